"""The GPU-speed targets, measured side by side and judged (python -m lab.tools.attention_targets).

The grid the targets are judged on: bfloat16, B=2, H=32 (as many kv heads), S = L ∈ {2048,
4096, 8192, 16384}, head_dim ∈ {64, 128}, causal and not, forward and forward + backward. At every
point the lab's compiled Pallas kernels (`pallas_mgpu` on Hopper, `pallas_gpu` everywhere;
block sizes from `tuned/`) run in one `bench.sweep` with their peers: cuDNN and XLA through
`jax.nn.dot_product_attention`, JAX's bundled Pallas kernels (Triton and Mosaic GPU), tokamax
and PyTorch's SDPA where installed. Each lab kernel that is in the run gets its own verdicts.

Targets, per point and lab kernel, from the medians of that one run:

- speed = reference time / kernel time ≥ 1.0 forward, ≥ 0.8 forward + backward, where the
  reference is cuDNN, or, where cuDNN does not run, the fastest of PyTorch SDPA, JAX's Mosaic
  GPU attention and tokamax at that point;
- ahead of JAX's bundled Pallas (Triton) attention and of XLA's attention, each where it
  ran: a peer that did not run at a point is named in the verdict's note, not counted.

The tool prints the verdict table and writes the records plus a Markdown block for BENCHMARKS.md
(date, device, versions, command) to `results/`. Needs an NVIDIA GPU: elsewhere the lab's
GPU kernel runs only through the interpreter, whose times say nothing.
"""

import dataclasses

from lab.measure.attention import TargetVerdict
from lab.studies import attention as bench

SEQS = (2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
OURS = ("pallas_mgpu", "pallas_gpu")  # the lab's kernels, each judged where it ran
IMPLS = (*OURS, "cudnn", "xla", "jax_pallas_triton", "jax_pallas_mgpu", "tokamax", "torch_sdpa")
FALLBACK_REFERENCES = ("torch_sdpa", "jax_pallas_mgpu", "tokamax")  # where cuDNN does not run
MUST_BEAT = ("jax_pallas_triton", "xla")
SPEED_TARGET = {"fwd": 1.0, "fwd+bwd": 0.8}


def judge(records: list[dict], head_dim: int) -> list[TargetVerdict]:
    """One verdict per (seq, causal, mode) and lab kernel of one head_dim's sweep records:
    every kernel of OURS the sweep included (pallas_gpu's, as 'not in this run', if none)."""
    points: dict[tuple, dict] = {}
    for r in bench.rows_of(records):
        points.setdefault((r.seq, r.causal, r.mode), {})[r.impl] = r
    present = {impl for by_impl in points.values() for impl in by_impl}
    ours = [k for k in OURS if k in present] or [OURS[-1]]
    return [v for k in ours for v in _judge_kernel(points, head_dim, k)]


def _judge_kernel(points: dict, head_dim: int, ours: str) -> list[TargetVerdict]:
    out = []
    for (seq, causal, mode), by_impl in sorted(points.items()):
        t = {i: r.time_s for i, r in by_impl.items() if r.ran}
        row = dict(
            kernel=ours,
            head_dim=head_dim,
            seq=seq,
            causal=causal,
            mode=mode,
            target=SPEED_TARGET[mode],
        )
        if ours not in t:
            why = by_impl[ours].skipped if ours in by_impl else None
            note = f"{ours} did not run: {why or 'not in this run'}"
            out.append(TargetVerdict(**row, met=False, note=note))
            continue
        fallback = [i for i in FALLBACK_REFERENCES if i in t]
        ref = "cudnn" if "cudnn" in t else min(fallback, key=t.get) if fallback else None
        beat = {p: t[ours] < t[p] for p in MUST_BEAT if p in t}
        notes = [f"behind {p}" for p, ok in beat.items() if not ok]
        notes += [f"{p} did not run" for p in MUST_BEAT if p not in t]
        notes += [] if ref else [f"no reference ran (cudnn, {', '.join(FALLBACK_REFERENCES)})"]
        v = TargetVerdict(
            **row,
            met=False,
            note="; ".join(notes),
            reference=ref,
            kernel_s=t[ours],
            reference_s=t[ref] if ref else None,
            kernel_tflops=by_impl[ours].tflops,
            reference_tflops=by_impl[ref].tflops if ref else None,
            ahead_of=tuple(sorted(p for p, ok in beat.items() if ok)),
        )
        met = v.speed is not None and v.speed >= SPEED_TARGET[mode] and all(beat.values())
        out.append(dataclasses.replace(v, met=met))
    return out


def run(
    head_dims=HEAD_DIMS, seqs=SEQS, *, budget_s: float = 0.3, progress=None
) -> tuple[list[dict], list[TargetVerdict]]:
    """(records, verdicts): one bench sweep per head_dim on the GPU-speed grid, judged."""
    impls = [i for i in IMPLS if i in bench.default_impls("gpu")]
    records, verdicts = [], []
    for d in head_dims:
        shape = bench.Shape(batch=2, heads=32, kv_heads=32, head_dim=d, dtype="bfloat16")
        recs = bench.sweep(
            tuple(seqs),
            impls=impls,
            shape=shape,
            budget_s=budget_s,
            baseline="cudnn",
            progress=progress,
        )
        records += recs
        verdicts += judge(recs, d)
    return records, verdicts

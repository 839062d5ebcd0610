"""`python -m lab.kernels.attention.targets`: the GPU-speed targets, measured side by side, judged.

The grid of the GPU-speed issue: bfloat16, B=2, H=32 (as many kv heads), S = L ∈ {2048, 4096,
8192, 16384}, head_dim ∈ {64, 128}, causal and not, forward and forward + backward. At every
point the lab's compiled Pallas kernel (`pallas_gpu`, block sizes from `tuned/`) runs in one
`bench.sweep` with its peers: cuDNN and XLA through `jax.nn.dot_product_attention`, JAX's
bundled Pallas kernels (Triton and Mosaic GPU) and PyTorch's SDPA where installed.

Targets, per point, from the medians of that one run:

- speed = reference time / pallas_gpu time ≥ 1.0 forward, ≥ 0.8 forward + backward, where the
  reference is cuDNN, or, where cuDNN does not run, the faster of PyTorch SDPA and JAX's Mosaic
  GPU attention at that point;
- ahead of JAX's bundled Pallas (Triton) attention and of XLA's attention.

Prints the verdict table and writes the records plus a Markdown block for BENCHMARKS.md
(date, device, versions, command) to `results/`. Needs an NVIDIA GPU: elsewhere the lab's
GPU kernel runs only through the interpreter, whose times say nothing.
"""

import argparse
import sys
import time
from pathlib import Path

import jax

from lab.kernels.attention import bench
from lab.measure import records as rec

SEQS = (2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
OURS = "pallas_gpu"
IMPLS = (OURS, "cudnn", "xla", "jax_pallas_triton", "jax_pallas_mgpu", "torch_sdpa")
FALLBACK_REFERENCES = ("torch_sdpa", "jax_pallas_mgpu")  # where cuDNN does not run
MUST_BEAT = ("jax_pallas_triton", "xla")
SPEED_TARGET = {"fwd": 1.0, "fwd+bwd": 0.8}


def judge(records: list[dict], head_dim: int) -> list[dict]:
    """One verdict per (seq, causal, mode) of one head_dim's sweep records."""
    points: dict[tuple, dict] = {}
    for r in bench.rows_of(records):
        key = (r["seq"], r["causal"], r["mode"])
        points.setdefault(key, {})[r["impl"]] = r
    out = []
    for (seq, causal, mode), by_impl in sorted(points.items()):
        t = {i: r["attention time"] for i, r in by_impl.items() if "attention time" in r}
        row = dict(head_dim=head_dim, seq=seq, causal=causal, mode=mode, target=SPEED_TARGET[mode])
        if OURS not in t:
            why = by_impl.get(OURS, {}).get("attention skipped", "not in this run")
            out.append({**row, "met": False, "note": f"{OURS} did not run: {why}"})
            continue
        fallback = [i for i in FALLBACK_REFERENCES if i in t]
        ref = "cudnn" if "cudnn" in t else min(fallback, key=t.get) if fallback else None
        beat = {p: t[OURS] < t[p] for p in MUST_BEAT if p in t}
        speed = t[ref] / t[OURS] if ref else None
        met = speed is not None and speed >= SPEED_TARGET[mode] and all(beat.values())
        notes = [f"behind {p}" for p, ok in beat.items() if not ok]
        notes += [f"{p} did not run" for p in MUST_BEAT if p not in t]
        notes += [] if ref else ["no reference ran (cudnn, torch_sdpa, jax_pallas_mgpu)"]
        out.append(
            {
                **row,
                "reference": ref,
                "speed": speed,
                "pallas_tflops": by_impl[OURS]["attention TFLOP/s"],
                "reference_tflops": by_impl[ref]["attention TFLOP/s"] if ref else None,
                "ahead_of": sorted(p for p, ok in beat.items() if ok),
                "met": met,
                "note": "; ".join(notes),
            }
        )
    return out


def markdown(verdicts: list[dict], env: dict, command: str) -> str:
    """A block to paste into BENCHMARKS.md: what ran where, and every point's verdict."""
    met = sum(v["met"] for v in verdicts)
    lines = [
        f"### Flash attention targets — `{command}`",
        "",
        f"{time.strftime('%Y-%m-%d')}, {env['device_kind']} × {env['device_count']}, "
        f"jax {env['jax_version']}, jaxlib {env['jaxlib_version']}. bf16, B=2, H=32. "
        f"Speed = reference time / pallas_gpu time (median of alternated calls). "
        f"**{met} of {len(verdicts)} points meet their target.**",
        "",
        "| D | L=S | causal | mode | reference | speed | target | pallas TFLOP/s | "
        "ref TFLOP/s | ahead of | met | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        speed = f"{v['speed']:.2f}×" if v.get("speed") else "–"
        tf = f"{v['pallas_tflops']:.0f}" if v.get("pallas_tflops") else "–"
        ref_tf = f"{v['reference_tflops']:.0f}" if v.get("reference_tflops") else "–"
        lines.append(
            f"| {v['head_dim']} | {v['seq']} | {'yes' if v['causal'] else 'no'} | {v['mode']} | "
            f"{v.get('reference') or '–'} | {speed} | ≥ {v['target']}× | {tf} | {ref_tf} | "
            f"{', '.join(v.get('ahead_of', [])) or '–'} | {'yes' if v['met'] else 'no'} | "
            f"{v['note']} |"
        )
    return "\n".join(lines) + "\n"


def verdict_table(verdicts: list[dict]):
    from rich.table import Table

    t = Table(title="pallas_gpu against the GPU-speed targets")
    for col in ("D", "L=S", "causal", "mode", "reference", "speed", "target", "met", "note"):
        t.add_column(col, justify="right")
    for v in verdicts:
        t.add_row(
            str(v["head_dim"]),
            str(v["seq"]),
            "yes" if v["causal"] else "no",
            v["mode"],
            v.get("reference") or "–",
            f"{v['speed']:.2f}x" if v.get("speed") else "–",
            f">= {v['target']}x",
            "[green]yes" if v["met"] else "[red]no",
            v["note"],
        )
    return t


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m lab.kernels.attention.targets", description=__doc__.split("\n")[0]
    )
    p.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
    p.add_argument("--seqs", type=int, nargs="+", default=list(SEQS))
    p.add_argument("--budget", type=float, default=0.3, help="seconds of timed runs per impl")
    p.add_argument("--out", default="results", help="folder for the records and the Markdown")
    return p


def main(argv=None) -> int:
    from rich.console import Console

    parser = _parser()
    args = parser.parse_args(argv)
    if min(args.seqs + args.head_dims) < 1:
        parser.error("--seqs and --head-dims must be positive")
    if jax.default_backend() != "gpu":
        parser.error(
            f"the targets compare compiled GPU kernels; this backend is {jax.default_backend()}"
            " (run on an NVIDIA GPU; on CPU, python -m lab.kernels.attention.bench)"
        )
    console = Console(width=160)
    impls = [i for i in IMPLS if i in bench.default_impls("gpu")]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out)
    verdicts = []
    for d in args.head_dims:
        shape = bench.Shape(batch=2, heads=32, kv_heads=32, head_dim=d, dtype="bfloat16")
        records = bench.sweep(
            tuple(args.seqs),
            impls=impls,
            shape=shape,
            budget_s=args.budget,
            baseline="cudnn",
            progress=console.log,
        )
        rec.write_records(out / f"attention-targets-{stamp}.jsonl", records)
        console.print(bench.table(records, f"D={d}"))
        verdicts += judge(records, d)
    console.print(verdict_table(verdicts))
    command = "python -m lab.kernels.attention.targets " + " ".join(sys.argv[1:])
    md = out / f"attention-targets-{stamp}.md"
    md.write_text(markdown(verdicts, rec.environment(), command.strip()))
    console.print(f"records and Markdown → {out}/attention-targets-{stamp}.*")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

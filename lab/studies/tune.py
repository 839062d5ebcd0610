"""A recorded search for the Pallas GPU kernels' tiles (`python -m lab.tools.attention_tune`).

Why a search: tile sizes, warps and pipeline depth trade registers, shared memory and
occupancy against each other, and the best choice moves with the GPU, the head_dim and the
dtype. A table typed in from a blog post is a guess; this one is measured on the GPU it is for.

How. Three stages, each scored on the same shapes (B×H heads, every seq, causal and not):

1. forward: every (block_q, block_k, num_warps, num_stages) of the space, forward only;
2. backward: every dQ/dK/dV tiling and launch of the space on top of the chosen forward,
   forward + backward;
3. variant: `split_mask` on and off for the chosen tiles, forward + backward.

Per shape, all candidates of a stage and the library baseline (`cudnn` where it runs, else
`xla`) are compiled, checked against the float64 reference on the last rows (bf16 ≈ 2e-2) and
timed alternately in one `lab.measure.timing.compare` call. A candidate's score is the
geometric mean over the shapes of its time / the baseline's: below 1 beats the library. One
that Triton refuses (shared memory, registers) or that misses the tolerance is recorded with
its reason and never chosen.

The Mosaic GPU kernel (`kernel=pallas_mgpu`, Hopper) has two stages, forward and backward:
its space is the streamed tile (block_k of the forward, the key tile of dQ and the query tile of
dK/dV), the pipeline depth (shared-memory slots the TMA producer runs ahead by: `max_stages`
in the forward, `max_stages_bwd` in the backward kernels, so that each stage tunes its own
kernels) and the compute warpgroups per CTA; each warpgroup's own tile stays 64 rows (one wgmma M).

Output: every candidate's records in `results/tune-<backend>-<time>.jsonl`, a table per stage,
and with `write=true` the winner per head_dim in `tuned/<gpu>.json` (`tuned/<gpu>-mgpu.json`
for the Mosaic kernel) beside the kernel, which `pallas_gpu` (`pallas_mgpu`) loads at import.
`interpret=true` runs the same search through the Pallas interpreter (the GPU interpreter for
the Mosaic kernel, jax >= 0.11) on tiny shapes, for the tests: its times say nothing, so
`write=true` refuses it.
"""

import dataclasses
import functools
import json
import math
import re
import sys
import time
from pathlib import Path

import jax

from lab.kernels.attention import pallas_gpu, pallas_mgpu
from lab.measure import records as rec
from lab.measure.timing import comparison
from lab.measure.tuning import KernelUse, Stage, StaticCandidate, StaticPass, TileSearch
from lab.studies import attention as bench

TOL = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4}  # max error vs float64, relative

# Search spaces: each entry overrides fields of the stage's starting BlockSizes.
FWD_SPACE = {
    "full": [
        dict(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
        for bq in (64, 128)
        for bk in (32, 64, 128)
        for w in (4, 8)
        for st in (2, 3)
    ],
    "quick": [
        dict(block_q=bq, block_k=bk, num_warps=w, num_stages=2)
        for bq, bk in ((64, 64), (128, 64))
        for w in (4, 8)
    ],
}


def _bwd(a: int, b: int, w: int, st: int) -> dict:
    """dQ: programs of `a` query rows looping over `b` keys; dK/dV: `a` keys over `b` rows."""
    return dict(
        block_q_dq=a,
        block_k_dq=b,
        block_q_dkv=b,
        block_k_dkv=a,
        num_warps_bwd=w,
        num_stages_bwd=st,
    )


BWD_SPACE = {
    "full": [
        _bwd(a, b, w, st)
        for a, b in ((64, 32), (64, 64), (128, 32), (128, 64))
        for w in (4, 8)
        for st in (2, 3)
    ],
    "quick": [_bwd(a, b, 4, 2) for a, b in ((64, 32), (64, 64), (128, 64))],
}
VARIANT_SPACE = [dict(split_mask=True), dict(split_mask=False)]
INTERPRET_SPACE = {  # tiny tiles for the interpreter (tests): the machinery, not the speed
    "fwd": [dict(block_q=16, block_k=16), dict(block_q=32, block_k=16)],
    "bwd": [_bwd(16, 16, 4, 2), _bwd(32, 16, 4, 2)],
    "variant": VARIANT_SPACE,
}

# The Mosaic GPU kernel: streamed tiles, pipeline depth, compute warpgroups. Each warpgroup's
# own tile is one wgmma M (64 rows); shared memory grows with block_k x stages (D=128: 2 stages
# of 128-key tiles fit the forward, 3 do not), which the static pass checks per candidate.
MGPU_FWD_SPACE = {
    "full": [
        dict(block_k=bk, max_stages=st, compute_wgs=w)
        for bk in (64, 128, 192, 256)
        for st in (2, 3, 4)
        for w in (1, 2)
    ],
    "quick": [dict(block_k=bk, max_stages=st) for bk in (64, 128) for st in (2, 3)],
}


def _mgpu_bwd(b: int, st: int) -> dict:
    """dQ: key tiles of `b` streamed past 64-row query tiles; dK/dV: query tiles of `b`."""
    return dict(block_k_dq=b, block_q_dkv=b, max_stages_bwd=st)


MGPU_BWD_SPACE = {
    "full": [_mgpu_bwd(b, st) for b in (64, 128) for st in (2, 3, 4)],
    "quick": [_mgpu_bwd(b, st) for b in (64, 128) for st in (2, 3)],
}
MGPU_INTERPRET_SPACE = {  # GPU interpreter (jax >= 0.11, tests): the machinery, not the speed
    "fwd": [dict(block_k=64), dict(block_k=128)],
    "bwd": [_mgpu_bwd(64, 2), _mgpu_bwd(64, 1)],
}
KERNELS = ("pallas_gpu", "pallas_mgpu")

# What a case holds beyond the inputs, gradients and float64 reference, measured as the peak
# RSS (VmHWM) of interpret=true searches (B=1 H=2 G=1 K=16 float32) at L=1,024, 2,048, 4,096:
# 575, 702, 1,249 MiB on jax 0.12 and 721, 941, 1,873 on jax 0.10, about 340 after the
# imports. The growth is quadratic: 6.1 (0.12) and 10.3 (0.10) float32 L×L arrays per
# (batch, head), the xla baseline's scores, probabilities and their gradients in its fwd+bwd,
# and a constant 0.16-0.33 GiB above the imports (the compiler, the runtime). The estimate
# counts 13 arrays and 0.5 GiB: a quarter over the larger of each.
XLA_SCORE_COPIES = 13
RUNTIME_BYTES = 2**29


def spaces(kernel: str, space: str, interpret: bool) -> dict:
    """stage -> candidate overrides, in the order the search runs them."""
    if kernel == "pallas_mgpu":
        if interpret:
            return MGPU_INTERPRET_SPACE
        return {"fwd": MGPU_FWD_SPACE[space], "bwd": MGPU_BWD_SPACE[space]}
    if interpret:
        return INTERPRET_SPACE
    return {"fwd": FWD_SPACE[space], "bwd": BWD_SPACE[space], "variant": VARIANT_SPACE}


def default_block_sizes(kernel: str, head_dim: int):
    """Where a search starts: the kernel's untuned default for this head_dim."""
    if kernel == "pallas_mgpu":
        return pallas_mgpu.BLOCK_SIZES[head_dim]
    return pallas_gpu.BlockSizes()


@dataclasses.dataclass(frozen=True)
class Search:
    """What one search scores candidates on."""

    head_dim: int
    seqs: tuple[int, ...] = (4096, 16384)
    causal: tuple[bool, ...] = (True, False)
    batch: int = 2
    heads: int = 32
    kv_heads: int = 32
    dtype: str = "bfloat16"
    interpret: bool = False
    # Compile every candidate first and drop those that spill registers or overflow shared
    # memory, before anything is timed: "" off, "here" the GPU present, or a plan target
    # ("gpu:h100:1": compiled deviceless, lab/plans).
    static: str = ""
    kernel: str = "pallas_gpu"  # or pallas_mgpu (Mosaic GPU, Hopper)

    @property
    def shape(self) -> bench.Shape:
        return bench.Shape(self.batch, self.heads, self.kv_heads, self.head_dim, self.dtype)

    def held_bytes(self, seq: int) -> int:
        """Host or device bytes one case of the search holds at length `seq` (checked before
        anything is allocated): the inputs, gradients and float64 reference
        (`Shape.held_bytes`), the xla baseline's L×L scores where it is the baseline
        (`XLA_SCORE_COPIES`), and the compiler's and runtime's own (`RUNTIME_BYTES`)."""
        copies = 0 if self.cudnn_possible else XLA_SCORE_COPIES
        return self.shape.held_bytes(seq, copies) + RUNTIME_BYTES

    @property
    def cudnn_possible(self) -> bool:
        """Whether `baseline_impl` may choose cuDNN (on a GPU, for 16-bit inputs): without
        it, the baseline is xla."""
        return jax.default_backend() == "gpu" and self.dtype in ("bfloat16", "float16")

    def cases(self):
        return [(seq, c) for seq in self.seqs for c in self.causal]


def _kernel_program(bs, causal: bool, mode: str, interpret: bool):
    """The timed program of one candidate; the kernel is the one `bs` belongs to."""
    mgpu = isinstance(bs, pallas_mgpu.BlockSizes)
    kernel = pallas_mgpu.flash_attention_mgpu if mgpu else pallas_gpu.flash_attention_gpu
    op = functools.partial(kernel, causal=causal, block_sizes=bs, interpret=interpret)
    return bench.program(op, mode)


def static_kernels(bs, search: Search, causal: bool, mode: str) -> list:
    """The candidate's kernels (lab.plans.resources.Kernel) as the compiler builds them for
    `search.static`'s GPU, at the search's shape; nothing runs."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from lab import plans

    B, H, G, K = search.batch, search.heads, search.kv_heads, search.head_dim
    L, dtype = min(search.seqs), jax.numpy.dtype(search.dtype)
    program = _kernel_program(bs, causal, mode, interpret=False)
    if search.static == "here":
        devices = jax.devices()[:1]
    else:
        plans.prepare_host(search.static)
        devices = plans.topology_devices(search.static)[:1]
    mesh = jax.sharding.Mesh(devices, ("data",))
    sh = NamedSharding(mesh, P())
    args = [jax.ShapeDtypeStruct(s, dtype, sharding=sh) for s in
            ((B, L, H, K), (B, L, G, K), (B, L, G, K), (B, L, H, K))]  # fmt: skip

    def lower():
        with jax.sharding.set_mesh(mesh):
            return jax.jit(program).lower(*args)

    kind = plans.gpu_kind(devices) or plans.gpu_kind_of(devices[0].device_kind)
    return plans.resources.compile_with_kernels(lower, kind)[1]


def static_reason(kernels, smem_limit: int) -> str | None:
    """Why a candidate is dropped before timing (spills, shared memory), or None."""
    for k in kernels:
        if k.spill_bytes:
            return f"spills {k.spill_bytes} B in {k.name} ({k.registers} registers)"
        if k.smem > smem_limit:
            return f"{k.name} needs {k.smem} B of shared memory > {smem_limit}"
    return None


def static_filter(candidates, search: Search, mode: str, log=None, progress=None) -> StaticPass:
    """Every candidate compiled for `search.static`'s GPU (compiled, not run): each kernel's
    registers, spills and shared memory, and which candidates are dropped and why. Nothing is
    compiled when the static pass is off. `log(line)` is told each drop (for a caller that
    shows no table of the pass); `progress(label)` is called before each candidate."""
    from lab import plans

    out = []
    if not search.static:
        return StaticPass(search.static, mode, ())
    for i, bs in enumerate(candidates):
        if progress:
            progress(f"candidate {i + 1}/{len(candidates)}")
        uses, reason = [], None
        for causal in search.causal:
            try:
                kernels = static_kernels(bs, search, causal, mode)
            except Exception as e:  # noqa: BLE001 — Triton's refusals (smem, shapes) vary
                reason = f"does not compile for {search.static}: {_first_line(e)}"
                break
            kind = plans.gpu_kind_of(kernels_device(search))
            limit = plans.gpu.GPUS[kind].smem_per_block if kind else 1 << 62
            uses += [
                KernelUse(causal, k.name, k.registers, k.spill_bytes, k.smem, k.blocks_per_sm)
                for k in kernels
            ]
            reason = static_reason(kernels, limit)
            if reason:
                break
        out.append(StaticCandidate(bs, tuple(uses), reason))
        if log and reason:
            log(f"static pass: candidate {i} dropped: {reason}")
    return StaticPass(search.static, mode, tuple(out))


def kernels_device(search: Search) -> str:
    """The device kind the static pass compiles for."""
    from lab import plans

    if search.static == "here":
        return jax.devices()[0].device_kind
    return plans.gpu.GPUS[plans.gpu.parse_target(search.static)[0]].device_kind


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:120]


def _compile_checked(program, args, ref_rows, want, tol: float):
    """(compiled, None) or (None, reason): Triton refused it, or it is not accurate."""
    try:
        compiled = jax.jit(program).lower(*args).compile()
        err = bench.max_error(compiled(*args), ref_rows, want)
    except Exception as e:  # noqa: BLE001 — Triton's refusals come in many types
        return None, f"does not compile or run: {_first_line(e)}"
    if not err < tol:
        return None, f"max error {err:.1e} >= {tol:.0e}"
    return compiled, None


def baseline_impl(search: Search) -> str:
    """cudnn where this GPU runs it for these inputs, else xla (CPU, interpret, f32)."""
    if not search.cudnn_possible:
        return "xla"
    args = search.shape.arrays(search.seqs[0])
    try:
        jax.jit(bench.impl_program("cudnn", True, "fwd")).lower(*args).compile()
        return "cudnn"
    except Exception:  # noqa: BLE001 — cuDNN missing, too old, or refusing this shape
        return "xla"


def run_stage(
    stage: str, candidates, search: Search, mode: str, baseline: str, timing, log=None
) -> tuple[list[dict], Stage]:
    """Score every candidate (a BlockSizes) on every case: the records, and the Stage with
    every score and the best index. With `search.static`, candidates that spill or overflow
    shared memory are dropped first."""
    out, ratios = [], {i: [] for i in range(len(candidates))}
    lows, highs = {i: [] for i in range(len(candidates))}, {i: [] for i in range(len(candidates))}
    static = static_filter(candidates, search, mode, log)
    dropped = static.dropped
    out += static.records(stage=stage)  # the dropped ones' reasons among them
    for i in dropped:
        ratios[i].append(math.inf)
    for seq, causal in search.cases():
        if log:
            mask = "yes" if causal else "no"
            log(f"{stage}: {len(candidates)} candidates, L=S={seq} causal={mask} {mode}")
        args = search.shape.arrays(seq, seed=seq + causal)
        ref_rows, want = bench.reference_rows(*args, causal=causal, mode=mode)
        config = dict(
            op="attention tune",
            stage=stage,
            seq=seq,
            causal=causal,
            mode=mode,
            baseline=baseline,
            interpret=search.interpret,
            **dataclasses.asdict(search.shape),
        )
        runnable = {}
        for i, bs in enumerate(candidates):
            if i in dropped:
                continue
            program = _kernel_program(bs, causal, mode, search.interpret)
            compiled, reason = _compile_checked(program, args, ref_rows, want, TOL[search.dtype])
            if compiled is None:
                ratios[i].append(math.inf)
                cand = dataclasses.asdict(bs)
                out.append(
                    rec.make_record("tune rejected", reason, "reason", candidate=cand, **config)
                )
            else:
                runnable[str(i)] = compiled
        if not runnable:
            continue
        runnable["baseline"] = jax.jit(bench.impl_program(baseline, causal, mode))
        times = comparison(runnable, *args, baseline="baseline", **timing)
        for t in times.contenders:
            if t.name == "baseline":
                continue
            i = int(t.name)
            ratios[i].append(t.ratio)
            lows[i].append(t.bench.p10_s / t.baseline_median_s)
            highs[i].append(t.bench.p90_s / t.baseline_median_s)
            cand = dataclasses.asdict(candidates[i])
            timed = {k: getattr(t.bench, k) for k in ("median_s", "p10_s", "p90_s", "runs")}
            out.append(
                rec.make_record(
                    "tune time ratio vs baseline",
                    t.ratio,
                    "x",
                    label="derived",
                    candidate=cand,
                    baseline_median_s=t.baseline_median_s,
                    **timed,
                    **config,
                )
            )
    scores = tuple(_geomean(ratios[i]) for i in range(len(candidates)))
    best = min(range(len(candidates)), key=lambda i: scores[i])
    spans = tuple(
        (_geomean(lows[i]), _geomean(highs[i])) if math.isfinite(scores[i]) else None
        for i in range(len(candidates))
    )
    done = Stage(stage, mode, tuple(candidates), scores, best, spans)
    if math.isfinite(done.best_score):
        out.append(done.record(baseline=baseline, interpret=search.interpret))
    return out, done


def _geomean(xs) -> float:
    if not xs or any(not math.isfinite(x) for x in xs):
        return math.inf
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def search_block_sizes(search: Search, space: str = "full", *, budget_s=0.2, log=None):
    """The staged search for one head_dim: (best BlockSizes, records, the TileSearch)."""
    todo = spaces(search.kernel, space, search.interpret)
    baseline = baseline_impl(search)
    timing = dict(budget_s=budget_s, min_runs=3, warmup=1)
    best, records, stages = default_block_sizes(search.kernel, search.head_dim), [], []
    for stage, overrides in todo.items():
        mode = "fwd" if stage == "fwd" else "fwd+bwd"
        candidates = [dataclasses.replace(best, **o) for o in overrides]
        recs, done = run_stage(stage, candidates, search, mode, baseline, timing, log)
        records += recs
        stages.append(done)
        if not math.isfinite(done.best_score):
            raise RuntimeError(f"stage {stage}: no candidate compiled and matched the reference")
        best = done.chosen
    return best, records, TileSearch(baseline, tuple(stages))


# ---------------------------------------------------------------------------- the table


def table_path(device_kind: str, folder: Path = pallas_gpu.TUNED_DIR, kernel="pallas_gpu"):
    slug = re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-")
    return folder / (slug + ("-mgpu" if kernel == "pallas_mgpu" else "") + ".json")


def write_entry(device_kind: str, search: Search, best, summary: TileSearch, folder=None) -> Path:
    """Merge this head_dim's winner and its search into the GPU's table file (one per kernel;
    the Mosaic kernel's entries say `kernel: pallas_mgpu`)."""
    path = table_path(device_kind, folder or pallas_gpu.TUNED_DIR, search.kernel)
    entry = json.loads(path.read_text()) if path.exists() else {"device_kind": device_kind}
    if search.kernel != "pallas_gpu":
        entry["kernel"] = search.kernel
    entry.setdefault("by_head_dim", {})[str(search.head_dim)] = dataclasses.asdict(best)
    entry.setdefault("search", {})[str(search.head_dim)] = {
        "score_vs_baseline": summary.best_score,
        "baseline": summary.baseline,
        "shapes": dataclasses.asdict(search),
        "candidates": summary.candidates,
        "date": time.strftime("%Y-%m-%d"),
        "versions": {k: v for k, v in rec.environment().items() if k.endswith("_version")},
        "command": "python -m lab.tools.attention_tune " + " ".join(sys.argv[1:]),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entry, indent=2) + "\n")
    return path

"""`python -m lab.kernels.attention.tune`: a recorded search for the Pallas GPU kernel's tiles.

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

Output: every candidate's records in `results/tune-<backend>-<time>.jsonl`, a table per stage,
and with `--write` the winner per head_dim in `tuned/<gpu>.json` beside the kernel, which
`pallas_gpu` loads at import. `--interpret` runs the same search through the Pallas
interpreter on tiny shapes, for the tests: its times say nothing, so `--write` refuses it.
"""

import argparse
import dataclasses
import functools
import json
import math
import re
import sys
import time
from pathlib import Path

import jax

from lab.kernels.attention import bench, pallas_gpu
from lab.measure import records as rec
from lab.measure.timing import compare

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

    @property
    def shape(self) -> bench.Shape:
        return bench.Shape(self.batch, self.heads, self.kv_heads, self.head_dim, self.dtype)

    def cases(self):
        return [(seq, c) for seq in self.seqs for c in self.causal]


def _kernel_program(bs: pallas_gpu.BlockSizes, causal: bool, mode: str, interpret: bool):
    op = functools.partial(
        pallas_gpu.flash_attention_gpu, causal=causal, block_sizes=bs, interpret=interpret
    )
    return bench.program(op, mode)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:120]


def _compile_checked(program, args, ref_rows, want, tol: float):
    """(compiled, None) or (None, reason): Triton refused it, or it is not accurate."""
    try:
        compiled = jax.jit(program).lower(*args).compile()
        err = bench._max_error(compiled(*args), ref_rows, want)
    except Exception as e:  # noqa: BLE001 — Triton's refusals come in many types
        return None, f"does not compile or run: {_first_line(e)}"
    if not err < tol:
        return None, f"max error {err:.1e} >= {tol:.0e}"
    return compiled, None


def baseline_impl(search: Search) -> str:
    """cudnn where this GPU runs it for these inputs, else xla (CPU, interpret, f32)."""
    if jax.default_backend() != "gpu" or search.dtype not in ("bfloat16", "float16"):
        return "xla"
    args = search.shape.arrays(search.seqs[0])
    try:
        jax.jit(bench._program("cudnn", True, "fwd")).lower(*args).compile()
        return "cudnn"
    except Exception:  # noqa: BLE001 — cuDNN missing, too old, or refusing this shape
        return "xla"


def run_stage(stage, candidates, search: Search, mode: str, baseline: str, timing, log=None):
    """Score every candidate (a BlockSizes) on every case; records and the best index."""
    out, ratios = [], {i: [] for i in range(len(candidates))}
    for seq, causal in search.cases():
        if log:
            log(f"{stage}: {len(candidates)} candidates, L=S={seq} causal={causal} {mode}")
        args = search.shape.arrays(seq, seed=seq + causal)
        ref_rows, want = bench._reference_rows(*args, causal=causal, mode=mode)
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
        runnable["baseline"] = jax.jit(bench._program(baseline, causal, mode))
        times = compare(runnable, *args, baseline="baseline", **timing)
        for name, t in times.items():
            if name == "baseline":
                continue
            i = int(name)
            ratios[i].append(t["ratio"])
            cand = dataclasses.asdict(candidates[i])
            timed = {k: t[k] for k in ("median_s", "p10_s", "p90_s", "runs")}
            out.append(
                rec.make_record(
                    "tune time ratio vs baseline",
                    t["ratio"],
                    "x",
                    label="derived",
                    candidate=cand,
                    baseline_median_s=times["baseline"]["median_s"],
                    **timed,
                    **config,
                )
            )
    scores = [_geomean(ratios[i]) for i in range(len(candidates))]
    best = min(range(len(candidates)), key=lambda i: scores[i])
    return out, scores, best


def _geomean(xs) -> float:
    if not xs or any(not math.isfinite(x) for x in xs):
        return math.inf
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def search_block_sizes(search: Search, space: str = "full", *, budget_s=0.2, log=None):
    """The staged search for one head_dim: (best BlockSizes, records, per-stage summaries)."""
    spaces = (
        INTERPRET_SPACE
        if search.interpret
        else {"fwd": FWD_SPACE[space], "bwd": BWD_SPACE[space], "variant": VARIANT_SPACE}
    )
    baseline = baseline_impl(search)
    timing = dict(budget_s=budget_s, min_runs=3, warmup=1)
    best, records, stages = pallas_gpu.BlockSizes(), [], []
    for stage, mode in (("fwd", "fwd"), ("bwd", "fwd+bwd"), ("variant", "fwd+bwd")):
        candidates = [dataclasses.replace(best, **o) for o in spaces[stage]]
        recs, scores, i = run_stage(stage, candidates, search, mode, baseline, timing, log)
        records += recs
        stages.append(dict(stage=stage, mode=mode, candidates=candidates, scores=scores, best=i))
        if not math.isfinite(scores[i]):
            raise RuntimeError(f"stage {stage}: no candidate compiled and matched the reference")
        best = candidates[i]
    return best, records, dict(baseline=baseline, stages=stages)


# ---------------------------------------------------------------------------- the table


def table_path(device_kind: str, folder: Path = pallas_gpu.TUNED_DIR) -> Path:
    return folder / (re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") + ".json")


def write_entry(device_kind: str, search: Search, best, summary: dict, folder=None) -> Path:
    """Merge this head_dim's winner and its search into the GPU's table file."""
    path = table_path(device_kind, folder or pallas_gpu.TUNED_DIR)
    entry = json.loads(path.read_text()) if path.exists() else {"device_kind": device_kind}
    entry.setdefault("by_head_dim", {})[str(search.head_dim)] = dataclasses.asdict(best)
    final = summary["stages"][-1]
    entry.setdefault("search", {})[str(search.head_dim)] = {
        "score_vs_baseline": final["scores"][final["best"]],
        "baseline": summary["baseline"],
        "shapes": dataclasses.asdict(search),
        "candidates": sum(len(s["candidates"]) for s in summary["stages"]),
        "date": time.strftime("%Y-%m-%d"),
        "versions": {k: v for k, v in rec.environment().items() if k.endswith("_version")},
        "command": "python -m lab.kernels.attention.tune " + " ".join(sys.argv[1:]),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entry, indent=2) + "\n")
    return path


def stage_table(summary_stage: dict, baseline: str):
    from rich.table import Table

    s = summary_stage
    t = Table(title=f"stage {s['stage']} ({s['mode']}): geometric-mean time / {baseline}")
    fields = sorted(
        {k for c in s["candidates"] for k, v in dataclasses.asdict(c).items()}
        - _constant_fields(s["candidates"])
    )
    for col in (*fields, f"vs {baseline}", ""):
        t.add_column(col, justify="right")
    order = sorted(range(len(s["candidates"])), key=lambda i: s["scores"][i])
    for i in order:
        c = dataclasses.asdict(s["candidates"][i])
        score = s["scores"][i]
        t.add_row(
            *(str(c[f]) for f in fields),
            f"{score:.3f}x" if math.isfinite(score) else "rejected",
            "← chosen" if i == s["best"] else "",
        )
    return t


def _constant_fields(candidates) -> set[str]:
    rows = [dataclasses.asdict(c) for c in candidates]
    return {k for k in rows[0] if len({r[k] for r in rows}) == 1} if len(rows) > 1 else set()


# ---------------------------------------------------------------------------- entry point


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m lab.kernels.attention.tune", description=__doc__.split("\n")[0]
    )
    p.add_argument("--head-dims", type=int, nargs="+", help="default 64 128 (interpret: 16)")
    p.add_argument("--seqs", type=int, nargs="+", help="default 4096 16384 (interpret: 40)")
    p.add_argument("--batch", type=int, help="default 2 (interpret: 1)")
    p.add_argument("--heads", type=int, help="default 32 (interpret: 2)")
    p.add_argument("--kv-heads", type=int, help="default: as many as --heads (interpret: 1)")
    p.add_argument("--dtype", help="default bfloat16 (interpret: float32)", choices=sorted(TOL))
    p.add_argument("--space", default="full", choices=sorted(FWD_SPACE))
    p.add_argument("--budget", type=float, default=0.2, help="seconds of timed runs per impl")
    p.add_argument("--interpret", action="store_true", help="Pallas interpreter, tiny shapes")
    p.add_argument("--write", action="store_true", help="store the winners in tuned/<gpu>.json")
    p.add_argument("--out", default="results", help="folder for the records")
    return p


def _defaults(args) -> None:
    """The issue's GPU shapes, or tiny ones for the interpreter (which takes minutes per
    candidate at GPU sizes)."""
    tiny = args.interpret
    pick = lambda value, gpu, interp: value if value is not None else (interp if tiny else gpu)
    args.head_dims = pick(args.head_dims, [64, 128], [16])
    args.seqs = pick(args.seqs, list(Search.seqs), [40])
    args.batch = pick(args.batch, 2, 1)
    args.heads = pick(args.heads, 32, 2)
    args.kv_heads = pick(args.kv_heads, args.heads, 1)
    args.dtype = pick(args.dtype, "bfloat16", "float32")


def _check_args(parser, args) -> None:
    backend = jax.default_backend()
    if args.write and args.interpret:
        parser.error("--write stores measured winners; interpret-mode times measure nothing")
    if backend != "gpu" and not args.interpret:
        parser.error(
            f"the Pallas GPU kernel compiles only on a GPU (this backend: {backend}); "
            "--interpret runs the search's machinery on tiny shapes"
        )
    for d in args.head_dims:
        if d not in pallas_gpu.HEAD_DIMS:
            parser.error(f"--head-dims {d}: the kernel takes head_dim in {pallas_gpu.HEAD_DIMS}")
    for name in ("seqs", "batch", "heads", "kv_heads"):
        value = getattr(args, name)
        if value is not None and min(value if isinstance(value, list) else [value]) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")


def main(argv=None) -> int:
    from rich.console import Console

    parser = _parser()
    args = parser.parse_args(argv)
    _defaults(args)
    _check_args(parser, args)
    console = Console(width=150)
    kind = jax.devices()[0].device_kind
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) / f"tune-{jax.default_backend()}-{stamp}.jsonl"
    for head_dim in args.head_dims:
        search = Search(
            head_dim=head_dim,
            seqs=tuple(args.seqs),
            batch=args.batch,
            heads=args.heads,
            kv_heads=args.kv_heads,
            dtype=args.dtype,
            interpret=args.interpret,
        )
        t0 = time.perf_counter()
        try:
            best, records, summary = search_block_sizes(
                search, args.space, budget_s=args.budget, log=console.log
            )
        except RuntimeError as e:
            print(f"error: head_dim {head_dim}: {e}", file=sys.stderr)
            return 1
        rec.write_records(out, records)
        for s in summary["stages"]:
            console.print(stage_table(s, summary["baseline"]))
        console.print(f"head_dim {head_dim}: {best} ({time.perf_counter() - t0:.0f} s)")
        if args.write:
            console.print(f"table → {write_entry(kind, search, best, summary)}")
    console.print(f"records → {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

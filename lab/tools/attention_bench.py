"""`python -m lab.tools.attention_bench`: every attention implementation over sequence lengths.

Time (median of alternated calls), TFLOP/s, compiled peak memory, error against float64 and
the ratio to a baseline, for L = S from 512 to 16384 (CPU; to 32k on GPU), causal and not,
forward and forward + backward; a table, records and a PNG. See lab/studies/attention.py for
the method. quick=true: L = 256 and 512 with a short budget. window=W, docs=N and softcap=C
time a causal sliding window, packed documents and soft-capped logits through the same
dispatch call (an implementation that cannot take them is listed with the reason).
"""

import dataclasses
import sys
import time

import jax

from lab import startup
from lab.config import cli, field, given_options
from lab.errors import ConfigError
from lab.measure import memory
from lab.measure import records as rec
from lab.names import DTYPES
from lab.report import plots, progress, tables
from lab.report.format import duration
from lab.studies import attention as study

# Wall seconds per timed second on CPU where samples are short: each waits CPU_SETTLE_S first.
_WALL_PER_BUDGET = round((study.SAMPLE_S + study.CPU_SETTLE_S) / study.SAMPLE_S)


@dataclasses.dataclass(frozen=True)
class Options:
    quick: bool = field(
        False,
        f"seqs {','.join(map(str, study.QUICK_SEQS))}, a 0.2 s budget (seqs= and budget= given "
        "win)",
    )
    seqs: tuple = field(
        (), "sequence lengths, e.g. 1024,4096 (default per backend)", kind="ints", min=1
    )
    causal: str = field(
        "both",
        "causal masks to run: both, yes (true: causal only) or no (false: full only)",
        choices=("both", "yes", "no", "true", "false"),
    )
    modes: tuple = field(study.MODES, "fwd and/or fwd+bwd", kind="names", choices=study.MODES)
    impls: tuple = field(
        (),
        "implementations (default: all compiled here: naive, blockwise, xla, and cpu_flash "
        "on CPU, the Pallas kernels on GPU and TPU, torch_sdpa and tokamax where installed)",
        kind="names",
    )
    baseline: str = field(study.BASELINE, "ratios against this implementation")
    inner: int = field(
        0,
        "calls per timed sample; 0 = about 2 ms a sample (at most 10,000: every impl's "
        "sample must end)",
        min=0,
        max=10_000,
    )
    batch: int = field(1, "B", min=1)
    heads: int = field(2, "H, query heads", min=1)
    kv_heads: int = field(1, "G, key/value heads (must divide heads)", min=1)
    head_dim: int = field(64, "K", min=1)
    dtype: str = field("auto", "auto = bfloat16 on GPU/TPU, float32 on CPU", kind="dtype")
    budget: float = field(
        1.0,
        "seconds of timed samples per implementation and point (seq, causal, mode). Wall time "
        f"is more: on CPU each sample (about {study.SAMPLE_S * 1e3:g} ms, or one call where "
        f"longer) waits {study.CPU_SETTLE_S * 1e3:g} ms untimed first, so a point takes up to "
        f"about {_WALL_PER_BUDGET:g}x budget per implementation, plus compiles and the float64 "
        "check",
        min=0.01,
    )
    window: int = field(
        0,
        "causal sliding window: a query sees itself and the window-1 keys before it, as lab.run's "
        "window= (attention's window=(W-1, 0)); needs causal=yes; 0 = none",
        min=0,
        max=2**31,  # the kernels count its W-1 keys in int32
    )
    docs: int = field(
        0,
        "packed documents of this many tokens each (segment ids, causal within a document); "
        "must divide every seq; needs causal=yes; 0 = none",
        min=0,
    )
    softcap: float = field(
        0.0,
        "logit soft-cap: scaled scores s -> softcap·tanh(s/softcap), as lab.run's softcap=; "
        "causal or not; 0 = off",
        min=0.0,
    )
    out_dir: str = field("results", "folder for the records and the plot", kind="path")
    plot: bool = field(True, "draw the PNG")


def _size_keys(o: Options, seqs) -> str:
    """The settings the user changed that set a point's size, and seqs (its default sets it
    too): "head_dim=4096 seqs=16384"."""
    defaults = {f.name: f.default for f in dataclasses.fields(Options)}
    keys = ("batch", "heads", "kv_heads", "head_dim")
    given = [f"{k}={getattr(o, k)}" for k in keys if getattr(o, k) != defaults[k]]
    return " ".join([f"seqs={max(seqs)}", *given] if o.seqs else [*given, f"seqs={max(seqs)}"])


def _default_budget() -> float:
    return Options.__dataclass_fields__["budget"].default


def run(o: Options) -> int:
    backend = jax.default_backend()
    if o.heads % o.kv_heads:
        raise ConfigError(f"heads={o.heads} must be a multiple of kv_heads={o.kv_heads}")
    impls = list(o.impls or study.default_impls())
    try:
        study.check_impls(impls)
        study.check_impls([o.baseline], key="baseline")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    added = o.baseline not in impls  # the ratios' reference is measured too: said below
    impls += [o.baseline] if added else []
    dtype = o.dtype if o.dtype != "auto" else ("float32" if backend == "cpu" else "bfloat16")
    seqs = o.seqs or study.default_seqs(backend, o.quick)
    typed = given_options(o)  # None for options made in code: then budget= away from its default
    budget_given = "budget" in typed if typed is not None else o.budget != _default_budget()
    causal = {"both": (True, False), "yes": (True,), "true": (True,), "no": (False,)}.get(
        o.causal, (False,)
    )
    masking = study.Masking(o.window or None, o.docs or None, o.softcap or None)
    try:
        masking.check(seqs, causal)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    shape = study.Shape(o.batch, o.heads, o.kv_heads, o.head_dim, DTYPES[dtype])
    need = shape.held_bytes(max(seqs))  # refused before anything is allocated
    memory.check_fits("the inputs and gradients", need, _size_keys(o, seqs), jax.devices()[:1])
    stem = rec.output_stem(o.out_dir, "attention")
    con = progress.console(width=150)
    if busy := rec.busy_note():
        con.print(f"[yellow]{busy}")
    t0 = time.perf_counter()
    pending = []  # the points measured and not yet written

    def write(taken) -> None:
        path = rec.write_records(stem.with_suffix(".jsonl"), taken)
        startup.note(f"the points measured so far are in {path}")

    flush = startup.keep_on_stop(pending, write)
    points = len(seqs) * len(causal) * len(o.modes)
    budget_s = 0.2 if o.quick and not budget_given else o.budget
    timed = [i for i in impls if masking.refusal(i) is None]  # the rest are skipped rows
    per_impl = points * budget_s * _settle_factor(backend, len(timed))  # the budget's figure
    floor = (  # every impl skipped for its masks: no samples, no peak to measure
        study.samples_floor_s(seqs, causal, o.modes, shape, masking, dtype, per_impl)
        if timed
        else (0.0, None)
    )
    estimate = _wall_estimate(points, len(timed), budget_s, backend, floor)
    if added:
        estimate = f"baseline={o.baseline} is measured too (the ratios' reference); {estimate}"
    con.print(estimate, markup=False, soft_wrap=True)
    with progress.counted(con, "attention", points) as tick:
        records = study.sweep(
            seqs,
            causal=causal,
            modes=o.modes,
            impls=impls,
            shape=shape,
            budget_s=budget_s,
            baseline=o.baseline,
            inner=o.inner or None,
            progress=tick,
            done=pending.extend,
            masking=masking,
        )
    env = rec.environment()
    title = (
        f"attention · {plots.host_name({**env, 'backend': backend})} · "
        f"jax {env['jax_version']} · "
        f"B={shape.batch} H={shape.heads} G={shape.kv_heads} K={shape.head_dim} {dtype}"
        + (f" · {masking.label}" if masking.label else "")
    )
    rows = study.rows_of(records)
    con.print(tables.attention_sweep(rows, study.baseline_of(records) or o.baseline, title))
    native = sorted({r.impl for r in rows if r.memory_excludes})
    if native:
        excluded = next(r.memory_excludes for r in rows if r.memory_excludes)
        con.print(
            f"peak temp mem of {', '.join(native)}: XLA's temporaries only, not {excluded}",
            soft_wrap=True,
        )
    flush()
    con.print(f"records → {stem.with_suffix('.jsonl')}", markup=False, soft_wrap=True)
    if not any(r.ran for r in rows):  # the skip records are kept; there is nothing to plot
        raise ConfigError("nothing was measured: each impl asked for was skipped (see its row)")
    if o.plot:
        con.print(
            f"plot → {plots.attention_sweep(rows, stem.with_suffix('.png'), title)}", markup=False
        )
    con.print(f"done in {time.perf_counter() - t0:.0f} s")
    return 0


def _settle_factor(backend: str, impls: int) -> float:
    """Wall time per second of budget: on CPU, where several impls alternate, each sample
    waits first (lab.studies.attention.CPU_SETTLE_S)."""
    return _WALL_PER_BUDGET if backend == "cpu" and impls > 1 else 1


def _wall_estimate(points: int, impls: int, budget_s: float, backend: str, floor) -> str:
    """About how long the sweep's samples take, said before it starts: a budget of 1e9 s, or
    a length whose calls take hours, should not be found out by waiting. Every impl takes at
    least three samples, which at a long sequence outlast budget=: `floor` (seconds, peak
    FLOP/s: what one impl's take at least; lab.studies.attention.samples_floor_s) is said
    where it is more than the budget's figure for one impl (_settle_factor)."""
    per = _settle_factor(backend, impls)
    wall = points * impls * budget_s * per
    settle = f" (×{per:g}: on CPU each sample waits first)" if per != 1 else ""
    head = (
        f"{points} point{'s' * (points != 1)} × {impls} impl{'s' * (impls != 1)} × "
        f"budget={budget_s:g} s{settle}: "
    )
    least, peak = floor
    if impls and least > wall / impls:
        each = "the impl" if impls == 1 else "each impl that runs"
        return head + (
            f"at least {duration(least)} of timed samples for {each}: three calls at every "
            f"point, each at this device's measured matmul peak ({peak / 1e12:.3g} TFLOP/s), "
            "take that whatever the budget; plus compiles and the float64 checks"
        )
    return head + (
        f"about {duration(wall)} of timed samples (more where three samples of an impl "
        "outlast budget=), plus compiles and the float64 checks"
    )


def main(argv=None) -> int:
    return cli(Options, run, prog="python -m lab.tools.attention_bench", doc=__doc__, argv=argv)


if __name__ == "__main__":
    from lab.report.progress import survive_lost_output

    survive_lost_output()  # a reader gone (| head) loses no records or report
    sys.exit(main())

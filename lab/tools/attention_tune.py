"""`python -m lab.tools.attention_tune`: a recorded search for the Pallas GPU kernels' tiles.

Three stages (forward tiles, backward tiles, the mask-split variant), every candidate checked
against float64 and scored by its geometric-mean time over the library baseline (cuDNN where
it runs) in the same run; write=true stores the winners in lab/kernels/attention/tuned/<gpu>.json,
which the kernel loads. `kernel=pallas_mgpu` searches the Mosaic GPU kernel instead (Hopper:
streamed tiles, pipeline depth, warpgroups; forward and backward stages; tuned/<gpu>-mgpu.json).
Needs a GPU; interpret=true runs the machinery on tiny shapes through the Pallas interpreter
(its times say nothing); static_only=true static=gpu:h100:1 compiles every candidate for an
H100 on this machine and shows which spill or overflow shared memory. See lab/studies/tune.py.
"""

import dataclasses
import sys
import time

import jax
import jax.numpy as jnp

from lab import startup
from lab.config import cli, field
from lab.errors import ConfigError, RunError
from lab.kernels.attention import pallas_gpu, pallas_mgpu
from lab.measure import memory, toolchain
from lab.measure import records as rec
from lab.report import progress, tables
from lab.studies import tune


@dataclasses.dataclass(frozen=True)
class Options:
    head_dims: tuple = field(
        (), "head dims to search (default 64,128; interpret: 16)", kind="ints", min=1
    )
    seqs: tuple = field(
        (), "sequence lengths (default 4096,16384; interpret: 40)", kind="ints", min=1
    )
    batch: int = field(0, "B (default 2; interpret: 1)", min=0)
    heads: int = field(0, "H (default 32; interpret: 2)", min=0)
    kv_heads: int = field(0, "G (default: as many as heads; interpret: 1)", min=0)
    dtype: str = field("", "default bfloat16 (interpret: float32)", choices=("", *sorted(tune.TOL)))
    space: str = field("full", "search space", choices=tuple(sorted(tune.FWD_SPACE)))
    budget: float = field(0.2, "seconds of timed runs per implementation", min=0.01)
    interpret: bool = field(False, "the Pallas interpreter on tiny shapes (tests the machinery)")
    kernel: str = field(
        "pallas_gpu", "the kernel searched: Triton, or Mosaic GPU (Hopper)", choices=tune.KERNELS
    )
    static: str = field(
        "auto",
        "compile candidates first and drop those that spill or overflow shared memory: auto "
        "(the GPU present; off elsewhere), off, or a plan target like gpu:h100:1 (deviceless)",
    )
    static_only: bool = field(
        False, "only the static pass (every candidate's kernels vs the target): runs on CPU"
    )
    write: bool = field(False, "store the winners in tuned/<gpu>.json")
    out_dir: str = field("results", "folder for the records", kind="path")


def _static(o: Options) -> str:
    if o.static == "auto":
        return "here" if jax.default_backend() == "gpu" else ""
    if o.static == "off":
        return ""
    if not o.static.startswith("gpu:"):
        raise ConfigError(f"static={o.static!r}: expected auto, off or gpu:KIND[:N]")
    from lab import plans

    try:  # the key the user typed names the target here: static=, not target=
        plans.prepare_host(o.static)  # the plugin and ptxas, one line if missing
        from lab.plans import gpu as gpu_targets

        gpu_targets.parse_target(o.static)
    except ConfigError as e:
        raise ConfigError(str(e).replace("target=", "static=", 1)) from None
    if o.kernel == "pallas_mgpu":  # LLVM aborts the process on another architecture
        from lab.kernels.attention import pallas_mgpu
        from lab.plans import gpu

        kind, _ = gpu.parse_target(o.static)
        if not pallas_mgpu.usable():
            raise ConfigError("kernel=pallas_mgpu: this jax builds no Mosaic GPU kernels")
        if not pallas_mgpu.runs_on(gpu.GPUS[kind].device_kind):
            raise ConfigError(
                f"static={o.static}: kernel=pallas_mgpu is written for Hopper (gpu:h100, "
                f"gpu:h200); {kind} has no wgmma or TMA"
            )
    return o.static


def searches(o: Options) -> list[tune.Search]:
    """The GPU-speed targets' shapes (lab.studies.targets), or tiny ones for the interpreter
    (minutes per candidate at GPU sizes), with what the user set."""
    tiny, mgpu = o.interpret, o.kernel == "pallas_mgpu"
    heads = o.heads or (2 if tiny else 32)
    kv_heads = o.kv_heads or (1 if tiny else heads)
    if heads % kv_heads:
        raise ConfigError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
    kernel = pallas_mgpu if mgpu else pallas_gpu
    bad = [d for d in o.head_dims if d not in kernel.HEAD_DIMS]
    if bad:
        takes = ", ".join(map(str, sorted(kernel.HEAD_DIMS)))
        raise ConfigError(
            f"head_dims={','.join(map(str, o.head_dims))}: {o.kernel} takes no head_dim "
            f"{', '.join(map(str, bad))} (it takes {takes})"
        )
    if mgpu and o.dtype not in ("", *(jnp.dtype(d).name for d in pallas_mgpu.DTYPES)):
        raise ConfigError(f"dtype={o.dtype}: pallas_mgpu takes bfloat16 or float16")
    if mgpu and tiny and not pallas_mgpu.interpretable():
        raise ConfigError(
            f"interpret=true kernel=pallas_mgpu needs jax >= 0.11's GPU interpreter "
            f"(this is {jax.__version__})"
        )
    common = dict(
        seqs=o.seqs or ((40,) if tiny else tune.Search.seqs),
        batch=o.batch or (1 if tiny else 2),
        heads=heads,
        kv_heads=kv_heads,
        dtype=o.dtype or ("float32" if tiny and not mgpu else "bfloat16"),
        interpret=tiny,
        static=_static(o),
        kernel=o.kernel,
    )
    tiny_dim = 64 if mgpu else 16
    dims = o.head_dims or ((tiny_dim,) if tiny else (64, 128))
    return [tune.Search(head_dim=d, **common) for d in dims]


def check_fits(o: Options, todo: list[tune.Search]) -> None:
    """One line before any search allocates where the largest case cannot fit: its inputs,
    gradients, float64 reference and the xla baseline's scores (`Search.held_bytes`) against
    the memory free now. interpret=true holds them in the host's memory, which a case too
    large exhausts (the process is killed, not refused); the line names the longest length
    that fits."""
    need = max(s.held_bytes(max(s.seqs)) for s in todo)
    keys = ("seqs", "batch", "heads", "kv_heads", "head_dims")
    given = [f"{k}={_text(getattr(o, k))}" for k in keys if getattr(o, k)]
    given += [] if o.seqs else [f"seqs={max(todo[0].seqs)}"]  # the default sets it too

    def fits(limit: float) -> str | None:
        seq = longest_seq(todo, limit)
        return f"seqs={seq}" if seq else None

    what = "the inputs, gradients and baseline"
    memory.check_fits(what, need, " ".join(given), jax.devices()[:1], fits)


def longest_seq(todo: list[tune.Search], limit: float) -> int | None:
    """The longest sequence length whose case fits `limit` bytes in every search (the
    estimate grows with the length), or None where not even one token does."""
    lo, hi = 0, max(max(s.seqs) for s in todo)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if all(s.held_bytes(mid) <= limit for s in todo):
            lo = mid
        else:
            hi = mid - 1
    return lo or None


def _text(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def static_only(o: Options) -> int:
    """Every candidate of the forward and backward spaces compiled for the target: which
    spill, which fit; nothing is timed (so it runs on a machine without a GPU)."""
    if not _static(o):
        raise ConfigError("static_only=true needs a GPU or static=gpu:KIND (a plan target)")
    stem = rec.output_stem(o.out_dir, "tune-static", backend="gpu")  # the target's, not the host's
    con = progress.console(width=150)
    stages = (("fwd", "fwd"), ("bwd", "fwd+bwd"))
    passes = []  # (search, stage, mode, candidates): every compile counted before the first
    for search in searches(o):
        base = tune.default_block_sizes(search.kernel, search.head_dim)
        todo = tune.spaces(search.kernel, o.space, interpret=False)
        for stage, mode in stages:
            candidates = [dataclasses.replace(base, **c) for c in todo[stage]]
            passes.append((search, stage, mode, candidates))
    total, started = sum(len(p[-1]) for p in passes), []
    for search, stage, mode, candidates in passes:
        title = f"{stage} K={search.head_dim}"
        # the drops are in the table below: a line per drop would say each one twice
        with progress.tasks(con) as bar:
            task = bar.add_task(title, total=total, completed=len(started))

            def tick(label, bar=bar, task=task, title=title):  # before each: those before done
                bar.update(task, description=f"{title} {label}", completed=len(started))
                started.append(label)

            static = tune.static_filter(candidates, search, mode, progress=tick)
            bar.update(task, completed=len(started))
        rec.write_records(stem.with_suffix(".jsonl"), static.records(stage=stage))
        startup.note(f"the passes finished so far are in {stem.with_suffix('.jsonl')}")
        con.print(tables.static_pass(static, title, toolchain.probe()))
    con.print(f"records → {stem.with_suffix('.jsonl')}", markup=False, soft_wrap=True)
    return 0


def run(o: Options) -> int:
    if o.static_only:
        return static_only(o)
    if o.write and o.interpret:
        raise ConfigError(
            "write=true stores measured winners; interpret-mode times measure nothing"
        )
    backend = jax.default_backend()
    if backend != "gpu" and not o.interpret:
        raise ConfigError(
            f"the Pallas GPU kernel compiles only on a GPU (this backend: {backend}); "
            "interpret=true runs the search's machinery on tiny shapes"
        )
    here = jax.devices()[0].device_kind
    if o.kernel == "pallas_mgpu" and not o.interpret and not pallas_mgpu.runs_on(here):
        raise ConfigError(f"kernel=pallas_mgpu needs a Hopper GPU (H100/H200); this is {here}")
    todo = searches(o)
    check_fits(o, todo)
    stem = rec.output_stem(o.out_dir, "tune")
    con = progress.console(width=150)
    if o.interpret:
        con.print(
            "[yellow]interpret=true: the Pallas interpreter runs the kernels on the host, so "
            "the times below check the search's machinery and say nothing of a GPU's"
        )
    kind = jax.devices()[0].device_kind
    for search in todo:
        t0 = time.perf_counter()
        try:
            best, records, summary = tune.search_block_sizes(
                search, o.space, budget_s=o.budget, log=progress.lines(con)
            )
        except RuntimeError as e:
            raise RunError(f"head_dim {search.head_dim}: {e}") from None
        rec.write_records(stem.with_suffix(".jsonl"), records)
        startup.note(f"the searches finished so far are in {stem.with_suffix('.jsonl')}")
        for stage in summary.stages:
            con.print(tables.tune_stage(stage, summary.baseline))
        tiles = " ".join(f"{f.name}={getattr(best, f.name)}" for f in dataclasses.fields(best))
        # every stage whose choice another candidate ties: the tiles rest on each of them
        ties = [
            f"{st.stage}: {tables.tied_text(st, st.within_noise_of)}"
            for st in summary.stages
            if st.within_noise_of
        ]
        noise = f", within noise of {'; '.join(ties)}" if ties else ""
        took = time.perf_counter() - t0
        con.print(f"head_dim {search.head_dim}: best {tiles}{noise} ({took:.0f} s)")
        if o.write:
            con.print(f"table → {tune.write_entry(kind, search, best, summary)}", markup=False)
    con.print(f"records → {stem.with_suffix('.jsonl')}", markup=False, soft_wrap=True)
    return 0


def main(argv=None) -> int:
    return cli(Options, run, prog="python -m lab.tools.attention_tune", doc=__doc__, argv=argv)


if __name__ == "__main__":
    from lab.report.progress import survive_lost_output

    survive_lost_output()  # a reader gone (| head) loses no records or report
    sys.exit(main())

"""`python -m experiments [size=tiny|quick|full] [only=C03,C08] [plans=auto|on|off]
[out_dir=results]`: the ledger.

Runs the experiment modules with a progress bar, appends every record to
results/<backend>-<device>-<timestamp>/records.jsonl as each module finishes, then renders
REPORT.md and the plots from those records and prints the verdict table. On CPU the process
simulates 8 devices (as the tests do) so the parallelism experiments have a mesh.

plans=on (or size=full) adds C10's and C14's plans: the Llama-2-7B step compiled for 1 H100,
the 70B step for 8, 16 and 32 H100s under dp, fsdp and tp, each with the compiler's memory
per device beside the calculator's (compiled, not run; experiments/gpu_plans.py). E.g.
`python -m experiments only=C10,C14 plans=on`.
"""

import dataclasses
import os
import sys
import time
import traceback

from experiments.common import SIZES
from lab.config import cli, field


@dataclasses.dataclass(frozen=True)
class Options:
    size: str = field("quick", "tiny (about a minute) | quick | full (GPU/TPU VMs)", choices=SIZES)
    only: tuple = field((), "claim ids to measure, e.g. C03,C08 (default: all)", kind="names")
    out_dir: str = field(
        "results", "where results/<backend>-<device>-<time>/ is written", kind="path"
    )
    plans: str = field(
        "auto",
        "compile the Llama-2 7B/70B training steps for 1-32 H100s (C10, C14; compiled, not run;"
        " needs the gpu-plan extra, a few minutes on 2 cores): on, off, auto (on with size=full)",
        choices=("auto", "on", "off"),
    )


def run(o: Options) -> int:
    from experiments import load, parse_only, plan_kwargs, select
    from lab.errors import ConfigError

    try:
        only = parse_only(",".join(o.only)) if o.only else None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", 8)
    except RuntimeError:  # backends already up (e.g. under pytest): keep what is there
        pass
    from lab.measure import records as rec
    from lab.report import markdown, progress, tables

    rec.writable_dir(o.out_dir)
    con = progress.console()
    env = rec.environment()
    out_dir = markdown.results_dir(o.out_dir, env)
    names = select(only)
    t0 = time.perf_counter()
    meta = {"size": o.size, "only": only, "modules": {}, "argv": sys.argv[1:]}
    con.print(
        f"experiments · {env['backend']} · {env['device_kind']} × "
        f"{env['device_count']} · size {o.size} → {out_dir}"
    )
    with progress.tasks(con) as bar:
        task = bar.add_task("starting", total=len(names))
        for name in names:
            module = load(name)
            bar.update(task, description=f"{name} ({', '.join(module.CLAIMS)})")
            start = time.perf_counter()
            try:
                records = module.run(o.size, **plan_kwargs(name, o.plans, o.size))
                for r in records:
                    r["config"]["module"] = name
                rec.write_records(out_dir / "records.jsonl", records)
                error = None
            except Exception as e:  # noqa: BLE001 — one failed topic must not lose the others
                error = f"{type(e).__name__}: {e}"
                con.print(f"[red]{name} failed[/red]: {error}")
                con.print(traceback.format_exc(), markup=False, highlight=False)
                records = []
            meta["modules"][name] = {
                "wall_s": time.perf_counter() - start,
                "records": len(records),
                "error": error,
            }
            bar.advance(task)
    meta["wall_s"] = time.perf_counter() - t0
    report = markdown.write_report(out_dir, meta=meta, only=only)
    con.print(tables.verdicts(report["verdicts"]))
    con.print(f"wall {meta['wall_s']:.0f} s · {report['path']}")
    return 1 if any(m["error"] for m in meta["modules"].values()) else 0


def main(argv: list[str] | None = None) -> int:
    return cli(Options, run, prog="python -m experiments", doc=__doc__, argv=argv)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    sys.exit(main())

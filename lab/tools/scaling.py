"""`python -m lab.tools.scaling size=quick`: one model over 1, 2, 4, 8 devices per strategy.

Strong scaling (step time, the collective/compute split, memory per device), data-parallel
efficiency extrapolated to 16-256 devices, and remat × batch on one device: tables, records and
a PNG. On CPU the devices are simulated. See lab/studies/scaling.py.
"""

import dataclasses
import sys
import time

import jax

from lab import devices, startup
from lab.config import cli, field
from lab.measure import records
from lab.report import plots, progress, tables
from lab.studies import scaling


@dataclasses.dataclass(frozen=True)
class Options:
    size: str = field(
        "quick",
        "tiny checks the code path (its times are too short to compare), quick is for CPU and "
        "CI, full for an accelerator: "
        + "; ".join(f"{k}: {v.summary()}" for k, v in scaling.SIZES.items()),
        choices=tuple(scaling.SIZES),
    )
    strategies: tuple = field(
        scaling.STRATEGIES, "strategies to scale", kind="names", choices=scaling.STRATEGIES
    )
    cpu_devices: int = field(8, "simulated devices on CPU", min=1)
    out_dir: str = field("results", "folder for the records and the plot", kind="path")
    plot: bool = field(True, "draw the PNG")


def run(o: Options) -> int:
    devices.prepare("1", cpu_devices=o.cpu_devices)
    stem = records.output_stem(o.out_dir, "scaling")
    con = progress.console(width=max(120, progress.console().width))  # the tables are wide
    t0 = time.perf_counter()
    if busy := records.busy_note():
        con.print(f"[yellow]{busy}")
    if o.size == "tiny":
        con.print("size=tiny checks the code path: its times are too short to compare")
    if skipped := scaling.skipped_counts(o.size):  # said, not dropped from the tables unseen
        here = jax.device_count()
        cpu = jax.default_backend() == "cpu"
        how = " (cpu_devices= sets how many are simulated)" if cpu else ""
        con.print(
            f"[yellow]{', '.join(map(str, skipped))} devices of size={o.size}: not timed, "
            f"{here} device{'s' * (here != 1)} here{how}"
        )
    with progress.tasks(con) as bar:
        total = scaling.points_planned(o.size, o.strategies)
        task = bar.add_task("scaling", total=total)

        started = []

        def tick(label: str) -> None:  # a point starts: the one before it is done
            bar.update(task, description=label[:60], advance=1 if started else 0)
            started.append(label)

        latest = []  # the study as far as it went, not yet written

        def write(taken) -> None:
            path = records.write_records(stem.with_suffix(".jsonl"), taken[-1].records())
            startup.note(f"the points finished so far are in {path}")

        def done(so_far) -> None:  # each point's end: the study so far replaces the last
            latest[:] = [so_far]

        flush = startup.keep_on_stop(latest, write)
        study = scaling.run(o.size, o.strategies, progress=tick, done=done)
        bar.update(task, completed=total)
    for table in tables.scaling(study):
        con.print(table)
    flush()
    con.print(f"records → {stem.with_suffix('.jsonl')}", markup=False, soft_wrap=True)
    if o.plot:
        env = records.environment()
        title = f"{plots.host_name(env)} · jax {env['jax_version']}"
        con.print(
            f"plot → {plots.scaling_study(study, stem.with_suffix('.png'), title)}", markup=False
        )
    con.print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


def main(argv=None) -> int:
    return cli(Options, run, prog="python -m lab.tools.scaling", doc=__doc__, argv=argv)


if __name__ == "__main__":
    from lab.report.progress import survive_lost_output

    survive_lost_output()  # a reader gone (| head) loses no records or report
    sys.exit(main())

"""`python -m lab.tools.ceilings`: this device's ceilings, measured.

Matmul FLOP/s per dtype and precision (numpy beside it on CPU), copy and host↔device
bandwidth, and a roofline sweep with its PNG (about 30 s on 2 cores; quick=true in seconds).
Stopped (Ctrl-C, SIGTERM), it keeps the rows it measured: their records, a table of them and
a last line that says where they are and which rows it never reached.
"""

import dataclasses
import sys
import time

from lab import startup
from lab.config import cli, field
from lab.measure import ceilings, records
from lab.report import plots, progress, tables


@dataclasses.dataclass(frozen=True)
class Options:
    quick: bool = field(False, "tiny sizes: checks the code path only")
    budget: float = field(1.0, "seconds of timed runs per figure", min=0.01)
    out_dir: str = field("results", "folder for the records and the plot", kind="path")
    plot: bool = field(True, "draw the roofline PNG")


def run(o: Options) -> int:
    stem = records.output_stem(o.out_dir, "ceilings")
    con = progress.console()
    if busy := records.busy_note("times", "the ceilings (peaks, bandwidths)"):
        con.print(f"[yellow]{busy}")
    t0 = time.perf_counter()
    planned = ceilings.planned_rows(o.quick)
    measured, unwritten = [], []  # every row so far (a stop's table); records not yet written

    def write(taken) -> None:
        path = records.write_records(stem.with_suffix(".jsonl"), taken)
        startup.note(lambda: _stopped(measured, planned, path))

    flush = startup.keep_on_stop(unwritten, write)
    ending = []  # set once every row is measured: a stop from then on prints no partial table

    def show_so_far() -> None:  # a stop: the rows it finished, before their records are written
        if measured and not ending:
            so_far = ceilings.so_far(measured, time.perf_counter() - t0)
            con.print(tables.ceilings(so_far, f"ceilings · stopped after {len(measured)} rows"))

    startup.on_stop(show_so_far)  # registered after keep_on_stop: a stop runs it first
    with progress.tasks(con) as bar:
        task = bar.add_task("ceilings", total=len(planned))

        def done(record, row) -> None:
            unwritten.append(record)  # the list a stop writes: a row is never counted unwritten
            measured.append(row)
            bar.update(task, description=row.what, advance=1)

        result = ceilings.run_all(budget_s=o.budget, quick=o.quick, done=done)
        ending.append(True)
        bar.update(task, completed=len(planned))
    env = records.environment()
    title = (
        f"ceilings · {plots.device_name(env['backend'], env['device_kind'])} × "
        f"{env['device_count']} · jax {env['jax_version']}"
        + plots.allocator_note(env)
        + (" · quick=true: tiny sizes check the code path, not the ceilings" if o.quick else "")
    )
    con.print(tables.ceilings(result, title))
    flush()
    con.print(f"records → {stem.with_suffix('.jsonl')}", markup=False, soft_wrap=True)
    if o.plot:
        png = plots.roofline_points(
            result.points,
            peak_flops=result.peak_flops,
            bandwidth=result.bandwidth,
            path=stem.with_suffix(".png"),
            title=f"{plots.host_name(env)}: measured roofline",
        )
        con.print(f"roofline → {png}", markup=False)
    con.print(f"done in {result.elapsed_s:.1f} s")
    return 0


def _stopped(rows, planned: list[str], path) -> str:
    """The exit line's account of a stopped run: how many rows it finished, where their
    records are, and which rows it never reached (the sweep's points counted, not named)."""
    got = {r.what for r in rows}
    missing = [w for w in planned if w not in got]
    sweep = [w for w in missing if w.startswith("roofline ")]
    names = [w for w in missing if not w.startswith("roofline ")]
    if sweep:
        names.insert(-3 if len(names) >= 3 else 0, f"{len(sweep)} roofline points")
    return (
        f"stopped after {len(rows)} of {len(planned)} rows, their records in {path}; "
        f"not measured: {', '.join(names) or 'nothing'}"
    )


def main(argv=None) -> int:
    return cli(Options, run, prog="python -m lab.tools.ceilings", doc=__doc__, argv=argv)


if __name__ == "__main__":
    from lab.report.progress import survive_lost_output

    survive_lost_output()  # a reader gone (| head) loses no records or report
    sys.exit(main())

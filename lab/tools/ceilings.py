"""`python -m lab.tools.ceilings`: this device's ceilings, measured.

Matmul FLOP/s per dtype and precision (numpy beside it on CPU), copy and host↔device
bandwidth, and a roofline sweep with its PNG (about 30 s on 2 cores; quick=true in seconds).
"""

import dataclasses
import sys

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
    what = "measuring matmul peaks, copy and transfer bandwidth and the roofline's points"
    with progress.working(con, what):
        result = ceilings.run_all(budget_s=o.budget, quick=o.quick)
    env = records.environment()
    title = (
        f"ceilings · {plots.device_name(env['backend'], env['device_kind'])} × "
        f"{env['device_count']} · jax {env['jax_version']}"
        + (" · quick=true: tiny sizes check the code path, not the ceilings" if o.quick else "")
    )
    con.print(tables.ceilings(result, title))
    con.print(
        f"records → {records.write_records(stem.with_suffix('.jsonl'), result.records)}",
        soft_wrap=True,
    )
    if o.plot:
        png = plots.roofline_points(
            result.points,
            peak_flops=result.peak_flops,
            bandwidth=result.bandwidth,
            path=stem.with_suffix(".png"),
            title=f"{plots.device_name(env['backend'], env['device_kind'])}: measured roofline",
        )
        con.print(f"roofline → {png}")
    con.print(f"done in {result.elapsed_s:.1f} s")
    return 0


def main(argv=None) -> int:
    return cli(Options, run, prog="python -m lab.tools.ceilings", doc=__doc__, argv=argv)


if __name__ == "__main__":
    from lab.report.progress import survive_lost_output

    survive_lost_output()  # a reader gone (| head) loses no records or report
    sys.exit(main())

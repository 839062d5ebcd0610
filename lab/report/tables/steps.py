"""Step times side by side (lab.measure.timing.comparison): a step against a bare one, or two
ways to run a collective matmul.
"""

from rich.table import Table

from lab.measure.timing import Comparison
from lab.report.format import OVERLAP, duration, ranges_overlap


def step_compare(c: Comparison, title: str) -> Table:
    """Each contender's times and its ratio to the comparison's baseline."""
    t = Table(title=title)
    for col in ("", "median", "p10", "p90", "runs", f"ratio vs {c.baseline}"):
        t.add_column(col, justify="right")
    for r in c.contenders:
        t.add_row(
            r.name,
            duration(r.bench.median_s),
            duration(r.bench.p10_s),
            duration(r.bench.p90_s),
            str(r.bench.runs),
            f"{r.ratio:.3f}",
        )
    if ranges_overlap((r.bench.p10_s, r.bench.p90_s) for r in c.contenders):
        t.caption = OVERLAP
    return t

"""Step times side by side (lab.measure.timing.compare): a step against a bare one, or two
ways to run a collective matmul.
"""

from rich.table import Table

from lab.report.format import duration


def step_compare(results: dict, title: str, baseline: str = "bare") -> Table:
    """`lab.measure.timing.compare` results: times and the ratio to the baseline."""
    t = Table(title=title)
    for col in ("", "median", "p10", "p90", "runs", f"ratio vs {baseline}"):
        t.add_column(col, justify="right")
    for name, r in results.items():
        t.add_row(
            name,
            duration(r["median_s"]),
            duration(r["p10_s"]),
            duration(r["p90_s"]),
            str(r["runs"]),
            f"{r['ratio']:.3f}",
        )
    return t

"""lab.tools.ceilings: the measured matmul and copy ceilings beside the datasheet."""

from rich.table import Table

from lab.measure.ceilings import Ceilings, Row
from lab.report.format import percent, rate


def _vs_spec(c: Ceilings, row: Row) -> str:
    """Share of the datasheet figure, where the device has a spec entry."""
    share = c.share_of_spec(row)
    if share is None:
        return ""
    value, key = share
    if key == "memory_bandwidth":
        return f"{percent(value, 0)} of spec"
    return f"{percent(value, 0)} of {key} spec"


def ceilings(c: Ceilings, title: str) -> Table:
    """Every row of lab.measure.ceilings.run_all: its value, how it was measured, and its share
    of the datasheet where one applies."""
    t = Table(title=title)
    spec = c.spec is not None  # no datasheet (a CPU): no column of blanks
    for col in ("measurement", "value", "note", *(("vs datasheet",) if spec else ())):
        t.add_column(col)
    for r in c.rows:
        if r.value is None:
            text = "n/a"
        else:
            text = (
                rate(r.value, r.unit)
                if r.unit in ("FLOP/s", "OP/s", "B/s")
                else f"{r.value:.3g} {r.unit}"
            )
        t.add_row(r.what, text, r.note, *((_vs_spec(c, r),) if spec else ()))
    return t

"""lab.tools.ceilings: the measured matmul and copy ceilings beside the datasheet."""

from rich.table import Table

from lab.report.format import percent, rate


def _vs_spec(what: str, value, spec) -> str:
    """Share of the datasheet figure, where the device has a spec entry."""
    if spec is None or value is None:
        return ""
    if what.startswith("matmul ") and "numpy" not in what and "/" not in what:
        dtype = what.split()[1]
        key = "tf32" if dtype == "float32" and "default" in what else dtype
        peak = spec.peak_flops.get(key)
        return f"{percent(value / peak, 0)} of {key} spec" if peak else ""
    if what.startswith("copy"):
        return f"{percent(value / spec.memory_bandwidth, 0)} of spec"
    return ""


def ceilings(result: dict, title: str) -> Table:
    t = Table(title=title)
    for col in ("measurement", "value", "note", "vs datasheet"):
        t.add_column(col)
    for what, value, unit, note in result["rows"]:
        if value is None:
            text = "n/a"
        else:
            text = rate(value, unit) if unit in ("FLOP/s", "B/s") else f"{value:.3g} {unit}"
        t.add_row(what, text, note, _vs_spec(what, value, result["spec"]))
    return t

"""Numbers as text: the one place the lab turns bytes, seconds, rates and ratios into words.

Tables (lab/report/tables/), REPORT.md (markdown.py) and every command's output use these,
so one figure reads the same everywhere.
"""

import math

MiB, GiB = 2**20, 2**30
_PREFIX = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
NA = "n/a"
# timings whose p10–p90 ranges overlap: their medians' order or ratio cannot rank them
NOISE = "the p10–p90 ranges overlap"
OVERLAP = f"{NOISE}: the ratios are within this run's noise"


def ranges_overlap(spans) -> bool:
    """Whether every (low, high) of two or more spans shares a point with every other."""
    spans = list(spans)
    return len(spans) > 1 and max(lo for lo, _ in spans) <= min(hi for _, hi in spans)


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and not math.isfinite(value))


def _absent(value, default: str) -> str:
    """A missing value's text: NaN or inf for a number that is not one (a diverged figure is
    not a missing one), `default` for None."""
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return default


def si(value: float, unit: str) -> str:
    """2.5e12 FLOP/s → '2.5 TFLOP/s' (decimal prefixes, 3 significant digits)."""
    for scale, prefix in _PREFIX:
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def fmt(value, unit: str) -> str:
    """A value with its unit, readable: 2e12 FLOP, 45.1 GFLOP/s, 80 GB, 20,000×. A value that
    is not a number says so ("NaN", "inf"): a diverged measurement is not a missing one."""
    if _missing(value):
        return _absent(value, NA)
    if unit in ("FLOP",):
        return f"{value:.3g} FLOP"
    if unit in ("FLOP/s", "B/s", "tokens/s", "req/s", "B"):
        return si(value, unit)
    if unit == "s":
        return duration(value)
    if unit.startswith("×"):
        text = f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
        return f"{text}{unit}"
    if unit == "$":
        return f"${value:.3g}"
    if unit in ("1", ""):  # a pure number (an efficiency, a share): no unit after it
        return f"{value:.3g}"
    return f"{value:.3g} {unit}"


def fmt_range(lo, hi, unit: str, strict: bool) -> str:
    lt, gt = ("<", ">") if strict else ("≤", "≥")
    if lo is not None and hi is not None:
        return f"{fmt(lo, unit)} … {fmt(hi, unit)}"
    if hi is not None:
        return f"{lt} {fmt(hi, unit)}"
    if lo is not None:
        return f"{gt} {fmt(lo, unit)}"
    return "any"


def size(n) -> str:
    """Bytes in binary units chosen by size: '512 B', '3.0 KiB', '12.5 MiB', '1.20 GiB'."""
    if _missing(n):
        return _absent(n, NA)
    if abs(n) >= 2**28:
        return f"{n / GiB:,.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:,.1f} MiB"
    if abs(n) >= 2**10:
        return f"{n / 2**10:,.1f} KiB"
    return f"{n:,.0f} B"


def mib(n, digits: int = 1) -> str:
    """Bytes as a MiB number without the unit (a table column that names it): '1,234.5'."""
    return _absent(n, "—") if _missing(n) else f"{n / MiB:,.{digits}f}"


def duration(s) -> str:
    """Seconds, in the unit that reads best: '850 ns', '12 µs', '3.4 ms', '2.10 s', '3.2 min',
    '5.5 h'."""
    if _missing(s):
        return _absent(s, NA)
    if s >= 2 * 3600:
        return f"{s / 3600:,.1f} h"
    if s >= 120:
        return f"{s / 60:,.1f} min"
    if s >= 1:
        return f"{s:,.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:,.2f} ms"
    if s >= 1e-6:
        return f"{s * 1e6:,.0f} µs"
    return f"{s * 1e9:,.0f} ns"


def significant(x, digits: int = 3) -> str:
    """A number to `digits` significant digits in plain notation, for a column that names its
    unit: 0.000123 → '0.000123', 12.345 → '12.3', 1234.5 → '1,234' (a fixed '.3f' printed a
    small shape's rate as '0.000')."""
    if _missing(x):
        return _absent(x, NA)
    if x == 0:
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return f"{x:,.{decimals}f}"


def rough(x) -> str:
    """An estimate to two significant figures, the rest rounded away: 1036.6 → '1,000',
    0.34 → '0.34', 9.96 → '10' (for a figure its own noise would move by more)."""
    return significant(float(f"{x:.2g}"), 2)


def ratio(x, digits: int = 2) -> str:
    return "" if _missing(x) else f"{x:.{digits}f}x"


def percent(x, digits: int = 1) -> str:
    """0.123 → '12.3%'; a share above zero too small to show at `digits` reads '<0.1%' (or
    '<1%'), not '0.0%', which would say there is none."""
    if _missing(x):
        return _absent(x, NA)
    least = 10.0**-digits
    if 0 < 100 * x < least / 2:
        return f"<{least:.{digits}f}%"
    return f"{100 * x:.{digits}f}%"


def rate(value, unit: str = "B/s") -> str:
    """A rate in decimal GB/s or GFLOP/s with two decimals (ceilings, bandwidths)."""
    return _absent(value, NA) if _missing(value) else f"{value / 1e9:,.2f} G{unit}"


def key_args(keys: dict) -> list[str]:
    """Typed keys back into the arguments a user types (the inverse of lab.config.parse_keys):
    {"preset": "small", "resume": True} → ["model=small", "resume=true"]. For printing a
    command to run, and for lab.tools.launch, which starts lab.run processes."""

    def text(v) -> str:
        if isinstance(v, bool):
            return str(v).lower()
        if isinstance(v, tuple):
            return ",".join(map(str, v))
        return str(v)

    return [f"{'model' if k == 'preset' else k}={text(v)}" for k, v in keys.items()]

"""`python -m lab.measure [--quick] [--budget S] [--out results]`: the device's ceilings.

Prints one table (matmul FLOP/s per dtype and precision, numpy's BLAS beside it on CPU,
copy and transfer bandwidth, the roofline sweep and its measured ridge point), appends the
records to results/ceilings-<backend>-<time>.jsonl and plots the roofline to a PNG.
"""

import argparse
import os
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lab.measure import ceilings, records, roofline

UNITS = {"FLOP/s": ("FLOP/s", 1e9, "G"), "B/s": ("B/s", 1e9, "G")}


def _fmt(value, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit in UNITS:
        name, scale, prefix = UNITS[unit]
        return f"{value / scale:,.2f} {prefix}{name}"
    return f"{value:.3g} {unit}"


def _vs_spec(what: str, value, spec) -> str:
    """Share of the datasheet figure, where the device has a spec entry."""
    if spec is None or value is None:
        return ""
    if what.startswith("matmul ") and "numpy" not in what and "/" not in what:
        dtype = what.split()[1]
        key = "tf32" if dtype == "float32" and "default" in what else dtype
        peak = spec.peak_flops.get(key)
        return f"{value / peak:.0%} of {key} spec" if peak else ""
    if what.startswith("copy"):
        return f"{value / spec.memory_bandwidth:.0%} of spec"
    return ""


def table(result: dict) -> Table:
    spec = result["spec"]
    env = records.environment()
    title = (
        f"ceilings · {env['backend']} · {env['device_kind']} × {env['device_count']} · "
        f"jax {env['jax_version']}"
    )
    t = Table(title=title)
    for col in ("measurement", "value", "note", "vs datasheet"):
        t.add_column(col)
    for what, value, unit, note in result["rows"]:
        t.add_row(what, _fmt(value, unit), note, _vs_spec(what, value, spec))
    return t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.measure", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the code path only")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timed runs per figure")
    p.add_argument("--out", default="results", help="folder for the records and the plot")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    console = Console()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > (os.cpu_count() or 1) * 0.5:
        console.print(f"[yellow]host load average {load:.1f}: figures will be low and noisy")
    result = ceilings.run_all(budget_s=args.budget, quick=args.quick)
    console.print(table(result))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    backend = records.environment()["backend"]
    out = Path(args.out)
    path = records.write_records(out / f"ceilings-{backend}-{stamp}.jsonl", result["records"])
    console.print(f"records → {path}")
    if not args.no_plot:
        png = roofline.plot(
            result["points"],
            peak_flops=result["peak_flops"],
            bandwidth=result["bandwidth"],
            path=out / f"roofline-{backend}-{stamp}.png",
            title=f"{records.environment()['device_kind']} ({backend}): measured roofline",
        )
        console.print(f"roofline → {png}")
    console.print(f"done in {result['elapsed_s']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

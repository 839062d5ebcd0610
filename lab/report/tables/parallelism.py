"""Parallelism: collective bandwidths and the scaling study's three tables."""

from rich.table import Table

from lab.report.format import duration, mib, percent, size


def collectives(points, title: str) -> Table:
    t = Table(title=title)
    for col in ("op", "axis", "W", "size", "time", "algbw GB/s", "busbw GB/s"):
        t.add_column(col, justify="right" if col not in ("op", "axis") else "left")
    for p in points:
        t.add_row(
            p.op,
            str(p.axis),
            str(p.group_size),
            size(p.size_bytes),
            duration(p.result.median_s),
            f"{p.algbw / 1e9:,.2f}",
            f"{p.busbw / 1e9:,.2f}",
        )
    return t


def _by(recs: list[dict], experiment: str, what: str) -> list[dict]:
    return [r for r in recs if r["config"].get("experiment") == experiment and r["what"] == what]


def _value(recs, experiment, what, **match):
    for r in _by(recs, experiment, what):
        if all(r["config"].get(k) == v for k, v in match.items()):
            return r["value"]
    return None


def _ms(x) -> str:
    return "—" if x is None else f"{x * 1e3:,.2f}"


def scaling(recs: list[dict]) -> list[Table]:
    """The scaling study's three tables: strong scaling, DP extrapolation, remat × batch."""
    sim = any(r["config"].get("simulated_devices") for r in recs)
    t1 = Table(
        title="scaling (strong, fixed global batch)" + (" · simulated CPU devices" if sim else "")
    )
    t1.caption = "collectives: HLO bus bytes / busbw measured per kind (derived); compute: the rest"
    cols = ("strategy", "devices", "mesh", "step ms", "collectives ms", "compute ms", "MiB/dev")
    for col in cols:
        t1.add_column(col, no_wrap=True)
    for r in _by(recs, "scaling", "step time"):
        c = r["config"]
        key = dict(strategy=c["strategy"], devices=c["devices"])
        comm = _value(recs, "scaling", "collective time (HLO bytes / measured busbw)", **key)
        comp = _value(recs, "scaling", "compute time (step - collectives)", **key)
        mem = _value(recs, "scaling", "memory per device", **key)
        t1.add_row(
            c["strategy"],
            str(c["devices"]),
            c["mesh"],
            _ms(r["value"]),
            _ms(comm),
            _ms(comp),
            mib(mem, 2),
        )
    rows = _by(recs, "dp extrapolation", "DP efficiency (extrapolated, no overlap)")
    src = rows[0]["config"]["bandwidth_source"] if rows else ""
    t2 = Table(title=f"data-parallel efficiency — EXTRAPOLATED, not measured (bandwidth: {src})")
    for col in (
        "devices",
        "per-device batch",
        "compute ms (measured)",
        "all-reduce ms (model)",
        "efficiency",
        "with overlap",
    ):
        t2.add_column(col)
    for r in rows:
        c = r["config"]
        what = "DP efficiency (extrapolated, perfect overlap)"
        over = _value(recs, "dp extrapolation", what, devices=c["devices"])
        t2.add_row(
            str(c["devices"]),
            str(c["per_device_batch"]),
            _ms(c["compute_s"]),
            _ms(c["comm_s"]),
            percent(r["value"]),
            percent(over),
        )
    t3 = Table(title="remat × batch on one device (scanned blocks): the real compiled step")
    for col in ("remat", "batch", "step ms", "peak MiB (memory_analysis)", "temporaries MiB"):
        t3.add_column(col)
    for r in _by(recs, "remat", "peak memory per device"):
        c = r["config"]
        step = _value(recs, "remat", "step time", remat=c["remat"], batch=c["batch"])
        t3.add_row(
            c["remat"],
            str(c["batch"]),
            _ms(step),
            mib(r["value"], 2),
            mib(c.get("temp_bytes"), 2),
        )
    return [t1, t2, t3]

"""Parallelism: collective bandwidths and the scaling study's three tables."""

from rich.table import Table

from lab.measure.scaling import ScalingStudy
from lab.report.format import duration, mib, percent, si, size


def collectives(points, title: str) -> Table:
    t = Table(title=title)
    for col in ("op", "axis", "W", "size", "time", "algbw", "busbw"):
        t.add_column(col, justify="right" if col not in ("op", "axis") else "left")
    for p in points:
        t.add_row(
            p.op,
            str(p.axis),
            str(p.group_size),
            size(p.size_bytes),
            duration(p.result.median_s),
            si(p.algbw, "B/s"),  # 3 digits at any size: a 4 KiB message moves MB/s, not 0.00 GB/s
            si(p.busbw, "B/s"),
        )
    return t


def _ms(x) -> str:
    return "—" if x is None else f"{x * 1e3:,.2f}"


def scaling(study: ScalingStudy) -> list[Table | str]:
    """The scaling study's three tables: strong scaling, DP extrapolation (a line where
    nothing was extrapolated), remat × batch."""
    sim = study.simulated
    t1 = Table(
        title="scaling (strong, fixed global batch)" + (" · simulated CPU devices" if sim else "")
    )
    t1.caption = "collectives: HLO bus bytes / busbw measured per kind (derived); compute: the rest"
    cols = ("strategy", "devices", "mesh", "step ms", "p10–p90", "collectives ms", "compute ms")
    cols += ("MiB/dev",)
    for col in cols:
        t1.add_column(col, no_wrap=True)
    for p in study.strong:
        if p.step_s is None:
            continue
        t1.add_row(
            p.strategy,
            str(p.devices),
            p.mesh,
            _ms(p.step_s),
            "–" if p.step_spread is None else "–".join(_ms(s) for s in p.step_spread),
            _ms(p.collective_s),
            _ms(p.compute_s),
            mib(p.memory_bytes, 2),
        )
    rows = [p for p in study.extrapolated if p.efficiency is not None]
    src = study.extrapolated[0].bandwidth_source if study.extrapolated else ""
    title = f"data-parallel efficiency — EXTRAPOLATED, not measured (bandwidth: {src})"
    t2 = Table(title=title, caption=model_error(study.extrapolated), caption_justify="left")
    for col in (
        "devices",
        "per-device batch",
        "compute ms (measured)",
        "all-reduce ms (model)",
        "efficiency",
        "with overlap",
    ):
        t2.add_column(col)
    for p in rows:
        t2.add_row(
            str(p.devices),
            str(p.per_device_batch),
            _ms(p.compute_s),
            _ms(p.comm_s),
            percent(p.efficiency),
            percent(p.efficiency_overlap),
        )
    t3 = Table(title="remat × batch on one device (scanned blocks): the real compiled step")
    for col in ("remat", "batch", "step ms", "peak MiB (memory_analysis)", "temporaries MiB"):
        t3.add_column(col)
    for p in study.remat:
        if p.peak_bytes is None:
            continue
        t3.add_row(p.remat, str(p.batch), _ms(p.step_s), mib(p.peak_bytes, 2), mib(p.temp_bytes, 2))
    if not rows:  # a line, not an empty table
        t2 = f"data-parallel efficiency: not extrapolated ({src})"
    return [t1, t2, t3]


def model_error(extrapolated) -> str:
    """The extrapolation's one check here, in words: its step on the devices whose bandwidth
    it uses against dp's step measured there; or that it has none."""
    check = next((p.check for p in extrapolated if p.check), None)
    if check is None:
        return (
            "its error is unchecked here: no data-parallel step was measured on the largest "
            "device count here"
        )
    n = check["devices"]
    shared = any(p.simulated for p in extrapolated)
    return (
        f"the model's error where it can be checked, {n} devices here: a step of "
        f"{_ms(check['predicted_s'])} ms predicted (one device's compute + the all-reduce at "
        f"that bandwidth), {_ms(check['measured_s'])} ms measured for dp on {n} devices "
        f"(×{check['ratio']:.2f})"
        + (
            ", simulated devices that share this host's cores, which the model does not count"
            if shared
            else ""
        )
        + "; further out it is unchecked"
    )

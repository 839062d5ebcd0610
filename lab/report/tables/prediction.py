"""The step-time model against published measurements, this CPU and the accelerator at hand;
the ledger's prediction section as Markdown.
"""

from rich.table import Table

from lab.measure.fitted import Fit
from lab.report.format import duration


def prediction_rows(rows, fits: dict[str, Fit], shown: tuple[str, ...] | None = None) -> Table:
    """One row per published point: what was measured, what the model predicts, the error,
    and whether the point calibrated the model or was held out (lab.studies.prediction).
    `shown`: the machine classes of the points shown (gpu, tpu), whose fits the caption
    gives (a class without one is said to be uncalibrated); None: every fit."""
    t = Table(title="the step-time model against published measurements (predicted)")
    for col in (
        "point",
        "publisher",
        "hardware",
        "work",
        "published",
        "predicted",
        "error",
        "role",
    ):
        # a point's id whole (folded, not cut): seven Azure GEMM ids share their first 16
        t.add_column(col, overflow="fold" if col == "point" else "ellipsis")
    for r in sorted(rows, key=lambda r: (r.role == "dropped", r.hardware, r.id)):
        unit = r.unit.split("(")[0].strip()
        pred = "—" if r.predicted is None else f"{r.predicted:,.4g} {unit}"
        err = "—" if r.error is None else f"{r.error:+.0%}"
        role = r.role if r.role != "dropped" else f"dropped: {r.note}"
        t.add_row(
            r.id, r.publisher, r.hardware, r.workload, f"{r.published:,.4g} {unit}", pred, err, role
        )
    t.caption = (
        "error: predicted / published - 1 in the published unit: for a rate (TFLOP/s, GB/s, "
        "tokens/s) + is predicted faster, for a time (ms) + is predicted slower"
    )
    for i, v in enumerate(fits if shown is None else shown):
        f = fits.get(v)
        t.caption += ("; " if i else "\nfitted on the calibration points: ") + (
            f"{v}: compute {f.compute_efficiency:.2f}, memory {f.memory_efficiency:.2f}, "
            f"op {f.op_overhead_s * 1e6:.1f} µs, collective {f.link_latency_s * 1e6:.1f} µs"
            + (f", call {f.call_overhead_s * 1e6:.1f} µs" if f.call_overhead_s is not None else "")
            if f
            else f"{v}: none (no calibration point: the roofline, efficiencies 1, no fixed costs)"
        )
    return t


def prediction_cpu_rows(rows, fit: Fit) -> Table:
    """The CPU self-check: each lab.run configuration measured here and predicted."""
    t = Table(title="the step-time model on this CPU (measured vs predicted, one run)")
    for col in ("lab.run keys", "measured", "predicted", "error", "role"):
        t.add_column(col)
    for r in rows:
        t.add_row(
            r.config, duration(r.measured_s), duration(r.predicted_s), f"{r.error:+.0%}", r.role
        )
    t.caption = (
        f"fitted on the calibration rows: compute {fit.compute_efficiency:.2f} of the "
        f"measured matmul peak, memory {fit.memory_efficiency:.2f} of the measured copy "
        f"bandwidth, {fit.op_overhead_s * 1e6:.1f} µs per op"
    )
    return t


def prediction_here_rows(rows, device_kind: str, ops: bool = False) -> Table:
    """The model against the accelerator at hand: measured, predicted, the error and where the
    predicted time goes (nothing fitted on these rows: all held out). ops=True: single ops,
    with the time per call queued back to back beside the blocked one (the error is taken
    against the queued time)."""
    what = "single ops" if ops else "step-time model"
    t = Table(title=f"the {what} on {device_kind} (measured vs predicted, held out)")
    cols = ("op", "measured", "queued", "predicted", "error", "predicted breakdown")
    for col in cols if ops else ("lab.run keys",) + cols[1:2] + cols[3:]:
        t.add_column(col)
    for r in rows:
        queued = (duration(r.pipelined_s) if r.pipelined_s else "—",) if ops else ()
        if r.error is None:
            measured = duration(r.measured_s) if r.measured_s else "—"
            t.add_row(r.config, measured, *queued, "—", "—", r.error_text)
            continue
        parts = sorted(r.breakdown.items(), key=lambda kv: -kv[1])[:3]
        where = ", ".join(f"{k} {duration(v)}" for k, v in parts if v)
        t.add_row(
            r.config,
            duration(r.measured_s),
            *queued,
            duration(r.predicted_s),
            f"{r.error:+.0%}",
            where,
        )
    return t


def prediction_markdown(records) -> list[str]:
    """The ledger's prediction section as Markdown lines: the error lines, then one table row
    per published point (records of experiments/prediction.py; empty without them)."""
    points = _once([r for r in records if r["config"].get("series") == "prediction_point"])
    if not points:
        return []
    lines = []
    for name in ("prediction_error", "prediction_fallback_error"):
        for r in _once([x for x in records if x["config"].get("series") == name]):
            c = r["config"]
            lines.append(
                f"- {r['what']}"
                + (f" · {r['machine']}" if r.get("machine") else "")
                + f": **{r['value']:.0%}**, worst {c['worst_ratio']:.2f}×, over "
                f"{c['points']} points" + (f" ({c['source']})" if c.get("source") else "")
            )
    lines += [
        "",
        "| point | publisher | hardware | work | published | predicted | error | role |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = {"held-out": 0, "calibration": 1, "dropped": 2}
    for r in sorted(points, key=lambda r: (order.get(r["config"]["fit_role"], 3), r["what"])):
        c = r["config"]
        unit = r["unit"].split("(")[0].strip()
        pred = "—" if r["value"] is None else f"{r['value']:,.4g}"
        err = "—" if c.get("error") is None else f"{c['error']:+.0%}"
        role = c["fit_role"] + (f": {c['note']}" if c.get("note") else "")
        point = c["point"] + (f" · {r['machine']}" if r.get("machine") else "")
        cells = [point, c["publisher"], c["hardware"], c["workload"]]
        cells += [f"{c['published']:,.4g} {unit}", pred, err, role.replace("|", "/")]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _once(rows: list[dict]) -> list[dict]:
    """A merge's rows, each figure once: the model predicts from compiled programs, not from
    the machine that ran it, so folders that agree printed every row once per folder. Rows
    that differ (another lab version's prediction) stay, each named by its compare column;
    rows of one folder carry no name."""
    seen, out = set(), []
    for r in rows:
        c = r["config"]
        key = (c.get("series"), c.get("point"), c.get("fit_role"), r["value"], c.get("points"))
        if key not in seen:
            seen.add(key)
            out.append(r)
    figures = {}
    for r in out:
        figures.setdefault((r["config"].get("series"), r["config"].get("point")), []).append(r)
    return [
        r if len(figures[(r["config"].get("series"), r["config"].get("point"))]) > 1
        else {k: v for k, v in r.items() if k != "machine"}
        for r in out
    ]  # fmt: skip

"""Verdicts and the report from synthetic records: no JAX work, so every claim's range can be
pushed in and out without running anything."""

import re
import sys
from pathlib import Path

import pytest

from lab.measure import records as rec
from lab.report import claims, markdown
from lab.report.format import fmt, rough
from lab.report.verdict import HOLDS, MISSING, NA, OFF, PREDICTED, judge, judge_all

IDS = [f"C{i:02d}" for i in range(1, 23)]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "CLAIMS.md"


def _record(claim, stated, value, *, label="measured", backend=None, **config):
    r = rec.make_record(
        "synthetic",
        value,
        stated.unit,
        label=label,
        claim=claim,
        metric=stated.metric,
        role="evidence",
        **config,
    )
    r["backend"] = backend or stated.backends[0]
    return r


def _inside_and_outside(stated, device=None):
    """A value inside the stated range and one outside it (device kinds: that device's)."""
    lo, hi = stated.range_for(device) if stated.devices else (stated.lo, stated.hi)
    if lo is not None and hi is not None:
        return (lo + hi) / 2, hi * 3
    if lo is not None:
        return (lo * 2 if lo > 0 else 1.0), (lo / 3 if lo > 0 else -1.0)
    return hi / 2, hi * 3


def test_every_claim_id_has_its_ranges_as_data():
    assert [c.id for c in claims.CLAIMS] == IDS
    if SHARED.exists():  # the shared ledger's ids and sources are the ones judged here
        table = re.findall(r"^\| (C\d\d) \|.*\| ([\d, ]+) \| [^|]+\|$", SHARED.read_text(), re.M)
        assert [t[0] for t in table] == IDS
        for (cid, sources), c in zip(table, claims.CLAIMS, strict=True):
            assert tuple(s.strip() for s in sources.split(",")) == c.sources, cid
    for c in claims.CLAIMS:
        assert c.stated and c.topic in claims.TOPICS
        for s in c.stated:
            assert s.devices or s.lo is not None or s.hi is not None, (c.id, s.metric)


def test_no_verdict_without_a_record():
    verdicts = judge_all([])
    assert {v.status for v in verdicts} == {MISSING}
    other = _record("C02", claims.get("C02").stated[0], 100.0, backend="gpu")
    for v in judge_all([other]):
        assert (v.status == MISSING) == (v.claim.id != "C02")


@pytest.mark.parametrize("claim", claims.CLAIMS, ids=lambda c: c.id)
def test_changing_the_measured_value_changes_the_verdict(claim):
    for stated in claim.stated:
        device = next(iter(stated.devices)) if stated.devices else None
        inside, out = _inside_and_outside(stated, device)
        kind = {"device_kind": device} if device else {}
        for value, want in ((inside, HOLDS), (out, OFF)):
            r = _record(claim.id, stated, value, **kind)
            if device:
                r["device_kind"] = device
            check = next(c for c in judge(claim, [r]).checks if c.stated is stated)
            assert check.status == want, (claim.id, stated.metric, value)


def test_labels_and_backends_decide_what_a_record_can_say():
    stated = claims.get("C03").stated[0]  # Tensor Cores: a GPU statement
    gpu = _record("C03", stated, 10.0, backend="gpu", label="derived")
    cpu = _record("C03", stated, 10.0, backend="cpu", label="derived")
    pred = _record("C03", stated, 10.0, backend="cpu", label="predicted", target="h100-sxm")
    ctx = _record("C03", stated, 10.0, backend="gpu", label="derived")
    ctx["config"]["role"] = "context"
    c03 = claims.get("C03")
    assert judge(c03, [gpu]).status == HOLDS
    assert judge(c03, [cpu]).status == NA
    assert judge(c03, [pred]).status == PREDICTED
    assert judge(c03, [ctx]).status == NA
    assert judge(c03, [pred, gpu]).status == HOLDS  # a measurement outranks a prediction


def test_report_says_how_far_off_and_why(tmp_path):
    c01 = claims.get("C01")
    flops = _record("C01", c01.stated[0], 2e12, backend="cpu")
    ref = _record("C20", claims.get("C20").stated[1], 80e9, label="derived", target="h100-sxm")
    ref["config"]["role"] = "reference"
    rec.write_records(tmp_path / "records.jsonl", [flops, ref])
    out = markdown.write_report(tmp_path)
    text = out["path"].read_text()
    for cid in IDS:
        assert f"| {cid} |" in text
    assert "×1.6e+04 (above)" in text and c01.stated[0].if_off in text
    assert "reference, not a verdict" in text and "×2.29 (below)" in text
    assert "**no record**" in text  # claims without records say so, not a verdict


def test_a_host_cpu_figure_measured_beside_an_accelerator_is_labelled_as_the_host():
    """In a GPU process the CPU's own figures (on=cpu) name the machine they came from as
    its host, not as if the accelerator had measured them."""
    c15 = claims.get("C15")
    r = _record("C15", c15.stated[0], 7.05e4, label="derived", backend="gpu", on="cpu")
    r["device_kind"], r["device_count"] = "NVIDIA H200", 1
    assert markdown._tag(r) == "*derived*, cpu, the host of NVIDIA H200 × 1"
    r["config"].pop("on")
    assert markdown._tag(r) == "*derived*, gpu, NVIDIA H200 × 1"
    r["config"]["on"] = "multi"  # a figure compare.py derives from several folders
    assert markdown._tag(r) == "*derived*, multi, NVIDIA H200 × 1"


@pytest.fixture(autouse=True)
def _figures_closed():
    """The figures the helpers below keep open to inspect are closed after each test (pyplot
    keeps every figure it opened until closed)."""
    yield
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is not None:
        plt.close("all")


def _figure_of(monkeypatch, draw, records, tmp_path):
    """The figure a plot function draws, kept open to inspect."""
    from lab.report import plots

    kept = []
    monkeypatch.setattr(plots, "_save", lambda fig, path, **kw: kept.append(fig) or path)
    assert draw(records, tmp_path / "x.png") is not None
    return kept[0]


def _rec(value, backend, kind, **config):
    return {"what": "x", "value": value, "unit": "x", "backend": backend, "device_kind": kind}


def test_a_merged_matmul_plot_names_each_device_and_reads_both(monkeypatch, tmp_path):
    """A CPU's and a GPU's matmul rates in one ledger: a legend names each device, and a
    log scale keeps the CPU's bars readable beside rates 100× larger."""
    from lab.report import plots

    records = [
        {
            **_rec(v * scale, b, k),
            "config": {"series": "matmul_precision", "dtype": d, "precision": "default", "n": 256},
        }
        for b, k, scale in (("cpu", "AMD EPYC", 1), ("gpu", "NVIDIA H100", 100))
        for d, v in (("float32", 1e11), ("bfloat16", 3e11))
    ]
    ax = _figure_of(monkeypatch, plots.matmul, records, tmp_path).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "cpu · AMD EPYC",
        "gpu · NVIDIA H100",
    ]
    assert ax.get_yscale() == "log"


def test_the_memory_legend_sits_beside_the_bars(monkeypatch, tmp_path):
    from lab.report import plots

    predicted = {"params": 2**20, "grads": 2**20, "optimizer": 2**21, "activations": 2**21}
    records = [
        {
            **_rec(6 * 2**20, "cpu", "cpu"),
            "config": {"series": "memory_breakdown", "case": c, "predicted": predicted},
        }
        for c in ("remat=none", "remat=full")
    ]
    fig = _figure_of(monkeypatch, plots.memory, records, tmp_path)
    fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent()
    assert legend.x0 >= ax.get_window_extent().x1  # right of the axes, over no bar


def _drawn(monkeypatch, draw, *args):
    """The figure `draw(args[0], path, *args[1:])` draws, kept open and laid out (its ticks
    and legend placed) to be read."""
    from lab.report import plots

    kept = []
    monkeypatch.setattr(plots, "_save", lambda fig, path, **kw: kept.append(fig) or path)
    draw(*args[:1], Path("unused.png"), *args[1:])
    kept[0].canvas.draw()
    return kept[0]


def _ticks(axis) -> list[str]:
    lo, hi = sorted(axis.get_view_interval())
    return [
        t.get_text()
        for t in axis.get_ticklabels()
        if lo <= t.get_position()[0 if axis.axis_name == "x" else 1] <= hi
    ]


def test_the_scaling_study_counts_devices_and_batches_in_whole_numbers_from_zero(monkeypatch):
    """Device counts and batches ticked as the whole numbers measured (not 1.0, 2.0, nor
    3.80-4.20 around a single batch); time and memory from 0; simulated devices said."""
    from lab.measure.scaling import DPExtrapolation, RematPoint, ScalingStudy, StrongPoint
    from lab.report import plots

    study = ScalingStudy(
        strong=tuple(
            StrongPoint("dp", n, f"data:{n}", s, 0.0, s, 2**21, True)
            for n, s in ((1, 0.0121), (2, 0.0134))
        ),
        extrapolated=tuple(
            DPExtrapolation(n, 2, 0.01, 1e-3, 0.9, 1.0, "measured here", True) for n in (16, 32)
        ),
        remat=(
            RematPoint("none", 4, 0.01, 2.12 * 2**20, 1),
            RematPoint("full", 4, 0.01, 2.04 * 2**20, 1),
        ),
    )
    fig = _drawn(monkeypatch, plots.scaling_study, study, "cpu · jax")
    steps, eff, remat = fig.axes
    assert _ticks(steps.xaxis) == ["1", "2"] and _ticks(eff.xaxis) == ["16", "32"]
    assert _ticks(remat.xaxis) == ["4"]
    assert steps.get_ylim()[0] == 0 and remat.get_ylim()[0] == 0
    assert remat.get_ylim()[1] < 3  # room above 2.12 MiB, not a range of its own
    assert "simulated" in fig._suptitle.get_text()


def test_an_attention_sweep_of_a_subset_draws_only_what_it_measured(monkeypatch):
    """modes=fwd, causal only, one length: a time panel and a memory panel (it drew three
    empty panels and no memory, since memory showed fwd+bwd causal only), in ms, plain ticks."""
    from lab.measure.attention import SweepRow
    from lab.report import plots

    rows = [
        SweepRow(impl, 512, True, "fwd", time_s=t, peak_temp_bytes=b)
        for impl, t, b in (("naive", 3e-4, 4e6), ("blockwise", 2e-4, 1e6))
    ]
    fig = _drawn(monkeypatch, plots.attention_sweep, rows, "attention · cpu")
    time, mem = [ax for ax in fig.axes if ax.axison]
    assert [len(ax.get_lines()) for ax in (time, mem)] == [2, 2]
    assert time.get_ylabel() == "ms per call" and _ticks(time.xaxis) == ["512"]
    assert sorted(y for line in time.get_lines() for y in line.get_ydata()) == pytest.approx(
        [0.2, 0.3]
    )
    assert all("×" not in t and "^" not in t for t in _ticks(time.yaxis) + _ticks(mem.yaxis))


def test_an_attention_sweeps_memory_legend_covers_no_curve(monkeypatch):
    """Four impls × two modes × two masks: a 16-entry legend drawn inside the memory panel
    covered the curves; it sits under the panel's x label, off the data."""
    from lab.measure.attention import SweepRow
    from lab.report import plots

    rows = [
        SweepRow(impl, seq, c, m, time_s=1e-4 * (i + 1) * k, peak_temp_bytes=1e5 * (i + 1) * k)
        for i, impl in enumerate(("blockwise", "naive", "pallas", "xla"))
        for c in (True, False)
        for m in ("fwd", "fwd+bwd")
        for k, seq in enumerate((128, 256, 512), start=1)
    ]
    kept = []
    monkeypatch.setattr(plots, "_save", lambda fig, path, **kw: kept.append(fig) or path)
    plots.attention_sweep(rows, Path("unused.png"), "attention · cpu")
    fig = kept[0]
    fig.tight_layout()  # as _save lays it out
    fig.canvas.draw()
    mem = next(ax for ax in fig.axes if ax.get_title() == "peak temporary memory")
    legend = mem.get_legend()
    assert len(legend.get_texts()) == 16
    box, label = legend.get_window_extent(), mem.xaxis.label.get_window_extent()
    assert box.y1 <= label.y0  # below the x label, so below every curve
    assert box.y0 >= 0  # and inside the figure


def test_the_attention_table_says_its_error_is_relative_and_gives_small_rates_digits():
    """The max error is relative to the reference's largest value (the records say so); a
    rate of 0.0004 TFLOP/s read '0.000' with a fixed three decimals."""
    from rich.console import Console

    from lab.measure.attention import SweepRow
    from lab.report import tables
    from lab.report.format import significant

    row = SweepRow("naive", 64, True, "fwd", time_s=1e-4, tflops=0.000412, max_error=1e-7)
    con = Console(width=200, record=True)
    con.print(tables.attention_sweep([row], "naive", "attention"))
    text = con.export_text()
    assert "max rel. error" in text and "0.000412" in text and "0.000 " not in text
    assert (significant(0.000412), significant(12.345), significant(1234.5)) == (
        "0.000412",
        "12.3",
        "1,234",
    )
    assert (significant(0), significant(None)) == ("0", "n/a")


def test_the_ledger_attention_plot_tells_causal_from_full_at_the_lengths_measured(monkeypatch):
    """Causal and full records of one (impl, mode) are two lines, each named by its mask; the
    lengths are ticked where measured (64 and 128 had no label, 70-90 had 7×10¹ …)."""
    from lab.report import plots

    records = [
        {
            **_rec(t, "cpu", "cpu"),
            "config": {
                "series": "attention",
                "impl": "flash",
                "mode": "fwd+bwd",
                "seq_len": n,
                "median_s": t,
                "temp_bytes": 2**20 * n,
                "causal": causal,
            },
        }  # fmt: skip
        for causal in (True, False)
        for n, t in ((64, 1e-4), (128, 3e-4 if causal else 4e-4))
    ]
    fig = _drawn(monkeypatch, plots.attention, records)
    time, mem = fig.axes
    assert [line.get_label() for line in time.get_lines()] == [
        "flash fwd+bwd causal",
        "flash fwd+bwd full",
    ]
    assert _ticks(time.xaxis) == _ticks(mem.xaxis) == ["64", "128"]
    assert fig._suptitle.get_text() == "attention · cpu"  # cpu · cpu named once


def test_the_ledger_attention_plot_says_a_native_kernels_memory_is_xlas_part(monkeypatch):
    """A native kernel's compiled temporaries leave out its own buffers (the record's
    temp_excludes): its lines say the memory is XLA's part, the others' do not."""
    from lab.report import plots

    records = [
        {
            **_rec(1e-4, "cpu", "cpu"),
            "config": {
                "series": "attention",
                "impl": impl,
                "mode": "fwd+bwd",
                "seq_len": n,
                "median_s": 1e-4 * n,
                "temp_bytes": 3 * 2**10 if impl == "cpu_flash" else 2**12 * n,
                "causal": True,
                **({"temp_excludes": "the kernel's own tiles"} if impl == "cpu_flash" else {}),
            },
        }
        for impl in ("blockwise", "cpu_flash")
        for n in (64, 128)
    ]
    fig = _drawn(monkeypatch, plots.attention, records)
    time, mem = fig.axes
    assert [line.get_label() for line in time.get_lines()] == [
        "blockwise fwd+bwd causal",
        "cpu_flash fwd+bwd causal (memory: XLA's part)",
    ]


def test_the_inference_plot_has_a_legend_naming_both_lines(monkeypatch):
    from lab.report import plots

    records = [
        {
            **_rec(100 * b, "cpu", "cpu"),
            "config": {"series": "inference_batch", "batch": b, "median_s": 0.01 * b},
        }
        for b in (1, 2, 4)
    ]
    fig = _drawn(monkeypatch, plots.inference, records)
    legend = fig.axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["requests/s", "latency per batch (ms)"]
    assert _ticks(fig.axes[0].xaxis) == ["1", "2", "4"]
    assert fig.axes[0].get_ylim()[0] == fig.axes[1].get_ylim()[0] == 0
    assert legend.get_window_extent().y1 <= fig.axes[0].get_window_extent().y0  # over no line


def test_a_merged_plots_legend_stays_below_the_x_label(monkeypatch):
    """Three long machine names, one a line, made a tall legend; tight_layout shrank the axes
    and a legend anchored at a share of their height covered the x label."""
    from lab.report import plots

    names = [f"gpu · NVIDIA H{n}00 80GB HBM3 (run 2026-11-2{n})" for n in (1, 2, 3)]
    records = [
        {
            **_rec(100 * b * (k + 1), "gpu", "gpu"),
            "machine": name,
            "config": {"series": "inference_batch", "batch": b, "median_s": 0.01 * b},
        }
        for k, name in enumerate(names)
        for b in (1, 2, 4)
    ]
    kept = []
    monkeypatch.setattr(plots, "_save", lambda fig, path, **kw: kept.append(fig) or path)
    plots.inference(records, Path("unused.png"))
    fig = kept[0]
    fig.tight_layout()  # as _save lays it out
    fig.canvas.draw()
    ax = fig.axes[0]
    label = ax.xaxis.label.get_window_extent()
    legend = ax.get_legend().get_window_extent()
    assert len(ax.get_legend().get_texts()) == 6
    assert legend.y1 <= label.y0  # below the label, not over it


def test_the_batch_sweep_writes_batches_as_plain_numbers(monkeypatch):
    from lab.report import plots

    records = [
        {
            **_rec(1000 * b, "cpu", "cpu"),
            "config": {"series": "batch_sweep", "batch": b, "memory_bytes": 2**20 * (20 + b)},
        }
        for b in (2, 4, 8)
    ]
    fig = _drawn(monkeypatch, plots.batch_sweep, records)
    assert _ticks(fig.axes[0].xaxis) == ["2", "4", "8"]  # not 2¹, 2², 2³
    assert fig.axes[0].get_ylim()[0] == fig.axes[1].get_ylim()[0] == 0


def test_the_decode_plot_reads_plainly_and_its_legend_covers_nothing(monkeypatch):
    """Several plain tokens/s ticks (one "2¹⁴" alone before), the dashed shares of the roof in
    the legend, the legend off the axes, x over the batches measured (a critical batch past
    them is named, not drawn out there)."""
    from lab.report import plots

    records = [
        {
            **_rec(tps, "cpu", "cpu"),
            "config": {"series": "decode_batch", "batch": b, "int8": q, "memory_roof_share": 0.5},
        }
        for q, base in ((False, 16000), (True, 22000))
        for b, tps in ((1, base), (2, 1.9 * base), (4, 3.5 * base), (8, 6 * base))
    ]
    records.append({**_rec(24, "cpu", "cpu"), "config": {"metric": "decode_critical_batch"}})
    fig = _drawn(monkeypatch, plots.decode, records)
    ax = fig.axes[0]
    ticks = _ticks(ax.yaxis)
    assert len(ticks) >= 3 and all(t.replace(",", "").isdigit() for t in ticks), ticks
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "% of memory roof, float" in labels and "critical batch (ridge): 24" in labels[-1]
    assert ax.get_legend().get_window_extent().y1 <= ax.get_window_extent().y0  # below it
    assert 8 <= ax.get_xlim()[1] < 12
    # a critical batch a few % of a roof would move many times over is drawn as an estimate
    records[-1]["config"] = {"metric": "decode_critical_batch", "sensitivity": 9.6}
    records[-1]["value"] = 1036.6
    legend = _drawn(monkeypatch, plots.decode, records).axes[0].get_legend()
    labels = [t.get_text() for t in legend.get_texts()]
    assert "critical batch (ridge): ~1,000, not well determined" in labels[-1], labels
    assert [rough(x) for x in (0.34, 9.96, 1036.6, 123456)] == ["0.34", "10", "1,000", "120,000"]


def test_the_roofline_names_its_roofs_and_ends_a_little_past_its_points(monkeypatch):
    """The roofs' values written beside them, the axis ending near the last point and the
    ridge (it ran to 10⁴ FLOP/B with the last point at ~341), no label on a point."""
    from lab.report import plots

    peak, bw = 6.5e10, 1.6e10
    ops = [("poly_1", 0.25), ("poly_16", 4.0), ("mm_8", 4.0), ("mm_1024", 341.0)]
    records = [
        {**_rec(peak, "cpu", "cpu"), "config": {"series": "roof", "roof": "peak"}},
        {**_rec(bw, "cpu", "cpu"), "config": {"series": "roof", "roof": "bandwidth"}},
    ] + [
        {
            **_rec(0, "cpu", "cpu"),
            "config": {
                "series": "roofline",
                "name": name,
                "flops": ai * 1e9,
                "bytes": 1e9,
                "median_s": ai / min(peak, ai * bw),
            },
        }  # fmt: skip
        for name, ai in ops
    ]
    fig = _drawn(monkeypatch, plots.roofline, records)
    ax = fig.axes[0]
    assert 341 < ax.get_xlim()[1] < 2000
    texts = [t for t in ax.texts if t.get_text()]
    assert {"peak 65 GFLOP/s", "16 GB/s", "ridge 4.1 FLOP/B"} <= {t.get_text() for t in texts}
    points = [
        ax.transData.transform(xy)
        for line in ax.get_lines()
        if line.get_linestyle() == "None"  # markers only: the points, not the roofs
        for xy in line.get_xydata()
    ]
    for t in texts:
        box = t.get_window_extent()
        assert not any(box.contains(x, y) for x, y in points), t.get_text()
    assert fig.axes[0].get_title().startswith("roofline · cpu (")  # not cpu · cpu


def test_collectives_keep_one_colour_per_op_and_one_line_style_per_axis(monkeypatch):
    """The same op over two mesh axes in one colour, the axes told apart by line style, the
    legend naming both; sizes ticked as 4K, 64K, 1M (they read 4×10³, 6×10³ …)."""
    from lab.measure.collectives import Point
    from lab.measure.timing import BenchResult
    from lab.report import plots

    points = [
        Point(op, axis, 4, size, BenchResult(size / 1e9, 0, 0, 1, 0))
        for axis in ("data", "model")
        for op in ("all-reduce", "ppermute")
        for size in (4096, 65536, 2**20)
    ]
    fig = _drawn(monkeypatch, plots.collectives, points, "collectives")
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert set(lines) == {
        f"{op} @ {a}" for op in ("all-reduce", "ppermute") for a in ("data", "model")
    }
    for op in ("all-reduce", "ppermute"):
        assert lines[f"{op} @ data"].get_color() == lines[f"{op} @ model"].get_color()
    assert lines["all-reduce @ data"].get_color() != lines["ppermute @ data"].get_color()
    for a in ("data", "model"):
        assert (
            lines[f"all-reduce @ {a}"].get_linestyle() == lines[f"ppermute @ {a}"].get_linestyle()
        )
    assert lines["all-reduce @ data"].get_linestyle() != lines["all-reduce @ model"].get_linestyle()
    assert _ticks(fig.axes[0].xaxis) == ["4K", "64K", "1M"]


def test_a_report_of_cpu_times_taken_on_a_busy_host_says_so(tmp_path):
    quiet = rec.make_record("matmul FLOP/s", 1e11, "FLOP/s")
    quiet.update(backend="cpu", load_avg_1m=0.4, cpu_count=2)
    busy = {**quiet, "load_avg_1m": 7.5}
    predicted = {**busy, "label": "predicted"}  # not timed here: never counted
    assert markdown.busy_caution([quiet, quiet, predicted]) == ""
    note = markdown.busy_caution([quiet, busy, predicted])
    assert note.startswith("1 of 2 CPU measurements were timed while other work shared the host")
    assert "load average up to 7.5 on 2 cores" in note
    # other work takes cores from the timed code: its times grow and its rates shrink
    assert "their times come out high and their rates low, both noisy" in note
    assert "times are low" not in note
    rec.write_records(tmp_path / "records.jsonl", [quiet, busy])
    text = markdown.write_report(tmp_path, meta={"size": "quick", "wall_s": 1})["path"].read_text()
    assert "- **Host busy**: 1 of 2 CPU measurements" in text


def test_context_rows_named_alike_say_what_tells_them_apart():
    r = rec.make_record("step time", 0.5, "s", strategy="dp", devices=4)
    assert markdown._context_what(r) == "step time, dp strategy, 4 devices"
    named = rec.make_record("step time, dp over 4 devices", 0.5, "s", strategy="dp", devices=4)
    assert markdown._context_what(named) == "step time, dp over 4 devices"
    assert fmt(0.884, "1") == "0.884"


def test_a_bound_decides_only_where_the_whole_of_what_it_allows_falls():
    from lab.report.verdict import decides

    assert decides(0.2, 0.25, 1, "upper") and not decides(0.3, 0.25, 1, "upper")
    assert decides(0.3, None, 0.5, "upper") and not decides(0.6, None, 0.5, "upper")
    assert decides(2.0, 0.5, 1.0, "lower") and not decides(0.7, 0.5, 1.0, "lower")
    assert decides(0.7, 0.5, None, "lower") and decides(0.7, 0.5, 1.0, None)
    share = claims.get("C06").stated[0]
    for value, status in ((0.1, "off"), (0.6, "n/a here")):
        r = _record("C06", share, value, backend="gpu", label="derived")
        r["config"]["bound"] = "upper"
        (check,) = judge_all([r], [claims.get("C06")])[0].checks
        assert check.status == status


def test_a_measurement_that_is_not_a_number_reads_as_one(tmp_path):
    """A diverged figure (NaN) decides nothing, but the report names it rather than n/a."""
    assert (fmt(float("nan"), "s"), fmt(float("inf"), "B/s"), fmt(None, "s")) == (
        "NaN",
        "inf",
        "n/a",
    )
    from lab.report.format import duration, percent, size

    assert (duration(float("nan")), size(float("inf")), percent(None)) == ("NaN", "inf", "n/a")
    c03 = claims.get("C03")
    r = _record("C03", c03.stated[0], float("nan"))
    assert judge(c03, [r]).status == NA
    rec.write_records(tmp_path / "records.jsonl", [r])
    text = markdown.write_report(tmp_path, meta={"size": "quick", "wall_s": 1})["path"].read_text()
    assert "synthetic" in text and ": NaN (" in text


def test_a_part_only_another_backend_tests_reads_na_not_no_record():
    """C20's L2 and shared memory are read from an NVIDIA driver: on a CPU, whose records of
    the claim are context, those parts are n/a (measured on a GPU only), not missing."""
    c20 = claims.get("C20")
    context = rec.make_record(
        "device kind reported: cpu", 8, "devices", claim="C20", metric=None, role="context"
    )
    context["backend"] = "cpu"
    v = judge(c20, [context])
    l2 = next(c for c in v.checks if c.stated.metric == "l2_cache")
    assert l2.status == NA and v.status == NA
    text = "\n".join(markdown._check_lines(v, [context]))
    assert "measured on gpu only" in text and "nothing recorded for this part" not in text
    # with no record of the claim at all, nothing is judged
    assert judge(c20, []).status == MISSING


def _two_machines(
    series_config, values, machines=("cpu · cpu · tiny · run1", "cpu · cpu · tiny · run2")
):
    """The records of one series from two folders that a merge stamped with their columns:
    `values(k)` → [(value, config)] for machine k."""
    return [
        {**_rec(v, "cpu", "cpu"), "machine": m, "config": {**series_config, **c}}
        for k, m in enumerate(machines)
        for v, c in values(k)
    ]


def test_a_merged_roofline_draws_each_machines_roofs_over_its_own_points(monkeypatch):
    """A CPU folder beside an H100 one: a panel each, titled by its machine, with its own
    roofs' values and only its own points (the merge drew the H100's roofs over every point,
    titled cpu)."""
    from lab.report import plots

    def folder(machine, backend, kind, peak, bw):
        roofs = [
            {**_rec(peak, backend, kind), "config": {"series": "roof", "roof": "peak"}},
            {**_rec(bw, backend, kind), "config": {"series": "roof", "roof": "bandwidth"}},
        ]
        pts = [
            {
                **_rec(0, backend, kind),
                "config": {
                    "series": "roofline",
                    "name": name,
                    "flops": ai * 1e9,
                    "bytes": 1e9,
                    "median_s": ai * 1e9 / (0.5 * min(peak, ai * bw)),
                },  # half way up
            }  # fmt: skip
            for name, ai in (("poly_1", 0.25), ("mm_64", 16.0))
        ]
        return [{**r, "machine": machine} for r in roofs + pts]

    records = folder("cpu · cpu · tiny", "cpu", "cpu", 6.7e10, 3.1e10) + folder(
        "gpu · NVIDIA H100 · tiny", "gpu", "NVIDIA H100", 7e14, 3e12
    )
    fig = _drawn(monkeypatch, plots.roofline, records)
    cpu, gpu = fig.axes
    assert cpu.get_title().startswith("roofline · cpu · cpu · tiny (")
    assert gpu.get_title().startswith("roofline · gpu · NVIDIA H100 · tiny (")
    cpu_texts = {t.get_text() for t in cpu.texts}
    assert {"peak 67 GFLOP/s", "31 GB/s"} <= cpu_texts and "peak 700 TFLOP/s" not in cpu_texts
    assert {"peak 700 TFLOP/s", "3 TB/s"} <= {t.get_text() for t in gpu.texts}
    for ax, top in ((cpu, 6.7e10), (gpu, 7e14)):
        points = [y for line in ax.get_lines() if line.get_linestyle() == "None"
                  for y in line.get_ydata()]  # fmt: skip
        assert len(points) == 2 and max(points) <= top / 2 * 1.0001, points


def test_a_single_folders_roofline_is_one_panel_titled_by_its_device(monkeypatch):
    from lab.report import plots

    records = [
        {**_rec(6.5e10, "cpu", "cpu"), "config": {"series": "roof", "roof": "peak"}},
        {**_rec(1.6e10, "cpu", "cpu"), "config": {"series": "roof", "roof": "bandwidth"}},
        {**_rec(0, "cpu", "cpu"), "config": {"series": "roofline", "name": "poly_1",
                                             "flops": 1e9, "bytes": 4e9, "median_s": 1.0}},
    ]  # fmt: skip
    fig = _drawn(monkeypatch, plots.roofline, records)
    (ax,) = fig.axes
    assert ax.get_title() == "roofline · cpu (measured roofs and points)"


def test_merged_line_plots_draw_a_series_per_machine_named_by_its_column(monkeypatch):
    """Two CPU folders merged: batch, inference and losses draw one line per folder (one line
    joined both folders' points and zigzagged at each batch), named by the columns the compare
    table uses; one folder's plots keep their plain labels."""
    from lab.report import plots

    run1, run2 = "cpu · cpu · tiny · run1", "cpu · cpu · tiny · run2"
    batch = _two_machines(
        {"series": "batch_sweep"},
        lambda k: [(1000 * b * (k + 1), {"batch": b, "memory_bytes": 2**20 * (20 + b)})
                   for b in (2, 8)],
    )  # fmt: skip
    fig = _drawn(monkeypatch, plots.batch_sweep, batch)
    ax, ax2 = fig.axes
    assert [(line.get_label(), list(line.get_xdata())) for line in ax.get_lines()] == [
        (f"tokens/s · {run1}", [2, 8]),
        (f"tokens/s · {run2}", [2, 8]),
    ]
    assert [line.get_label() for line in ax2.get_lines()] == [
        f"memory (compiled) · {run1}",
        f"memory (compiled) · {run2}",
    ]
    assert len({line.get_color() for line in ax.get_lines()}) == 2
    assert "·" not in ax.get_title()  # one machine named for both would be wrong
    inference = _two_machines(
        {"series": "inference_batch"},
        lambda k: [(100 * b + k, {"batch": b, "median_s": 0.01 * b}) for b in (1, 4)],
    )
    fig = _drawn(monkeypatch, plots.inference, inference)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == [
        f"requests/s · {run1}",
        f"requests/s · {run2}",
        f"latency per batch (ms) · {run1}",
        f"latency per batch (ms) · {run2}",
    ]
    assert [len(line.get_xdata()) for line in fig.axes[0].get_lines()] == [2, 2]
    losses = _two_machines(
        {"series": "loss_curve"},
        lambda k: [
            (0, {"dtype": d, "losses": [5.0, 4.0 + k, 3.0]}) for d in ("float32", "bfloat16")
        ],
    )
    fig = _drawn(monkeypatch, plots.losses, losses)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == [f"float32 · {run1}", f"bfloat16 · {run1}", f"float32 · {run2}",
                      f"bfloat16 · {run2}"]  # fmt: skip
    assert len(set(labels)) == 4
    alone = [r for r in losses if r["machine"] == run1]
    for r in alone:
        del r["machine"]
    fig = _drawn(monkeypatch, plots.losses, alone)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["float32", "bfloat16"]


def test_a_cpu_beside_a_gpu_reads_on_a_log_scale_in_a_merged_line_plot(monkeypatch):
    from lab.report import plots

    batch = _two_machines(
        {"series": "batch_sweep"},
        lambda k: [(2e4 * 500**k * b, {"batch": b, "memory_bytes": 2**20 * 3}) for b in (2, 8)],
        machines=("cpu · cpu", "gpu · NVIDIA H100"),
    )
    fig = _drawn(monkeypatch, plots.batch_sweep, batch)
    assert fig.axes[0].get_yscale() == "log" and fig.axes[1].get_ylim()[0] == 0


def test_merged_bar_and_panel_plots_name_each_machine(monkeypatch, tmp_path):
    """matmul: a bar colour and legend entry per folder (six bars said "cpu"); memory,
    attention and decode: a panel per folder, titled by it."""
    from lab.report import plots

    run1, run2 = "cpu · cpu · tiny · run1", "cpu · cpu · tiny · run2"
    matmul = _two_machines(
        {"series": "matmul_precision", "precision": "default", "n": 128},
        lambda k: [(v, {"dtype": d}) for d, v in (("float32", 3e10), ("bfloat16", 4e10))],
    )
    ax = _figure_of(monkeypatch, plots.matmul, matmul, tmp_path).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [run1, run2]
    predicted = {"params": 2**20, "grads": 2**20, "optimizer": 2**21, "activations": 2**21}
    memory = _two_machines(
        {"series": "memory_breakdown", "predicted": predicted},
        lambda k: [(6 * 2**20, {"case": c}) for c in ("remat=none", "remat=full")],
    )
    fig = _drawn(monkeypatch, plots.memory, memory)
    assert [a.get_title() for a in fig.axes] == [
        f"training memory: calculator vs compiler · {m}" for m in (run1, run2)
    ]
    assert [[t.get_text() for t in a.get_xticklabels()] for a in fig.axes] == [
        ["remat=none", "remat=full"]
    ] * 2
    attention = _two_machines(
        {"series": "attention", "impl": "xla", "mode": "fwd", "causal": True},
        lambda k: [(0, {"seq_len": s, "median_s": 1e-3 * s / 64, "temp_bytes": s * 2**10})
                   for s in (64, 128)],
    )  # fmt: skip
    fig = _drawn(monkeypatch, plots.attention, attention)
    assert [a.get_title() for a in fig.axes] == [
        f"{what} · {m}" for m in (run1, run2) for what in ("time", "memory")
    ]
    assert all(len(line.get_xdata()) == 2 for a in fig.axes for line in a.get_lines())
    decode = _two_machines(
        {"series": "decode_batch", "int8": False, "memory_roof_share": 0.5},
        lambda k: [(1000 * b, {"batch": b}) for b in (1, 2)],
    ) + [
        {**_rec(at, "cpu", "cpu"), "machine": m, "config": {"metric": "decode_critical_batch"}}
        for m, at in ((run1, 4), (run2, 1.5))
    ]
    fig = _drawn(monkeypatch, plots.decode, decode)
    left, right = (a for a in fig.axes if a.get_title())
    assert left.get_title().endswith(f"· {run1}") and right.get_title().endswith(f"· {run2}")
    assert "critical batch (ridge): 4, past the batches measured" in [
        t.get_text() for t in left.get_legend().get_texts()
    ]
    assert "critical batch (ridge): 1.5" in [t.get_text() for t in right.get_legend().get_texts()]


def test_a_merged_verdict_table_names_the_machine_of_every_value():
    """A merge's records carry their folder's column (`machine`): the verdict table says whose
    each value is (it read `0.0686× step ×3.64 below; 0.9× step`), a ratio of two folders
    says merged, every folder's values show (not the first two of them), and one folder's
    table reads as it did."""
    c06 = claims.get("C06").stated[0]
    # (C06 is judged on accelerators: a CPU's share is context, so the first folder is a GPU's)
    cpu = {**_record("C06", c06, 0.0686, backend="gpu"), "machine": "gpu · NVIDIA A100 · quick"}
    gpu = {**_record("C06", c06, 0.9, backend="gpu"), "machine": "gpu · NVIDIA H100 · tiny"}
    tpu = {**_record("C06", c06, 0.5, backend="tpu"), "machine": "tpu · TPU v5 lite · tiny"}
    (v,) = judge_all([cpu, gpu, tpu], [claims.get("C06")])
    n = c06.name
    assert markdown.measured_cell(v, [cpu, gpu, tpu]) == (
        f"{n}: 0.0686× step (gpu · NVIDIA A100 · quick) ×3.64 below; {n}: 0.9× step (gpu · "
        f"NVIDIA H100 · tiny); {n}: 0.5× step (tpu · TPU v5 lite · tiny)"
    )
    c01 = claims.get("C01").stated[1]
    pair = _record("C01", c01, 200.0, label="derived", backend="multi", on="gpu")  # compare's
    # ratio of two folders' figures, judged on the accelerator's backend
    pred = {**_record("C01", c01, 220.0, label="predicted", backend="cpu"), "machine": "cpu · cpu"}
    (v,) = judge_all([pair, pred], [claims.get("C01")])
    assert "200× (merged)" in markdown.measured_cell(v, [pair, pred])
    (v,) = judge_all([pred], [claims.get("C01")])
    assert markdown.measured_cell(v, [pred]) == f"{c01.name}: 220× (pred., cpu · cpu)"
    alone = [{k: x for k, x in r.items() if k != "machine"} for r in (cpu, gpu, tpu)]
    (v,) = judge_all(alone, [claims.get("C06")])
    assert markdown.measured_cell(v, alone) == f"{n}: 0.0686× step ×3.64 below; {n}: 0.9× step"


def test_c06_is_decided_on_accelerators_and_a_cpu_share_is_context(tmp_path):
    """'Today's GPUs … waiting on memory': a CPU's share (its ridge is a few FLOP/B, so its
    matmuls dominate) is context, never `off`, and never outranks the H100 prediction; a
    GPU's measured share decides, alone or merged with a CPU folder."""
    c06 = claims.get("C06")
    share = c06.stated[0]
    assert "cpu" not in share.backends
    cpu = _record("C06", share, 0.0686, backend="cpu", label="derived", bound="upper")
    h100 = _record("C06", share, 0.9, label="predicted", target="h100-sxm")
    gpu = _record("C06", share, 0.9, backend="gpu", label="derived")
    assert judge(c06, [cpu]).status == NA
    v = judge(c06, [cpu, h100])
    assert v.status == PREDICTED and [x.index for x in v.checks[0].readings] == [1]
    assert 0 in v.checks[0].context
    assert judge(c06, [cpu, gpu]).status == HOLDS  # a merge: the GPU's figure decides
    assert judge(c06, [cpu, gpu, h100]).status == HOLDS
    rec.write_records(tmp_path / "records.jsonl", [cpu, h100])
    text = markdown.write_report(tmp_path, meta={"size": "quick", "wall_s": 1})["path"].read_text()
    (row,) = [line for line in text.splitlines() if line.startswith("| C06 |")]
    assert row.endswith("| **predicted** |") and "0.0686" not in row


def test_an_upper_bound_that_decides_says_so_in_its_reading(tmp_path):
    """C01's datasheet-peak ratios are upper bounds: one above the range decides nothing (it
    is not 'outside … (above)'), one below it decides, and its reading says it is a bound."""
    c01 = claims.get("C01")
    speedup = c01.stated[1]
    above = _record("C01", speedup, 4970.0, label="predicted", target="h100-sxm", bound="upper")
    below = _record("C01", speedup, 81.4, label="predicted", target="t4", bound="upper")
    check = judge(c01, [above, below]).checks[1]
    assert check.status == PREDICTED and [x.index for x in check.readings] == [1]
    assert 0 in check.context
    rec.write_records(tmp_path / "records.jsonl", [above, below])
    text = markdown.write_report(tmp_path, meta={"size": "quick", "wall_s": 1})["path"].read_text()
    assert "an upper bound: it decides nothing here" in text
    assert "81.4× (*predicted*, for t4, an upper bound) — outside" in text
    assert "(above)" not in text


def test_the_table_shows_a_parts_own_context_figure_before_the_claims_others(tmp_path):
    """A claim decided nowhere here shows, in the table, the figure of its stated part that
    was shown as context (C06: this CPU's share), not whichever record came first."""
    c06 = claims.get("C06")
    roof = rec.make_record("roof: compute", 8.6e10, "FLOP/s", claim="C06", metric=None)
    cpu = _record("C06", c06.stated[0], 0.0881, backend="cpu", label="derived", bound="upper")
    cpu["config"]["role"] = "context"
    v = judge(c06, [roof, cpu])
    assert v.status == NA
    cell = markdown.measured_cell(v, [roof, cpu])
    # the figure keeps its words (a peak ratio read as a measured speed-up without them)
    assert cell.startswith("context: 0.0881× step (synthetic; *derived*, cpu")


def test_every_figure_in_the_table_says_what_it_is():
    """A bare '1.09×' in the measured column said nothing: every stated part has a short name,
    each figure is shown after it, a part stated per device says the device, a context cell
    drops its description's asides (the claim's section keeps them whole) and a spec table's
    figure is marked as not measured."""
    assert all(s.name for c in claims.CLAIMS for s in c.stated)
    c16 = claims.get("C16")
    gpu = c16.stated[1]
    assert gpu.devices
    a = _record("C16", gpu, 1e4, label="predicted", target="rtx-4090")
    b = _record("C16", gpu, 6e4, label="predicted", target="h100-sxm")
    (v,) = judge_all([a, b], [c16])
    cell = markdown.measured_cell(v, [a, b])
    assert cell.startswith(f"{gpu.name}: 10 kreq/s (pred., rtx-4090)"), cell
    assert f"{gpu.name}: 60 kreq/s (pred., h100-sxm)" in cell, cell
    c20 = claims.get("C20")
    spec = _record("C20", c20.stated[1], 80e9, label="derived", target="h100-sxm")
    spec["config"]["role"] = "reference"
    spec["what"] = "NVIDIA H100 SXM5 80GB: memory in the spec table (a datasheet (p. 3))"
    (v,) = judge_all([spec], [c20])
    cell = markdown.measured_cell(v, [spec])
    assert cell.startswith(
        "reference, not measured: 80 GB (NVIDIA H100 SXM5 80GB: memory in the spec table; *derived*"
    ), cell
    long = "word " * 100 + "(an aside (nested)) end"
    short = markdown._without_asides(long)
    assert "aside" not in short and short.endswith(" …") and len(short) <= 202, short
    # a bracket after a word is not an aside; a text that is all aside is kept; no space: cut
    assert markdown._without_asides("slope of log(bytes) on log(L)") == (
        "slope of log(bytes) on log(L)"
    )
    assert markdown._without_asides(" (all aside)") == " (all aside)"
    assert markdown._without_asides("x" * 300) == "x" * 200 + " …"
    # a part stated for any device names none; a measured figure comes before a spec's
    c01 = claims.get("C01").stated[0]
    plain = _record("C01", c01, 2e12, target="h100-sxm")
    (v,) = judge_all([plain], [claims.get("C01")])
    assert "h100" not in markdown.measured_cell(v, [plain])
    here = _record("C20", c20.stated[1], 90e9, label="measured", backend="cpu")
    here["config"]["role"] = "context"
    (v,) = judge_all([spec, here], [c20])
    assert markdown.measured_cell(v, [spec, here]).startswith("context: 90 GB"), v
    # the claim's section heads each part by its name, its id beside it
    lines = markdown._check_lines(v, [spec, here])
    assert f"- **{c20.stated[1].name}** (`{c20.stated[1].metric}`) — *" in "\n".join(lines)


def test_a_share_too_small_to_show_reads_as_under_the_least_shown():
    """16 MiB of an H100's 80 GB is not 0.0% of it: a share above zero that rounds to zero
    reads '<0.1%'; zero and larger shares read as before."""
    from lab.report.format import percent

    assert percent(16 * 2**20 / 80e9 / 10) == "<0.1%"
    assert percent(0.0003, 0) == "<1%"
    assert (percent(0.0), percent(0.006), percent(0.123)) == ("0.0%", "0.6%", "12.3%")


def test_a_gpu_claim_is_judged_on_gpu_ratios_and_a_tpu_ratio_is_context(tmp_path):
    """'GPUs are ~100× faster than CPUs': in a merge of a CPU, a GPU and a TPU folder, the
    GPU-over-CPU ratio decides and a TPU-over-CPU ratio outside the range is shown beside
    it, never making the GPU claim off. The same for C01's GPU matmul speed-up and C04's
    Tensor Core speed-up."""

    def merged(claim, stated, value, on):  # as experiments.compare derives it
        r = _record(claim, stated, value, label="derived", backend="multi", on=on)
        r["device_kind"] = f"{on} over cpu"
        return r

    for claim, part in (("C02", 0), ("C01", 1), ("C04", 1)):
        c = claims.get(claim)
        stated = c.stated[part]
        inside = stated.lo * 1.1 if stated.hi is None else (stated.lo + stated.hi) / 2
        gpu, tpu = merged(claim, stated, inside, "gpu"), merged(claim, stated, 0.5, "tpu")
        check = judge(c, [gpu, tpu]).checks[part]
        assert check.status == HOLDS and [x.index for x in check.readings] == [0], claim
        assert 1 in check.context
        assert judge(c, [tpu]).checks[part].status == NA  # a TPU alone judges nothing
    c02 = claims.get("C02")
    gpu, tpu = merged("C02", c02.stated[0], 100.0, "gpu"), merged("C02", c02.stated[0], 20.0, "tpu")
    rec.write_records(tmp_path / "records.jsonl", [gpu, tpu])
    text = markdown.write_report(tmp_path, meta={"size": "quick", "wall_s": 1})["path"].read_text()
    (row,) = [line for line in text.splitlines() if line.startswith("| C02 |")]
    assert row.endswith("| **holds** |") and "20×" not in row
    assert "20×" in text.split("### C02")[1]  # the TPU's ratio, shown as context


def test_an_attention_time_shows_its_spread_in_the_record_and_the_report(tmp_path, monkeypatch):
    """The ledger's C08 time rows keep each median's p10 and p90 and the number of samples
    (every contender, PyTorch's with its threads), and the report prints the spread, so a
    median made of a few scattered samples reads as such."""
    from experiments import attention as c08
    from lab.studies import attention as bench

    def bench_record(impl, seq, median, **extra):
        config = dict(impl=impl, seq=seq, mode="fwd+bwd", causal=True, **extra)
        return rec.make_record("attention time", median, "s", **config)

    spread = dict(p10_s=0.77e-3, p90_s=1.27, runs=3, inner=1)
    torch = dict(torch_version="2.13", torch_threads=2, omp_wait_policy="PASSIVE")
    raw = [bench_record("torch_sdpa", 256, 0.0209, **spread, **torch)]
    raw.append(bench_record("xla", 256, 2e-3, p10_s=1.9e-3, p90_s=2.2e-3, runs=5, inner=2))
    records = c08._context(c08._rows(raw), bench.Shape(1, 2, 1, 16))
    by_impl = {r["config"]["impl"]: r["config"] for r in records}
    assert by_impl["torch_sdpa"].items() >= {**spread, **torch}.items()
    assert by_impl["xla"]["p90_s"] == 2.2e-3 and "torch_threads" not in by_impl["xla"]
    rec.write_records(tmp_path / "records.jsonl", records)
    text = markdown.write_report(tmp_path, meta={"size": "tiny", "wall_s": 1})["path"].read_text()
    (line,) = [x for x in text.splitlines() if x.startswith("  - torch_sdpa fwd+bwd, L=256")]
    assert "(p10–p90 770 µs–1.27 s, 3 runs)" in line, line
    # and the plot draws each line's p10–p90 as a band around it
    from lab.report import plots

    monkeypatch.setattr(plots, "_save", lambda fig, path, **kw: fig)
    fig = plots.attention(records, tmp_path / "attention.png")
    assert len(fig.axes[0].collections) == 2  # one band per line
    plots._plt().close(fig)


def test_the_decode_plots_title_says_what_bounds_its_points(monkeypatch):
    """The title names the bound the float points' records give, by batch (an overhead-bound
    sweep is not called memory-bound), and claims none where the records say none."""
    from lab.report import plots

    def rec(b, bound=None):
        config = {"series": "decode_batch", "batch": b, "int8": False, "memory_roof_share": 0.05}
        if bound:
            config["bound"] = bound
        return {**_rec(100.0 * b, "cpu", "cpu"), "config": config}

    over = [rec(b, "overhead") for b in (1, 2, 4)]
    title = _drawn(monkeypatch, plots.decode, over).axes[0].get_title()
    assert title.startswith("decode, float weights: overhead-bound at batch 1-4")
    assert "memory" not in title
    mixed = [rec(1, "memory"), rec(2, "memory"), rec(4, "compute")]
    title = _drawn(monkeypatch, plots.decode, mixed).axes[0].get_title()
    assert "memory-bound at batch 1-2, compute-bound at batch 4" in title, title
    title = _drawn(monkeypatch, plots.decode, [rec(1), rec(2)]).axes[0].get_title()
    assert title.startswith("decode tokens/s by batch") and "bound" not in title, title


def test_a_claim_that_holds_on_some_parts_says_which_were_not_judged(tmp_path):
    """'holds' is never read as every part measured: where a part could not be judged here
    (flash attention's speed-up needs an accelerator), the row names it beside the verdict;
    a claim judged on every part shows the verdict alone."""
    c08 = claims.get("C08")
    error, speedup, exponent = c08.stated
    recs = [
        _record("C08", error, 1.5e-6, backend="cpu"),
        _record("C08", exponent, -0.03, backend="cpu"),
    ]
    rec.write_records(tmp_path / "records.jsonl", recs)
    text = markdown.write_report(tmp_path, meta={"size": "quick", "wall_s": 1})["path"].read_text()
    (row,) = [line for line in text.splitlines() if line.startswith("| C08 |")]
    assert row.endswith("| **holds** (2 of 3 parts; flash ÷ naive speed n/a here) |"), row
    rec.write_records(tmp_path / "records.jsonl", [_record("C08", speedup, 3.0, backend="gpu")])
    text = markdown.write_report(tmp_path, meta={"size": "quick", "wall_s": 1})["path"].read_text()
    (row,) = [line for line in text.splitlines() if line.startswith("| C08 |")]
    assert row.endswith("| **holds** |"), row


def test_a_sweep_whose_baseline_never_ran_says_why_its_ratio_column_is_empty():
    """The default baseline (xla) skipped for a mask it cannot take: the caption says so and
    names baseline=, instead of an empty column with no word; a sweep whose baseline ran has
    no such caption."""
    from lab.measure.attention import SweepRow
    from lab.report import tables

    why = "takes no document mask"
    rows = [
        SweepRow("xla", 512, True, "fwd", skipped=why),
        SweepRow("blockwise", 512, True, "fwd", time_s=2e-4, tflops=1.0, max_error=1e-7),
    ]
    t = tables.attention_sweep(rows, "xla", "t")
    assert t.caption == (
        f"time ÷ xla's is empty: xla did not run ({why}); give baseline= one of the impls that ran"
    ), t.caption
    ran = [SweepRow("xla", 512, True, "fwd", time_s=3e-4, tflops=1.0, max_error=1e-7), rows[1]]
    assert tables.attention_sweep(ran, "xla", "t").caption is None
    # nothing ran at all: no baseline to suggest among "the impls that ran"
    none = [rows[0], SweepRow("naive", 512, True, "fwd", skipped="does not take float16")]
    caption = tables.attention_sweep(none, "xla", "t").caption
    assert caption == "no impl asked for ran: each row says why it was skipped", caption


def test_a_ledger_that_judges_nothing_says_so_and_colours_no_verdict():
    """size=tiny checks that the studies run: its terminal ledger is titled as a smoke test
    and shows no verdict in a pass or failure colour; a real size's is coloured."""
    import dataclasses

    from rich.console import Console

    from lab.report import tables

    vs = [dataclasses.replace(judge(claims.BY_ID["C01"], []), status=s) for s in (HOLDS, OFF)]
    for judged, title in ((False, "a smoke test, no claim judged"), (True, "claims ledger")):
        console = Console(record=True, width=160, force_terminal=True, color_system="truecolor")
        console.print(tables.verdicts(vs, "too small to judge", judged=judged))
        styled = console.export_text(styles=True, clear=False)
        plain = console.export_text()
        assert title in plain and "holds" in plain and "off" in plain
        coloured = (
            "\x1b[32m" in styled or "\x1b[38;5;2m" in styled or "\x1b[38;2;0;128;0m" in styled
        )
        assert ("smoke test" in plain) != judged
        assert ("read at size tiny (no verdict)" in plain) != judged  # its column says so too
        assert coloured == judged, styled
    # a smoke test's `off` says no distance either: nothing was judged
    c01 = claims.get("C01")
    off = judge(c01, [_record("C01", c01.stated[0], 2e12, backend="cpu")])
    for judged in (False, True):
        console = Console(record=True, width=200)
        console.print(tables.verdicts([off], "", judged=judged))
        assert ("×1.6e+04 above" in console.export_text()) == judged


def test_the_terminal_ledger_says_how_far_off_and_which_claims_only_tiny_folders_decide():
    """An `off` in the terminal says by how much, as REPORT.md does; a comparison's claim that
    only tiny folders decide says so and is not coloured as a pass or a failure."""
    from rich.console import Console

    from lab.report import tables

    c01 = claims.get("C01")
    off = judge(c01, [_record("C01", c01.stated[0], 2e12, backend="cpu")])
    assert off.status == OFF
    lo, _ = _inside_and_outside(c01.stated[0])
    holds = judge(c01, [_record("C01", c01.stated[0], lo, backend="cpu")])
    assert holds.status == HOLDS
    for tiny_only, coloured in ((frozenset(), True), (frozenset({"C01"}), False)):
        console = Console(record=True, width=200, force_terminal=True, color_system="truecolor")
        console.print(tables.verdicts([off], "", tiny_only=tiny_only))
        plain = console.export_text(styles=False, clear=False)
        styled = console.export_text(styles=True)
        assert "off (×1.6e+04 above" in plain, plain
        assert ("size tiny only" in plain) != coloured, plain
        red = "\x1b[31m" in styled or "\x1b[38;2;128;0;0m" in styled or "\x1b[91m" in styled
        assert red == coloured, styled
    assert tables.off_by(holds) == "" and tables.off_by(off) == "×1.6e+04 above"
    # a prediction outside its range says by how much, as an `off` does; one inside, nothing
    far = judge(c01, [_record("C01", c01.stated[0], 2e12, label="predicted", backend="cpu")])
    near = judge(c01, [_record("C01", c01.stated[0], lo, label="predicted", backend="cpu")])
    assert far.status == near.status == PREDICTED
    assert tables.off_by(far) == "×1.6e+04 above" and tables.off_by(near) == ""


def test_long_durations_read_in_hours_and_huge_sizes_in_whole_gib():
    """Past two hours a duration reads in hours ('1e9 s' of samples was '16,666,666.7 min');
    past 100 GiB a refusal's size drops its tenths."""
    from lab.measure.memory import _gib
    from lab.report.format import duration

    assert duration(2 * 3600 - 1) == "120.0 min" and duration(2 * 3600) == "2.0 h"
    assert duration(1e9) == "277,777.8 h"
    assert _gib(99.94 * 2**30) == "99.9 GiB" and _gib(100 * 2**30) == "100 GiB"

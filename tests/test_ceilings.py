"""Ceilings and roofline: the code path at tiny sizes (no timed assertion), the roof maths."""

import json
import math

import jax.numpy as jnp
import pytest

from lab.measure import ceilings, records, roofline, specs
from lab.tools import ceilings as ceilings_tool


def test_roof_maths():
    assert roofline.ridge_point(100.0, 10.0) == 10.0
    assert roofline.attainable(1.0, 100.0, 10.0) == 10.0  # memory-bound
    assert roofline.attainable(50.0, 100.0, 10.0) == 100.0  # compute-bound
    p = roofline.Point("mm_1", flops=8.0, bytes=4.0, median_s=2.0)
    assert (p.intensity, p.flops_per_s) == (2.0, 4.0)


def test_python_m_lab_tools_ceilings_quick(tmp_path, capsys):
    """The whole `python -m lab.tools.ceilings` path at tiny sizes: table, records, PNG."""
    assert ceilings_tool.main(["quick=true", "budget=0.02", f"out_dir={tmp_path}"]) == 0
    shown = capsys.readouterr().out
    assert "ceilings · cpu" in shown and "GFLOP/s" in shown and "GB/s" in shown
    assert "quick=true: tiny sizes check the code path, not the ceilings" in shown
    (jsonl,) = tmp_path.glob("ceilings-cpu-*.jsonl")
    recs = records.read_records(jsonl)
    assert {r["backend"] for r in recs} == {"cpu"}
    by_what = {r["what"]: r for r in recs}
    # one record per row, and the rows a stopped run names as missing are the rows a run makes
    assert len(by_what) == len(recs) and set(by_what) == set(ceilings.planned_rows(quick=True))
    for what in (
        "matmul float32 precision=highest",
        "matmul float32 precision=default",
        "matmul bfloat16 precision=default",
        "matmul int8 precision=default",
        "matmul float32 numpy BLAS",
        "copy bandwidth (read+write)",
        "host→device bandwidth",
        "device→host bandwidth",
        "memory roof",
        "ridge point (compute roof / memory roof)",
    ):
        assert by_what[what]["value"] > 0, what
    sweep = [r for r in recs if r["what"].startswith("roofline ")]
    assert len(sweep) >= 6 and all(r["config"]["intensity"] > 0 for r in sweep)
    intensities = sorted(r["config"]["intensity"] for r in sweep)
    assert by_what["memory roof"]["value"] >= by_what["copy bandwidth (read+write)"]["value"]
    assert intensities[0] < 1 < 10 < intensities[-1]  # both sides of any plausible ridge
    (png,) = tmp_path.glob("ceilings-cpu-*.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(recs)
    # a ratio of two rows, the best of other rows and their ratio are derived, not measured
    derived = {
        "matmul float32 jax / numpy",
        "compute roof",
        "memory roof",
        "ridge point (compute roof / memory roof)",
    }
    assert {r["what"] for r in recs if r["label"] == "derived"} == derived
    assert {r["label"] for r in recs if r["what"] not in derived} == {"measured"}
    from lab.report import runbook  # the runbook's line still finds the roofs it reads

    line, _ = runbook.ceilings(recs, tmp_path)
    assert "memory roof" in line and "ridge" in line and "copy" in line


def test_roofs_are_the_best_measured_so_no_op_sits_above_them():
    """A copy measured low on a noisy host must not leave sweep points at 450% of the roof
    (seen here: copy 8.0 GB/s while poly_1 moved 36 GB/s)."""
    mm = {("float32", "default"): {"flops_per_s": 100.0}}
    fast = roofline.Point("poly_1", flops=1.0, bytes=36.0, median_s=1.0)  # 36 B/s
    slow = roofline.Point("mm_8", flops=50.0, bytes=2.0, median_s=1.0)
    peak, bw, how = ceilings.roofs(mm, 8.0, [fast, slow])
    assert (peak, bw) == (100.0, 36.0) and how.startswith("poly_1, which moved bytes faster")
    assert "78% below it" in how
    for p in (fast, slow):
        assert p.flops_per_s <= roofline.attainable(p.intensity, peak, bw) * (1 + 1e-9)
    assert ceilings.roofs(mm, 40.0, [fast, slow])[1:] == (40.0, "the copy kernel's (x ← x·s)")


def test_matmul_peak_is_cached_per_process():
    first = ceilings.matmul_peak("float32", n=128, budget_s=0.01)
    assert first > 0 and math.isfinite(first)
    assert ceilings.matmul_peak("f32", n=128, budget_s=0.01) == first  # alias, same entry
    assert ceilings._cached_peak.cache_info().hits >= 1


def test_matmul_dtypes():
    r = ceilings.measure_matmul("bf16", n=64, budget_s=0.01)
    assert (r["dtype"], r["precision"], r["flops"]) == ("bfloat16", "default", 2 * 64**3)
    r = ceilings.measure_matmul("int8", n=64, budget_s=0.01)  # int8 × int8 → int32
    assert (r["dtype"], r["flops"]) == ("int8", 2 * 64**3) and r["flops_per_s"] > 0
    with pytest.raises(ValueError, match="dtype"):
        ceilings.measure_matmul("int4", n=64)


def test_the_compute_roof_is_a_float_matmul():
    """int8 (and fp8) run on other units at other rates: they are measured, but the roof
    float ops are held against is the best float matmul."""
    mm = {
        ("float32", "default"): {"flops_per_s": 100.0},
        ("int8", "default"): {"flops_per_s": 400.0},
    }
    assert ceilings.roofs(mm, 10.0, [])[0] == 100.0


@pytest.mark.parametrize(
    "argv, needle", [(["budget=-1"], "budget='-1': must be >= 0.01"), (["quik=true"], "quick")]
)
def test_bad_options_are_one_line_and_exit_2(argv, needle, capsys):
    assert ceilings_tool.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_the_table_holds_each_row_against_its_datasheet_figure():
    """A float32 matmul at default precision runs as TF32 on an H100, so its share is of the
    TF32 peak; copies are held against the memory bandwidth; the rest against nothing."""
    from rich.console import Console

    from lab.report import tables

    spec = specs.lookup("NVIDIA H100 80GB HBM3")
    rows = (
        ceilings.Row("matmul float32 precision=default", 247.25e12, "FLOP/s", "", "tf32"),
        ceilings.Row("matmul bfloat16 precision=default", None, "FLOP/s", "", "bfloat16"),
        ceilings.Row(
            "copy bandwidth (read+write)", spec.memory_bandwidth / 2, "B/s", "", "memory_bandwidth"
        ),
        ceilings.Row("ridge point (compute roof / memory roof)", 300.0, "FLOP/B"),
    )
    c = ceilings.Ceilings(rows, (), (), 1e15, 3e12, (), spec, 1.0)
    assert c.ridge == roofline.ridge_point(1e15, 3e12)
    assert c.share_of_spec(rows[0]) == (247.25e12 / spec.peak_flops["tf32"], "tf32")
    assert c.share_of_spec(rows[1]) is None and c.share_of_spec(rows[3]) is None
    con = Console(width=200, record=True)
    con.print(tables.ceilings(c, "t"))
    text = con.export_text()
    assert "50% of tf32 spec" in text and "50% of spec" in text and "n/a" in text


def test_the_jax_over_numpy_note_follows_the_ratio():
    from lab.measure.ceilings import matmul_ratio_note

    assert "faster than the usual" in matmul_ratio_note(1.86)
    assert "as fast as the usual one" in matmul_ratio_note(1.0)
    assert "slower than the usual" in matmul_ratio_note(0.5)
    # timed one after the other on a busy host, the ratio judges nothing
    busy = matmul_ratio_note(0.41, (3.0, 2))
    assert "no verdict" in busy and "load 3.0 on 2 cores" in busy and "slower" not in busy


def test_a_float32_sweep_is_held_to_the_float32_matmul():
    """A CPU sweeps its roofline in float32: the compute roof is float32's best matmul, not a
    bfloat16 rate twice as high (which put every matmul point at half its roof)."""
    mm = {
        ("float32", "highest"): {"flops_per_s": 80.0},
        ("float32", "default"): {"flops_per_s": 100.0},
        ("bfloat16", "default"): {"flops_per_s": 250.0},
        ("int8", "default"): {"flops_per_s": 900.0},
    }
    point = roofline.Point("mm_8", flops=50.0, bytes=1.0, median_s=1.0)
    assert ceilings.roofs(mm, 8.0, [point], jnp.float32)[0] == 100.0
    assert ceilings.roofs(mm, 8.0, [point], jnp.bfloat16)[0] == 250.0
    assert ceilings.roofs(mm, 8.0, [point])[0] == 250.0  # no dtype: every float matmul


def test_the_roofs_say_which_op_set_them():
    """The compute roof is a matmul's or a sweep op's, the memory roof the copy's or an op's:
    the roofline's records carry which (compare lined up a CPU's polynomial peak as if it were
    a matmul beside another folder's matmul)."""
    slow = {"dtype": "float32", "precision": "default", "n": 64, "flops_per_s": 1.0}
    roof = ceilings.roofline_ceilings("tiny", budget_s=0.0, matmuls={("float32", "default"): slow})
    names = {p.name for p in roof["points"]}
    assert roof["peak_op"] in names  # every op of the sweep beat 1 FLOP/s
    assert roof["bandwidth_op"] in names | {"copy"}
    fast = {**slow, "flops_per_s": 1e30}
    roof = ceilings.roofline_ceilings("tiny", budget_s=0.0, matmuls={("float32", "default"): fast})
    assert roof["peak_op"] == "matmul float32 precision=default, n=64"


def test_host_to_device_copies_even_a_64_byte_aligned_host_array(monkeypatch):
    """XLA:CPU shares a 64-byte-aligned host array instead of copying it, so the CPU's
    host→device figure timed some puts as free (20× between runs): each timed put must
    leave a device array that a later host write does not reach."""
    import numpy as np

    n = 1 << 14

    class AlignedRng:  # what the allocator may hand out: data on a 64-byte boundary
        def standard_normal(self, size, dtype):
            buf = np.empty(size + 16, dtype)
            start = (-buf.ctypes.data % 64) // buf.itemsize
            out = buf[start : start + size]
            out[...] = 1.0
            return out

    monkeypatch.setattr(ceilings.np.random, "default_rng", lambda seed: AlignedRng())
    timed = []
    bench = ceilings.timing.bench
    monkeypatch.setattr(
        ceilings.timing,
        "bench",
        lambda fn, rotate, **k: timed.append((fn, rotate)) or bench(fn, rotate=rotate, **k),
    )
    assert ceilings.host_to_device(4 * n, budget_s=0.01)["bytes_per_s"] > 0
    ((put, hosts),) = timed
    for (host,) in hosts:
        on_device = put(host).block_until_ready()
        host[0] = 7.0
        assert float(on_device[0]) != 7.0  # copied, not shared


def test_records_keep_the_measuring_order_and_rows_the_tables():
    """`Ceilings.records` are the records `done` got, in that order (a sweep point's as it was
    timed, before the roofs and ridge taken from the sweep); `rows` put the roofs and ridge
    before the sweep's points, whose shares of the roofs are known only then."""
    got = []
    result = ceilings.run_all(budget_s=0.01, quick=True, done=lambda r, row: got.append(r))
    assert list(result.records) == got
    whats = [r["what"] for r in result.records]
    assert sorted(whats) == sorted(row.what for row in result.rows)  # one record per row
    assert whats[-3:] == ["compute roof", "memory roof", ceilings.RIDGE]
    rows = [row.what for row in result.rows]
    first_point = next(i for i, w in enumerate(rows) if w.startswith("roofline "))
    assert rows[first_point - 3 : first_point] == whats[-3:]
    assert all(w.startswith("roofline ") for w in rows[first_point:])

"""The benchmarked collectives compute what they claim (against numpy, on every mesh axis),
and their bandwidth bookkeeping follows the nccl-tests conventions."""

import json

import numpy as np
import pytest

from lab.errors import ConfigError
from lab.measure import collectives as C
from lab.mesh import make_mesh
from lab.tools import collectives as tool


def _expected(op, blocks, mesh, axis):
    """Apply the numpy reference along `axis` of the (data, fsdp, model) grid of blocks."""
    shape = tuple(mesh.shape.values())
    k = list(mesh.axis_names).index(axis)
    grid = np.moveaxis(blocks.reshape(*shape, -1), k, -2)  # (..., W, N)
    flat = grid.reshape(-1, *grid.shape[-2:])
    out = np.stack([C.reference(op, g) for g in flat])
    out = out.reshape(*grid.shape[:-2], *out.shape[-2:])
    return np.moveaxis(out, -2, k).reshape(-1)


@pytest.mark.parametrize("axis", ["data", "model"])
@pytest.mark.parametrize("op", C.OPS)
def test_collective_values_match_numpy(op, axis):
    mesh = make_mesh("4x2")
    W = mesh.shape[axis]
    n = C.input_elems(op, 64, W)
    x = C.global_input(mesh, n, seed=1)
    got = np.asarray(C.collective(op, mesh, axis)(x))
    blocks = np.asarray(x).reshape(mesh.size, n)
    np.testing.assert_allclose(got, _expected(op, blocks, mesh, axis), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "op, W, factor",
    [
        ("all-reduce", 8, 2 * 7 / 8),
        ("all-reduce", 2, 1.0),
        ("all-gather", 4, 3 / 4),
        ("reduce-scatter", 4, 3 / 4),
        ("all-to-all", 8, 7 / 8),
        ("ppermute", 4, 1.0),
    ],
)
def test_bus_factor_is_nccl_tests(op, W, factor):
    assert C.bus_factor(op, W) == pytest.approx(factor)


def test_message_size_is_the_all_gather_output():
    assert C.message_bytes("all-gather", C.input_elems("all-gather", 4096, 4), 4) == 4096
    assert C.message_bytes("all-reduce", C.input_elems("all-reduce", 4096, 4), 4) == 4096
    assert tool.parse_size("k", "4KB") == 4096 and tool.parse_size("k", "16MiB") == 16 * 2**20
    assert tool.parse_size("k", "1TB") == 2**40
    with pytest.raises(ConfigError, match="with a unit of B, KB, MB, GB or TB"):
        tool.parse_size("min_size", "lots")


def test_main_writes_records_and_plot(tmp_path, capsys):
    argv = ["quick=true", "mesh=4x2", "ops=all-reduce,ppermute", "budget=0.01"]
    assert tool.main([*argv, f"out_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "simulated devices" in out
    recs = [json.loads(line) for f in tmp_path.glob("*.jsonl") for line in f.open()]
    assert len(recs) == 2 * 2 * 2 * 2  # ops × axes × sizes × (algbw, busbw)
    ar = [r for r in recs if r["config"]["op"] == "all-reduce" and r["what"].endswith("busbw")]
    assert all(r["value"] > 0 and r["config"]["simulated_devices"] for r in ar)
    assert list(tmp_path.glob("*.png"))
    assert {r["config"]["size_bytes"] for r in ar} == {4096, 65536}, ar  # 4 KiB and 16× it


def test_a_quick_check_takes_the_max_size_asked_for(tmp_path, monkeypatch, capsys):
    """... and on a busy host says, before it times anything, that its times will be high
    and its bandwidths low, as every timing tool does."""
    from lab.measure import records

    monkeypatch.setattr(records, "busy_host", lambda: (5.5, 2))
    argv = ["quick=true", "mesh=2", "ops=all-reduce", "budget=0.01", "plot=false"]
    assert tool.main([*argv, "max_size=1MB", f"out_dir={tmp_path}"]) == 0
    recs = [json.loads(line) for f in tmp_path.glob("*.jsonl") for line in f.open()]
    assert {r["config"]["size_bytes"] for r in recs} == {4096, 2**20}
    out = " ".join(capsys.readouterr().out.split())
    assert "host load average 5.5 on 2 cores" in out and "bus bandwidths low" in out, out


def test_sizes_that_round_alike_are_said_to_and_the_title_names_the_axes_that_split(
    tmp_path, capsys
):
    """3 B and 48 B round up to one float32 element on each of 8 devices (32 B): timed once,
    and the run says so instead of showing one point for two asked."""
    argv = ["quick=true", "mesh=1x8", "ops=all-reduce", "budget=0.01", "plot=false"]
    assert tool.main([*argv, "min_size=3B", f"out_dir={tmp_path}"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "1 of the 2 points asked for round to a size already timed" in out
    assert "· model=8" in out and "data=1" not in out


@pytest.mark.parametrize(
    "args, needle",
    [
        (["ops=broadcast"], "broadcast"),
        (["min_size=0"], "min_size=0: a message holds at least one byte"),
        (["min_size=8MB", "max_size=4KB"], "min_size=8MB is above max_size=4KB"),
        (["min_size=8MB", "max_size=4KB", "quick=true"], "min_size=8MB is above max_size=4KB"),
        # 3 × 4096 GiB on each of 8 devices: refused before anything is allocated
        (["min_size=4096GB", "max_size=4096GB"], "simulated devices share"),
        (["max_size=1TB"], "max_size=1TB: the largest message would take"),  # TB is a unit
        (["max_size=1PB"], "max_size='1PB': expected a whole number of bytes"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, args, needle):
    assert tool.main([*args, "plot=false", "mesh=4x2"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


def test_a_mesh_past_the_simulated_devices_names_cpu_devices(capsys):
    assert tool.main(["mesh=3x3", "plot=false"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "needs 9 devices but only 8 are present (cpu_devices= sets how many are simulated: 8)"
    ), err

"""Host offloading (offload_optimizer=true, remat=offload) changes no numbers where it runs
(CPU, through the library: the optimizer state really sits in pinned_host memory), lab.run
refuses it on CPU in one line (host memory is the device's own RAM there), and ahead of time
for a TPU slice and an H100 the bytes move from device to host memory."""

import json

import jax
import numpy as np
import pytest
from few_steps import train_steps

from lab.config import parse_args
from lab.run import main

BASE = [
    "model=tiny",
    "n_layers=4",
    "scan_layers=true",
    "batch_size=16",
    "seq_len=16",
    "dtype=float32",
    "attention=naive",
    "mesh=2",
]


def _two_steps(argv):
    losses, _, state = train_steps(parse_args([*BASE, *argv]), 2)
    return losses, state


@pytest.fixture(scope="module")
def plain():
    return _two_steps([])


@pytest.mark.parametrize("argv", [["offload_optimizer=true"], ["remat=offload"]])
def test_offloading_changes_no_numbers(plain, argv):
    """Two AdamW steps against the plain step's: the optimizer state in host memory gives the
    same numbers bit for bit; remat=offload recomputes each block from its saved input, whose
    fusions sum in another order (float32 within 1e-5; the CPU compiler keeps the saved inputs
    in device memory, the same RAM)."""
    losses, state = _two_steps(argv)
    if argv == ["offload_optimizer=true"]:
        assert losses == plain[0]
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(plain[1]), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        kinds = {a.sharding.memory_kind for a in jax.tree.leaves(state.opt_state)}
        assert kinds == {"pinned_host"}
        return
    np.testing.assert_allclose(losses, plain[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(plain[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "argv, suggested",
    [
        # a GPU plan lists no host memory kind: its optimizer state would stay on the device
        (["offload_optimizer=true"], ["target=tpu:v5e:2x2 mesh=-1"]),
        (["offload_optimizer=true", "compile_only=true"], ["target=tpu:v5e:2x2 mesh=-1"]),
        (["remat=offload"], ["target=tpu:v5e:2x2 mesh=-1", "target=gpu:h100:1"]),
    ],
)
def test_offload_on_cpu_is_one_line(argv, suggested, capsys):
    assert main([*argv, "steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "the cpu backend has no separate host memory" in err and len(err.splitlines()) == 1
    assert [t for t in ("target=tpu:v5e:2x2 mesh=-1", "target=gpu:h100:1") if t in err] == suggested


@pytest.mark.parametrize(
    "option, moved",
    [
        ("offload_optimizer=true", "optimizer state"),
        pytest.param("remat=offload", "block inputs", marks=pytest.mark.slow_plan),
    ],
)
def test_the_target_the_cpu_refusal_suggests_moves_the_state(tmp_path, capsys, option, moved):
    """The refusal on CPU names a target where the option takes effect (on jax 0.10's libtpu
    too, which refuses v5e:1x1): planned there as written, the state it names lies in host
    memory."""
    pytest.importorskip("libtpu", reason="libtpu not installed: pip install -e '.[tpu]'")
    argv = ["target=tpu:v5e:2x2", "mesh=-1", "model=tiny", option, f"out_dir={tmp_path}"]
    # the target's default batch (32 × 1024) only lengthens the compile: what is checked is
    # the plan's header and notes, which the option and the target decide
    argv += ["name=plan", "batch_size=8", "seq_len=128"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"in host memory: {moved}" in out and "stays in device memory" not in out


# --- ahead of time: bytes from device to host memory ----------------------------------------


def _plans(tmp_path, capsys, target, variants) -> dict[str, dict]:
    out = {}
    for name, extra in variants.items():
        argv = [
            f"target={target}",
            "mesh=-1",
            "model=small",
            "scan_layers=true",
            "batch_size=16",
            "seq_len=256",
            f"out_dir={tmp_path}",
            f"name={name}",
            *extra,
        ]
        assert main(argv) == 0
        printed = capsys.readouterr().out
        out[name] = json.loads((tmp_path / name / "summary.json").read_text())
        out[name]["printed"] = printed
    return out


LAYER_INPUTS = 4 * 2 * 256 * 256 * 2  # small: 4 layers × 2 rows per device × L × D, bf16


@pytest.mark.slow_plan
def test_tpu_plan_moves_the_bytes_to_host_memory(tmp_path, capsys):
    """v5e 2x4, data over 8 chips (libtpu): the AdamW moments leave the device arguments and
    appear as host arguments; each block's input is kept in host memory between forward and
    backward. (XLA:TPU keeps small buffers on chip, in memory space S(1), which temp does not
    count: the device temp of a plan this small is not a signal.)"""
    pytest.importorskip("libtpu")
    s = _plans(
        tmp_path, capsys, "tpu:v5e:2x4", {"offload": ["remat=offload", "offload_optimizer=true"]}
    )
    off = s["offload"]["compiled_memory_per_device"]
    params = s["offload"]["params"]  # data parallel: every chip holds all of them, float32
    assert off["host_argument_bytes"] == pytest.approx(2 * 4 * params, rel=1e-3)  # mu and nu
    assert off["argument_bytes"] == pytest.approx(4 * params, rel=1e-3)  # the parameters
    assert off["host_temp_bytes"] == LAYER_INPUTS
    moved = s["offload"]["offload"]
    assert moved["bytes_to_host"] == LAYER_INPUTS + off["host_output_bytes"]
    assert moved["added_step_s"] is None  # the spec table has no TPU host-link figure


@pytest.mark.slow_plan
def test_gpu_plan_offloads_activations_not_the_optimizer(tmp_path, capsys):
    """One H100 (CUDA plugin): remat=offload keeps the block inputs in host memory and the
    device total falls; the plugin's abstract devices list no memory kinds, so the optimizer
    state cannot be put in host memory in a plan, and the plan says so."""
    from lab.plans import gpu

    if gpu._pjrt() is None or gpu.ptxas() is None:
        pytest.skip("the CUDA plugin or ptxas is missing: pip install -e '.[gpu-plan]'")
    variants = {"full": ["remat=full"], "offload": ["remat=offload", "offload_optimizer=true"]}
    s = _plans(tmp_path, capsys, "gpu:h100:1", variants)
    full, off = (s[k]["compiled_memory_per_device"] for k in ("full", "offload"))
    assert off["host_temp_bytes"] == 4 * 16 * 256 * 256 * 2  # one device: all 16 rows
    assert off["total_bytes"] < full["total_bytes"]
    assert s["offload"]["offload"]["added_step_s"] > 0  # the spec table's PCIe host link
    assert off["host_argument_bytes"] == 0  # the optimizer state could not move
    assert any("stays in device memory" in n for n in s["offload"]["notes"])
    assert "stays in device memory" in s["offload"]["printed"]  # said, not only recorded


@pytest.mark.parametrize("target", ["tpu:v5e:2x2", "gpu:h100:1"])
def test_explain_counts_device_memory_as_the_program_holds_it(target):
    """explain=true's 'from shardings (exact)' column is device memory: an optimizer state the
    TPU program keeps in host memory is 0 there (the whole state was printed as device bytes);
    a GPU plan, whose abstract devices list no host memory, keeps it on the device and the
    calculator beside it says so too (it predicted 0)."""
    from lab.parallel import explain
    from lab.plans import gpu
    from lab.session import open_session

    if target.startswith("tpu"):
        pytest.importorskip("libtpu")
    elif gpu._pjrt() is None or gpu.ptxas() is None:
        pytest.skip("the CUDA plugin or ptxas is missing: pip install -e '.[gpu-plan]'")
    keys = {"preset": "tiny", "offload_optimizer": True, "batch_size": 8, "seq_len": 16}
    mesh = "4" if target.startswith("tpu") else "1"
    s = open_session(keys={**keys, "target": target, "mesh": mesh, "strategy": "fsdp"})
    whole = explain.per_device_bytes(s.trainer.abstract_state.opt_state)
    split = explain.memory_rows(s.cfg, s.trainer, None)
    if target.startswith("tpu"):
        assert split.optimizer == 0 < whole
    else:
        assert split.optimizer == whole and split.predicted["optimizer"] > 0

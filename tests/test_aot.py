"""Ahead-of-time plans for TPU slices, compiled on this CPU machine (needs libtpu)."""

import json
import re

import pytest

from lab.config import parse_args
from lab.measure.memory import predict_lab_step
from lab.measure.records import read_records
from lab.run import main

libtpu = pytest.importorskip("libtpu", reason="libtpu not installed: pip install -e '.[tpu]'")

# The calculator's margin against memory_analysis on CPU (lab/measure/memory.py). Here only
# the training state is held to it (at seq_len 256 a tiny model's temporaries are mostly
# XLA:TPU's fusion scratch and tile padding); the whole step's total, where naive
# attention's scores dominate it, is held on TPU and GPU in tests/test_gpu_plans.py.
MARGIN = 0.15


@pytest.mark.parametrize(
    "target, mesh, preset",
    [
        # v5e once per CI (the slowest two). The oldest-JAX leg runs the first v4 case (a TPU
        # plan compiles, its records and capacity); the newest runs both, the calculator on
        # the training state included (2x2x2, small)
        pytest.param("tpu:v5e:2x2", "2x2", "tiny", marks=pytest.mark.slow_plan),
        pytest.param("tpu:v5e:2x2", "4", "small", marks=pytest.mark.slow_plan),
        ("tpu:v4:2x2x2", "4x2", "tiny"),
        ("tpu:v4:2x2x2", "2x2x2", "small"),
    ],
)
def test_plan_compiles_and_matches_the_calculator(tmp_path, capsys, target, mesh, preset):
    argv = [
        f"target={target}",
        f"mesh={mesh}",
        f"model={preset}",
        "batch_size=16",
        "seq_len=256",
        "attention=naive",
        f"out_dir={tmp_path}",
        "name=plan",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "compiled, not run" in out and "predicted step time" in out
    # a compile of minutes says so as it starts (a line where the output is not a terminal)
    assert f"compiling the step for {target} (compiled, not run) …" in out
    assert s_pred(tmp_path)["label"] == "predicted"
    s = json.loads((tmp_path / "plan" / "summary.json").read_text())
    assert s["aot"]["label"] == "compiled, not run"
    # the plan's records are the target's figures, stamped with the target, not this host
    recs = {r["what"]: r for r in read_records(tmp_path / "plan" / "records.jsonl")}
    assert set(recs) >= {"compiled memory per device", "training step time", "training MFU"}
    for r in recs.values():
        assert r["backend"] == "tpu" and r["device_kind"].startswith("TPU"), r
        assert r["device_count"] == s["devices"] and r["compiled_on"]["backend"] == "cpu"
    assert recs["training step time"]["label"] == "predicted"
    assert recs["training step time"]["value"] == s["aot"]["estimated_step_s"]
    # judged against what XLA:TPU lets a program hold, not the datasheet's HBM
    assert (
        s["capacity_bytes_per_device"]
        == {"tpu:v5e:2x2": 15.75, "tpu:v4:2x2x2": 30.75}[target] * 2**30
    )
    assert "memory per device (what XLA:TPU lets a program hold)" in out
    # the calculator's row states its error on this program: its total over the compiled one
    calc = s["predicted_memory_per_device"]["total"]
    ratio = calc / s["compiled_memory_per_device"]["total_bytes"]
    flat = re.sub(r"[\s│]+", " ", out)  # the row may wrap inside its cell
    assert f"{ratio:.2f}× the compiled, which counts HBM only: XLA:TPU keeps some" in flat, out
    cfg = json.loads((tmp_path / "plan" / "config.json").read_text())
    keys = [f"model={preset}", "dtype=bfloat16", "attention=naive", "batch_size=16"]
    run_cfg = parse_args([*keys, "seq_len=256", f"strategy={cfg['strategy']}"])
    assert cfg["model"]["dtype"] == "bfloat16"  # TPU defaults: bf16 compute
    sizes = {a: n for a, n in zip(("data", "fsdp", "model"), _sizes(mesh), strict=True)}
    pred = predict_lab_step(run_cfg, sizes=sizes, backend="tpu")
    state = s["compiled_memory_per_device"]["argument_bytes"]  # params + Adam moments + batch
    if preset == "tiny":
        return  # d_model=64 is half a TPU (8, 128) tile: padding, not the model, dominates
    assert abs(pred["params"] + pred["optimizer"] - state) / state < MARGIN, (pred, state)


def _sizes(mesh: str) -> tuple[int, int, int]:
    parts = [int(p) for p in mesh.split("x")]
    return {1: (parts[0], 1, 1), 2: (parts[0], 1, parts[-1]), 3: tuple(parts)}[len(parts)]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["target=tpu:v9:2x2"], "unknown TPU generation 'v9'"),
        (["target=tpu:v5f:2x2"], "(did you mean v5e or v5p?)"),
        (["target=tpu:v5e:0x2"], "every axis of the topology needs at least 1 chip"),
        (["target=tpu:v5e:2x2x2"], "a v5e slice is a 2-D torus"),
        (["target=tpu:v4:2x2"], "a v4 slice is a 3-D torus"),
        # JAX drives a v4 chip's two TensorCores as one device: 4 chips, 4 devices
        (
            ["target=tpu:v4:2x2x1", "mesh=8"],
            "mesh=8 needs 8 devices but the target tpu:v4:2x2x1 has 4",
        ),
        (["target=cpu:h100"], "expected tpu:GEN:TOPOLOGY"),
        (
            ["target=tpu:v5e:2x2", "mesh=16"],
            "mesh=16 needs 16 devices but the target tpu:v5e:2x2 has 4",
        ),
        (["target=tpu:v5e:2x4", "mesh=2"], "mesh=2 uses 2 of the target's 8 devices"),
        # no mesh=: all 8 chips on the stage axis, and the example keeps to 8
        (
            ["target=tpu:v5e:2x4", "strategy=pp+fsdp", "n_layers=8"],
            "the mesh stage:8 does not have: name it (e.g. mesh=stage:4,fsdp:2)",
        ),
    ],
)
def test_bad_targets_are_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "extra, mesh, axes",
    [({}, "-1", {"data": 8}), ({"strategy": "fsdp"}, "fsdp:-1", {"fsdp": 8})],
)
def test_a_plan_without_mesh_uses_every_device_of_its_target(extra, mesh, axes):
    """A plan is one program over its whole target: with no mesh= a slice of 8 chips takes
    mesh=-1 (the batch over all 8, or an explicit strategy's axis), not the one chip the
    default mesh=1 names, which the target would refuse. A mesh= given is kept, and refused
    where it leaves chips out (test_bad_targets_are_one_line)."""
    from lab.session import open_session

    s = open_session(keys={"preset": "tiny", "target": "tpu:v5e:2x4", **extra})
    assert s.cfg.mesh == mesh
    assert {a: n for a, n in s.trainer.mesh.shape.items() if n > 1} == axes


def test_an_unloadable_cache_entry_of_a_plan_is_not_warned_about():
    """jax's persistent compilation cache keeps a plan's executable, which it cannot load back
    for abstract devices: the next plan of the same program warned so and compiled afresh.
    Once a target's devices are made that warning is filtered; any other failure to read an
    entry still warns."""
    import warnings

    from lab import plans

    entry = "Error reading persistent compilation cache entry for 'jit_train_step': "
    unloadable = (
        "JaxRuntimeError: INVALID_ARGUMENT: PjRtCompiler must be constructed with a Client to "
        "call DeserializeLoadedExecutable."
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        plans.topology_devices("tpu:v5e:2x2")
        for why in (unloadable, "EOFError: truncated"):
            warnings.warn(entry + why, UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == [entry + "EOFError: truncated"]


def test_a_step_the_target_cannot_hold_is_one_line_and_exit_2(capsys):
    """XLA:TPU refuses a program larger than its HBM: a config the target cannot hold, told
    as a mesh that does not fit is (one line, exit 2), with the change that would fit."""
    argv = ["target=tpu:v5e:2x2", "model=small", "mesh=4", "batch_size=4096", "seq_len=2048"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "does NOT fit: the compiler refused the step (needs" in err, err
    assert "would fit" in err and len(err.splitlines()) == 1


def test_a_refused_steps_advice_is_scaled_to_the_need_the_compiler_names():
    """The calculator's figure for each change is scaled by how far its figure for the refused
    step sits from the need XLA's refusal names; a refusal without a figure in units leaves
    the calculator's own figures. Nothing is compiled: the refusal is given."""
    from lab import summary
    from lab.config import override, parse_keys
    from lab.session import open_session
    from lab.train import census_for

    # a slice of four chips (the oldest JAX's libtpu lays out no v5e 1x1), a batch over them
    argv = ["target=tpu:v5e:2x2", "mesh=4", "model=small", "batch_size=4096", "seq_len=2048"]
    trainer = open_session(keys=parse_keys(argv)).trainer
    cap = 15.75 * 2**30

    def predicted(**change) -> float:
        cfg = override(trainer.cfg, **change)
        census = census_for(cfg, trainer.mesh)
        return predict_lab_step(cfg, sizes=dict(trainer.mesh.shape), backend="tpu", census=census)[
            "total"
        ]

    def advised(refusal: str) -> tuple[str, float]:
        text = summary.refused_advice(trainer, refusal)
        found = re.search(r"; (\w+=\w+) would fit \(([\d.]+) GiB, predicted\)$", text)
        assert found, text
        return found[1], float(found[2])

    def change(text: str) -> dict:
        key, value = text.split("=")
        return {key: int(value) if value.isdigit() else value}

    now = predicted()
    # the calculator's own figure, then less than half of it (XLA:TPU needed 0.44 of it for
    # this model's step of 1024 sequences on one chip)
    for need in (now, 0.4 * now):
        text, figure = advised(f"needs {need / 2**30:.2f}G, 15.75G available")
        scale = round(need / 2**30, 2) * 2**30 / now
        assert figure == pytest.approx(predicted(**change(text)) * scale / 2**30, abs=0.05)
        assert figure * 2**30 <= cap
    unscaled = advised("needs 39390000000 bytes")  # no unit: not read
    assert unscaled == advised(f"needs {now / 2**30:.2f}G")
    # a need of less than half the calculator's: a change the unscaled figures put over
    scaled, _ = advised(f"needs {0.4 * now / 2**30:.2f}G")
    assert scaled != unscaled[0] and predicted(**change(scaled)) > cap


@pytest.mark.slow_plan  # two TPU compiles: the refused step and the advised one
def test_the_change_advised_for_a_refused_step_compiles_and_fits(capsys):
    """The single change a refused step is advised compiles for the target and fits."""
    argv = ["target=tpu:v5e:1x1", "model=small", "batch_size=1024", "seq_len=2048"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    change = re.search(r"; (\S+=\S+) would fit \(", err)
    assert change, err
    key = change[1].split("=")[0]
    assert main([*(a for a in argv if not a.startswith(f"{key}=")), change[1]]) == 0
    assert re.search(r"GiB: fits, [\d.]+ GiB spare", capsys.readouterr().out)


@pytest.mark.slow_plan  # once per CI; test_attention_aot.py compiles the kernel on both legs
def test_plan_runs_the_pallas_kernel_inside_the_sharded_step():
    """attention=auto on a TPU target picks the Mosaic kernel (head_dim 64 here), run per
    shard under shard_map in the tensor-parallel step: the compiled step holds its calls."""
    from lab.config import parse_keys
    from lab.session import open_session

    argv = ["target=tpu:v5e:2x2", "mesh=2x2", "model=small", "d_model=512", "n_layers=2"]
    argv += ["batch_size=8", "seq_len=256"]
    s = open_session(keys=parse_keys(argv))
    cfg, info, trainer = s.cfg, s.info, s.trainer
    assert cfg.model.attention == "pallas_tpu" and info.backend == "tpu"
    hlo = trainer.lower().compile().as_text()
    assert hlo.count("tpu_custom_call") >= 3 * cfg.model.n_layers  # forward, dq, dk/dv


def s_pred(tmp_path) -> dict:
    """The plan's predicted step (lab/predict): seconds and where they go."""
    s = json.loads((tmp_path / "plan" / "summary.json").read_text())
    p = s["predicted_step"]
    assert p["seconds"] > 0 and sum(p["breakdown"].values()) == pytest.approx(p["seconds"])
    assert s["aot"]["estimated_step_s"] == p["seconds"]
    return p

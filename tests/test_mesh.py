"""Mesh specs, device meshes and the logical→mesh rule tables."""

import jax
import pytest

from lab.config import parse_args
from lab.errors import ConfigError
from lab.mesh import (
    RULES,
    MeshSpecError,
    auto_strategy,
    check_divisible,
    cpu_devices_for,
    make_mesh,
    parse_mesh_spec,
    resolve_shape,
)
from lab.resolve import defaults


@pytest.mark.parametrize(
    "spec, want",
    [
        ("8", {"data": 8, "stage": 1, "fsdp": 1, "model": 1}),
        ("4x2", {"data": 4, "stage": 1, "fsdp": 1, "model": 2}),
        ("2x2x2", {"data": 2, "stage": 1, "fsdp": 2, "model": 2}),
        ("data:2,fsdp:2,model:2", {"data": 2, "stage": 1, "fsdp": 2, "model": 2}),
        ("model:2,data:-1", {"data": 4, "stage": 1, "fsdp": 1, "model": 2}),
        ("-1", {"data": 8, "stage": 1, "fsdp": 1, "model": 1}),
        ("4", {"data": 4, "stage": 1, "fsdp": 1, "model": 1}),
        ("data:2,stage:4", {"data": 2, "stage": 4, "fsdp": 1, "model": 1}),
    ],
)
def test_resolve_shape(spec, want):
    assert resolve_shape(spec, 8) == want


def test_an_axis_of_minus_one_fills_eight_simulated_devices():
    """cpu_devices=0 sizes the simulated CPU devices by the mesh: -1 fills 8 (as many of the
    fixed axes' product as fit), never 1 device that leaves the axis out."""
    got = {
        s: cpu_devices_for(s)
        for s in ("4x2", "data:2,fsdp:-1", "-1", "data:3,fsdp:-1", "data:16,fsdp:-1")
    }
    assert got == {
        "4x2": 8,
        "data:2,fsdp:-1": 8,
        "-1": 8,
        "data:3,fsdp:-1": 6,
        "data:16,fsdp:-1": 16,
    }
    assert resolve_shape("data:2,fsdp:-1", cpu_devices_for("data:2,fsdp:-1"))["fsdp"] == 4


@pytest.mark.parametrize("spec", ["0", "4x2x1x1", "a", "data:2,data:2", "3x-1"])
def test_bad_specs(spec):
    with pytest.raises(MeshSpecError):
        resolve_shape(spec, 8)


def test_make_mesh_axes_and_size():
    mesh = make_mesh("4x2")
    assert mesh.axis_names == ("data", "stage", "fsdp", "model")
    assert dict(mesh.shape) == {"data": 4, "stage": 1, "fsdp": 1, "model": 2}
    assert mesh.devices.size == 8
    assert len(make_mesh("2").devices.flatten()) == 2  # a divisor of the devices is allowed
    assert parse_mesh_spec("4x2") == {"data": 4, "model": 2}


def test_auto_strategy():
    assert auto_strategy({"data": 8, "fsdp": 1, "model": 1}) == "dp"
    assert auto_strategy({"data": 4, "fsdp": 1, "model": 2}) == "tp"
    assert auto_strategy({"data": 1, "fsdp": 8, "model": 1}) == "fsdp"
    assert auto_strategy({"data": 2, "fsdp": 2, "model": 2}) == "fsdp+tp"
    assert auto_strategy({"data": 2, "stage": 4, "fsdp": 1, "model": 1}) == "pp"
    assert auto_strategy({"stage": 2, "fsdp": 2, "model": 1}) == "pp+fsdp"
    assert auto_strategy({"stage": 2, "fsdp": 2, "model": 2}) == "pp+tp"


def test_rule_tables_are_short_and_use_mesh_axes():
    for name, rules in RULES.items():
        assert 1 <= len(rules) <= 6, name
        for _, axes in rules:
            assert set(axes) <= {"data", "stage", "fsdp", "model"}


def test_check_divisible_names_tensor_and_axis():
    mesh = make_mesh("4x2")
    check_divisible("ok", (8, 6), (("data",), ("model",)), mesh)
    with pytest.raises(MeshSpecError, match=r"wq: dimension 1 \(size 3\).*\('model',\) \(size 2\)"):
        check_divisible("wq", (8, 3), (None, ("model",)), mesh)
    assert jax.device_count() == 8


@pytest.mark.parametrize(
    "strategy, want",
    [("fsdp", "fsdp:8"), ("tp", "model:8"), ("cp", "model:8"), ("pp", "stage:8"), ("dp", "8")],
)
def test_a_bare_device_count_follows_the_strategys_axis(strategy, want):
    # mesh=8 strategy=fsdp used to be data:8, on which fsdp split nothing
    assert defaults(parse_args(["mesh=8", f"strategy={strategy}"])).mesh == want
    assert defaults(parse_args(["mesh=4x2", f"strategy={strategy}"])).mesh == "4x2"  # as given


def test_fsdp_on_a_mesh_without_its_axis_is_refused():
    from lab.train import make_trainer

    cfg = parse_args(["mesh=data:8", "strategy=fsdp", "model=tiny"])
    with pytest.raises(ConfigError, match="strategy=fsdp splits over the fsdp or model axis"):
        make_trainer(cfg, make_mesh(cfg.mesh))
    # a strategy of two axes: the example names both
    cfg = parse_args(["mesh=data:8", "strategy=fsdp+tp", "model=tiny"])
    with pytest.raises(ConfigError, match=r"\(e\.g\. mesh=fsdp:4,model:2\)$"):
        make_trainer(cfg, make_mesh(cfg.mesh))


def test_fsdp_on_a_bare_count_shards_the_weights():
    from lab.train import make_trainer

    cfg = defaults(parse_args(["mesh=8", "strategy=fsdp", "model=tiny"]))
    trainer = make_trainer(cfg, make_mesh(cfg.mesh))
    specs = [s.spec for s in jax.tree.leaves(trainer.state_shardings.params)]
    assert any("fsdp" in str(spec) for spec in specs)


def test_the_header_says_what_a_strategy_splits_over_which_axes():
    """fsdp on a 4x2 mesh shards the weights over `model` (its second positional axis); the
    run header's mesh line says so instead of leaving a user to guess which axis is fsdp's."""
    from lab.mesh import split_words

    sizes = {"data": 4, "stage": 1, "fsdp": 1, "model": 2}
    assert split_words("fsdp", sizes) == "batch over data×model, embed over model"
    assert split_words("tp", sizes) == "batch over data, heads over model, mlp over model, " + (
        "vocab over model"
    )
    assert split_words("dp", {"data": 1, "stage": 1, "fsdp": 1, "model": 1}) == ""

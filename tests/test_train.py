"""The sharded train step against one device: same losses for every strategy and mesh."""

import re

import jax
import numpy as np
import pytest
from few_steps import train_steps

from lab.config import parse_args
from lab.mesh import make_mesh
from lab.resolve import defaults
from lab.train import make_trainer

STEPS = 3
BASE = ["model=tiny", "batch_size=8", "seq_len=32", "dtype=float32", "attention=naive"]


def _losses(mesh_spec: str, strategy: str, extra=()) -> list[float]:
    # the mesh built here as lab.run builds it: a bare count follows the strategy's axis
    cfg = defaults(parse_args([*BASE, f"mesh={mesh_spec}", f"strategy={strategy}", *extra]))
    return train_steps(cfg, STEPS)[0]


@pytest.fixture(scope="module")
def single_device():
    return _losses("1", "dp")


@pytest.mark.parametrize(
    "mesh_spec, strategy",
    [
        ("4x2", "dp"),
        ("4x2", "fsdp"),
        ("4x2", "tp"),
        ("4x2", "fsdp+tp"),
        ("8", "dp"),
        ("8", "fsdp"),
        ("2x2x2", "fsdp"),
        ("2x2x2", "fsdp+tp"),
    ],
)
def test_sharded_losses_match_one_device(single_device, mesh_spec, strategy):
    np.testing.assert_allclose(_losses(mesh_spec, strategy), single_device, rtol=2e-5)


def test_params_are_really_sharded():
    cfg = parse_args([*BASE, "mesh=2x2x2", "strategy=fsdp+tp"])
    trainer = make_trainer(cfg, make_mesh(cfg.mesh))
    wq = trainer.abstract_state.params["block_0"]["attn"]["wq"]  # (embed, heads, head_dim)
    assert wq.sharding.spec[:2] == ("fsdp", "model")
    mu = trainer.abstract_state.opt_state[1][0].mu["block_0"]["attn"]["wq"]
    assert mu.sharding.spec == wq.sharding.spec  # Adam moments follow their parameter


@pytest.mark.parametrize("extra", [("remat=full",), ("remat=dots",), ("scan_layers=true",)])
def test_remat_and_scan_keep_the_loss(single_device, extra):
    # scan initialises the stacked weights from other keys, so compare its first loss loosely
    losses = _losses("1", "dp", extra)
    if "scan_layers=true" in extra:
        assert abs(losses[0] - single_device[0]) < 0.5 and losses[-1] < losses[0]
    else:
        np.testing.assert_allclose(losses, single_device, rtol=2e-5)


def test_1b_preset_compiles_with_its_state_at_12_bytes_a_parameter():
    """model=1b only has to build and compile on CPU (issue: the foundation): ~1B parameters,
    and the compiled step's arguments are the f32 parameters and two AdamW moments."""
    from lab.config import parse_args
    from lab.measure.memory import compiled_memory
    from lab.model import count_params
    from lab.session import open_session

    trainer = open_session(parse_args(["model=1b", "seq_len=128", "batch_size=2"])).trainer
    n = count_params(trainer.abstract_state.params)
    assert 0.9e9 < n < 1.1e9
    mem = compiled_memory(trainer.lower().compile())
    assert mem["argument_bytes"] == pytest.approx(12 * n, rel=0.001)


def test_weight_decay_marks_the_same_weights_in_every_layout():
    """Decay by a weight's name: the matmul weights and the embedding, never a norm's scale,
    whether the layers are a vector each (unscanned) or stacked [layers, D] (scanned)."""
    import flax.linen as nn
    import jax.numpy as jnp

    from lab import quant
    from lab.model import build, stack_layers
    from lab.train import DECAYED, decay_mask

    def mask(*extra):
        cfg = parse_args(["model=tiny", "dtype=float32", "attention=naive", *extra])
        init = lambda k: build(cfg.model).init(k, jnp.zeros((1, 8), jnp.int32))["params"]  # noqa: E731
        boxed = jax.eval_shape(init, jax.random.key(0))  # boxes (logical axes) answer whole
        return decay_mask(boxed), nn.meta.unbox(boxed)

    def by_name(m):  # a layer's weights by their name in the block, whichever block
        paths = jax.tree_util.tree_leaves_with_path(m)
        return {re.sub(r"\['block(s|_\d+)'\]", "", jax.tree_util.keystr(k)): v for k, v in paths}

    flat, params = mask()
    stacked, _ = mask("scan_layers=true")
    restacked = decay_mask(jax.eval_shape(lambda p: stack_layers(p, 2), params))
    assert by_name(flat) == by_name(stacked) == by_name(restacked)
    names = by_name(flat)
    assert not any(v for k, v in names.items() if k.endswith("['scale']"))  # every norm's
    assert all(v for k, v in names.items() if not k.endswith("['scale']"))
    assert {k.split("'")[-2] for k, v in names.items() if v} == DECAYED - {"head"}  # tied
    untied, _ = mask("tie_embeddings=false")
    assert untied["head"] and untied["embed"]
    int8 = decay_mask(jax.eval_shape(quant.quantize_params, params))
    assert not any(jax.tree.leaves(int8))  # int8 codes are not trained


def test_the_step_program_is_named_train_step():
    """The jitted step carries its function's name (a profile's step, its ops' names)."""
    cfg = parse_args([*BASE, "mesh=1"])
    lowered = make_trainer(cfg, make_mesh(cfg.mesh)).lower()
    assert lowered.as_text().startswith("module @jit_train_step")


def test_init_programs_carry_their_names():
    """Profiles and dumps read a program by its function's name: the initialisation's two
    programs are init_params and _state_of, not a lambda's."""
    cfg = defaults(parse_args([*BASE, "mesh=1"]))
    trainer = make_trainer(cfg, make_mesh(cfg.mesh))
    key = jax.random.key(0)
    with jax.set_mesh(trainer.mesh):
        params_text = trainer.init_jit.params.lower(key).as_text()
        rest = trainer.init_jit.rest.lower(trainer.init_jit.params(key)).as_text()
    assert "jit_init_params" in params_text and "lambda" not in params_text
    assert "jit__state_of" in rest

"""The transformer is causal: the loss at position t does not depend on inputs after t.

nanodo's test_causality, on one device and on a sharded mesh (the per-shard attention kernels
and the sharding constraints must not leak the future either): the gradient of the logits at
position t with respect to the embedded inputs is zero at every later position and not zero
at t and before.
"""

import dataclasses

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab.config import make_config
from lab.mesh import make_mesh, rules_for
from lab.model import build
from lab.train import resolved_for

L, T = 24, 10  # sequence length; the position whose loss is differentiated


def _input_gradient(cfg, mesh):
    """d(loss at position T)/d(embedded inputs), [B, L, D], under the mesh and rules."""
    model = build(cfg.model)
    tokens_BxL = jax.random.randint(jax.random.key(1), (cfg.batch_size, L), 0, 256)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules_for(cfg.strategy)):
        variables = jax.jit(model.init)(jax.random.key(0), tokens_BxL)
        params = nn.meta.unbox(variables["params"])
        zeros = jax.tree.map(jnp.zeros_like, variables["perturbations"])
        w_V = jax.random.normal(jax.random.key(2), (cfg.model.vocab_size,))

        def loss_at_t(perturbations):
            logits_BxLxV = model.apply(
                {"params": params, "perturbations": perturbations}, tokens_BxL
            )
            return jnp.sum(logits_BxLxV[:, T] @ w_V)

        grads = jax.jit(jax.grad(loss_at_t))(zeros)
    return np.asarray(grads["embedded"])


@pytest.mark.parametrize(
    "mesh, strategy, attention",
    [
        ("1", "dp", "naive"),
        ("1", "dp", "blockwise"),
        ("2x2x2", "fsdp+tp", "blockwise"),
        ("2x4", "cp", "ring"),
    ],
)
def test_the_loss_at_t_does_not_depend_on_later_inputs(mesh, strategy, attention):
    cfg = make_config(
        preset="tiny", batch_size=4, seq_len=L, mesh=mesh, strategy=strategy, attention=attention
    )
    m = make_mesh(mesh)
    cfg = resolved_for(cfg, m).cfg
    g_BxLxD = _input_gradient(cfg, m)
    chex.assert_shape(g_BxLxD, (4, L, cfg.model.d_model))
    np.testing.assert_array_equal(g_BxLxD[:, T + 1 :], 0.0)  # exactly: masked, not small
    assert np.all(np.abs(g_BxLxD[:, : T + 1]).sum(-1) > 0)  # every earlier position counts


SEGMENTS_L = np.repeat([0, 1, 2], [8, 10, 6])  # three packed documents in a row of L


def test_packed_documents_do_not_see_each_other(attention="blockwise"):
    """The loss of a packed row's middle document has zero gradient with respect to the other
    documents' inputs (exactly), and its logits are those of the document alone at the start
    of a row: attention stays within it and its rotary positions restart."""
    model = build(make_config(preset="tiny", attention=attention, dtype="float32").model)
    tokens_BxL = jax.random.randint(jax.random.key(1), (2, L), 0, 256)
    segments_BxL = jnp.broadcast_to(jnp.asarray(SEGMENTS_L), (2, L))
    variables = model.init(jax.random.key(0), tokens_BxL)
    params, zeros = variables["params"], jax.tree.map(jnp.zeros_like, variables["perturbations"])
    w_V = jax.random.normal(jax.random.key(2), (256,))
    mine = SEGMENTS_L == 1

    def middle_loss(perturbations):
        logits = model.apply(
            {"params": params, "perturbations": perturbations}, tokens_BxL, None, segments_BxL
        )
        return jnp.sum(logits[:, mine] @ w_V)

    g_BxLxD = np.asarray(jax.jit(jax.grad(middle_loss))(zeros)["embedded"])
    np.testing.assert_array_equal(g_BxLxD[:, ~mine], 0.0)
    assert np.all(np.abs(g_BxLxD[:, mine]).sum(-1) > 0)
    packed = model.apply({"params": params}, tokens_BxL, None, segments_BxL)[:, mine]
    alone = model.apply({"params": params}, tokens_BxL[:, mine])
    np.testing.assert_allclose(packed, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_a_sliding_window_limits_what_each_layer_sees(scan_layers):
    """Unscanned, two local layers of window 4: the logits at T see inputs T-6 … T and nothing
    before. Scanned, local,global (each layer's window switched in the one body): all of the
    past, and the logits of the unscanned model with the same weights, not a global model's."""
    cfg = make_config(
        preset="tiny",
        dtype="float32",
        attention="naive",
        window=4,
        scan_layers=scan_layers,
        window_pattern="local,global" if scan_layers else "",
    )
    model = build(cfg.model)
    tokens_BxL = jax.random.randint(jax.random.key(1), (2, L), 0, 256)
    variables = model.init(jax.random.key(0), tokens_BxL)
    params, zeros = variables["params"], jax.tree.map(jnp.zeros_like, variables["perturbations"])
    w_V = jax.random.normal(jax.random.key(2), (256,))

    def loss_at_t(p):
        return jnp.sum(model.apply({"params": params, "perturbations": p}, tokens_BxL)[:, T] @ w_V)

    seen = np.abs(np.asarray(jax.jit(jax.grad(loss_at_t))(zeros)["embedded"])).sum(-1)
    first = 0 if scan_layers else T - 6
    np.testing.assert_array_equal(seen[:, :first], 0.0)
    assert np.all(seen[:, first : T + 1] > 0)
    np.testing.assert_array_equal(seen[:, T + 1 :], 0.0)
    if scan_layers:
        layers = {
            f"block_{i}": jax.tree.map(lambda a, i=i: a[i], params["blocks"]) for i in range(2)
        }
        unscanned = {**{k: v for k, v in params.items() if k != "blocks"}, **layers}
        logits = model.apply({"params": params}, tokens_BxL)
        same = dataclasses.replace(cfg.model, scan_layers=False)
        want = build(same).apply({"params": unscanned}, tokens_BxL)
        np.testing.assert_allclose(logits, want, atol=1e-5, rtol=1e-5)
        every = build(dataclasses.replace(same, window=0, window_pattern=""))
        assert np.abs(every.apply({"params": unscanned}, tokens_BxL) - want).max() > 1e-3


@pytest.mark.parametrize(
    "strategy, mesh_spec, tokens, splits",
    [
        ("tp", "2x4", (4, 3), True),  # a decode-sized lookup: each shard looks up its rows
        ("fsdp+tp", "1x2x4", (2, 5), True),
        ("tp", "2x4", (4, 64), False),  # 2·B·L ≥ V: the per-shard lookup moves more bytes
    ],
)
def test_a_vocabulary_split_table_is_looked_up_per_shard(strategy, mesh_spec, tokens, splits):
    """Under a strategy that splits the vocabulary, a short lookup runs on each shard's rows
    and sums them (an all-reduce of the activations) instead of gathering the table onto every
    device; the rows and the table's gradient are the plain lookup's, exactly."""
    from lab.model import embed_lookup

    V, D = 512, 16
    keys = jax.random.split(jax.random.key(11), 3)
    table = jax.random.normal(keys[0], (V, D))
    ids = jax.random.randint(keys[1], tokens, 0, V)
    cotangent = jax.random.normal(keys[2], (*tokens, D))
    mesh = make_mesh(mesh_spec)

    def lookup(t):
        with nn.logical_axis_rules(rules_for(strategy)):
            return embed_lookup(t, ids, jnp.float32)

    with jax.set_mesh(mesh):
        out, vjp = jax.vjp(jax.jit(lookup), table)
        (grad,) = vjp(cotangent)
        text = jax.jit(lookup).lower(table).compile().as_text()
    want, want_vjp = jax.vjp(lambda t: jnp.take(t, ids, axis=0), table)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(want_vjp(cotangent)[0]))
    if splits:  # (the long lookup is left to XLA's partitioner, which chooses per shape)
        assert "all-gather" not in text and "all-reduce" in text, text[-2000:]


def test_a_low_precision_model_starts_from_the_float32_weights_rounded():
    """The init draws in float32 and rounds to the parameter dtype, so a bfloat16 model and
    a float32 one start from the same point (a draw in bfloat16 gives other numbers)."""
    params = {}
    for dtype in ("float32", "bfloat16"):
        model = build(make_config(preset="tiny", param_dtype=dtype, dtype="float32").model)
        boxed = model.init(jax.random.key(3), jnp.zeros((1, 8), jnp.int32))["params"]
        params[dtype] = nn.meta.unbox(boxed)
    pairs = zip(
        jax.tree.leaves(params["float32"]), jax.tree.leaves(params["bfloat16"]), strict=True
    )
    for f32, bf16 in pairs:
        assert bf16.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(f32.astype(jnp.bfloat16)), np.asarray(bf16))


def test_build_refuses_the_unresolved_dtype_and_names_how_to_resolve_it():
    """ModelConfig's default dtype is auto, which depends on the backend: building it would
    fail in flax on the first init ("data type 'auto' not understood")."""
    from lab.config import ModelConfig, resolve_dtype

    with pytest.raises(ValueError, match=r"dtype='auto'.*lab\.config\.resolve_dtype"):
        build(ModelConfig())
    model = build(resolve_dtype(ModelConfig(), "cpu"))
    tokens = jnp.zeros((1, 4), jnp.int32)
    assert model.init(jax.random.key(0), tokens)["params"]

"""The transformer is causal: the loss at position t does not depend on inputs after t.

nanodo's test_causality, on one device and on a sharded mesh (the per-shard attention kernels
and the sharding constraints must not leak the future either): the gradient of the logits at
position t with respect to the embedded inputs is zero at every later position and not zero
at t and before.
"""

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

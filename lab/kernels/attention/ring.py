"""Ring attention: context-parallel attention with the sequence split over a mesh axis.

Each of W devices holds one contiguous block of the sequence: its queries and its keys and
values. Attention needs every key for every query, so the key/value blocks travel around
the ring (ppermute): after t steps device i holds the block of device (i - t) mod W. Each
step attends the local queries to the visiting block and keeps, per query row, the output
normalised within the block and its log-sum-exp (LSE); two partial results combine exactly:

    lse = logaddexp(lse_a, lse_b)      o = o_a·exp(lse_a - lse) + o_b·exp(lse_b - lse)

(Liu et al., "Ring Attention with Blockwise Transformers", 2023). Memory per device is one
tile of scores, never the full L×L matrix; communication is (W-1) blocks of K and V per
layer, overlappable with the block's compute.

The local block is the lab's flash kernel in plain JAX (`lab.kernels.attention.blockwise`),
in the form that also returns each row's LSE: its custom VJP takes the LSE's cotangent too
(dS = P·(dP − δ + dLSE)), so the backward recomputes scores block by block instead of storing
them, and per-device memory stays linear in the local length. The own block is attended
causally (the diagonal); a visiting block from earlier in the sequence is attended in full;
one from later is computed and then given LSE = −huge, i.e. weight 0 (computed, not skipped:
the ring keeps every device in step).

Inside the lab's model it runs through the attention dispatch (`impl="ring"`), over the
mesh axis the model's sharding gives the sequence (strategy=cp: `model`).

Letters (lab/names.py): B batch, L local query rows, S local key columns, H query heads,
G kv heads, K head dim.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from lab.kernels.attention import blockwise
from lab.kernels.attention.common import MASK_VALUE


def block_attention(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, *, causal: bool, scale: float):
    """One query block against one key block: (output_BxLxHxK in f32, lse_BxLxH), by the
    blockwise flash kernel; `causal` aligns the mask to the diagonal (own block, L == C)."""
    o_BxLxHxK, lse_BxLxH = blockwise.blockwise_attention_with_lse(
        q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal=causal, scale=scale
    )
    return o_BxLxHxK.astype(jnp.float32), lse_BxLxH.astype(jnp.float32)


def combine(o_a, lse_a, o_b, lse_b):
    """Merge two partial softmax results over disjoint key sets (exact)."""
    lse = jnp.logaddexp(lse_a, lse_b)
    o = o_a * jnp.exp(lse_a - lse)[..., None] + o_b * jnp.exp(lse_b - lse)[..., None]
    return o, lse


def _ring(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, *, axis: str, W: int, causal: bool, scale: float):
    """Per device: local queries against every key block as it passes by."""
    i = lax.axis_index(axis)
    ring = [(d, (d + 1) % W) for d in range(W)]
    attend = functools.partial(block_attention, scale=scale)
    o, lse = attend(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal=causal)  # own block: the diagonal

    def step(carry, t):
        k_BxSxGxK, v_BxSxGxK, o, lse = carry
        k_BxSxGxK, v_BxSxGxK = lax.ppermute((k_BxSxGxK, v_BxSxGxK), axis, ring)
        o_t, lse_t = attend(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal=False)
        if causal:  # the block came from device (i - t) mod W: later in the sequence → unseen
            lse_t = jnp.where((i - t) % W > i, MASK_VALUE, lse_t)
        o, lse = combine(o, lse, o_t, lse_t)
        return (k_BxSxGxK, v_BxSxGxK, o, lse), None

    (_, _, o, _), _ = lax.scan(step, (k_BxSxGxK, v_BxSxGxK, o, lse), jnp.arange(1, W))
    return o.astype(q_BxLxHxK.dtype)


def ring_attention(
    q_BxLxHxK,
    k_BxSxGxK,
    v_BxSxGxK,
    *,
    mesh,
    seq_axis: str,
    batch_axes=None,
    head_axes=None,
    causal: bool = True,
    scale: float | None = None,
):
    """softmax(Q·Kᵀ·scale)·V, layout [batch, seq, heads, head_dim], with the sequence split
    over `seq_axis` of `mesh` (batch and heads optionally over other axes). Equal to
    lab.kernels.attention.attention_reference; L must divide by the axis size."""
    W = mesh.shape[seq_axis]
    if q_BxLxHxK.shape[1] != k_BxSxGxK.shape[1] or q_BxLxHxK.shape[1] % W:
        raise ValueError(
            f"{q_BxLxHxK.shape=} {k_BxSxGxK.shape=}: ring attention needs equal q and kv "
            f"lengths divisible by {seq_axis}={W}"
        )
    scale = q_BxLxHxK.shape[-1] ** -0.5 if scale is None else scale
    spec = P(batch_axes, seq_axis, head_axes, None)
    fn = jax.shard_map(
        functools.partial(_ring, axis=seq_axis, W=W, causal=causal, scale=scale),
        mesh=mesh,
        in_specs=(spec, spec, spec),
        out_specs=spec,
        check_vma=False,
    )
    return fn(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK)

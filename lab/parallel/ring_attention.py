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

Letters: B batch, L local query rows, C local key columns, H query heads, G kv heads,
R = H/G query heads per kv head, K head dim.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from lab.kernels.attention import blockwise
from lab.parallel.shmap import shard_map

MASK = -1e30  # finite: a fully masked row stays finite and gets weight exp(MASK - lse) = 0


def block_attention(q_BxLxHxK, k_BxCxGxK, v_BxCxGxK, *, causal: bool, scale: float):
    """One query block against one key block: (output_BxLxHxK in f32, lse_BxLxH), by the
    blockwise flash kernel; `causal` aligns the mask to the diagonal (own block, L == C)."""
    o_BxLxHxK, lse_BxLxH = blockwise.blockwise_attention_with_lse(
        q_BxLxHxK, k_BxCxGxK, v_BxCxGxK, causal=causal, scale=scale
    )
    return o_BxLxHxK.astype(jnp.float32), lse_BxLxH.astype(jnp.float32)


def combine(o_a, lse_a, o_b, lse_b):
    """Merge two partial softmax results over disjoint key sets (exact)."""
    lse = jnp.logaddexp(lse_a, lse_b)
    o = o_a * jnp.exp(lse_a - lse)[..., None] + o_b * jnp.exp(lse_b - lse)[..., None]
    return o, lse


def _ring(q_BxLxHxK, k_BxCxGxK, v_BxCxGxK, *, axis: str, W: int, causal: bool, scale: float):
    """Per device: local queries against every key block as it passes by."""
    i = lax.axis_index(axis)
    ring = [(d, (d + 1) % W) for d in range(W)]
    attend = functools.partial(block_attention, scale=scale)
    o, lse = attend(q_BxLxHxK, k_BxCxGxK, v_BxCxGxK, causal=causal)  # own block: the diagonal

    def step(carry, t):
        k_BxCxGxK, v_BxCxGxK, o, lse = carry
        k_BxCxGxK, v_BxCxGxK = lax.ppermute((k_BxCxGxK, v_BxCxGxK), axis, ring)
        o_t, lse_t = attend(q_BxLxHxK, k_BxCxGxK, v_BxCxGxK, causal=False)
        if causal:  # the block came from device (i - t) mod W: later in the sequence → unseen
            lse_t = jnp.where((i - t) % W > i, MASK, lse_t)
        o, lse = combine(o, lse, o_t, lse_t)
        return (k_BxCxGxK, v_BxCxGxK, o, lse), None

    (_, _, o, _), _ = lax.scan(step, (k_BxCxGxK, v_BxCxGxK, o, lse), jnp.arange(1, W))
    return o.astype(q_BxLxHxK.dtype)


def ring_attention(
    q_BxLxHxK,
    k_BxLxGxK,
    v_BxLxGxK,
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
    if q_BxLxHxK.shape[1] != k_BxLxGxK.shape[1] or q_BxLxHxK.shape[1] % W:
        raise ValueError(
            f"{q_BxLxHxK.shape=} {k_BxLxGxK.shape=}: ring attention needs equal q and kv "
            f"lengths divisible by {seq_axis}={W}"
        )
    scale = q_BxLxHxK.shape[-1] ** -0.5 if scale is None else scale
    spec = P(batch_axes, seq_axis, head_axes, None)
    fn = shard_map(
        functools.partial(_ring, axis=seq_axis, W=W, causal=causal, scale=scale),
        mesh=mesh,
        in_specs=(spec, spec, spec),
        out_specs=spec,
    )
    return fn(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)


def _context_mesh():
    """The mesh the caller traces under (jax.set_mesh, or the Mesh context before JAX 0.7)."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get() if get else None
    if mesh is None or not mesh.axis_names:
        from jax._src import mesh as mesh_lib

        mesh = mesh_lib.thread_resources.env.physical_mesh
    return mesh


def _fits(axes, size: int, mesh) -> bool:
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    n = 1
    for a in names:
        n *= mesh.shape[a]
    return size % n == 0


def ring_attention_in_model(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, *, causal: bool = True):
    """`attention=ring` inside lab.model: the ring runs over the mesh axis the logical rules
    give `seq` (strategy=cp). Batch and heads keep their sharding where they divide (the
    model's init traces a batch of one)."""
    mesh = _context_mesh()
    batch, seq, heads, _ = nn.logical_to_mesh_axes(("batch", "seq", "heads", "kv"))
    if not mesh.axis_names or seq is None:
        raise ValueError("attention=ring needs a mesh axis for the sequence: use strategy=cp")
    seq_axes = (seq,) if isinstance(seq, str) else tuple(seq)
    if len(seq_axes) != 1:
        raise ValueError(f"attention=ring runs over one mesh axis, the rules give seq={seq_axes}")
    B, G = q_BxLxHxK.shape[0], k_BxLxGxK.shape[2]
    return ring_attention(
        q_BxLxHxK,
        k_BxLxGxK,
        v_BxLxGxK,
        mesh=mesh,
        seq_axis=seq_axes[0],
        batch_axes=batch if _fits(batch, B, mesh) else None,
        head_axes=heads if _fits(heads, G, mesh) else None,
        causal=causal,
    )

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
from lab.kernels.attention.common import Mask

FEATURES = frozenset({"segments", "lengths", "softcap", "sinks", "lse", "value_dim"})


def block_attention(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, *, causal: bool, scale: float, **kwargs):
    """One query block against one key block: (output_BxLxHxV in f32, lse_BxLxH), by the
    blockwise flash kernel; `causal` aligns the mask to the diagonal (own block, L == C);
    `kwargs`: the kernel's mask, softcap (blockwise.blockwise_attention)."""
    o_BxLxHxV, lse_BxLxH = blockwise.blockwise_attention_with_lse(
        q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, causal=causal, scale=scale, **kwargs
    )
    return o_BxLxHxV.astype(jnp.float32), lse_BxLxH.astype(jnp.float32)


def combine(o_a, lse_a, o_b, lse_b):
    """Merge two partial softmax results over disjoint key sets (exact); an LSE of -inf (no
    key seen) weighs 0, and two of them give the output 0 and -inf."""
    m = jnp.maximum(lse_a, lse_b)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w_a, w_b = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
    total = w_a + w_b
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, m + jnp.log(safe), -jnp.inf)
    o = (o_a * w_a[..., None] + o_b * w_b[..., None]) / safe[..., None]
    return o, lse


def _local_mask(q_seg, kv_seg, q_len, kv_len, *, causal: bool, q_start, k_start, C: int):
    """The Mask of local queries [q_start, q_start + C) against keys [k_start, k_start + C):
    segment ids as they are, global lengths made local (clipped to the block)."""
    local = lambda n, start: None if n is None else jnp.clip(n - start, 0, C)  # noqa: E731
    return Mask.make(
        causal=causal,
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        q_lengths=local(q_len, q_start),
        kv_lengths=local(kv_len, k_start),
    )


def _ring(
    q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, mask, sinks_H, *, axis, W, causal, scale, softcap, return_lse
):
    """Per device: local queries against every key block as it passes by."""
    i = lax.axis_index(axis)
    C = q_BxLxHxK.shape[1]
    ring = [(d, (d + 1) % W) for d in range(W)]
    extra = {} if softcap is None else {"softcap": softcap}
    q_seg, kv_seg = mask.q_segment_ids, mask.kv_segment_ids
    q_len, kv_len = mask.q_lengths, mask.kv_lengths
    if q_len is not None and kv_len is None:
        kv_len = jnp.full_like(q_len, W * C)
    if kv_len is not None and q_len is None:
        q_len = jnp.full_like(kv_len, W * C)

    def attend(k_BxSxGxK, v_BxSxGxV, kv_seg, src, *, causal):
        m = _local_mask(
            q_seg, kv_seg, q_len, kv_len, causal=causal, q_start=i * C, k_start=src * C, C=C
        )
        return block_attention(
            q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, causal=causal, scale=scale, mask=m, **extra
        )

    o, lse = attend(k_BxSxGxK, v_BxSxGxV, kv_seg, i, causal=causal)  # own block: the diagonal

    def step(carry, t):
        k_BxSxGxK, v_BxSxGxV, kv_seg, o, lse = carry
        k_BxSxGxK, v_BxSxGxV, kv_seg = lax.ppermute((k_BxSxGxK, v_BxSxGxV, kv_seg), axis, ring)
        src = (i - t) % W
        o_t, lse_t = attend(k_BxSxGxK, v_BxSxGxV, kv_seg, src, causal=False)
        if causal:  # the block came from device (i - t) mod W: later in the sequence → unseen
            lse_t = jnp.where(src > i, -jnp.inf, lse_t)
        o, lse = combine(o, lse, o_t, lse_t)
        return (k_BxSxGxK, v_BxSxGxV, kv_seg, o, lse), None

    (_, _, _, o, lse), _ = lax.scan(step, (k_BxSxGxK, v_BxSxGxV, kv_seg, o, lse), jnp.arange(1, W))
    if sinks_H is not None:  # one more logit per row, with no value: weighs the output down
        sink_1x1xH = jnp.broadcast_to(sinks_H.astype(jnp.float32)[None, None], lse.shape)
        o, lse = combine(o, lse, jnp.zeros_like(o), sink_1x1xH)
    o = o.astype(q_BxLxHxK.dtype)
    return (o, lse) if return_lse else o


def ring_attention(
    q_BxLxHxK,
    k_BxSxGxK,
    v_BxSxGxV,
    *,
    mesh,
    seq_axis: str,
    batch_axes=None,
    head_axes=None,
    causal: bool = True,
    scale: float | None = None,
    mask: Mask | None = None,
    softcap: float | None = None,
    sinks=None,
    return_lse: bool = False,
):
    """softmax(Q·Kᵀ·scale)·V, layout [batch, seq, heads, head_dim], with the sequence split
    over `seq_axis` of `mesh` (batch and heads optionally over other axes). Equal to
    lab.kernels.attention.attention_reference; L must divide by the axis size.

    `mask` may carry segment ids (they travel around the ring with their keys) and
    per-sequence lengths; a sliding window is not supported here. `softcap`, `sinks` [H] and
    `return_lse` (out, lse [B, L, H] f32) as in blockwise_attention."""
    W = mesh.shape[seq_axis]
    if q_BxLxHxK.shape[1] != k_BxSxGxK.shape[1] or q_BxLxHxK.shape[1] % W:
        raise ValueError(
            f"{q_BxLxHxK.shape=} {k_BxSxGxK.shape=}: ring attention needs equal q and kv "
            f"lengths divisible by {seq_axis}={W}"
        )
    mask = Mask.make(causal=causal) if mask is None else mask
    if mask.window is not None:
        raise ValueError(f"window={mask.window}: impl='ring' does not support a sliding window")
    mask.check(q_BxLxHxK.shape[0], q_BxLxHxK.shape[1], k_BxSxGxK.shape[1])
    scale = q_BxLxHxK.shape[-1] ** -0.5 if scale is None else scale
    spec = P(batch_axes, seq_axis, head_axes, None)
    row = P(batch_axes, seq_axis)
    mask_spec = Mask(
        q_segment_ids=None if mask.q_segment_ids is None else row,
        kv_segment_ids=None if mask.kv_segment_ids is None else row,
        q_lengths=None if mask.q_lengths is None else P(batch_axes),
        kv_lengths=None if mask.kv_lengths is None else P(batch_axes),
        causal=mask.causal,
        window=None,
    )
    lse_spec = P(batch_axes, seq_axis, head_axes)
    fn = jax.shard_map(
        functools.partial(
            _ring,
            axis=seq_axis,
            W=W,
            causal=mask.causal,
            scale=scale,
            softcap=softcap,
            return_lse=return_lse,
        ),
        mesh=mesh,
        in_specs=(spec, spec, spec, mask_spec, None if sinks is None else P(head_axes)),
        out_specs=(spec, lse_spec) if return_lse else spec,
        check_vma=False,
    )
    return fn(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, mask, sinks)

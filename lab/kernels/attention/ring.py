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

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from lab.kernels.attention import blockwise
from lab.kernels.attention.common import Mask, with_causal

FEATURES = frozenset(
    {"empty_rows", "segments", "lengths", "window", "softcap", "sinks", "lse", "value_dim"}
)


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


def _local_mask(q_seg, kv_seg, q_len, kv_len, *, causal: bool, q_start, k_start, C: int, band=None):
    """The Mask of local queries [q_start, q_start + C) against keys [k_start, k_start + C):
    segment ids as they are, global lengths made local (clipped to the block). `band`: the
    local (left, right) window that replaces `causal` (see `_band`)."""
    local = lambda n, start: None if n is None else jnp.clip(n - start, 0, C)  # noqa: E731
    mask = Mask.make(
        causal=causal,
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        q_lengths=local(q_len, q_start),
        kv_lengths=local(kv_len, k_start),
    )
    # Built directly: a shifted band may have a negative side, which Mask.make refuses from
    # users but Mask.visible and Mask.block_map take as the plain inequality it is.
    return mask if band is None else dataclasses.replace(mask, causal=False, window=band)


def _band(mask: Mask, off: int, C: int):
    """The local window (left, right) of a query block against a key block whose first key
    is `off` positions after its first query (the global band shifted by off), or "empty"
    when no pair of the two blocks is in the band: the step's work is skipped statically."""
    lo, hi = mask.band(C, C)  # global offsets j - i the band allows (L == S here)
    lo_l = None if lo is None else lo - off  # local offsets lk - lq, which lie in ±(C - 1)
    hi_l = None if hi is None else hi - off
    if (hi_l is not None and hi_l < 1 - C) or (lo_l is not None and lo_l > C - 1):
        return "empty"
    if lo_l is not None and hi_l is not None and lo_l > hi_l:
        return "empty"
    return (None if lo_l is None else -lo_l, hi_l)


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

    def attend(k_BxSxGxK, v_BxSxGxV, kv_seg, src, *, causal, band=None):
        if band == "empty":  # no pair of these blocks is in the window: weight 0
            B, L, H, _ = q_BxLxHxK.shape
            o = jnp.zeros((B, L, H, v_BxSxGxV.shape[-1]), jnp.float32)
            return o, jnp.full((B, L, H), -jnp.inf, jnp.float32)
        m = _local_mask(
            q_seg,
            kv_seg,
            q_len,
            kv_len,
            causal=causal,
            q_start=i * C,
            k_start=src * C,
            C=C,
            band=band,
        )
        return block_attention(
            q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, causal=m.causal, scale=scale, mask=m, **extra
        )

    if mask.window is not None:
        o, lse = _ring_banded(attend, (k_BxSxGxK, v_BxSxGxV, kv_seg), mask, i, C, W, ring, axis)
    else:
        o, lse = attend(k_BxSxGxK, v_BxSxGxV, kv_seg, i, causal=causal)  # own block: diagonal

        def step(carry, t):
            k_BxSxGxK, v_BxSxGxV, kv_seg, o, lse = carry
            k_BxSxGxK, v_BxSxGxV, kv_seg = lax.ppermute((k_BxSxGxK, v_BxSxGxV, kv_seg), axis, ring)
            src = (i - t) % W
            o_t, lse_t = attend(k_BxSxGxK, v_BxSxGxV, kv_seg, src, causal=False)
            if causal:  # the block came from device (i - t) mod W: later in the sequence
                lse_t = jnp.where(src > i, -jnp.inf, lse_t)
            o, lse = combine(o, lse, o_t, lse_t)
            return (k_BxSxGxK, v_BxSxGxV, kv_seg, o, lse), None

        init = (k_BxSxGxK, v_BxSxGxV, kv_seg, o, lse)
        (_, _, _, o, lse), _ = lax.scan(step, init, jnp.arange(1, W))
    if sinks_H is not None:  # one more logit per row, with no value: weighs the output down
        sink_1x1xH = jnp.broadcast_to(sinks_H.astype(jnp.float32)[None, None], lse.shape)
        o, lse = combine(o, lse, jnp.zeros_like(o), sink_1x1xH)
    o = o.astype(q_BxLxHxK.dtype)
    return (o, lse) if return_lse else o


def _ring_banded(attend, kv, mask: Mask, i, C: int, W: int, ring, axis):
    """The ring with a sliding window (causal or not), unrolled over its steps so that each
    step's mask is static: at step t device i holds the block of device (i - t) mod W, which
    starts t·C keys before its queries when i >= t and (W - t)·C after them otherwise, so
    each step is a `lax.cond` between those two banded blocks (`_band`). A block no pair of
    which is in the window is skipped, and the ring stops after the last step that any device
    needs, so a window of w keys costs about w/C + 1 steps, not W."""
    bands = [(_band(mask, -t * C, C), _band(mask, (W - t) * C, C)) for t in range(W)]
    last = max((t for t, pair in enumerate(bands) if pair != ("empty", "empty")), default=0)
    o, lse = attend(*kv, i, causal=False, band=bands[0][0])
    for t in range(1, last + 1):
        kv = lax.ppermute(kv, axis, ring)
        back, wrap = bands[t]
        if (back, wrap) == ("empty", "empty"):
            continue
        src = (i - t) % W
        one = lambda band, kv, src: attend(*kv, src, causal=False, band=band)  # noqa: E731
        o_t, lse_t = lax.cond(
            i >= t, functools.partial(one, back), functools.partial(one, wrap), kv, src
        )
        o, lse = combine(o, lse, o_t, lse_t)
    return o, lse


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
    lab.kernels.attention.attention_reference; max(L, S) must divide by the axis size.

    `mask` is combined with `causal` (causal when either is: common.with_causal; a
    non-causal mask needs causal=False). It may carry segment ids (they travel around the
    ring with their keys), per-sequence lengths and a sliding window (each step's band
    static: `_ring_banded`). q and kv lengths may differ: the shorter side is padded at the
    front to the longer (`_equalise`), which keeps the bottom-right diagonal where it was, so
    causal with more queries than keys gives 0 for the rows that see no key, as everywhere.
    `softcap`, `sinks` [H] and `return_lse` (out, lse [B, L, H] f32) as in
    blockwise_attention."""
    W = mesh.shape[seq_axis]
    L, S = q_BxLxHxK.shape[1], k_BxSxGxK.shape[1]
    if max(L, S) % W:
        raise ValueError(
            f"{q_BxLxHxK.shape=} {k_BxSxGxK.shape=}: ring attention needs the longer of the q "
            f"and kv lengths divisible by {seq_axis}={W}"
        )
    mask = with_causal(mask, causal)
    mask.check(q_BxLxHxK.shape[0], L, S)
    q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, mask = _equalise(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, mask)
    scale = q_BxLxHxK.shape[-1] ** -0.5 if scale is None else scale
    spec = P(batch_axes, seq_axis, head_axes, None)
    row = P(batch_axes, seq_axis)
    mask_spec = Mask(
        q_segment_ids=None if mask.q_segment_ids is None else row,
        kv_segment_ids=None if mask.kv_segment_ids is None else row,
        q_lengths=None if mask.q_lengths is None else P(batch_axes),
        kv_lengths=None if mask.kv_lengths is None else P(batch_axes),
        causal=mask.causal,
        window=mask.window,
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
    out = fn(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, mask, sinks)
    if L >= S:
        return out
    return (out[0][:, S - L :], out[1][:, S - L :]) if return_lse else out[:, S - L :]


def _equalise(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, mask: Mask):
    """q, k, v and mask with L == S and the same attention for the real rows: the shorter side
    padded at the front by P = |L - S| positions, which moves every real query and key by P
    together (the offsets j - i - (S - L) and so the causal and window bands stay put; lengths
    grow by P). Padded keys get a segment id no query has, so no row sees them (and their
    tiles are empty); padded queries' rows are dropped by the caller."""
    B, L = q_BxLxHxK.shape[:2]
    S = k_BxSxGxK.shape[1]
    if L == S:
        return q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, mask
    front = lambda x, n: jnp.pad(x, [(0, 0), (n, 0)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    grow = lambda n, by: None if n is None else n + by  # noqa: E731
    if L < S:
        P_ = S - L
        q_seg = mask.q_segment_ids
        q_seg = None if q_seg is None else front(q_seg, P_)
        return (
            front(q_BxLxHxK, P_),
            k_BxSxGxK,
            v_BxSxGxV,
            dataclasses.replace(mask, q_segment_ids=q_seg, q_lengths=grow(mask.q_lengths, P_)),
        )
    P_ = L - S
    if mask.segments:
        q_seg, kv_seg = mask.q_segment_ids, mask.kv_segment_ids
    else:
        q_seg, kv_seg = jnp.zeros((B, L), jnp.int32), jnp.zeros((B, S), jnp.int32)
    unseen = (jnp.min(q_seg) - 1).astype(kv_seg.dtype)
    kv_seg = jnp.concatenate([jnp.full((B, P_), unseen, kv_seg.dtype), kv_seg], axis=1)
    mask = dataclasses.replace(
        mask, q_segment_ids=q_seg, kv_segment_ids=kv_seg, kv_lengths=grow(mask.kv_lengths, P_)
    )
    return q_BxLxHxK, front(k_BxSxGxK, P_), front(v_BxSxGxV, P_), mask

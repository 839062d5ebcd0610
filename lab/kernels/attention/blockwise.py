"""Flash attention in pure JAX: online softmax over key blocks, recompute in the backward.

Why it exists: it runs on every backend with no kernel language, and its memory is linear in
sequence length, forward *and* backward (the naive form keeps a B·H·L·S score tensor, and
autodiff saves it for the backward). The saved residuals are q, k, v, the output and one
log-sum-exp per query row; every L×S quantity lives one (block_q × block_k) tile at a time.

Loop structure: queries are cut into blocks (`lax.map`, sequential); for each query block a
`fori_loop` walks only the key blocks the mask leaves non-empty (`common.Mask.block_map`: the
causal diagonal, a sliding window, segment ids, lengths), applying the mask only to partial
tiles, so causal attention does about half the work and a window of W keys about W/S of it.
The backward is one pass over key blocks (`scan`), each walking its non-empty query blocks:
the probabilities are recomputed once and
feed dV, dK and dQ together (dQ is accumulated in place in a full-size f32 buffer, still linear
in L), which on CPU is cheaper than FlashAttention-2's separate dQ and dK/dV passes, because
exp() over the tile is the expensive part there.

Letters (lab/names.py): B batch, H query heads, G key/value heads, R = H/G query heads per kv
head, K head dim. Inside the loops a tile has L query rows and S key columns; l and s count the
query and key blocks (q_lxBxLxGxRxK: l blocks of L rows).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from lab.kernels import varying
from lab.kernels.attention.common import (
    FULL,
    MASK_VALUE,
    PARTIAL,
    BlockMap,
    Geometry,
    Mask,
    check_dtype,
    check_qkv,
    check_sinks,
    check_softcap,
    default_scale,
    pad_seq,
    round_up,
    with_causal,
)

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)
FEATURES = frozenset(
    {"empty_rows", "segments", "lengths", "window", "softcap", "sinks", "lse", "value_dim"}
)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile of the score matrix held at once; both shrink to the (8-rounded) sequence length."""

    block_q: int = 256  # query rows per tile (256: fastest on a 2-core CPU, see bench)
    block_k: int = 256  # key columns per tile

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value % 8:
                raise ValueError(f"BlockSizes.{name}={value!r}: must be a positive multiple of 8")

    def fit(self, L: int, S: int) -> tuple[int, int]:
        """Blocks no larger than the (padded) sequences, so short inputs are not over-padded."""
        return min(self.block_q, round_up(L, 8)), min(self.block_k, round_up(S, 8))


def _blocks(x_BxSxRest, block: int):
    """[B, n·block, ...] -> [n, B, block, ...]: the loop axis first."""
    B, n = x_BxSxRest.shape[0], x_BxSxRest.shape[1] // block
    return jnp.swapaxes(x_BxSxRest.reshape(B, n, block, *x_BxSxRest.shape[2:]), 0, 1)


def _unblocks(x_lxBxLxRest):
    """Inverse of `_blocks`."""
    l, B, L = x_lxBxLxRest.shape[:3]
    return jnp.swapaxes(x_lxBxLxRest, 0, 1).reshape(B, l * L, *x_lxBxLxRest.shape[3:])


@dataclasses.dataclass(frozen=True)
class _Static:
    """The static part of one call (hashable: a custom_vjp static argument)."""

    g: Geometry
    softcap: float | None
    sinks: bool  # whether per-head sink logits are given


def _mask_blocks(mask: Mask, g: Geometry):
    """The mask's per-sequence arrays cut into the kernel's blocks: query segment ids
    [l, B, L] and key segment ids [s, B, S] (None without segments)."""
    if not mask.segments:
        return None, None
    q_seg = pad_seq(mask.q_segment_ids, g.n_q * g.bq)
    kv_seg = pad_seq(mask.kv_segment_ids, g.n_k * g.bk)
    return _blocks(q_seg, g.bq), _blocks(kv_seg, g.bk)


def _tile_visible(mask: Mask, g: Geometry, n, m, q_seg_lxBxL, kv_seg_sxBxS):
    """[B or 1, 1, 1, L, S]: which pairs of tile (n, m) take part (broadcasts over G, R)."""
    q_pos = (n * g.bq + jnp.arange(g.bq))[None, :, None]
    k_pos = (m * g.bk + jnp.arange(g.bk))[None, None, :]
    q_seg = None if q_seg_lxBxL is None else q_seg_lxBxL[n][:, :, None]
    kv_seg = None if kv_seg_sxBxS is None else kv_seg_sxBxS[m][:, None, :]
    q_len = None if mask.q_lengths is None else mask.q_lengths[:, None, None]
    kv_len = None if mask.kv_lengths is None else mask.kv_lengths[:, None, None]
    ok = mask.visible(
        q_pos, k_pos, L=g.L, S=g.S, q_seg=q_seg, kv_seg=kv_seg, q_len=q_len, kv_len=kv_len
    )
    return ok[:, None, None]


def _scores(q_BxLxGxRxK, k_BxSxGxK, st: _Static, acc):
    """Scaled (and soft-capped) scores of a query block against a key block; with softcap
    also tanh(scores/cap), which the backward's chain rule needs."""
    s_BxGxRxLxS = jnp.einsum(
        "blgrk,bsgk->bgrls", q_BxLxGxRxK, k_BxSxGxK, preferred_element_type=acc
    )
    s_BxGxRxLxS = s_BxGxRxLxS * st.g.scale
    if st.softcap is None:
        return s_BxGxRxLxS, None
    t_BxGxRxLxS = jnp.tanh(s_BxGxRxLxS / st.softcap)
    return st.softcap * t_BxGxRxLxS, t_BxGxRxLxS


def _grouped(x_BxLxHxK, g: Geometry):
    """[B, L, H, K] -> query blocks [l, B, L, G, R, K]; head h = g·R + r, as jnp.repeat makes."""
    B, L, H, K = x_BxLxHxK.shape
    x_BxLpxGxRxK = pad_seq(x_BxLxHxK, g.n_q * g.bq).reshape(B, g.n_q * g.bq, g.G, g.R, K)
    return _blocks(x_BxLpxGxRxK, g.bq)


def _by_kind(kind, has_partial: bool, has_full: bool, step):
    """Run `step(masked)` as the tile's kind asks: the mask only on PARTIAL tiles."""
    if not has_full:
        return step(True)
    if not has_partial:
        return step(False)
    return lax.cond(kind == FULL, lambda: step(False), lambda: step(True))


def _kinds_present(bm: BlockMap) -> tuple[bool, bool]:
    """(may a tile be PARTIAL, may one be FULL): static where the map is."""
    if not bm.static:
        return True, True
    return bool((bm.kind == PARTIAL).any()), bool((bm.kind == FULL).any())


def _forward(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, mask, sinks_H, st: _Static):
    """(out [B, L, H, V], lse [l, B, G, R, L]): the log-sum-exp per query row in block layout
    (query block n, row r of head g·R + r), natural log, f32 (f64 for f64 inputs), +inf for a
    row that sees nothing (so the backward's exp(s - lse) is 0 there); padded query rows
    included. What a caller combining partial attentions (ring attention) needs."""
    g = st.g
    acc = jnp.promote_types(q_BxLxHxK.dtype, jnp.float32)
    q_lxBxLxGxRxK = _grouped(q_BxLxHxK, g)
    k_sxBxSxGxK = _blocks(pad_seq(k_BxSxGxK, g.n_k * g.bk), g.bk)
    v_sxBxSxGxV = _blocks(pad_seq(v_BxSxGxV, g.n_k * g.bk), g.bk)
    q_seg, kv_seg = _mask_blocks(mask, g)
    bm = mask.block_map(g.L, g.S, g.bq, g.bk).merged()
    has_partial, has_full = _kinds_present(bm)
    kind_lxs, kv_blocks_lxs, kv_count_l = (
        jnp.asarray(x[0]) for x in (bm.kind, bm.kv_blocks, bm.kv_count)
    )

    def one_q_block(args):
        n, q_BxLxGxRxK = args

        def step(t, carry):
            m = kv_blocks_lxs[n, t]

            def tile(masked: bool):
                o_BxGxRxLxV, max_BxGxRxL, sum_BxGxRxL = carry
                s_BxGxRxLxS, _ = _scores(q_BxLxGxRxK, k_sxBxSxGxK[m], st, acc)
                if masked:
                    ok = _tile_visible(mask, g, n, m, q_seg, kv_seg)
                    s_BxGxRxLxS = jnp.where(ok, s_BxGxRxLxS, MASK_VALUE)
                new_max_BxGxRxL = jnp.maximum(max_BxGxRxL, s_BxGxRxLxS.max(-1))
                p_BxGxRxLxS = jnp.exp(s_BxGxRxLxS - new_max_BxGxRxL[..., None])
                if masked:  # a row that has seen only masked keys has max MASK_VALUE: exp = 1
                    p_BxGxRxLxS = jnp.where(ok, p_BxGxRxLxS, 0.0)
                alpha_BxGxRxL = jnp.exp(max_BxGxRxL - new_max_BxGxRxL)
                pv_BxGxRxLxV = jnp.einsum(
                    "bgrls,bsgv->bgrlv",
                    p_BxGxRxLxS.astype(v_sxBxSxGxV.dtype),
                    v_sxBxSxGxV[m],
                    preferred_element_type=acc,
                )
                o_BxGxRxLxV = alpha_BxGxRxL[..., None] * o_BxGxRxLxV + pv_BxGxRxLxV
                sum_BxGxRxL = alpha_BxGxRxL * sum_BxGxRxL + p_BxGxRxLxS.sum(-1)
                return o_BxGxRxLxV, new_max_BxGxRxL, sum_BxGxRxL

            return _by_kind(kind_lxs[n, m], has_partial, has_full, tile)

        B, L, G, R, _ = q_BxLxGxRxK.shape
        V = v_BxSxGxV.shape[-1]
        ins = (q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, sinks_H, *mask.arrays())  # the carry's axes
        if st.sinks:  # the sink is one more logit per row, with no value: max = sink, sum = 1
            sink_BxGxRxL = sinks_H.astype(acc).reshape(1, G, R, 1)
            max_BxGxRxL = sink_BxGxRxL + varying.full((B, G, R, L), 0, acc, *ins)
            sum_BxGxRxL = varying.full((B, G, R, L), 1, acc, *ins)
        else:
            max_BxGxRxL = varying.full((B, G, R, L), MASK_VALUE, acc, *ins)
            sum_BxGxRxL = varying.full((B, G, R, L), 0, acc, *ins)
        init = (varying.full((B, G, R, L, V), 0, acc, *ins), max_BxGxRxL, sum_BxGxRxL)
        o_BxGxRxLxV, max_BxGxRxL, sum_BxGxRxL = lax.fori_loop(0, kv_count_l[n], step, init)
        seen_BxGxRxL = sum_BxGxRxL > 0
        safe_BxGxRxL = jnp.where(seen_BxGxRxL, sum_BxGxRxL, 1.0)
        o_BxLxGxRxV = jnp.einsum("bgrlv->blgrv", o_BxGxRxLxV / safe_BxGxRxL[..., None])
        lse_BxGxRxL = jnp.where(seen_BxGxRxL, max_BxGxRxL + jnp.log(safe_BxGxRxL), jnp.inf)
        return o_BxLxGxRxV.astype(q_BxLxHxK.dtype), lse_BxGxRxL

    o_lxBxLxGxRxV, lse_lxBxGxRxL = lax.map(one_q_block, (jnp.arange(g.n_q), q_lxBxLxGxRxK))
    B, L, H, _ = q_BxLxHxK.shape
    o_BxLxHxV = _unblocks(o_lxBxLxGxRxV).reshape(B, -1, H, v_BxSxGxV.shape[-1])[:, :L]
    return o_BxLxHxV, lse_lxBxGxRxL


def _row_blocks(x_BxLxH, g: Geometry):
    """A per-row quantity [B, L, H] -> the kernel's block layout [l, B, G, R, L]."""
    return jnp.moveaxis(_grouped(x_BxLxH[..., None], g)[..., 0], 2, -1)


def _row_unblocks(x_lxBxGxRxL, g: Geometry):
    """Inverse of `_row_blocks`: [l, B, G, R, L] -> [B, L, H] (padded rows dropped)."""
    x_BxLpxGxR = _unblocks(jnp.moveaxis(x_lxBxGxRxL, -1, 2))
    B, Lp = x_BxLpxGxR.shape[:2]
    return x_BxLpxGxR.reshape(B, Lp, g.G * g.R)[:, : g.L]


def _user_lse(lse_lxBxGxRxL, g: Geometry):
    """The residual's log-sum-exp as the caller sees it: [B, L, H], -inf (log 0) for a row
    that sees nothing (the residual keeps +inf there for the backward)."""
    lse = _row_unblocks(lse_lxBxGxRxL, g)
    return jnp.where(lse == jnp.inf, -jnp.inf, lse)


def _group_sum(p_BxGxRxLxS, x_BxLxGxRxK, acc):
    """Σ over r, l of p[b,g,r,l,s]·x[b,l,g,r,k] → [B, S, G, K]: a key block's dK or dV from
    every query row of its kv head's R query heads. lax.dot_general written out to contract
    (R, L) in that order: jnp.einsum orders contracted letters alphabetically, and (L, R) made
    XLA:CPU keep one more tile (+0.5 MiB of temporaries at L = 1024, f32)."""
    dims = (((3, 1), (2, 3)), ((0, 2), (0, 1)))  # x's (r, l) with p's (r, l); batch (b, g)
    out_BxGxKxS = lax.dot_general(x_BxLxGxRxK, p_BxGxRxLxS, dims, preferred_element_type=acc)
    return jnp.transpose(out_BxGxKxS, (0, 3, 1, 2))


def _backward(st: _Static, residuals, do_BxLxHxV, dlse_BxLxH=None):
    """dQ, dK, dV (and the sinks' gradient); with `dlse_BxLxH` (the cotangent of the
    log-sum-exp output, see `blockwise_attention_with_lse`) folded in: d lse_i / d s_ij =
    P_ij, so dS = P·(dP − δ + dlse). Soft-capping multiplies dS by 1 − tanh²; a sink's logit
    gets Σ_rows −P_sink·(δ − dlse)."""
    g = st.g
    q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, o_BxLxHxV, lse_lxBxGxRxL, mask, sinks_H = residuals
    acc = jnp.promote_types(q_BxLxHxK.dtype, jnp.float32)
    ins = (*residuals[:5], sinks_H, do_BxLxHxV, dlse_BxLxH, *mask.arrays())  # the carries' axes
    # delta_i = Σ_d dO_id·O_id = Σ_j P_ij·dP_ij: the softmax-backward row term, linear in L.
    delta_BxLxH = jnp.einsum("blhv,blhv->blh", o_BxLxHxV.astype(acc), do_BxLxHxV.astype(acc))
    if dlse_BxLxH is not None:
        delta_BxLxH = delta_BxLxH - jnp.where(jnp.isfinite(dlse_BxLxH), dlse_BxLxH, 0).astype(acc)
    delta_lxBxGxRxL = _row_blocks(delta_BxLxH, g)
    q_lxBxLxGxRxK = _grouped(q_BxLxHxK, g)
    do_lxBxLxGxRxV = _grouped(do_BxLxHxV, g)
    k_sxBxSxGxK = _blocks(pad_seq(k_BxSxGxK, g.n_k * g.bk), g.bk)
    v_sxBxSxGxV = _blocks(pad_seq(v_BxSxGxV, g.n_k * g.bk), g.bk)
    q_seg, kv_seg = _mask_blocks(mask, g)
    bm = mask.block_map(g.L, g.S, g.bq, g.bk).merged()
    has_partial, has_full = _kinds_present(bm)
    kind_lxs, q_blocks_sxl, q_count_s = (
        jnp.asarray(x[0]) for x in (bm.kind, bm.q_blocks, bm.q_count)
    )

    def one_k_block(dq_lxBxLxGxRxK, args):
        m, k_BxSxGxK, v_BxSxGxV = args

        def step(t, carry):
            n = q_blocks_sxl[m, t]

            def tile(masked: bool):
                dk_BxSxGxK, dv_BxSxGxV, dq_lxBxLxGxRxK = carry
                q_BxLxGxRxK, do_BxLxGxRxV = q_lxBxLxGxRxK[n], do_lxBxLxGxRxV[n]
                s_BxGxRxLxS, t_BxGxRxLxS = _scores(q_BxLxGxRxK, k_BxSxGxK, st, acc)
                if masked:  # exp(MASK_VALUE - lse) is 0, also where lse is +inf (no key)
                    ok = _tile_visible(mask, g, n, m, q_seg, kv_seg)
                    s_BxGxRxLxS = jnp.where(ok, s_BxGxRxLxS, MASK_VALUE)
                p_BxGxRxLxS = jnp.exp(s_BxGxRxLxS - lse_lxBxGxRxL[n][..., None])
                dv_BxSxGxV += _group_sum(p_BxGxRxLxS.astype(do_BxLxGxRxV.dtype), do_BxLxGxRxV, acc)
                dp_BxGxRxLxS = jnp.einsum(
                    "blgrv,bsgv->bgrls", do_BxLxGxRxV, v_BxSxGxV, preferred_element_type=acc
                )
                ds_BxGxRxLxS = p_BxGxRxLxS * (dp_BxGxRxLxS - delta_lxBxGxRxL[n][..., None])
                if st.softcap is not None:
                    ds_BxGxRxLxS = ds_BxGxRxLxS * (1.0 - t_BxGxRxLxS * t_BxGxRxLxS)
                ds_BxGxRxLxS = (ds_BxGxRxLxS * g.scale).astype(q_BxLxGxRxK.dtype)
                dk_BxSxGxK += _group_sum(ds_BxGxRxLxS, q_BxLxGxRxK, acc)
                dq_BxLxGxRxK = jnp.einsum(
                    "bgrls,bsgk->blgrk", ds_BxGxRxLxS, k_BxSxGxK, preferred_element_type=acc
                )
                return dk_BxSxGxK, dv_BxSxGxV, dq_lxBxLxGxRxK.at[n].add(dq_BxLxGxRxK)

            return _by_kind(kind_lxs[n, m], has_partial, has_full, tile)

        init = (
            varying.full(k_BxSxGxK.shape, 0, acc, *ins),
            varying.full(v_BxSxGxV.shape, 0, acc, *ins),
            dq_lxBxLxGxRxK,
        )
        dk_BxSxGxK, dv_BxSxGxV, dq_lxBxLxGxRxK = lax.fori_loop(0, q_count_s[m], step, init)
        return dq_lxBxLxGxRxK, (dk_BxSxGxK, dv_BxSxGxV)

    dq_lxBxLxGxRxK, (dk_sxBxSxGxK, dv_sxBxSxGxV) = lax.scan(
        one_k_block,
        varying.full(q_lxBxLxGxRxK.shape, 0, acc, *ins),
        (jnp.arange(g.n_k), k_sxBxSxGxK, v_sxBxSxGxV),
    )
    B, L, H, K = q_BxLxHxK.shape
    S = k_BxSxGxK.shape[1]
    dq_BxLxHxK = _unblocks(dq_lxBxLxGxRxK).reshape(B, -1, H, K)[:, :L]
    dk_BxSxGxK = _unblocks(dk_sxBxSxGxK)[:, :S]
    dv_BxSxGxV = _unblocks(dv_sxBxSxGxV)[:, :S]
    dsinks_H = None
    if st.sinks:
        sink_1x1xGxRx1 = sinks_H.astype(acc).reshape(1, 1, g.G, g.R, 1)
        p_sink_lxBxGxRxL = jnp.exp(sink_1x1xGxRx1 - lse_lxBxGxRxL)
        dsinks_H = -(p_sink_lxBxGxRxL * delta_lxBxGxRxL).sum((0, 1, 4)).reshape(-1)
        dsinks_H = dsinks_H.astype(sinks_H.dtype)
    grads = (
        dq_BxLxHxK.astype(q_BxLxHxK.dtype),
        dk_BxSxGxK.astype(k_BxSxGxK.dtype),
        dv_BxSxGxV.astype(v_BxSxGxV.dtype),
        dsinks_H,
    )
    dq, dk, dv, ds = varying.reduce_like(grads, (q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, sinks_H))
    return dq, dk, dv, None, ds


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, mask, sinks_H, st: _Static):
    return _forward(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, mask, sinks_H, st)[0]


def _flash_fwd(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, mask, sinks_H, st: _Static):
    o_BxLxHxV, lse_lxBxGxRxL = _forward(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, mask, sinks_H, st)
    return o_BxLxHxV, (q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, o_BxLxHxV, lse_lxBxGxRxL, mask, sinks_H)


_flash.defvjp(_flash_fwd, _backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash_lse(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, mask, sinks_H, st: _Static):
    o_BxLxHxV, lse_lxBxGxRxL = _forward(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, mask, sinks_H, st)
    return o_BxLxHxV, _user_lse(lse_lxBxGxRxL, st.g)


def _flash_lse_fwd(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, mask, sinks_H, st: _Static):
    o_BxLxHxV, residuals = _flash_fwd(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, mask, sinks_H, st)
    return (o_BxLxHxV, _user_lse(residuals[4], st.g)), residuals


def _flash_lse_bwd(st: _Static, residuals, cotangents):
    do_BxLxHxV, dlse_BxLxH = cotangents
    return _backward(st, residuals, do_BxLxHxV, dlse_BxLxH)


_flash_lse.defvjp(_flash_lse_fwd, _flash_lse_bwd)


def _static(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, mask, softcap, sinks, scale, block_sizes) -> _Static:
    """The inputs checked, and the static sizes of one call (tiles fitted to the lengths)."""
    check_qkv(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, causal=mask.causal, empty_rows=True, value_dim=True)
    check_dtype(q_BxLxHxK, DTYPES, "blockwise")
    B, L, H, K = q_BxLxHxK.shape
    S, G = k_BxSxGxK.shape[1:3]
    mask.check(B, L, S)
    if sinks is not None and tuple(sinks.shape) != (H,):
        raise ValueError(f"{sinks.shape=}: attention sinks are one logit per query head, ({H},)")
    bq, bk = block_sizes.fit(L, S)
    scale = default_scale(K, scale)
    g = Geometry(L=L, S=S, G=G, R=H // G, bq=bq, bk=bk, causal=mask.causal, scale=scale)
    return _Static(
        g=g, softcap=None if softcap is None else float(softcap), sinks=sinks is not None
    )


@functools.partial(
    jax.jit, static_argnames=("causal", "scale", "block_sizes", "softcap", "return_lse")
)
def blockwise_attention(
    q_BxLxHxK,
    k_BxSxGxK,
    v_BxSxGxV,
    *,
    causal: bool = True,
    scale: float | None = None,
    block_sizes: BlockSizes = BlockSizes(),
    mask: Mask | None = None,
    softcap: float | None = None,
    sinks=None,
    return_lse: bool = False,
):
    """softmax(Q·Kᵀ·scale)·V, [batch, seq, heads, head_dim], grouped kv heads, any length.

    `mask` (common.Mask) says which pairs take part, combined with `causal` (causal when
    either is: common.with_causal; a non-causal mask needs causal=False): tiles it leaves
    empty are skipped in the forward and the backward, and only partial ones are masked; a
    row that sees nothing gives 0. `softcap`: cap·tanh(scores/cap). `sinks` [H]: one logit
    per query head in each row's softmax denominator (differentiable). `return_lse`: (out,
    lse [B, L, H] f32), both differentiable. v's head dim may differ from q's and k's.
    """
    mask = with_causal(mask, causal)
    # called directly (not through `attention`): the same checks, one ValueError each
    softcap, sinks = check_softcap(softcap), check_sinks(sinks, q_BxLxHxK.shape[2])
    st = _static(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, mask, softcap, sinks, scale, block_sizes)
    fn = _flash_lse if return_lse else _flash
    return fn(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, mask, sinks, st)


def blockwise_attention_with_lse(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, **kwargs):
    """(out [B, L, H, V], lse [B, L, H] in f32): the output and each row's log-sum-exp of the
    scaled scores, both differentiable. Partial attentions over disjoint key sets combine
    exactly through the LSE (ring attention), which is why a caller may need it."""
    return blockwise_attention(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, return_lse=True, **kwargs)

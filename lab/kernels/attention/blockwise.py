"""Flash attention in pure JAX: online softmax over key blocks, recompute in the backward.

Why it exists: it runs on every backend with no kernel language, and its memory is linear in
sequence length, forward *and* backward (the naive form keeps a B·H·L·S score tensor, and
autodiff saves it for the backward). The saved residuals are q, k, v, the output and one
log-sum-exp per query row; every L×S quantity lives one (block_q × block_k) tile at a time.

Loop structure: queries are cut into blocks (`lax.map`, sequential); for each query block a
`fori_loop` walks the key blocks, with an upper bound that stops at the causal diagonal, so
causal attention does about half the work. The backward is one pass over key blocks (`scan`),
each walking the query blocks from the diagonal down: the probabilities are recomputed once and
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

from lab.kernels.attention.common import (
    MASK_VALUE,
    Geometry,
    check_dtype,
    check_qkv,
    default_scale,
    pad_seq,
    round_up,
    visible,
)

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


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


def _scores(q_BxLxGxRxK, k_BxSxGxK, n, m, g: Geometry, acc):
    """Scaled, masked scores of query block n against key block m."""
    s_BxGxRxLxS = jnp.einsum(
        "blgrk,bsgk->bgrls", q_BxLxGxRxK, k_BxSxGxK, preferred_element_type=acc
    )
    s_BxGxRxLxS = s_BxGxRxLxS * g.scale
    if not g.needs_mask:
        return s_BxGxRxLxS
    q_pos_Lx1 = (n * g.bq + jnp.arange(g.bq))[:, None]
    k_pos_1xS = (m * g.bk + jnp.arange(g.bk))[None, :]
    ok_LxS = visible(q_pos_Lx1, k_pos_1xS, causal=g.causal, kv_len=g.S, offset=g.offset)
    return jnp.where(ok_LxS, s_BxGxRxLxS, MASK_VALUE)


def _grouped(x_BxLxHxK, g: Geometry):
    """[B, L, H, K] -> query blocks [l, B, L, G, R, K]; head h = g·R + r, as jnp.repeat makes."""
    B, L, H, K = x_BxLxHxK.shape
    x_BxLpxGxRxK = pad_seq(x_BxLxHxK, g.n_q * g.bq).reshape(B, g.n_q * g.bq, g.G, g.R, K)
    return _blocks(x_BxLpxGxRxK, g.bq)


def _forward(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, g: Geometry):
    """(out [B, L, H, K], lse [l, B, G, R, L]): the log-sum-exp per query row in block layout
    (query block n, row r of head g·R + r), natural log, f32 (f64 for f64 inputs); padded
    query rows included. What a caller combining partial attentions (ring attention) needs."""
    acc = jnp.promote_types(q_BxLxHxK.dtype, jnp.float32)
    q_lxBxLxGxRxK = _grouped(q_BxLxHxK, g)
    k_sxBxSxGxK = _blocks(pad_seq(k_BxSxGxK, g.n_k * g.bk), g.bk)
    v_sxBxSxGxK = _blocks(pad_seq(v_BxSxGxK, g.n_k * g.bk), g.bk)

    def one_q_block(args):
        n, q_BxLxGxRxK = args

        def step(m, carry):
            o_BxGxRxLxK, max_BxGxRxL, sum_BxGxRxL = carry
            s_BxGxRxLxS = _scores(q_BxLxGxRxK, k_sxBxSxGxK[m], n, m, g, acc)
            new_max_BxGxRxL = jnp.maximum(max_BxGxRxL, s_BxGxRxLxS.max(-1))
            p_BxGxRxLxS = jnp.exp(s_BxGxRxLxS - new_max_BxGxRxL[..., None])
            alpha_BxGxRxL = jnp.exp(max_BxGxRxL - new_max_BxGxRxL)
            pv_BxGxRxLxK = jnp.einsum(
                "bgrls,bsgk->bgrlk",
                p_BxGxRxLxS.astype(v_sxBxSxGxK.dtype),
                v_sxBxSxGxK[m],
                preferred_element_type=acc,
            )
            o_BxGxRxLxK = alpha_BxGxRxL[..., None] * o_BxGxRxLxK + pv_BxGxRxLxK
            sum_BxGxRxL = alpha_BxGxRxL * sum_BxGxRxL + p_BxGxRxLxS.sum(-1)
            return o_BxGxRxLxK, new_max_BxGxRxL, sum_BxGxRxL

        B, L, G, R, K = q_BxLxGxRxK.shape
        init = (
            jnp.zeros((B, G, R, L, K), acc),
            jnp.full((B, G, R, L), MASK_VALUE, acc),
            jnp.zeros((B, G, R, L), acc),
        )
        o_BxGxRxLxK, max_BxGxRxL, sum_BxGxRxL = lax.fori_loop(0, g.k_blocks_end(n), step, init)
        o_BxLxGxRxK = jnp.einsum("bgrlk->blgrk", o_BxGxRxLxK / sum_BxGxRxL[..., None])
        return o_BxLxGxRxK.astype(q_BxLxHxK.dtype), max_BxGxRxL + jnp.log(sum_BxGxRxL)

    o_lxBxLxGxRxK, lse_lxBxGxRxL = lax.map(one_q_block, (jnp.arange(g.n_q), q_lxBxLxGxRxK))
    B, L, H, K = q_BxLxHxK.shape
    o_BxLxHxK = _unblocks(o_lxBxLxGxRxK).reshape(B, -1, H, K)[:, :L]
    return o_BxLxHxK, lse_lxBxGxRxL


def _row_blocks(x_BxLxH, g: Geometry):
    """A per-row quantity [B, L, H] -> the kernel's block layout [l, B, G, R, L]."""
    return jnp.moveaxis(_grouped(x_BxLxH[..., None], g)[..., 0], 2, -1)


def _row_unblocks(x_lxBxGxRxL, g: Geometry):
    """Inverse of `_row_blocks`: [l, B, G, R, L] -> [B, L, H] (padded rows dropped)."""
    x_BxLpxGxR = _unblocks(jnp.moveaxis(x_lxBxGxRxL, -1, 2))
    B, Lp = x_BxLpxGxR.shape[:2]
    return x_BxLpxGxR.reshape(B, Lp, g.G * g.R)[:, : g.L]


def _group_sum(p_BxGxRxLxS, x_BxLxGxRxK, acc):
    """Σ over r, l of p[b,g,r,l,s]·x[b,l,g,r,k] → [B, S, G, K]: a key block's dK or dV from
    every query row of its kv head's R query heads. lax.dot_general written out to contract
    (R, L) in that order: jnp.einsum orders contracted letters alphabetically, and (L, R) made
    XLA:CPU keep one more tile (+0.5 MiB of temporaries at L = 1024, f32)."""
    dims = (((3, 1), (2, 3)), ((0, 2), (0, 1)))  # x's (r, l) with p's (r, l); batch (b, g)
    out_BxGxKxS = lax.dot_general(x_BxLxGxRxK, p_BxGxRxLxS, dims, preferred_element_type=acc)
    return jnp.transpose(out_BxGxKxS, (0, 3, 1, 2))


def _backward(g: Geometry, residuals, do_BxLxHxK, dlse_BxLxH=None):
    """dQ, dK, dV; with `dlse_BxLxH` (the cotangent of the log-sum-exp output, see
    `blockwise_attention_with_lse`) folded in: d lse_i / d s_ij = P_ij, so
    dS = P·(dP − δ + dlse)."""
    q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, o_BxLxHxK, lse_lxBxGxRxL = residuals
    acc = jnp.promote_types(q_BxLxHxK.dtype, jnp.float32)
    # delta_i = Σ_d dO_id·O_id = Σ_j P_ij·dP_ij: the softmax-backward row term, linear in L.
    delta_BxLxH = jnp.einsum("blhk,blhk->blh", o_BxLxHxK.astype(acc), do_BxLxHxK.astype(acc))
    if dlse_BxLxH is not None:
        delta_BxLxH = delta_BxLxH - dlse_BxLxH.astype(acc)
    delta_lxBxGxRxL = _row_blocks(delta_BxLxH, g)
    q_lxBxLxGxRxK = _grouped(q_BxLxHxK, g)
    do_lxBxLxGxRxK = _grouped(do_BxLxHxK, g)
    k_sxBxSxGxK = _blocks(pad_seq(k_BxSxGxK, g.n_k * g.bk), g.bk)
    v_sxBxSxGxK = _blocks(pad_seq(v_BxSxGxK, g.n_k * g.bk), g.bk)

    def one_k_block(dq_lxBxLxGxRxK, args):
        m, k_BxSxGxK, v_BxSxGxK = args

        def step(n, carry):
            dk_BxSxGxK, dv_BxSxGxK, dq_lxBxLxGxRxK = carry
            q_BxLxGxRxK, do_BxLxGxRxK = q_lxBxLxGxRxK[n], do_lxBxLxGxRxK[n]
            s_BxGxRxLxS = _scores(q_BxLxGxRxK, k_BxSxGxK, n, m, g, acc)
            p_BxGxRxLxS = jnp.exp(s_BxGxRxLxS - lse_lxBxGxRxL[n][..., None])
            dv_BxSxGxK += _group_sum(p_BxGxRxLxS.astype(do_BxLxGxRxK.dtype), do_BxLxGxRxK, acc)
            dp_BxGxRxLxS = jnp.einsum(
                "blgrk,bsgk->bgrls", do_BxLxGxRxK, v_BxSxGxK, preferred_element_type=acc
            )
            ds_BxGxRxLxS = p_BxGxRxLxS * (dp_BxGxRxLxS - delta_lxBxGxRxL[n][..., None])
            ds_BxGxRxLxS = (ds_BxGxRxLxS * g.scale).astype(q_BxLxGxRxK.dtype)
            dk_BxSxGxK += _group_sum(ds_BxGxRxLxS, q_BxLxGxRxK, acc)
            dq_BxLxGxRxK = jnp.einsum(
                "bgrls,bsgk->blgrk", ds_BxGxRxLxS, k_BxSxGxK, preferred_element_type=acc
            )
            return dk_BxSxGxK, dv_BxSxGxK, dq_lxBxLxGxRxK.at[n].add(dq_BxLxGxRxK)

        zeros_BxSxGxK = jnp.zeros(k_BxSxGxK.shape, acc)
        dk_BxSxGxK, dv_BxSxGxK, dq_lxBxLxGxRxK = lax.fori_loop(
            g.q_blocks_start(m), g.n_q, step, (zeros_BxSxGxK, zeros_BxSxGxK, dq_lxBxLxGxRxK)
        )
        return dq_lxBxLxGxRxK, (dk_BxSxGxK, dv_BxSxGxK)

    dq_lxBxLxGxRxK, (dk_sxBxSxGxK, dv_sxBxSxGxK) = lax.scan(
        one_k_block,
        jnp.zeros(q_lxBxLxGxRxK.shape, acc),
        (jnp.arange(g.n_k), k_sxBxSxGxK, v_sxBxSxGxK),
    )
    B, L, H, K = q_BxLxHxK.shape
    S = k_BxSxGxK.shape[1]
    dq_BxLxHxK = _unblocks(dq_lxBxLxGxRxK).reshape(B, -1, H, K)[:, :L]
    dk_BxSxGxK = _unblocks(dk_sxBxSxGxK)[:, :S]
    dv_BxSxGxK = _unblocks(dv_sxBxSxGxK)[:, :S]
    return (
        dq_BxLxHxK.astype(q_BxLxHxK.dtype),
        dk_BxSxGxK.astype(k_BxSxGxK.dtype),
        dv_BxSxGxK.astype(v_BxSxGxK.dtype),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, g: Geometry):
    return _forward(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, g)[0]


def _flash_fwd(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, g: Geometry):
    o_BxLxHxK, lse_lxBxGxRxL = _forward(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, g)
    return o_BxLxHxK, (q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, o_BxLxHxK, lse_lxBxGxRxL)


_flash.defvjp(_flash_fwd, _backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash_lse(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, g: Geometry):
    o_BxLxHxK, lse_lxBxGxRxL = _forward(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, g)
    return o_BxLxHxK, _row_unblocks(lse_lxBxGxRxL, g)


def _flash_lse_fwd(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, g: Geometry):
    o_BxLxHxK, residuals = _flash_fwd(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, g)
    return (o_BxLxHxK, _row_unblocks(residuals[-1], g)), residuals


def _flash_lse_bwd(g: Geometry, residuals, cotangents):
    do_BxLxHxK, dlse_BxLxH = cotangents
    return _backward(g, residuals, do_BxLxHxK, dlse_BxLxH)


_flash_lse.defvjp(_flash_lse_fwd, _flash_lse_bwd)


def _geometry(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal, scale, block_sizes) -> Geometry:
    """The inputs checked, and the static sizes of one call (tiles fitted to the lengths)."""
    check_qkv(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal=causal)
    check_dtype(q_BxLxHxK, DTYPES, "blockwise")
    _, L, H, K = q_BxLxHxK.shape
    S, G = k_BxSxGxK.shape[1:3]
    bq, bk = block_sizes.fit(L, S)
    scale = default_scale(K, scale)
    return Geometry(L=L, S=S, G=G, R=H // G, bq=bq, bk=bk, causal=causal, scale=scale)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "block_sizes"))
def blockwise_attention(
    q_BxLxHxK,
    k_BxSxGxK,
    v_BxSxGxK,
    *,
    causal: bool = True,
    scale: float | None = None,
    block_sizes: BlockSizes = BlockSizes(),
):
    """softmax(Q·Kᵀ·scale)·V, [batch, seq, heads, head_dim], grouped kv heads, any length."""
    g = _geometry(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal, scale, block_sizes)
    return _flash(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, g)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "block_sizes"))
def blockwise_attention_with_lse(
    q_BxLxHxK,
    k_BxSxGxK,
    v_BxSxGxK,
    *,
    causal: bool = True,
    scale: float | None = None,
    block_sizes: BlockSizes = BlockSizes(),
):
    """(out [B, L, H, K], lse [B, L, H] in f32): the output and each row's log-sum-exp of the
    scaled scores, both differentiable. Partial attentions over disjoint key sets combine
    exactly through the LSE (ring attention), which is why a caller may need it."""
    g = _geometry(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal, scale, block_sizes)
    return _flash_lse(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, g)

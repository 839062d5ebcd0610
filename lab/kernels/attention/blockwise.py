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

Letters: B batch, L query seq, S key seq, H query heads, K key/value heads, G = H/K query
heads per kv head, D head dim, N/M number of query/key blocks, Q/C rows/columns of one block.
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
from lab.kernels.attention.reference import attention_reference

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


def _blocks(x_BxNxRest, block: int):
    """[B, n·block, ...] -> [n, B, block, ...]: the loop axis first."""
    B, n = x_BxNxRest.shape[0], x_BxNxRest.shape[1] // block
    return jnp.swapaxes(x_BxNxRest.reshape(B, n, block, *x_BxNxRest.shape[2:]), 0, 1)


def _unblocks(x_NxBxQxRest):
    """Inverse of `_blocks`."""
    N, B, Q = x_NxBxQxRest.shape[:3]
    return jnp.swapaxes(x_NxBxQxRest, 0, 1).reshape(B, N * Q, *x_NxBxQxRest.shape[3:])


def _scores(q_BxQxKxGxD, k_BxCxKxD, n, m, g: Geometry, acc):
    """Scaled, masked scores of query block n against key block m."""
    s_BxKxGxQxC = jnp.einsum(
        "bqkgd,bckd->bkgqc", q_BxQxKxGxD, k_BxCxKxD, preferred_element_type=acc
    )
    s_BxKxGxQxC = s_BxKxGxQxC * g.scale
    if not g.needs_mask:
        return s_BxKxGxQxC
    q_pos_Qx1 = (n * g.bq + jnp.arange(g.bq))[:, None]
    k_pos_1xC = (m * g.bk + jnp.arange(g.bk))[None, :]
    ok_QxC = visible(q_pos_Qx1, k_pos_1xC, causal=g.causal, kv_len=g.S, offset=g.offset)
    return jnp.where(ok_QxC, s_BxKxGxQxC, MASK_VALUE)


def _grouped(x_BxLxHxD, g: Geometry):
    """[B, L, H, D] -> query blocks [N, B, Q, K, G, D]; head h = k·G + g, as jnp.repeat makes."""
    B, L, H, D = x_BxLxHxD.shape
    x_BxLpxKxGxD = pad_seq(x_BxLxHxD, g.n_q * g.bq).reshape(B, g.n_q * g.bq, g.K, g.G, D)
    return _blocks(x_BxLpxKxGxD, g.bq)


def _forward(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, g: Geometry):
    """(out [B, L, H, D], lse [N, B, K, G, Q]): the log-sum-exp per query row in block layout
    (query block n, row q of head k·G + g), natural log, f32 (f64 for f64 inputs); padded
    query rows included. What a caller combining partial attentions (ring attention) needs."""
    acc = jnp.promote_types(q_BxLxHxD.dtype, jnp.float32)
    q_NxBxQxKxGxD = _grouped(q_BxLxHxD, g)
    k_MxBxCxKxD = _blocks(pad_seq(k_BxSxKxD, g.n_k * g.bk), g.bk)
    v_MxBxCxKxD = _blocks(pad_seq(v_BxSxKxD, g.n_k * g.bk), g.bk)

    def one_q_block(args):
        n, q_BxQxKxGxD = args

        def step(m, carry):
            o_BxKxGxQxD, max_BxKxGxQ, sum_BxKxGxQ = carry
            s_BxKxGxQxC = _scores(q_BxQxKxGxD, k_MxBxCxKxD[m], n, m, g, acc)
            new_max_BxKxGxQ = jnp.maximum(max_BxKxGxQ, s_BxKxGxQxC.max(-1))
            p_BxKxGxQxC = jnp.exp(s_BxKxGxQxC - new_max_BxKxGxQ[..., None])
            alpha_BxKxGxQ = jnp.exp(max_BxKxGxQ - new_max_BxKxGxQ)
            pv_BxKxGxQxD = jnp.einsum(
                "bkgqc,bckd->bkgqd",
                p_BxKxGxQxC.astype(v_MxBxCxKxD.dtype),
                v_MxBxCxKxD[m],
                preferred_element_type=acc,
            )
            o_BxKxGxQxD = alpha_BxKxGxQ[..., None] * o_BxKxGxQxD + pv_BxKxGxQxD
            sum_BxKxGxQ = alpha_BxKxGxQ * sum_BxKxGxQ + p_BxKxGxQxC.sum(-1)
            return o_BxKxGxQxD, new_max_BxKxGxQ, sum_BxKxGxQ

        B, Q, K, G, D = q_BxQxKxGxD.shape
        init = (
            jnp.zeros((B, K, G, Q, D), acc),
            jnp.full((B, K, G, Q), MASK_VALUE, acc),
            jnp.zeros((B, K, G, Q), acc),
        )
        o_BxKxGxQxD, max_BxKxGxQ, sum_BxKxGxQ = lax.fori_loop(0, g.k_blocks_end(n), step, init)
        o_BxQxKxGxD = jnp.einsum("bkgqd->bqkgd", o_BxKxGxQxD / sum_BxKxGxQ[..., None])
        return o_BxQxKxGxD.astype(q_BxLxHxD.dtype), max_BxKxGxQ + jnp.log(sum_BxKxGxQ)

    o_NxBxQxKxGxD, lse_NxBxKxGxQ = lax.map(one_q_block, (jnp.arange(g.n_q), q_NxBxQxKxGxD))
    B, L, H, D = q_BxLxHxD.shape
    o_BxLxHxD = _unblocks(o_NxBxQxKxGxD).reshape(B, -1, H, D)[:, :L]
    return o_BxLxHxD, lse_NxBxKxGxQ


def _row_blocks(x_BxLxH, g: Geometry):
    """A per-row quantity [B, L, H] -> the kernel's block layout [N, B, K, G, Q]."""
    return jnp.einsum("nbqkg->nbkgq", _grouped(x_BxLxH[..., None], g)[..., 0])


def _row_unblocks(x_NxBxKxGxQ, g: Geometry):
    """Inverse of `_row_blocks`: [N, B, K, G, Q] -> [B, L, H] (padded rows dropped)."""
    x_BxLpxKxG = _unblocks(jnp.einsum("nbkgq->nbqkg", x_NxBxKxGxQ))
    B, Lp = x_BxLpxKxG.shape[:2]
    return x_BxLpxKxG.reshape(B, Lp, g.K * g.G)[:, : g.L]


def _backward(g: Geometry, residuals, do_BxLxHxD, dlse_BxLxH=None):
    """dQ, dK, dV; with `dlse_BxLxH` (the cotangent of the log-sum-exp output, see
    `blockwise_attention_with_lse`) folded in: d lse_i / d s_ij = P_ij, so
    dS = P·(dP − δ + dlse)."""
    q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, o_BxLxHxD, lse_NxBxKxGxQ = residuals
    acc = jnp.promote_types(q_BxLxHxD.dtype, jnp.float32)
    # delta_i = Σ_d dO_id·O_id = Σ_j P_ij·dP_ij: the softmax-backward row term, linear in L.
    delta_BxLxH = jnp.einsum("blhd,blhd->blh", o_BxLxHxD.astype(acc), do_BxLxHxD.astype(acc))
    if dlse_BxLxH is not None:
        delta_BxLxH = delta_BxLxH - dlse_BxLxH.astype(acc)
    delta_NxBxKxGxQ = _row_blocks(delta_BxLxH, g)
    q_NxBxQxKxGxD = _grouped(q_BxLxHxD, g)
    do_NxBxQxKxGxD = _grouped(do_BxLxHxD, g)
    k_MxBxCxKxD = _blocks(pad_seq(k_BxSxKxD, g.n_k * g.bk), g.bk)
    v_MxBxCxKxD = _blocks(pad_seq(v_BxSxKxD, g.n_k * g.bk), g.bk)

    def one_k_block(dq_NxBxQxKxGxD, args):
        m, k_BxCxKxD, v_BxCxKxD = args

        def step(n, carry):
            dk_BxCxKxD, dv_BxCxKxD, dq_NxBxQxKxGxD = carry
            q_BxQxKxGxD, do_BxQxKxGxD = q_NxBxQxKxGxD[n], do_NxBxQxKxGxD[n]
            s_BxKxGxQxC = _scores(q_BxQxKxGxD, k_BxCxKxD, n, m, g, acc)
            p_BxKxGxQxC = jnp.exp(s_BxKxGxQxC - lse_NxBxKxGxQ[n][..., None])
            dv_BxCxKxD += jnp.einsum(
                "bkgqc,bqkgd->bckd",
                p_BxKxGxQxC.astype(do_BxQxKxGxD.dtype),
                do_BxQxKxGxD,
                preferred_element_type=acc,
            )
            dp_BxKxGxQxC = jnp.einsum(
                "bqkgd,bckd->bkgqc", do_BxQxKxGxD, v_BxCxKxD, preferred_element_type=acc
            )
            ds_BxKxGxQxC = p_BxKxGxQxC * (dp_BxKxGxQxC - delta_NxBxKxGxQ[n][..., None])
            ds_BxKxGxQxC = (ds_BxKxGxQxC * g.scale).astype(q_BxQxKxGxD.dtype)
            dk_BxCxKxD += jnp.einsum(
                "bkgqc,bqkgd->bckd", ds_BxKxGxQxC, q_BxQxKxGxD, preferred_element_type=acc
            )
            dq_BxQxKxGxD = jnp.einsum(
                "bkgqc,bckd->bqkgd", ds_BxKxGxQxC, k_BxCxKxD, preferred_element_type=acc
            )
            return dk_BxCxKxD, dv_BxCxKxD, dq_NxBxQxKxGxD.at[n].add(dq_BxQxKxGxD)

        zeros_BxCxKxD = jnp.zeros(k_BxCxKxD.shape, acc)
        dk_BxCxKxD, dv_BxCxKxD, dq_NxBxQxKxGxD = lax.fori_loop(
            g.q_blocks_start(m), g.n_q, step, (zeros_BxCxKxD, zeros_BxCxKxD, dq_NxBxQxKxGxD)
        )
        return dq_NxBxQxKxGxD, (dk_BxCxKxD, dv_BxCxKxD)

    dq_NxBxQxKxGxD, (dk_MxBxCxKxD, dv_MxBxCxKxD) = lax.scan(
        one_k_block,
        jnp.zeros(q_NxBxQxKxGxD.shape, acc),
        (jnp.arange(g.n_k), k_MxBxCxKxD, v_MxBxCxKxD),
    )
    B, L, H, D = q_BxLxHxD.shape
    S = k_BxSxKxD.shape[1]
    dq_BxLxHxD = _unblocks(dq_NxBxQxKxGxD).reshape(B, -1, H, D)[:, :L]
    dk_BxSxKxD = _unblocks(dk_MxBxCxKxD)[:, :S]
    dv_BxSxKxD = _unblocks(dv_MxBxCxKxD)[:, :S]
    return (
        dq_BxLxHxD.astype(q_BxLxHxD.dtype),
        dk_BxSxKxD.astype(k_BxSxKxD.dtype),
        dv_BxSxKxD.astype(v_BxSxKxD.dtype),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, g: Geometry):
    return _forward(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, g)[0]


def _flash_fwd(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, g: Geometry):
    o_BxLxHxD, lse_NxBxKxGxQ = _forward(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, g)
    return o_BxLxHxD, (q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, o_BxLxHxD, lse_NxBxKxGxQ)


_flash.defvjp(_flash_fwd, _backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash_lse(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, g: Geometry):
    o_BxLxHxD, lse_NxBxKxGxQ = _forward(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, g)
    return o_BxLxHxD, _row_unblocks(lse_NxBxKxGxQ, g)


def _flash_lse_fwd(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, g: Geometry):
    o_BxLxHxD, residuals = _flash_fwd(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, g)
    return (o_BxLxHxD, _row_unblocks(residuals[-1], g)), residuals


def _flash_lse_bwd(g: Geometry, residuals, cotangents):
    do_BxLxHxD, dlse_BxLxH = cotangents
    return _backward(g, residuals, do_BxLxHxD, dlse_BxLxH)


_flash_lse.defvjp(_flash_lse_fwd, _flash_lse_bwd)


def _geometry(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, causal, scale, block_sizes) -> Geometry:
    """The inputs checked, and the static sizes of one call (tiles fitted to the lengths)."""
    check_qkv(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, causal=causal)
    check_dtype(q_BxLxHxD, DTYPES, "blockwise")
    _, L, H, D = q_BxLxHxD.shape
    S, K = k_BxSxKxD.shape[1:3]
    bq, bk = block_sizes.fit(L, S)
    scale = default_scale(D, scale)
    return Geometry(L=L, S=S, K=K, G=H // K, bq=bq, bk=bk, causal=causal, scale=scale)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "block_sizes"))
def blockwise_attention(
    q_BxLxHxD,
    k_BxSxKxD,
    v_BxSxKxD,
    *,
    causal: bool = True,
    scale: float | None = None,
    block_sizes: BlockSizes = BlockSizes(),
):
    """softmax(Q·Kᵀ·scale)·V, [batch, seq, heads, head_dim], grouped kv heads, any length."""
    g = _geometry(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, causal, scale, block_sizes)
    return _flash(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, g)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "block_sizes"))
def blockwise_attention_with_lse(
    q_BxLxHxD,
    k_BxSxKxD,
    v_BxSxKxD,
    *,
    causal: bool = True,
    scale: float | None = None,
    block_sizes: BlockSizes = BlockSizes(),
):
    """(out [B, L, H, D], lse [B, L, H] in f32): the output and each row's log-sum-exp of the
    scaled scores, both differentiable. Partial attentions over disjoint key sets combine
    exactly through the LSE (ring attention), which is why a caller may need it."""
    g = _geometry(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, causal, scale, block_sizes)
    return _flash_lse(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, g)


blockwise_reference = attention_reference  # the template keeps a reference beside each kernel

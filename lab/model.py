"""A decoder-only transformer in flax.linen: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Letters in tensor names and einsum strings (lab/names.py): B batch, L sequence, D d_model,
H query heads, G key/value heads, K head dim, F MLP hidden, V vocabulary. Weights and
activations carry logical axis names (lab/names.py; lab/mesh.py maps them to the mesh);
parameters live in `param_dtype`, matmuls run in `dtype`, softmax and the loss in float32.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from lab.config import ModelConfig
from lab.kernels.attention import attention
from lab.names import BATCH, EMBED, HEAD_DIM, HEADS, LAYERS, MLP, NORM, SEQ, VOCAB

QKV = (BATCH, SEQ, HEADS, HEAD_DIM)  # q, k, v and the attention output

REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs
}


def _init(std: float, names: tuple):
    return nn.with_logical_partitioning(nn.initializers.normal(std), names)


def _constrain(x, names: tuple):
    return nn.with_logical_constraint(x, names)


def rope(x_BxLxHxK, positions_L, theta: float):
    """Rotary embeddings: rotate pairs of features by a position-dependent angle."""
    K = x_BxLxHxK.shape[-1]
    freq_K2 = theta ** (-jnp.arange(0, K, 2, dtype=jnp.float32) / K)
    angle_LxK2 = positions_L[:, None].astype(jnp.float32) * freq_K2[None, :]
    sin, cos = jnp.sin(angle_LxK2)[None, :, None, :], jnp.cos(angle_LxK2)[None, :, None, :]
    x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxHxK.dtype)


class RMSNorm(nn.Module):
    """x / rms(x) · scale. The scale is tiny, so it is replicated (logical name `norm`)."""

    eps: float = 1e-6
    param_dtype: str = "float32"

    @nn.compact
    def __call__(self, x_BxLxD):
        scale_D = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, (NORM,)),
            (x_BxLxD.shape[-1],),
            self.param_dtype,
        )
        x = x_BxLxD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * scale_D.astype(jnp.float32)).astype(x_BxLxD.dtype)


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxLxD):
        c = self.cfg
        D, H, G, K = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
        std = D**-0.5
        wq_DxHxK = self.param("wq", _init(std, (EMBED, HEADS, HEAD_DIM)), (D, H, K), c.param_dtype)
        wk_DxGxK = self.param("wk", _init(std, (EMBED, HEADS, HEAD_DIM)), (D, G, K), c.param_dtype)
        wv_DxGxK = self.param("wv", _init(std, (EMBED, HEADS, HEAD_DIM)), (D, G, K), c.param_dtype)
        wo_HxKxD = self.param(
            "wo", _init((H * K) ** -0.5, (HEADS, HEAD_DIM, EMBED)), (H, K, D), c.param_dtype
        )
        x = x_BxLxD.astype(c.dtype)
        q_BxLxHxK = jnp.einsum("bld,dhk->blhk", x, wq_DxHxK.astype(c.dtype))
        k_BxLxGxK = jnp.einsum("bld,dgk->blgk", x, wk_DxGxK.astype(c.dtype))
        v_BxLxGxK = jnp.einsum("bld,dgk->blgk", x, wv_DxGxK.astype(c.dtype))
        pos_L = jnp.arange(x.shape[1])
        q_BxLxHxK = _constrain(rope(q_BxLxHxK, pos_L, c.rope_theta), QKV)
        k_BxLxGxK = _constrain(rope(k_BxLxGxK, pos_L, c.rope_theta), QKV)
        o_BxLxHxK = attention(
            q_BxLxHxK,
            k_BxLxGxK,
            v_BxLxGxK,
            causal=True,
            impl=c.attention,
            shard_spec=nn.logical_to_mesh_axes(QKV),  # Pallas kernels and ring run per shard
        )
        o_BxLxHxK = _constrain(o_BxLxHxK, QKV)
        return jnp.einsum("blhk,hkd->bld", o_BxLxHxK, wo_HxKxD.astype(c.dtype))


class Mlp(nn.Module):
    """SwiGLU: silu(x·W_gate) ⊙ (x·W_up), then W_down."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxLxD):
        c = self.cfg
        D, F = c.d_model, c.d_ff
        w_gate_DxF = self.param("w_gate", _init(D**-0.5, (EMBED, MLP)), (D, F), c.param_dtype)
        w_up_DxF = self.param("w_up", _init(D**-0.5, (EMBED, MLP)), (D, F), c.param_dtype)
        w_down_FxD = self.param("w_down", _init(F**-0.5, (MLP, EMBED)), (F, D), c.param_dtype)
        x = x_BxLxD.astype(c.dtype)
        gate_BxLxF = jnp.einsum("bld,df->blf", x, w_gate_DxF.astype(c.dtype))
        up_BxLxF = jnp.einsum("bld,df->blf", x, w_up_DxF.astype(c.dtype))
        h_BxLxF = _constrain(nn.silu(gate_BxLxF) * up_BxLxF, (BATCH, SEQ, MLP))
        return jnp.einsum("blf,fd->bld", h_BxLxF, w_down_FxD.astype(c.dtype))


class Block(nn.Module):
    """Pre-norm residual block; returns (x, None) so nn.scan can stack it."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxLxD, _=None):
        c = self.cfg
        x_BxLxD = x_BxLxD + Attention(c, name="attn")(RMSNorm(param_dtype=c.param_dtype)(x_BxLxD))
        x_BxLxD = x_BxLxD + Mlp(c, name="mlp")(RMSNorm(param_dtype=c.param_dtype)(x_BxLxD))
        return _constrain(x_BxLxD, (BATCH, SEQ, EMBED)), None


def _block_class(cfg: ModelConfig):
    if cfg.remat == "none":
        return Block
    return nn.remat(Block, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)


class Transformer(nn.Module):
    """tokens_BxL (int) → logits_BxLxV (float32)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens_BxL):
        c = self.cfg
        embed_VxD = self.param(
            "embed", _init(1.0, (VOCAB, EMBED)), (c.vocab_size, c.d_model), c.param_dtype
        )
        # Gather the table whole along embed before the lookup (an FSDP all-gather): a lookup
        # into an embed-sharded table would leave activations sharded the wrong way.
        table_VxD = _constrain(embed_VxD, (VOCAB, None))
        x_BxLxD = jnp.take(table_VxD, tokens_BxL, axis=0).astype(c.dtype)
        # A no-op unless a `perturbations` collection is passed: then the gradient with
        # respect to each position's input arrives there (tests/test_model.py: causality).
        x_BxLxD = self.perturb("embedded", x_BxLxD)
        x_BxLxD = _constrain(x_BxLxD, (BATCH, SEQ, EMBED))
        block = _block_class(c)
        if c.scan_layers:
            stack = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=c.n_layers,
                metadata_params={nn.PARTITION_NAME: LAYERS},
            )
            x_BxLxD, _ = stack(c, name="blocks")(x_BxLxD, None)
        else:
            for i in range(c.n_layers):
                x_BxLxD, _ = block(c, name=f"block_{i}")(x_BxLxD, None)
        x_BxLxD = RMSNorm(param_dtype=c.param_dtype, name="final_norm")(x_BxLxD)
        if c.tie_embeddings:  # unit-variance embeddings, so scale the head to unit logits
            head_DxV = embed_VxD.T * c.d_model**-0.5
        else:
            head_DxV = self.param(
                "head",
                _init(c.d_model**-0.5, (EMBED, VOCAB)),
                (c.d_model, c.vocab_size),
                c.param_dtype,
            )
        logits_BxLxV = jnp.einsum(
            "bld,dv->blv", x_BxLxD, head_DxV.astype(c.dtype), preferred_element_type=jnp.float32
        )
        return _constrain(logits_BxLxV, (BATCH, SEQ, VOCAB))


def count_params(params) -> int:
    return sum(x.size for x in jax.tree.leaves(params))


def count_nonembedding_params(params, cfg: ModelConfig) -> int:
    """N in the 6·N FLOPs-per-token rule: every weight except the input embedding table.

    An untied output head is a matmul per token, so it counts; a tied one is the embedding
    itself and counts once through the head matmul (the lookup costs no FLOPs).
    """
    return count_params(params) - cfg.vocab_size * cfg.d_model * (0 if cfg.tie_embeddings else 1)


@functools.cache
def build(cfg: ModelConfig) -> Transformer:
    return Transformer(cfg)

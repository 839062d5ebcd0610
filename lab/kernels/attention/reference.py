"""Plain softmax(Q·Kᵀ·scale)·V: the ground truth every attention kernel is held against."""

import jax
import jax.numpy as jnp

from lab.kernels.attention.common import MASK_VALUE


def attention_reference(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, *, causal: bool = True, scale=None):
    """Materialises the full L×S score matrix; softmax in f32 (or f64 if the inputs are f64).

    Grouped-query heads: H query heads share G key/value heads (H % G == 0).
    """
    _, L, H, K = q_BxLxHxK.shape
    S, G = k_BxSxGxK.shape[1], k_BxSxGxK.shape[2]
    if H % G:
        raise ValueError(
            f"{q_BxLxHxK.shape=} {k_BxSxGxK.shape=}: query heads must be a multiple of kv heads"
        )
    scale = K**-0.5 if scale is None else scale
    acc = jnp.promote_types(q_BxLxHxK.dtype, jnp.float32)
    k_BxSxHxK = jnp.repeat(k_BxSxGxK, H // G, axis=2)
    v_BxSxHxK = jnp.repeat(v_BxSxGxK, H // G, axis=2)
    s_BxHxLxS = jnp.einsum("blhk,bshk->bhls", q_BxLxHxK, k_BxSxHxK, preferred_element_type=acc)
    s_BxHxLxS = s_BxHxLxS * scale
    if causal:
        mask_LxS = jnp.arange(L)[:, None] + (S - L) >= jnp.arange(S)[None, :]
        s_BxHxLxS = jnp.where(mask_LxS, s_BxHxLxS, MASK_VALUE)
    p_BxHxLxS = jax.nn.softmax(s_BxHxLxS, axis=-1)
    o_BxLxHxK = jnp.einsum(
        "bhls,bshk->blhk", p_BxHxLxS.astype(v_BxSxHxK.dtype), v_BxSxHxK, preferred_element_type=acc
    )
    return o_BxLxHxK.astype(q_BxLxHxK.dtype)

"""Plain softmax(Q·Kᵀ·scale)·V: the ground truth every attention kernel is held against."""

import jax
import jax.numpy as jnp


def attention_reference(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, *, causal: bool = True, scale=None):
    """Materialises the full L×S score matrix; softmax in f32 (or f64 if the inputs are f64).

    Grouped-query heads: H query heads share K key/value heads (H % K == 0).
    """
    _, L, H, D = q_BxLxHxD.shape
    S, K = k_BxSxKxD.shape[1], k_BxSxKxD.shape[2]
    if H % K:
        raise ValueError(
            f"{q_BxLxHxD.shape=} {k_BxSxKxD.shape=}: query heads must be a multiple of kv heads"
        )
    scale = D**-0.5 if scale is None else scale
    acc = jnp.promote_types(q_BxLxHxD.dtype, jnp.float32)
    k_BxSxHxD = jnp.repeat(k_BxSxKxD, H // K, axis=2)
    v_BxSxHxD = jnp.repeat(v_BxSxKxD, H // K, axis=2)
    s_BxHxLxS = jnp.einsum("blhd,bshd->bhls", q_BxLxHxD, k_BxSxHxD, preferred_element_type=acc)
    s_BxHxLxS = s_BxHxLxS * scale
    if causal:
        mask_LxS = jnp.arange(L)[:, None] + (S - L) >= jnp.arange(S)[None, :]
        s_BxHxLxS = jnp.where(mask_LxS, s_BxHxLxS, jnp.finfo(acc).min)
    p_BxHxLxS = jax.nn.softmax(s_BxHxLxS, axis=-1)
    o_BxLxHxD = jnp.einsum(
        "bhls,bshd->blhd", p_BxHxLxS.astype(v_BxSxHxD.dtype), v_BxSxHxD, preferred_element_type=acc
    )
    return o_BxLxHxD.astype(q_BxLxHxD.dtype)

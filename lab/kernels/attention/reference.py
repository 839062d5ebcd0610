"""Plain softmax(Q·Kᵀ·scale)·V: the ground truth every attention kernel is held against."""

import jax
import jax.numpy as jnp

from lab.kernels.attention.common import (
    Mask,
    check_qkv,
    check_sinks,
    check_softcap,
    default_scale,
    with_causal,
)

FEATURES = frozenset(
    {"empty_rows", "segments", "lengths", "window", "softcap", "sinks", "lse", "value_dim"}
)


def attention_reference(
    q_BxLxHxK,
    k_BxSxGxK,
    v_BxSxGxV,
    *,
    causal: bool = True,
    scale=None,
    mask: Mask | None = None,
    softcap: float | None = None,
    sinks_H=None,
    return_lse: bool = False,
):
    """Materialises the full L×S score matrix; every sum in f32 (f64 if the inputs are f64),
    P·V included (P is never rounded to the input dtype).

    Grouped-query heads: H query heads share G key/value heads (H % G == 0). `mask` says
    which pairs take part, combined with `causal` (causal when either is: common.with_causal;
    a non-causal mask needs causal=False); a row with none gives 0. `softcap`: scores
    become cap·tanh(scores/cap) after scaling. `sinks_H`: one logit per query head added to
    every row's softmax denominator (no value). `return_lse`: also the log of that
    denominator per row, [B, L, H] f32 (-inf for a row with no key and no sink).
    """
    mask = with_causal(mask, causal)
    check_qkv(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, causal=mask.causal, empty_rows=True, value_dim=True)
    B, L, H, K = q_BxLxHxK.shape
    S, G = k_BxSxGxK.shape[1], k_BxSxGxK.shape[2]
    mask.check(B, L, S)  # called directly: the checks `attention` makes, one ValueError each
    softcap, sinks_H = check_softcap(softcap), check_sinks(sinks_H, H)
    scale = default_scale(K, scale)
    acc = jnp.promote_types(q_BxLxHxK.dtype, jnp.float32)
    k_BxSxHxK = jnp.repeat(k_BxSxGxK, H // G, axis=2)
    v_BxSxHxV = jnp.repeat(v_BxSxGxV, H // G, axis=2).astype(acc)
    s_BxHxLxS = jnp.einsum("blhk,bshk->bhls", q_BxLxHxK, k_BxSxHxK, preferred_element_type=acc)
    s_BxHxLxS = s_BxHxLxS * scale
    if softcap is not None:
        s_BxHxLxS = softcap * jnp.tanh(s_BxHxLxS / softcap)
    ok_Bx1xLxS = mask.dense(B, L, S)[:, None]
    s_BxHxLxS = jnp.where(ok_Bx1xLxS, s_BxHxLxS, -jnp.inf)
    m_BxHxL = s_BxHxLxS.max(-1)
    if sinks_H is not None:
        sink_1xHx1 = sinks_H.astype(acc)[None, :, None]
        m_BxHxL = jnp.maximum(m_BxHxL, sink_1xHx1)
    m_BxHxL = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m_BxHxL), m_BxHxL, 0.0))
    e_BxHxLxS = jnp.where(ok_Bx1xLxS, jnp.exp(s_BxHxLxS - m_BxHxL[..., None]), 0.0)
    denom_BxHxL = e_BxHxLxS.sum(-1)
    if sinks_H is not None:
        denom_BxHxL = denom_BxHxL + jnp.exp(sink_1xHx1 - m_BxHxL)
    safe_BxHxL = jnp.where(denom_BxHxL > 0, denom_BxHxL, 1.0)
    p_BxHxLxS = e_BxHxLxS / safe_BxHxL[..., None]
    o_BxLxHxV = jnp.einsum("bhls,bshv->blhv", p_BxHxLxS, v_BxSxHxV, preferred_element_type=acc)
    o_BxLxHxV = o_BxLxHxV.astype(q_BxLxHxK.dtype)
    if not return_lse:
        return o_BxLxHxV
    lse_BxHxL = jnp.where(denom_BxHxL > 0, m_BxHxL + jnp.log(safe_BxHxL), -jnp.inf)
    return o_BxLxHxV, jnp.einsum("bhl->blh", lse_BxHxL).astype(jnp.promote_types(acc, jnp.float32))

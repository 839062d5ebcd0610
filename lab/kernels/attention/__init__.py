"""Attention dispatch: one call, several implementations (see DESIGN.md)."""

from lab.kernels.attention.reference import attention_reference

IMPLS = ("naive",)


def attention(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, *, causal: bool = True, impl: str = "auto"):
    """softmax(Q·Kᵀ/√D)·V with layout [batch, seq, heads, head_dim]."""
    if impl not in (*IMPLS, "auto"):
        raise ValueError(f"attention impl={impl!r}: choose one of {', '.join(IMPLS)} or auto")
    return attention_reference(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, causal=causal)

"""Attention dispatch: one call, several implementations (see DESIGN.md).

impl            what runs
--------------  ---------------------------------------------------------------------------
naive           reference.py: the full L×S score matrix (memory quadratic in length)
blockwise       blockwise.py: flash algorithm in pure JAX, any backend, memory linear
pallas          the Pallas kernel of this backend: pallas_tpu on TPU, pallas_gpu on GPU
pallas_tpu      pallas_tpu.py: Mosaic kernel (TPU; elsewhere only with interpret=True)
pallas_gpu      pallas_gpu.py: Triton kernel (GPU; elsewhere only with interpret=True)
xla, cudnn      jax.nn.dot_product_attention(implementation=...): the library baselines
auto            the best available for the backend, never an interpreted kernel:
                TPU -> pallas_tpu; GPU -> cudnn where its constraints hold (bf16/f16,
                head_dim <= 128), else pallas_gpu; CPU -> blockwise, which measured faster
                than naive and xla for fwd+bwd at every length from 512 to 16384 on the
                lab's 2-core CPU (0.95x naive at 512 full, 0.17x at 16384 causal; f32,
                H=2, D=64: `python -m lab.kernels.attention.bench`), and within 10% of it
                at 256. Falls back to blockwise when the chosen kernel does not take the
                input (dtype, head_dim).

Interpret mode is opt-in only: `interpret=True` with impl pallas / pallas_tpu / pallas_gpu runs
the kernel through the Pallas interpreter on any backend (slow: tests, debugging). On CPU,
`impl="pallas", interpret=True` means the TPU kernel. Sequence lengths that are not block
multiples are padded and masked inside every kernel; bad shapes, head dims or dtypes raise a
ValueError that names the constraint.
"""

import jax

from lab.kernels.attention import blockwise, pallas_gpu, pallas_tpu
from lab.kernels.attention.common import check_qkv
from lab.kernels.attention.reference import attention_reference

IMPLS = ("naive", "blockwise", "pallas", "pallas_tpu", "pallas_gpu", "xla", "cudnn")
PALLAS = ("pallas", "pallas_tpu", "pallas_gpu")
_NATIVE = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}  # backend -> its compiled Pallas kernel


def available_impls(backend: str | None = None, *, interpret: bool = False) -> tuple[str, ...]:
    """Implementations that run on `backend` (default: JAX's); `interpret` adds the Pallas
    kernels that run only through the interpreter there."""
    backend = backend or jax.default_backend()
    impls = ["naive", "blockwise", "xla"]
    if backend in _NATIVE:
        impls += ["pallas", _NATIVE[backend]]
    if backend == "gpu":
        impls.append("cudnn")
    if interpret:
        impls += [k for k in PALLAS if k not in impls]
    return tuple(impls)


def _resolve(impl: str, interpret: bool, backend: str) -> str:
    """Map pallas to this backend's kernel; refuse what cannot run here, saying what can."""
    if impl == "pallas":
        impl = _NATIVE.get(backend, "pallas_tpu" if interpret else "pallas")
    if impl in available_impls(backend, interpret=interpret):
        return impl
    hint = " or pass interpret=True (slow; tests)" if impl in PALLAS else ""
    raise ValueError(
        f"attention impl={impl!r} has no compiled kernel on backend {backend!r}: choose one of "
        f"{', '.join(available_impls(backend))}{hint}"
    )


def _auto(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, causal: bool, backend: str) -> str:
    """The fastest implementation that accepts this input; see the module docstring."""
    candidates = {"tpu": ["pallas_tpu"], "gpu": ["cudnn", "pallas_gpu"]}.get(backend, [])
    for impl in candidates:
        try:
            _check(impl, q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, causal)
            return impl
        except ValueError:
            continue
    return "blockwise"


def _check(impl, q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, causal: bool) -> None:
    """Constraints beyond the shared ones, per implementation (ValueError naming them)."""
    if impl == "pallas_tpu":
        pallas_tpu.check_inputs(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, causal=causal)
    elif impl == "pallas_gpu":
        pallas_gpu.check_inputs(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, causal=causal)
    elif impl in ("xla", "cudnn"):
        L, S = q_BxLxHxD.shape[1], k_BxSxKxD.shape[1]
        if causal and L != S:
            raise ValueError(
                f"{q_BxLxHxD.shape=} {k_BxSxKxD.shape=}: impl={impl!r} aligns the causal mask "
                "top-left, so it needs q seq == kv seq (the others align it bottom-right)"
            )
        if impl == "cudnn":
            if q_BxLxHxD.dtype.name not in ("bfloat16", "float16"):
                raise ValueError(f"{q_BxLxHxD.dtype=}: impl='cudnn' supports bfloat16, float16")
            if q_BxLxHxD.shape[-1] > 128:
                raise ValueError(f"{q_BxLxHxD.shape=}: impl='cudnn' supports head_dim <= 128")


def attention(
    q_BxLxHxD,
    k_BxSxKxD,
    v_BxSxKxD,
    *,
    causal: bool = True,
    impl: str = "auto",
    scale: float | None = None,
    interpret: bool = False,
    block_sizes=None,
):
    """softmax(Q·Kᵀ·scale)·V with layout [batch, seq, heads, head_dim]; scale 1/√D by default.

    k and v may have fewer heads than q (grouped-query: query head h reads kv head h // G).
    `block_sizes` is the chosen kernel's own BlockSizes (None: its default).
    """
    if impl not in (*IMPLS, "auto"):
        raise ValueError(f"attention impl={impl!r}: choose one of {', '.join(IMPLS)} or auto")
    if interpret and impl not in PALLAS:
        raise ValueError(f"interpret=True applies to impl in {PALLAS}, not impl={impl!r}")
    check_qkv(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, causal=causal)
    backend = jax.default_backend()
    if impl == "auto":
        impl = _auto(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, causal, backend)
    else:
        impl = _resolve(impl, interpret, backend)
    _check(impl, q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, causal)
    args = (q_BxLxHxD, k_BxSxKxD, v_BxSxKxD)
    if impl == "naive":
        return attention_reference(*args, causal=causal, scale=scale)
    if impl == "blockwise":
        bs = block_sizes or blockwise.BlockSizes()
        return blockwise.blockwise_attention(*args, causal=causal, scale=scale, block_sizes=bs)
    if impl == "pallas_tpu":
        bs = block_sizes or pallas_tpu.BlockSizes()
        return pallas_tpu.flash_attention_tpu(
            *args, causal=causal, scale=scale, block_sizes=bs, interpret=interpret
        )
    if impl == "pallas_gpu":
        return pallas_gpu.flash_attention_gpu(
            *args, causal=causal, scale=scale, block_sizes=block_sizes, interpret=interpret
        )
    return jax.nn.dot_product_attention(*args, scale=scale, is_causal=causal, implementation=impl)


__all__ = ["IMPLS", "attention", "attention_reference", "available_impls"]

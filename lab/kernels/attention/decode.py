"""Decode attention: one query token per sequence against a long key/value cache.

    o[b, h] = softmax_s(q[b, h] · k[b, h // R, s] · scale, s < lengths[b]) · v[b, h // R, s]

Two Pallas kernels of the same algorithm (flash decoding: an online softmax over cache blocks,
optionally split along the cache into partial (o, m, l) that a small jnp step combines), and
the plain-jnp `decode_attention_reference` they are held against.

Cache layout [B, G, S, K] (batch, kv head, cache slot, head dim), not the prefill layout
[B, S, G, K]. Reasons, in order:
  1. Decode is bound by reading the cache once per token. A kernel that wanted another layout
     would need a transpose of the whole cache every step (read it, write it, then the kernel
     reads it: 3× the traffic), so the cache has to be *stored* in the kernel's layout.
  2. Mosaic (TPU) tiles the last two dims of every block by (8, 128). A [B, S, G, K] block
     (bk, squeezed G, K) puts the squeezed head in the second-minor place; [B, G, S, K] gives
     (bk, K) tiles: cache slots on sublanes, head dim on lanes, contiguous in HBM.
  3. On GPU one (b, g) row of the cache is one contiguous S·K run: each block load is a
     single coalesced bk·K stretch, and a split is a contiguous sub-range.
  Writing one new token (prefill writes S of them) is a strided scatter either way.

Grouped-query heads: q [B, H, K] is viewed as [B, G, R, K] (free reshape, h = g·R + r): a
program works on one kv head and all R query heads that share it, so each K/V block is read
from memory once for the whole group (no jnp.repeat, no R× traffic).

Sliding window: `window=W` attends to the last W valid slots of each sequence only (slots
lengths[b] - W .. lengths[b] - 1: the current token and the W - 1 before it; a Mask window
(W - 1, 0) in common.py's terms, as Mistral's and Gemma's local layers). The blocks wholly
before the window are skipped like the blocks past the length (no DMA, no loop step), and
the splits cut only the blocks the window covers.

Ragged lengths: `lengths[b]` valid slots (1..S; larger values are clamped to S, 0 gives a zero
output), any integer dtype (NumPy's int64 too, or a list), read as int32 by every
implementation. Slots at and beyond the length are never trusted: their scores are masked,
their values zeroed before the P·V product (garbage may be NaN), and the kernels do not even
read whole blocks past the length (TPU: index map clamped with the scalar-prefetched lengths, so the
pipeline issues no DMA; GPU: the loop stops at the last valid block and every load is
masked by the length).

Splits (flash decoding): with few (batch × kv head) programs the machine is idle while each
program walks a long cache. `num_splits` = P cuts each sequence's *own* valid blocks into P
near-equal parts (ceil(n_b / P) blocks each, n_b = ceil(lengths[b] / bk)), so ragged batches
stay balanced: every program of sequence b does the same work, none walks padding. Partials
are f32 (o unnormalised, running max m, sum l); `combine_splits` merges them (a [B, H, P, K]
jnp step, small next to the cache). GPU: splits default to filling the SMs. TPU: a TensorCore
runs its grid sequentially, so a split helps only to give the second core of a megacore chip
(v4, v5p) work when B·G is 1; the default is 1.

int8 cache: k, v int8 with float32 scales per (token, kv head), stored [B, G, 1, S]:
k[b, g, s] ≈ k_i8[b, g, s] · k_scale[b, g, 0, s]. Why [B, G, 1, S] and not [B, G, S]: on TPU
the (1, S) row is lane-dense with no padding (XLA gives it tiles T(1,128)) and a (1, bk) block
is what Mosaic accepts; a [B, G, S] array is tiled (8, 128) over (G, S), so G pads to 8 and
turning it into rows costs a relayout copy each step (seen in the compiled HLO). Like the cache,
the scales are stored in the kernel's layout. (quant.quantize_kv returns this layout.)
The scale is constant along the head dim, so it factors out of both products and is applied
on the (R × bk) score tile, never on the (bk × K) cache tile:
    q · (σ_s k_s)  = σ_s (q · k_s)             → scores *= k_scale row
    Σ_s p_s σ_s v_s = Σ_s (p_s σ_s) v_s        → p *= v_scale row, then p · v_i8
The int8 tile is only converted to q's dtype (exact: |x| <= 127 fits bf16/f16 mantissas).

Inference only: no custom_vjp (decode never differentiates through the cache).
"""

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lab.kernels import triton_deprecation
from lab.kernels.attention.common import MASK_VALUE, check_softcap, default_scale


def _pallas():
    """JAX's Pallas modules (pl, its TPU and its Triton backend), imported where a kernel is
    built: the reference and the C++ CPU kernel need none of them, and a CPU process that never
    builds a Pallas kernel does not pay their import."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas import triton as plgpu

    return pl, pltpu, plgpu


TPU_DTYPES = (jnp.float32, jnp.bfloat16)
GPU_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
TPU_HEAD_DIMS = (64, 128, 256)  # compiled ahead of time for v5e (test_decode.py)
GPU_HEAD_DIMS = (16, 32, 64, 128, 256)  # Triton tiles are powers of two, tl.dot needs >= 16
LANES = 128  # Mosaic's lane width: the cache block is the lane dim of the score tile
GPU_MIN_ROWS = 16  # tl.dot needs M >= 16: the R query heads of a group are padded to this
# Splits chosen by default on GPU: enough programs for two waves on an H100 (132 SMs, NVIDIA
# H100 SXM datasheet); more splits only add partials to combine.
GPU_TARGET_PROGRAMS = 264
NT_DIMS = (((1,), (1,)), ((), ()))  # a·bᵀ without materialising the transpose


def _check_block(name: str, value, multiple: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % multiple:
        what = "a positive int" if multiple == 1 else f"a positive multiple of {multiple}"
        raise ValueError(f"{name}={value!r}: must be {what}")


@dataclasses.dataclass(frozen=True)
class BlockSizesTPU:
    """Tiles of the TPU kernel. Compiled kernels need block_k in whole lanes (128)."""

    block_k: int = 512  # cache slots per grid step (a bf16 K=128 tile is 128 KiB)
    num_splits: int = 1  # parallel parts of each sequence (2 feeds both cores of a megacore)

    def __post_init__(self):
        _check_block("BlockSizesTPU.block_k", self.block_k, 8)
        _check_block("BlockSizesTPU.num_splits", self.num_splits, 1)

    def check_compiled(self) -> None:
        if self.block_k % LANES:
            raise ValueError(
                f"BlockSizesTPU.block_k={self.block_k}: a compiled TPU kernel needs a "
                f"multiple of {LANES}"
            )


def _power_of_two(n) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizesGPU:
    """Tiles and Triton launch parameters of the GPU kernel."""

    block_k: int = 64  # cache slots per loop step (power of two >= 16)
    num_splits: int = 0  # parts of each sequence; 0: enough for GPU_TARGET_PROGRAMS programs
    num_warps: int = 4  # warps per program (Triton)
    num_stages: int = 2  # software-pipelining depth of the cache loop (Triton)

    def __post_init__(self):
        if not (_power_of_two(self.block_k) and self.block_k >= 16):
            raise ValueError(
                f"BlockSizesGPU.block_k={self.block_k!r}: must be a power of two >= 16"
            )
        if not (isinstance(self.num_splits, int) and self.num_splits >= 0):
            raise ValueError(f"BlockSizesGPU.num_splits={self.num_splits!r}: must be an int >= 0")
        if not (_power_of_two(self.num_warps) and self.num_warps <= 32):
            raise ValueError(
                f"BlockSizesGPU.num_warps={self.num_warps!r}: must be a power of two <= 32"
            )
        if not (isinstance(self.num_stages, int) and self.num_stages >= 1):
            raise ValueError(f"BlockSizesGPU.num_stages={self.num_stages!r}: must be an int >= 1")

    def splits_for(self, batch: int, kv_heads: int, n_blocks: int) -> int:
        if self.num_splits:
            return min(self.num_splits, n_blocks)
        return max(1, min(n_blocks, -(-GPU_TARGET_PROGRAMS // (batch * kv_heads))))


# ---------------------------------------------------------------------------- checks


def check_inputs(q_BxHxK, k_BxGxSxK, v_BxGxSxK, lengths_B, k_scale_BxGx1xS, v_scale_BxGx1xS):
    """Shape and dtype rules of every implementation; ValueError naming the broken one."""
    q, k, v = q_BxHxK, k_BxGxSxK, v_BxGxSxK
    if q.ndim != 3 or k.ndim != 4:
        raise ValueError(
            f"{q.shape=} {k.shape=}: expected q [batch, heads, head_dim] and caches "
            "[batch, kv_heads, cache_len, head_dim]"
        )
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"{k.shape=} {v.shape=} {k.dtype=} {v.dtype=}: caches must match")
    if 0 in (*q.shape[1:], k.shape[1], k.shape[3]):  # before any rule that divides by one
        raise ValueError(f"{q.shape=} {k.shape=}: heads and head_dim must be at least 1")
    if k.shape[2] == 0:
        raise ValueError(f"{k.shape=}: the cache has no position (cache_len 0); decode needs one")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[3]:
        raise ValueError(f"{q.shape=} {k.shape=}: batch and head_dim of q and caches must match")
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"{q.shape=} {k.shape=}: query heads must be a multiple of kv heads "
            "(grouped-query attention)"
        )
    as_lengths(lengths_B, q.shape[0], k.shape[2])
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"{q.dtype=}: queries must be floating point")
    scales = (k_scale_BxGx1xS, v_scale_BxGx1xS)
    if k.dtype == jnp.int8:
        want = (*k.shape[:2], 1, k.shape[2])
        for name, s in zip(("k_scale", "v_scale"), scales, strict=True):
            if s is None or s.shape != want or not jnp.issubdtype(s.dtype, jnp.floating):
                got = None if s is None else (s.shape, s.dtype)
                raise ValueError(
                    f"{k.dtype=}: an int8 cache needs {name} of floats {want} (per token and "
                    f"kv head); got {got}"
                )
    elif k.dtype != q.dtype:
        raise ValueError(f"{q.dtype=} {k.dtype=}: the cache is q's dtype or int8 with scales")
    elif any(s is not None for s in scales):
        raise ValueError(f"{k.dtype=}: scales are only for an int8 cache")


def as_lengths(lengths_B, B: int, S: int):
    """`lengths_B` as the int32 [B] every kernel reads: any integer dtype (NumPy's default
    int64, a list of ints) is taken, clamped to 0..S first (what every kernel makes of a
    length anyway) so that a wide value cannot wrap; a non-integer dtype is refused."""
    if not hasattr(lengths_B, "dtype"):
        try:
            lengths_B = np.asarray(lengths_B)  # int64 for Python ints: clamped below
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"lengths={lengths_B!r}: expected integers [{B}]") from None
    if tuple(lengths_B.shape) != (B,) or not jnp.issubdtype(lengths_B.dtype, jnp.integer):
        raise ValueError(
            f"lengths shape={tuple(lengths_B.shape)} dtype={lengths_B.dtype}: expected integers "
            f"[{B}], one length per sequence"
        )
    if lengths_B.dtype == jnp.int32:
        return lengths_B
    xp = np if isinstance(lengths_B, np.ndarray) else jnp
    return xp.clip(lengths_B, 0, S).astype(np.int32)


def _check_kernel(q_BxHxK, scales, dtypes, head_dims, impl: str) -> None:
    if any(s is not None and s.dtype != jnp.float32 for s in scales):
        raise ValueError(f"{[s.dtype for s in scales]}: {impl} takes float32 scales")
    if q_BxHxK.dtype not in [jnp.dtype(d) for d in dtypes]:
        names = ", ".join(jnp.dtype(d).name for d in dtypes)
        raise ValueError(f"{q_BxHxK.dtype=}: {impl} supports dtypes {names}")
    if q_BxHxK.shape[-1] not in head_dims:
        raise ValueError(f"{q_BxHxK.shape=}: {impl} supports head_dim in {head_dims}")


# ---------------------------------------------------------------------------- reference


def check_window(window) -> int | None:
    """None (the whole cache) or a positive int: how many of the last valid slots are seen."""
    if window is None:
        return None
    try:
        if isinstance(window, bool):
            raise TypeError
        w = operator.index(window)  # an int, or a NumPy integer
    except TypeError:
        w = 0
    if w < 1:
        raise ValueError(
            f"window={window!r}: must be a positive int (the last W tokens) or None (all)"
        )
    return w


def decode_attention_reference(
    q_BxHxK,
    k_BxGxSxK,
    v_BxGxSxK,
    lengths_B,
    k_scale_BxGx1xS=None,
    v_scale_BxGx1xS=None,
    *,
    scale=None,
    window: int | None = None,
    softcap: float | None = None,
):
    """softmax over the first lengths[b] slots (the last `window` of them, if given),
    materialised; f32 math (f64 for f64 inputs); `softcap`: scaled scores s → softcap·tanh(s /
    softcap) before the softmax, as in attention().

    Slots outside are zeroed before any product, so garbage (NaN included) there never
    reaches the output; a length of 0 gives zeros, as in the kernels.
    """
    check_inputs(q_BxHxK, k_BxGxSxK, v_BxGxSxK, lengths_B, k_scale_BxGx1xS, v_scale_BxGx1xS)
    lengths_B = as_lengths(lengths_B, q_BxHxK.shape[0], k_BxGxSxK.shape[2])
    window, softcap = check_window(window), check_softcap(softcap)
    B, H, K = q_BxHxK.shape
    G, S = k_BxGxSxK.shape[1:3]
    acc = jnp.promote_types(q_BxHxK.dtype, jnp.float32)
    k_BxGxSxK, v_BxGxSxK = k_BxGxSxK.astype(acc), v_BxGxSxK.astype(acc)
    if k_scale_BxGx1xS is not None:
        k_BxGxSxK = k_BxGxSxK * jnp.swapaxes(k_scale_BxGx1xS, 2, 3).astype(acc)
        v_BxGxSxK = v_BxGxSxK * jnp.swapaxes(v_scale_BxGx1xS, 2, 3).astype(acc)
    slot_1xS = jnp.arange(S)[None, :]
    lengths_B = jnp.minimum(lengths_B, S)  # a length past the cache is the whole cache
    valid_BxS = slot_1xS < lengths_B[:, None]
    if window is not None:
        valid_BxS = valid_BxS & (slot_1xS >= lengths_B[:, None] - window)
    valid_Bx1xS = valid_BxS[:, None, :]
    k_BxGxSxK = jnp.where(valid_Bx1xS[..., None], k_BxGxSxK, 0)
    v_BxGxSxK = jnp.where(valid_Bx1xS[..., None], v_BxGxSxK, 0)
    q_BxGxRxK = q_BxHxK.reshape(B, G, H // G, K).astype(acc)
    s_BxGxRxS = jnp.einsum("bgrk,bgsk->bgrs", q_BxGxRxK, k_BxGxSxK)
    s_BxGxRxS = s_BxGxRxS * default_scale(K, scale)
    if softcap is not None:
        s_BxGxRxS = softcap * jnp.tanh(s_BxGxRxS / softcap)
    s_BxGxRxS = jnp.where(valid_Bx1xS[:, :, None, :], s_BxGxRxS, MASK_VALUE)
    p_BxGxRxS = jax.nn.softmax(s_BxGxRxS, axis=-1)
    o_BxGxRxK = jnp.einsum("bgrs,bgsk->bgrk", p_BxGxRxS, v_BxGxSxK)
    return o_BxGxRxK.reshape(B, H, K).astype(q_BxHxK.dtype)


CPU_DTYPES = (jnp.float32, jnp.bfloat16)  # q; the cache: these or int8


def cpu_takes(q_BxHxK, k_BxGxSxK) -> bool:
    """Whether `decode_attention_cpu` takes these operands here (built, dtypes it reads)."""
    from lab.kernels import cpu_gemv  # the library that holds it (built on first use)

    return cpu_takes_dtypes(q_BxHxK.dtype, k_BxGxSxK.dtype) and cpu_gemv.available()


def cpu_takes_dtypes(q_dtype, kv_dtype) -> bool:
    """Whether `decode_attention_cpu` reads queries and a cache of these dtypes."""
    return jnp.dtype(q_dtype) in CPU_DTYPES and jnp.dtype(kv_dtype) in (*CPU_DTYPES, jnp.int8)


def decode_attention_cpu(
    q_BxHxK,
    k_BxGxSxK,
    v_BxGxSxK,
    lengths_B,
    k_scale_BxGx1xS=None,
    v_scale_BxGx1xS=None,
    *,
    scale=None,
    window: int | None = None,
    threads: int = 0,
):
    """Decode attention in C++ on the CPU (lab/kernels/cpu_gemv.cc, through `jax.ffi`), the
    reference's result without its float copy of the cache: the reference widens (and for an
    int8 cache rescales) every slot of K and V into memory each step, then reads that copy
    again; this reads each (b, kv head)'s valid slots once in the cache's own dtype, widens
    them in registers, and folds an int8 cache's scales into the small operands:

        s_t = (q · k_code_t) · σ_k[t] · scale,   o = Σ_t p_t σ_v[t] v_code_t / Σ_t p_t

    Slots past each length (before the window) are never read. f32 math; q float32 or
    bfloat16, the cache those or int8; threads over (batch, kv head) (0: every core).
    Inference only (no gradient), as decode never differentiates.
    """
    from lab.kernels import cpu_gemv

    check_inputs(q_BxHxK, k_BxGxSxK, v_BxGxSxK, lengths_B, k_scale_BxGx1xS, v_scale_BxGx1xS)
    lengths_B = as_lengths(lengths_B, q_BxHxK.shape[0], k_BxGxSxK.shape[2])
    window = check_window(window)
    if not cpu_takes(q_BxHxK, k_BxGxSxK):
        raise ValueError(
            f"decode_attention_cpu: q {q_BxHxK.dtype} / cache {k_BxGxSxK.dtype}: takes float32 "
            "or bfloat16 queries and a float32, bfloat16 or int8 cache, where the kernel is built"
        )
    B, H, K = q_BxHxK.shape
    none = jnp.zeros((0,), jnp.float32)
    ks = none if k_scale_BxGx1xS is None else k_scale_BxGx1xS.astype(jnp.float32)
    vs = none if v_scale_BxGx1xS is None else v_scale_BxGx1xS.astype(jnp.float32)
    out = jax.ShapeDtypeStruct((B, H, K), jnp.float32)
    call = jax.ffi.ffi_call(cpu_gemv.ATTENTION_TARGET, out, vmap_method="sequential")
    o_BxHxK = call(
        q_BxHxK.astype(jnp.float32),
        k_BxGxSxK,
        v_BxGxSxK,
        jnp.asarray(lengths_B, jnp.int32),
        ks,
        vs,
        scale=np.float32(default_scale(K, scale)),
        window=np.int64(window or 0),
        threads=np.int64(threads),
    )
    return o_BxHxK.astype(q_BxHxK.dtype)


# ---------------------------------------------------------------------------- shared


def _cdiv(a, b: int):
    """ceil(a / b) of a non-negative traced int (lax.div lowers on every backend)."""
    a = jnp.asarray(a)
    return lax.div(a + (b - 1), jnp.asarray(b, a.dtype))


def first_slot(length, window: int | None):
    """The first slot a sequence with `length` valid slots attends to (0 without a window)."""
    return 0 if window is None else jnp.maximum(length - window, 0)


def split_range(length, split, *, block_k: int, num_splits: int, window: int | None = None):
    """Cache blocks [lo, hi) that part `split` of a sequence with `length` valid slots covers.

    Each sequence's own visible blocks (from the window's first to the length's last) are
    cut into num_splits near-equal parts, so a short sequence's programs finish early and a
    long one's share its work evenly.
    """
    first = jnp.asarray(first_slot(length, window))
    first = lax.div(first, jnp.asarray(block_k, first.dtype))
    n_valid = _cdiv(length, block_k)
    per = _cdiv(n_valid - first, num_splits)
    lo = first + split * per
    return lo, jnp.minimum(lo + per, n_valid)


def combine_splits(o_BxGxPxRxK, m_BxGxPxR, l_BxGxPxR, dtype):
    """Merge partial softmaxes: o = Σ_p e^(m_p - m) o_p / Σ_p e^(m_p - m) l_p.

    Empty parts carry (0, MASK_VALUE, 0) and get weight 0; an empty sequence gives 0.
    """
    B, G, _, R, K = o_BxGxPxRxK.shape
    m_BxGx1xR = m_BxGxPxR.max(axis=2, keepdims=True)
    w_BxGxPxR = jnp.exp(m_BxGxPxR - m_BxGx1xR)
    l_BxGxR = (w_BxGxPxR * l_BxGxPxR).sum(axis=2)
    o_BxGxRxK = (w_BxGxPxR[..., None] * o_BxGxPxRxK).sum(axis=2)
    o_BxGxRxK = o_BxGxRxK / jnp.where(l_BxGxR > 0, l_BxGxR, 1.0)[..., None]
    return o_BxGxRxK.reshape(B, G * R, K).astype(dtype)


def _prepare(q_BxHxK, k_BxGxSxK, lengths_B):
    B, H, K = q_BxHxK.shape
    G, S = k_BxGxSxK.shape[1:3]
    lengths_B = jnp.clip(lengths_B, 0, S)  # a length past the cache means the whole cache
    return q_BxHxK.reshape(B, G, H // G, K), lengths_B


# ---------------------------------------------------------------------------- TPU (Mosaic)


def _tpu_kernel(
    lengths_ref, q_ref, k_ref, v_ref, *refs, bk, splits, scale, quantized, window, cap=None
):
    # lengths_ref: [B] int32 in SMEM (scalar prefetch); q_ref: [R, K]; k_ref, v_ref: [C, K]
    # quantized: ks_ref, vs_ref: [1, C] f32 scale rows of this block
    # outputs o_ref: [R, K] f32 (unnormalised), m_ref, l_ref: [R, 1] f32 for this split
    # scratch m_scr, l_scr: [R, 1], acc_scr: [R, K] f32, alive across the blocks j of a split
    pl, _, _ = _pallas()
    if quantized:
        ks_ref, vs_ref, *refs = refs
    o_ref, m_ref, l_ref, m_scr, l_scr, acc_scr = refs
    b, split, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    length = lengths_ref[b]
    lo, hi = split_range(length, split, block_k=bk, num_splits=splits, window=window)
    start = (lo + j) * bk  # first cache slot of this block
    first = first_slot(length, window)  # the first slot attended to

    @pl.when(j == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, MASK_VALUE, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    def step(masked: bool):
        q_RxK = q_ref[...]
        k_CxK = k_ref[...].astype(q_RxK.dtype)  # int8 -> q's dtype is exact
        s_RxC = lax.dot_general(q_RxK, k_CxK, NT_DIMS, preferred_element_type=jnp.float32)
        s_RxC = s_RxC * scale
        if quantized:
            s_RxC = s_RxC * ks_ref[...]  # σ_s (q · k_s): the key scale on the score row
        if cap is not None:  # soft-capping, after every scale and before the mask
            s_RxC = cap * jnp.tanh(s_RxC / cap)
        if masked:  # the block holding the length (slots past it are garbage) or the window's start
            slot_1xC = start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
            valid_1xC = (slot_1xC < length) & (slot_1xC >= first)
            s_RxC = jnp.where(valid_1xC, s_RxC, MASK_VALUE)
        m_prev_Rx1 = m_scr[...]
        m_Rx1 = jnp.maximum(m_prev_Rx1, s_RxC.max(axis=1, keepdims=True))
        p_RxC = jnp.exp(s_RxC - m_Rx1)
        alpha_Rx1 = jnp.exp(m_prev_Rx1 - m_Rx1)
        l_scr[...] = alpha_Rx1 * l_scr[...] + p_RxC.sum(axis=1, keepdims=True)
        v_CxK = v_ref[...]
        if masked:  # 0 · NaN is NaN: zero the garbage values themselves
            slot_Cx1 = start + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
            valid_Cx1 = (slot_Cx1 < length) & (slot_Cx1 >= first)
            v_CxK = jnp.where(valid_Cx1, v_CxK, jnp.zeros((), v_CxK.dtype))
        if quantized:
            vs_1xC = vs_ref[...]
            if masked:
                vs_1xC = jnp.where(valid_1xC, vs_1xC, 0.0)
            p_RxC = p_RxC * vs_1xC  # Σ_s (p_s σ_s) v_s: the value scale on the probabilities
        pv_RxK = jnp.dot(
            p_RxC.astype(q_RxK.dtype), v_CxK.astype(q_RxK.dtype), preferred_element_type=jnp.float32
        )
        acc_scr[...] = alpha_Rx1 * acc_scr[...] + pv_RxK
        m_scr[...] = m_Rx1

    live = lo + j < hi
    whole = (start + bk <= length) & (start >= first)

    @pl.when(live & whole)
    def _whole():
        step(masked=False)

    @pl.when(live & jnp.logical_not(whole))
    def _last():
        step(masked=True)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        o_ref[...] = acc_scr[...]
        m_ref[...] = m_scr[...]
        l_ref[...] = l_scr[...]


@functools.partial(
    jax.jit, static_argnames=("scale", "window", "softcap", "block_sizes", "interpret")
)
def decode_attention_tpu(
    q_BxHxK,
    k_BxGxSxK,
    v_BxGxSxK,
    lengths_B,
    k_scale_BxGx1xS=None,
    v_scale_BxGx1xS=None,
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    block_sizes: BlockSizesTPU = BlockSizesTPU(),
    interpret: bool = False,
):
    """Decode attention on TPU: grid (batch, kv head, split, cache block), last axis sequential.

    `window=W`: only the last W valid slots of each sequence (blocks before them skipped).
    `softcap`: scaled scores s → softcap·tanh(s / softcap) before the softmax (after the int8
    key scale), as in attention().
    `interpret=True` runs the kernel through the Pallas interpreter (CPU); block_k then only
    needs a multiple of 8. A cache length S that is not a multiple of block_k is fine: the
    last grid block hangs over the end and its slots are masked (S >= length).
    """
    pl, pltpu, _ = _pallas()
    check_inputs(q_BxHxK, k_BxGxSxK, v_BxGxSxK, lengths_B, k_scale_BxGx1xS, v_scale_BxGx1xS)
    lengths_B = as_lengths(lengths_B, q_BxHxK.shape[0], k_BxGxSxK.shape[2])
    _check_kernel(
        q_BxHxK,
        (k_scale_BxGx1xS, v_scale_BxGx1xS),
        TPU_DTYPES,
        TPU_HEAD_DIMS,
        "decode_attention_tpu",
    )
    window = check_window(window)
    if not interpret:
        block_sizes.check_compiled()
    B, H, K = q_BxHxK.shape
    G, S = k_BxGxSxK.shape[1:3]
    R = H // G
    quantized = k_BxGxSxK.dtype == jnp.int8
    bk = min(block_sizes.block_k, -(-S // 8) * 8 if interpret else -(-S // LANES) * LANES)
    n_blocks = -(-S // bk)
    splits = min(block_sizes.num_splits, n_blocks)
    per_split = -(-n_blocks // splits)  # grid extent: the most blocks any split can have
    q_BxGxRxK, lengths_B = _prepare(q_BxHxK, k_BxGxSxK, lengths_B)

    def kv_index(b, g, split, j, lengths_ref):
        # Blocks past this split's last valid block map to it: same index, no new DMA.
        lo, hi = split_range(lengths_ref[b], split, block_k=bk, num_splits=splits, window=window)
        return b, g, jnp.maximum(jnp.minimum(lo + j, hi - 1), 0), 0

    def scale_index(b, g, split, j, lengths_ref):
        _, _, block, _ = kv_index(b, g, split, j, lengths_ref)
        return b, g, 0, block

    def part_index(b, g, split, j, lengths_ref):
        return b, g, split, 0, 0

    q_spec = pl.BlockSpec((None, None, R, K), lambda b, g, split, j, lengths_ref: (b, g, 0, 0))
    kv_spec = pl.BlockSpec((None, None, bk, K), kv_index)
    in_specs = [q_spec, kv_spec, kv_spec]
    args = [q_BxGxRxK, k_BxGxSxK, v_BxGxSxK]
    if quantized:  # a (1, bk) row per block, lane-dense like the score tile it scales
        in_specs += [pl.BlockSpec((None, None, 1, bk), scale_index)] * 2
        args += [k_scale_BxGx1xS, v_scale_BxGx1xS]
    o_spec = pl.BlockSpec((None, None, None, R, K), part_index)
    row_spec = pl.BlockSpec((None, None, None, R, 1), part_index)
    o, m, l = pl.pallas_call(
        functools.partial(
            _tpu_kernel,
            bk=bk,
            splits=splits,
            scale=default_scale(K, scale),
            quantized=quantized,
            window=window,
            cap=check_softcap(softcap),
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, G, splits, per_split),
            in_specs=in_specs,
            out_specs=[o_spec, row_spec, row_spec],
            scratch_shapes=[
                pltpu.VMEM((R, 1), jnp.float32),
                pltpu.VMEM((R, 1), jnp.float32),
                pltpu.VMEM((R, K), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((B, G, splits, R, K), jnp.float32),
            jax.ShapeDtypeStruct((B, G, splits, R, 1), jnp.float32),
            jax.ShapeDtypeStruct((B, G, splits, R, 1), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="decode_attention_tpu",
    )(lengths_B, *args)
    return combine_splits(o, m[..., 0], l[..., 0], q_BxHxK.dtype)


# ---------------------------------------------------------------------------- GPU (Triton)


def _dot(a, b, *, trans_b: bool = False):
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _gpu_kernel(
    lengths_ref, q_ref, k_ref, v_ref, *refs, bk, splits, scale, quantized, window, cap=None
):
    # lengths_ref: [] int32 (this sequence); q_ref: [Rp, K] (R heads padded to >= 16 rows)
    # k_ref, v_ref: [S, K] the whole cache row of (b, g); quantized: ks_ref, vs_ref: [S] f32
    # outputs o_ref: [Rp, K] f32 (unnormalised), m_ref, l_ref: [Rp] f32 for this split
    pl, _, plgpu = _pallas()
    if quantized:
        ks_ref, vs_ref, *refs = refs
    o_ref, m_ref, l_ref = refs
    length = lengths_ref[...]
    lo, hi = split_range(length, pl.program_id(2), block_k=bk, num_splits=splits, window=window)
    first = first_slot(length, window)
    q_RxK = q_ref[...]

    def body(blk, carry):
        acc_RxK, m_R, l_R = carry
        slots = pl.ds(blk * bk, bk)
        slot_C = blk * bk + jnp.arange(bk)
        valid_C = (slot_C < length) & (slot_C >= first)
        # Masked loads: slots past the length (or the cache) are never read, 0 stands in.
        k_CxK = plgpu.load(k_ref.at[slots, :], mask=valid_C[:, None], other=0)
        v_CxK = plgpu.load(v_ref.at[slots, :], mask=valid_C[:, None], other=0)
        s_RxC = _dot(q_RxK, k_CxK.astype(q_RxK.dtype), trans_b=True) * scale
        if quantized:
            s_RxC = s_RxC * plgpu.load(ks_ref.at[slots], mask=valid_C, other=0.0)[None, :]
        if cap is not None:  # soft-capping, after every scale and before the mask
            s_RxC = cap * jnp.tanh(s_RxC / cap)
        s_RxC = jnp.where(valid_C[None, :], s_RxC, MASK_VALUE)
        m_new_R = jnp.maximum(m_R, s_RxC.max(axis=1))
        p_RxC = jnp.exp(s_RxC - m_new_R[:, None])
        alpha_R = jnp.exp(m_R - m_new_R)
        l_R = alpha_R * l_R + p_RxC.sum(axis=1)
        if quantized:
            p_RxC = p_RxC * plgpu.load(vs_ref.at[slots], mask=valid_C, other=0.0)[None, :]
        pv_RxK = _dot(p_RxC.astype(q_RxK.dtype), v_CxK.astype(q_RxK.dtype))
        return alpha_R[:, None] * acc_RxK + pv_RxK, m_new_R, l_R

    Rp = q_RxK.shape[0]
    init = (
        jnp.zeros(q_RxK.shape, jnp.float32),
        jnp.full((Rp,), MASK_VALUE, jnp.float32),
        jnp.zeros((Rp,), jnp.float32),
    )
    acc_RxK, m_R, l_R = lax.fori_loop(lo, hi, body, init)
    o_ref[...] = acc_RxK
    m_ref[...] = m_R
    l_ref[...] = l_R


@functools.partial(
    jax.jit, static_argnames=("scale", "window", "softcap", "block_sizes", "interpret")
)
def decode_attention_gpu(
    q_BxHxK,
    k_BxGxSxK,
    v_BxGxSxK,
    lengths_B,
    k_scale_BxGx1xS=None,
    v_scale_BxGx1xS=None,
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    block_sizes: BlockSizesGPU = BlockSizesGPU(),
    interpret: bool = False,
):
    """Decode attention on GPU (Pallas Triton): grid (batch, kv head, split), each program
    loops over its part of the cache; partials merged by `combine_splits`. `window=W`: only
    the last W valid slots of each sequence (the loop starts at the window's block).
    `softcap`: scaled scores s → softcap·tanh(s / softcap) before the softmax (after the int8
    key scale), as in attention()."""
    pl, _, plgpu = _pallas()
    check_inputs(q_BxHxK, k_BxGxSxK, v_BxGxSxK, lengths_B, k_scale_BxGx1xS, v_scale_BxGx1xS)
    lengths_B = as_lengths(lengths_B, q_BxHxK.shape[0], k_BxGxSxK.shape[2])
    _check_kernel(
        q_BxHxK,
        (k_scale_BxGx1xS, v_scale_BxGx1xS),
        GPU_DTYPES,
        GPU_HEAD_DIMS,
        "decode_attention_gpu",
    )
    window = check_window(window)
    if not interpret:
        triton_deprecation.explain()  # jax >= 0.11: one line instead of a warning per kernel
    B, H, K = q_BxHxK.shape
    G, S = k_BxGxSxK.shape[1:3]
    R = H // G
    Rp = max(GPU_MIN_ROWS, pl.next_power_of_2(R))
    quantized = k_BxGxSxK.dtype == jnp.int8
    bk = block_sizes.block_k
    splits = block_sizes.splits_for(B, G, -(-S // bk))
    q_BxGxRxK, lengths_B = _prepare(q_BxHxK, k_BxGxSxK, lengths_B)
    q_BxGxRpxK = jnp.pad(q_BxGxRxK, ((0, 0), (0, 0), (0, Rp - R), (0, 0)))  # q is tiny

    row = lambda b, g, split: (b, g, 0, 0)
    in_specs = [
        pl.BlockSpec((None,), lambda b, g, split: (b,)),
        pl.BlockSpec((None, None, Rp, K), row),
        pl.BlockSpec((None, None, S, K), row),
        pl.BlockSpec((None, None, S, K), row),
    ]
    args = [lengths_B, q_BxGxRpxK, k_BxGxSxK, v_BxGxSxK]
    if quantized:
        in_specs += [pl.BlockSpec((None, None, None, S), lambda b, g, split: (b, g, 0, 0))] * 2
        args += [k_scale_BxGx1xS, v_scale_BxGx1xS]
    part = lambda b, g, split: (b, g, split, 0)
    o, m, l = pl.pallas_call(
        functools.partial(
            _gpu_kernel,
            bk=bk,
            splits=splits,
            scale=default_scale(K, scale),
            quantized=quantized,
            window=window,
            cap=check_softcap(softcap),
        ),
        grid=(B, G, splits),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, Rp, K), lambda b, g, split: (b, g, split, 0, 0)),
            pl.BlockSpec((None, None, None, Rp), part),
            pl.BlockSpec((None, None, None, Rp), part),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, G, splits, Rp, K), jnp.float32),
            jax.ShapeDtypeStruct((B, G, splits, Rp), jnp.float32),
            jax.ShapeDtypeStruct((B, G, splits, Rp), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(
            num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages
        ),
        interpret=interpret,
        name="decode_attention_gpu",
    )(*args)
    return combine_splits(o[:, :, :, :R], m[..., :R], l[..., :R], q_BxHxK.dtype)

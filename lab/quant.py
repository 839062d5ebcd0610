"""int8 quantization for inference: weight-only matmuls with per-channel scales, and an int8
key/value cache with one scale per (token, kv head) in the decode kernels' layout.

Symmetric absmax, round to nearest, codes in [-127, 127] (a symmetric grid; x / scale never
leaves it, so no clipping decides anything). qwix divides by 127.5 instead and clips to
[-128, 127]: a 0.4 % finer step, the largest element rounds from 127.5 and is clipped to 127;
test_quant.py reproduces qwix's numbers exactly with that convention. Both keep |e| <= step/2.

    scale = max |x| over the reduced axes / 127,   x_i8 = round(x / scale),   x ≈ x_i8 · scale

Error of one element: |x - x_i8·scale| <= scale / 2, and ~uniform on [-scale/2, scale/2]
(RMS scale/√12) when x is spread over many codes.

Matmul error (weight-only, one scale per output channel c, contraction over d):
    y_c = Σ_d x_d w_dc,   y'_c - y_c = Σ_d x_d e_dc,   |e_dc| <= s_c / 2
  worst case:   |y'_c - y_c| <= (s_c / 2) · ‖x‖₁                                 (always)
  typical:      RMS(y' - y)_c = (s_c / √12) · ‖x‖₂   (errors independent of x)
  For weights of RMS σ_c per channel, RMS(y_c) = σ_c ‖x‖₂, so the relative RMS error is
      s_c / (√12 σ_c) = crest_c / (127 √12) = crest_c / 440,   crest_c = max|w_c| / σ_c
  Gaussian columns of D = 256 … 4096 entries have crest ≈ 3.0 … 3.9: 0.7 % … 0.9 %,
  independent of D's effect on ‖x‖ (it cancels). An outlier-heavy column (large crest)
  is what breaks per-channel int8; that is what sub-channel scales (qwix tile_size) are for.
  int8 activations too (W8A8, one scale per row of x): add the activations' own term,
  relative RMS ≈ √(crest_w² + crest_x²) / 440.

KV cache (decode): one scale per (b, g, s) over the head dim K.
  scores:  δs = scale_attn · q · e_k,  |δs| <= scale_attn · ‖q‖₁ · s_k / 2
  softmax: ‖p' - p‖₁ <= 2 max|δs|  (Jacobian diag(p) - p pᵀ maps ‖δ‖∞ to at most 2‖δ‖∞ in ℓ₁,
           at every point, so it holds for the exact difference by the mean value theorem)
  output:  o' - o = Σ (p'_s - p_s) v'_s + Σ p_s e_v,s
           |o' - o| <= 2 max|δs| · max|v| + max_s s_v,s / 2                       (always)
  (`kv_error_bound` computes this from the data; test_quant.py checks it holds.)

Why in-house and not a library: qwix and AQT both install on jax 0.10 and the newest and give
the same int8 numbers (7.1e-3 on a per-channel bld,dhk->blhk einsum), but qwix fails on the
model's `w.astype(dtype)` before `jnp.einsum` ("Unsupported type: QArray") and runs a bf16
model's dot in f32, and AQT needs every einsum rewritten as a module with convert/serve modes.
The lab needs weight-only int8 with per-channel scales and an int8 cache in its decode
kernel's layout: this file is the whole implementation (qwix is the route for quantization-aware
training, int4 or sub-channel scales).

How `matmul` runs is chosen by the caller (`using(Matmuls(...))`, lab/decode.py does): XLA's
einsum (weight-only: XLA:CPU converts the whole int8 weight to float before the dot), the W8A8
int8 × int8 → int32 dot, or a native kernel (lab/kernels/cpu_gemv.py on CPU: the codes widened
in registers, the scale applied to the sum).
"""

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

INT8_MAX = 127


def _axes(axis, ndim: int) -> tuple[int, ...]:
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    out = tuple(sorted(a % ndim for a in axes))
    if len(set(out)) != len(out) or any(not -ndim <= a < ndim for a in axes):
        raise ValueError(f"axis={axis!r}: bad axes for an array of {ndim} dims")
    return out


def quantize_int8(x, axis):
    """(x_i8, scale): one float32 scale per index of the axes *not* in `axis` (keepdims).

    For a weight, `axis` is its contraction axes: w_DxHxK used as "bld,dhk->blhk" takes
    axis=0 and gets a [1, H, K] scale, one per output channel.
    """
    axes = _axes(axis, x.ndim)
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axes, keepdims=True)
    # an all-zero channel: any scale; a channel holding NaN keeps it in its scale, so what is
    # read back through it is NaN too, never a number the codes made up
    # (asked of isnan, not of the max: XLA:CPU's max reduction drops NaN in larger arrays)
    nan = jnp.isnan(x).any(axis=axes, keepdims=True)
    scale = jnp.where(nan, jnp.nan, jnp.where(amax > 0, amax / INT8_MAX, 1.0))
    x_i8 = jnp.clip(jnp.round(x.astype(jnp.float32) / scale), -INT8_MAX, INT8_MAX)
    return x_i8.astype(jnp.int8), scale


def dequantize_int8(x_i8, scale, dtype=jnp.float32):
    return (x_i8.astype(jnp.float32) * scale).astype(dtype)


def _parse(eqn: str):
    plain = eqn.replace(" ", "")
    if plain.count("->") != 1 or plain.split("->")[0].count(",") != 1:
        raise ValueError(f"{eqn=}: expected two operands and an output, e.g. 'bld,dhk->blhk'")
    ins, out = plain.split("->")
    x_subs, w_subs = ins.split(",")
    if "." in eqn or len(set(w_subs)) != len(w_subs):
        raise ValueError(f"{eqn=}: plain two-operand einsum without ellipsis or repeats")
    return x_subs, w_subs, out


def int8_einsum(eqn: str, x, w_i8, w_scale, *, activations: str = "float"):
    """einsum(eqn, x, w) with w = w_i8 · w_scale quantized per output channel.

    activations="float" (weight-only): x · w_i8 with w_i8 converted to x's dtype (exact: every
      int8 is a bf16/f16), accumulated in f32, then · w_scale on the *output* (the scale is
      constant along the contraction, so it factors out; no dequantised weight is formed).
    activations="int8" (W8A8): x quantized per row (one scale per index of x's kept axes),
      an int8 × int8 dot with preferred_element_type=int32 (the MXU's int8 path on TPU
      v5e/v6e, IMMA on GPU), then · x_scale · w_scale.
    Returns x's dtype.
    """
    x_subs, w_subs, out = _parse(eqn)
    contracted = [c for c in w_subs if c not in out]
    if w_i8.ndim != len(w_subs) or w_scale.ndim != len(w_subs):
        raise ValueError(f"{eqn=} {w_i8.shape=} {w_scale.shape=}: ranks do not match {w_subs!r}")
    if x.ndim != len(x_subs):
        raise ValueError(f"{eqn=} {x.shape=}: its rank does not match {x_subs!r}")
    for c in set(x_subs) & set(w_subs):
        if x.shape[x_subs.index(c)] != w_i8.shape[w_subs.index(c)]:
            raise ValueError(
                f"{eqn=} {x.shape=} {w_i8.shape=}: axis {c!r} differs between x and the weight"
            )
    want = tuple(1 if c in contracted else n for c, n in zip(w_subs, w_i8.shape, strict=True))
    if w_scale.shape != want:
        raise ValueError(
            f"{eqn=} {w_i8.shape=} {w_scale.shape=}: expected one scale per output channel "
            f"(size 1 on the contracted axes {contracted}): quantize_int8(w, axis=contracted)"
        )
    if w_i8.dtype != jnp.int8:
        raise ValueError(f"{w_i8.dtype=}: expected int8")
    if activations not in ("float", "int8"):
        raise ValueError(f"{activations=}: choose 'float' (weight-only) or 'int8' (W8A8)")
    if activations == "float":
        y = jnp.einsum(eqn, x, w_i8.astype(x.dtype), preferred_element_type=jnp.float32)
    else:
        x_axes = [i for i, c in enumerate(x_subs) if c not in out]
        x_i8, x_scale = quantize_int8(x, x_axes)
        y = jnp.einsum(eqn, x_i8, w_i8, preferred_element_type=jnp.int32).astype(jnp.float32)
        y = y * _to_output(x_scale, x_subs, out)
    return (y * _to_output(w_scale, w_subs, out)).astype(x.dtype)


def _to_output(scale, subs: str, out: str):
    """A keepdims scale over `subs`, laid out to broadcast against the output `out`."""
    kept = [c for c in out if c in subs]
    squeezed = scale.reshape([n for c, n in zip(subs, scale.shape, strict=True) if c in out])
    order = [c for c in subs if c in out]
    moved = jnp.transpose(squeezed, [order.index(c) for c in kept])
    return moved.reshape([scale.shape[subs.index(c)] if c in subs else 1 for c in out])


@struct.dataclass
class Int8Weight:
    """A weight stored as int8 codes and one float32 scale per output channel (keepdims over
    the contracted axes). lab/model.py multiplies it with `matmul`, never dequantised."""

    q: jax.Array
    scale: jax.Array


# Weights the model multiplies, with the einsum each goes through (lab/model.py): the
# contracted axes of each get one scale per output channel.
EINSUMS = {
    "wq": "bld,dhk->blhk",
    "wk": "bld,dgk->blgk",
    "wv": "bld,dgk->blgk",
    "wo": "blhk,hkd->bld",
    "w_gate": "bld,df->blf",
    "w_up": "bld,df->blf",
    "w_down": "blf,fd->bld",
    "head": "bld,dv->blv",
}
# A tied model's output head is its embedding table [V, D], read in place as "bld,vd->blv"
# (no transposed copy): quantised, one scale per vocabulary row, which is both the head's
# per-output-channel scale and the lookup's per-row one (lab/model.py `embed_lookup`).
TIED_HEAD = "bld,vd->blv"


def quantize_params(params):
    """The model's matmul weights as Int8Weight (per output channel), every other leaf (norms;
    an untied model's embedding table, which only a lookup reads a row of) unchanged. A tied
    model (no `head` beside `embed`) has its table quantised per row: it is the output head,
    a quarter of a small model's bytes. Scanned layers keep their leading layer axis out of
    the contraction."""
    tied = isinstance(params, Mapping) and "embed" in params and "head" not in params

    def one(path, w):
        name = getattr(path[-1], "key", None)
        eqn = TIED_HEAD if name == "embed" and tied and len(path) == 1 else EINSUMS.get(name)
        if eqn is None:
            return w
        _, w_subs, out = _parse(eqn)
        stacked = w.ndim == len(w_subs) + 1  # nn.scan's leading layers axis
        contracted = [i + stacked for i, c in enumerate(w_subs) if c not in out]
        return Int8Weight(*quantize_int8(w, contracted))

    return jax.tree_util.tree_map_with_path(one, params)


@dataclasses.dataclass(frozen=True)
class Matmuls:
    """How `matmul` multiplies while a function is traced under `using(...)`.

    int8_activations: an Int8Weight's product runs W8A8 (the activations quantized per row,
      an int8 × int8 dot accumulated in int32) instead of weight-only.
    native: a kernel for the 2-D product, `native(x_MxC, w_CxN, scale_N or None, dtype,
      transposed=False)` → y [M, N] in `dtype` (transposed: w is [N, C]), or None where it
      does not take these operands (then the einsum runs). lab/decode.py passes the CPU
      kernel (lab/kernels/cpu_gemv.py) for decode steps.
    min_rows: a product with fewer rows of x than this (a batch-1 decode step) runs on x
      padded with zero rows, the extra outputs dropped. lab/decode.py asks for 2 on GPU:
      XLA:GPU strength-reduces a one-row product to a multiply that writes the whole C × N
      product to memory, then a reduction reading it back (three to five times the weight's
      bytes moved), where two rows take its GEMM (a split-K Triton fusion reading the weight
      once).
    """

    int8_activations: bool = False
    native: Callable | None = None
    min_rows: int = 1


_MATMULS: contextvars.ContextVar = contextvars.ContextVar("lab_matmuls", default=None)


@contextlib.contextmanager
def using(choice: Matmuls):
    """`matmul` follows `choice` inside the block (read while tracing, as flax reads its
    logical axis rules)."""
    token = _MATMULS.set(choice)
    try:
        yield
    finally:
        _MATMULS.reset(token)


def _as_2d(eqn: str, x, w):
    """(x [M, C], w [C, N] or [N, C], transposed, output shape) where eqn is x = kept +
    contracted and w = contracted + outputs (every matmul of the model), or w = outputs +
    contracted with one output axis (a tied head: the embedding table read in place); None
    for any other einsum."""
    x_subs, w_subs, out = _parse(eqn)
    c = len(w_subs) - len([a for a in w_subs if a in out])
    kept, contracted = x_subs[: len(x_subs) - c], x_subs[len(x_subs) - c :]
    if set(kept) & set(w_subs):
        return None
    m = x.shape[: len(kept)]
    x_MxC = x.reshape(math.prod(m), -1)
    if w_subs[:c] == contracted and out == kept + w_subs[c:]:
        return x_MxC, w.reshape(x_MxC.shape[1], -1), False, (*m, *w.shape[c:])
    if len(w_subs) == c + 1 and w_subs[1:] == contracted and out == kept + w_subs[0]:
        return x_MxC, w.reshape(-1, x_MxC.shape[1]), True, (*m, w.shape[0])
    return None


def _native(eqn: str, x, w, dtype, kernel):
    w_arr = w.q if isinstance(w, Int8Weight) else w
    two_d = _as_2d(eqn, x, w_arr)
    if two_d is None:
        return None
    x_MxC, w_2d, transposed, shape = two_d
    scale_N = w.scale.reshape(-1) if isinstance(w, Int8Weight) else None
    y_MxN = kernel(x_MxC.astype(dtype), w_2d, scale_N, dtype, transposed=transposed)
    return None if y_MxN is None else y_MxN.reshape(shape)


def _pad_rows(eqn: str, x, min_rows: int):
    """(x padded with zero rows along its first axis, the output axis to slice back) where x
    has fewer than `min_rows` rows and its first axis is kept in the output; None otherwise."""
    if min_rows <= 1:
        return None
    x_subs, w_subs, out = _parse(eqn)
    kept = [i for i, a in enumerate(x_subs) if a not in w_subs]
    if not kept or kept[0] != 0 or x_subs[0] not in out:
        return None
    if not 0 < math.prod(x.shape[i] for i in kept) < min_rows:  # no rows, or enough
        return None
    pad = [(0, min_rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, pad), out.index(x_subs[0])


def matmul(eqn: str, x, w, dtype, out_dtype=None):
    """einsum(eqn, x, w) in `dtype`: a float weight cast to it, an Int8Weight multiplied
    weight-only (its codes converted, its scale applied to the output) or W8A8; a native
    kernel first where `using` gives one and it takes the operands. `out_dtype` (the head's
    float32 logits): the result in it, summed in it, not rounded to `dtype` first. Fewer rows
    than `using`'s `min_rows`: x padded with zero rows, the extra outputs dropped."""
    choice = _MATMULS.get() or Matmuls()
    padded = _pad_rows(eqn, x, choice.min_rows) if choice.native is None else None
    if padded is not None:
        x_pad, axis = padded
        y = matmul(eqn, x_pad, w, dtype, out_dtype)
        return jax.lax.slice_in_dim(y, 0, x.shape[0], axis=axis)
    out_dtype = jnp.dtype(out_dtype or dtype)
    if choice.native is not None:
        # the kernel sums in f32 whatever x's dtype; x in the output's dtype gives y in it
        y = _native(eqn, x, w, jnp.promote_types(dtype, out_dtype), choice.native)
        if y is not None:
            return y.astype(out_dtype)
    if isinstance(w, Int8Weight):
        act = "int8" if choice.int8_activations else "float"
        y = int8_einsum(eqn, x.astype(dtype), w.q, w.scale, activations=act)
        return y.astype(out_dtype)
    if out_dtype != jnp.dtype(dtype):
        return jnp.einsum(eqn, x.astype(dtype), w.astype(dtype), preferred_element_type=out_dtype)
    return jnp.einsum(eqn, x.astype(dtype), w.astype(dtype))


def is_int8(params) -> bool:
    """Whether any matmul weight of `params` is int8 (an Int8Weight)."""
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Int8Weight))
    return any(isinstance(x, Int8Weight) for x in leaves)


def weight_bytes(params) -> int:
    """Bytes the matmuls and the lookup read: int8 codes and their scales, or floats."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


# ---------------------------------------------------------------------------- KV cache


def quantize_kv(x_BxGxSxK):
    """int8 cache entries and scales [B, G, 1, S] (the decode kernels' layout: one row of
    per-token scales per (batch, kv head))."""
    x_i8, scale_BxGxSx1 = quantize_int8(x_BxGxSxK, axis=3)
    return x_i8, jnp.swapaxes(scale_BxGxSx1, 2, 3)


def dequantize_kv(x_i8_BxGxSxK, scale_BxGx1xS, dtype=jnp.float32):
    _check_cache(x_i8_BxGxSxK, scale_BxGx1xS)
    return dequantize_int8(x_i8_BxGxSxK, jnp.swapaxes(scale_BxGx1xS, 2, 3), dtype)


def _check_cache(cache_i8_BxGxSxK, scale_BxGx1xS) -> None:
    """An int8 cache [B, G, S, K] and its per-token scales [B, G, 1, S]: ValueError otherwise."""
    shape = jnp.shape(cache_i8_BxGxSxK)
    want = (*shape[:2], 1, shape[2]) if len(shape) == 4 else None
    if want is None or jnp.shape(scale_BxGx1xS) != want:
        raise ValueError(
            f"cache {shape}, scales {jnp.shape(scale_BxGx1xS)}: expected a cache [B, G, S, K] "
            f"and its scales [B, G, 1, S]{f' = {want}' if want else ''}"
        )


def write_kv(cache_i8_BxGxSxK, scale_BxGx1xS, new_BxGxK, pos_B):
    """Quantize one new token per sequence and write it at slot pos[b] (a decode step).
    Shapes are checked, and positions outside the cache where they are known (concrete); a
    traced position past the cache is clamped to its last slot, as dynamic_update_slice does."""
    _check_cache(cache_i8_BxGxSxK, scale_BxGx1xS)
    B, G, S, K = cache_i8_BxGxSxK.shape
    if jnp.shape(new_BxGxK) != (B, G, K) or jnp.shape(pos_B) != (B,):
        raise ValueError(
            f"new {jnp.shape(new_BxGxK)}, pos {jnp.shape(pos_B)}: expected one token per "
            f"sequence [B, G, K] = {(B, G, K)} and one position per sequence [B] = {(B,)}"
        )
    if S == 0:
        raise ValueError(f"cache {cache_i8_BxGxSxK.shape}: it has no slot to write a token in")
    if not isinstance(pos_B, jax.core.Tracer):
        pos = np.asarray(pos_B)
        bad = pos.size and (pos.min() < 0 or pos.max() >= S)
        if not np.issubdtype(pos.dtype, np.integer) or bad:
            raise ValueError(f"pos={pos.tolist()}: positions must be integers in 0..{S - 1}")
    new_i8_BxGxK, new_scale_BxGx1 = quantize_int8(new_BxGxK, axis=2)

    def one(cache_GxSxK, scale_Gx1xS, tok_GxK, s_Gx1, pos):
        cache_GxSxK = jax.lax.dynamic_update_slice(cache_GxSxK, tok_GxK[:, None, :], (0, pos, 0))
        scale_Gx1xS = jax.lax.dynamic_update_slice(scale_Gx1xS, s_Gx1[:, :, None], (0, 0, pos))
        return cache_GxSxK, scale_Gx1xS

    return jax.vmap(one)(cache_i8_BxGxSxK, scale_BxGx1xS, new_i8_BxGxK, new_scale_BxGx1, pos_B)


def kv_error_bound(q_BxHxK, k_BxGxSxK, v_BxGxSxK, lengths_B, *, scale=None):
    """Worst-case |o(int8 cache) - o(float cache)| per (b, h), from the derivation above."""
    B, H, K = q_BxHxK.shape
    G, S = k_BxGxSxK.shape[1:3]
    scale = K**-0.5 if scale is None else scale
    valid_Bx1xS = (jnp.arange(S)[None] < lengths_B[:, None])[:, None, :]
    _, k_scale = quantize_kv(k_BxGxSxK)
    _, v_scale = quantize_kv(v_BxGxSxK)
    k_step_BxG = jnp.where(valid_Bx1xS, k_scale[:, :, 0], 0).max(-1)
    v_step_BxG = jnp.where(valid_Bx1xS, v_scale[:, :, 0], 0).max(-1)
    v_max_BxG = jnp.where(valid_Bx1xS[..., None], jnp.abs(v_BxGxSxK), 0).max((-1, -2))
    q_l1_BxGxR = jnp.abs(q_BxHxK.astype(jnp.float32)).sum(-1).reshape(B, G, H // G)
    ds_BxGxR = scale * q_l1_BxGxR * k_step_BxG[..., None] / 2
    bound = 2 * ds_BxGxR * v_max_BxG[..., None] + v_step_BxG[..., None] / 2
    return bound.reshape(B, H)

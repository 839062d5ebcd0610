"""The Pallas flash kernels' options beyond plain softmax attention, each kernel in interpret
mode against a float64 reference, forward and all three gradients: logit soft-capping
(cap·tanh(s / cap), Gemma 2), a value head dim different from the query/key one, the
log-sum-exp as a second, differentiable output (its cotangent is random too), and on the
Triton kernel head dims that are multiples of 8 but not powers of two; the masks
(common.Mask) and attention sinks on every kernel. Shapes are tiny (lengths of a few blocks,
not block multiples) so each case takes seconds; the Mosaic GPU kernel's other cases live in
tests/test_pallas_mgpu.py (the GPU interpreter).
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab.kernels.attention import pallas_gpu, pallas_mgpu, pallas_tpu
from lab.kernels.attention.common import Mask
from lab.kernels.attention.reference import attention_reference

# max |kernel - f64| / max |f64| per dtype, as tests/test_attention.py and
# tests/test_pallas_mgpu.py derive them: f32 sums of ~100 products at 2^-24; bf16 and f16
# round P and dS to 2^-8 (2^-11) before their products, about 5 such units allowed.
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2.5e-3}
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def reference(q, k, v, *, causal: bool, softcap=None, scale=None):
    """(out [B, L, H, V], lse [B, L, H]) in the inputs' dtype (float64 here), materialised."""
    _, L, H, K = q.shape
    S, G = k.shape[1:3]
    scale = K**-0.5 if scale is None else scale
    k, v = jnp.repeat(k, H // G, axis=2), jnp.repeat(v, H // G, axis=2)
    s = jnp.einsum("blhk,bshk->bhls", q, k) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if causal:
        s = jnp.where(jnp.arange(L)[:, None] + (S - L) >= jnp.arange(S)[None, :], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    o = jnp.einsum("bhls,bshk->blhk", jnp.exp(s - lse[..., None]), v)
    return o, jnp.swapaxes(lse, 1, 2)


def random_inputs(seed, L, S, H, G, K, V, dtype):
    """q, k, v, and the cotangents of out and lse: normal, never zeros."""
    keys = jax.random.split(jax.random.key(seed), 5)
    shapes = [(1, L, H, K), (1, S, G, K), (1, S, G, V), (1, L, H, V), (1, L, H)]
    xs = [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes, strict=True)]
    return [x.astype(dtype) for x in xs[:4]] + [xs[4]]


def values_and_grads(fn, q, k, v, do, dlse, compile_options=None):
    """(out, lse, dq, dk, dv) of fn(q, k, v) -> (out, lse) with cotangents (do, dlse)."""

    def both(q, k, v, do, dlse):
        (o, lse), vjp = jax.vjp(fn, q, k, v)
        return (o, lse, *vjp((do, dlse)))

    lowered = jax.jit(both).lower(q, k, v, do, dlse)
    return lowered.compile(compiler_options=compile_options)(q, k, v, do, dlse)


def reference_f64(q, k, v, do, dlse, **kwargs):
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, do, dlse)]
        fn = functools.partial(reference, **kwargs)
        return [np.asarray(x) for x in values_and_grads(fn, *args)]


def assert_close(got, want, dtype):
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        assert g.shape == w.shape, (name, g.shape, w.shape)
        err = np.abs(np.asarray(g, np.float64) - w).max() / np.abs(w).max()
        assert err < TOL[dtype], f"{name}: max error {err:.2e} relative to max |ref|"


def check(kernel, *, L, S, H, G, K, V, dtype, causal, softcap):
    seed = zlib.crc32(f"{L}{S}{H}{G}{K}{V}{dtype}{causal}{softcap}".encode())
    q, k, v, do, dlse = random_inputs(seed, L, S, H, G, K, V, dtype)
    q = q * 4  # large logits, so that the cap bends them
    fn = functools.partial(kernel, causal=causal, softcap=softcap, return_lse=True)
    got = values_and_grads(fn, q, k, v, do, dlse, FAST_COMPILE)
    assert got[0].dtype == q.dtype and got[1].dtype == jnp.float32
    assert_close(got, reference_f64(q, k, v, do, dlse, causal=causal, softcap=softcap), dtype)


GPU = functools.partial(
    pallas_gpu.flash_attention_gpu,
    block_sizes=pallas_gpu.BlockSizes(16, 32, 32, 16, 16, 32),
    interpret=True,
)
MGPU = functools.partial(
    pallas_mgpu.flash_attention_mgpu,
    block_sizes=pallas_mgpu.BlockSizes(block_k=64),
    interpret=True,
)
TPU = functools.partial(
    pallas_tpu.flash_attention_tpu,
    block_sizes=pallas_tpu.BlockSizes(block_q=16, block_k=32, block_q_bwd=32, block_k_bwd=16),
    interpret=True,
)


@pytest.mark.parametrize(
    "K, V, dtype, causal, softcap",
    [
        # 24 and 40 (padded to 32 and 64 tiles) with soft-capping: the mask cases below
        (8, 256, "bfloat16", False, None),  # below tl.dot's 16; v the widest head dim
    ],
)
def test_triton_kernel_options_match_float64(K, V, dtype, causal, softcap):
    check(GPU, L=20, S=40, H=2, G=1, K=K, V=V, dtype=dtype, causal=causal, softcap=softcap)


@pytest.mark.skipif(
    not pallas_mgpu.interpretable(), reason="jax < 0.11: no GPU interpreter for pallas_mgpu"
)
def test_mosaic_gpu_kernel_head_dim_256_matches_float64():
    """In JAX's GPU interpreter, q/k head dim 256 and v's 128 (the tiles of 256: one compute
    warpgroup, 64-key blocks): the dQ kernel runs as two launches of 128 output columns, dK
    and dV as one launch each (pallas_mgpu.column_parts, dkv_launches); soft-capped, the lse
    returned; 40 queries against 100 keys: the causal mask bottom-right, the last key block
    partly padding. (The other head dims and dtypes: tests/test_pallas_mgpu.py.)"""
    mgpu = functools.partial(pallas_mgpu.flash_attention_mgpu, interpret=True)
    check(mgpu, L=40, S=100, H=2, G=1, K=256, V=128, dtype="float16", causal=True, softcap=8.0)


@pytest.mark.parametrize(
    "kernel, shapes, kwargs, needle",
    [
        (GPU, (44, 44), {}, "pallas_gpu supports q/k head_dim a multiple of 8 up to 256"),
        (GPU, (264, 264), {}, "multiple of 8 up to 256 (dtypes float32, bfloat16, float16)"),
        (GPU, (64, 12), {}, "pallas_gpu supports v head_dim a multiple of 8"),
        (GPU, (64, 64), {"softcap": -1.0}, "softcap=-1.0: must be a positive number"),
        (TPU, (64, 96), {}, "pallas_tpu supports v head_dim in (64, 128, 256)"),
        (MGPU, (64, 96), {}, "pallas_mgpu supports v head_dim in (64, 128"),
        (TPU, (64, 64), {"softcap": 0}, "softcap=0: must be a positive number"),
    ],
)
def test_bad_options_name_the_constraint(kernel, shapes, kwargs, needle):
    K, V = shapes
    dtype = jnp.bfloat16 if kernel is MGPU else jnp.float32
    q, k, v = (jnp.ones((1, 16, n, d), dtype) for n, d in ((2, K), (1, K), (1, V)))
    with pytest.raises(ValueError) as info:
        kernel(q, k, v, causal=True, **kwargs)
    assert needle in str(info.value)


# ---------------------------------------------------------------------------- masks


def mask_case(kind: str, B: int, L: int, S: int) -> Mask:
    """One common.Mask of each kind, on per-sequence arrays where the kind has them."""
    if kind == "causal-more-queries":  # the first L - S rows see no key: output 0
        return Mask.make(causal=True)
    if kind == "window":
        return Mask.make(causal=True, window=(9, 0))
    docs = np.array([[0] * 13 + [1] * 20 + [2] * (L - 33), [5] * 7 + [6] * (L - 7)])[:B]
    if kind == "segments":  # packed documents (ids need not start at 0)
        return Mask.make(q_segment_ids=jnp.asarray(docs), kv_segment_ids=jnp.asarray(docs))
    if kind == "lengths":
        return Mask.make(q_lengths=jnp.array([L - 5, 0][:B]), kv_lengths=jnp.array([S, 9][:B]))
    # all of them at once, a window open on both sides and no causal clause
    return Mask.make(
        window=(6, 3),
        q_segment_ids=jnp.asarray(docs),
        kv_segment_ids=jnp.asarray(docs),
        kv_lengths=jnp.array([S - 3, 20][:B]),
    )


def masked_reference_f64(q, k, v, do, dlse, mask, softcap):
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, do, dlse)]
        fn = functools.partial(
            attention_reference, causal=False, mask=mask, softcap=softcap, return_lse=True
        )
        return [np.asarray(x) for x in values_and_grads(fn, *args)]


def assert_masked_close(got, want, dtype):
    """As assert_close, with rows that see no key: lse -inf on both sides, output 0."""
    o, lse, *grads = got
    w_o, w_lse, *w_grads = want
    empty = np.isneginf(w_lse)
    assert (np.isneginf(np.asarray(lse)) == empty).all()
    assert (np.asarray(o, np.float64)[empty] == 0).all()
    lse, w_lse = np.where(empty, 0, lse), np.where(empty, 0, w_lse)
    assert_close([o, lse, *grads], [w_o, w_lse, *w_grads], dtype)


# each kind once, both dtypes and ratios; packed documents alone are in "combined" (and the
# TPU kernel's cases)
MASK_CASES = [
    ("causal-more-queries", "float32", 2, 48, 24, None),
    ("window", "bfloat16", 1, 40, 40, 5.0),
    ("lengths", "bfloat16", 2, 40, 40, None),
    ("combined", "float32", 1, 40, 40, 5.0),
]


@pytest.mark.parametrize("kind, dtype, ratio, L, S, softcap", MASK_CASES)
def test_triton_kernel_masks_match_float64(kind, dtype, ratio, L, S, softcap):
    """Every Mask kind through the Triton kernel (16-row, 16/32-key tiles, so the maps hold
    empty, partial and full tiles), forward and the three gradients, lse included. Keys in
    16-key blocks that no query sees hold NaN in the kernel's inputs (not the reference's):
    in the lengths and combined cases whole tiles of every kernel's map, so a kernel that
    visited an empty tile (forward, dQ or dK/dV) would return NaN."""
    check_masks(GPU, kind, dtype, ratio, L, S, softcap, K=24, V=40)


@pytest.mark.parametrize(
    "kind, dtype, ratio, L, S, softcap",
    [("causal-more-queries", "bfloat16", 1, 48, 24, None), ("combined", "float32", 2, 40, 40, 5.0)],
)
def test_tpu_kernel_masks_match_float64(kind, dtype, ratio, L, S, softcap):
    """The TPU kernel's grid visits the block map's non-empty tiles (scalar-prefetched);
    a v head dim (128) unlike q/k's (64), soft-capping and the lse ride along."""
    check_masks(TPU, kind, dtype, ratio, L, S, softcap, K=64, V=128)


needs_mgpu_interpreter = pytest.mark.skipif(
    not pallas_mgpu.interpretable(), reason="jax < 0.11: no GPU interpreter for pallas_mgpu"
)
# The Mosaic GPU kernel's cases: its tiles are 64 rows (64 keys in every kernel here), so the
# lengths run past a few tiles to give its streams empty, partial and full blocks; GQA in
# most. Unseen keys hold NaN at its 64-key granularity.
MGPU_MASK_CASES = [
    ("causal-more-queries", "bfloat16", 2, 200, 100, None),
    ("window", "bfloat16", 1, 200, 200, 5.0),
    ("lengths", "float16", 2, 130, 130, None),
    ("segments", "float16", 1, 130, 130, None),
    ("combined", "float16", 2, 100, 100, 5.0),
]


@needs_mgpu_interpreter
@pytest.mark.parametrize("kind, dtype, ratio, L, S, softcap", MGPU_MASK_CASES)
def test_mosaic_gpu_kernel_masks_match_float64(kind, dtype, ratio, L, S, softcap):
    """The Mosaic GPU kernel in JAX's GPU interpreter: each CTA streams only the key (dK/dV:
    query) blocks its tiles' ranges span (pallas_mgpu._ranges, from the block map), runs a
    tile's full blocks bare and masks the rest; rows with no key give 0."""
    check_masks(MGPU, kind, dtype, ratio, L, S, softcap, K=64, V=64, block=64)


def check_masks(kernel, kind, dtype, ratio, L, S, softcap, *, K, V, block=16):
    """`block`: the kernel's finest key tile; keys of blocks no query sees hold NaN."""
    B, H = 2, 2
    seed = zlib.crc32(f"{kind}{dtype}{ratio}".encode())
    q, k, v, do, dlse = random_inputs(seed, L, S, H, H // ratio, K, V, dtype)
    q, k, v, do = (jnp.concatenate([x, x[:, ::-1] * 0.5]) for x in (q, k, v, do))  # B = 2
    dlse = jnp.concatenate([dlse, -dlse])
    mask = mask_case(kind, B, L, S)
    bm = mask.block_map(L, S, 16, block)  # the dK/dV kernel's tiles, the finest key blocks
    unseen_B1xS11 = np.repeat(np.asarray(bm.kind).max(axis=1) == 0, block, axis=1)[:, None, :S]
    unseen_B1xS11 = jnp.asarray(unseen_B1xS11.reshape(-1, 1, S, 1, 1)[:, 0])
    k_nan, v_nan = (jnp.where(unseen_B1xS11, jnp.nan, x) for x in (k, v))
    fn = functools.partial(kernel, causal=False, mask=mask, softcap=softcap, return_lse=True)
    got = values_and_grads(fn, q, k_nan, v_nan, do, dlse, FAST_COMPILE)
    want = masked_reference_f64(q, k, v, do, dlse, mask, softcap)
    assert_masked_close(got, want, dtype)


# ---------------------------------------------------------------------------- attention sinks


@pytest.mark.parametrize(
    "kernel, K, V, dtype",
    [
        (GPU, 24, 40, "bfloat16"),
        (TPU, 64, 128, "float32"),
        pytest.param(MGPU, 64, 128, "bfloat16", marks=needs_mgpu_interpreter),
    ],
    ids=["triton", "tpu", "mosaic-gpu"],
)
def test_pallas_kernels_take_sinks_matching_float64(kernel, K, V, dtype):
    """A learned logit per query head in the softmax denominator: output, lse and the
    gradients of q, k, v and the sinks against float64, with the lse's cotangent random.
    Per-sequence lengths leave the second sequence's last rows with no key (output 0, lse =
    the sink) and a window leaves partial and empty tiles; a v head dim of its own."""
    L, S, H = 40, 40, 2
    seed = zlib.crc32(f"sinks{K}{V}{dtype}".encode())
    q, k, v, do, dlse = random_inputs(seed, L, S, H, 1, K, V, dtype)
    q, k, v, do = (jnp.concatenate([x, x[:, ::-1] * 0.5]) for x in (q, k, v, do))
    dlse = jnp.concatenate([dlse, -dlse])
    sinks = jax.random.normal(jax.random.key(seed), (H,)) * 2
    mask = Mask.make(causal=True, window=(11, 0), q_lengths=jnp.array([L, 30]))

    def run(fn, q, k, v, sinks, do, dlse):
        (o, lse), vjp = jax.vjp(lambda *a: fn(*a[:3], sinks=a[3]), q, k, v, sinks)
        return (o, lse, *vjp((do, dlse)))

    fn = functools.partial(kernel, causal=True, mask=mask, return_lse=True)
    args = (q, k, v, sinks, do, dlse)
    got = jax.jit(functools.partial(run, fn)).lower(*args).compile(FAST_COMPILE)(*args)
    with jax.enable_x64(True):
        f64 = [jnp.asarray(np.asarray(x, np.float64)) for x in args]
        ref = functools.partial(attention_reference, mask=mask, return_lse=True)
        want = [
            np.asarray(x) for x in run(lambda q, k, v, sinks: ref(q, k, v, sinks_H=sinks), *f64)
        ]
    assert (np.asarray(got[0])[1, 30:] == 0).all() and np.isfinite(got[1]).all()
    np.testing.assert_allclose(np.asarray(got[1])[1, 30:], np.broadcast_to(sinks, (10, H)))
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, want, strict=True):
        err = np.abs(np.asarray(g, np.float64) - w).max() / np.abs(w).max()
        assert err < TOL[dtype], f"{name}: max error {err:.2e} relative to max |ref|"

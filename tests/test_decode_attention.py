"""The decode kernels (lab/kernels/attention/decode.py) against the float64 reference: both
Pallas kernels through the interpreter, and the CPU's C++ kernel (`cpu`, where it builds); the
TPU kernel compiled ahead of time for a v5e topology (Mosaic, needs libtpu) and the GPU kernel
for an H100 (Triton, needs the gpu-plan extra).

Product: kernel (tpu, gpu, cpu) × GQA ratio (1, 2, 4) × dtype (f32, bf16); every case has one
batch of ragged lengths — 1, the full cache, and lengths that are not block multiples — over
a cache of S = 200 slots, which is not a block multiple either (block_k 32: 6¼ blocks).
Slots past each length hold NaN: a kernel that reads or weighs them fails. The splits change
with the ratio so that 1, 3 and 4 parts are all exercised on both kernels.
"""

import dataclasses
import functools
import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab import quant
from lab.kernels import cpu_gemv
from lab.kernels.attention import decode, decode_attention

IMPLS = ("tpu", "gpu", "cpu")
needs_cpu_kernel = pytest.mark.skipif(not cpu_gemv.available(), reason="cpu kernel not built")


def impls():
    """The kernels under test, `cpu` skipped where its C++ library does not build."""
    return [pytest.param(i, marks=needs_cpu_kernel) if i == "cpu" else i for i in IMPLS]


# max |kernel - f64 reference| / max |reference|, per input dtype. Both sides start from the
# same rounded inputs, so what differs is the kernel's own rounding. f32: sums of <= 200
# products at 2^-24 each; measured <= 1.1e-7 (float and int8 caches). bf16: two roundings to
# bf16 of at most 2^-9 relative each — the probabilities (times the value scales, for int8)
# fed to the P·V product, and the output — so at most 2^-8 = 3.9e-3 of max |ref|; measured
# <= 1.2e-3 with bf16 caches, <= 3.5e-3 with int8 caches (there the largest outputs, the
# length-1 rows, are dequantised values that bf16 cannot hold exactly). 1e-2 leaves margin.
TOL = {"float32": 1e-5, "bfloat16": 1e-2}
B, G_MAX, S, K = 4, 2, 200, 64  # kv heads G = 2; query heads H = G · ratio
LENGTHS = (1, S, 37, 130)  # one, full, and two that end inside a block
BLOCK_K = 32  # interpret mode: small blocks so S = 200 spans several and ends in a partial one
SPLITS = {1: 1, 2: 3, 4: 4}  # ratio → num_splits: every path of split_range on both kernels


@dataclasses.dataclass(frozen=True)
class Case:
    impl: str
    ratio: int
    dtype: str

    def __str__(self):
        return f"{self.impl}-r{self.ratio}-{self.dtype}"


CASES = [
    pytest.param(c, marks=needs_cpu_kernel) if c.impl == "cpu" else c
    for c in (Case(*c) for c in itertools.product(IMPLS, (1, 2, 4), TOL))
]


def kernel(impl: str, splits: int):
    if impl == "cpu":  # no blocks or splits: one (batch, kv head) per part, its slots whole
        return decode.decode_attention_cpu
    if impl == "tpu":
        bs = decode.BlockSizesTPU(block_k=BLOCK_K, num_splits=splits)
        return functools.partial(decode.decode_attention_tpu, block_sizes=bs, interpret=True)
    bs = decode.BlockSizesGPU(block_k=BLOCK_K, num_splits=splits)
    return functools.partial(decode.decode_attention_gpu, block_sizes=bs, interpret=True)


def random_inputs(seed: int, ratio: int, dtype, lengths=LENGTHS, garbage=jnp.nan):
    """Normal q, k, v (never zeros); cache slots past each length set to `garbage`. Drawn
    and masked on the host: on the device each new shape compiled its own programs."""
    rng, G, dt = np.random.default_rng(seed), G_MAX, jnp.dtype(dtype)
    q = rng.standard_normal((B, G * ratio, K), np.float32)
    k, v = (rng.standard_normal((B, G, S, K), np.float32) for _ in range(2))
    lengths = np.asarray(lengths, np.int32)
    valid = (np.arange(S)[None, :] < lengths[:, None])[:, None, :, None]
    k, v = (np.where(valid, x, np.float32(garbage)) for x in (k, v))
    return (*(jnp.asarray(x.astype(dt)) for x in (q, k, v)), jnp.asarray(lengths))


@functools.partial(jax.jit, static_argnames="window")
def _reference_jit(q, k, v, lengths, k_scale=None, v_scale=None, window=None):
    return decode.decode_attention_reference(q, k, v, lengths, k_scale, v_scale, window=window)


def reference_f64(q, k, v, lengths, k_scale=None, v_scale=None, window=None):
    """The reference in float64 from the same (rounded) inputs; int8 caches stay int8."""
    with jax.enable_x64(True):
        f64 = lambda x: None if x is None else jnp.asarray(np.asarray(x, np.float64))
        k, v = (x if x.dtype == jnp.int8 else f64(x) for x in (k, v))
        args = (f64(q), k, v, lengths, f64(k_scale), f64(v_scale))
        return np.asarray(_reference_jit(*args, window=window))


def relative_error(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_matches_float64_reference(case: Case):
    seed = zlib.crc32(str(case).encode())  # fresh per case, reproducible
    q, k, v, lengths = random_inputs(seed, case.ratio, case.dtype)
    got = kernel(case.impl, SPLITS[case.ratio])(q, k, v, lengths)
    assert got.shape == q.shape and got.dtype == q.dtype
    want = reference_f64(q, k, v, lengths)
    assert np.isfinite(want).all()
    err = relative_error(got, want)
    assert err < TOL[case.dtype], f"max error {err:.2e} relative to max |ref|"


@pytest.mark.parametrize("impl", impls())
@pytest.mark.parametrize("dtype", list(TOL))
def test_int8_cache_matches_reference(impl: str, dtype: str):
    """int8 k/v with per-(token, head) scales, dequantised inside the kernel. Against the
    reference on the *same* int8 cache (the quantization error is test_quant.py's business);
    scales past the length are NaN."""
    q, k, v, lengths = random_inputs(11, 2, jnp.float32, garbage=0.0)
    (k_i8, k_scale), (v_i8, v_scale) = quant.quantize_kv(k), quant.quantize_kv(v)
    invalid = (jnp.arange(S)[None, :] >= lengths[:, None])[:, None, None, :]
    k_scale, v_scale = (jnp.where(invalid, jnp.nan, s) for s in (k_scale, v_scale))
    q = q.astype(dtype)
    got = kernel(impl, 3)(q, k_i8, v_i8, lengths, k_scale, v_scale)
    want = reference_f64(q, k_i8, v_i8, lengths, k_scale, v_scale)
    err = relative_error(got, want)
    assert err < TOL[dtype], f"max error {err:.2e} relative to max |ref|"


def test_reference_against_a_plain_loop():
    """The reference itself, against numpy one sequence and head at a time (float64)."""
    q, k, v, lengths = random_inputs(3, 2, jnp.float32)
    want = reference_f64(q, k, v, lengths)
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    for b, h in itertools.product(range(B), range(q.shape[1])):
        n, g = int(lengths[b]), h // 2
        s = k[b, g, :n] @ q[b, h] / np.sqrt(K)
        p = np.exp(s - s.max())
        np.testing.assert_allclose(want[b, h], p @ v[b, g, :n] / p.sum(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", impls())
def test_empty_and_overlong_lengths(impl: str):
    """Length 0 gives zeros; a length past the cache is the whole cache."""
    q, k, v, _ = random_inputs(5, 1, jnp.float32, lengths=(S,) * B)
    fn = kernel(impl, 2)
    out = fn(q, k, v, jnp.array([0, S, S + 50, 7], jnp.int32))
    full = fn(q, k, v, jnp.full((B,), S, jnp.int32))
    assert (np.asarray(out[0]) == 0).all()
    np.testing.assert_allclose(out[2], full[2], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", impls())
def test_sliding_window_sees_only_the_last_slots(impl: str):
    """window=40 (Mistral's local attention at decode): the last 40 valid slots of each
    sequence; slots before the window hold NaN like those past the length, so a kernel that
    reads them fails. Lengths 1 and 37 fit the window whole; 130 starts it inside a block
    (slot 90), the full cache at a block edge (160); 3 splits share the window's blocks."""
    q, k, v, lengths = random_inputs(21, 2, jnp.float32)
    W = 40
    seen = (jnp.arange(S)[None, :] >= lengths[:, None] - W)[:, None, :, None]
    k, v = (jnp.where(seen, x, jnp.nan) for x in (k, v))
    fn = kernel(impl, 3)
    bs = fn.keywords["block_sizes"] if impl != "cpu" else None
    got = decode_attention(  # through the dispatch, as lab.serve calls it
        q,
        k,
        v,
        lengths,
        impl="cpu" if impl == "cpu" else f"pallas_{impl}",
        window=W,
        interpret=impl != "cpu",
        block_sizes=bs,
    )
    want = reference_f64(q, k, v, lengths, window=W)
    assert np.isfinite(want).all()
    assert relative_error(got, want) < TOL["float32"]
    # the window is a real restriction: without it the answer differs (and reads NaN)
    with jax.enable_x64(True):
        f64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]
        nowin = decode.decode_attention_reference(*f64, lengths)
    assert np.isnan(np.asarray(nowin)[2:]).any()
    with pytest.raises(ValueError, match="window=0: must be a positive int"):
        fn(q, k, v, lengths, window=0)


@pytest.mark.parametrize("impl, dtype", [("tpu", "float32"), ("gpu", "bfloat16")])
def test_softcap_matches_float64_reference(impl: str, dtype: str):
    """Soft-capped logits (Gemma 2: cap·tanh(s / cap)) in both kernels, through the dispatch
    as lab.serve calls it, with a window too; q scaled up so that the cap bends the logits
    (without it the answer differs by far more than the tolerance)."""
    q, k, v, lengths = random_inputs(zlib.crc32(f"cap{impl}{dtype}".encode()), 2, dtype)
    q = (q.astype(jnp.float32) * 6).astype(dtype)
    bs = kernel(impl, 3).keywords["block_sizes"]
    kw = dict(impl=f"pallas_{impl}", window=150, interpret=True, block_sizes=bs)
    got = decode_attention(q, k, v, lengths, softcap=5.0, **kw)
    with jax.enable_x64(True):
        f64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]
        want = decode.decode_attention_reference(*f64, lengths, window=150, softcap=5.0)
        uncapped = decode.decode_attention_reference(*f64, lengths, window=150)
        want, uncapped = np.asarray(want), np.asarray(uncapped)
    assert np.isfinite(want).all()
    assert relative_error(got, want) < TOL[dtype]
    assert relative_error(uncapped, want) > 10 * TOL[dtype]


def test_splits_default_fills_the_gpu():
    bs = decode.BlockSizesGPU()
    assert bs.splits_for(batch=1, kv_heads=8, n_blocks=1000) == 33  # 8 · 33 >= 264
    assert bs.splits_for(batch=64, kv_heads=8, n_blocks=1000) == 1
    assert bs.splits_for(batch=1, kv_heads=1, n_blocks=5) == 5  # never more than the blocks
    assert decode.BlockSizesGPU(num_splits=4).splits_for(1, 1, 1000) == 4


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {**a, "q": a["q"][:, None]}, "expected q"),
        (lambda a: {**a, "q": a["q"][:, :3]}, "multiple of kv heads"),
        (lambda a: {**a, "v": a["v"][:, :, :10]}, "caches must match"),
        (lambda a: {**a, "k": a["k"][:, :, :0], "v": a["v"][:, :, :0]}, "cache_len 0"),
        (lambda a: {**a, "lengths": a["lengths"].astype(jnp.float32)}, "expected integers"),
        (
            lambda a: {**a, "k": a["k"].astype(jnp.bfloat16), "v": a["v"].astype(jnp.bfloat16)},
            "the cache is q's dtype or int8",
        ),
        (
            lambda a: {**a, "k": a["k"].astype(jnp.int8), "v": a["v"].astype(jnp.int8)},
            "needs k_scale of floats",
        ),
        (lambda a: {**a, "k_scale": jnp.ones((B, G_MAX, 1, S))}, "only for an int8 cache"),
        (lambda a: {**a, "k": a["k"][:, :0], "v": a["v"][:, :0]}, "heads and head_dim"),
        (lambda a: {**a, "q": a["q"][..., :0]}, "heads and head_dim"),
    ],
)
def test_bad_inputs_raise_naming_the_shape(change, match):
    q, k, v, lengths = random_inputs(1, 2, jnp.float32)
    args = change({"q": q, "k": k, "v": v, "lengths": lengths, "k_scale": None})
    for fn in (decode.decode_attention_reference, kernel("tpu", 1), kernel("gpu", 1)):
        with pytest.raises(ValueError, match=match):
            fn(args["q"], args["k"], args["v"], args["lengths"], args["k_scale"], None)


@pytest.mark.parametrize("cap", [0.0, -1.0, float("nan")])
def test_the_reference_called_directly_refuses_a_cap_that_is_not_positive(cap):
    """A cap of 0 makes every score 0 and -1 acts as +1: refused, as the dispatch does."""
    q, k, v, lengths = random_inputs(1, 2, jnp.float32)
    with pytest.raises(ValueError, match="softcap="):
        decode.decode_attention_reference(q, k, v, lengths, softcap=cap)


def test_kernel_limits():
    q, k, v, lengths = random_inputs(1, 2, jnp.float16)
    with pytest.raises(ValueError, match="decode_attention_tpu supports dtypes float32, bfloat16"):
        kernel("tpu", 1)(q, k, v, lengths)
    q, k, v, lengths = (x[..., :48] if x.ndim > 1 else x for x in random_inputs(1, 1, "float32"))
    with pytest.raises(ValueError, match="supports head_dim"):
        kernel("tpu", 1)(q, k, v, lengths)
    with pytest.raises(ValueError, match="multiple of 128"):
        decode.decode_attention_tpu(
            *random_inputs(1, 1, jnp.float32), block_sizes=decode.BlockSizesTPU(block_k=64)
        )


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: decode.BlockSizesTPU(block_k=12), "BlockSizesTPU.block_k=12"),
        (lambda: decode.BlockSizesTPU(num_splits=0), "BlockSizesTPU.num_splits=0"),
        (lambda: decode.BlockSizesGPU(block_k=48), "BlockSizesGPU.block_k=48"),
        (lambda: decode.BlockSizesGPU(num_warps=3), "BlockSizesGPU.num_warps=3"),
        (lambda: decode.BlockSizesGPU(num_splits=-1), "BlockSizesGPU.num_splits=-1"),
        (lambda: decode.BlockSizesGPU(num_stages=0), "BlockSizesGPU.num_stages=0"),
    ],
)
def test_block_sizes_validate_themselves(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ---------------------------------------------------------------------------- ahead of time


def _tpu_mesh():
    pytest.importorskip("libtpu", reason="libtpu not installed: pip install 'jax[tpu]'")
    from lab import plans

    devices = plans.topology_devices("tpu:v5e:2x2")
    return jax.sharding.Mesh(np.array(devices).reshape(2, 2), ("data", "model"))


@pytest.mark.parametrize(
    "dtype, ratio, seq, block_k, splits, int8",
    [
        (jnp.bfloat16, 4, 4096, 512, 1, False),  # the default tiles
        (jnp.float32, 1, 1000, 256, 2, False),  # S not a block multiple; 2 splits (megacore)
        (jnp.bfloat16, 2, 2048, 512, 1, True),  # int8 cache, scales [B, G, 1, S]
    ],
)
def test_tpu_kernel_compiles_for_v5e(dtype, ratio, seq, block_k, splits, int8):
    """Mosaic compile for a v5e 2x2 slice on this CPU machine (compiled, not run). Under a
    multi-device mesh the kernel sits in shard_map: batch over `data`, kv heads over
    `model` (XLA cannot partition a Mosaic custom call)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _tpu_mesh()
    Bc, Gc, Kc = 4, 4, 128
    q_spec, kv_spec, len_spec = P("data", "model", None), P("data", "model", None, None), P("data")
    fn = functools.partial(
        decode.decode_attention_tpu, block_sizes=decode.BlockSizesTPU(block_k, splits)
    )
    specs = (q_spec, kv_spec, kv_spec, len_spec) + ((kv_spec, kv_spec) if int8 else ())
    sharded = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)

    def arg(shape, dt, spec):
        return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))

    cache = arg((Bc, Gc, seq, Kc), jnp.int8 if int8 else dtype, kv_spec)
    args = [arg((Bc, Gc * ratio, Kc), dtype, q_spec), cache, cache, arg((Bc,), jnp.int32, len_spec)]
    if int8:
        args += [arg((Bc, Gc, 1, seq), jnp.float32, kv_spec)] * 2
    lowered = jax.jit(sharded).lower(*args)
    assert "decode_attention_tpu" in lowered.as_text()  # the Mosaic custom call is there
    compiled = lowered.compile()
    assert "tpu_custom_call" in compiled.as_text()
    assert compiled.memory_analysis() is not None


def test_gpu_kernel_compiles_for_h100():
    """Compiled (Triton → PTX → cubin by ptxas) for an H100 (lab/plans), an int8 cache with
    bf16 queries, its resources read back: no spill, shared memory within the SM's limit."""
    from lab.plans import gpu as gpus

    if gpus._pjrt() is None or gpus.ptxas() is None:
        pytest.skip("the CUDA plugin or ptxas is missing: pip install -e '.[gpu-plan]'")
    from lab import plans

    devices = plans.topology_devices("gpu:h100:1")
    mesh = jax.sharding.Mesh(devices, ("x",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    Bc, Gc, Rc, Sc, Kc = 2, 4, 4, 1000, 128
    args = [jax.ShapeDtypeStruct((Bc, Gc * Rc, Kc), jnp.bfloat16, sharding=rep)]
    args += [jax.ShapeDtypeStruct((Bc, Gc, Sc, Kc), jnp.int8, sharding=rep)] * 2
    args += [jax.ShapeDtypeStruct((Bc,), jnp.int32, sharding=rep)]
    args += [jax.ShapeDtypeStruct((Bc, Gc, 1, Sc), jnp.float32, sharding=rep)] * 2

    def lower():
        with jax.sharding.set_mesh(mesh):
            return jax.jit(decode.decode_attention_gpu).lower(*args)

    _, kernels = plans.compile_plan(lower, devices)
    (k,) = [k for k in kernels if k.name.startswith("decode_attention_gpu")]
    assert k.spill_bytes == 0 and 0 < k.smem <= gpus.GPUS["h100"].smem_per_block, k


def test_a_length_past_the_cache_is_the_whole_cache_under_a_window_too():
    """The reference clamps each length to the cache before it places the window, as the
    kernels do: a length of S + 6 with window 8 sees the cache's last 8 slots."""
    q, k, v, _ = random_inputs(8, 2, jnp.float32, lengths=(S,) * B)
    long = jnp.array([S, S + 6, 40, S + 500], jnp.int32)
    clamped = jnp.minimum(long, S)
    got = decode.decode_attention_reference(q, k, v, long, window=8)
    want = reference_f64(q, k, v, clamped, window=8)
    assert relative_error(got, want) < TOL["float32"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"softcap": 0.0}, "softcap=0.0: must be a positive number"),
        ({"softcap": float("inf")}, "softcap=inf: must be finite"),
        ({"impl": "pallas"}, "decode impl='pallas' has no compiled kernel on backend 'cpu'"),
        ({"impl": "refrence"}, "did you mean reference?"),
        ({"impl": "reference", "block_sizes": decode.BlockSizesTPU()}, "has no tiles to size"),
    ],
)
def test_the_dispatch_refuses_what_no_kernel_takes(kwargs, match):
    q, k, v, lengths = random_inputs(2, 2, jnp.float32)
    with pytest.raises(ValueError, match=match):
        decode_attention(q, k, v, lengths, **kwargs)
    with pytest.raises(
        ValueError, match=r"lengths shape=\(3,\) dtype=int(32|64): expected integers \[4\]"
    ):
        decode_attention(q, k, v, [1, 2, 3], impl="reference")
    assert decode.check_window(np.int64(5)) == 5  # a NumPy integer is an int
    # under auto, tiles tuned for another backend's kernel are left out, not refused
    got = decode_attention(q, k, v, lengths, block_sizes=decode.BlockSizesTPU())
    want = decode_attention(q, k, v, lengths)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _decode_impls_here():
    """Every decode implementation that runs on CPU: (impl, interpret)."""
    out = [("reference", False), ("auto", False), ("pallas_tpu", True), ("pallas_gpu", True)]
    return out + ([("cpu", False)] if cpu_gemv.available() else [])


@pytest.mark.parametrize("impl, interpret", _decode_impls_here())
def test_integer_lengths_of_any_dtype_are_read_as_int32(impl, interpret):
    """One rule for every implementation: lengths of any integer dtype (NumPy's default int64,
    a list of ints) are read as int32, a length past the cache (even one int32 cannot hold)
    is the whole cache; a non-integer dtype is refused in one line."""
    q, k, v, lengths = random_inputs(31, 2, jnp.float32)
    want = reference_f64(q, k, v, lengths)
    kw = dict(impl=impl, interpret=interpret)
    if interpret:
        kw["block_sizes"] = kernel(impl[-3:], 1).keywords["block_sizes"]
    wide = np.asarray(lengths, np.int64)
    wide[1] = 2**40  # a length past the cache: the whole cache, as S
    for given in (
        np.asarray(lengths, np.int64),
        wide,
        list(map(int, lengths)),
        lengths.astype(jnp.int16),
    ):
        got = decode_attention(q, k, v, given, **kw)
        assert relative_error(got, want) < TOL["float32"], type(given)
    for bad in (np.asarray(lengths, np.float32), [1.0, 2.0, 3.0, 4.0], np.ones(B, bool)):
        with pytest.raises(ValueError, match=r"^lengths shape=\(4,\) dtype=\w+: expected integers"):
            decode_attention(q, k, v, bad, **kw)


def test_a_pallas_kernel_on_cpu_names_every_kernel_that_runs_here():
    """Refusing a GPU/TPU decode kernel on CPU lists the kernels that run here, auto and the
    native C++ one (the default) included, as attention's impl='pallas' refusal does."""
    q, k, v, lengths = random_inputs(4, 2, jnp.float32)
    here = "auto, cpu, reference" if cpu_gemv.available() else "auto, reference"
    for impl in ("pallas_gpu", "pallas_tpu", "pallas"):
        with pytest.raises(ValueError, match=f"on backend 'cpu': use {here} "):
            decode_attention(q, k, v, lengths, impl=impl)


@pytest.mark.parametrize("flag", ["yes", None, 1])
def test_decode_interpret_must_be_a_bool(flag):
    q, k, v, lengths = random_inputs(5, 2, jnp.float32)
    with pytest.raises(ValueError, match=f"^interpret={flag!r}: must be True or False"):
        decode_attention(q, k, v, lengths, impl="reference", interpret=flag)

"""int8 weight-only / W8A8 einsums and the int8 KV cache against float64, with the error
bounds derived in lab/quant.py's docstring checked on data (the worst case always, the typical
relative RMS error within 20 % of its prediction crest/440)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab import quant
from lab.kernels import cpu_gemv
from lab.kernels.attention import decode

# The lab's projections (lab/model.py): q/k/v in, output out (two contracted axes), MLP.
EINSUMS = [
    ("bld,dhk->blhk", (2, 16, 256), (256, 4, 64)),
    ("blhk,hkd->bld", (2, 16, 4, 64), (4, 64, 256)),
    ("bld,df->blf", (2, 16, 256), (256, 512)),
]


def f64(x):
    return np.asarray(x, np.float64)


def contracted_axes(eqn: str):
    w_subs, out = eqn.split(",")[1].split("->")
    return [i for i, c in enumerate(w_subs) if c not in out]


def random_xw(seed: int, x_shape, w_shape):
    kx, kw = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, x_shape), 0.02 * jax.random.normal(kw, w_shape)


@pytest.mark.parametrize("axis", [0, (0,), (0, 1), -1])
def test_quantize_int8_round_trip(axis):
    x = jax.random.normal(jax.random.key(0), (32, 8, 16)) * jnp.arange(1, 17)  # uneven channels
    x = x.at[:, 3, 5].set(0.0)  # an all-zero channel when axis=0
    x_i8, scale = quant.quantize_int8(x, axis)
    assert x_i8.dtype == jnp.int8 and scale.dtype == jnp.float32
    axes = {a % 3 for a in ((axis,) if isinstance(axis, int) else axis)}
    assert scale.shape == tuple(1 if i in axes else n for i, n in enumerate(x.shape))
    assert int(jnp.abs(x_i8.astype(jnp.int32)).max()) <= 127  # symmetric: never -128
    err = np.abs(f64(quant.dequantize_int8(x_i8, scale)) - f64(x))
    assert (err <= f64(scale) / 2 * (1 + 1e-6)).all()  # |e| <= scale / 2, every element
    assert np.isfinite(f64(scale)).all()


@pytest.mark.parametrize("eqn, x_shape, w_shape", EINSUMS)
def test_weight_only_einsum(eqn, x_shape, w_shape):
    """Exactly the einsum of the dequantised weight (the scale factors out of the sum), and
    within the derived error of the float weight."""
    x, w = random_xw(1, x_shape, w_shape)
    w_i8, w_scale = quant.quantize_int8(w, contracted_axes(eqn))
    got = f64(quant.int8_einsum(eqn, x, w_i8, w_scale))
    same = np.einsum(eqn, f64(x), f64(quant.dequantize_int8(w_i8, w_scale)))
    np.testing.assert_allclose(got, same, rtol=1e-5, atol=1e-5 * np.abs(same).max())
    want = np.einsum(eqn, f64(x), f64(w))
    # worst case: |y' - y| <= Σ_d |x_d| · s_c / 2 (the same einsum on |x| and s / 2)
    bound = np.einsum(eqn, np.abs(f64(x)), np.broadcast_to(f64(w_scale) / 2, w.shape))
    assert (np.abs(got - want) <= bound * (1 + 1e-5) + 1e-6).all()
    # typical: relative RMS error = mean crest / 440 within 20 %
    axes = contracted_axes(eqn)
    w_cols = np.moveaxis(f64(w), axes, range(len(axes))).reshape(
        -1, w.size // np.prod([w.shape[a] for a in axes])
    )
    crest = (np.abs(w_cols).max(0) / np.sqrt((w_cols**2).mean(0))).mean()
    rel_rms = np.sqrt(((got - want) ** 2).mean() / (want**2).mean())
    assert 0.8 < rel_rms / (crest / 440) < 1.2, (rel_rms, crest / 440)


@pytest.mark.parametrize("eqn, x_shape, w_shape", EINSUMS)
def test_w8a8_einsum_int32_accumulation(eqn, x_shape, w_shape):
    """int8 × int8 → int32 is exact: equal to the einsum of both dequantised operands."""
    x, w = random_xw(2, x_shape, w_shape)
    w_i8, w_scale = quant.quantize_int8(w, contracted_axes(eqn))
    got = f64(quant.int8_einsum(eqn, x, w_i8, w_scale, activations="int8"))
    x_axes = [i for i, c in enumerate(eqn.split(",")[0]) if c not in eqn.split("->")[1]]
    x_i8, x_scale = quant.quantize_int8(x, x_axes)
    same = np.einsum(
        eqn, f64(quant.dequantize_int8(x_i8, x_scale)), f64(quant.dequantize_int8(w_i8, w_scale))
    )
    np.testing.assert_allclose(got, same, rtol=1e-5, atol=1e-5 * np.abs(same).max())
    want = np.einsum(eqn, f64(x), f64(w))
    rel_rms = np.sqrt(((got - want) ** 2).mean() / (want**2).mean())
    assert rel_rms < 0.02, rel_rms  # ≈ √(crest_w² + crest_x²) / 440 ≈ 1.0e-2 here
    hlo = (
        jax.jit(functools.partial(quant.int8_einsum, eqn, activations="int8"))
        .lower(x, w_i8, w_scale)
        .as_text()
    )
    dots = [line.replace(" ", "") for line in hlo.splitlines() if "dot_general" in line]
    assert len(dots) == 1 and dots[0].count("xi8>") == 2 and "xi32>" in dots[0], dots


def test_bf16_activations_keep_their_dtype_and_dot():
    x, w = random_xw(3, (2, 16, 256), (256, 4, 64))
    w_i8, w_scale = quant.quantize_int8(w, 0)
    fn = functools.partial(quant.int8_einsum, "bld,dhk->blhk")
    y = fn(x.astype(jnp.bfloat16), w_i8, w_scale)
    assert y.dtype == jnp.bfloat16
    hlo = jax.jit(fn).lower(x.astype(jnp.bfloat16), w_i8, w_scale).as_text()
    dots = [line for line in hlo.splitlines() if "dot_general" in line]
    assert len(dots) == 1 and dots[0].replace(" ", "").count("xbf16>") == 2, dots  # bf16 dot
    want = np.einsum("bld,dhk->blhk", f64(x), f64(w))
    assert np.abs(f64(y) - want).max() / np.abs(want).max() < 2e-2  # int8 + bf16 rounding


def test_quantize_params_and_errors():
    params = {"attn": {"wq": jnp.ones((8, 2, 4))}, "norm": jnp.ones((8,))}
    q = quant.quantize_params(params)
    wq = q["attn"]["wq"]
    assert wq.q.dtype == jnp.int8 and wq.scale.shape == (1, 2, 4)  # one per output channel
    assert q["norm"] is params["norm"]
    stacked = quant.quantize_params({"wq": jnp.ones((3, 8, 2, 4))})["wq"]  # scan_layers
    assert stacked.scale.shape == (3, 1, 2, 4)
    x = jnp.ones((1, 3, 8))
    with pytest.raises(ValueError, match="one scale per output channel"):
        quant.int8_einsum("bld,dhk->blhk", x, wq.q, jnp.ones((8, 1, 1)))
    with pytest.raises(ValueError, match="choose 'float'"):
        quant.int8_einsum("bld,dhk->blhk", x, wq.q, wq.scale, activations="int4")
    with pytest.raises(ValueError, match="expected int8"):
        quant.int8_einsum("bld,dhk->blhk", x, wq.scale * jnp.ones((8, 2, 4)), wq.scale)


def test_einsum_shapes_a_user_gets_wrong_are_named():
    wq = quant.quantize_params({"wq": jnp.ones((8, 2, 4))})["wq"]
    x = jnp.ones((1, 3, 8))
    with pytest.raises(ValueError, match="expected two operands and an output"):
        quant.int8_einsum("bld,dhk", x, wq.q, wq.scale)
    with pytest.raises(ValueError, match="axis 'd' differs between x and the weight"):
        quant.int8_einsum("bld,dhk->blhk", jnp.ones((1, 3, 5)), wq.q, wq.scale)
    with pytest.raises(ValueError, match="its rank does not match 'bld'"):
        quant.int8_einsum("bld,dhk->blhk", jnp.ones((3, 8)), wq.q, wq.scale)


def test_a_channel_holding_nan_reads_back_as_nan():
    """A NaN in a channel gives that channel a NaN scale, so dequantising it, or a product
    through it, is NaN: never codes made up with a scale of 1. Other channels keep theirs."""
    x = jax.random.normal(jax.random.key(3), (4, 3)).at[1, 2].set(jnp.nan)
    x_i8, scale = quant.quantize_int8(x, axis=0)  # one scale per column
    back = quant.dequantize_int8(x_i8, scale)
    assert np.isnan(back[:, 2]).all() and not np.isnan(back[:, :2]).any()
    # at a cache's size too, where XLA:CPU's max reduction no longer returns the NaN
    _, k, _, _ = kv_inputs(B=2, S=256)
    k_i8, k_scale = quant.quantize_kv(k.at[1, 0, 7, 5].set(jnp.nan))
    back = np.asarray(quant.dequantize_kv(k_i8, k_scale))
    assert np.isnan(back[1, 0, 7]).all() and np.isnan(back).sum() == back.shape[-1]


# ---------------------------------------------------------------------------- KV cache


def kv_inputs(seed=4, B=3, G=2, R=4, S=96, K=64):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (B, G * R, K))
    k = jax.random.normal(kk, (B, G, S, K))
    v = jax.random.normal(kv, (B, G, S, K))
    return q, k, v, jnp.array([1, 50, S], jnp.int32)[:B]


def test_kv_layout_and_round_trip():
    _, k, _, _ = kv_inputs()
    k_i8, scale = quant.quantize_kv(k)
    assert k_i8.shape == k.shape and k_i8.dtype == jnp.int8
    assert scale.shape == (k.shape[0], k.shape[1], 1, k.shape[2])  # decode's [B, G, 1, S]
    err = np.abs(f64(quant.dequantize_kv(k_i8, scale)) - f64(k))
    assert (err <= f64(jnp.swapaxes(scale, 2, 3)) / 2 * (1 + 1e-6)).all()


def test_write_kv_updates_one_slot_per_sequence():
    _, k, _, _ = kv_inputs()
    k_i8, scale = quant.quantize_kv(k)
    new = jax.random.normal(jax.random.key(9), (k.shape[0], k.shape[1], k.shape[3]))
    pos = jnp.array([0, 17, k.shape[2] - 1], jnp.int32)
    k2_i8, scale2 = quant.write_kv(k_i8, scale, new, pos)
    want_i8, want_scale = quant.quantize_kv(k.at[jnp.arange(3), :, pos].set(new))
    np.testing.assert_array_equal(k2_i8, want_i8)
    np.testing.assert_array_equal(scale2, want_scale)


def test_write_kv_refuses_a_slot_outside_the_cache_and_shapes_that_differ():
    """A position it knows (concrete) outside 0..S-1 would be clamped onto the last slot,
    and a token narrower than the cache would leave stale codes: each is a ValueError."""
    _, k, _, _ = kv_inputs()
    k_i8, scale = quant.quantize_kv(k)
    B, G, S, K = k.shape
    new = jax.random.normal(jax.random.key(9), (B, G, K))
    for pos in ([0, 1, S], [-1, 0, 1]):
        with pytest.raises(ValueError, match=f"positions must be integers in 0..{S - 1}"):
            quant.write_kv(k_i8, scale, new, jnp.array(pos, jnp.int32))
    with pytest.raises(ValueError, match="expected one token per sequence"):
        quant.write_kv(k_i8, scale, new[..., : K // 2], jnp.array([0, 1, 2], jnp.int32))
    with pytest.raises(ValueError, match="expected a cache"):
        quant.dequantize_kv(k_i8, jnp.swapaxes(scale, 2, 3))
    with pytest.raises(ValueError, match="it has no slot"):
        quant.write_kv(k_i8[:, :, :0], scale[..., :0], new, jnp.array([0, 0, 0], jnp.int32))
    # an empty batch writes nothing, as it did before the checks
    out, _ = quant.write_kv(k_i8[:0], scale[:0], new[:0], jnp.zeros((0,), jnp.int32))
    assert out.shape == (0, G, S, K)


@pytest.mark.parametrize("impl", ["reference", "tpu", "gpu", "cpu"])
def test_int8_cache_decode_error_within_bound(impl):
    """|o(int8 cache) - o(float cache)| <= quant.kv_error_bound for every (b, h)."""
    if impl == "cpu" and not cpu_gemv.available():
        pytest.skip("the CPU decode kernel is not built here")
    q, k, v, lengths = kv_inputs()
    (k_i8, ks), (v_i8, vs) = quant.quantize_kv(k), quant.quantize_kv(v)
    with jax.enable_x64(True):
        want = f64(
            decode.decode_attention_reference(*(jnp.asarray(f64(x)) for x in (q, k, v)), lengths)
        )
    fn = {
        "reference": decode.decode_attention_reference,
        "tpu": functools.partial(
            decode.decode_attention_tpu, block_sizes=decode.BlockSizesTPU(32, 2), interpret=True
        ),
        "gpu": functools.partial(
            decode.decode_attention_gpu, block_sizes=decode.BlockSizesGPU(32, 2), interpret=True
        ),
        "cpu": decode.decode_attention_cpu,
    }[impl]
    got = f64(fn(q, k_i8, v_i8, lengths, ks, vs))
    err_BxH = np.abs(got - want).max(-1)
    bound_BxH = f64(quant.kv_error_bound(q, k, v, lengths))
    assert (err_BxH <= bound_BxH + 1e-5).all(), (err_BxH / bound_BxH).max()
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < 0.03, rel  # measured ~1e-2 (int8 cache, K = 64, normal q/k/v)


def test_matches_qwix_weight_only_where_installed():
    """The same numbers as qwix's PTQ (absmax per channel) on a linen einsum: an independent
    implementation of the same scheme. Runs where qwix is installed (eval/ venvs)."""
    qwix = pytest.importorskip("qwix")
    import flax.linen as nn

    class Proj(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.normal(0.02), (256, 4, 64))
            return jnp.einsum("bld,dhk->blhk", x, w)

    x = jax.random.normal(jax.random.key(0), (2, 8, 256))
    params = Proj().init(jax.random.key(1), x)["params"]
    rules = [qwix.QuantizationRule(module_path=".*", weight_qtype=jnp.int8)]
    qmodel = qwix.quantize_model(Proj(), qwix.PtqProvider(rules))
    qparams = qwix.quantize_params(
        params, jax.eval_shape(qmodel.init, jax.random.key(1), x)["params"]
    )
    theirs = qmodel.apply({"params": qparams}, x)
    # qwix's convention: step = absmax / 127.5, codes clipped to [-128, 127]
    w = params["w"]
    step = jnp.abs(w).max(0, keepdims=True) / 127.5
    w_i8 = jnp.clip(jnp.round(w / step), -128, 127).astype(jnp.int8)
    same_scheme = quant.int8_einsum("bld,dhk->blhk", x, w_i8, step)
    np.testing.assert_allclose(same_scheme, theirs, rtol=1e-5, atol=1e-6)
    # ours (absmax / 127): the same error to within the 0.4 % step difference and noise
    want = f64(Proj().apply({"params": params}, x))
    ours = quant.int8_einsum("bld,dhk->blhk", x, *quant.quantize_int8(w, 0))
    rms = lambda y: np.sqrt(((f64(y) - want) ** 2).mean())
    assert 0.9 < rms(ours) / rms(theirs) < 1.1


@pytest.mark.parametrize("int8", [False, True])
def test_a_one_row_product_padded_to_two_rows_is_the_same_product(int8):
    """min_rows=2 (decoding on GPU): a batch-1 product runs on x padded with a zero row and
    gives exactly the one-row product; several rows are left alone."""
    kx, kw = jax.random.split(jax.random.key(3))
    w = jax.random.normal(kw, (64, 48), jnp.float32)
    w = quant.Int8Weight(*quant.quantize_int8(w, [0])) if int8 else w
    padded = quant.Matmuls(min_rows=2)
    for shape in [(1, 1, 64), (1, 64), (3, 1, 64)]:
        x = jax.random.normal(kx, shape, jnp.float32)
        eqn = "btd,df->btf" if len(shape) == 3 else "bd,df->bf"
        want = quant.matmul(eqn, x, w, jnp.float32)
        with quant.using(padded):
            got = quant.matmul(eqn, x, w, jnp.float32)
            product = functools.partial(quant.matmul, eqn, w=w, dtype=jnp.float32)
            jaxpr = str(jax.make_jaxpr(product)(x))
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        assert ("pad" in jaxpr) == (shape[0] == 1), jaxpr


def test_decoding_pads_one_row_products_on_gpu_only():
    """Whatever name the GPU plugin gives its platform, decoding there pads batch-1 products
    (quant.Matmuls.min_rows); on CPU and TPU it does not."""
    from lab import decode

    for platform, rows in [("gpu", 2), ("cuda", 2), ("rocm", 2), ("cpu", 1), ("tpu", 1)]:
        assert decode.matmuls("xla", platform).min_rows == rows, platform
    x = jnp.ones((1, 0, 8))  # no rows at all: nothing to pad
    with quant.using(quant.Matmuls(min_rows=2)):
        assert quant.matmul("btd,df->btf", x, jnp.ones((8, 4)), jnp.float32).shape == (1, 0, 4)

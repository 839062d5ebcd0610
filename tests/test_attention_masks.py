"""Masks and the scalar features of attention, every implementation against float64.

Mask kinds (lab.kernels.attention.common.Mask): packed sequences (segment ids), per-sequence
lengths, a sliding window, causal with more queries than keys (rows with no key give 0), and
their combination; scalar features: soft-capping, attention sinks, the log-sum-exp as an
output, a value head dim unlike the query/key one. Each case compares the output (and the
LSE) and the gradients of q, k, v (and of the sinks) with the float64 reference, on random
inputs whose lengths are not block multiples (72 rows against 16/32 tiles: padded, partial
and full tiles, empty ones skipped). Tolerances as tests/test_attention.py (f32 1e-5, bf16
2e-2, relative to the largest reference entry). Cases ported from peers' grids: splash's
packed segments with causal and a local window, FlashAttention's window (left, right) with
right > 0 and its causal L > S rows (zero output), tokamax's padded lengths with GQA.
Also here: block classification against the dense mask, and the one-line refusals.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab.kernels.attention import attention, blockwise, cpu_flash
from lab.kernels.attention.common import EMPTY, FULL, Mask
from lab.kernels.attention.reference import attention_reference
from lab.measure.timing import random_inputs

TOL = {"float32": 1e-5, "bfloat16": 2e-2}
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
B, H = 2, 4


def _segments(n: int, seed: int):
    """Packed documents: [B, n] ids rising at random boundaries (about one per 16 tokens)."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.cumsum(rng.random((B, n)) < 1 / 16, axis=1).astype(np.int32))


def _case(kind: str):
    """(shapes (L, S, G, D, Dv), the attention keyword arguments) of one mask kind."""
    sinks = jnp.asarray(np.random.default_rng(7).normal(size=H), jnp.float32)
    seg = _segments(72, 3)
    table = {
        "segments": ((72, 72, 2, 32, 32), dict(causal=True, q_segment_ids=seg)),
        "lengths": (
            (72, 72, 1, 32, 32),
            dict(causal=True, q_lengths=jnp.array([50, 72]), kv_lengths=jnp.array([41, 72])),
        ),
        "window": ((72, 72, 2, 32, 32), dict(causal=True, window=(17, 0))),
        "window_lr": ((72, 72, 4, 32, 32), dict(causal=False, window=(9, 5), return_lse=True)),
        "causal_short": ((40, 24, 2, 32, 32), dict(causal=True)),
        "sinks": ((72, 72, 2, 32, 32), dict(causal=True, sinks=sinks)),
        "value_dim": ((72, 72, 2, 32, 16), dict(causal=True, softcap=2.0)),
        "combo": (
            (72, 72, 2, 32, 16),
            dict(
                causal=True,
                q_segment_ids=seg,
                q_lengths=jnp.array([60, 72]),
                kv_lengths=jnp.array([55, 70]),
                window=(20, 0),
                softcap=3.0,
                sinks=sinks,
                return_lse=True,
            ),
        ),
    }
    return table[kind]


def _inputs(shapes, dtype):
    L, S, G, D, Dv = shapes
    # drawn on the host: a draw on the device compiles a program for every new shape
    dims = [(B, L, H, D), (B, S, G, D), (B, S, G, Dv), (B, L, H, Dv)]
    q, k, v, do = random_inputs(L + S + G + D + Dv, dims, dtype)
    (dlse,) = random_inputs(L + S + G + D + Dv + 1, [(B, L, H)])
    return q, k, v, do, dlse


def _run(fn, kwargs, q, k, v, do, dlse):
    """Outputs and cotangents of q, k, v (and sinks) of fn, one compiled program."""
    sinks = kwargs.get("sinks")
    rest = {name: x for name, x in kwargs.items() if name != "sinks"}

    def both(q, k, v, sinks, do, dlse):
        def f(q, k, v, sinks):
            return fn(q, k, v, **rest, **({} if sinks is None else {"sinks": sinks}))

        out, vjp = jax.vjp(f, q, k, v, sinks)
        grads = vjp((do, dlse) if rest.get("return_lse") else do)
        outs = out if isinstance(out, tuple) else (out,)
        return [*outs, *(g for g in grads if g is not None)]

    args = (q, k, v, sinks, do, dlse)
    return jax.jit(both).lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


def _reference(kwargs, q, k, v, do, dlse):
    def ref(
        q,
        k,
        v,
        *,
        causal,
        window=None,
        q_segment_ids=None,
        q_lengths=None,
        kv_lengths=None,
        sinks=None,
        **rest,
    ):
        mask = Mask.make(
            causal=causal,
            window=window,
            q_segment_ids=q_segment_ids,
            kv_segment_ids=q_segment_ids,
            q_lengths=q_lengths,
            kv_lengths=kv_lengths,
        )
        return attention_reference(q, k, v, causal=causal, mask=mask, sinks_H=sinks, **rest)

    with jax.enable_x64(True):
        f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))  # noqa: E731
        kw = dict(kwargs)
        if "sinks" in kw:
            kw["sinks"] = f64(kw["sinks"])
        got = _run(ref, kw, *(f64(x) for x in (q, k, v, do, dlse)))
        return [np.asarray(x) for x in got]


def assert_close(got, want, dtype: str, what: str):
    names = ["out", "lse", "dq", "dk", "dv", "dsinks"] if len(got) > 5 else None
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        g = np.asarray(g, np.float64)
        finite = np.isfinite(w)
        assert (np.isfinite(g) == finite).all(), f"{what} #{i}: -inf rows differ"
        err = np.abs(g[finite] - w[finite]).max() / np.abs(w[finite]).max()
        name = names[i] if names else f"#{i}"
        assert err < TOL[dtype], f"{what} {name}: max error {err:.2e} relative to max |ref|"


# Each feature at least once alone and all of them together (combo), f32; bf16 on combo.
CASES = [
    ("segments", "float32"),
    ("lengths", "float32"),
    ("window_lr", "float32"),
    ("causal_short", "float32"),
    ("value_dim", "float32"),
    ("sinks", "float32"),
    ("combo", "float32"),
    ("combo", "bfloat16"),
]


@pytest.mark.parametrize("kind, dtype", CASES, ids=lambda x: str(x))
def test_blockwise_matches_float64(kind, dtype):
    shapes, kwargs = _case(kind)
    q, k, v, do, dlse = _inputs(shapes, dtype)
    kw = dict(kwargs, impl="blockwise", block_sizes=blockwise.BlockSizes(16, 32))
    got = _run(attention, kw, q, k, v, do, dlse)
    assert_close(got, _reference(kwargs, q, k, v, do, dlse), dtype, f"blockwise {kind}")


@pytest.mark.parametrize("kind", ["combo"])
def test_naive_matches_float64_in_bfloat16(kind):
    """The naive implementation keeps P in f32 for P·V (rounding it to bf16 cost splash's
    bf16 gradient tolerance up to 7×)."""
    shapes, kwargs = _case(kind)
    q, k, v, do, dlse = _inputs(shapes, "bfloat16")
    got = _run(attention, dict(kwargs, impl="naive"), q, k, v, do, dlse)
    assert_close(got, _reference(kwargs, q, k, v, do, dlse), "bfloat16", f"naive {kind}")


@pytest.mark.parametrize("kind", ["lengths", "window"])
def test_xla_matches_float64(kind):
    shapes, kwargs = _case(kind)
    q, k, v, do, dlse = _inputs(shapes, "float32")
    got = _run(attention, dict(kwargs, impl="xla"), q, k, v, do, dlse)
    assert_close(got, _reference(kwargs, q, k, v, do, dlse), "float32", f"xla {kind}")


def _dense(mask: Mask, L: int, S: int):
    """The mask written out pair by pair from its definition (NumPy, independent of Mask)."""
    i, j = np.arange(L)[None, :, None], np.arange(S)[None, None, :]
    d = j - i - (S - L)
    ok = np.ones((B, L, S), bool)
    left, right = mask.window or (None, None)
    if mask.causal:
        ok &= d <= 0
    if left is not None:
        ok &= d >= -left
    if right is not None:
        ok &= d <= right
    if mask.q_lengths is not None:
        ok &= (i < mask.q_lengths[:, None, None]) & (j < mask.kv_lengths[:, None, None])
    if mask.segments:
        ok &= mask.q_segment_ids[:, :, None] == mask.kv_segment_ids[:, None, :]
    return ok


def test_block_map_is_exact_where_static_and_safe_with_segments():
    """Every tile classified against the mask written out: EMPTY only if no pair is
    visible, FULL only if every pair is; without segment ids the classification is exact."""
    rng = np.random.default_rng(0)
    for _ in range(60):
        L, S = (int(x) for x in rng.integers(1, 70, 2))
        bq, bk = int(rng.choice([8, 16])), int(rng.choice([8, 16, 32]))
        window = None
        if rng.integers(2):
            window = tuple(None if rng.integers(3) == 0 else int(rng.integers(0, 20)) for _ in "lr")
        kw = {}
        if rng.integers(2):
            kw["q_segment_ids"] = np.sort(rng.integers(0, 4, (B, L)), 1)
            kw["kv_segment_ids"] = np.sort(rng.integers(0, 4, (B, S)), 1)
        if rng.integers(2):
            kw["q_lengths"] = rng.integers(0, L + 1, (B,))
            kw["kv_lengths"] = rng.integers(0, S + 1, (B,))
        mask = Mask.make(causal=bool(rng.integers(2)), window=window, **kw)
        n_q, n_k = -(-L // bq), -(-S // bk)
        kind = np.broadcast_to(mask.block_map(L, S, bq, bk).kind, (B, n_q, n_k))
        dense = np.zeros((B, n_q * bq, n_k * bk), bool)
        dense[:, :L, :S] = _dense(mask, L, S)
        for b, i, j in itertools.product(range(B), range(n_q), range(n_k)):
            tile = dense[b, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            where = (mask, L, S, bq, bk, b, i, j)
            assert kind[b, i, j] != EMPTY or not tile.any(), where
            assert kind[b, i, j] != FULL or tile.all(), where
            if not mask.segments:
                assert (kind[b, i, j] == FULL) == tile.all(), where
                assert (kind[b, i, j] == EMPTY) == (not tile.any()), where


def test_block_map_lists_the_tiles_a_window_leaves():
    """A causal window of 1,024 keys at S = 8,192 in 256-tiles: each query block sees at most
    5 key blocks (4 partial-free ones and the diagonal), a small share of causal's 528."""
    causal = Mask.make(causal=True).block_map(8192, 8192, 256, 256)
    window = Mask.make(causal=True, window=(1023, 0)).block_map(8192, 8192, 256, 256)
    assert int(causal.kv_count.sum()) == 528
    assert int(window.kv_count.max()) == 5 and int(window.kv_count.sum()) == 32 * 5 - 4 - 3 - 2 - 1
    first = window.kv_blocks[0, 10, : window.kv_count[0, 10]]
    assert list(first) == [6, 7, 8, 9, 10]


@pytest.mark.parametrize(
    "impl, kwargs, needle",
    [
        ("xla", {"q_segment_ids": jnp.zeros((1, 32), jnp.int32)}, "does not support segment ids"),
        ("xla", {"softcap": 5.0}, "does not support logit soft-capping"),
        ("xla", {"return_lse": True}, "does not support return_lse=True"),
        ("blockwise", {"window": (3,)}, "window=(3,): expected (left, right)"),
        ("blockwise", {"q_lengths": jnp.zeros((2,), jnp.int32)}, "q_lengths.shape=(2,)"),
    ],
)
def test_features_an_impl_lacks_are_refused_in_one_line(impl, kwargs, needle):
    q = jnp.ones((1, 32, 2, 8))
    with pytest.raises(ValueError) as info:
        attention(q, q, q, impl=impl, **kwargs)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_xla_float16_on_cpu_is_refused_in_one_line():
    q = jnp.ones((1, 32, 2, 8), jnp.float16)
    with pytest.raises(ValueError, match="impl='xla' on CPU does not take float16") as info:
        jax.jit(lambda q: attention(q, q, q, impl="xla", causal=False))(q)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kind", ["combo", "window_lr", "causal_short", "causal_fewer"])
def test_ring_matches_float64(kind):
    """Ring attention over 4 devices: segment ids travel with their keys, global lengths
    become local ones, a window (causal, and open on both sides) becomes each step's static
    band, causal with more queries than keys (rows with no key give 0) and fewer, softcap,
    sinks and the LSE (combo: every feature at once)."""
    from lab.kernels.attention.ring import ring_attention

    if kind == "causal_fewer":  # 24 queries against 72 keys (the queries padded at the front)
        shapes, kwargs = (24, 72, 2, 32, 32), dict(causal=True, return_lse=True)
    else:
        shapes, kwargs = _case(kind)
    q, k, v, do, dlse = _inputs(shapes, "float32")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("model",))

    def ring(
        q, k, v, *, causal, q_segment_ids=None, q_lengths=None, kv_lengths=None, window=None, **rest
    ):
        mask = Mask.make(
            causal=causal,
            window=window,
            q_segment_ids=q_segment_ids,
            kv_segment_ids=q_segment_ids,
            q_lengths=q_lengths,
            kv_lengths=kv_lengths,
        )
        return ring_attention(
            q, k, v, mesh=mesh, seq_axis="model", causal=causal, mask=mask, **rest
        )

    got = _run(ring, kwargs, q, k, v, do, dlse)
    assert_close(got, _reference(kwargs, q, k, v, do, dlse), "float32", f"ring {kind}")


def test_ring_with_a_window_stops_early_and_skips_empty_blocks():
    """A causal window of 17 keys over 4 blocks of 18: each query block needs its own block
    and the one before, so the ring takes 1 step, not 3, and never the wrapped-around one."""
    from lab.kernels.attention.ring import _band

    mask = Mask.make(causal=True, window=(17, 0))
    C = 18
    assert _band(mask, 0, C) == (17, 0)
    assert _band(mask, -C, C) == (-1, 18)  # a block 18 keys earlier: local offsets 1..18
    assert [_band(mask, -t * C, C) for t in (2, 3)] == ["empty", "empty"]
    assert all(_band(mask, (4 - t) * C, C) == "empty" for t in (1, 2, 3))


def test_flops_count_only_the_tiles_the_mask_leaves():
    """A causal window of 1,024 at S = 8,192 in 256-tiles computes 150 tiles, packed causal
    documents of 1,024 8·(4·5/2) = 80, plain causal 528, of the 1,024 a full mask has."""
    from lab.kernels.attention.common import attention_tile_flops
    from lab.measure.cost import attention_flops

    def share(**kw):
        got = attention_tile_flops(Mask.make(**kw), 1, 2, 8192, 8192, 64, bq=256, bk=256)
        return got / attention_flops(1, 2, 8192, 8192, 64, causal=False)

    docs = np.repeat(np.arange(8, dtype=np.int32), 1024)[None]
    assert share(causal=False) == 1.0
    assert share(causal=True) == 528 / 1024
    assert share(causal=True, window=(1023, 0)) == 150 / 1024
    assert share(causal=True, q_segment_ids=docs, kv_segment_ids=docs) == 80 / 1024
    mask = Mask.make(causal=True)
    bwd = attention_tile_flops(mask, 1, 2, 512, 512, 64, bq=256, bk=256, backward=True)
    fwd = attention_tile_flops(mask, 1, 2, 512, 512, 64, bq=256, bk=256)
    assert bwd == 2.5 * fwd


def test_auto_on_cpu_takes_the_kernel_that_has_the_feature():
    """The native CPU kernel takes the masks, softcap and sinks but not the LSE as an output:
    auto keeps it for a window and sinks and falls back to blockwise for return_lse."""
    from lab.kernels.attention import choose

    q = jnp.ones((1, 32, 2, 8))
    assert choose("auto", q, q, q, features=frozenset({"lse"}), backend="cpu") == "blockwise"
    if not cpu_flash.available():
        return
    for needs in ({"window"}, {"sinks", "window"}):
        assert choose("auto", q, q, q, features=frozenset(needs), backend="cpu") == "cpu_flash"
    with pytest.raises(ValueError, match="impl='cpu_flash' does not support return_lse=True"):
        choose("cpu_flash", q, q, q, features=frozenset({"lse"}), backend="cpu")


CPU_FLASH_CASES = [
    ("segments", "float32"),
    ("lengths", "float32"),
    ("window_lr", "float32"),
    ("causal_short", "float32"),
    ("value_dim", "float32"),
    ("sinks", "float32"),
    ("combo", "float32"),
    ("combo", "bfloat16"),
]


@pytest.mark.skipif(not cpu_flash.available(), reason="the native CPU kernel is not built here")
@pytest.mark.parametrize("kind, dtype", CPU_FLASH_CASES, ids=lambda x: str(x))
def test_cpu_flash_matches_float64(kind, dtype):
    """The native kernel takes the masks, softcap and sinks (the sinks folded in around the
    C++ kernel through its log-sum-exp, their gradient checked too; not yet the LSE as an
    output or a value dim of its own: those are dropped from the case, the rest kept)."""
    shapes, kwargs = _case(kind)
    kwargs = {n: x for n, x in kwargs.items() if n != "return_lse"}
    L, S, G, D, _ = shapes
    q, k, v, do, dlse = _inputs((L, S, G, D, D), dtype)
    kw = dict(kwargs, impl="cpu_flash", block_sizes=cpu_flash.BlockSizes(32, 32))
    got = _run(attention, kw, q, k, v, do, dlse)
    assert_close(got, _reference(kwargs, q, k, v, do, dlse), dtype, f"cpu_flash {kind}")


def _as_lists(kwargs):
    """The case's mask arrays as Python lists (lengths) and tuples of lists (segment ids)."""
    out = dict(kwargs)
    for name in ("q_lengths", "kv_lengths"):
        if name in out:
            out[name] = [int(n) for n in out[name]]
    if "q_segment_ids" in out:
        out["q_segment_ids"] = tuple(np.asarray(out["q_segment_ids"]).tolist())
    return out


LIST_CASES = [
    ("naive", "lengths"),
    ("blockwise", "lengths"),
    ("blockwise", "combo"),
    ("xla", "lengths"),
    pytest.param(
        "cpu_flash",
        "lengths",
        marks=pytest.mark.skipif(not cpu_flash.available(), reason="cpu_flash not built"),
    ),
    ("auto", "lengths"),
]


@pytest.mark.parametrize("impl, kind", LIST_CASES)
def test_mask_arrays_given_as_python_lists(impl, kind):
    """Lengths and segment ids may be lists or tuples of ints, in every implementation: read
    as NumPy arrays, they give the float64 reference's output and gradients."""
    shapes, kwargs = _case(kind)
    q, k, v, do, dlse = _inputs(shapes, "float32")
    got = _run(attention, dict(_as_lists(kwargs), impl=impl), q, k, v, do, dlse)
    assert_close(got, _reference(kwargs, q, k, v, do, dlse), "float32", f"{impl} {kind}")


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(q_lengths=[50.5, 72.0]), r"^q_lengths.shape=\(2,\) dtype=float64: expected integers"),
        (dict(kv_lengths=(1, 2, 3)), r"^kv_lengths.shape=\(3,\) dtype=int64: expected integers"),
        (dict(kv_lengths=[[1], [2, 3]]), r"^kv_lengths=\[\[1\], \[2, 3\]\]: expected an integer"),
        (dict(kv_lengths=72), r"^kv_lengths.shape=\(\) dtype=int64: expected integers"),
        (dict(kv_lengths=[-3, 72]), r"^kv_lengths holds -3: a length is 0\.\.72 \(S, the keys"),
        (dict(q_lengths=np.array([100, 7])), r"^q_lengths holds 100: a length is 0\.\.72 \(L"),
    ],
)
def test_bad_mask_lists_are_one_line(kwargs, needle):
    q, k, v, _, _ = _inputs((72, 72, 2, 32, 32), "float32")
    for impl in ("naive", "blockwise", "auto"):
        with pytest.raises(ValueError, match=needle):
            attention(q, k, v, impl=impl, **kwargs)


def test_a_traced_length_past_its_bound_acts_as_the_bound():
    """Under jit a length is not known until the program runs: one past S reads as S, one
    below 0 as 0, in every implementation alike (as the docs say)."""
    q, k, v, _, _ = _inputs((72, 72, 2, 32, 32), "float32")
    for impl in ("naive", "blockwise", "xla", *(["cpu_flash"] if cpu_flash.available() else [])):
        run = jax.jit(lambda q, k, v, n, impl=impl: attention(q, k, v, impl=impl, kv_lengths=n))
        want = attention(q, k, v, impl=impl, kv_lengths=np.array([72, 0]))
        got = run(q, k, v, jnp.array([100, -3]))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("flag", ["causal", "return_lse", "interpret"])
@pytest.mark.parametrize("value", ["no", None, 0, 1.0, "False"])
def test_flags_must_be_bools(flag, value):
    """A flag's truthiness would pick the mode ('no' as True, None as False): every
    implementation refuses a non-bool in one line, and the chooser too."""
    from lab.kernels.attention import choose

    q, k, v, _, _ = _inputs((24, 24, 2, 32, 32), "float32")
    want = f"^{flag}={value!r}: must be True or False"  # interpret: or a params object
    for impl in ("naive", "blockwise", "xla", "auto", "ring"):
        with pytest.raises(ValueError, match=want.replace("(", r"\(").replace(".", r"\.")):
            attention(q, k, v, impl=impl, **{flag: value})
    if flag != "return_lse":
        with pytest.raises(ValueError, match="must be True or False"):
            choose("blockwise", q, k, v, **{flag: value})


def test_numpy_bools_are_flags():
    """np.bool_ (what a NumPy comparison gives) is a bool: the same answer as True/False."""
    q, k, v, _, _ = _inputs((24, 24, 2, 32, 32), "float32")
    for impl in ("naive", "blockwise"):
        for c in (True, False):
            got = attention(q, k, v, impl=impl, causal=np.bool_(c))
            want = attention(q, k, v, impl="naive", causal=c)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def _entry_points():
    """Every attention implementation's own function, as a caller may use it directly: the
    Pallas kernels interpreted; dtype and head dim each kernel takes."""
    import functools

    from lab.kernels.attention import pallas_gpu, pallas_mgpu, pallas_tpu
    from lab.kernels.attention.ring import ring_attention

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("model",))
    out = {
        "naive": (attention_reference, "float32"),
        "blockwise": (blockwise.blockwise_attention, "float32"),
        "ring": (functools.partial(ring_attention, mesh=mesh, seq_axis="model"), "float32"),
        "pallas_tpu": (
            functools.partial(pallas_tpu.flash_attention_tpu, interpret=True),
            "float32",
        ),
        "pallas_gpu": (
            functools.partial(pallas_gpu.flash_attention_gpu, interpret=True),
            "float32",
        ),
    }
    if cpu_flash.available():
        out["cpu_flash"] = (cpu_flash.cpu_flash_attention, "float32")
    if pallas_mgpu.interpretable():
        kernel = functools.partial(pallas_mgpu.flash_attention_mgpu, interpret=True)
        out["pallas_mgpu"] = (kernel, "bfloat16")
    return out


@pytest.mark.parametrize(
    "impl", ["naive", "blockwise", "ring", "cpu_flash", "pallas_tpu", "pallas_gpu", "pallas_mgpu"]
)
def test_every_kernel_combines_causal_with_a_mask(impl):
    """A Mask passed to a kernel's own function is combined with its `causal` argument (True
    by default): causal=True and a non-causal mask give causal attention, causal=False the
    mask alone, as `attention` does; dropping `causal` beside a mask would lose causality
    without a word."""
    entries = _entry_points()
    if impl not in entries:
        pytest.skip(f"{impl} does not run here")
    fn, dtype = entries[impl]
    L, K = 64, 64
    q, k, v, _, _ = _inputs((L, L, 2, K, K), dtype)
    lengths = jnp.array([L, 40], jnp.int32)
    mask = Mask.make(kv_lengths=lengths)
    with jax.enable_x64(True):
        f64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]
        dense = {c: Mask.make(causal=c, kv_lengths=lengths) for c in (True, False)}
        want = {c: np.asarray(attention_reference(*f64, causal=c, mask=dense[c])) for c in dense}
    assert np.abs(want[True] - want[False]).max() > 0.1  # the two answers are far apart
    for causal in (True, False):
        got = np.asarray(fn(q, k, v, causal=causal, mask=mask), np.float64)
        err = np.abs(got - want[causal]).max() / np.abs(want[causal]).max()
        assert err < TOL[dtype], f"{impl} causal={causal}: max error {err:.2e}"
    got = np.asarray(fn(q, k, v, mask=mask), np.float64)  # causal by default
    assert np.abs(got - want[True]).max() / np.abs(want[True]).max() < TOL[dtype]


def _direct_kernels():
    kernels = {
        "reference": lambda q, k, v, sinks=None, **kw: attention_reference(
            q, k, v, sinks_H=sinks, **kw
        ),
        "blockwise": blockwise.blockwise_attention,
    }
    if cpu_flash.available():
        kernels["cpu_flash"] = cpu_flash.cpu_flash_attention
    return kernels


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(softcap=0.0), r"^softcap=0\.0: must be a positive number"),
        (dict(softcap=-5), r"^softcap=-5: must be a positive number"),
        (dict(sinks=[0.1, 0.2]), r"attention sinks are one logit per query head, \(4,\)"),
        (dict(mask=Mask.make(kv_lengths=np.array([1, 2, 3]))), r"^kv_lengths.shape=\(3,\)"),
        (dict(scale="0.1"), r"^scale='0\.1': must be a number"),
        (dict(scale=float("nan")), r"^scale=nan: must be finite"),
    ],
)
def test_kernel_functions_called_directly_check_as_attention_does(kwargs, needle):
    """README names the kernel functions as public: called directly, a cap of 0 or below (was
    uniform attention from blockwise, another answer from cpu_flash), sinks of the wrong
    shape, a mask for another batch, or a scale that is not a finite number are the same
    one-line ValueError `attention` gives, never a wrong answer or an error deep in lax."""
    q, k, v, _, _ = _inputs((24, 24, 2, 32, 32), "float32")
    for fn in _direct_kernels().values():
        with pytest.raises(ValueError, match=needle):
            jax.block_until_ready(fn(q, k, v, causal=False, **kwargs))
    if "mask" not in kwargs:  # attention takes the mask's parts as keywords
        for impl in ("auto", "naive", "xla"):  # xla hands scale to jax.nn as it is
            with pytest.raises(ValueError, match=needle):
                attention(q, k, v, impl=impl, causal=False, **kwargs)


def test_sinks_as_a_list_are_read_by_every_kernel_function():
    q, k, v, _, _ = _inputs((24, 24, 2, 32, 32), "float32")
    want = attention_reference(q, k, v, sinks_H=jnp.array([0.3, -0.2, 0.1, 0.0]))
    for name, fn in _direct_kernels().items():
        got = fn(q, k, v, sinks=[0.3, -0.2, 0.1, 0.0])
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=name)


def test_a_window_side_past_int32_is_refused_and_a_wide_one_bounds_nothing():
    """Window sides are int32 positions in every kernel: 2**31 is one line (None is the
    unbounded side), and a side wider than the sequences equals no bound in every impl (the
    xla impl read 2**31 - 1 as a different answer)."""
    q, k, v, _, _ = _inputs((40, 40, 2, 16, 16), "float32")
    with pytest.raises(ValueError, match=r"window=\(2147483648, None\): a side above"):
        attention(q, k, v, causal=False, window=(2**31, None))
    full = attention_reference(q, k, v, causal=False)
    for impl in ("naive", "blockwise", "xla"):
        got = attention(q, k, v, impl=impl, causal=False, window=(2**31 - 1, None))
        np.testing.assert_allclose(got, full, atol=1e-5, err_msg=impl)


def test_xla_takes_int64_lengths_under_x64():
    q, k, v, _, _ = _inputs((16, 16, 2, 16, 16), "float32")
    want = attention(q, k, v, impl="naive", causal=False, kv_lengths=np.array([16, 8]))
    with jax.enable_x64(True):
        got = attention(q, k, v, impl="xla", causal=False, kv_lengths=[16, 8])
    np.testing.assert_allclose(got, want, atol=1e-5)

"""The native CPU kernel (cpu_flash: C++ through jax.ffi) against the float64 reference.

Product: causal × GQA ratio (1, 2, 4) × dtype (f32, bf16) × length (1; 127: one partial block;
256: two whole 128-key blocks under causal, one 256-key block without; 1000: several blocks
and a partial one) × head_dim (64, 128), forward
and dQ, dK, dV. Also: L < S (bottom-right mask), L > S without a mask, a given scale, vmap,
the dispatch (auto picks it on CPU, falls back to blockwise for what it does not take), the
build (no compiler: one line; a cached build is reused; workers share one build), and lab.run
on a 4x2 mesh (the kernel per shard under shard_map) with blockwise's losses.
"""

import dataclasses
import functools
import itertools
import json
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab.kernels.attention import attention, available_impls, choose, cpu_flash
from lab.kernels.attention.reference import attention_reference

pytestmark = pytest.mark.skipif(not cpu_flash.available(), reason="cpu_flash is not built here")

# max |kernel - f64 reference| / max |reference|, per input dtype. f32 measures ≤ 2.4e-6 (sums
# of up to 1000 products at 2^-24 each, all in f32); bf16 inputs are exact in f32 and every
# sum is f32, so the error is the final rounding of out, dq, dk, dv to bf16 (≤ 2^-8 relative):
# measured ≤ 2.6e-3.
TOL = {"float32": 1e-5, "bfloat16": 1e-2}
HEADS = 4  # query heads; kv heads = HEADS // ratio


@dataclasses.dataclass(frozen=True)
class Case:
    causal: bool
    ratio: int  # query heads per kv head
    dtype: str
    seq: int
    head_dim: int

    def __str__(self):
        mask = "causal" if self.causal else "full"
        return f"{mask}-g{self.ratio}-{self.dtype}-L{self.seq}-D{self.head_dim}"


CASES = [
    Case(*c)
    for c in itertools.product((True, False), (1, 2, 4), TOL, (1, 127, 256, 1000), (64, 128))
]


def random_qkv(seed: int, L: int, S: int, H: int, G: int, K: int, dtype, B: int = 1):
    """Fresh normal q, k, v and output cotangent (never zeros), drawn by numpy: no compile."""
    rng = np.random.default_rng(seed)
    shapes = [(B, L, H, K), (B, S, G, K), (B, S, G, K), (B, L, H, K)]
    return [
        jnp.asarray(rng.standard_normal(s, np.float32).astype(jnp.dtype(dtype))) for s in shapes
    ]


def output_and_grads(fn, q, k, v, do):
    def both(q, k, v, do):
        o, vjp = jax.vjp(fn, q, k, v)
        return (o, *vjp(do))

    return jax.jit(both)(q, k, v, do)


# LLVM at -O0 for the reference: it compiles in half the time, the HLO is unchanged.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@functools.cache
def _reference_program(shapes, causal: bool, scale):
    def both(q, k, v, do):
        fn = lambda q, k, v: attention_reference(q, k, v, causal=causal, scale=scale)
        o, vjp = jax.vjp(fn, q, k, v)
        return (o, *vjp(do))

    args = [jax.ShapeDtypeStruct(s, jnp.float64) for s in shapes]
    return jax.jit(both).lower(*args).compile(compiler_options=FAST_COMPILE)


def reference_f64(q, k, v, do, causal: bool, scale=None):
    """The same quantities in float64 from the same (rounded) inputs: one compile per shape,
    shared by both dtypes."""
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, do)]
        program = _reference_program(tuple(x.shape for x in args), causal, scale)
        return [np.asarray(x) for x in program(*args)]


@functools.partial(jax.jit, static_argnames="causal")
def _kernel_jit(q, k, v, do, causal: bool):
    o, vjp = jax.vjp(kernel(causal), q, k, v)
    return (o, *vjp(do))


def assert_close(got, want, dtype: str):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert g.dtype == jnp.dtype(dtype), (name, g.dtype)
        # one key (L = S = 1): softmax is constant, dq and dk are exactly zero
        scale = np.abs(w).max() or 1.0
        err = np.abs(np.asarray(g, np.float64) - w).max() / scale
        assert err < TOL[dtype], f"{name}: max error {err:.2e} relative to max |ref|"


def kernel(causal, scale=None):
    return lambda q, k, v: cpu_flash.cpu_flash_attention(q, k, v, causal=causal, scale=scale)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_float64_reference(case: Case):
    seed = zlib.crc32(str(case).encode())
    q, k, v, do = random_qkv(
        seed, case.seq, case.seq, HEADS, HEADS // case.ratio, case.head_dim, case.dtype
    )
    got = _kernel_jit(q, k, v, do, causal=case.causal)
    assert_close(got, reference_f64(q, k, v, do, case.causal), case.dtype)


@pytest.mark.parametrize("causal, L, S", [(True, 40, 300), (False, 300, 40), (False, 1, 129)])
def test_unequal_lengths(causal, L, S):
    """Causal L < S: the mask is aligned bottom-right (decoding against a cache)."""
    q, k, v, do = random_qkv(L * S, L, S, HEADS, 2, 64, "float32", B=2)
    got = output_and_grads(kernel(causal), q, k, v, do)
    assert_close(got, reference_f64(q, k, v, do, causal), "float32")


def test_a_given_scale_is_used():
    q, k, v, do = random_qkv(3, 130, 130, HEADS, 1, 64, "float32")
    got = output_and_grads(kernel(True, scale=0.3), q, k, v, do)
    assert_close(got, reference_f64(q, k, v, do, True, scale=0.3), "float32")


def test_block_sizes_do_not_change_the_result():
    q, k, v, do = random_qkv(4, 300, 300, HEADS, 2, 64, "float32")
    want = reference_f64(q, k, v, do, True)
    for bs in (cpu_flash.BlockSizes(32, 64), cpu_flash.BlockSizes(96, 32)):
        fn = lambda q, k, v, bs=bs: cpu_flash.cpu_flash_attention(q, k, v, block_sizes=bs)
        assert_close(output_and_grads(fn, q, k, v, do), want, "float32")


def test_the_default_key_block_follows_the_mask():
    """128 keys a tile under a band (its diagonal tiles are computed whole), 256 without."""
    bs = cpu_flash.BlockSizes()
    assert bs.fit(2048, 2048, banded=True) == (128, 128)
    assert bs.fit(2048, 2048, banded=False) == (128, 256)
    assert bs.fit(100, 200, banded=False) == (128, 224)  # shrunk to the 32-rounded length
    assert cpu_flash.BlockSizes(64, 64).fit(2048, 2048, banded=False) == (64, 64)
    with pytest.raises(ValueError, match="block_k=48"):
        cpu_flash.BlockSizes(block_k=48)


def test_large_scores_saturate_the_softmax_as_the_reference_does():
    """Scores up to about a hundred (a scale of 2 on normal inputs, 16× the default at K=64):
    most probabilities underflow to 0 in the kernel's base-2 exponential, the rest match.
    Errors here grow with the scores in any f32 attention (XLA's, from f32 inputs: 7.8e-6);
    scaling the scores to base 2 before the max doubled the kernel's (1.7e-5)."""
    q, k, v, do = random_qkv(11, 300, 300, HEADS, 2, 64, "float32")
    for causal in (True, False):
        got = output_and_grads(kernel(causal, scale=2.0), q, k, v, do)
        assert_close(got, reference_f64(q, k, v, do, causal, scale=2.0), "float32")


def test_calls_of_other_shapes_in_between_do_not_change_a_result():
    """The packed copies of the inputs are kept from one call to the next and reused: a smaller
    call after a larger one (stale data past its end) and a larger one after it (grown) are
    each exact."""
    shapes = [(300, 80, False), (64, 32, True), (40, 64, False), (300, 80, False)]
    first = None
    for L, K, causal in shapes:
        q, k, v, do = random_qkv(L * K, L, L, HEADS, 2, K, "float32")
        got = output_and_grads(kernel(causal), q, k, v, do)
        assert_close(got, reference_f64(q, k, v, do, causal), "float32")
        if first is None:
            first = got
    for a, b in zip(first, got, strict=True):  # the same call again: the same bits
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


BACKWARD_SHAPES = {  # L, S, head_dim, block sizes
    "square": (300, 300, 64, cpu_flash.BlockSizes()),
    "k80-32x64": (300, 300, 80, cpu_flash.BlockSizes(32, 64)),
    "l200-s330-96x32": (200, 330, 64, cpu_flash.BlockSizes(96, 32)),
}


@pytest.mark.parametrize("path", ["fused", "two-pass"])
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", BACKWARD_SHAPES)
def test_both_backward_paths_match_the_reference(monkeypatch, path, dtype, shape):
    """The backward in one pass (each (batch, kv head) item adds its own dQ) and in two (a dQ
    pass and a dK/dV pass); `auto` picks by how the items spread over the threads. Grouped
    heads, several blocks and a partial one, a sliding window; unequal blocks, a head dim that
    is not a multiple of 32 (its tiles zero-padded), L < S."""
    monkeypatch.setenv("LAB_CPU_FLASH_BACKWARD", path)
    monkeypatch.setenv("LAB_CPU_FLASH_THREADS", "2")
    L, S, K, bs = BACKWARD_SHAPES[shape]
    q, k, v, do = random_qkv(11, L, S, HEADS, 2, K, dtype, B=2)
    mask = cpu_flash.Mask.make(causal=True, window=(100, 0))

    def fn(q, k, v):
        return cpu_flash.cpu_flash_attention(q, k, v, mask=mask, block_sizes=bs)

    ref = lambda q, k, v: attention_reference(q, k, v, mask=mask)  # noqa: E731
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, do)]
        want = [np.asarray(x) for x in output_and_grads(ref, *args)]
    assert_close(output_and_grads(fn, q, k, v, do), want, dtype)


@pytest.mark.parametrize("causal", [True, False])
def test_a_nan_in_a_query_row_reaches_that_row_and_no_other(causal):
    """A NaN in gives NaN out, as in the reference: the NaN query row's output and its dQ are
    NaN (a plain row max would skip the NaN and read the row as one that sees no key: 0),
    and every other row is untouched."""
    ks = jax.random.split(jax.random.key(5), 4)
    q, k, v, do = (jax.random.normal(kk, (1, 160, 2, 32), jnp.float32) for kk in ks)
    q = q.at[0, 140, 1, 3].set(jnp.nan)
    fn = functools.partial(attention, causal=causal, impl="cpu_flash")
    out, vjp = jax.vjp(fn, q, k, v)
    dq = vjp(do)[0]
    assert bool(jnp.isnan(out[0, 140, 1]).all()) and bool(jnp.isnan(dq[0, 140, 1]).all())
    dk, dv = vjp(do)[1:]
    seen = slice(0, 141 if causal else 160)  # the keys row 140 reaches: NaN there too
    assert bool(jnp.isnan(dk[0, seen, 1]).any()) and bool(jnp.isnan(dv[0, seen, 1]).any())
    ref = attention_reference(q, k, v, causal=causal)
    clean = jnp.ones(out.shape, bool).at[0, 140, 1].set(False)
    assert bool(jnp.isfinite(jnp.where(clean, out, 0.0)).all())
    np.testing.assert_allclose(
        np.where(clean, out, 0.0), np.where(clean, ref, 0.0), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("q_id, kv_id", [(3, 3), (0, 1)])
def test_one_segment_id_everywhere_is_no_mask_and_two_hide_everything(q_id, kv_id):
    """Segment ids that are one value everywhere mask nothing (the kernel then masks a row as
    one run of keys, under a window and lengths here); q and kv ids that never match hide
    every key, so every row sees none: output 0, as the reference gives."""
    ks = jax.random.split(jax.random.key(9), 3)
    q, k, v = (jax.random.normal(kk, (2, 150, 2, 32), jnp.float32) for kk in ks)
    kw = dict(
        causal=True,
        window=(40, 0),
        q_segment_ids=jnp.full((2, 150), q_id, jnp.int32),
        kv_segment_ids=jnp.full((2, 150), kv_id, jnp.int32),
        q_lengths=jnp.array([150, 97]),
        kv_lengths=jnp.array([120, 150]),
    )
    got = attention(q, k, v, impl="cpu_flash", **kw)
    want = attention(q, k, v, impl="naive", **kw)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
    if q_id != kv_id:
        assert not np.asarray(got).any()


def test_vmap_over_a_leading_axis():
    """ffi_call's broadcast_all: the vmapped axis is folded into the batch inside the kernel."""
    q, k, v, do = random_qkv(5, 70, 70, HEADS, 2, 64, "float32", B=3)
    fn = jax.vmap(kernel(True), in_axes=(0, 0, None))
    stack = lambda x: jnp.stack([x, 2 * x])
    got = output_and_grads(fn, stack(q), stack(k), v, stack(do))
    for i in range(2):
        want = output_and_grads(kernel(True), stack(q)[i], stack(k)[i], v, stack(do)[i])
        for g, w in zip(got[:3], want[:3], strict=True):
            np.testing.assert_allclose(np.asarray(g[i]), np.asarray(w), rtol=1e-5, atol=1e-6)
    dv_sum = sum(
        output_and_grads(kernel(True), stack(q)[i], stack(k)[i], v, stack(do)[i])[3]
        for i in range(2)
    )
    np.testing.assert_allclose(np.asarray(got[3]), np.asarray(dv_sum), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- dispatch


def _spec(dtype, head_dim=64, L=32, S=32):
    q = jax.ShapeDtypeStruct((1, L, 4, head_dim), jnp.dtype(dtype))
    kv = jax.ShapeDtypeStruct((1, S, 2, head_dim), jnp.dtype(dtype))
    return q, kv, kv


@pytest.mark.parametrize(
    "dtype, want", [("float32", "cpu_flash"), ("bfloat16", "cpu_flash"), ("float16", "blockwise")]
)
def test_auto_picks_it_on_cpu_where_it_takes_the_input(dtype, want):
    assert "cpu_flash" in available_impls("cpu")
    assert choose("auto", *_spec(dtype), causal=True, backend="cpu") == want
    assert choose("auto", *_spec(dtype), causal=True, backend="tpu") != "cpu_flash"


def test_named_elsewhere_or_on_a_bad_dtype_it_is_refused_in_one_line():
    with pytest.raises(
        ValueError, match="impl='cpu_flash' has no compiled kernel on backend 'tpu'"
    ):
        choose("cpu_flash", *_spec("float32"), backend="tpu")
    with pytest.raises(ValueError, match="impl='cpu_flash' supports dtypes float32, bfloat16"):
        choose("cpu_flash", *_spec("float16"), backend="cpu")


@pytest.mark.parametrize("text", ["abc", "-2", "0"])
def test_a_bad_thread_count_is_refused_not_passed_over(monkeypatch, text):
    """auto must not fall back to blockwise without a word where LAB_CPU_FLASH_THREADS is not
    a thread count (the C++ kernel would ignore it): one line naming the variable."""
    monkeypatch.setenv("LAB_CPU_FLASH_THREADS", text)
    q, k, v, _ = random_qkv(8, 32, 32, HEADS, 2, 32, "float32")
    for impl in ("auto", "cpu_flash"):
        with pytest.raises(ValueError, match=f"^LAB_CPU_FLASH_THREADS='{text}': must be a whole"):
            attention(q, k, v, impl=impl)
    monkeypatch.setenv("LAB_CPU_FLASH_THREADS", "2")
    assert attention(q, k, v, impl="auto").shape == q.shape


@pytest.mark.parametrize("text", ["two_pass", "foo", " fused"])
def test_a_backward_form_that_names_none_is_refused(monkeypatch, text):
    """LAB_CPU_FLASH_BACKWARD is fused or two-pass; a typo (two_pass) would leave the choice
    to the shape without a word: one line naming the variable."""
    monkeypatch.setenv("LAB_CPU_FLASH_BACKWARD", text)
    q, k, v, _ = random_qkv(8, 32, 32, HEADS, 2, 32, "float32")
    for impl in ("auto", "cpu_flash"):
        with pytest.raises(ValueError, match=f"^LAB_CPU_FLASH_BACKWARD='{text}': must be fused"):
            attention(q, k, v, impl=impl)


def test_a_bench_asked_for_cpu_flash_says_the_environment_turned_it_off(monkeypatch):
    from lab.studies.attention import check_impls

    monkeypatch.setenv("LAB_CPU_FLASH", "0")
    monkeypatch.setattr(cpu_flash, "available", lambda: False)
    with pytest.raises(ValueError, match="impls=cpu_flash: LAB_CPU_FLASH=0 in the environment"):
        check_impls(["cpu_flash"], "cpu")


def test_without_the_kernel_auto_keeps_blockwise(monkeypatch):
    monkeypatch.setattr(cpu_flash, "available", lambda: False)
    assert choose("auto", *_spec("float32"), causal=True, backend="cpu") == "blockwise"
    assert "cpu_flash" not in available_impls("cpu")
    with pytest.raises(ValueError, match="cpu_flash is not built here"):
        choose("cpu_flash", *_spec("float32"), backend="cpu")


def test_auto_keeps_blockwise_where_the_sequence_is_split(monkeypatch):
    """strategy=cp splits the sequence: XLA partitions blockwise, an FFI call it cannot."""
    from jax.sharding import PartitionSpec as P

    from lab.kernels.attention import blockwise

    seen = []
    monkeypatch.setattr(blockwise, "blockwise_attention", lambda q, *a, **kw: seen.append(1) or q)
    q, k, v, _ = random_qkv(8, 64, 64, HEADS, 2, 64, "float32")
    with jax.set_mesh(jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])):
        attention(q, k, v, impl="auto", shard_spec=P(None, "data", None, None))
        assert seen
        with pytest.raises(ValueError, match="sharded along the sequence"):
            attention(q, k, v, impl="cpu_flash", shard_spec=P(None, "data", None, None))


def test_dispatch_runs_it():
    q, k, v, do = random_qkv(6, 64, 64, HEADS, 2, 64, "float32")
    got = output_and_grads(lambda q, k, v: attention(q, k, v, impl="cpu_flash"), q, k, v, do)
    assert_close(got, reference_f64(q, k, v, do, True), "float32")


# ---------------------------------------------------------------------------- build


def test_no_compiler_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(cpu_flash, "_compiler", lambda: None)
    assert cpu_flash._build() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no C++ compiler" in err[0] and "JAX kernels" in err[0]


def test_a_compiler_that_fails_is_one_line(monkeypatch, tmp_path, capsys):
    """Both attempts (-march=native, then portable) fail: one line says so, not a `building`
    line per attempt before it."""
    monkeypatch.setenv("LAB_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_flash, "_compiler", lambda: "/bin/false")
    assert cpu_flash._build() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "did not build (failed)" in err[0] and "JAX kernels" in err[0]


def test_a_build_is_cached_and_shared(monkeypatch, tmp_path):
    """One compile per key: a second process finds the library (the lock serialises them)."""
    calls = []

    def fake_compile(cxx, opt, out):
        calls.append(opt)
        out.write_bytes(b"library")

    monkeypatch.setenv("LAB_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_flash, "_compile", fake_compile)
    first = cpu_flash._build()
    assert first is not None and first.read_bytes() == b"library"
    assert cpu_flash._build() == first and len(calls) == 1
    assert first.parent.parent == tmp_path


def test_a_failed_native_build_falls_back_to_the_portable_one(monkeypatch, tmp_path, capsys):
    def fake_compile(cxx, opt, out):
        if "-march=native" in opt:
            return "error: unknown target CPU"
        out.write_bytes(b"portable")

    monkeypatch.setenv("LAB_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_flash, "_compile", fake_compile)
    assert cpu_flash._build().read_bytes() == b"portable"
    assert capsys.readouterr().err == ""


def test_a_cache_that_cannot_be_written_is_one_line(monkeypatch, tmp_path, capsys):
    """A read-only home or a cache path through a file: one line, the JAX kernels run (it
    was a traceback out of the session's first attention choice)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("LAB_KERNEL_CACHE", str(blocker / "cache"))
    monkeypatch.setattr(cpu_flash, "_compile", lambda cxx, opt, out: pytest.fail("built"))
    assert cpu_flash._build() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be written" in err[0] and "LAB_KERNEL_CACHE" in err[0]


def test_a_build_held_by_another_process_is_waited_for_and_said(monkeypatch, tmp_path, capsys):
    import fcntl
    import threading

    from lab.kernels import native

    folder = tmp_path / "k"
    folder.mkdir()
    holder = open(folder / ".lock", "w")  # noqa: SIM115 - held across the thread
    fcntl.flock(holder, fcntl.LOCK_EX)
    threading.Timer(0.3, lambda: holder.close()).start()  # the other build finishes
    with open(folder / ".lock", "w") as lock:
        native._lock_waiting(lock, "CPU kernel", folder)
    assert "waiting for another process's build of the CPU kernel" in capsys.readouterr().err


# ---------------------------------------------------------------------------- lab.run


def test_lab_run_on_a_4x2_mesh_matches_blockwise(tmp_path):
    """The kernel runs once per shard (shard_map over data=4, model=2: batch and heads split)
    inside the jitted training step, and trains with blockwise's losses."""
    from lab.run import main

    losses = {}
    for impl in ("cpu_flash", "blockwise"):
        args = ["model=tiny", "n_layers=1", "batch_size=8", "seq_len=32", "log_every=1", "steps=3"]
        assert (
            main([*args, "mesh=4x2", f"attention={impl}", f"name={impl}", f"out_dir={tmp_path}"])
            == 0
        )
        lines = (tmp_path / impl / "metrics.jsonl").read_text().splitlines()
        losses[impl] = [json.loads(x)["loss"] for x in lines]
    assert len(losses["cpu_flash"]) == 3
    np.testing.assert_allclose(losses["cpu_flash"], losses["blockwise"], rtol=1e-5, atol=1e-5)

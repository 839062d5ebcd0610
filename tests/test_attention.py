"""Every attention implementation against the float64 reference: forward and dQ, dK, dV.

Product: causal × GQA ratio (1, 2, 4) × dtype (f32, bf16) × length (64: whole blocks, 130:
padded and masked) × head_dim (64, 128), all of it for every implementation: naive, blockwise,
xla, and both Pallas kernels through the interpreter (1-3 s a case). The GPU kernel's second
variant (the mask on every block) reruns a pairwise-covering subset (every pair of factor
levels appears at least once). Small blocks (16/32) so that the short
sequences still cross several tiles and the causal diagonal. Also here: dispatch rules, bad
input, the model's `attention=` switch (blockwise trains with naive's losses) and one tiny
point of the benchmark sweep. Ahead-of-time compiles live in tests/test_attention_aot.py.
"""

import dataclasses
import functools
import itertools
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab.kernels.attention import (
    IMPLS,
    attention,
    available_impls,
    blockwise,
    cpu_flash,
    pallas_gpu,
    pallas_mgpu,
    pallas_tpu,
)
from lab.kernels.attention.reference import attention_reference
from lab.measure.timing import random_inputs

# max |impl - f64 reference| / max |reference|, per input dtype. f32 measures ~1e-6 (sums of
# ~130 products at 2^-24 each); bf16 measures ~4e-3 (the output and the probabilities fed to the
# P·V and dS·K products are rounded to bf16, 2^-8 relative).
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
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


FULL = [Case(*c) for c in itertools.product((True, False), (1, 2, 4), TOL, (64, 130), (64, 128))]
PAIRWISE = [
    Case(True, 1, "float32", 64, 64),
    Case(False, 1, "bfloat16", 130, 128),
    Case(True, 2, "bfloat16", 130, 64),
    Case(False, 2, "float32", 64, 128),
    Case(True, 4, "float32", 130, 128),
    Case(False, 4, "bfloat16", 64, 64),
]
# LLVM at -O0: compiles in half the time; the HLO, i.e. the algorithm under test, is unchanged.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


# The full product beyond PAIRWISE, marked `exhaustive` (LAB_EXHAUSTIVE=1 runs it): every
# implementation here runs every pair of factor values in CI (the native CPU kernel, the
# default on CPU, runs its whole matrix in tests/test_cpu_flash.py).
PAIRWISE_THEN_REST = PAIRWISE + [
    pytest.param(c, marks=pytest.mark.exhaustive) for c in FULL if c not in PAIRWISE
]


def pytest_generate_tests(metafunc):
    """Each class says which cases it runs (`CASES`): full product or the pairwise subset."""
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", metafunc.cls.CASES, ids=str)


def random_qkv(seed: int, L: int, S: int, H: int, K: int, D: int, dtype):
    """Fresh normal q, k, v and output cotangent (never zeros), drawn on the host: a draw on
    the device compiles a program for every new shape, and this matrix has dozens."""
    shapes = [(1, L, H, D), (1, S, K, D), (1, S, K, D), (1, L, H, D)]
    return random_inputs(seed, shapes, dtype)


def output_and_grads(fn, q, k, v, do):
    """fn's output and the vjp of do, compiled as one program."""

    def both(q, k, v, do):
        o, vjp = jax.vjp(fn, q, k, v)
        return (o, *vjp(do))

    return jax.jit(both).lower(q, k, v, do).compile(compiler_options=FAST_COMPILE)(q, k, v, do)


@functools.partial(jax.jit, static_argnames="causal")
def _reference_jit(q, k, v, do, causal: bool):
    o, vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, causal=causal), q, k, v)
    return (o, *vjp(do))


def reference_f64(q, k, v, do, causal: bool):
    """The same quantities in float64 from the same (rounded) inputs; one compile per shape
    (module-level jit), shared by every implementation and dtype."""
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, do)]
        return [np.asarray(x) for x in _reference_jit(*args, causal=causal)]


def assert_close(got, want, dtype: str):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert g.dtype == jnp.dtype(dtype), (name, g.dtype)
        err = np.abs(np.asarray(g, np.float64) - w).max() / np.abs(w).max()
        assert err < TOL[dtype], f"{name}: max error {err:.2e} relative to max |ref|"


class AttentionCase:
    """Base: one implementation, run over `CASES` (pairwise in CI, the rest exhaustive)."""

    impl = "blockwise"
    interpret = False
    block_sizes = blockwise.BlockSizes(16, 32)
    CASES = PAIRWISE_THEN_REST

    def run(self, q, k, v, do, causal):
        fn = lambda q, k, v: attention(
            q,
            k,
            v,
            causal=causal,
            impl=self.impl,
            interpret=self.interpret,
            block_sizes=self.block_sizes,
        )
        return output_and_grads(fn, q, k, v, do)

    def test_matches_float64_reference(self, case: Case):
        K = HEADS // case.ratio
        seed = zlib.crc32(str(case).encode())  # fresh per case, reproducible
        q, k, v, do = random_qkv(seed, case.seq, case.seq, HEADS, K, case.head_dim, case.dtype)
        got = self.run(q, k, v, do, case.causal)
        assert_close(got, reference_f64(q, k, v, do, case.causal), case.dtype)

    def test_shorter_queries_than_keys(self):
        """Causal with L < S (decoding against a cache): the mask is aligned bottom-right."""
        q, k, v, do = random_qkv(7, 40, 100, HEADS, 2, 64, "float32")
        got = self.run(q, k, v, do, True)
        assert_close(got, reference_f64(q, k, v, do, True), "float32")


class TestBlockwise(AttentionCase):
    pass


class TestNaive(AttentionCase):
    impl = "naive"
    block_sizes = None


class TestXla(AttentionCase):
    """The library baseline: also the reference's independent cross-check."""

    impl = "xla"
    block_sizes = None

    def test_shorter_queries_than_keys(self):
        q, k, v, _ = random_qkv(7, 40, 100, HEADS, 2, 64, "float32")
        with pytest.raises(ValueError, match="aligns the causal mask top-left"):
            attention(q, k, v, causal=True, impl="xla")


class TestPallasTpuInterpret(AttentionCase):
    impl = "pallas_tpu"
    interpret = True
    block_sizes = pallas_tpu.BlockSizes(block_q=16, block_k=32, block_q_bwd=32, block_k_bwd=16)


class TestPallasGpuInterpret(AttentionCase):
    impl = "pallas_gpu"
    interpret = True
    block_sizes = pallas_gpu.BlockSizes(16, 32, 32, 16, 16, 32)  # split_mask: whole blocks unmasked


class TestPallasGpuInterpretMaskEveryBlock(TestPallasGpuInterpret):
    """The other variant the tuner chooses between: the mask applied on every block."""

    block_sizes = pallas_gpu.BlockSizes(16, 32, 32, 16, 16, 32, split_mask=False)
    CASES = PAIRWISE


# ---------------------------------------------------------------------------- dispatch


@pytest.mark.parametrize(
    "kwargs, module, name",
    [
        (
            {"impl": "auto"},
            *(
                (cpu_flash, "cpu_flash_attention")
                if cpu_flash.available()
                else (blockwise, "blockwise_attention")
            ),
        ),
        ({"impl": "pallas", "interpret": True}, pallas_tpu, "flash_attention_tpu"),
        ({"impl": "pallas_gpu", "interpret": True}, pallas_gpu, "flash_attention_gpu"),
    ],
)
def test_dispatch_on_cpu(monkeypatch, kwargs, module, name):
    """auto -> cpu_flash on CPU (blockwise where it is not built); pallas + interpret -> the
    TPU kernel, interpreted."""
    seen = {}
    monkeypatch.setattr(module, name, lambda *a, **kw: seen.setdefault("kw", kw) and "ran")
    assert attention(*_qkv(), **kwargs) == "ran"
    assert seen["kw"].get("interpret", False) == kwargs.get("interpret", False)


def test_available_impls_per_backend():
    native = ("cpu_flash",) if cpu_flash.available() else ()  # built on first use, if it can be
    assert available_impls("cpu") == ("naive", "blockwise", "xla", *native)
    # ring is not a kernel of a backend: it runs anywhere, under a mesh that splits the sequence;
    # pallas_mgpu is interpreted only from jax 0.11 (tests/test_pallas_mgpu.py)
    not_here = {"cudnn", "ring"} | (set() if pallas_mgpu.interpretable() else {"pallas_mgpu"})
    not_here |= set() if native else {"cpu_flash"}
    assert "cpu_flash" not in available_impls("tpu") + available_impls("gpu")
    assert set(available_impls("cpu", interpret=True)) == set(IMPLS) - not_here
    assert {"pallas", "pallas_tpu"} <= set(
        available_impls("tpu")
    ) and "cudnn" not in available_impls("tpu")
    assert {"pallas", "pallas_gpu", "cudnn"} <= set(available_impls("gpu"))
    assert set(available_impls()) == set(available_impls("cpu"))  # these tests run on CPU


@pytest.mark.parametrize(
    "backend, dtype, head_dim, causal_lengths, want",
    [
        ("gpu", "bfloat16", 128, (32, 32), "cudnn"),
        ("gpu", "float32", 128, (32, 32), "pallas_gpu"),  # cuDNN: bf16/f16 only
        ("gpu", "bfloat16", 256, (32, 32), "pallas_gpu"),  # cuDNN: head_dim <= 128
        ("gpu", "bfloat16", 64, (16, 32), "pallas_gpu"),  # cuDNN's causal mask is top-left
        ("gpu", "float32", 44, (32, 32), "blockwise"),  # Triton kernel: multiples of 8 only
        ("tpu", "bfloat16", 128, (32, 32), "pallas_tpu"),
        ("cpu", "float16", 128, (32, 32), "blockwise"),  # cpu_flash: f32/bf16 only
    ],
)
def test_auto_picks_per_backend_and_falls_back_on_what_it_cannot_take(
    backend, dtype, head_dim, causal_lengths, want
):
    from lab.kernels.attention import choose

    L, S = causal_lengths
    q = jax.ShapeDtypeStruct((1, L, 4, head_dim), jnp.dtype(dtype))
    kv = jax.ShapeDtypeStruct((1, S, 2, head_dim), jnp.dtype(dtype))
    assert choose("auto", q, kv, kv, causal=True, backend=backend) == want


@pytest.mark.parametrize(
    "impl, interpret",
    [
        ("naive", False),
        ("blockwise", False),
        ("xla", False),
        ("pallas_tpu", True),
        ("pallas_gpu", True),
    ],
)
def test_a_given_scale_is_used(impl, interpret):
    q, k, v = _qkv()
    want = attention_reference(q * 0.3, k, v, causal=True, scale=1.0)
    got = attention(q, k, v, causal=True, impl=impl, scale=0.3, interpret=interpret)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


# ---------------------------------------------------------------------------- bad input


def _qkv(H=4, K=2, D=64, L=32, S=32, dtype="float32"):
    q, k, v, _ = random_qkv(0, L, S, H, K, D, dtype)
    return q, k, v


@pytest.mark.parametrize(
    "args, kwargs, needle",
    [
        (_qkv(H=3, K=2), {}, "query heads must be a multiple of kv heads"),
        (
            _qkv(),
            {"sinks": jnp.zeros(4), "impl": "xla"},
            "impl='xla' does not support attention sinks",
        ),
        (_qkv(), {"window": (4, -1)}, "window=(4, -1): expected (left, right)"),
        (_qkv(), {"sinks": jnp.zeros(3)}, "attention sinks are one logit per query head"),
        (_qkv(), {"softcap": -1.0}, "softcap=-1.0: must be a positive number"),
        (_qkv(), {"softcap": float("inf")}, "softcap=inf: must be finite"),
        (_qkv(), {"impl": "blockwize"}, "(did you mean blockwise?)"),
        (_qkv(dtype="int32"), {"impl": "naive"}, "attention takes floating-point q, k, v"),
        (_qkv(L=0), {"impl": "blockwise"}, "every dimension must be at least 1"),
        # no head: refused before the rule that divides query heads by kv heads
        ((lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]))(*_qkv()), {}, "at least 1"),
        ((lambda q, k, v: (q[:, :, :0], k, v))(*_qkv()), {"impl": "pallas_gpu"}, "at least 1"),
        ((lambda q, k, v: (q[0, 0], k, v))(*_qkv()), {}, "expected [batch, seq, heads, head_dim]"),
        (
            _qkv(L=16, S=32),
            {"impl": "xla", "causal": False, "window": (4, 0)},
            "impl='xla' aligns a window top-left",
        ),
        (
            _qkv(),
            {"impl": "blockwise", "block_sizes": (32, 32)},
            "where impl='blockwise' takes lab.kernels.attention.blockwise.BlockSizes",
        ),
        (_qkv(), {"impl": "naive", "block_sizes": (32, 32)}, "impl='naive' has no tiles"),
        (_qkv(), {"impl": "flash"}, "attention impl='flash': choose one of naive, blockwise"),
        (_qkv(), {"impl": "pallas"}, "impl='pallas' has no compiled kernel on backend 'cpu'"),
        (_qkv(), {"impl": "cudnn"}, "impl='cudnn' has no compiled kernel on backend 'cpu'"),
        (_qkv(), {"impl": "naive", "interpret": True}, "interpret=True applies to impl in"),
        (
            _qkv(D=96),
            {"impl": "pallas_tpu", "interpret": True},
            "pallas_tpu supports q/k head_dim in (64, 128, 256)",
        ),
        (
            _qkv(D=44),
            {"impl": "pallas_gpu", "interpret": True},
            "pallas_gpu supports q/k head_dim a multiple of 8 up to 256",
        ),
        (_qkv(dtype="int32"), {"impl": "blockwise"}, "attention takes floating-point q, k, v"),
        (
            _qkv(dtype="float16"),
            {"impl": "pallas_tpu", "interpret": True},
            "supports dtypes float32, bfloat16",
        ),
    ],
)
def test_bad_input_names_the_constraint(args, kwargs, needle):
    constraint = "shape=|dtype=|impl=|interpret=|window=|softcap=|block_|head_dim "
    with pytest.raises(ValueError, match=constraint) as info:
        attention(*args, **kwargs)
    assert needle in str(info.value)


def test_sinks_may_be_a_list_as_the_mask_arrays_may():
    """sinks=[...] is taken as an array (as q_lengths=[...] is), and a list of the wrong
    length names the rule, not AttributeError: 'list' has no attribute 'shape'."""
    q, k, v = _qkv()
    want = attention(q, k, v, causal=True, impl="naive", sinks=jnp.zeros(4))
    got = attention(q, k, v, causal=True, impl="naive", sinks=[0.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="attention sinks are one logit per query head"):
        attention(q, k, v, causal=True, impl="naive", sinks=[0.0, 0.0, 0.0])
    # a kernel's own entry point takes the list too (the Pallas ones interpreted)
    got = pallas_gpu.flash_attention_gpu(q, k, v, causal=True, sinks=[0.0] * 4, interpret=True)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda: blockwise.BlockSizes(block_q=12), "block_q=12: must be a positive multiple of 8"),
        (lambda: pallas_tpu.BlockSizes(block_k=20), "block_k=20: must be a positive multiple of 8"),
        (lambda: pallas_tpu.BlockSizes(block_k=64).check_compiled(), "needs a multiple of 128"),
        (lambda: pallas_gpu.BlockSizes(block_q=48), "block_q=48: must be a power of two >= 16"),
        (lambda: pallas_gpu.BlockSizes(num_warps=3), "num_warps=3: must be a power of two"),
    ],
)
def test_block_sizes_validate_themselves(make, needle):
    with pytest.raises(ValueError) as info:
        make()
    assert needle in str(info.value)


def test_gpu_block_table_falls_back_to_default():
    assert pallas_gpu.block_sizes_for("no such GPU") == pallas_gpu.BLOCK_SIZES["default"]


# ---------------------------------------------------------------------------- the model switch


def _train_losses(attention_impl: str, steps: int = 3) -> list[float]:
    """A tiny model trained a few steps on one device with the given `attention=`."""
    from few_steps import train_steps

    from lab.config import parse_args

    argv = ["model=tiny", "batch_size=4", "seq_len=64", "dtype=float32", "mesh=1"]
    return train_steps(parse_args([*argv, f"attention={attention_impl}"]), steps)[0]


def test_model_trained_with_blockwise_matches_naive(monkeypatch):
    """attention=blockwise goes through the dispatch, and training follows the same losses.

    The model passes no block sizes, so 16×16 tiles are patched in as the default: the 64-token
    sequence then crosses 4×4 tiles and the causal skip, forward and backward.
    """
    naive = _train_losses("naive")
    tiles = blockwise.BlockSizes(16, 16)
    monkeypatch.setattr(blockwise, "BlockSizes", lambda: tiles)
    calls = []
    real = blockwise.blockwise_attention
    monkeypatch.setattr(
        blockwise, "blockwise_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw)
    )
    got = _train_losses("blockwise")
    assert calls and calls[0]["block_sizes"] == tiles
    np.testing.assert_allclose(got, naive, rtol=2e-5)
    assert got[-1] < got[0]  # it trains


def test_model_with_pallas_on_cpu_says_what_runs_here():
    """No compiled Pallas kernel on CPU, and a model never runs the interpreter: clear error."""
    with pytest.raises(ValueError, match="impl='pallas' has no compiled kernel on backend 'cpu'"):
        _train_losses("pallas", steps=1)


# ---------------------------------------------------------------------------- the benchmark


def test_bench_sweep_records_and_skips_what_does_not_fit(monkeypatch, tmp_path):
    """One tiny point of the sweep: every figure recorded per impl; an impl whose compiled
    program would not fit is compiled, not run (its memory still reported)."""
    from lab.report import plots, tables
    from lab.studies import attention as bench

    # room for blockwise's tiles but not for naive's L×S scores
    monkeypatch.setattr(bench, "_free_bytes", lambda: 2 * 6_000_000)
    records = bench.sweep(
        (384,), causal=(True,), modes=("fwd+bwd",), impls=("naive", "blockwise"),
        budget_s=0.0, min_runs=1, warmup=0,
    )  # fmt: skip
    rows = {r.impl: r for r in bench.rows_of(records)}
    blockwise_row, naive_row = rows["blockwise"], rows["naive"]
    assert blockwise_row.max_error < 1e-5
    assert blockwise_row.tflops > 0 and blockwise_row.ran
    assert not naive_row.ran and "needs" in naive_row.skipped
    assert naive_row.memory_label == "compiled, not run"
    assert naive_row.peak_temp_bytes > blockwise_row.peak_temp_bytes
    table_rows = bench.rows_of(records)
    assert "skipped" in str(tables.attention_sweep(table_rows, "xla", "t").columns[4]._cells)
    assert plots.attention_sweep(table_rows, tmp_path / "a.png", "t").stat().st_size > 0


def _naive_raises(monkeypatch, error: Exception):
    """Make the bench's `naive` contender raise `error` when called (the others compile as
    usual); returns the bench module."""
    from lab.studies import attention as bench

    real = bench._compile

    def compile_one(impl, causal, mode, args, mask_kw=None):
        if impl != "naive":
            return real(impl, causal, mode, args, mask_kw)

        def raises(*_):
            raise error

        return raises, 0.0, None

    monkeypatch.setattr(bench, "_compile", compile_one)
    return bench


def _sweep_naive_and_blockwise(bench, seq: int):
    return bench.sweep(
        (seq,), causal=(True,), modes=("fwd",), impls=("naive", "blockwise"),
        budget_s=0.0, min_runs=1, warmup=0,
    )  # fmt: skip


def test_bench_sweep_drops_a_contender_that_fails_at_its_first_call(monkeypatch):
    """A contender that runs out of memory when first called (as PyTorch's math kernel does
    at long lengths on a GPU, beyond what the compiled-memory check sees) is recorded as
    skipped with its reason, and the others are still timed and checked."""
    oom = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate\nmore")
    bench = _naive_raises(monkeypatch, oom)
    rows = {r.impl: r for r in bench.rows_of(_sweep_naive_and_blockwise(bench, 200))}
    assert rows["blockwise"].ran and rows["blockwise"].max_error < 1e-5
    assert not rows["naive"].ran
    assert rows["naive"].skipped == (
        "out of memory when called: RuntimeError: RESOURCE_EXHAUSTED: Out of memory while"
        " trying to allocate"
    )


def test_bench_sweep_lets_a_contender_s_real_error_surface(monkeypatch):
    """Only running out of memory drops a contender: any other error at its first call is a
    bug in it and stops the sweep, rather than reading as a skipped row."""
    bench = _naive_raises(monkeypatch, ValueError("shapes do not match"))
    with pytest.raises(ValueError, match="shapes do not match"):
        _sweep_naive_and_blockwise(bench, 64)


# ------------------------------------------------------------------ under a multi-device mesh


def test_torch_sdpa_peer_matches_the_reference_and_is_timed_like_jax():
    """The bench's PyTorch peer on this CPU: same numbers in (DLPack), same answers out
    (forward and dQ against float64), and the timer blocks through its block_until_ready."""
    pytest.importorskip("torch", reason="PyTorch not installed: the bench's optional peer")
    from lab.studies import attention as bench

    records = bench.sweep(
        (96,),
        causal=(True, False),
        impls=("xla", "torch_sdpa"),
        shape=bench.Shape(1, 4, 2, 32),
        budget_s=0.01,
    )
    rows = {(r.impl, r.causal, r.mode): r for r in bench.rows_of(records)}
    assert len(rows) == 8
    for (impl, _, _), r in rows.items():
        assert r.max_error < 1e-5, (impl, r)
        assert r.time_s > 0
    assert rows[("torch_sdpa", True, "fwd")].peak_temp_bytes is None
    # its times keep their spread like JAX's, and say the threads and wait policy they ran on:
    # as many threads as JAX's CPU client has cores
    times = [r for r in records if r["what"] == "attention time"]
    assert {r["config"]["impl"] for r in times} == {"xla", "torch_sdpa"}
    for r in times:
        c = r["config"]
        assert c["p10_s"] <= r["value"] <= c["p90_s"] and c["runs"] >= 3, r
    torch_times = [r["config"] for r in times if r["config"]["impl"] == "torch_sdpa"]
    for c in torch_times:
        assert c["torch_threads"] == len(os.sched_getaffinity(0)) and c["omp_wait_policy"]


def test_pytorch_s_openmp_threads_are_told_to_sleep_when_idle_before_it_loads():
    """Spinning OpenMP threads stalled torch_sdpa for whole seconds on a shared 2-core host:
    before PyTorch loads on a busy host the bench sets a passive wait policy, unless the user
    chose one; on a quiet host the peer keeps PyTorch's default; once it is loaded, the policy
    it loaded with is only reported."""
    from lab.studies import attention as bench

    env = {}
    assert bench.wait_policy(False, env, busy=True) == "PASSIVE"
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert bench.wait_policy(False, env, busy=True) == "ACTIVE"
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}
    env = {}
    assert bench.wait_policy(False, env, busy=False) == "PyTorch's default" and env == {}
    assert bench.wait_policy(True, env, busy=True).startswith("unknown") and env == {}


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_pallas_kernel_runs_per_shard_under_a_mesh(impl):
    """A Pallas call is opaque to XLA's partitioner: with `shard_spec` the dispatch runs it on
    each device's batch × heads block under shard_map. Output and grads equal the reference."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 1, 2), ("data", "fsdp", "model"))
    spec = P(("data", "fsdp"), None, "model", None)
    q, k, v, do = random_qkv(11, 48, 48, 4, 2, 64, "float32")
    q, k, v, do = (jnp.concatenate([x, -x[..., ::-1]]) for x in (q, k, v, do))  # batch 2
    mod = pallas_tpu if impl == "pallas_tpu" else pallas_gpu
    bs = (
        TestPallasTpuInterpret.block_sizes
        if mod is pallas_tpu
        else TestPallasGpuInterpret.block_sizes
    )
    fn = functools.partial(
        attention, causal=True, impl=impl, interpret=True, block_sizes=bs, shard_spec=spec
    )
    with jax.set_mesh(mesh):
        q, k, v, do = (jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, do))
        got = output_and_grads(fn, q, k, v, do)
    assert_close(got, reference_f64(q, k, v, do, causal=True), "float32")


EXPLICIT_CASES = [
    ("naive", False),
    ("blockwise", False),
    ("xla", False),
    ("auto", False),
    ("auto", True),
    pytest.param(
        "cpu_flash",
        False,
        marks=pytest.mark.skipif(not cpu_flash.available(), reason="cpu_flash not built"),
    ),
    pytest.param(
        "cpu_flash",
        True,
        marks=pytest.mark.skipif(not cpu_flash.available(), reason="cpu_flash not built"),
    ),
    ("ring", True),
]


@pytest.mark.parametrize("impl, with_spec", EXPLICIT_CASES)
def test_every_cpu_impl_runs_under_a_mesh_with_explicit_axes(impl, with_spec):
    """`jax.make_mesh` gives Explicit axes by default on new JAX, where a reshape or repeat of
    a sharded array needs its output sharding spelled out; the dispatch runs the kernel with
    those axes made Auto. Output (sharded like q) and grads equal the float64 reference, with
    shard_spec and without (ring needs it: it names the sequence axis)."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    seq = "seq" if impl == "ring" else None
    mesh = jax.make_mesh((2, 2, 2), ("data", "seq", "model"), axis_types=(AxisType.Explicit,) * 3)
    spec = P("data", seq, "model", None)
    q, k, v, do = random_qkv(23, 64, 64, 4, 2, 32, "float32")
    q, k, v, do = (jnp.concatenate([x, -x[..., ::-1]]) for x in (q, k, v, do))  # batch 2
    fn = functools.partial(
        attention, causal=True, impl=impl, shard_spec=spec if with_spec else None
    )
    want = reference_f64(q, k, v, do, causal=True)
    with jax.set_mesh(mesh):
        q, k, v, do = (jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, do))
        got = output_and_grads(fn, q, k, v, do)
        assert jax.typeof(got[0]).sharding.spec == spec
    assert_close(got, want, "float32")


def test_explicit_axes_keep_lse_and_mask_arrays():
    """Under Explicit axes the log-sum-exp comes back too, sharded like q's rows, and the mask
    arrays (sharded jax arrays or static NumPy ones) reach the kernel."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    spec = P("data", None, "model", None)
    q, k, v, _ = random_qkv(29, 48, 48, 4, 2, 32, "float32")
    q, k, v = (jnp.concatenate([x, -x[..., ::-1]]) for x in (q, k, v))
    sinks = jax.random.normal(jax.random.key(3), (4,))
    lengths = np.array([40, 17], np.int32)
    kw = dict(causal=True, kv_lengths=lengths, sinks=sinks, return_lse=True)
    want_o, want_lse = attention(q, k, v, impl="naive", **kw)
    with jax.set_mesh(mesh):
        qs, ks, vs = (jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v))
        sharded = jax.device_put(lengths, NamedSharding(mesh, P("data")))
        run = jax.jit(
            lambda q, k, v, lens: attention(q, k, v, impl="blockwise", **{**kw, "kv_lengths": lens})
        )
        eager = functools.partial(attention, impl="blockwise", **kw)  # NumPy lengths: static
        for o, lse in (run(qs, ks, vs, sharded), eager(qs, ks, vs)):
            assert jax.typeof(lse).sharding.spec == P("data", None, "model")
            np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), atol=1e-5)
            np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=1e-5)

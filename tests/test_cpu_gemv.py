"""The native CPU matmul (lab/kernels/cpu_gemv.py) against a float64 reference: float32,
bfloat16 and int8 weights (per-column scales), float32 and bfloat16 activations, lengths that
are not multiples of the vector width; the model's einsums through `lab.quant.matmul`; bad
input one line. Inference only: the kernel has no gradient, so none is tested."""

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab import quant
from lab.kernels import cpu_gemv

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="cpu_gemv is not built here")

# Relative to max |y|. float32 sums of C <= 300 products: ~1e-6. A bfloat16 output rounds to
# 8 bits of mantissa (2^-9 ≈ 2e-3 relative); bfloat16 inputs are exact in the reference (it
# takes the rounded values), so only the output's rounding and f32 sums remain.
TOL = {"float32": 2e-5, "bfloat16": 8e-3}


def _operands(rng, M, C, N, w_dtype, x_dtype):
    x = jnp.asarray(rng.standard_normal((M, C)), x_dtype)
    if w_dtype == "int8":
        w = jnp.asarray(rng.integers(-127, 128, (C, N)), jnp.int8)
        scale = jnp.asarray(rng.uniform(0.001, 0.02, N), jnp.float32)
    else:
        w, scale = jnp.asarray(rng.standard_normal((C, N)), w_dtype), None
    return x, w, scale


# Batch 1 (runs of rows split across parts, each read as long streams with rows left over;
# column strips, each read as long streams, for a contraction too short to split and for an
# output too wide for per-part sums); several rows (register tiles of up
# to 8 rows, blocks of weight rows, a tile of two vectors, of one, and columns left over);
# more than 8 rows (a second tile of rows) over blocks that do not divide the contraction;
# runs of rows split across parts.
@pytest.mark.parametrize(
    "M,C,N",
    [
        (1, 300, 77),
        (1, 301, 77),
        (1, 100, 77),
        (1, 37, 40000),
        (5, 37, 130),
        (11, 75, 200),
        (9, 100, 48),
        (3, 520, 90),
    ],
)
@pytest.mark.parametrize("w_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
def test_matches_the_float64_reference(M, C, N, w_dtype, x_dtype):
    x, w, scale = _operands(np.random.default_rng(M * C + N), M, C, N, w_dtype, x_dtype)
    got = jax.jit(cpu_gemv.cpu_gemv)(x, w, scale)
    assert got.shape == (M, N) and got.dtype == x.dtype
    f32 = lambda a: None if a is None else np.asarray(a.astype(jnp.float32))  # noqa: E731
    want = cpu_gemv.gemv_reference(f32(x), f32(w), f32(scale))
    err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
    assert err < TOL[x_dtype], err


# Batch 1 in each layout, whichever this CPU's build takes by default: the runs of a part's
# rows as four long streams (rows left over when four do not divide it), and sixteen or four
# adjacent rows (prefetched ahead for narrower weights); column strips for a short contraction.
@pytest.mark.parametrize("M,C,N", [(1, 1031, 48), (1, 300, 77), (1, 37, 40000)])
@pytest.mark.parametrize("w_dtype", ["int8", "float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["adjacent", "streams"])
def test_each_batch_one_layout_matches_the_float64_reference(M, C, N, w_dtype, layout, rng):
    x, w, scale = _operands(rng, M, C, N, w_dtype, "float32")
    got = jax.jit(functools.partial(cpu_gemv.cpu_gemv, layout=layout))(x, w, scale)
    f32 = lambda a: None if a is None else np.asarray(a.astype(jnp.float32))  # noqa: E731
    want = cpu_gemv.gemv_reference(f32(x), f32(w), f32(scale))
    err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
    assert err < TOL["float32"], err
    one = cpu_gemv.cpu_gemv(x, w, scale, threads=1, layout=layout)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(one))


def test_the_layout_is_obeyed_and_auto_is_one_of_them():
    """The two layouts add the same products in another order, so their float32 sums differ
    in the last bits: a kernel that ignored `layout` would give one answer for both."""
    x, w, _ = _operands(np.random.default_rng(7), 1, 1031, 48, "float32", "float32")
    got = {k: np.asarray(cpu_gemv.cpu_gemv(x, w, layout=k)) for k in cpu_gemv.LAYOUTS}
    assert (got["streams"] != got["adjacent"]).any()
    assert any((got["auto"] == got[k]).all() for k in ("streams", "adjacent"))


def test_an_unknown_layout_is_one_clear_error(rng):
    x, w, _ = _operands(rng, 1, 8, 4, "float32", "float32")
    with pytest.raises(ValueError, match="layouts are auto, streams, adjacent"):
        cpu_gemv.cpu_gemv(x, w, layout="rows")


@pytest.mark.parametrize("w_dtype", ["float32", "bfloat16", "int8"])
def test_a_transposed_weight_matches_the_float64_reference(w_dtype, rng):
    """w [N, C] (a tied head: the embedding table read in place), N not a multiple of the
    four rows taken at a time, C not a multiple of the vector width."""
    M, C, N = int(rng.integers(1, 6)), 101, 203
    x, w_CxN, scale = _operands(rng, M, C, N, w_dtype, "float32")
    w_NxC = jnp.asarray(w_CxN.T)
    for threads in (0, 1):
        call = functools.partial(cpu_gemv.cpu_gemv, threads=threads, transposed=True)
        got = jax.jit(call)(x, w_NxC, scale)
        f32 = lambda a: None if a is None else np.asarray(a.astype(jnp.float32))  # noqa: E731
        want = cpu_gemv.gemv_reference(f32(x), f32(w_NxC), f32(scale), transposed=True)
        assert got.shape == (M, N)
        err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
        assert err < TOL["float32"], err


# column strips; runs of rows (batch 1 and 3); more rows than a register tile holds
@pytest.mark.parametrize("M,C,N", [(3, 64, 200), (1, 301, 50), (3, 300, 50), (11, 300, 90)])
def test_one_thread_gives_the_same_sums(M, C, N, rng):
    x, w, scale = _operands(rng, M, C, N, "int8", "float32")
    many = cpu_gemv.cpu_gemv(x, w, scale)
    one = cpu_gemv.cpu_gemv(x, w, scale, threads=1)
    np.testing.assert_array_equal(np.asarray(many), np.asarray(one))


@pytest.mark.parametrize("name", ["wq", "wo", "w_down", "head", "embed"])
def test_the_models_einsums_through_quant_matmul(name):
    """quant.matmul with the native kernel gives the einsum's result for the model's weight
    layouts (several contracted or output axes; a tied head's table [V, D]), float and int8."""
    eqn = quant.TIED_HEAD if name == "embed" else quant.EINSUMS[name]
    shapes = {"wq": (16, 4, 8), "wo": (4, 8, 16), "w_down": (48, 16), "head": (16, 40)}
    shapes["embed"] = (40, 16)
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal(shapes[name]), jnp.float32)
    x_subs = eqn.split(",")[0]
    dims = dict(zip(eqn.split(",")[1].split("->")[0], shapes[name], strict=True))
    x = jnp.asarray(
        rng.standard_normal([{"b": 2, "l": 1}.get(c) or dims[c] for c in x_subs]), jnp.float32
    )
    native = quant.Matmuls(native=cpu_gemv.model_matmul)
    for weight in (w, quant.quantize_params({name: w})[name]):
        want = quant.matmul(eqn, x, weight, jnp.float32)
        with quant.using(native):
            got = jax.jit(lambda x, w: quant.matmul(eqn, x, w, jnp.float32))(x, weight)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_many_rows_and_an_unbuilt_kernel_leave_it_to_xla(monkeypatch):
    x = jnp.ones((cpu_gemv.MAX_ROWS + 1, 8), jnp.float32)
    assert cpu_gemv.model_matmul(x, jnp.ones((8, 4)), None, jnp.float32) is None
    monkeypatch.setattr(cpu_gemv, "available", lambda: False)
    assert cpu_gemv.model_matmul(x[:1], jnp.ones((8, 4)), None, jnp.float32) is None


@pytest.mark.parametrize(
    "x,w,scale,words",
    [
        ((2, 8), (9, 4), None, "multiplies x [M, C] by w [C, N]"),
        ((2, 8), (8, 4), (4,), "need a scale per column"),
        ((2, 8), ("int8", 8, 4), None, "need a scale per column"),
        ((2, 8), ("int8", 8, 4), (5,), "one scale per output column"),
        (("int32", 2, 8), (8, 4), None, "float32 or bfloat16 activations"),
    ],
)
def test_bad_input_is_one_line(x, w, scale, words):
    def make(spec):
        if spec is None:
            return None
        dtype, shape = (spec[0], spec[1:]) if isinstance(spec[0], str) else ("float32", spec)
        return jnp.ones(shape, dtype)

    with pytest.raises(ValueError, match=re.escape(words)):
        cpu_gemv.cpu_gemv(make(x), make(w), make(scale))


@pytest.mark.parametrize("text", ["abc", "-2", "0", "1.5", "4x", "1_000"])
def test_a_thread_count_that_is_not_one_is_refused_in_one_line(monkeypatch, text):
    """The C++ kernel would read these as 0 and take every core without a word."""
    from lab.kernels import native

    monkeypatch.setenv("LAB_CPU_GEMV_THREADS", text)
    want = f"^LAB_CPU_GEMV_THREADS='{re.escape(text)}': must be a whole number of threads"
    with pytest.raises(ValueError, match=want):
        native.threads_from_env("LAB_CPU_GEMV_THREADS")
    with pytest.raises(ValueError, match=want):
        cpu_gemv.available()


def test_a_thread_count_past_four_per_core_is_cut_and_said_once(monkeypatch, capsys):
    """Each thread is an OS thread: a count mistyped by digits would starve the host."""
    from lab.kernels import native

    monkeypatch.setattr(native.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(native, "_SAID", set())
    for text, want in [("", None), (" 3 ", 3), ("8", 8)]:
        monkeypatch.setenv("LAB_CPU_GEMV_THREADS", text)
        assert native.threads_from_env("LAB_CPU_GEMV_THREADS") == want
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("LAB_CPU_GEMV_THREADS", "9")
    assert native.threads_from_env("LAB_CPU_GEMV_THREADS") == 8
    assert native.threads_from_env("LAB_CPU_GEMV_THREADS") == 8
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "lab: LAB_CPU_GEMV_THREADS=9 is more than 4 threads per core of this host's 2: "
        "the kernel runs 8"
    ]


def test_a_bad_thread_count_stops_a_program_before_the_kernel_runs():
    import subprocess
    import sys

    code = (
        "import jax.numpy as jnp; from lab.kernels import cpu_gemv; "
        "cpu_gemv.cpu_gemv(jnp.ones((1, 8)), jnp.ones((8, 4)))"
    )
    env = {**os.environ, "LAB_CPU_GEMV_THREADS": "abc", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "lab.errors.ConfigError: LAB_CPU_GEMV_THREADS='abc': must be a whole number of "
        "threads, at least 1 (unset: one per core)"
    )


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_the_kernel_itself_cuts_a_count_set_past_the_python_check():
    """A variable changed after the program was traced is read by the C++ kernel alone: its
    pool still starts at most 4 threads per core (the caller is one of them). Counted in a
    fresh process, as the pool is started once per process; one above the cap, so the run
    starts few threads on any host."""
    import os
    import subprocess
    import sys

    from lab.kernels import native

    cap = native.max_threads()
    code = f"""
import os
import jax, jax.numpy as jnp
from lab.kernels import cpu_gemv
x, w = jnp.ones((1, 64)), jnp.ones((64, 64))
run = jax.jit(cpu_gemv.cpu_gemv).lower(x, w).compile()
jnp.dot(x, w).block_until_ready()
before = len(os.listdir("/proc/self/task"))
os.environ["LAB_CPU_GEMV_THREADS"] = "{cap + 1}"
run(x, w).block_until_ready()
print(len(os.listdir("/proc/self/task")) - before)
"""
    env = {k: v for k, v in os.environ.items() if k != "LAB_CPU_GEMV_THREADS"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) == cap - 1  # the pool's workers beside the caller

"""Small-batch matmul in C++ for the CPU (cpu_gemv.cc), called through XLA's FFI (`jax.ffi`):
decode's matmuls, which are memory-bound.

Why it exists: a decode step multiplies a few rows of activations by every weight of the model,
so its speed is the rate the weights stream from memory. XLA:CPU reached ~50–65% of the copy
roof with float32 weights, and with int8 weights it converts the whole weight to float before
each dot (a dequantised copy written and read again every step), which made int8 decode
~10× *slower* than float32 where it should be ~4× faster. This kernel reads each weight once in
its own dtype (float32, bfloat16, or int8 codes with one float32 scale per output column),
widens it in registers, sums in float32 and multiplies the scale into the sum (it is constant
along the contraction), threaded over output columns.

    y[M, N] = x[M, C] · w[C, N] (· scale[N]),   x float32 or bfloat16, y in x's dtype
    transposed=True: w is [N, C] (a tied model's head: the embedding table read in place,
    each output channel a contiguous row; no transposed copy made every step)

Inference only: the op has no gradient (no custom_vjp), and `jax.grad` through it is an error.
Decoding never differentiates; training keeps XLA's dot.

Build: lab/kernels/native.py (first use, cached; no compiler: one line, `available()` is False
and the callers keep XLA's dot). LAB_CPU_GEMV=0 turns it off; LAB_CPU_GEMV_THREADS sets the
thread count (default: the host's cores; a whole number >= 1, at most 4 per core: more is cut
to that, said once, since each is an OS thread; anything else is refused when the kernel is
first asked for).
"""

import ctypes
import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from lab.kernels import native

SOURCE = Path(__file__).with_name("cpu_gemv.cc")
X_DTYPES = (jnp.float32, jnp.bfloat16)
W_DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8)
_TARGET = "lab_cpu_gemv"
# The same library holds decode attention over the float or int8 cache (one build, one thread
# pool): lab/kernels/attention/decode.py `decode_attention_cpu` calls it.
ATTENTION_TARGET = "lab_cpu_decode_attention"
_WHAT = "cpu_gemv matmul kernel"


def available() -> bool:
    """Whether the kernel is built and registered with XLA (builds it on the first call). A
    ConfigError (one line) where LAB_CPU_GEMV_THREADS is not a thread count
    (native.threads_from_env): the kernel would ignore it, or start that many threads."""
    if os.environ.get("LAB_CPU_GEMV") == "0":
        return False
    native.threads_from_env("LAB_CPU_GEMV_THREADS")
    return _registered()


@functools.cache
def _registered() -> bool:
    lib_path = native.build(
        SOURCE,
        what=_WHAT,
        fallback="decode's matmuls run XLA's dot",
        cxx=native.compiler(),
        compile_fn=lambda cxx, opt, out: native.compile_library(cxx, opt, SOURCE, out, _WHAT),
        portable=os.environ.get("LAB_CPU_GEMV_PORTABLE") == "1",
    )
    if lib_path is None:
        return False
    lib = ctypes.cdll.LoadLibrary(str(lib_path))
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.LabCpuGemv), platform="cpu")
    jax.ffi.register_ffi_target(
        ATTENTION_TARGET, jax.ffi.pycapsule(lib.LabCpuDecodeAttention), platform="cpu"
    )
    return True


def check_inputs(x_MxC, w_CxN, scale_N=None, *, transposed: bool = False) -> None:
    """ValueError naming what this kernel does not take, or that it is not built here."""
    c_axis, n_axis = (1, 0) if transposed else (0, 1)
    if x_MxC.ndim != 2 or w_CxN.ndim != 2 or x_MxC.shape[1] != w_CxN.shape[c_axis]:
        layout = "w [N, C] (transposed)" if transposed else "w [C, N]"
        raise ValueError(f"{x_MxC.shape=} {w_CxN.shape=}: cpu_gemv multiplies x [M, C] by {layout}")
    if x_MxC.dtype not in X_DTYPES:
        raise ValueError(f"{x_MxC.dtype=}: cpu_gemv takes float32 or bfloat16 activations")
    if w_CxN.dtype not in W_DTYPES:
        raise ValueError(f"{w_CxN.dtype=}: cpu_gemv takes float32, bfloat16 or int8 weights")
    if (w_CxN.dtype == jnp.int8) != (scale_N is not None):
        raise ValueError(f"{w_CxN.dtype=}: int8 weights need a scale per column, floats none")
    if scale_N is not None and scale_N.shape != (w_CxN.shape[n_axis],):
        raise ValueError(f"{scale_N.shape=} {w_CxN.shape=}: one scale per output column")
    if not available():
        raise ValueError(
            "cpu_gemv is not built here (no C++ compiler, a failed build, or LAB_CPU_GEMV=0)"
        )


# How a batch of one reads its weight rows (cpu_gemv.cc, `long_streams`): "auto" takes what
# was measured fastest on the CPU it runs on; the others are there to test and time each.
LAYOUTS = {"auto": 0, "streams": 1, "adjacent": 2}


def cpu_gemv(
    x_MxC,
    w_CxN,
    scale_N=None,
    *,
    threads: int = 0,
    transposed: bool = False,
    layout: str = "auto",
):
    """x · w (· scale per column) on the CPU, float32 sums, in x's dtype; `transposed`: w is
    [N, C] and y = x · wᵀ. `threads` 0: every core (or LAB_CPU_GEMV_THREADS). `layout`: how
    a batch of one reads the rows of a [C, N] weight (LAYOUTS; the same products, added in
    another order, so float32 rounding may differ in the last bits); several rows of x and
    a transposed weight have one layout each and ignore it."""
    if layout not in LAYOUTS:
        raise ValueError(f"{layout=}: cpu_gemv's layouts are {', '.join(LAYOUTS)}")
    check_inputs(x_MxC, w_CxN, scale_N, transposed=transposed)
    scale = jnp.zeros((0,), jnp.float32) if scale_N is None else scale_N.astype(jnp.float32)
    n = w_CxN.shape[0 if transposed else 1]
    out = jax.ShapeDtypeStruct((x_MxC.shape[0], n), x_MxC.dtype)
    call = jax.ffi.ffi_call(_TARGET, out, vmap_method="sequential")
    return call(
        x_MxC,
        w_CxN,
        scale,
        threads=np.int64(threads),
        transposed=np.int64(bool(transposed)),
        layout=np.int64(LAYOUTS[layout]),
    )


def gemv_reference(x_MxC, w_CxN, scale_N=None, *, transposed: bool = False):
    """The same product in float64 with numpy (the tests' reference)."""
    w = np.asarray(w_CxN, np.float64)
    y = np.asarray(x_MxC, np.float64) @ (w.T if transposed else w)
    return y if scale_N is None else y * np.asarray(scale_N, np.float64)


MAX_ROWS = 16  # rows of x the kernel takes in a model: decode's; prefill's many rows use XLA


def model_matmul(x_MxC, w_CxN, scale_N, dtype, *, threads: int = 0, transposed: bool = False):
    """`lab.quant.Matmuls.native`: y [M, N] in `dtype` through this kernel, or None where it
    does not take the operands (more than MAX_ROWS rows, other dtypes, not built);
    `transposed`: w is [N, C]."""
    ok = (
        x_MxC.shape[0] <= MAX_ROWS
        and jnp.dtype(dtype) in X_DTYPES
        and w_CxN.dtype in W_DTYPES
        and available()
    )
    if not ok:
        return None
    return cpu_gemv(x_MxC.astype(dtype), w_CxN, scale_N, threads=threads, transposed=transposed)

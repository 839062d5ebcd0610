"""Flash attention in C++ for the CPU (cpu_flash.cc), called through XLA's FFI (`jax.ffi`).

Why it exists: on CPU the lab's JAX kernel (`blockwise`) ran at 0.34–0.53× the speed of
PyTorch's scaled_dot_product_attention fwd+bwd (2-core host, B1 H8 K64 f32, S 2k–8k); XLA:CPU
compiles its tiles into loops that do not keep a tile in registers. This kernel packs each tile
into f32, multiplies in a register-blocked micro-kernel and runs the online softmax on the
packed tile, over std::threads (batch × heads × query blocks). Forward saves the log-sum-exp;
the backward is FlashAttention-2's: a dQ pass over query blocks and a dK/dV pass over key
blocks. Grouped-query heads read their kv head in place (no repeat); bottom-right causal mask
and block skipping as `common.Geometry`; any length; f32 and bf16 (f32 accumulation).

Build: the source ships in the package and is compiled on first use by the system C++
compiler (`$CXX`, else c++ / g++ / clang++) into `~/.cache/lab-kernels/<key>/` (or
`$LAB_KERNEL_CACHE`), keyed by the source, the flags, jaxlib's version and the host CPU; a file
lock and an atomic rename let parallel test workers share one build. `-O3 -march=native`,
falling back to a portable `-O3` build (forced with LAB_CPU_FLASH_PORTABLE=1). No compiler, or
a failed build: one line on stderr, `available()` is False and `auto` keeps `blockwise`.
LAB_CPU_FLASH=0 turns the kernel off; LAB_CPU_FLASH_THREADS sets the thread count (default:
the host's cores).
"""

import ctypes
import dataclasses
import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from lab.kernels import native
from lab.kernels.attention.common import check_dtype, check_qkv, default_scale, round_up

SOURCE = Path(__file__).with_name("cpu_flash.cc")
DTYPES = (jnp.float32, jnp.bfloat16)
ALIGN = 32  # block sizes are multiples of this (the C++ micro-kernel's tile)
_FWD, _BWD = "lab_cpu_flash_forward", "lab_cpu_flash_backward"
_WHAT = "cpu_flash attention kernel"


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile of the score matrix one thread holds; both shrink to the (32-rounded) lengths."""

    block_q: int = 128  # query rows per tile
    block_k: int = 128  # key columns per tile

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value % ALIGN:
                raise ValueError(f"BlockSizes.{name}={value!r}: must be a positive multiple of 32")

    def fit(self, L: int, S: int) -> tuple[int, int]:
        return min(self.block_q, round_up(max(L, 1), ALIGN)), min(
            self.block_k, round_up(max(S, 1), ALIGN)
        )


# ---------------------------------------------------------------------------- build


def _compiler() -> str | None:
    return native.compiler()


def _compile(cxx: str, opt: list[str], out: Path) -> str | None:
    """Build the library at `out` (atomically); the compiler's first error line, or None."""
    return native.compile_library(cxx, opt, SOURCE, out, _WHAT)


def _build() -> Path | None:
    """The compiled library, built now if no cached one matches; None (one line printed) if
    there is no compiler or the build fails (lab/kernels/native.py)."""
    return native.build(
        SOURCE,
        what=_WHAT,
        fallback="CPU attention runs the JAX kernels",
        cxx=_compiler(),
        compile_fn=_compile,
        portable=os.environ.get("LAB_CPU_FLASH_PORTABLE") == "1",
    )


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered with XLA (builds it on the first call)."""
    if os.environ.get("LAB_CPU_FLASH") == "0":
        return False
    lib_path = _build()
    if lib_path is None:
        return False
    lib = ctypes.cdll.LoadLibrary(str(lib_path))
    jax.ffi.register_ffi_target(_FWD, jax.ffi.pycapsule(lib.LabCpuFlashForward), platform="cpu")
    jax.ffi.register_ffi_target(_BWD, jax.ffi.pycapsule(lib.LabCpuFlashBackward), platform="cpu")
    return True


# ---------------------------------------------------------------------------- the op


@dataclasses.dataclass(frozen=True)
class _Static:
    """What the C++ kernel takes as attributes (hashable: a custom_vjp static argument)."""

    causal: bool
    scale: float
    block_q: int
    block_k: int

    def attrs(self) -> dict:
        return dict(
            causal=np.int64(self.causal),
            scale=np.float32(self.scale),
            block_q=np.int64(self.block_q),
            block_k=np.int64(self.block_k),
            threads=np.int64(0),  # 0: LAB_CPU_FLASH_THREADS or every core
        )


def _forward(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, st: _Static):
    """(out [B, L, H, K], lse [B, H, L] f32); vmap adds leading axes the kernel folds into B."""
    *lead, L, H, _ = q_BxLxHxK.shape
    out = (
        jax.ShapeDtypeStruct(q_BxLxHxK.shape, q_BxLxHxK.dtype),
        jax.ShapeDtypeStruct((*lead, H, L), jnp.float32),
    )
    call = jax.ffi.ffi_call(_FWD, out, vmap_method="broadcast_all")
    return call(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, **st.attrs())


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, st: _Static):
    return _forward(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, st)[0]


def _flash_fwd(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, st: _Static):
    o_BxLxHxK, lse_BxHxL = _forward(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, st)
    return o_BxLxHxK, (q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, o_BxLxHxK, lse_BxHxL)


def _flash_bwd(st: _Static, residuals, do_BxLxHxK):
    q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, _, _ = residuals
    out = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q_BxLxHxK, k_BxSxGxK, v_BxSxGxK))
    call = jax.ffi.ffi_call(_BWD, out, vmap_method="broadcast_all")
    return call(*residuals, do_BxLxHxK.astype(q_BxLxHxK.dtype), **st.attrs())


_flash.defvjp(_flash_fwd, _flash_bwd)


def check_inputs(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, *, causal: bool) -> None:
    """ValueError naming what this kernel does not take, or that it is not built here."""
    check_qkv(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal=causal)
    check_dtype(q_BxLxHxK, DTYPES, "cpu_flash")
    if not available():
        raise ValueError(
            "attention impl='cpu_flash' is not built here (no C++ compiler, a failed build, "
            "or LAB_CPU_FLASH=0): use blockwise"
        )


@functools.partial(jax.jit, static_argnames=("causal", "scale", "block_sizes"))
def cpu_flash_attention(
    q_BxLxHxK,
    k_BxSxGxK,
    v_BxSxGxK,
    *,
    causal: bool = True,
    scale: float | None = None,
    block_sizes: BlockSizes = BlockSizes(),
):
    """softmax(Q·Kᵀ·scale)·V, [batch, seq, heads, head_dim], grouped kv heads, any length."""
    check_inputs(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal=causal)
    L, K = q_BxLxHxK.shape[1], q_BxLxHxK.shape[3]
    bq, bk = block_sizes.fit(L, k_BxSxGxK.shape[1])
    st = _Static(causal=causal, scale=default_scale(K, scale), block_q=bq, block_k=bk)
    return _flash(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, st)

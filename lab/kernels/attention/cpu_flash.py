"""Flash attention in C++ for the CPU (cpu_flash.cc), called through XLA's FFI (`jax.ffi`).

Why it exists: on CPU the lab's JAX kernel (`blockwise`) ran at 0.34–0.53× the speed of
PyTorch's scaled_dot_product_attention fwd+bwd (2-core host, B1 H8 K64 f32, S 2k–8k); XLA:CPU
compiles its tiles into loops that do not keep a tile in registers. This kernel packs each tile
into f32, multiplies in a register-blocked micro-kernel and runs the online softmax on the
packed tile, over XLA's own intra-op threads (the FFI's thread pool; std::threads where a
call has none), batch × heads × query blocks. Forward saves the log-sum-exp;
the backward is FlashAttention-2's, recomputing the probabilities: one pass over key blocks
that adds dQ beside dK and dV where the (batch, kv head) items spread evenly over the threads
(5 products a tile), else a dQ pass over query blocks and a dK/dV pass over key blocks (7).
Grouped-query heads read their kv head in place (no repeat); masks as `common.Mask` (causal
bottom-right, a sliding window, segment ids, lengths) with the tiles to skip or mask from its
block map; any length; f32 and bf16 (f32 accumulation).

Build: the source ships in the package and is compiled on first use by the system C++
compiler (`$CXX`, else c++ / g++ / clang++) into `~/.cache/lab-kernels/<key>/` (or
`$LAB_KERNEL_CACHE`), keyed by the source, the flags, jaxlib's version and the host CPU; a file
lock and an atomic rename let parallel test workers share one build. `-O3 -march=native`,
falling back to a portable `-O3` build (forced with LAB_CPU_FLASH_PORTABLE=1). No compiler: one
line on stderr; a failed build: each attempt's "building" line, then one saying it failed.
Either way `available()` is False and `auto` keeps `blockwise`.
LAB_CPU_FLASH=0 turns the kernel off; LAB_CPU_FLASH_THREADS sets the thread count (default:
the host's cores; on XLA's pool, at most its threads and the caller take part; a whole number
>= 1, at most 4 per core: more is cut to that, said once, since each may be an OS thread;
anything else is refused when the kernel is first asked for);
LAB_CPU_FLASH_BACKWARD=fused or two-pass forces the backward's form (unset or empty: chosen
as above; any other value is refused when the kernel is first asked for).
"""

import ctypes
import dataclasses
import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from lab.errors import ConfigError
from lab.kernels import native, varying
from lab.kernels.attention.common import (
    Mask,
    check_dtype,
    check_qkv,
    check_sinks,
    check_softcap,
    default_scale,
    round_up,
    sink_grad,
    sink_output,
    with_causal,
)

SOURCE = Path(__file__).with_name("cpu_flash.cc")
DTYPES = (jnp.float32, jnp.bfloat16)
ALIGN = 32  # block sizes are multiples of this (the C++ micro-kernel's tile)
_FWD, _BWD = "lab_cpu_flash_forward", "lab_cpu_flash_backward"
_WHAT = "cpu_flash attention kernel"


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile of the score matrix one thread holds; both shrink to the (32-rounded) lengths.

    `block_k` None: 128 keys under a causal or window mask, 256 without one. A tile on the
    mask's diagonal is computed whole and masked, so under a band narrower tiles waste less
    (forward, S = 2048, B1 H8 f32 causal on a 2-core AMD EPYC: 62 ms at 128 × 128, 64 ms at
    128 × 256); without one, wider tiles halve the per-tile work of the online softmax (the
    output's rescale, the micro-kernel's loads and stores of the sums) and the forward ran
    3–6% faster at S = 2048–8192, K = 64 and 128 (512: within 1% of 256). The backward's time
    did not move with it."""

    block_q: int = 128  # query rows per tile
    block_k: int | None = None  # key columns per tile

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if value is None and name == "block_k":
                continue
            if not isinstance(value, int) or value <= 0 or value % ALIGN:
                raise ValueError(f"BlockSizes.{name}={value!r}: must be a positive multiple of 32")

    def fit(self, L: int, S: int, banded: bool = True) -> tuple[int, int]:
        """(block_q, block_k) for L queries and S keys; `banded`: a causal or window mask."""
        block_k = self.block_k or (128 if banded else 256)
        return min(self.block_q, round_up(max(L, 1), ALIGN)), min(
            block_k, round_up(max(S, 1), ALIGN)
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


def available() -> bool:
    """Whether the kernel is built and registered with XLA (builds it on the first call). A
    ConfigError (one line) where LAB_CPU_FLASH_THREADS is not a thread count
    (native.threads_from_env): the kernel would ignore it, or start that many threads; or
    where LAB_CPU_FLASH_BACKWARD names no form."""
    if os.environ.get("LAB_CPU_FLASH") == "0":
        return False
    native.threads_from_env("LAB_CPU_FLASH_THREADS")
    form = os.environ.get("LAB_CPU_FLASH_BACKWARD", "")  # as the kernel reads it: unstripped
    if form not in ("", "fused", "two-pass"):  # the kernel would choose without a word
        raise ConfigError(
            f"LAB_CPU_FLASH_BACKWARD={form!r}: must be fused or two-pass (unset: chosen by the "
            "shape)"
        )
    return _registered()


@functools.cache
def _registered() -> bool:
    lib_path = _build()
    if lib_path is None:
        return False
    lib = ctypes.cdll.LoadLibrary(str(lib_path))
    jax.ffi.register_ffi_target(_FWD, jax.ffi.pycapsule(lib.LabCpuFlashForward), platform="cpu")
    jax.ffi.register_ffi_target(_BWD, jax.ffi.pycapsule(lib.LabCpuFlashBackward), platform="cpu")
    return True


# ---------------------------------------------------------------------------- the op


FEATURES = frozenset({"empty_rows", "segments", "lengths", "window", "softcap", "sinks"})


@dataclasses.dataclass(frozen=True)
class _Static:
    """What the C++ kernel takes as attributes (hashable: a custom_vjp static argument)."""

    causal: bool
    scale: float
    block_q: int
    block_k: int
    lo: int | None = None  # the mask's band (common.Mask.band): key offsets from the diagonal
    hi: int | None = None
    softcap: float | None = None  # scores -> softcap · tanh(scores / softcap)

    def attrs(self) -> dict:
        return dict(
            causal=np.int64(self.causal),
            scale=np.float32(self.scale),
            block_q=np.int64(self.block_q),
            block_k=np.int64(self.block_k),
            threads=np.int64(0),  # 0: LAB_CPU_FLASH_THREADS or every core
            has_lo=np.int64(self.lo is not None),
            lo=np.int64(self.lo or 0),
            has_hi=np.int64(self.hi is not None),
            hi=np.int64(self.hi or 0),
            softcap=np.float32(self.softcap or 0.0),
        )


def _mask_arrays(mask: Mask, B: int, L: int, S: int, st: _Static) -> tuple:
    """What the C++ kernel reads of the mask, every array int32 and per sequence: segment ids
    [B, L] and [B, S] (0 without), lengths [B] (L and S without), the block map [B, nq, nk]."""
    i32 = jnp.int32
    q_seg = jnp.zeros((B, L), i32) if not mask.segments else mask.q_segment_ids.astype(i32)
    kv_seg = jnp.zeros((B, S), i32) if not mask.segments else mask.kv_segment_ids.astype(i32)
    q_len = jnp.full((B,), L, i32) if mask.q_lengths is None else mask.q_lengths.astype(i32)
    kv_len = jnp.full((B,), S, i32) if mask.kv_lengths is None else mask.kv_lengths.astype(i32)
    kind = mask.block_map(L, S, st.block_q, st.block_k).kind
    kind = jnp.broadcast_to(jnp.asarray(kind, i32), (B, *kind.shape[1:]))
    return q_seg, kv_seg, q_len, kv_len, kind


def _forward(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, m, st: _Static):
    """(out [B, L, H, K], lse [B, H, L] f32); vmap adds leading axes the kernel folds into B."""
    *lead, L, H, _ = q_BxLxHxK.shape
    out = (
        jax.ShapeDtypeStruct(q_BxLxHxK.shape, q_BxLxHxK.dtype),
        jax.ShapeDtypeStruct((*lead, H, L), jnp.float32),
    )
    call = jax.ffi.ffi_call(_FWD, out, vmap_method="broadcast_all")
    ins = (q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, *m)
    return varying.like(call(*ins, **st.attrs()), *ins)  # varying as its inputs (shard_map)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, sinks_H, m, st: _Static):
    """The output [B, L, H, K], differentiable. `sinks_H` (or None): one logit per query head
    in every row's softmax denominator, folded into the C++ forward's output and log-sum-exp
    (common.fold_sinks: exact); fed those as its residuals, the C++ backward computes exact
    dQ, dK, dV unchanged, and the sinks' gradient is -Σ P_sink·delta per head (here in JAX)."""
    return _flash_fwd(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, sinks_H, m, st)[0]


def _flash_fwd(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, sinks_H, m, st: _Static):
    o_BxLxHxK, lse_BxHxL = _forward(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, m, st)
    if sinks_H is not None:
        o_BxLxHxK, lse_BxHxL = sink_output(o_BxLxHxK, lse_BxHxL, sinks_H)
    residuals = (q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, o_BxLxHxK, lse_BxHxL, sinks_H, m)
    return o_BxLxHxK, residuals


def _flash_bwd(st: _Static, residuals, do_BxLxHxK):
    *residuals, sinks_H, m = residuals
    q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, o_BxLxHxK, lse_BxHxL = residuals
    out = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q_BxLxHxK, k_BxSxGxK, v_BxSxGxK))
    call = jax.ffi.ffi_call(_BWD, out, vmap_method="broadcast_all")
    do_BxLxHxK = do_BxLxHxK.astype(q_BxLxHxK.dtype)
    ins = (*residuals, do_BxLxHxK, *m)
    grads = varying.like(call(*ins, **st.attrs()), *ins)
    dsinks_H = None
    if sinks_H is not None:  # delta as the C++ backward computes it, Σ dO·O per row
        delta_BxLxH = (do_BxLxHxK.astype(jnp.float32) * o_BxLxHxK.astype(jnp.float32)).sum(-1)
        per_row_BxHxL = sink_grad(sinks_H[:, None], lse_BxHxL, jnp.swapaxes(delta_BxLxH, -1, -2))
        lead = tuple(range(per_row_BxHxL.ndim - 2))
        dsinks_H = per_row_BxHxL.sum((*lead, per_row_BxHxL.ndim - 1)).astype(sinks_H.dtype)
    primals = (q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, sinks_H)
    return (*varying.reduce_like((*grads, dsinks_H), primals), None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def check_inputs(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, *, causal: bool) -> None:
    """ValueError naming what this kernel does not take, or that it is not built here."""
    check_qkv(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal=causal, empty_rows=True)
    check_dtype(q_BxLxHxK, DTYPES, "cpu_flash")
    if not available():
        raise ValueError(
            "attention impl='cpu_flash' is not built here (no C++ compiler, a failed build, "
            "or LAB_CPU_FLASH=0): use blockwise"
        )


@functools.partial(jax.jit, static_argnames=("causal", "scale", "block_sizes", "softcap"))
def cpu_flash_attention(
    q_BxLxHxK,
    k_BxSxGxK,
    v_BxSxGxK,
    *,
    causal: bool = True,
    scale: float | None = None,
    block_sizes: BlockSizes = BlockSizes(),
    mask: Mask | None = None,
    softcap: float | None = None,
    sinks=None,
):
    """softmax(Q·Kᵀ·scale)·V, [batch, seq, heads, head_dim], grouped kv heads, any length.

    `mask` (common.Mask: causal, a sliding window, segment ids, lengths), combined with
    `causal` (causal when either is: common.with_causal; a non-causal mask needs
    causal=False); tiles its block map leaves empty are skipped in the forward and both
    backward passes, only partial ones are masked, and a row that sees no key gives 0. `softcap`:
    scores become softcap·tanh(scores/softcap) after scaling (gradient included). `sinks`
    [heads]: one learned logit per query head in every row's softmax denominator (its
    gradient included), folded in around the C++ kernel exactly through its log-sum-exp."""
    mask = with_causal(mask, causal)
    check_inputs(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal=mask.causal)
    B, L, _, K = q_BxLxHxK.shape
    S = k_BxSxGxK.shape[1]
    mask.check(B, L, S)
    sinks = check_sinks(sinks, q_BxLxHxK.shape[2])
    lo, hi = mask.band(L, S)
    bq, bk = block_sizes.fit(L, S, banded=lo is not None or hi is not None)
    cap = check_softcap(softcap)  # called directly: as `attention` checks it
    st = _Static(mask.causal, default_scale(K, scale), bq, bk, lo, hi, cap)
    m = _mask_arrays(mask, B, L, S, st)
    return _flash(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, sinks, m, st)

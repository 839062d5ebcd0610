"""Attention dispatch: one call, several implementations (see DESIGN.md).

impl            what runs
--------------  ---------------------------------------------------------------------------
naive           reference.py: the full L×S score matrix (memory quadratic in length)
blockwise       blockwise.py: flash algorithm in pure JAX, any backend, memory linear
pallas          the Pallas kernel of this backend: pallas_tpu on TPU; on GPU pallas_mgpu on
                Hopper where it takes the input (bf16/f16, head_dim 64/128/256), else pallas_gpu
pallas_tpu      pallas_tpu.py: Mosaic kernel (TPU; elsewhere only with interpret=True)
pallas_gpu      pallas_gpu.py: Triton kernel, any NVIDIA GPU since Volta (elsewhere only with
                interpret=True)
pallas_mgpu     pallas_mgpu.py: Mosaic GPU kernel for Hopper (H100/H200: TMA, wgmma, warp
                specialisation); elsewhere only with interpret=True, from jax 0.11
xla, cudnn      jax.nn.dot_product_attention(implementation=...): the library baselines
ring            ring.py: context parallel, the sequence split over a mesh axis (`shard_spec`
                names it), K/V blocks passed around the ring, each by the blockwise kernel
cpu_flash       cpu_flash.py: native CPU kernel, flash attention in C++ (cpu_flash.cc) called
                through jax.ffi; compiled on first use by the system C++ compiler, absent
                (one line on stderr) where there is none; f32 and bf16
auto            the best available for the backend, never an interpreted kernel:
                TPU -> pallas_tpu; GPU -> cudnn where its constraints hold (bf16/f16,
                head_dim <= 128) and cuDNN is here, else the GPU's pallas (pallas_mgpu on
                Hopper, pallas_gpu otherwise); CPU -> cpu_flash where it is built and
                takes the input (f32/bf16; q, k, v whole sequences per device), which
                measured faster than blockwise and PyTorch's SDPA (BENCHMARKS.md), else
                blockwise, which measured faster than naive and xla for fwd+bwd at every
                length from 512 to 16384 on the lab's 2-core CPU (0.95x naive at 512 full,
                0.17x at 16384 causal; f32, H=2, K=64: `python -m lab.tools.attention_bench`),
                and within 10% of it at 256. Falls back to blockwise when the chosen kernel
                does not take the input (dtype, head_dim).

The toolchain counts too: ptxas of CUDA 12.8.0 up to 12.9.1 miscompiles pallas_mgpu's masks
(lab/measure/toolchain.py). There `impl=pallas_mgpu` with causal=True or any other mask (a
window, lengths, segment ids, padded keys: `_masked`) is refused (one line naming the
ptxas and the way out), and `auto`/`pallas` pass it over for the next kernel that takes the
input; `choose_noted` says so, and lab.run's header and the attention plan print it.
Interpreted kernels run no ptxas and are not checked.

Masks and features (common.Mask; keyword arguments of `attention`): causal, a sliding window,
segment ids (packed sequences), per-sequence lengths, causal with L > S (rows with no key give
0), soft-capping, attention sinks, the log-sum-exp as an output, a value head dim of its own.
Each implementation lists what it takes in its module's FEATURES (naive, blockwise, ring: all;
cpu_flash: the masks, softcap and sinks; xla/cudnn: lengths and a window, what
jax.nn.dot_product_attention takes; the Pallas kernels: what their modules declare) and is
refused in one line for the rest; `auto` passes over a kernel that lacks a feature the
call needs. Block-skipping kernels classify each tile empty/partial/full before running
(`Mask.block_map`), skip empty tiles and mask only partial ones.

Decoding (one query token per sequence against a key/value cache) has its own dispatch,
`decode_attention` (decode.py): reference (plain JAX), pallas_tpu, pallas_gpu, cpu (C++
through XLA's FFI, lab/kernels/cpu_gemv.cc); auto is the backend's Pallas kernel on TPU and
GPU, the C++ kernel on CPU where it is built, and the reference where a kernel cannot take the
call (a soft-cap on CPU, float16).

Interpret mode is opt-in only: `interpret=True` with impl pallas / pallas_tpu / pallas_gpu /
pallas_mgpu runs the kernel through the Pallas interpreter on any backend (slow: tests,
debugging; pallas_mgpu through JAX's GPU interpreter, jax >= 0.11). On CPU,
`impl="pallas", interpret=True` means the TPU kernel. Sequence lengths that are not block
multiples are padded and masked inside every kernel; bad shapes, head dims or dtypes raise a
ValueError that names the constraint.

Inside a jitted program under a mesh (`jax.set_mesh`), the backend is the mesh's platform, so
an ahead-of-time plan for a TPU slice picks the TPU kernel on a CPU host (and a plan for an
H100 the Mosaic GPU kernel: the device kind is the target's); a Pallas kernel is
opaque to XLA's partitioner, so with `shard_spec` (the PartitionSpec of q, k and v) it runs
once per shard under `shard_map`: batch and heads split, sequence whole.

Under a mesh with Explicit axes (`jax.make_mesh`'s default on new JAX; the lab's meshes,
lab.mesh, are Auto) every implementation runs with those axes made Auto
(`jax.sharding.auto_axes`): with Explicit axes each reshape or repeat of a sharded array
must be given its output's sharding, which the kernels do not spell out, so XLA's
partitioner places them, as under an Auto mesh. The output keeps q's sharding of batch,
sequence and heads. `shard_spec` still says how q, k, v are split for the Pallas and native
kernels' shard_map (without it they run on whole arrays, gathered by XLA).

`causal`, `interpret` and `return_lse` must be bools (a string such as 'no' would read as
True); mask arrays (segment ids, lengths) may be lists or tuples of ints, read as NumPy
arrays.
"""

import functools
import importlib

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from lab.kernels import cpu_gemv
from lab.kernels.attention import blockwise, cpu_flash, decode, ring
from lab.kernels.attention import reference as _reference
from lab.kernels.attention.common import (
    FEATURE_NAMES,
    Mask,
    check_flag,
    check_interpret,
    check_qkv,
    check_rank,
    check_softcap,
    default_scale,
    device_kind,
    platform,
    target_device,
)
from lab.kernels.attention.reference import attention_reference
from lab.measure import toolchain
from lab.names import ATTENTION_IMPLS

# The Pallas kernels (pallas_tpu, pallas_gpu, pallas_mgpu) import JAX's Pallas, Triton and
# Mosaic GPU backends: a quarter of a lab process's imports (0.61 s of 2.58 s, median, on a
# 2-core host), which a process that builds none of them (a CPU run or serve) need not pay. They are
# imported where they are used (`_kernel`); `from lab.kernels.attention import pallas_gpu`
# imports the submodule as ever.
_LAZY = frozenset({"pallas_tpu", "pallas_gpu", "pallas_mgpu"})


def _kernel(name: str):
    """The kernel module `name`, imported on first use (Python's import: a module that fails
    to load raises its own error at every use, never a half-loaded module). Its failure is an
    ImportError, not the ValueError by which a kernel refuses an input, so `auto` never
    passes over a broken kernel for another."""
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError:
        raise
    except Exception as e:
        raise ImportError(f"the {name} attention kernel did not load: {e}") from e


IMPLS = ATTENTION_IMPLS
PALLAS = ("pallas", "pallas_tpu", "pallas_gpu", "pallas_mgpu")
_NATIVE = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}  # backend -> its compiled Pallas kernel
# What jax.nn.dot_product_attention takes: per-sequence lengths and a local window (its
# causal mask is aligned top-left, so L == S there; see _check).
_LIBRARY_FEATURES = frozenset({"lengths", "window"})
# The features that put a mask into a kernel's tiles (the rest change its arithmetic only).
MASK_FEATURES = frozenset({"empty_rows", "segments", "lengths", "window"})
_MODULES = {
    "naive": _reference,
    "blockwise": blockwise,
    "ring": ring,
    "cpu_flash": cpu_flash,
}


def supported_features(impl: str) -> frozenset:
    """The common.FEATURE_NAMES `impl` takes (each kernel module lists its own in FEATURES)."""
    if impl in ("xla", "cudnn"):
        return _LIBRARY_FEATURES
    module = _kernel(impl) if impl in _LAZY else _MODULES.get(impl)
    return getattr(module, "FEATURES", frozenset())


def features_of(
    q_BxLxHxK,
    k_BxSxGxK,
    v_BxSxGxV,
    *,
    mask: Mask | None = None,
    softcap=None,
    sinks=None,
    return_lse: bool = False,
) -> frozenset:
    """The features one call needs (what `_check` holds against `supported_features`)."""
    L, S = q_BxLxHxK.shape[1], k_BxSxGxK.shape[1]
    out = set() if mask is None else mask.features(L, S)
    if softcap is not None:
        out.add("softcap")
    if sinks is not None:
        out.add("sinks")
    if return_lse:
        out.add("lse")
    if v_BxSxGxV.shape[-1] != k_BxSxGxK.shape[-1]:
        out.add("value_dim")
    return frozenset(out)


def gpu_kernels() -> list[str]:
    """The compiled Pallas kernels of the GPU being built for (a target's under its mesh),
    best first: the Mosaic GPU kernel on Hopper where this JAX has Mosaic GPU, then Triton."""
    hopper = _kernel("pallas_mgpu").runs_on(device_kind())
    return (["pallas_mgpu"] if hopper else []) + ["pallas_gpu"]


def _interpretable(impl: str) -> bool:
    return impl != "pallas_mgpu" or _kernel("pallas_mgpu").interpretable()


def available_impls(backend: str | None = None, *, interpret: bool = False) -> tuple[str, ...]:
    """Implementations that run on `backend` (default: JAX's); `interpret` adds the Pallas
    kernels that run only through the interpreter there."""
    backend = backend or jax.default_backend()
    impls = ["naive", "blockwise", "xla"]
    if backend == "cpu" and cpu_flash.available():
        impls += ["cpu_flash"]
    if backend == "gpu":
        impls += ["pallas", *gpu_kernels(), "cudnn"]
    elif backend in _NATIVE:
        impls += ["pallas", _NATIVE[backend]]
    if interpret:
        impls += [k for k in PALLAS if k not in impls and _interpretable(k)]
    return tuple(impls)


def _resolve(impl: str, interpret: bool, backend: str) -> str:
    """Map pallas to this backend's kernel; refuse what cannot run here, saying what can."""
    if impl == "ring":  # runs on every backend, under a mesh that splits the sequence
        return impl
    if impl == "pallas":
        impl = _NATIVE.get(backend, "pallas_tpu" if interpret else "pallas")
    if impl in available_impls(backend, interpret=interpret):
        return impl
    hint = (  # no command has the key: the Python API's, for tests
        " (another backend's Pallas kernel runs here only interpreted: the Python API's "
        "interpret=True, slow, for tests)"
        if impl in PALLAS
        else ""
    )
    if impl == "pallas_mgpu" and backend == "gpu":
        hint = f" (pallas_mgpu needs a Hopper GPU, H100/H200; this one is {device_kind()!r})"
    elif impl == "pallas_mgpu" and not _kernel("pallas_mgpu").interpretable():
        hint = " (pallas_mgpu is interpreted on CPU only from jax 0.11)"
    elif impl == "cpu_flash" and backend == "cpu":
        hint = " (cpu_flash is not built here: no C++ compiler, a failed build or LAB_CPU_FLASH=0)"
    raise ValueError(
        f"attention impl={impl!r} has no compiled kernel on backend {backend!r}: choose one of "
        f"{', '.join(available_impls(backend))}{hint}"
    )


def _cudnn_here() -> bool:
    """cuDNN's fused attention needs the cuDNN library to compile: present on a GPU machine
    (jax[cuda]), absent where a GPU plan is compiled without one (the gpu-plan extra)."""
    if jax.default_backend() == "gpu" or target_device() is None:
        return True
    import importlib.util

    try:
        return importlib.util.find_spec("nvidia.cudnn") is not None
    except ImportError:  # no nvidia namespace package at all
        return False


def _fit(spec, shapes, mesh):
    """`spec` with the mesh axes dropped from any dimension they do not divide in every one
    of q, k, v (model init traces a batch of one; query and kv heads must split alike for
    the grouped-query mapping): that dimension is then whole on every device."""
    out = []
    for i, axes in enumerate(spec):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        size = 1
        for a in names:
            size *= mesh.shape[a]
        out.append(axes if names and all(shape[i] % size == 0 for shape in shapes) else None)
    return jax.sharding.PartitionSpec(*out)


def _splits_seq(shard_spec) -> bool:
    """Whether `shard_spec` splits the sequence over a context mesh of more than one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if shard_spec is None or len(shard_spec) < 2 or shard_spec[1] is None or mesh.empty:
        return False
    names = (shard_spec[1],) if isinstance(shard_spec[1], str) else tuple(shard_spec[1])
    size = 1
    for a in names:
        size *= mesh.shape[a]
    return size > 1


def _per_shard(fn, shard_spec, *args, extras=None):
    """`fn` (a Pallas kernel) run on each device's block of q, k, v under the context mesh;
    `extras` (keyword arguments: a Mask, sinks, softcap, return_lse) split alike."""
    extras = extras or {}
    mesh = jax.sharding.get_abstract_mesh()
    if shard_spec is None or mesh.empty or mesh.size == 1:
        return fn(*args, **extras)
    if _splits_seq(shard_spec):
        raise ValueError(
            f"q/k/v sharded along the sequence ({shard_spec}): a Pallas or native kernel needs "
            "whole sequences per device; use attention=ring for context parallelism"
        )
    spec = _fit(shard_spec, [x.shape for x in args], mesh)
    arrays = {k: x for k, x in extras.items() if k in ("mask", "sinks")}
    static = {k: x for k, x in extras.items() if k not in arrays}
    arrays_spec = {k: _extras_spec(x, spec) for k, x in arrays.items()}
    out_spec = (spec, P(spec[0], None, spec[2])) if static.get("return_lse") else spec
    return jax.shard_map(
        lambda q, k, v, arrays: fn(q, k, v, **arrays, **static),
        mesh=mesh,
        in_specs=((spec,) * 3 + (arrays_spec,)),
        out_specs=out_spec,
        check_vma=False,
    )(*args, arrays)


def _extras_spec(x, spec):
    """The PartitionSpec tree of a Mask (per-sequence arrays split like the batch) or of the
    sinks [H] (split like the heads)."""
    if isinstance(x, Mask):
        return jax.tree.map(lambda a: P(spec[0], *([None] * (a.ndim - 1))), x)
    return P(spec[2])


def _ring(args, *, causal, scale, shard_spec, extras=None):
    """Ring attention over the mesh axis `shard_spec` gives the sequence; batch and heads
    keep their split where it divides (the model's init traces a batch of one)."""
    mesh = jax.sharding.get_abstract_mesh()
    seq = shard_spec[1] if shard_spec is not None and len(shard_spec) > 1 else None
    seq_axes = (seq,) if isinstance(seq, str) else tuple(seq or ())
    if mesh.empty or len(seq_axes) != 1:
        raise ValueError(
            f"impl='ring' runs over one mesh axis that splits the sequence (strategy=cp); "
            f"the sharding gives seq={seq!r}"
        )
    spec = _fit(shard_spec, [x.shape for x in args], mesh)
    return ring.ring_attention(
        *args,
        mesh=mesh,
        seq_axis=seq_axes[0],
        batch_axes=spec[0],
        head_axes=spec[2],
        causal=causal,
        scale=scale,
        **(extras or {}),
    )


def _auto(
    q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal: bool, backend: str, features=frozenset()
) -> tuple:
    """(the fastest implementation that accepts this input, why a faster one was passed over
    or None); see the module docstring."""
    candidates = {"tpu": ["pallas_tpu"]}.get(backend, [])
    if backend == "cpu" and cpu_flash.available():
        candidates = ["cpu_flash"]
    if backend == "gpu":
        candidates = (["cudnn"] if _cudnn_here() else []) + gpu_kernels()
    impl, note = _first_fit(candidates, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal, False, features)
    return impl or "blockwise", note


def _first_fit(
    candidates, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal: bool, interpret=False, features=()
):
    """(the first implementation of `candidates` that takes this input and that this
    toolchain compiles correctly, or None; why one before it that takes the input was passed
    over for the toolchain, or None). Only the toolchain's reason is kept: an input a kernel
    does not take is the ordinary case, a compiler that would miscompile it is news."""
    note = None
    for impl in candidates:
        try:
            _check(impl, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal, features)
        except ValueError:
            continue
        problem = _toolchain_problem(impl, causal, interpret, k_BxSxGxK.shape[1], features)
        if problem is None:
            return impl, note
        note = note or (impl, problem)
    return None, note


def _toolchain_problem(
    impl: str, causal: bool, interpret: bool, S: int = 0, features=()
) -> str | None:
    """Why this toolchain must not compile `impl` for this mask (None: it may); interpreted
    kernels run no ptxas. Keys that do not fill whole tiles are masked too: any S that is not
    a multiple of the largest key tile (128) counts, whatever tiles a table picks; so does
    any mask feature (a window, lengths, segment ids, rows with no key)."""
    if impl == "pallas_mgpu" and not interpret:
        return _kernel("pallas_mgpu").toolchain_problem(causal=causal, masked=_masked(S, features))
    return None


def _masked(S: int, features) -> bool:
    """Whether pallas_mgpu's tiles hold a mask beyond causal: padded keys or a Mask."""
    return S % 128 != 0 or bool(set(features) & MASK_FEATURES)


def _not_taken(backend, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal, features) -> str | None:
    """'blockwise instead of pallas_tpu: it takes head_dim 64, 128 or 256 (here 32)'-like:
    why `auto` fell back to the portable kernel on an accelerator, from the first kernel
    it prefers there; None where no kernel was a candidate."""
    first = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}[backend]
    try:
        _check(first, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal, features)
    except ValueError as e:
        return f"blockwise instead of {first}, which does not take this input ({e})"
    return None


def _passed_over(note, chosen: str) -> str | None:
    if note is None:
        return None
    skipped, problem = note
    return (
        f"{chosen} instead of {skipped}: {problem}; a CUDA toolchain >= "
        f"{toolchain.FIXED_IN} brings {skipped} back"
    )


def _check(
    impl, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal: bool, features=frozenset(), backend=None
) -> None:
    """Constraints beyond the shared ones, per implementation (ValueError naming them; a
    missing feature names the implementations on `backend` that take it)."""
    missing = sorted(set(features) - supported_features(impl))
    if missing:
        here = available_impls(backend or platform())
        takers = [i for i in here if i != "pallas" and set(features) <= supported_features(i)]
        takers = sorted(takers, key=lambda i: i == "naive") or ["blockwise"]  # naive: L×S last
        raise ValueError(
            f"attention impl={impl!r} does not support {FEATURE_NAMES[missing[0]]}"
            + (f" (nor {', '.join(FEATURE_NAMES[m] for m in missing[1:])})" if missing[1:] else "")
            + f"; use {' or '.join(takers)}"
        )
    if impl == "pallas_tpu":
        _kernel("pallas_tpu").check_inputs(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal=causal)
    elif impl == "pallas_gpu":
        _kernel("pallas_gpu").check_inputs(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal=causal)
    elif impl == "pallas_mgpu":
        _kernel("pallas_mgpu").check_inputs(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal=causal)
    elif impl == "cpu_flash":
        cpu_flash.check_inputs(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal=causal)
    elif impl in ("xla", "cudnn"):
        L, S = q_BxLxHxK.shape[1], k_BxSxGxK.shape[1]
        if causal and L != S:
            raise ValueError(
                f"{q_BxLxHxK.shape=} {k_BxSxGxK.shape=}: impl={impl!r} aligns the causal mask "
                "top-left, so it needs q seq == kv seq (the others align it bottom-right)"
            )
        if "window" in features and L != S:
            raise ValueError(
                f"{q_BxLxHxK.shape=} {k_BxSxGxK.shape=}: impl={impl!r} aligns a window "
                "top-left, so it needs q seq == kv seq (the others align it bottom-right)"
            )
        if impl == "cudnn":
            if q_BxLxHxK.dtype.name not in ("bfloat16", "float16"):
                raise ValueError(f"{q_BxLxHxK.dtype=}: impl='cudnn' supports bfloat16, float16")
            if q_BxLxHxK.shape[-1] > 128:
                raise ValueError(f"{q_BxLxHxK.shape=}: impl='cudnn' supports head_dim <= 128")


def choose(
    impl,
    q_BxLxHxK,
    k_BxSxGxK,
    v_BxSxGxK,
    *,
    causal=True,
    interpret=False,
    backend=None,
    features=frozenset(),
) -> str:
    """The implementation `attention` runs for these inputs (arrays or ShapeDtypeStructs) on
    `backend` (default: `platform()`), or a ValueError naming the constraint; lab.run asks
    before tracing so that a bad choice is one line, not a traceback from inside jit.
    `features`: what the call needs beyond plain attention (`features_of`)."""
    return choose_noted(
        impl,
        q_BxLxHxK,
        k_BxSxGxK,
        v_BxSxGxK,
        causal=causal,
        interpret=interpret,
        backend=backend,
        features=features,
    )[0]


def choose_noted(
    impl,
    q_BxLxHxK,
    k_BxSxGxK,
    v_BxSxGxK,
    *,
    causal=True,
    interpret=False,
    backend=None,
    features=frozenset(),
) -> tuple[str, str | None]:
    """`choose`, with one line saying why `auto`/`pallas` passed over the kernel they prefer
    here (this toolchain miscompiles it), or None: a run's header and a plan print it, so a
    slower kernel is never a silent surprise. A kernel named explicitly is refused instead."""
    if impl not in (*IMPLS, "auto"):
        from lab.config import did_you_mean

        hint = did_you_mean(str(impl), (*IMPLS, "auto"))
        raise ValueError(f"attention impl={impl!r}: choose one of {', '.join(IMPLS)} or auto{hint}")
    causal = check_flag("causal", causal)
    if check_interpret(interpret) and impl not in PALLAS:
        raise ValueError(f"interpret=True applies to impl in {PALLAS}, not impl={impl!r}")
    check_qkv(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal=causal, empty_rows=True, value_dim=True)
    backend = backend or platform()
    note = None
    if impl == "auto":
        impl, note = _auto(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal, backend, features)
        if impl == "blockwise" and note is None and backend in ("tpu", "gpu"):
            why = _not_taken(backend, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal, features)
            if why:  # the accelerator's kernel did not take this input: said, not silent
                return impl, why
    elif impl == "pallas" and backend == "gpu":  # the best GPU kernel that takes the input
        impl, note = _first_fit(
            gpu_kernels(), q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal, interpret, features
        )
        impl = impl or "pallas_gpu"
    else:
        impl = _resolve(impl, interpret, backend)
    _check(impl, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal, features, backend)
    if impl == "xla" and backend == "cpu" and q_BxLxHxK.dtype == jnp.float16:
        raise ValueError(
            f"{q_BxLxHxK.dtype=}: impl='xla' on CPU does not take float16 (XLA:CPU has no "
            "float16 dot with float32 accumulation); use blockwise or float32"
        )
    if impl == "pallas_mgpu" and not interpret:  # named explicitly: refused, not replaced
        _kernel("pallas_mgpu").check_toolchain(
            causal=causal, masked=_masked(k_BxSxGxK.shape[1], features)
        )
    return impl, _passed_over(note, impl)


def attention(
    q_BxLxHxK,
    k_BxSxGxK,
    v_BxSxGxV,
    *,
    causal: bool = True,
    impl: str = "auto",
    scale: float | None = None,
    interpret: bool = False,
    block_sizes=None,
    shard_spec=None,
    window: tuple | None = None,
    q_segment_ids=None,
    kv_segment_ids=None,
    q_lengths=None,
    kv_lengths=None,
    softcap: float | None = None,
    sinks=None,
    return_lse: bool = False,
):
    """softmax(Q·Kᵀ·scale)·V with layout [batch, seq, heads, head_dim]; scale 1/√K by default.

    k and v may have fewer heads than q (grouped-query: query head h reads kv head h // R, R = H/G);
    v's head dim may differ from q's and k's (the output takes v's).
    `block_sizes` is the chosen kernel's own BlockSizes (None: its default). `shard_spec`:
    how q, k, v are split over the context mesh, for the Pallas kernels' shard_map.

    The mask (common.Mask; every clause must hold): `causal` (bottom-right aligned),
    `window=(left, right)` (key j seen by query i iff i+S-L-left <= j <= i+S-L+right; None
    sides unbounded), `q_segment_ids` [B, L] and `kv_segment_ids` [B, S] (packed sequences:
    only equal ids attend; kv defaults to q's when L == S), `q_lengths` / `kv_lengths` [B]
    (right padding: the padded keys and values are masked, not skipped, so they must be finite;
    a NaN there reaches the output, unlike decode_attention's cache). A row that sees no key
    gives 0. `softcap`: scores become
    softcap·tanh(scores/softcap) after scaling. `sinks` [H]: a learned logit per query head in
    every row's softmax denominator. `return_lse=True`: (out, lse) with lse [B, L, H] f32, the
    log of each row's softmax denominator (differentiable; -inf for a row that sees nothing).
    An implementation that lacks a feature the call needs refuses in one line naming it;
    `auto` picks the fastest one that has them all.
    """
    causal, return_lse = check_flag("causal", causal), check_flag("return_lse", return_lse)
    check_rank(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV)  # before any rule reads a dimension
    interpret = check_interpret(interpret)  # np.False_ is False to every kernel below
    if _explicit_axes():  # see the module docstring
        call = functools.partial(
            attention,
            causal=causal,
            impl=impl,
            scale=scale,
            interpret=interpret,
            block_sizes=block_sizes,
            shard_spec=shard_spec,
            window=window,
            softcap=softcap,
            return_lse=return_lse,
        )
        arrays = dict(
            q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids,
            q_lengths=q_lengths,
            kv_lengths=kv_lengths,
            sinks=sinks,
        )
        return _under_auto_axes(call, (q_BxLxHxK, k_BxSxGxK, v_BxSxGxV), arrays, return_lse)
    if q_segment_ids is not None and kv_segment_ids is None:
        if q_BxLxHxK.shape[1] != k_BxSxGxK.shape[1]:
            raise ValueError(
                f"{q_BxLxHxK.shape=} {k_BxSxGxK.shape=}: q and kv lengths differ, so pass "
                "kv_segment_ids as well as q_segment_ids"
            )
        kv_segment_ids = q_segment_ids
    mask = Mask.make(
        causal=causal,
        window=window,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        q_lengths=q_lengths,
        kv_lengths=kv_lengths,
    )
    B, L, H = q_BxLxHxK.shape[:3]
    mask.check(B, L, k_BxSxGxK.shape[1])
    softcap = check_softcap(softcap)
    if scale is not None and not isinstance(scale, jax.core.Tracer):  # every impl, xla's too
        scale = default_scale(q_BxLxHxK.shape[-1], scale)
    if sinks is not None and tuple((sinks := jnp.asarray(sinks)).shape) != (H,):
        raise ValueError(f"{sinks.shape=}: attention sinks are one logit per query head, ({H},)")
    features = features_of(
        q_BxLxHxK,
        k_BxSxGxK,
        v_BxSxGxV,
        mask=mask,
        softcap=softcap,
        sinks=sinks,
        return_lse=return_lse,
    )
    asked = impl
    impl = choose(
        impl,
        q_BxLxHxK,
        k_BxSxGxK,
        v_BxSxGxV,
        causal=causal,
        interpret=interpret,
        features=features,
    )
    if impl == "cpu_flash" and asked == "auto" and _splits_seq(shard_spec):
        impl = "blockwise"  # XLA partitions blockwise along the sequence; the FFI call it cannot
    block_sizes = _fitting_block_sizes(impl, block_sizes, named=asked not in ("auto", "pallas"))
    args = (q_BxLxHxK, k_BxSxGxK, v_BxSxGxV)
    # Kernels are given the new arguments only when a call uses them, so a kernel that takes
    # none of them keeps its plain signature.
    extras = {}
    if mask.dynamic or mask.window is not None or "empty_rows" in features:
        extras["mask"] = mask
    if softcap is not None:
        extras["softcap"] = float(softcap)
    if sinks is not None:
        extras["sinks"] = sinks
    if return_lse:
        extras["return_lse"] = True
    if impl == "naive":
        return attention_reference(*args, causal=causal, scale=scale, **_sinks_H(extras))
    if impl == "ring":
        return _ring(args, causal=causal, scale=scale, shard_spec=shard_spec, extras=extras)
    if impl == "blockwise":
        bs = block_sizes or blockwise.BlockSizes()
        return blockwise.blockwise_attention(
            *args, causal=causal, scale=scale, block_sizes=bs, **extras
        )
    if impl == "cpu_flash":  # an FFI call is opaque to XLA's partitioner, as a Pallas kernel
        bs = block_sizes or cpu_flash.BlockSizes()
        kernel = functools.partial(
            cpu_flash.cpu_flash_attention, causal=causal, scale=scale, block_sizes=bs
        )
        return _per_shard(kernel, shard_spec, *args, extras=extras)
    if impl == "pallas_tpu":
        bs = block_sizes or _kernel("pallas_tpu").BlockSizes()
        kernel = functools.partial(
            _kernel("pallas_tpu").flash_attention_tpu,
            causal=causal,
            scale=scale,
            block_sizes=bs,
            interpret=interpret,
        )
        return _per_shard(kernel, shard_spec, *args, extras=extras)
    if impl == "pallas_gpu":
        kernel = functools.partial(
            _kernel("pallas_gpu").flash_attention_gpu,
            causal=causal,
            scale=scale,
            block_sizes=block_sizes,
            interpret=interpret,
        )
        return _per_shard(kernel, shard_spec, *args, extras=extras)
    if impl == "pallas_mgpu":
        kernel = functools.partial(
            _kernel("pallas_mgpu").flash_attention_mgpu,
            causal=causal,
            scale=scale,
            block_sizes=block_sizes,
            interpret=interpret,
        )
        return _per_shard(kernel, shard_spec, *args, extras=extras)
    return _library(args, mask=mask, scale=scale, impl=impl)


def _explicit_axes() -> tuple:
    """The context mesh's axes of type Explicit (`jax.make_mesh`'s default on new JAX; the
    lab's own meshes, lab.mesh, are Auto)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    explicit = jax.sharding.AxisType.Explicit
    return tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == explicit)


def _under_auto_axes(call, args, arrays: dict, return_lse: bool):
    """`call(*args, **arrays)` with the context mesh's Explicit axes made Auto
    (`jax.sharding.auto_axes`): with Explicit axes every reshape and repeat of a sharded
    array must be told its output's sharding, which no kernel here spells out; under Auto
    axes XLA's partitioner places them, as under the lab's meshes. The output keeps q's
    split of batch, sequence and heads (lse alike). NumPy mask arrays stay outside, static."""
    spec = getattr(jax.typeof(args[0]), "sharding", None)
    spec = (*(spec.spec if spec is not None else ()), None, None, None)[:3]
    out = (P(*spec, None), P(*spec)) if return_lse else P(*spec, None)
    traced = {k: x for k, x in arrays.items() if isinstance(x, jax.Array)}
    static = {k: x for k, x in arrays.items() if k not in traced}
    run = jax.sharding.auto_axes(
        lambda args, traced: call(*args, **traced, **static), out_sharding=out
    )
    return run(args, traced)


def _fitting_block_sizes(impl: str, block_sizes, *, named: bool):
    """`block_sizes` where they are the chosen kernel's own BlockSizes. A kernel named
    explicitly refuses another's (ValueError): its tiles mean nothing to it, and an
    implementation without tiles takes none. Under auto, tiles tuned for another backend's
    kernel (a TPU's, on a CPU running the tests) are left out: None, the kernel's default."""
    try:
        _check_block_sizes(impl, block_sizes)
    except ValueError:
        if named:
            raise
        return None
    return block_sizes


def _check_block_sizes(impl: str, block_sizes) -> None:
    """ValueError where `block_sizes` is not the chosen kernel's own BlockSizes."""
    if block_sizes is None:
        return
    kinds = {
        "blockwise": blockwise.BlockSizes,
        "cpu_flash": cpu_flash.BlockSizes,
        "decode pallas_tpu": decode.BlockSizesTPU,
        "decode pallas_gpu": decode.BlockSizesGPU,
    }
    if impl in _LAZY:  # only the chosen kernel is imported
        kinds[impl] = _kernel(impl).BlockSizes
    want = kinds.get(impl)
    got = type(block_sizes)
    if want is None:
        raise ValueError(f"block_sizes={got.__name__}(…): impl={impl!r} has no tiles to size")
    if not isinstance(block_sizes, want):
        raise ValueError(
            f"block_sizes: a {got.__module__}.{got.__qualname__}, where impl={impl!r} takes "
            f"{want.__module__}.{want.__qualname__}"
        )


def _sinks_H(extras: dict) -> dict:
    """The reference's spelling of the extras (sinks_H for sinks)."""
    out = dict(extras)
    if "sinks" in out:
        out["sinks_H"] = out.pop("sinks")
    return out


def _library(args, *, mask: Mask, scale, impl: str):
    """jax.nn.dot_product_attention with the mask features it has (lengths, a local window);
    rows that see no key are set to 0, as every other implementation gives them."""
    q_BxLxHxK, k_BxSxGxK, _ = args
    L, S = q_BxLxHxK.shape[1], k_BxSxGxK.shape[1]
    window = None
    if mask.window is not None:  # a side past S + L bounds nothing (and JAX's sums are int32)
        window = tuple(S + L if w is None else min(w, S + L) for w in mask.window)
    int32 = lambda x: None if x is None else jnp.asarray(x, jnp.int32)  # noqa: E731 (x64 on)
    o_BxLxHxK = jax.nn.dot_product_attention(
        *args,
        scale=scale,
        is_causal=mask.causal,
        query_seq_lengths=int32(mask.q_lengths),
        key_value_seq_lengths=int32(mask.kv_lengths),
        local_window_size=window,
        implementation=impl,
    )
    if not mask.lengths:
        return o_BxLxHxK
    seen_BxL = mask.dense(q_BxLxHxK.shape[0], L, S).any(-1)
    return jnp.where(seen_BxL[:, :, None, None], o_BxLxHxK, 0).astype(o_BxLxHxK.dtype)


DECODE_IMPLS = ("reference", "pallas", "pallas_tpu", "pallas_gpu", "cpu")


def decode_kernel(
    impl: str, *, softcap, q_dtype, kv_dtype, backend: str | None = None, interpret=False
) -> str:
    """The decode kernel that runs for these operands: choose_decode's, except that auto on
    CPU takes the reference where the C++ kernel cannot (a soft-cap; float16, or float64 in
    tests). Who counts a step's bytes asks this too: the reference reads every slot."""
    chosen = choose_decode(impl, interpret=interpret, backend=backend)
    if chosen == "cpu" and impl == "auto":
        if softcap is not None or not decode.cpu_takes_dtypes(q_dtype, kv_dtype):
            return "reference"
    return chosen


def decode_kernel_noted(
    impl: str, *, softcap, q_dtype, kv_dtype, backend: str | None = None
) -> tuple[str, str | None]:
    """(`decode_kernel`'s choice, why it is not the one `impl` prefers here, or None): the
    C++ kernel has no soft-cap and reads float32/bfloat16 queries only, so auto on CPU
    falls back to the reference, which reads every cache slot."""
    kernel = decode_kernel(
        impl, softcap=softcap, q_dtype=q_dtype, kv_dtype=kv_dtype, backend=backend
    )
    preferred = choose_decode(impl, backend=backend)
    if kernel == preferred:
        return kernel, None
    if softcap is not None:
        return kernel, f"the {preferred} kernel has no soft-cap (softcap={softcap:g})"
    return kernel, (
        f"the {preferred} kernel takes float32 or bfloat16 queries and a cache of those or "
        f"int8 (here {jnp.dtype(q_dtype).name} / {jnp.dtype(kv_dtype).name})"
    )


def choose_decode(impl: str, *, interpret: bool = False, backend: str | None = None) -> str:
    """The decode kernel `decode_attention` runs: auto is the backend's Pallas kernel on TPU
    and GPU, the C++ kernel on CPU where it is built (`cpu`, decode.decode_attention_cpu;
    else the plain-JAX reference); an interpreted Pallas kernel only when asked."""
    if impl not in (*DECODE_IMPLS, "auto"):
        from lab.config import did_you_mean

        hint = did_you_mean(str(impl), (*DECODE_IMPLS, "auto"))
        raise ValueError(
            f"decode impl={impl!r}: choose one of {', '.join(DECODE_IMPLS)} or auto{hint}"
        )
    backend = backend or platform()
    native = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}
    if impl == "auto":
        if backend == "cpu" and cpu_gemv.available():
            return "cpu"
        return native.get(backend, "reference")
    if impl == "cpu":
        if backend != "cpu" or not cpu_gemv.available():
            raise ValueError(
                f"decode impl=cpu runs on the CPU where its C++ kernel is built (backend "
                f"{backend!r}; no C++ compiler, a failed build or LAB_CPU_GEMV=0 leave it out): "
                f"use {' or '.join(decode_impls_here(backend))}"
            )
        return impl
    if impl == "pallas":
        impl = native.get(backend, "pallas_tpu" if interpret else "reference")
    if impl.startswith("pallas") and impl != native.get(backend) and not interpret:
        raise ValueError(
            f"decode impl={impl!r} has no compiled kernel on backend {backend!r}: use "
            f"{', '.join(decode_impls_here(backend))} (or, from Python, interpret=True: slow, "
            "tests)"
        )
    return impl


def decode_impls_here(backend: str | None = None) -> list[str]:
    """The decode kernels that run compiled on `backend` (default: the platform's), auto
    first: what a refusal offers instead."""
    backend = backend or platform()
    native = {"tpu": ["pallas", "pallas_tpu"], "gpu": ["pallas", "pallas_gpu"]}
    cpu = ["cpu"] if backend == "cpu" and cpu_gemv.available() else []
    return ["auto", *native.get(backend, []), *cpu, "reference"]


def decode_attention(
    q_BxHxK,
    k_BxGxSxK,
    v_BxGxSxK,
    lengths_B,
    k_scale_BxGx1xS=None,
    v_scale_BxGx1xS=None,
    *,
    impl: str = "auto",
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    interpret: bool = False,
    block_sizes=None,
    shard_spec=None,
):
    """One query token per sequence against its cache (decode.py): q [B, H, K], caches
    [B, G, S, K] (int8 with [B, G, 1, S] scales, or q's dtype), lengths [B] valid slots;
    `window=W`: only the last W of them (a sliding-window layer: Mask window (W - 1, 0)).
    `shard_spec`: how the cache [B, G, S, K] is split over the context mesh (batch and kv
    heads; the slots whole), for the kernels' shard_map.
    `softcap`: logits soft-capped as in attention(), in the Pallas kernels and the reference;
    the CPU kernel has none (auto takes the reference then; impl=cpu asked for refuses).
    """
    softcap = check_softcap(softcap)
    interpret = check_interpret(interpret)
    if softcap is not None and impl == "cpu":
        raise ValueError("decode_attention: impl=cpu has no soft-cap; use impl=reference")
    asked = impl
    impl = decode_kernel(
        impl, softcap=softcap, q_dtype=q_BxHxK.dtype, kv_dtype=k_BxGxSxK.dtype, interpret=interpret
    )
    if asked == "pallas" and impl == "reference":
        raise ValueError(
            f"decode impl='pallas' has no compiled kernel on backend {platform()!r}: use "
            f"{', '.join(i for i in decode_impls_here() if i != 'pallas')} (or, from Python, "
            "interpret=True: slow, tests)"
        )
    decode.check_inputs(q_BxHxK, k_BxGxSxK, v_BxGxSxK, lengths_B, k_scale_BxGx1xS, v_scale_BxGx1xS)
    lengths_B = decode.as_lengths(lengths_B, q_BxHxK.shape[0], k_BxGxSxK.shape[2])
    args = (q_BxHxK, k_BxGxSxK, v_BxGxSxK, lengths_B, k_scale_BxGx1xS, v_scale_BxGx1xS)
    named = asked not in ("auto", "pallas")
    block_sizes = _fitting_block_sizes(f"decode {impl}", block_sizes, named=named)
    if impl == "reference":
        return decode.decode_attention_reference(*args, scale=scale, window=window, softcap=softcap)
    if impl == "cpu":
        fn = functools.partial(decode.decode_attention_cpu, scale=scale, window=window)
    else:
        kernel = (
            decode.decode_attention_tpu if impl == "pallas_tpu" else decode.decode_attention_gpu
        )
        bs = block_sizes or (
            decode.BlockSizesTPU() if impl == "pallas_tpu" else decode.BlockSizesGPU()
        )
        fn = functools.partial(
            kernel,
            scale=scale,
            window=window,
            softcap=softcap,
            block_sizes=bs,
            interpret=interpret,
        )
    mesh = jax.sharding.get_abstract_mesh()
    if shard_spec is None or mesh.empty or mesh.size == 1:
        return fn(*args)
    b, g = shard_spec[0], shard_spec[1]
    cache = _fit(P(b, g, None, None), [k_BxGxSxK.shape], mesh)
    b, g = cache[0], cache[1]
    q = P(b, g, None)
    row = P(b)
    scales = P(b, g, None, None) if k_scale_BxGx1xS is not None else None
    specs = (q, cache, cache, row, scales, scales)
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=q, check_vma=False)(*args)


__all__ = [
    "IMPLS",
    "attention",
    "attention_reference",
    "available_impls",
    "choose",
    "choose_noted",
    "decode_attention",
]

"""The attention sweep (`python -m lab.tools.attention_bench`): every implementation timed,
sized and checked over sequence lengths.

Sweeps sequence length, causal and not, forward and forward+backward, for every attention
implementation that runs compiled on this backend (interpreted Pallas kernels are left out:
they test correctness, and the interpreter's speed says nothing about the kernel's). Per
implementation and shape it reports, in one run:

- time: median of `lab.measure.timing.compare` (all contenders alternated call by call on the
  same random inputs, warm-up and compile apart);
- TFLOP/s: `lab.measure.cost.attention_flops` over the median time. Convention: 2 FLOPs per
  multiply-add, matmuls only (softmax not counted); forward 4·B·H·L·S·D, backward 2.5× that;
  causal counts only the pairs its bottom-right mask leaves (S·(S + 1)/2 of the S² scores)
  for every implementation — the useful work — so a naive kernel that computes the masked
  half too shows a lower figure, not a higher one;
- peak memory: XLA's temporary allocation of the compiled program (`memory_analysis`, via
  `lab.measure.memory.compiled_memory`); arguments and outputs are the same for every
  implementation and left out, so this is the memory the algorithm itself needs;
- max error: max |out − ref| / max |ref| against the float64 reference, on the last 128 query
  rows (exact for causal too: the mask is bottom-right aligned), and for fwd+bwd also on dQ of
  those rows (dQ of a row depends only on that row's output cotangent);
- ratio: median time / the baseline's (`baseline=`, default `xla`:
  `jax.nn.dot_product_attention`; `cudnn` for the GPU targets).

With a `Masking` (a causal sliding window, packed documents, a soft-cap) every contender gets
it through the dispatch's keywords, the float64 check uses it too, and TFLOP/s counts only the
pairs the window and documents leave; an implementation that does not take it is skipped with
the reason (the peers take none of it: they are given q, k, v and causal only).

Sub-millisecond kernels are timed as `inner` queued calls blocked once (`timing.compare`),
with `inner` chosen per shape so that a sample lasts about 2 ms: a host synchronisation per
call would otherwise be a fair share of the figure. The same `inner` applies to every
contender of a shape. On CPU each sample starts after 20 ms of quiet (`CPU_SETTLE_S`): right
after PyTorch's SDPA, whose OpenMP threads spin on after it returns, the native kernel took
68–69 ms where it took 63 ms 20 ms later (S=2048, 2 cores), and after XLA's naive attention
74.5 ms against 65 ms 50 ms later.

Implementations whose compiled program needs more memory than half of what the host (CPU) or
device has free are compiled but not run: their memory is reported (*compiled, not run*) and
their time is "skipped". On GPU the lab's own kernels are `pallas_gpu` (Triton) and, on
Hopper, `pallas_mgpu` (Mosaic GPU); cuDNN and JAX's bundled Pallas attention ops join as peers:
`jax.experimental.pallas.ops.gpu.attention.mha` (Triton; kv heads repeated, it has no grouped
heads) and `attention_mgpu.attention` (Mosaic GPU, Hopper and later, bf16/f16, lengths in
whole 128-blocks; it takes no softmax scale, so q is scaled before the call). Where tokamax is
installed (`pip install -e '.[peers]'`), `tokamax` (`tokamax.dot_product_attention`, the
library JAX points Pallas GPU users to, with its own choice of Mosaic, Triton or XLA kernel)
joins on every backend. Where PyTorch is installed, `torch_sdpa`
(`torch.nn.functional.scaled_dot_product_attention`, PyTorch's own choice of flash /
memory-efficient / math kernel) joins on the same device, fed the same numbers through DLPack,
synchronised as part of each timed call and timed in the same alternated loop (warm-up
apart, median, p10 and p90 of the samples); its memory is not XLA's and is reported as n/a.
On CPU it runs on as many threads as JAX's CPU client has cores; on a busy host its OpenMP
threads sleep when idle (TORCH_WAIT_POLICY says why), on a quiet one PyTorch's default
holds; its records say both (`torch_settings`). A
peer that refuses a shape or device is listed as "does not compile here" with its reason.

`sweep(...)` returns the records (`lab.measure.records`); `rows_of(records)` gives them back as
one `lab.measure.attention.SweepRow` per point, which the tool prints as a table
(lab/report/tables/attention.py) and a PNG (lab/report/plots.py); the ledger judges the
records (C08).
"""

import dataclasses
import functools
import importlib.util
import json
import math
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from lab.config import did_you_mean
from lab.kernels.attention import attention, available_impls, supported_features
from lab.kernels.attention.common import FEATURE_NAMES, Mask
from lab.kernels.attention.reference import attention_reference
from lab.measure import records as rec
from lab.measure.attention import (
    MAX_ERROR,
    PEAK_TEMP,
    RATIO,
    SKIPPED,
    TFLOPS,
    TIME,
    Measured,
    SweepRow,
)
from lab.measure.cost import attention_flops, visible_keys
from lab.measure.memory import compiled_memory, device_memory_stats, host_available_bytes
from lab.measure.timing import BenchResult, compare, random_inputs

BASELINE = "xla"
MODES = ("fwd", "fwd+bwd")
ERROR_ROWS = 128  # query rows held against the float64 reference
CPU_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
GPU_SEQS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
QUICK_SEQS = (256, 512)
FIT_SHARE = 0.5  # run only programs needing at most this share of the free memory
SAMPLE_S = 2e-3  # `inner` queues calls until one timed sample lasts about this long
MAX_INNER = 50
# On CPU, seconds of quiet before each contender's sample: what one contender leaves running
# after it returns (PyTorch's spinning OpenMP threads, XLA freeing its buffers) must not be
# timed as the next one's (`timing.comparison`'s settle_s).
CPU_SETTLE_S = 0.02
# PyTorch's OpenMP threads spin between parallel regions by default. On a host shared with
# other work (and with XLA's own threads) a spinning thread holds the core its partner needs:
# torch_sdpa's fwd+bwd at L=256-512 (the ledger's tiny shape, 2 cores, load 6-10) took
# 0.25-1.8 s in some samples where it takes 1-5 ms, often enough to make a median of three;
# with the threads asleep when idle (OMP_WAIT_POLICY=PASSIVE, read once as PyTorch loads)
# its worst of 24 samples at load 7-12 was 52 ms (the JAX contenders' worst: tens of ms
# too), and at L=1024 (the quick shape) it ran no slower. On a quiet host the peer runs as
# its users get it, with PyTorch's own default: the policy is set only on a busy one.
TORCH_WAIT_POLICY = "PASSIVE"


@dataclasses.dataclass(frozen=True)
class Shape:
    """Everything but the sequence length (L = S: self-attention)."""

    batch: int = 1
    heads: int = 2  # query heads
    kv_heads: int = 1  # grouped-query: heads // kv_heads query heads per kv head
    head_dim: int = 64
    dtype: str = "float32"

    def arrays(self, seq: int, seed: int = 0):
        """Fresh random q, k, v and output cotangent (never zeros)."""
        B, H, G, K = self.batch, self.heads, self.kv_heads, self.head_dim
        shapes = [(B, seq, H, K), (B, seq, G, K), (B, seq, G, K), (B, seq, H, K)]
        return random_inputs(seed, shapes, jnp.dtype(self.dtype))

    def held_bytes(self, seq: int, score_copies: int = 0) -> int:
        """Bytes one point holds at length `seq` (checked before anything is allocated): q,
        out, dout, dq and k, v, dk, dv in the dtype; the float64 copies of q, k, v and dout
        that the reference reads; the reference's float64 scores for its checked rows; and
        `score_copies` arrays of B·H·L·L scores (at least float32) for a contender that
        materialises them (the xla impl: the tuner's baseline off a GPU). The bench leaves
        those out: it skips such a program, on its compiled memory, where it cannot fit."""
        B, H, G, K = self.batch, self.heads, self.kv_heads, self.head_dim
        item = jnp.dtype(self.dtype).itemsize
        tensors = B * seq * K * ((4 * H + 4 * G) * item + (2 * H + 2 * G) * 8)
        scores = score_copies * B * H * seq * seq * max(item, 4)
        return tensors + B * H * min(ERROR_ROWS, seq) * seq * 8 + scores


@dataclasses.dataclass(frozen=True)
class Masking:
    """What every contender's call adds to the plain (causal or full) attention, through the
    one dispatch's keywords: a causal sliding window of `window` keys (a query sees itself and
    the window - 1 keys before it: `window=(window - 1, 0)`, as lab.run's window= means),
    packed documents of `docs` tokens each (segment ids restarting every `docs` tokens, causal
    within a document) and a logit soft-cap (scores s -> softcap·tanh(s/softcap)). None: not
    asked for. The window and the documents are causal masks: they run with causal only."""

    window: int | None = None
    docs: int | None = None
    softcap: float | None = None

    def check(self, seqs, causal) -> None:
        """ValueError in one line for a mask that these seqs and causal choices cannot run."""
        for key in ("window", "docs", "softcap"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ValueError(f"{key}={value}: must be > 0 (0 = none)")
        causal_mask = [f"{k}={getattr(self, k)}" for k in ("window", "docs") if getattr(self, k)]
        if causal_mask and tuple(causal) != (True,):
            raise ValueError(
                f"{' '.join(causal_mask)} is a causal mask (a query sees only keys before it): "
                "run it with causal=yes"
            )
        if self.docs:
            bad = [s for s in seqs if s % self.docs]
            if bad:
                raise ValueError(
                    f"docs={self.docs} does not divide seqs={','.join(map(str, bad))}: the "
                    "documents pack each sequence whole"
                )

    @property
    def features(self) -> frozenset:
        """The common.FEATURE_NAMES a call with this masking needs from an implementation."""
        out = {"window"} if self.window else set()
        out |= {"segments"} if self.docs else set()
        return frozenset(out | ({"softcap"} if self.softcap else set()))

    @property
    def label(self) -> str:
        """'window 1,024 · docs of 512 · softcap 30', or '' for none."""
        parts = [f"window {self.window:,}"] if self.window else []
        parts += [f"docs of {self.docs:,}"] if self.docs else []
        return " · ".join(parts + ([f"softcap {self.softcap:g}"] if self.softcap else []))

    def config(self) -> dict:
        """The keys a record's config carries (only those asked for: a plain run's records
        keep their keys)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v}

    def segment_ids(self, batch: int, seq: int):
        """[batch, seq] int32 ids, one per document (None without documents)."""
        if not self.docs:
            return None
        ids = (np.arange(seq) // self.docs).astype(np.int32)
        return np.broadcast_to(ids, (batch, seq)).copy()

    def kwargs(self, batch: int, seq: int) -> dict:
        """The dispatch's keywords (segment ids as NumPy constants [batch, seq])."""
        out = {"window": (self.window - 1, 0)} if self.window else {}
        if self.docs:
            out["q_segment_ids"] = self.segment_ids(batch, seq)
        return out | ({"softcap": float(self.softcap)} if self.softcap else {})

    def reference_kwargs(self, batch: int, seq: int, rows: slice, causal: bool) -> dict:
        """attention_reference's keywords for the query `rows` against all `seq` keys."""
        ids = self.segment_ids(batch, seq)
        mask = Mask.make(
            causal=causal,
            window=(self.window - 1, 0) if self.window else None,
            q_segment_ids=None if ids is None else ids[:, rows],
            kv_segment_ids=ids,
        )
        return dict(mask=mask, softcap=float(self.softcap) if self.softcap else None)

    def refusal(self, impl: str) -> str | None:
        """Why `impl` cannot take this masking (its reason in the table), or None."""
        peer = impl in _library_peers() or impl == "torch_sdpa"
        missing = sorted(self.features - (frozenset() if peer else supported_features(impl)))
        if not missing:
            return None
        return f"does not take {' nor '.join(FEATURE_NAMES[m] for m in missing)}"

    def pairs(self, seq: int) -> float | None:
        """Unmasked (query, key) pairs of one sequence and head under the window and the
        documents (None without either: attention_flops' own count)."""
        if not (self.window or self.docs):
            return None
        n = self.docs or seq
        return (seq // n) * n * visible_keys(n, self.window)


def point_flops(shape, seq: int, causal: bool, mode: str, masking: Masking) -> float:
    """One call's FLOPs at a point, as its TFLOP/s count them: only the (query, key) pairs the
    causal mask, the window and the documents leave; fwd+bwd 3.5× the forward
    (cost.attention_flops' convention)."""
    pairs = masking.pairs(seq)
    if pairs is None:
        flops = attention_flops(shape.batch, shape.heads, seq, seq, shape.head_dim, causal=causal)
    else:  # only the pairs the window or the documents leave: the useful work
        flops = 4.0 * shape.batch * shape.heads * shape.head_dim * pairs
    return flops * 3.5 if mode == "fwd+bwd" else flops


# Every device JAX runs on multiplies matrices at least this fast (a 2-core VM: 2.6e11 FLOP/s
# in float32): FLOPs that take less than a budget even at it need no peak measured to know
# that the budget, not the FLOPs, bounds the samples.
_SLOWEST_FLOPS = 1e10


def samples_floor_s(seqs, causal, modes, shape, masking, dtype: str, bound_s: float, min_runs=3):
    """The least time one impl's timed samples take over a sweep, whatever its budget:
    `min_runs` calls at every point, each at this device's measured matmul peak at `dtype` (no
    attention kernel outruns its own matmuls; fwd+bwd counted at 3× the forward, what a
    backward that recomputes nothing does). (seconds, the peak in FLOP/s); (0.0, None),
    without measuring the peak (about a second with its compile), where the FLOPs cannot
    outlast `bound_s` even on the slowest device (_SLOWEST_FLOPS)."""
    from lab.measure import ceilings

    def least(seq, c, mode):  # the forward's FLOPs, and a backward's twice them
        return point_flops(shape, seq, c, "fwd", masking) * (3 if mode == "fwd+bwd" else 1)

    flops = min_runs * sum(least(seq, c, mode) for seq in seqs for c in causal for mode in modes)
    if flops / _SLOWEST_FLOPS <= bound_s:
        return 0.0, None
    peak = ceilings.matmul_peak(dtype, budget_s=0.1)
    return flops / peak, peak


# ---------------------------------------------------------------------------- contenders


GPU_PEERS = ("jax_pallas_triton", "jax_pallas_mgpu")  # peers that compile only for a GPU


def _library_peers() -> dict:
    """JAX's own Pallas attention kernels (GPU only) and tokamax's attention (where it is
    installed), as f(q, k, v, causal) -> out."""
    peers = {}
    try:
        # newer jax deprecates this module in favour of tokamax, which is a peer of its own
        # below: the lab times both on purpose, so the import's warning says nothing to act on
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import attention as triton_ops

        def triton_mha(q, k, v, causal):
            R = q.shape[2] // k.shape[2]
            k, v = jnp.repeat(k, R, axis=2), jnp.repeat(v, R, axis=2)
            scale = 1.0 / math.sqrt(q.shape[-1])
            return triton_ops.mha(q, k, v, None, sm_scale=scale, causal=causal)

        peers["jax_pallas_triton"] = triton_mha
    except ImportError:
        pass
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu

        def mgpu(q, k, v, causal):
            config = attention_mgpu.TuningConfig(
                block_q=128, block_kv=128, max_concurrent_steps=2, causal=causal
            )
            q = (q * (1.0 / math.sqrt(q.shape[-1]))).astype(q.dtype)
            return attention_mgpu.attention(q, k, v, config)

        peers["jax_pallas_mgpu"] = mgpu
    except ImportError:
        pass
    try:
        import tokamax

        def tokamax_attention(q, k, v, causal):  # L = S here: its top-left causal mask agrees
            return tokamax.dot_product_attention(q, k, v, is_causal=causal)

        peers["tokamax"] = tokamax_attention
    except ImportError:
        pass
    return peers


class _TorchDone:
    """What a torch_sdpa call returns: `jax.block_until_ready` calls this method, so the
    timer waits for PyTorch's queued work exactly as it waits for JAX's."""

    def __init__(self, torch, device):
        self.torch, self.device = torch, device

    def block_until_ready(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
        return self


class TorchSDPA:
    """PyTorch's scaled_dot_product_attention on q, k, v (and the cotangent) of one shape,
    converted once, laid out [batch, heads, seq, head_dim] as PyTorch wants them."""

    def __init__(self, causal: bool, mode: str, q, k, v, do):
        torch, _ = _torch()
        if jax.default_backend() == "cpu":  # the same cores as the JAX contenders
            torch.set_num_threads(_cores())
        self.torch, self.causal, self.mode = torch, causal, mode
        to_t = lambda x: torch.from_dlpack(x).transpose(1, 2).contiguous()
        self.q, self.k, self.v, self.do = (to_t(x) for x in (q, k, v, do))
        self.gqa = q.shape[2] != k.shape[2]
        if mode != "fwd":
            for t in (self.q, self.k, self.v):
                t.requires_grad_(True)

    def _run(self):
        F = self.torch.nn.functional
        out = F.scaled_dot_product_attention(
            self.q, self.k, self.v, is_causal=self.causal, enable_gqa=self.gqa
        )
        if self.mode == "fwd":
            return (out,)
        return (out, *self.torch.autograd.grad(out, (self.q, self.k, self.v), self.do))

    def __call__(self, *_args):
        with self.torch.inference_mode(self.mode == "fwd"):
            self._run()
        return _TorchDone(self.torch, self.q.device)

    def release(self):
        """Drop the inputs and gradients and hand PyTorch's cached device memory back (after a
        failed call, so the contenders after it get the memory)."""
        self.q = self.k = self.v = self.do = None
        if self.torch.cuda.is_available():
            self.torch.cuda.empty_cache()

    def outputs(self):
        """out (and dq, dk, dv) as float32 numpy in the lab's [batch, seq, heads, dim]."""
        with self.torch.inference_mode(self.mode == "fwd"):
            got = self._run()
        return tuple(x.detach().float().transpose(1, 2).cpu().numpy() for x in got)


def _cores() -> int:
    """Cores this process may run on: what XLA's CPU client sizes its thread pool to."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def wait_policy(loaded: bool, environ, busy: bool) -> str:
    """The OpenMP wait policy PyTorch runs with, set in `environ` where it is not loaded yet
    (its OpenMP runtime reads OMP_WAIT_POLICY once, as it loads): on a `busy` host
    TORCH_WAIT_POLICY unless the user set one; on a quiet one the user's, or PyTorch's own
    default. Loaded already, whatever it loaded with."""
    if not loaded:
        if busy:
            return environ.setdefault("OMP_WAIT_POLICY", TORCH_WAIT_POLICY)
        return environ.get("OMP_WAIT_POLICY", "PyTorch's default")
    return environ.get("OMP_WAIT_POLICY", "unknown: PyTorch loaded before the sweep")


@functools.cache
def _torch():
    """(torch, the OpenMP wait policy it runs with: `wait_policy`). ImportError where PyTorch
    is not installed (and then the environment is left as it was)."""
    if importlib.util.find_spec("torch") is None:
        raise ImportError("PyTorch is not installed")
    policy = wait_policy("torch" in sys.modules, os.environ, rec.busy_host() is not None)
    import torch

    return torch, policy


def torch_settings() -> dict:
    """What torch_sdpa's times were taken under, for its records: PyTorch's version, its
    intra-op threads and its OpenMP wait policy; {} where PyTorch is not installed (a row
    made elsewhere, read back here)."""
    try:
        torch, policy = _torch()
    except ImportError:
        return {}
    return {
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": policy,
    }


def _torch_available(backend: str) -> bool:
    try:
        torch, _ = _torch()
    except ImportError:
        return False
    return backend == "cpu" or (backend == "gpu" and torch.cuda.is_available())


def default_seqs(backend: str, quick: bool) -> tuple[int, ...]:
    return QUICK_SEQS if quick else GPU_SEQS if backend == "gpu" else CPU_SEQS


def check_impls(impls, backend: str | None = None, key: str = "impls") -> None:
    """ValueError naming what runs here, for an impl that is unknown or does not run here
    (saying why, for one that runs elsewhere or needs a library not installed); `key`: the
    option the user gave them with (impls=, baseline=)."""
    backend = backend or jax.default_backend()
    here = default_impls(backend)
    bad = [i for i in impls if i not in here]
    if not bad:
        return
    reasons = []
    for i in bad:
        why = _not_here(i, backend)
        if why is None:
            hint = did_you_mean(i, here) if len(bad) == 1 else ""
            why = f"not an implementation that runs compiled here{hint}"
        reasons.append(why if len(bad) == 1 else f"{i}: {why}")
    raise ValueError(f"{key}={','.join(bad)}: {'; '.join(reasons)}; choose from {','.join(here)}")


def _not_here(impl: str, backend: str) -> str | None:
    """Why an implementation the lab has does not run here, or None for a name it does not
    know: a peer whose library is not installed, or a kernel for another backend."""
    if impl == "torch_sdpa":
        if importlib.util.find_spec("torch") is None:
            return "PyTorch is not installed here (pip install -e '.[peers]' adds it)"
        return f"the PyTorch installed here does not run on {backend} (a CUDA build runs on a GPU)"
    if impl == "tokamax" and importlib.util.find_spec("tokamax") is None:
        return "tokamax is not installed here (pip install -e '.[peers]' adds it)"
    if impl in GPU_PEERS:
        return "it compiles only for a GPU"
    if impl == "cpu_flash" and backend == "cpu":  # the lab's native kernel, not built here
        if os.environ.get("LAB_CPU_FLASH") == "0":
            return "LAB_CPU_FLASH=0 in the environment turns it off"
        return "the native kernel could not be built here (its line above says why)"
    where = [b for b in ("cpu", "gpu", "tpu") if b != backend and impl in available_impls(b)]
    if where:
        return f"it runs on {' or '.join(b.upper() for b in where)} only"
    return None


def default_impls(backend: str | None = None) -> tuple[str, ...]:
    """Every compiled implementation on this backend, JAX's bundled kernels on GPU, tokamax
    where installed, and PyTorch's SDPA where PyTorch is installed for this device."""
    backend = backend or jax.default_backend()
    own = [i for i in available_impls(backend) if i != "pallas"]  # pallas = pallas_<backend>
    own += [p for p in _library_peers() if backend == "gpu" or p not in GPU_PEERS]
    return tuple(own + (["torch_sdpa"] if _torch_available(backend) else []))


def _op(impl: str, causal: bool, mask_kw: dict):
    peers = _library_peers()
    if impl in peers:  # a peer is never given a masking it cannot take (Masking.refusal)
        return functools.partial(peers[impl], causal=causal)
    return functools.partial(attention, causal=causal, impl=impl, **mask_kw)


def impl_program(impl: str, causal: bool, mode: str, mask_kw: dict | None = None):
    """f(q, k, v, do) -> out (fwd) or (out, dq, dk, dv) (fwd+bwd), not yet compiled;
    `mask_kw`: the dispatch's mask and soft-cap keywords (Masking.kwargs)."""
    return program(_op(impl, causal, mask_kw or {}), mode)


def program(op, mode: str):
    """The timed program of an op f(q, k, v) -> out: forward only, or forward and the vjp of
    the cotangent `do` (one compiled program either way)."""
    if mode == "fwd":
        return lambda q, k, v, do: op(q, k, v)

    def fwd_bwd(q, k, v, do):
        out, vjp = jax.vjp(op, q, k, v)
        return (out, *vjp(do))

    return fwd_bwd


# ---------------------------------------------------------------------------- measuring


def _free_bytes() -> int | None:
    """Memory a new program may take: the allocator's headroom, or the host's available RAM."""
    stats = device_memory_stats(jax.devices()[0])
    if stats and stats.get("bytes_limit"):
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return host_available_bytes()


def reference_rows(q, k, v, do, causal: bool, mode: str, masking: Masking = Masking()):
    """Float64 output (and dQ) of the last ERROR_ROWS query rows, under the same mask and
    soft-cap as the timed calls (the window is bottom-right aligned, so it holds for the last
    rows against all keys)."""
    rows = slice(q.shape[1] - min(ERROR_ROWS, q.shape[1]), None)
    extra = masking.reference_kwargs(q.shape[0], k.shape[1], rows, causal)
    with jax.enable_x64(True):
        q64, k64, v64, do64 = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, do))
        ref = functools.partial(attention_reference, causal=causal, **extra)
        out, vjp = jax.vjp(ref, q64[:, rows], k64, v64)
        want = [out] if mode == "fwd" else [out, vjp(do64[:, rows])[0]]
        return rows, [np.asarray(x) for x in want]


def max_error(outputs, rows, want) -> float:
    """The largest error over the checked outputs, each relative to its reference's largest
    magnitude; absolute where the reference is exactly zero (dQ with a single key)."""
    got = [outputs] if not isinstance(outputs, tuple) else outputs[: len(want)]
    got = [np.asarray(g, np.float64) for g in got]
    errs = [
        np.abs(np.asarray(g[:, rows], np.float64) - w).max() / (np.abs(w).max() or 1.0)
        for g, w in zip(got, want, strict=True)
    ]
    return float(max(errs))


def _compile(impl, causal, mode, args, mask_kw=None):
    """(compiled, seconds, memory dict) or (None, 0, reason) where it does not build here."""
    t0 = time.perf_counter()
    try:
        if impl == "torch_sdpa":
            return TorchSDPA(causal, mode, *args), time.perf_counter() - t0, None
        compiled = jax.jit(impl_program(impl, causal, mode, mask_kw)).lower(*args).compile()
    except Exception as e:  # noqa: BLE001 — a peer's constraints (dtype, arch, shape) differ
        return None, 0.0, f"does not compile here: {str(e).strip().splitlines()[0]}"
    return compiled, time.perf_counter() - t0, compiled_memory(compiled)


def _outputs(fn, args):
    return fn.outputs() if isinstance(fn, TorchSDPA) else fn(*args)


def out_of_memory(e: Exception) -> bool:
    """An allocation the device (or host) could not make: PyTorch's OutOfMemoryError, XLA's
    RESOURCE_EXHAUSTED."""
    text = str(e)
    return (
        type(e).__name__ == "OutOfMemoryError"
        or "RESOURCE_EXHAUSTED" in text
        or "out of memory" in text.lower()
    )


def _first_calls(runnable: dict, args) -> tuple[dict, dict]:
    """Call each contender once or twice: ({impl: fastest seconds}, {impl: why it is out}).

    The first call allocates and autotunes. A contender that runs out of memory there
    (PyTorch's math kernel materialises the [B, H, L, S] scores, which the compiled-memory
    check cannot see) is dropped with its reason, so the others still run; any other error
    is a bug and surfaces."""
    fastest, failed = {}, {}
    for impl, fn in runnable.items():
        try:
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            first = time.perf_counter() - t0
            # a cold first call can take several times a warm one (XLA's 0.65 ms kernel at
            # L=128 took over 2 ms): the second, warm call picks the calls per sample, unless
            # the first was so long that one call is a sample whatever the second would say
            if first >= 10 * SAMPLE_S:
                fastest[impl] = first
                continue
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            fastest[impl] = time.perf_counter() - t0
        except Exception as e:
            if not out_of_memory(e):
                raise
            first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            failed[impl] = f"out of memory when called: {type(e).__name__}: {first_line}"
            if isinstance(fn, TorchSDPA):
                fn.release()
    return fastest, failed


def _inner(fastest: dict) -> int:
    """Calls per timed sample: enough that the fastest contender's sample lasts SAMPLE_S."""
    best = min(fastest.values(), default=math.inf)
    return max(1, min(MAX_INNER, math.ceil(SAMPLE_S / max(best, 1e-9))))


def _measure_one(
    impls, shape: Shape, seq: int, causal: bool, mode: str, timing: dict, masking=Masking()
) -> list[Measured]:
    """Every impl at one (seq, causal, mode) under `masking`: compile all that take it, run
    those that fit."""
    args = shape.arrays(seq, seed=seq + 2 * causal + (mode == "fwd"))
    free = _free_bytes()
    mask_kw = masking.kwargs(shape.batch, seq)
    rows, runnable = [], {}
    for impl in impls:
        if why := masking.refusal(impl):
            rows.append(Measured(impl, 0.0, memory=None, skipped=why))
            continue
        compiled, compile_s, memory = _compile(impl, causal, mode, args, mask_kw)
        if compiled is None:  # `memory` is the reason it did not build
            rows.append(Measured(impl, compile_s, memory=None, skipped=memory))
        elif free is not None and memory and memory["total_bytes"] > FIT_SHARE * free:
            need = memory["total_bytes"] / 2**30
            why = f"needs {need:.1f} GiB > {FIT_SHARE:.0%} of {free / 2**30:.1f} free"
            rows.append(Measured(impl, compile_s, memory, skipped=why))
        else:
            runnable[impl] = compiled
            rows.append(Measured(impl, compile_s, memory, skipped=None))
    if not runnable:
        return rows
    fastest, failed = _first_calls(runnable, args)
    if failed:
        runnable = {i: f for i, f in runnable.items() if i not in failed}
        rows = [
            dataclasses.replace(r, skipped=failed[r.impl]) if r.impl in failed else r for r in rows
        ]
    if not runnable:
        return rows
    timing = dict(timing)
    wanted = timing.pop("baseline", BASELINE)
    baseline = wanted if wanted in runnable else next(iter(runnable))
    inner = timing.pop("inner", None) or _inner(fastest)
    if jax.default_backend() == "cpu" and len(runnable) > 1:
        timing.setdefault("settle_s", CPU_SETTLE_S)
    times = compare(runnable, *args, baseline=baseline, inner=inner, **timing)
    ref_rows, want = reference_rows(*args, causal=causal, mode=mode, masking=masking)
    out = []
    for row in rows:
        if row.impl in runnable:
            t = dict(times[row.impl])
            ratio = t.pop("ratio")
            ratio = ratio if baseline == wanted else None  # the baseline did not run: no ratio
            error = max_error(_outputs(runnable[row.impl], args), ref_rows, want)
            row = dataclasses.replace(
                row, bench=BenchResult(**t), inner=inner, ratio=ratio, max_error=error
            )
        out.append(row)
    return out


# A native kernel (an XLA FFI call) allocates its own scratch, which XLA's buffer assignment
# does not see: its peak temp memory is XLA's part only.
NATIVE_IMPLS = ("cpu_flash",)
NATIVE_BUFFERS = (
    "the native kernel's own buffers (per thread a block's tiles; the backward's B·H·L floats)"
)


def _records(
    row: Measured,
    shape: Shape,
    seq: int,
    causal: bool,
    mode: str,
    baseline=BASELINE,
    masking: Masking = Masking(),
) -> list:
    """One record per figure of a row; all share the row's config (with the masking's keys
    where one was asked for: window, docs, softcap)."""
    config = dict(
        op="attention",
        impl=row.impl,
        seq=seq,
        causal=causal,
        mode=mode,
        **masking.config(),
        **dataclasses.asdict(shape),
        **(torch_settings() if row.impl == "torch_sdpa" else {}),
    )
    flops = point_flops(shape, seq, causal, mode, masking)
    out = []
    memory = row.memory
    if memory:
        label = "compiled" if row.ran else "compiled, not run"  # XLA's buffer assignment
        native = {"excludes": NATIVE_BUFFERS} if row.impl in NATIVE_IMPLS else {}
        out.append(
            rec.make_record(
                PEAK_TEMP,
                memory["temp_bytes"],
                "B",
                label=label,
                total_bytes=memory["total_bytes"],
                **native,
                **config,
            )
        )
    if row.skipped:
        out.append(rec.make_record(SKIPPED, row.skipped, "reason", **config))
    if not row.ran:
        return out
    t = row.bench
    timing = dict(p10_s=t.p10_s, p90_s=t.p90_s, runs=t.runs, inner=row.inner)
    out += [
        rec.make_record(TIME, t.median_s, "s", compile_s=row.compile_s, **timing, **config),
        rec.make_record(
            TFLOPS,
            flops / t.median_s / 1e12,
            "TFLOP/s",
            label="derived",
            flops=flops,
            **config,
        ),
        rec.make_record(MAX_ERROR, row.max_error, "relative", rows=ERROR_ROWS, **config),
    ]
    if row.ratio is not None:
        out.append(rec.make_record(RATIO + baseline, row.ratio, "x", label="derived", **config))
    return out


def sweep(
    seqs=CPU_SEQS,
    *,
    causal=(True, False),
    modes=MODES,
    impls=None,
    shape: Shape = Shape(),
    budget_s: float = 1.0,
    min_runs: int = 3,
    warmup: int = 1,
    baseline: str = BASELINE,
    inner: int | None = None,
    progress=None,
    done=None,
    masking: Masking = Masking(),
) -> list[dict]:
    """Measure every impl over seqs × causal × modes; returns `lab.measure.records` records
    (`done(records)` with each point's as it finishes: a caller that keeps them on a stop).
    `masking`: a window, packed documents and/or a soft-cap given to every call and to the
    float64 check (an impl that cannot take it is skipped with the reason).

    Records of one (impl, seq, causal, mode) share `config`: time (s), TFLOP/s, peak temp
    memory (B), max error, time ratio vs the baseline (absent where the baseline did not run),
    or the reason it was skipped.
    """
    impls = tuple(impls or default_impls())
    timing = dict(budget_s=budget_s, min_runs=min_runs, warmup=warmup)
    timing.update(baseline=baseline, inner=inner)  # inner None: chosen per shape
    out = []
    for seq in seqs:
        for c in causal:
            for mode in modes:
                if progress:
                    label = f" {masking.label}" if masking.label else ""
                    progress(f"L=S={seq} causal={'yes' if c else 'no'}{label} {mode}")
                point = []
                for row in _measure_one(impls, shape, seq, c, mode, timing, masking):
                    point += _records(row, shape, seq, c, mode, baseline, masking)
                out += point
                if done:
                    done(point)
    return out


# ---------------------------------------------------------------------------- reporting


def rows_of(records: list[dict]) -> list[SweepRow]:
    """The records (of `sweep`, or read back from its .jsonl) as one row per (impl, seq,
    causal, mode), in the order the points first appear."""
    points: dict[str, tuple[dict, list]] = {}
    for r in records:
        c = r["config"]
        key = json.dumps([c[k] for k in ("impl", "seq", "causal", "mode")])
        point = {k: c[k] for k in ("impl", "seq", "causal", "mode")}
        points.setdefault(key, (point, []))[1].append(r)
    return [SweepRow.from_records(point, recs) for point, recs in points.values()]


def baseline_of(records: list[dict]) -> str:
    """The impl the ratios of these records are taken against."""
    return next((r["what"][len(RATIO) :] for r in records if r["what"].startswith(RATIO)), "")

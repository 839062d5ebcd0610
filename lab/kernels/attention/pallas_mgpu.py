"""Flash attention for Hopper (sm_90a) as Mosaic GPU Pallas kernels: forward, dQ and dK/dV.

Every kernel is one CTA of `compute_wgs` compute warpgroups plus one producer warpgroup
(warp specialisation, `plgpu.kernel(num_threads=compute_wgs + 1)`):

- the producer issues TMA copies (`copy_gmem_to_smem`) of the streamed tiles into a ring of
  `max_stages` shared-memory slots (`max_stages_bwd` in dQ and dK/dV); a slot's "loaded"
  barrier completes when its bytes land, and the producer refills the slot only after every
  compute warpgroup arrived on its "free" barrier (a multi-stage pipeline with the copy
  engine running ahead of the tensor cores);
- each compute warpgroup owns one 64-row tile (query rows in the forward and dQ kernels, key
  rows in the dK/dV kernel) that it loaded once by TMA, and runs `wgmma` on the streamed tiles
  with operands in swizzled shared memory and accumulators in registers.

Forward, per query tile and key step: S = Q·Kᵀ (wgmma into a `pl.run_scoped` accumulator),
the online softmax in registers in base 2 (scores pre-multiplied by scale·log2 e, so every
exponential is one `ex2`), P rounded to the input dtype and stored to shared memory, then
P·V (wgmma into a second scoped accumulator) added to the rescaled output carry. The output
leaves through shared memory and a TMA store, with the base-2 log-sum-exp per row (the
backward's residual). Backward: dQ = scale·dS·K with the key/value tiles streamed past a query
tile; dK = scale·dSᵀ·Q and dV = Pᵀ·dO with query tiles streamed past a key tile, where the dK
and dV accumulators stay in two scoped wgmma accumulators for the whole loop.

Why the accumulators are scoped, P goes through shared memory, and the output is rescaled in
registers (rather than FlashAttention-3's P in registers and a rescaled accumulator fed back
with `pl.run_state`): JAX's GPU interpreter, which runs these kernels on CPU with a race
detector, supports `wgmma` only with both operands in shared memory and accumulators only as
zero-initialised `pl.run_scoped` allocations (no `pl.run_state`, no stores into an
accumulator). Writing the kernels inside that subset is what lets CPU tests check them.

Causal block skipping, from `Geometry` (common.py): the producer of a CTA loads only the
blocks some warpgroup of the CTA sees (keys up to the diagonal of its last query tile; for
dK/dV, query blocks from the first that sees its first key tile). In the forward and dQ kernels
each warpgroup runs its key blocks in three spans: whole blocks without the mask, the diagonal
and padded blocks with it, and the blocks past its own diagonal (which its sibling still
needs) only as barrier bookkeeping (wait on the load, arrive on free). The dK/dV kernel runs
one flat loop over its stream and applies the mask (`lax.cond`) to the blocks that need it:
nested loops around its two accumulators spilled registers at head_dim 128, so a block only
the sibling key tile sees is computed fully masked instead of skipped (at most one per head).
Masks (common.Mask: a window, per-sequence lengths, segment ids, causal with more queries
than keys) take a second path, as pallas_gpu's and pallas_tpu's do: before the kernels run,
`Mask.block_map` classifies every (query block, key block) tile at each kernel's tiles and
`_ranges` turns it into each tile's (lo, hi, full_lo, full_hi) and each CTA's stream (first
block, count), int32 arrays in global memory that the kernels read as scalars (per sequence
where the mask has arrays). The producer loads only its CTA's stream; each warpgroup steps over
the blocks outside its own range (barrier bookkeeping), runs its first run of full blocks
without the mask and masks the rest (`_Tiles.mask`: the band and the lengths on the position
vectors, segment ids as two id vectors, the tile's by TMA beside Q and the streamed block's
beside K). A row that sees no key keeps the initial max: output 0, log-sum-exp +inf (the
backward's P is then 0); a key tile no query sees is zeroed after the dK/dV kernel. The forward
reads its stream inside the compute and producer branches (read before them, a value held across
setmaxnreg spilled) and indexes its per-warpgroup segment ids and log-sum-exp tiles by a `_fresh`
warpgroup. With segment ids and a window or lengths its key tiles are 64 rows (`plan_for`: 128
spilled).
Attention sinks are folded into the output and log-sum-exp after the forward
(common.fold_sinks), which leaves the backward kernels exact unchanged; their gradient is
-Σ P_sink·delta per head, outside the kernels.

Grouped-query heads: the forward and dQ kernels read kv head h // R; the dK/dV kernel runs per
kv head and streams the query tiles of all R heads of its group through one pipeline, so
dK/dV are accumulated at kv-head size (no repeat of K/V, no reduction afterwards).

Precision: every product accumulates in f32. P (forward, dV) and dS (dQ, dK) are rounded to
the input dtype as wgmma operands; the dK/dV kernel forms dS from that rounded P too (keeping
P in f32 until then cost 8 bytes of spill at head_dim 128). Tests: tests/test_pallas_mgpu.py.

Any sequence length: q/k/v are zero-padded to whole CTAs (query rows) and whole key blocks;
padded keys are masked, padded query rows computed and dropped (their backward log-sum-exp is
set to 0 and dO to 0, so they add nothing to dK/dV). Tiles made only of padding (a CTA's last
query or key tile) skip their compute.

Options (keyword-only on `flash_attention_mgpu`; dtypes bfloat16 and float16, head dims 64, 128
and 256 for q/k and for v, which may differ): `mask` and `sinks` (above); `softcap` turns the
scores into cap·tanh(scores / cap) before the mask and the softmax, and the backward
multiplies dS by 1 - tanh² (in the dK/dV kernel that factor waits in the dSᵀ tile's shared
memory, in the input dtype: held in registers it spilled); `return_lse` also returns each
row's natural log-sum-exp (the kernel's base-2 one times ln 2), differentiable: its cotangent
enters the backward as delta - dlse. Head dim 256 runs on one compute warpgroup (shared
memory), and no warpgroup accumulates more than 128 f32 columns of 64 rows in registers: the
forward and dQ kernels run one launch per 128 output columns (each recomputing the scores),
the dK/dV kernel one launch per gradient where K + V > 256 (`column_parts`,
`dkv_launches`); every launch compiles with no spill for sm_90a (tests/test_pallas_mgpu.py).

Where it runs: compiled, on Hopper (sm_90a: H100, H200; `runs_on`), on every JAX the lab
supports (`plgpu.kernel`, 0.10 and newer; `pl.pallas_call` for Mosaic GPU is deprecated on 0.10
and gone on 0.11); interpreted on CPU from JAX 0.11 (`interpretable`: 0.10's interpreter has no
rule for `layout_cast` and cannot read a transposed shared-memory wgmma operand). The dispatch
(`impl=pallas` and `auto` on Hopper) picks it; `pallas_gpu` (Triton) stays the portable kernel.
Block sizes: `tuned/<gpu>-mgpu.json` from the tuner (`attention_tune kernel=pallas_mgpu`), else
`BLOCK_SIZES[head_dim]`, the tiles that fit shared memory and spill nothing on sm_90a (tests).
Resources per kernel (registers, spills, shared memory) come from Mosaic's own ptxas run
(lab/plans/resources.py). Nothing here has run on a GPU yet: figures are *compiled, not run*.
"""

import dataclasses
import functools
import inspect
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

try:  # Mosaic GPU ships with jaxlib; a build without it leaves the Triton kernel only
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - every jaxlib the lab supports has it
    plgpu = None

from lab.kernels.attention.common import (
    EMPTY,
    FULL,
    MASK_VALUE,
    Geometry,
    Mask,
    TileCost,
    check_dtype,
    check_interpret,
    check_qkv,
    check_sinks,
    check_softcap,
    default_scale,
    device_kind,
    kernel_mask,
    pad_seq,
    round_up,
    sink_grad,
    sink_output,
    tile_cost,
    visible,
)
from lab.measure import toolchain

DTYPES = (jnp.bfloat16, jnp.float16)  # wgmma on 16-bit inputs; f32 stays with pallas_gpu
HEAD_DIMS = (64, 128, 256)  # q/k and v alike (v's may differ); each compiled with 0 spills
# What the dispatch may pass beyond plain attention (common.FEATURE_NAMES).
FEATURES = frozenset(
    {"softcap", "sinks", "lse", "value_dim", "empty_rows", "segments", "lengths", "window"}
)
# Above this sum of the q/k and v head dims the dK/dV kernel runs as two launches (dkv_launches).
MAX_DKV_COLUMNS = 256
# Widest output a forward or dQ launch accumulates in registers; wider ones run in parts.
MAX_ACC_COLUMNS = 128
# Every tile edge is a multiple of 64: a warpgroup's wgmma covers 64 rows (M), and a row of 64
# 16-bit elements fills the 128-byte swizzle, the only one Mosaic stores a WGMMA-layout register
# tile into (P, dS; a 32-column tile with a 64-byte swizzle failed its layout inference).
TILE = 64
SWIZZLE = 128
MAX_WGMMA_N = 256
LOG2E = math.log2(math.e)
# Registers per thread after `setmaxnreg`: the producer keeps 24 (it only issues TMA and waits)
# and the compute warpgroups share the rest of the SM's 64K (512 per thread of one warpgroup),
# rounded down to 8 and at most 256: 240 each for two (128 · (240 + 240 + 24) = 64512), as
# FlashAttention-3 does. With 232/40 the D=128 dK/dV kernel spilled (ptxas, sm_90a).
PRODUCER_REGS = 24
COMPUTE_REGS = {w: min(256, (512 - PRODUCER_REGS) // w // 8 * 8) for w in (1, 2)}


def _multiple(n, m) -> bool:
    return isinstance(n, int) and n > 0 and n % m == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles, warpgroups and pipeline depth of the three kernels."""

    block_q: int = 64  # forward: query rows per compute warpgroup (wgmma M)
    block_k: int = 128  # forward: key rows per pipeline stage (wgmma N of Q·Kᵀ)
    block_q_dq: int = 64  # dQ kernel: query rows per compute warpgroup
    block_k_dq: int = 64  # dQ kernel: key rows per pipeline stage
    block_q_dkv: int = 64  # dK/dV kernel: query rows per pipeline stage
    block_k_dkv: int = 64  # dK/dV kernel: key rows per compute warpgroup
    compute_wgs: int = 2  # compute warpgroups per CTA (each owns one tile), plus one producer
    max_stages: int = 2  # shared-memory slots of the streamed tiles (TMA runs this far ahead)
    # the dQ and dK/dV kernels' slots (None: max_stages). Their own, so that the backward's
    # depth is tuned apart from the forward's: one shared count let a backward candidate's
    # depth overflow the forward's shared memory (D=128: 3 slots of 128-key tiles do not fit)
    max_stages_bwd: int | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name.startswith("block_") and (
                not _multiple(value, TILE) or value > MAX_WGMMA_N
            ):
                raise ValueError(
                    f"BlockSizes.{field.name}={value!r}: must be a multiple of {TILE} and "
                    f"<= {MAX_WGMMA_N} (a warpgroup's wgmma covers {TILE} rows; a streamed "
                    f"tile's 16-bit rows must fill the {SWIZZLE}-byte swizzle that the "
                    "scores are stored into)"
                )
        if self.compute_wgs not in (1, 2):
            raise ValueError(f"BlockSizes.compute_wgs={self.compute_wgs!r}: must be 1 or 2")
        for name in ("max_stages", "max_stages_bwd"):
            value = getattr(self, name)
            if name == "max_stages_bwd" and value is None:
                continue
            if not isinstance(value, int) or not 1 <= value <= 4:
                raise ValueError(f"BlockSizes.{name}={value!r}: must be an int in 1..4")

    @property
    def bwd_stages(self) -> int:
        """The backward kernels' shared-memory slots."""
        return self.max_stages if self.max_stages_bwd is None else self.max_stages_bwd


# Per head_dim defaults (the smem and register budgets differ); a tuner may replace them.
BLOCK_SIZES: dict[int, BlockSizes] = {
    64: BlockSizes(block_k=128, max_stages=2),
    128: BlockSizes(block_k=128, max_stages=2),
    # One compute warpgroup: two would need 2 × 64 × 256 × 2 B of Q (and of dO in dQ) next
    # to the streamed tiles, past the 227 KiB of shared memory a block can have; and the
    # 64 × 256 f32 accumulators take 128 of its registers. 64-key tiles for the same reason.
    256: BlockSizes(block_k=64, compute_wgs=1, max_stages=2),
}
TUNED_DIR = Path(__file__).parent / "tuned"
KERNEL = "pallas_mgpu"  # the `kernel` of its entries in tuned/ (pallas_gpu's have none)
# Device kinds with the sm_90a features the kernels use (wgmma, TMA, setmaxnreg): Hopper.
# Blackwell (sm_100) has no wgmma; Ampere and older have no TMA.
HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")


def load_tuned(folder: Path = TUNED_DIR) -> dict[str, dict[int, BlockSizes]]:
    """device_kind -> head_dim -> BlockSizes from the tuner's `kernel: pallas_mgpu` files."""
    table: dict[str, dict[int, BlockSizes]] = {}
    for path in sorted(folder.glob("*.json")):
        entry = json.loads(path.read_text())
        if entry.get("kernel") == KERNEL:
            by_dim = {int(d): BlockSizes(**f) for d, f in entry["by_head_dim"].items()}
            table[entry["device_kind"]] = by_dim
    return table


TUNED = load_tuned()


def block_sizes_for(device_kind: str, head_dim: int) -> BlockSizes:
    """The searched entry for this GPU and head_dim, else the default for the head_dim."""
    return TUNED.get(device_kind, {}).get(head_dim) or BLOCK_SIZES[head_dim]


def usable() -> bool:
    """Whether this JAX builds Mosaic GPU kernels with `plgpu.kernel` (0.10 and newer)."""
    return plgpu is not None and hasattr(plgpu, "kernel")


def interpretable() -> bool:
    """Whether JAX's GPU interpreter runs these kernels on CPU (public from jax 0.11; 0.10's
    lacks layout_cast and transposed smem wgmma operands)."""
    return usable() and hasattr(plgpu, "InterpretGPUParams")


def runs_on(device_kind: str) -> bool:
    """Whether the kernels compile for this device kind (a Hopper GPU, real or a target's)
    with this JAX."""
    kind = device_kind.upper()
    return usable() and "NVIDIA" in kind and any(h in kind for h in HOPPER_KINDS)


# ---------------------------------------------------------------------------- version shims


def _t(ref):
    """The transposed view of a 2-D shared-memory ref (a wgmma operand read as Kᵀ)."""
    return ref.transpose((1, 0))


# jax 0.10: load(ref, idx)
_LOAD_TAKES_IDX = usable() and "idx" in inspect.signature(plgpu.load).parameters


def _load(ref, layout):
    """A shared-memory vector into registers in `layout` (0.10 takes an index argument)."""
    if _LOAD_TAKES_IDX:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def interpret_params(detect_races: bool = True, **kwargs):
    """Parameters of JAX's GPU interpreter (public from jax 0.11, private in 0.10)."""
    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
    return params(detect_races=detect_races, **kwargs)


def _interpret_arg(interpret):
    if interpret is False or interpret is None:
        return None
    return interpret_params(detect_races=False) if interpret is True else interpret


# ---------------------------------------------------------------------------- shared pieces


def _smem(shape, dtype):
    """A wgmma operand tile in shared memory: (8, 64) element tiles, 128-byte swizzle."""
    cols = SWIZZLE // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(SWIZZLE))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def _i32(x):
    return jnp.asarray(x, jnp.int32)


def _slot(t, stages: int):
    return lax.rem(t, jnp.int32(stages))


def _zeros(shape, layout):
    return plgpu.layout_cast(jnp.full(shape, 0, jnp.float32), layout)


def _fresh(index):
    """`index` as a value LLVM must recompute at every use (an empty inline asm marked as a
    side effect): a shared-memory tile indexed by it inside a loop then has its wgmma
    descriptors and store addresses formed in the loop, from uniform registers, instead of
    hoisted out of it and held in ordinary registers for the whole loop."""
    return lax.optimization_barrier(index)


def _bcast(vec, shape, dim: int):
    """Row (dim=0) or column (dim=1) vector broadcast over a 2-D tile."""
    return lax.broadcast_in_dim(vec, shape, [dim])


def _matmul(a_smem, b_smem, shape):
    """a·b with both operands in shared memory, through a fresh (zeroed) scoped accumulator."""

    def scope(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_smem)
        return acc_ref[...]  # waits for the wgmma

    return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))


def _mask(s_2d, row0, col0, g: Geometry, transposed: bool):
    """Scores of one tile with invisible (query, key) pairs set to MASK_VALUE.

    Rows are queries and columns keys, or the other way round when `transposed` (dK/dV).
    Positions are a row vector and a column vector broadcast over the tile, not 2-D iotas: a
    2-D iota is one loop-invariant register per element of the thread's fragment, which LLVM
    hoists out of the key loop (the causal D=128 forward spilled 16 bytes on jax 0.10 so). The
    query vector exists only when causal: a vector no comparison uses leaves Mosaic's layout
    inference with nothing to anchor it (it fails)."""
    shape = s_2d.shape
    k_dim = 0 if transposed else 1
    k_pos = _positions(shape, k_dim, row0 if transposed else col0)
    q_pos = _positions(shape, 1 - k_dim, col0 if transposed else row0) if g.causal else None
    ok = visible(q_pos, k_pos, causal=g.causal, kv_len=g.S, offset=g.offset)
    return jnp.where(ok, s_2d, MASK_VALUE)


@dataclasses.dataclass(frozen=True)
class _MaskPlan:
    """The static side of a common.Mask for these kernels (hashable: part of the jit key):
    its causal and window clauses, and which of its arrays ride along as kernel inputs."""

    mask: Mask  # causal and window only (no arrays)
    q_lengths: bool
    kv_lengths: bool
    segments: bool
    per_seq: bool  # one block map per sequence (the mask depends on arrays)

    @staticmethod
    def of(mask: Mask) -> "_MaskPlan":
        return _MaskPlan(
            Mask.make(causal=mask.causal, window=mask.window),
            mask.q_lengths is not None,
            mask.kv_lengths is not None,
            mask.segments,
            mask.dynamic,
        )

    def arrays(self, mask: Mask, g: Geometry, W: int, query_major: bool) -> list:
        """One kernel's mask inputs: its tiles' block ranges and its CTAs' streams (`_ranges`,
        from the block map at its tiles), the lengths, then the segment ids padded to whole
        CTAs (query-major: query rows; else key rows) and whole blocks of the other side."""
        kind = mask.block_map(g.L, g.S, g.bq, g.bk).kind
        if not query_major:
            kind = kind.swapaxes(1, 2)
        out = list(_ranges(kind, W))
        for present, x in ((self.q_lengths, mask.q_lengths), (self.kv_lengths, mask.kv_lengths)):
            if present:
                out.append(jnp.asarray(x, jnp.int32))
        if self.segments:
            n_cta = -(-(g.n_q if query_major else g.n_k) // W)
            Lp = n_cta * W * g.bq if query_major else g.n_q * g.bq
            Sp = g.n_k * g.bk if query_major else n_cta * W * g.bk
            out.append(pad_seq(jnp.asarray(mask.q_segment_ids, jnp.int32), Lp))
            out.append(pad_seq(jnp.asarray(mask.kv_segment_ids, jnp.int32), Sp))
        return out

    @property
    def n_inputs(self) -> int:
        return 2 + self.q_lengths + self.kv_lengths + 2 * self.segments


def _ranges(kind, W: int):
    """(tiles [B', n_cta·W, 4], streams [B', n_cta, 2]) int32 from a block map's kinds
    [B', n, m] (n tiles of this kernel, m streamed blocks each).

    A tile's (lo, hi, full_lo, full_hi): blocks lo .. hi-1 span its non-empty ones, and
    full_lo .. full_hi-1 is its first run of FULL blocks (run without the mask); the others
    in lo .. hi-1 are run masked (an empty one among them, possible only with segment ids that
    come and go, adds exactly nothing). A CTA streams (first, count): the blocks from the
    first any of its W tiles needs to the last; a tile with no block has all four at `first`
    (it steps over the whole stream and writes zeros). Padding tiles past n have none."""
    xp = np if isinstance(kind, np.ndarray) else jnp
    B, n, m = kind.shape
    n_cta = -(-n // W)
    idx = xp.arange(m)
    nonempty, full = kind != EMPTY, kind == FULL
    seen, any_full = nonempty.any(-1), full.any(-1)
    lo = xp.where(seen, xp.argmax(nonempty, -1), 0)
    hi = xp.where(seen, m - xp.argmax(nonempty[..., ::-1], -1), 0)
    full_lo = xp.where(any_full, xp.argmax(full, -1), hi)
    after = (idx >= full_lo[..., None]) & ~full
    full_hi = xp.where(any_full, xp.where(after.any(-1), xp.argmax(after, -1), m), hi)
    tiles = xp.stack([lo, hi, full_lo, full_hi], -1).astype(np.int32)
    tiles = xp.pad(tiles, ((0, 0), (0, n_cta * W - n), (0, 0)))
    seen = xp.pad(seen, ((0, 0), (0, n_cta * W - n)))
    per_cta = tiles.reshape(B, n_cta, W, 4)
    seen = seen.reshape(B, n_cta, W)
    first = xp.where(seen, per_cta[..., 0], m).min(-1)
    last = xp.where(seen, per_cta[..., 1], 0).max(-1)
    first = xp.where(last > 0, first, 0)
    streams = xp.stack([first, xp.maximum(last - first, 0)], -1).astype(np.int32)
    per_cta = xp.where(seen[..., None], per_cta, first[..., None, None])
    return per_cta.reshape(B, n_cta * W, 4).astype(np.int32), streams


class _Tiles:
    """Inside a kernel with a Mask: its CTA's stream, each tile's block ranges and the mask of
    one tile, from the mask inputs (_MaskPlan.arrays) and the scratch of the segment ids."""

    def __init__(self, mp: _MaskPlan, refs, b):
        self.mp = mp
        self.b = b if mp.per_seq else 0  # the block map's sequence
        self.batch = b
        self.tiles, self.streams, *rest = refs
        rest = iter(rest)
        self.q_len = next(rest) if mp.q_lengths else None
        self.kv_len = next(rest) if mp.kv_lengths else None
        self.q_seg, self.kv_seg = (next(rest), next(rest)) if mp.segments else (None, None)

    def stream(self, cta):
        """(first block, number of steps) of this CTA's stream."""
        return self.streams[self.b, cta, 0], self.streams[self.b, cta, 1]

    def tile(self, i):
        """(lo, hi, full_lo, full_hi) of tile i, absolute block indices."""
        return tuple(self.tiles[self.b, i, c] for c in range(4))

    def mask(self, s_2d, row0, col0, g: Geometry, transposed: bool, segs=None):
        """Scores of one tile with invisible pairs set to MASK_VALUE: keys past S, the band
        (causal, window), the lengths, and `segs` = (query ids, key ids) vectors in the
        tile's row and column layouts. As `_mask`: vectors broadcast, no 2-D iota."""
        shape = s_2d.shape
        k_dim = 0 if transposed else 1
        k_pos = _positions(shape, k_dim, row0 if transposed else col0)
        lo, hi = self.mp.mask.band(g.L, g.S)
        ok = k_pos < (g.S if self.kv_len is None else jnp.minimum(g.S, self.kv_len[self.batch]))
        if lo is not None or hi is not None or self.q_len is not None:
            q_pos = _positions(shape, 1 - k_dim, col0 if transposed else row0)
            if lo is not None:  # k - q - offset >= lo
                ok = ok & (k_pos >= q_pos + (g.offset + lo))
            if hi is not None:
                ok = ok & (k_pos <= q_pos + (g.offset + hi))
            if self.q_len is not None:
                ok = ok & (q_pos < self.q_len[self.batch])
        if segs is not None:
            q_seg, kv_seg = segs
            ok = ok & (_bcast(q_seg, shape, 1 - k_dim) == _bcast(kv_seg, shape, k_dim))
        return jnp.where(ok, s_2d, MASK_VALUE)


def _positions(shape, dim: int, start):
    """start + index along `dim` of a WGMMA-layout tile, broadcast over the other dim."""
    layout = plgpu.Layout.WGMMA.reduce(1 - dim)  # a row index varies along dim 0
    vec = plgpu.broadcasted_iota(jnp.int32, (shape[dim],), 0, layout=layout) + start
    return _bcast(vec, shape, dim)


def _logits2(s_2d, g: Geometry, cap):
    """Raw Q·Kᵀ scores to base-2 logits: (scale·s or cap·tanh(scale·s / cap))·log2 e; with a
    cap also tanh(scale·s / cap), whose 1 - t² the backward needs (else None)."""
    if cap is None:
        return s_2d * (g.scale * LOG2E), None
    t_2d = jnp.tanh(s_2d * (g.scale / cap))
    return t_2d * (cap * LOG2E), t_2d


def _capped_grad(ds_2d, t_2d):
    """dL/d(scale·q·k) from dL/d(cap·tanh(·/cap)): times 1 - tanh²."""
    return ds_2d if t_2d is None else ds_2d * (1.0 - t_2d * t_2d)


def _query_tile_spans(i, real, g: Geometry, tiles, first):
    """(first step, end step, [(lo, hi, masked)]) of query tile i's key loop (the forward's
    and dQ's): without a Mask, from g's causal band (no step for a tile past the queries);
    with one, its block ranges (`tiles`), relative to the CTA's stream's first block."""
    if tiles is None:
        end = jnp.where(real, _i32(g.k_blocks_end(i)), 0)
        whole = jnp.minimum(_i32(g.k_blocks_whole(i)), end)
        return 0, end, _spans(whole, end, g)
    begin, end, full_lo, full_hi = (x - first for x in tiles.tile(i))
    return begin, end, [(begin, full_lo, True), (full_lo, full_hi, False), (full_hi, end, True)]


def _spans(whole, end, g: Geometry):
    """[(lo, hi, masked)] of a query tile's key loop: whole blocks bare, the rest masked."""
    if not g.needs_mask:
        return [(0, end, False)]
    return [(0, whole, False), (whole, end, True)]


def _producer_regs():
    plgpu.set_max_registers(PRODUCER_REGS, action="decrease")


def _compute_regs(W: int):
    plgpu.set_max_registers(COMPUTE_REGS[W], action="increase")


def _produce(n_steps, stages: int, load, free_barriers):
    """The producer warpgroup's loop: prime the ring, refill each slot once it is free, then
    observe the last completions of every free barrier (so that every barrier phase the
    producer could see is seen: the interpreter checks this, and it is free on hardware)."""
    for s in range(stages):
        pl.when(s < n_steps)(functools.partial(load, _i32(s), s))  # int32 under x64 too

    def refill(t, carry):
        slot = _slot(t, stages)
        for free in free_barriers:
            plgpu.barrier_wait(free.at[slot])
        load(t, slot)
        return carry

    lax.fori_loop(_i32(stages), n_steps, refill, None)

    def drain(t, carry):
        for free in free_barriers:
            plgpu.barrier_wait(free.at[_slot(t, stages)])
        return carry

    lax.fori_loop(jnp.maximum(n_steps - stages, 0), n_steps, drain, None)


def _skip(t, stages: int, pairs):
    """A streamed step this warpgroup does not compute: observe its loads, release its slot."""
    slot = _slot(t, stages)
    for loaded, _ in pairs:
        plgpu.barrier_wait(loaded.at[slot])
    for _, free in pairs:
        plgpu.barrier_arrive(free.at[slot])


# ---------------------------------------------------------------------------- forward


def _query_cta(g: Geometry, W: int):
    """Where a query-tiled CTA (forward, dQ) stands: (query head, CTA, batch, warpgroup, kv
    head, key steps). Its key steps run up to the last block its last query tile with real
    rows sees."""
    h, cta, b = lax.axis_index("heads"), lax.axis_index("q"), lax.axis_index("batch")
    wg = lax.axis_index("wg")
    kv = lax.div(h, jnp.int32(g.R))
    last_real = jnp.minimum(cta * W + W - 1, g.n_q - 1)
    return h, cta, b, wg, kv, _i32(g.k_blocks_end(last_real))


def _fwd_kernel(
    q_ref, k_ref, v_ref, *refs, g: Geometry, W: int, stages: int, cap, mp=None,
):  # fmt: skip
    # gmem: q_ref [B, Lp, H, K]; o_ref [B, Lp, H, V]; k_ref [B, Sp, G, K]; v_ref [B, Sp, G, V];
    #       lse_ref [B, H, Lp]; with a Mask first its inputs (_MaskPlan.arrays)
    # smem: q_smem [W, bq, K] (Q, then O where V == K); k_smem [st, bk, K]; v_smem
    #       [st, bk, V]; p_smem [W, bq, bk]; lse_smem [W, bq]; with segment ids qs_smem
    #       [W, bq] and ks_smem [st, bk] int32; o_smem [W, bq, V] only where V != K.
    #       st = stages, W = compute warpgroups.
    n_mask = 0 if mp is None else mp.n_inputs
    mask_refs, refs = refs[:n_mask], refs[n_mask:]
    (o_ref, lse_ref, q_smem, k_smem, v_smem, p_smem, lse_smem,
     q_bar, k_bar, v_bar, k_free, v_free, *rest) = refs  # fmt: skip
    qs_smem, ks_smem = rest[:2] if mp is not None and mp.segments else (None, None)
    o_smem = rest[2 if qs_smem is not None else 0 :]
    bq, bk, V = g.bq, g.bk, v_smem.shape[-1]
    o_smem = o_smem[0] if o_smem else q_smem
    dtype = q_smem.dtype
    h, cta, b, wg, kv, causal_steps = _query_cta(g, W)
    tiles = None if mp is None else _Tiles(mp, mask_refs, b)

    def stream():
        """(first block, steps) of the CTA's stream, read inside each branch of the cond
        below: read once before it, `first` lived across setmaxnreg and ptxas spilled it
        (16 bytes at head_dim 128 with a window or with segment ids; sm_90a)."""
        return (0, causal_steps) if tiles is None else tiles.stream(cta)

    def _compute():
        _compute_regs(W)
        first, n_steps = stream()
        i = cta * W + wg  # this warpgroup's query block
        real = i < g.n_q
        q_tile, p_tile, o_tile = q_smem.at[wg], p_smem.at[wg], o_smem.at[wg]
        rows = pl.ds(i * bq, bq)
        begin, end, spans = _query_tile_spans(i, real, g, tiles, first)
        pairs = ((k_bar, k_free), (v_bar, v_free))
        if tiles is not None:
            lax.fori_loop(0, begin, lambda t, c: _skip(t, stages, pairs), None)

        @pl.when(real)
        def _attend():
            plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_tile, q_bar.at[wg])
            qs_tile = None if qs_smem is None else qs_smem.at[_fresh(wg)]
            if qs_tile is not None:
                plgpu.copy_gmem_to_smem(tiles.q_seg.at[b, rows], qs_tile, q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
            q_seg = None
            if qs_smem is not None:
                q_seg = _load(qs_tile, plgpu.Layout.WGMMA.reduce(1))

            def step(t, carry, masked: bool):
                o_LxK, m_L, l_L = carry
                slot = _slot(t, stages)
                plgpu.barrier_wait(k_bar.at[slot])
                s_LxS = _matmul(q_tile, _t(k_smem.at[slot]), (bq, bk))
                plgpu.barrier_arrive(k_free.at[slot])
                s_LxS, _ = _logits2(s_LxS, g, cap)  # base-2 logits
                if masked and tiles is None:
                    s_LxS = _mask(s_LxS, i * bq, t * bk, g, transposed=False)
                elif masked:
                    segs = None
                    if ks_smem is not None:
                        segs = (q_seg, _load(ks_smem.at[slot], plgpu.Layout.WGMMA.reduce(0)))
                    s_LxS = tiles.mask(s_LxS, i * bq, (first + t) * bk, g, False, segs)
                new_m_L = jnp.maximum(m_L, s_LxS.max(axis=1))
                alpha_L = jnp.exp2(m_L - new_m_L)
                p_LxS = jnp.exp2(s_LxS - _bcast(new_m_L, s_LxS.shape, 0))
                l_L = l_L * alpha_L + p_LxS.sum(axis=1)
                p_tile[...] = p_LxS.astype(dtype)
                plgpu.commit_smem()  # P visible to the tensor cores
                plgpu.barrier_wait(v_bar.at[slot])
                pv_LxV = _matmul(p_tile, v_smem.at[slot], (bq, V))
                plgpu.barrier_arrive(v_free.at[slot])
                o_LxK = o_LxK * _bcast(alpha_L, o_LxK.shape, 0) + pv_LxV
                return o_LxK, new_m_L, l_L

            row = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a WGMMA tile
            carry = (
                _zeros((bq, V), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((bq,), MASK_VALUE, jnp.float32), row),
                _zeros((bq,), row),
            )
            for lo, hi, masked in spans:
                carry = lax.fori_loop(
                    _i32(lo), _i32(hi), functools.partial(step, masked=masked), carry
                )
            o_LxK, m_L, l_L = carry
            # The segment ids' and log-sum-exp tiles indexed by a `_fresh` wg: by wg itself,
            # an address formed before the key loop was held over it (it spilled 8 bytes on
            # some 128-key tiles with segment ids, head_dim 128, sm_90a).
            lse_tile = lse_smem.at[_fresh(wg)]
            if tiles is None:
                o_tile[...] = (o_LxK * _bcast(1.0 / l_L, o_LxK.shape, 0)).astype(dtype)
                lse_tile[...] = m_L + jnp.log2(l_L)
            else:
                # A row that saw no key kept the initial max (its masked scores' P, summed
                # in l, were never rescaled away): output 0, log-sum-exp +inf (P = 0 after).
                seen_L = m_L > MASK_VALUE
                inv_L = jnp.where(seen_L, 1.0 / l_L, 0.0)
                o_tile[...] = (o_LxK * _bcast(inv_L, o_LxK.shape, 0)).astype(dtype)
                lse_tile[...] = jnp.where(seen_L, m_L + jnp.log2(l_L), jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_tile, o_ref.at[b, rows, h])
            plgpu.copy_smem_to_gmem(lse_tile, lse_ref.at[b, h, rows])
            plgpu.wait_smem_to_gmem(0)

        lax.fori_loop(end, n_steps, lambda t, c: _skip(t, stages, pairs), None)

    def _producer():
        _producer_regs()
        first, n_steps = stream()

        def load(t, slot):
            keys = pl.ds((first + t) * bk, bk)
            plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kv], k_smem.at[slot], k_bar.at[slot])
            if ks_smem is not None:
                plgpu.copy_gmem_to_smem(tiles.kv_seg.at[b, keys], ks_smem.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[b, keys, kv], v_smem.at[slot], v_bar.at[slot])

        _produce(n_steps, stages, load, (k_free, v_free))

    # One if/else, compute or producer: the shape ptxas needs to honour setmaxnreg.
    lax.cond(wg < W, _compute, _producer)


def _launch_cost(g: Geometry, B, heads, widths, row_bytes, tile_bytes, rows, mask=None):
    """A launch's TileCost over the tiles it visits (common.tile_cost): the causal band and
    padding of `g`, or `mask`'s block map — a _MaskPlan's static side inside the kernel
    (exact for causal and window; with lengths or segment ids, data when traced, an upper
    bound), or a Mask of NumPy arrays (kernel_cost: exact). `widths`: per tile, the sum over
    its matmuls of the width each contracts or produces (forward part of n value columns:
    K + n; dQ part: K + V + n, the scores and dP recomputed per part; dK/dV: K + V plus K
    for dK and V for dV)."""
    dynamic = isinstance(mask, _MaskPlan) and mask.per_seq
    return tile_cost(
        mask.mask if isinstance(mask, _MaskPlan) else mask,
        g,
        B=B,
        H=heads,
        widths=widths,
        row_bytes=row_bytes,
        tile_bytes=tile_bytes,
        rows=rows,
        dynamic=dynamic,
    )


def _estimate(cost: TileCost) -> dict:
    """`cost_estimate=` for plgpu.kernel where it takes one (jax 0.11+: it rides in the custom
    call's backend config as cost_estimate_json, which lab/measure/hlo.py reads); 0.10's
    Mosaic GPU lowering drops it, and its plgpu.kernel has no such argument."""
    if "cost_estimate" not in inspect.signature(plgpu.kernel).parameters:
        return {}
    return {"cost_estimate": cost.estimate()}


def _forward_cost(g: Geometry, B, H, K, n, itemsize, mask=None) -> TileCost:
    return _launch_cost(
        g, B, H, K + n, itemsize * (K + n) + 4, g.bk * itemsize * (K + n), g.n_q * g.bq, mask
    )


def _dq_cost(g: Geometry, B, H, K, V, n, itemsize, mask=None) -> TileCost:
    row_bytes = itemsize * (K + V + n) + 8
    tile_bytes = g.bk * itemsize * (K + V)
    return _launch_cost(g, B, H, K + V + n, row_bytes, tile_bytes, g.n_q * g.bq, mask)


def _dkv_cost(g: Geometry, B, H, K, V, parts, itemsize, mask=None) -> TileCost:
    widths = K + V + ("dk" in parts) * K + ("dv" in parts) * V
    tile_bytes = g.bq * (itemsize * (K + V) + 8)
    rows = g.n_k * g.bk / g.R
    return _launch_cost(g, B, H, widths, 2 * itemsize * (K + V), tile_bytes, rows, mask)


def kernel_cost(
    q_shape, k_shape, v_dim: int, dtype, *, mask: Mask, backward: bool, block_sizes=None
) -> TileCost:
    """What the launches' cost estimates add up to for one call (forward, or forward, dQ and
    dK/dV, every column part), from the same tiles at the same tile sizes; with a Mask of
    NumPy arrays (a plan's packed documents) exact for them. `block_sizes=None`: the device's
    tuned entry, as the kernel."""
    B, L, H, K = q_shape
    V = v_dim
    bs = block_sizes or block_sizes_for(device_kind(), max(K, V))
    plan = plan_for(
        q_shape,
        k_shape,
        causal=mask.causal,
        scale=None,
        block_sizes=bs,
        interpret=False,
        mask=mask if (mask.window or mask.lengths or mask.segments) else None,
    )
    itemsize = jnp.dtype(dtype).itemsize
    m = None if plan.mp is None else mask
    costs = [_forward_cost(plan.fwd, B, H, K, n, itemsize, m) for _, n in column_parts(V)]
    if backward:
        costs += [_dq_cost(plan.dq, B, H, K, V, n, itemsize, m) for _, n in column_parts(K)]
        costs += [_dkv_cost(plan.dkv, B, H, K, V, p, itemsize, m) for p in dkv_launches(K, V)]
    total = costs[0]
    for c in costs[1:]:
        total = total + c
    return total


def _forward(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, g: Geometry, plan: "_Plan", masks=()):
    """(O, base-2 log-sum-exp): one launch, or one per column part of V (column_parts),
    each with the same scores and statistics and its own columns of O. `masks`: the mask
    inputs (_MaskPlan.arrays) where the plan has a Mask."""
    V = v_BxSxGxV.shape[-1]
    outs = [
        _forward_part(
            q_BxLxHxK,
            k_BxSxGxK,
            v_BxSxGxV[..., c : c + n],
            g,
            plan,
            _part_name("flash_attention_mgpu_fwd", (c, n), V),
            masks,
        )
        for c, n in column_parts(V)
    ]
    if len(outs) == 1:
        return outs[0]
    return jnp.concatenate([o for o, _ in outs], axis=-1), outs[0][1]


def _forward_part(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, g: Geometry, plan: "_Plan", name, masks):
    B, L, H, K = q_BxLxHxK.shape
    V = v_BxSxGxV.shape[-1]
    bs = plan.block_sizes
    W, stages = bs.compute_wgs, min(bs.max_stages, g.n_k)  # no slot that is never filled
    n_cta = -(-g.n_q // W)
    Lp, Sp = n_cta * W * g.bq, g.n_k * g.bk
    dtype = q_BxLxHxK.dtype
    segs = int(plan.mp is not None and plan.mp.segments)
    o_smem = () if V == K else (_smem((W, g.bq, V), dtype),)  # else O goes out through Q's
    o_BxLxHxV, lse_BxHxL = plgpu.kernel(
        functools.partial(_fwd_kernel, g=g, W=W, stages=stages, cap=plan.softcap, mp=plan.mp),
        out_type=(
            jax.ShapeDtypeStruct((B, Lp, H, V), dtype),
            jax.ShapeDtypeStruct((B, H, Lp), jnp.float32),
        ),
        scratch_types=(
            _smem((W, g.bq, K), dtype),
            _smem((stages, g.bk, K), dtype),
            _smem((stages, g.bk, V), dtype),
            _smem((W, g.bq, g.bk), dtype),
            plgpu.SMEM((W, g.bq), jnp.float32),
            plgpu.Barrier(num_arrivals=1 + segs, num_barriers=W),  # Q (and its segment ids)
            plgpu.Barrier(num_arrivals=1 + segs, num_barriers=stages),  # K (and its ids)
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=W, num_barriers=stages),
            plgpu.Barrier(num_arrivals=W, num_barriers=stages),
            *_segment_smem(plan, W, g.bq, stages, g.bk),
            *o_smem,
        ),
        grid=(H, n_cta, B),
        grid_names=("heads", "q", "batch"),
        num_threads=W + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=_interpret_arg(plan.interpret),
        kernel_name=name,
        **_estimate(_forward_cost(g, B, H, K, V, dtype.itemsize, plan.mp)),
    )(pad_seq(q_BxLxHxK, Lp), pad_seq(k_BxSxGxK, Sp), pad_seq(v_BxSxGxV, Sp), *masks)
    return o_BxLxHxV[:, :L], lse_BxHxL[:, :, :L]


def _segment_smem(plan: "_Plan", W: int, tile: int, stages: int, block: int) -> list:
    """With segment ids, their shared memory: the W tiles' ids, then the ring's."""
    if plan.mp is None or not plan.mp.segments:
        return []
    return [plgpu.SMEM((W, tile), jnp.int32), plgpu.SMEM((stages, block), jnp.int32)]


# ---------------------------------------------------------------------------- dQ


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs,
    g: Geometry, W: int, stages: int, cap, cols: tuple, mp=None,
):  # fmt: skip
    # gmem: q_ref [B, Lp, H, K]; dq_ref [B, Lp, H, C]; do_ref [B, Lp, H, V]; k_ref
    #       [B, Sp, G, K]; v_ref [B, Sp, G, V]; lse_ref, delta_ref [B, H, Lp]; with a Mask
    #       its inputs come first in `refs` (_MaskPlan.arrays), then dq_ref and the scratch
    # smem: q_smem [W, bq, K] (holds dQ at the end); do_smem [W, bq, V]; k_smem [st, bk, K];
    #       v_smem [st, bk, V]; ds_smem [W, bq, bk]; lse_smem, delta_smem [W, bq]; with
    #       segment ids qs_smem [W, bq] and ks_smem [st, bk] int32; out_smem [W, bq, C] only
    #       where C != K (else dQ goes out through Q's tile)
    # `cols` = (col0, C): the columns of dQ this launch accumulates (all K, or a 128-wide
    # part where a 64 × K f32 accumulator would not fit next to the score tiles).
    n_mask = 0 if mp is None else mp.n_inputs
    mask_refs, refs = refs[:n_mask], refs[n_mask:]
    (dq_ref, q_smem, do_smem, k_smem, v_smem, ds_smem, lse_smem, delta_smem,
     q_bar, k_bar, v_bar, k_free, v_free, *rest) = refs  # fmt: skip
    qs_smem, ks_smem = rest[:2] if mp is not None and mp.segments else (None, None)
    out_smem = rest[2 if qs_smem is not None else 0 :]
    bq, bk = g.bq, g.bk
    col0, C = cols
    dq_cols = pl.ds(col0, C)
    dtype = q_smem.dtype
    h, cta, b, wg, kv, n_steps = _query_cta(g, W)
    tiles = None if mp is None else _Tiles(mp, mask_refs, b)
    first = 0
    if tiles is not None:
        first, n_steps = tiles.stream(cta)

    def _compute():
        _compute_regs(W)
        i = cta * W + wg
        real = i < g.n_q
        q_tile, do_tile, ds_tile = q_smem.at[wg], do_smem.at[wg], ds_smem.at[wg]
        rows = pl.ds(i * bq, bq)
        begin, end, spans = _query_tile_spans(i, real, g, tiles, first)
        pairs = ((k_bar, k_free), (v_bar, v_free))
        if tiles is not None:
            lax.fori_loop(0, begin, lambda t, c: _skip(t, stages, pairs), None)

        @pl.when(real)
        def _grad():
            bar = q_bar.at[wg]  # one barrier, four copies (five with segment ids)
            plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_tile, bar)
            plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_tile, bar)
            plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem.at[wg], bar)
            plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows], delta_smem.at[wg], bar)
            if qs_smem is not None:
                plgpu.copy_gmem_to_smem(tiles.q_seg.at[b, rows], qs_smem.at[wg], bar)
            plgpu.barrier_wait(bar)
            lse_L = _load(lse_smem.at[wg], plgpu.Layout.WGMMA.reduce(1))
            delta_L = _load(delta_smem.at[wg], plgpu.Layout.WGMMA.reduce(1))
            q_seg = None
            if qs_smem is not None:
                q_seg = _load(qs_smem.at[wg], plgpu.Layout.WGMMA.reduce(1))

            def scope(dq_acc):
                def step(t, carry, masked: bool):
                    slot = _slot(t, stages)
                    plgpu.barrier_wait(k_bar.at[slot])
                    s_LxS = _matmul(q_tile, _t(k_smem.at[slot]), (bq, bk))
                    plgpu.barrier_wait(v_bar.at[slot])
                    dp_LxS = _matmul(do_tile, _t(v_smem.at[slot]), (bq, bk))
                    plgpu.barrier_arrive(v_free.at[slot])
                    s_LxS, t_LxS = _logits2(s_LxS, g, cap)
                    if masked and tiles is None:
                        s_LxS = _mask(s_LxS, i * bq, t * bk, g, transposed=False)
                    elif masked:
                        segs = None
                        if ks_smem is not None:
                            kv_seg = _load(ks_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
                            segs = (q_seg, kv_seg)
                        s_LxS = tiles.mask(s_LxS, i * bq, (first + t) * bk, g, False, segs)
                    p_LxS = jnp.exp2(s_LxS - _bcast(lse_L, s_LxS.shape, 0))
                    ds_LxS = p_LxS * (dp_LxS - _bcast(delta_L, s_LxS.shape, 0))
                    ds_LxS = _capped_grad(ds_LxS, t_LxS)
                    ds_tile[...] = ds_LxS.astype(dtype)
                    plgpu.commit_smem()
                    plgpu.wgmma(dq_acc, ds_tile, k_smem.at[slot, :, dq_cols])  # dQ += dS·K
                    plgpu.wgmma_wait(0)  # K and the dS tile are read: free / rewrite them
                    plgpu.barrier_arrive(k_free.at[slot])
                    return carry

                for lo, hi, masked in spans:
                    lax.fori_loop(_i32(lo), _i32(hi), functools.partial(step, masked=masked), None)
                return dq_acc[...]

            dq_LxC = pl.run_scoped(scope, plgpu.ACC((bq, C), jnp.float32))
            out_tile = out_smem[0].at[wg] if out_smem else q_tile
            out_tile[...] = (dq_LxC * g.scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_tile, dq_ref.at[b, rows, h])
            plgpu.wait_smem_to_gmem(0)

        lax.fori_loop(end, n_steps, lambda t, c: _skip(t, stages, pairs), None)

    def _producer():
        _producer_regs()

        def load(t, slot):
            keys = pl.ds((first + t) * bk, bk)
            plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kv], k_smem.at[slot], k_bar.at[slot])
            if ks_smem is not None:
                plgpu.copy_gmem_to_smem(tiles.kv_seg.at[b, keys], ks_smem.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[b, keys, kv], v_smem.at[slot], v_bar.at[slot])

        _produce(n_steps, stages, load, (k_free, v_free))

    # One if/else, compute or producer: the shape ptxas needs to honour setmaxnreg.
    lax.cond(wg < W, _compute, _producer)


# ---------------------------------------------------------------------------- dK/dV


def _dkv_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs,
    g: Geometry, W: int, stages: int, cap, parts: tuple, mp=None,
):  # fmt: skip
    # gmem: q_ref [B, Lp, H, K]; do_ref [B, Lp, H, V]; k_ref, dk_ref [B, Sp, G, K];
    #       v_ref, dv_ref [B, Sp, G, V]; lse_ref, delta_ref [B, H, Lp]
    # `parts`: the gradients this kernel accumulates, ("dk", "dv") or one of them (head dims
    # whose two accumulators would not fit a warpgroup's registers: one launch each); in
    # `refs` the mask inputs come first (with a Mask: _MaskPlan.arrays), then its outputs
    # (dk_ref, dv_ref or one of them), then the scratch.
    # smem: k_smem [W, bk, K], v_smem [W, bk, V] (this CTA's key tiles, then dK, dV); q_smem
    #       [st, bq, K], do_smem [st, bq, V] (the ring); pt_smem, dst_smem [W, bk, bq];
    #       lse_smem, delta_smem [st, bq]; with segment ids ks_smem [W, bk] and qs_smem
    #       [st, bq] int32
    n_mask = 0 if mp is None else mp.n_inputs
    mask_refs, refs = refs[:n_mask], refs[n_mask:]
    out_refs = dict(zip(parts, refs[: len(parts)], strict=True))
    (k_smem, v_smem, q_smem, do_smem, pt_smem, dst_smem, lse_smem, delta_smem,
     kv_bar, q_bar, free, *segs_smem) = refs[len(parts):]  # fmt: skip
    ks_smem, qs_smem = segs_smem if segs_smem else (None, None)
    bq, bk = g.bq, g.bk
    dtype = k_smem.dtype
    kv, cta, b = lax.axis_index("kv_heads"), lax.axis_index("k"), lax.axis_index("batch")
    wg = lax.axis_index("wg")
    tiles = None if mp is None else _Tiles(mp, mask_refs, b)
    # The stream: for each of the R query heads of this kv head, query blocks start .. n_q-1,
    # from the first block the CTA's first key tile sees (with a Mask: its CTA's stream).
    if tiles is None:
        start = _i32(g.q_blocks_start(cta * W))
        n_blocks = g.n_q - start
    else:
        start, n_blocks = tiles.stream(cta)
    n_steps = g.R * n_blocks

    def _compute():
        _compute_regs(W)
        j = cta * W + wg  # this warpgroup's key block
        real = j < g.n_k
        k_tile, v_tile = k_smem.at[wg], v_smem.at[wg]
        keys = pl.ds(j * bk, bk)
        # Query blocks before `mid` need the mask against this key block: those on its causal
        # diagonal, and (when W > 1) those only a sibling key block sees, which are wholly
        # masked here. The latter cost a wasted step each instead of a separate skip loop: one
        # flat loop over the stream keeps the dK and dV accumulators in one loop, which is what
        # lets the D=128 kernel fit its registers (nested loops spilled).
        if tiles is None:
            mid = _i32(g.q_blocks_masked_end(j))
            needs_mask = lambda i: i < mid  # noqa: E731
        else:  # outside the tile's run of FULL blocks (its own range, and its sibling's)
            lo, hi, full_lo, full_hi = tiles.tile(j)
            needs_mask = lambda i: (i < full_lo) | (i >= full_hi)  # noqa: E731
            real = real & (lo < hi)  # a key tile no query sees: zeros (set by the caller)

        def step(t, acc):
            # This warpgroup's tiles, indexed by a `_fresh` wg: indexed by wg itself, LLVM
            # hoisted their 24 wgmma descriptors and 8 store addresses (64-bit values) out of
            # the loop, live throughout it, and the D=128 kernel spilled 8-12 bytes (R = 1, or
            # no mask). Formed in the loop, it spills nothing with 24 registers to spare.
            w = _fresh(wg)
            k_tile, v_tile = k_smem.at[w], v_smem.at[w]
            pt_tile, dst_tile = pt_smem.at[w], dst_smem.at[w]
            slot = _slot(t, stages)
            i = start + lax.rem(t, n_blocks)  # the streamed query block
            plgpu.barrier_wait(q_bar.at[slot])
            st_SxL = _matmul(k_tile, _t(q_smem.at[slot]), (bk, bq))
            st_SxL, tt_SxL = _logits2(st_SxL, g, cap)
            if cap is not None and "dk" in parts:
                # 1 - t² waits in the dSᵀ tile (free until dSᵀ is written), in the input
                # dtype: held in registers across the two products below, the D=128 kernel
                # spilled 64 bytes (jax 0.10, sm_90a).
                dst_tile[...] = (1.0 - tt_SxL * tt_SxL).astype(dtype)
            if tiles is not None:

                def masked(x):
                    segs = None
                    if qs_smem is not None:
                        q_seg = _load(qs_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
                        segs = (q_seg, _load(ks_smem.at[w], plgpu.Layout.WGMMA.reduce(1)))
                    return tiles.mask(x, j * bk, i * bq, g, True, segs)

                st_SxL = lax.cond(needs_mask(i), masked, lambda x: x, st_SxL)
            elif g.needs_mask:
                st_SxL = lax.cond(
                    needs_mask(i),
                    lambda x: _mask(x, j * bk, i * bq, g, transposed=True),
                    lambda x: x,
                    st_SxL,
                )
            lse_L = _load(lse_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
            pt_SxL = jnp.exp2(st_SxL - _bcast(lse_L, st_SxL.shape, 1))
            # P rounded to the input dtype serves both dV (as the wgmma operand) and dS:
            # holding it in f32 until dS cost the causal D=128 kernel 8 bytes of spill.
            pt_SxL = pt_SxL.astype(dtype)
            if "dv" in parts:
                pt_tile[...] = pt_SxL
                plgpu.commit_smem()
                plgpu.wgmma(acc["dv"], pt_tile, do_smem.at[slot])  # dV += Pᵀ·dO
            if "dk" in parts:
                dpt_SxL = _matmul(v_tile, _t(do_smem.at[slot]), (bk, bq))  # waits for dV too
                delta_L = _load(delta_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
                dpt_SxL = dpt_SxL - _bcast(delta_L, dpt_SxL.shape, 1)
                dst_SxL = pt_SxL.astype(jnp.float32) * dpt_SxL
                if cap is not None:
                    dst_SxL = dst_SxL * _load(dst_tile, plgpu.Layout.WGMMA).astype(jnp.float32)
                dst_tile[...] = dst_SxL.astype(dtype)
                plgpu.commit_smem()
                plgpu.wgmma(acc["dk"], dst_tile, q_smem.at[slot])  # dK += dSᵀ·Q
            plgpu.wgmma_wait(0)  # Q, dO, Pᵀ, dSᵀ all read: the slot and both tiles are free
            plgpu.barrier_arrive(free.at[slot])

        def scope(*accs):
            acc = dict(zip(parts, accs, strict=True))
            lax.fori_loop(0, n_steps, lambda t, c: step(t, acc), None)
            return tuple(a[...] for a in accs)

        @pl.when(real)
        def _grad():
            plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kv], k_tile, kv_bar.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[b, keys, kv], v_tile, kv_bar.at[wg])
            if ks_smem is not None:
                plgpu.copy_gmem_to_smem(tiles.kv_seg.at[b, keys], ks_smem.at[wg], kv_bar.at[wg])
            plgpu.barrier_wait(kv_bar.at[wg])
            widths = {"dk": k_smem.shape[-1], "dv": v_smem.shape[-1]}
            accs = [plgpu.ACC((bk, widths[p]), jnp.float32) for p in parts]
            grads = dict(zip(parts, pl.run_scoped(scope, *accs), strict=True))
            if "dk" in parts:
                k_tile[...] = (grads["dk"] * g.scale).astype(dtype)
            if "dv" in parts:
                v_tile[...] = grads["dv"].astype(dtype)
            plgpu.commit_smem()
            if "dk" in parts:
                plgpu.copy_smem_to_gmem(k_tile, out_refs["dk"].at[b, keys, kv])
            if "dv" in parts:
                plgpu.copy_smem_to_gmem(v_tile, out_refs["dv"].at[b, keys, kv])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(~real)
        def _idle():  # a key tile of padding only: keep the pipeline's books, compute nothing
            pairs = ((q_bar, free),)
            lax.fori_loop(0, n_steps, lambda t, c: _skip(t, stages, pairs), None)

    def _producer():
        _producer_regs()

        def load(t, slot):
            member = lax.div(t, n_blocks)
            i = start + lax.rem(t, n_blocks)
            h = kv * g.R + member
            rows = pl.ds(i * bq, bq)
            plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem.at[slot], q_bar.at[slot])
            plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem.at[slot], q_bar.at[slot])
            plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem.at[slot], q_bar.at[slot])
            plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows], delta_smem.at[slot], q_bar.at[slot])
            if qs_smem is not None:
                plgpu.copy_gmem_to_smem(tiles.q_seg.at[b, rows], qs_smem.at[slot], q_bar.at[slot])

        _produce(n_steps, stages, load, (free,))

    # One if/else, compute or producer: the shape ptxas needs to honour setmaxnreg.
    lax.cond(wg < W, _compute, _producer)


# ---------------------------------------------------------------------------- backward


def _backward(q, k, v, lse, do, delta_BxHxL, plan, masks=((), ())):
    """dQ, dK, dV from the forward's base-2 log-sum-exp (two kernels) and the row terms
    delta [B, H, L]; `masks`: the dQ and dK/dV kernels' mask inputs."""
    B, L, H, K = q.shape
    _, S, G, V = v.shape
    dtype = q.dtype
    bs = plan.block_sizes
    W = bs.compute_wgs
    interpret = _interpret_arg(plan.interpret)
    segs = int(plan.mp is not None and plan.mp.segments)

    gq = plan.dq
    stages = min(bs.bwd_stages, gq.n_k)
    n_cta = -(-gq.n_q // W)
    Lp, Sp = n_cta * W * gq.bq, gq.n_k * gq.bk
    args = (
        pad_seq(q, Lp),
        pad_seq(k, Sp),
        pad_seq(v, Sp),
        pad_seq(do, Lp),
        pad_seq(lse, Lp, axis=2),
        pad_seq(delta_BxHxL, Lp, axis=2),
    )
    parts = []
    for cols in column_parts(K):
        parts.append(
            plgpu.kernel(
                functools.partial(
                    _dq_kernel, g=gq, W=W, stages=stages, cap=plan.softcap, cols=cols, mp=plan.mp
                ),
                out_type=jax.ShapeDtypeStruct((B, Lp, H, cols[1]), dtype),
                scratch_types=(
                    _smem((W, gq.bq, K), dtype),
                    _smem((W, gq.bq, V), dtype),
                    _smem((stages, gq.bk, K), dtype),
                    _smem((stages, gq.bk, V), dtype),
                    _smem((W, gq.bq, gq.bk), dtype),
                    plgpu.SMEM((W, gq.bq), jnp.float32),
                    plgpu.SMEM((W, gq.bq), jnp.float32),
                    plgpu.Barrier(num_arrivals=4 + segs, num_barriers=W),
                    plgpu.Barrier(num_arrivals=1 + segs, num_barriers=stages),
                    plgpu.Barrier(num_barriers=stages),
                    plgpu.Barrier(num_arrivals=W, num_barriers=stages),
                    plgpu.Barrier(num_arrivals=W, num_barriers=stages),
                    *_segment_smem(plan, W, gq.bq, stages, gq.bk),
                    *([] if cols[1] == K else [_smem((W, gq.bq, cols[1]), dtype)]),
                ),
                grid=(H, n_cta, B),
                grid_names=("heads", "q", "batch"),
                num_threads=W + 1,
                thread_name="wg",
                compiler_params=plgpu.CompilerParams(approx_math=True),
                interpret=interpret,
                kernel_name=_part_name("flash_attention_mgpu_dq", cols, K),
                **_estimate(_dq_cost(gq, B, H, K, V, cols[1], dtype.itemsize, plan.mp)),
            )(*args, *masks[0])
        )
    dq = jnp.concatenate(parts, axis=-1)[:, :L] if len(parts) > 1 else parts[0][:, :L]

    gk = plan.dkv
    stages = min(bs.bwd_stages, gk.R * gk.n_q)
    n_cta = -(-gk.n_k // W)
    Lp, Sp = gk.n_q * gk.bq, n_cta * W * gk.bk
    widths = {"dk": K, "dv": V}
    args = (
        pad_seq(q, Lp),
        pad_seq(k, Sp),
        pad_seq(v, Sp),
        pad_seq(do, Lp),
        pad_seq(lse, Lp, axis=2),
        pad_seq(delta_BxHxL, Lp, axis=2),
    )
    grads = {}
    for parts in dkv_launches(K, V):
        outs = plgpu.kernel(
            functools.partial(
                _dkv_kernel, g=gk, W=W, stages=stages, cap=plan.softcap, parts=parts, mp=plan.mp
            ),
            out_type=tuple(jax.ShapeDtypeStruct((B, Sp, G, widths[p]), dtype) for p in parts),
            scratch_types=(
                _smem((W, gk.bk, K), dtype),
                _smem((W, gk.bk, V), dtype),
                _smem((stages, gk.bq, K), dtype),
                _smem((stages, gk.bq, V), dtype),
                _smem((W, gk.bk, gk.bq), dtype),
                _smem((W, gk.bk, gk.bq), dtype),
                plgpu.SMEM((stages, gk.bq), jnp.float32),
                plgpu.SMEM((stages, gk.bq), jnp.float32),
                plgpu.Barrier(num_arrivals=2 + segs, num_barriers=W),  # K, V (and key ids)
                plgpu.Barrier(num_arrivals=4 + segs, num_barriers=stages),  # Q, lse, dO, delta
                plgpu.Barrier(num_arrivals=W, num_barriers=stages),
                *_segment_smem(plan, W, gk.bk, stages, gk.bq),
            ),
            grid=(G, n_cta, B),
            grid_names=("kv_heads", "k", "batch"),
            num_threads=W + 1,
            thread_name="wg",
            compiler_params=plgpu.CompilerParams(approx_math=True),
            interpret=interpret,
            kernel_name="flash_attention_mgpu_" + ("dkv" if len(parts) == 2 else parts[0]),
            **_estimate(_dkv_cost(gk, B, G * gk.R, K, V, parts, dtype.itemsize, plan.mp)),
        )(*args, *masks[1])
        grads.update(zip(parts, outs, strict=True))
    dk, dv = grads["dk"], grads["dv"]
    if plan.mp is not None:  # key tiles no query sees were never written: their zeros
        tiles = masks[1][0]  # [B', n_cta·W, 4]
        unseen_Bx1 = jnp.repeat(tiles[..., 0] >= tiles[..., 1], gk.bk, axis=1)[:, :, None, None]
        dk, dv = (jnp.where(unseen_Bx1, jnp.zeros((), dtype), x) for x in (dk, dv))
    return dq, dk[:, :S], dv[:, :S]


def column_parts(width: int) -> tuple:
    """(first, count) column ranges of an output accumulated one launch each: the whole width
    up to MAX_ACC_COLUMNS, else parts of that many. A 64-row f32 accumulator of 256 columns
    takes 128 registers per thread of a warpgroup, and the forward's and dQ kernel's score
    tiles next to it spilled (sm_90a); each launch recomputes the scores for its part."""
    if width <= MAX_ACC_COLUMNS:
        return ((0, width),)
    return tuple((c, min(MAX_ACC_COLUMNS, width - c)) for c in range(0, width, MAX_ACC_COLUMNS))


def _part_name(name: str, cols, width) -> str:
    """A launch's kernel name: `name`, with its first column where it computes a part."""
    if cols == (0, width):
        return name
    return f"{name}_cols{cols[0]}"


def dkv_launches(K: int, V: int) -> tuple:
    """The dK/dV kernel's launches: one accumulating both, or (head dims summing past 256)
    one per gradient: a warpgroup's two f32 accumulators of 64 rows would need (K + V) / 2
    registers per thread, past what setmaxnreg gives it next to the score tiles."""
    return (("dk", "dv"),) if K + V <= MAX_DKV_COLUMNS else (("dk",), ("dv",))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Geometry of each kernel (their tiles differ) plus launch parameters: one jit key."""

    fwd: Geometry
    dq: Geometry
    dkv: Geometry
    block_sizes: BlockSizes
    interpret: object  # False, True, or the interpreter's parameters (hashable)
    softcap: float | None = None  # scores become softcap·tanh(scores / softcap)
    mp: _MaskPlan | None = None  # with a Mask: its static side (else causal and padding)


LN2 = math.log(2.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, sinks_H, masks, plan: _Plan):
    """(output [B, L, H, V], natural log-sum-exp [B, H, L] f32, +inf for a row that sees no
    key): both differentiable. `masks`: the forward, dQ and dK/dV kernels' mask inputs (empty
    without a Mask). `sinks_H` (or None): one logit per query head in every row's
    denominator, folded into the forward's output and log-sum-exp (common.fold_sinks), which
    leaves the backward kernels exact unchanged."""
    return _flash_fwd(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, sinks_H, masks, plan)[0]


def _flash_fwd(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, sinks_H, masks, plan: _Plan):
    o_BxLxHxV, lse2_BxHxL = _forward(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, plan.fwd, plan, masks[0])
    lse_BxHxL = lse2_BxHxL * LN2
    if sinks_H is not None:
        o_BxLxHxV, lse_BxHxL = sink_output(o_BxLxHxV, lse_BxHxL, sinks_H)
    residuals = (q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, o_BxLxHxV, lse_BxHxL, sinks_H, masks)
    return (o_BxLxHxV, lse_BxHxL), residuals


def _flash_bwd(plan: _Plan, residuals, cotangents):
    q, k, v, o, lse_BxHxL, sinks_H, masks = residuals
    do_BxLxHxV, dlse_BxHxL = cotangents
    # delta_i = Σ_d dO_id·O_id: the softmax-backward row term, one f32 per query row. A
    # cotangent on the log-sum-exp adds dlse_i·P_ij to dS_ij: the same as delta_i - dlse_i.
    delta_BxHxL = jnp.einsum(
        "blhk,blhk->bhl", o.astype(jnp.float32), do_BxLxHxV.astype(jnp.float32)
    )
    delta_BxHxL = delta_BxHxL - dlse_BxHxL
    lse2_BxHxL = lse_BxHxL * (1.0 / LN2)  # the kernels' base 2 (+inf stays)
    dq, dk, dv = _backward(q, k, v, lse2_BxHxL, do_BxLxHxV, delta_BxHxL, plan, masks[1:])
    dsinks_H = None
    if sinks_H is not None:
        dsinks_H = sink_grad(sinks_H[None, :, None], lse_BxHxL, delta_BxHxL).sum((0, 2))
        dsinks_H = dsinks_H.astype(sinks_H.dtype)
    return dq, dk, dv, dsinks_H, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def check_inputs(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, *, causal: bool) -> None:
    """What this kernel accepts (the dispatch asks before choosing it): dtypes bfloat16 and
    float16; q/k and v head dims each in HEAD_DIMS (v's may differ)."""
    check_qkv(q_BxLxHxK, k_BxSxGxK, k_BxSxGxK, causal=causal, empty_rows=True)
    k, v = k_BxSxGxK, v_BxSxGxV
    if v.ndim != 4 or v.shape[:3] != k.shape[:3] or v.dtype != k.dtype:
        raise ValueError(
            f"{k.shape=} {v.shape=} {k.dtype=} {v.dtype=}: keys and values must share batch, "
            "length, heads and dtype (only the head dim may differ)"
        )
    if not usable():
        raise ValueError(f"impl='pallas_mgpu': this jax ({jax.__version__}) has no Mosaic GPU")
    check_dtype(q_BxLxHxK, DTYPES, "pallas_mgpu")
    for what, x in (("q/k", q_BxLxHxK), ("v", v)):
        if x.shape[-1] not in HEAD_DIMS:
            raise ValueError(
                f"{what} head_dim {x.shape[-1]}: pallas_mgpu supports {what} head_dim in "
                f"{HEAD_DIMS} "
                "(dtypes bfloat16, float16)"
            )


def toolchain_problem(*, causal: bool, masked: bool = False) -> str | None:
    """Why the PTX assembler that would compile these kernels must not (None: it may). With a
    mask in the tiles (causal, or keys padded to a whole tile or any common.Mask: `masked`),
    ptxas and nvJitLink of CUDA 12.8.0 up to 12.9.1 miscompile their masked wgmma code
    (lab/measure/toolchain.py; JAX's own Mosaic GPU attention refuses causal masking on the
    same range). Without a mask no masked wgmma is emitted, so any release compiles them."""
    bad = toolchain.miscompiling(toolchain.probe())
    if not ((causal or masked) and bad):
        return None
    return (
        f"{' and '.join(bad)} miscompiles its masked wgmma code (every PTX assembler from "
        f"{toolchain.range_text()} does)"
    )


def check_toolchain(*, causal: bool, masked: bool = False) -> None:
    """`toolchain_problem` as a one-line ValueError that names the way out. Only compiled
    kernels ask: the interpreter runs no ptxas."""
    problem = toolchain_problem(causal=causal, masked=masked)
    if problem:
        what = "a causal mask" if causal else "a mask (keys padded to a whole tile, or a Mask)"
        raise ValueError(
            f"impl='pallas_mgpu' with {what}: {problem}; choose pallas_gpu or cudnn "
            f"instead, or a CUDA toolchain >= {toolchain.FIXED_IN} (e.g. pip install -U "
            "'nvidia-cuda-nvcc-cu12>=12.9.86')"
        )


def plan_for(
    q_shape,
    k_shape,
    *,
    causal: bool,
    scale,
    block_sizes: BlockSizes,
    interpret,
    softcap=None,
    mask: Mask | None = None,
):
    """The three kernels' geometries for these shapes (key tiles shrink to short sequences)."""
    _, L, H, K = q_shape
    S, G = k_shape[1:3]

    def geometry(bq, bk):
        bk = min(bk, round_up(S, TILE))  # no key tile longer than the (64-rounded) keys
        return Geometry(
            L=L, S=S, G=G, R=H // G, bq=bq, bk=bk, causal=causal, scale=default_scale(K, scale)
        )

    bs = block_sizes
    block_k = bs.block_k
    if mask is not None and mask.segments and (mask.lengths or mask.window):
        # segment ids with a window or lengths: the forward's 128-key tile holds the key ids
        # and positions (32 values a thread each) next to the scores and a 128-wide output,
        # and spilled 8 bytes at head_dim 128 (sm_90a); 64-key tiles spill nothing. Segment
        # ids with causal alone fit 128-key tiles.
        block_k = min(block_k, TILE)
    return _Plan(
        fwd=geometry(bs.block_q, block_k),
        dq=geometry(bs.block_q_dq, bs.block_k_dq),
        dkv=geometry(bs.block_q_dkv, bs.block_k_dkv),
        block_sizes=bs,
        interpret=interpret,
        softcap=softcap,
        mp=None if mask is None else _MaskPlan.of(mask),
    )


@functools.partial(
    jax.jit,
    static_argnames=("causal", "scale", "softcap", "return_lse", "block_sizes", "interpret"),
)
def flash_attention_mgpu(
    q_BxLxHxK,
    k_BxSxGxK,
    v_BxSxGxV,
    *,
    causal: bool = True,
    scale: float | None = None,
    mask: Mask | None = None,
    softcap: float | None = None,
    sinks=None,
    return_lse: bool = False,
    block_sizes: BlockSizes | None = None,
    interpret=False,
):
    """softmax(Q·Kᵀ·scale)·V, [batch, seq, heads, head_dim]; any length (padded and masked).

    dtypes bfloat16, float16; head dims in HEAD_DIMS, and v's may differ from q/k's (the
    output takes v's). `softcap`: the scores become softcap·tanh(scores / softcap) before the
    softmax (Gemma 2), gradient included. `return_lse=True` returns (out, lse) with lse
    [batch, seq, heads] f32, each row's natural log-sum-exp of the (capped) scaled scores;
    both are differentiable. `sinks` [heads]: one learned logit per query head in every
    row's softmax denominator (no value; its gradient included), folded in exactly through
    the log-sum-exp. `mask` (common.Mask: causal, a window, segment ids, lengths, combined
    with `causal`): each kernel streams only the blocks its CTA's tiles see (`_ranges`, from
    Mask.block_map), runs a tile's run of full blocks without the mask and masks the rest; a
    row that sees no key gives 0 (lse -inf). Causal with more queries than keys takes this
    path too.
    `block_sizes=None` takes the device's tuned entry, else `BLOCK_SIZES[head_dim]` (the
    wider of the q/k and v head dims).
    `interpret=True` runs the kernels in JAX's GPU interpreter on CPU (jax >= 0.11); pass
    `interpret_params(detect_races=True)` (or any `InterpretGPUParams`) to choose its
    options, e.g. the race detector.
    """
    check_inputs(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, causal=causal)
    interpret = check_interpret(interpret)  # a NumPy False is not the interpreter
    softcap = check_softcap(softcap)
    sinks = check_sinks(sinks, q_BxLxHxK.shape[2])
    B, L = q_BxLxHxK.shape[:2]
    S = k_BxSxGxK.shape[1]
    mask = kernel_mask(mask, causal, B, L, S)
    if interpret is not False and interpret is not None and not interpretable():
        raise ValueError(
            f"interpret={interpret!r}: JAX's GPU interpreter runs pallas_mgpu from jax 0.11 "
            f"(this is {jax.__version__}: no layout_cast rule, no transposed smem operand)"
        )
    if interpret is not False and interpret is not None and jax.config.jax_enable_x64:
        # seen on jax 0.12: with segment ids the interpreter's threads waited on each other
        # forever; one kv head failed to lower (a loop carry of int64 beside int32). With x64
        # off the same calls return, gradients included.
        raise ValueError(
            "impl='pallas_mgpu' does not run in JAX's GPU interpreter while jax_enable_x64 "
            "is on: turn it off for this call (with jax.enable_x64(False): ...)"
        )
    if block_sizes is None:
        # the wider head dim sets the tiles: shared memory holds tiles of both widths
        block_sizes = block_sizes_for(device_kind(), max(q_BxLxHxK.shape[-1], v_BxSxGxV.shape[-1]))
    plan = plan_for(
        q_BxLxHxK.shape,
        k_BxSxGxK.shape,
        causal=causal,
        scale=scale,
        block_sizes=block_sizes,
        interpret=interpret,
        softcap=softcap,
        mask=mask,
    )
    if interpret is False or interpret is None:
        masked = mask is not None or any(g.needs_mask for g in (plan.fwd, plan.dq, plan.dkv))
        check_toolchain(causal=causal, masked=masked)
    masks = ((), (), ())
    if mask is not None:  # each kernel's block ranges, classified before it runs
        W = plan.block_sizes.compute_wgs
        masks = tuple(
            plan.mp.arrays(mask, g, W, query_major)
            for g, query_major in ((plan.fwd, True), (plan.dq, True), (plan.dkv, False))
        )
    o_BxLxHxV, lse_BxHxL = _flash(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, sinks, masks, plan)
    if not return_lse:
        return o_BxLxHxV
    lse_BxHxL = jnp.where(lse_BxHxL == jnp.inf, -jnp.inf, lse_BxHxL)  # rows that saw no key
    return o_BxLxHxV, jnp.swapaxes(lse_BxHxL, 1, 2)

"""Flash attention as a Pallas TPU (Mosaic) kernel: forward, dQ and dK/dV kernels.

The grid is (batch, heads, query blocks, key blocks); the last axis is the sequential
("arbitrary") reduction, and the running max, sum and output accumulator live in VMEM scratch
across it. Causal tiles above the diagonal are skipped twice: `pl.when` skips the compute, and
the key index map is clamped to the last useful block so the pipeline issues no DMA for them
(consecutive equal block indices are not re-fetched).

Layout: Mosaic tiles the last two dims of every block by (8, 128), and a squeezed head dim in
the second-to-last place would break that, so the wrapper transposes to [batch, heads, seq,
head_dim] (one HBM pass each way, as the JAX bundled TPU kernel also expects). Per-row
statistics (log-sum-exp, the backward's delta) are stored as [batch, heads, seq, 1] columns,
which broadcast against a (rows × keys) tile with no relayout.

Grouped-query heads are never repeated in memory: the key/value index maps send query head h
to kv head h // R, and the dK/dV kernel reduces over the R query heads of a group inside its
grid (axes kv-block, group member, query block), so dK/dV come out at kv-head size.

Options (keyword-only on `flash_attention_tpu`; dtypes float32 and bfloat16, head dims 64, 128,
256 for q/k and for v, which may differ): `softcap` (cap·tanh(scores / cap) before the mask,
its 1 - tanh² in both backward kernels), `sinks` (a logit per query head in the softmax
denominator, folded into the forward's output and log-sum-exp, so the backward kernels need
no change; the sinks' gradient is -Σ P_sink·delta per head) and `return_lse` (each row's
natural log-sum-exp as a second, differentiable output: its cotangent enters the backward as
delta - dlse).

Under a multi-device mesh, call it inside `jax.shard_map(..., check_vma=False)`: XLA cannot
partition a Mosaic custom call, and `pallas_call` outputs carry no varying-axes type
(tests/test_attention_aot.py compiles it that way for v5e and v4 topologies).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lab.kernels.attention.common import (
    FULL,
    MASK_VALUE,
    Geometry,
    Mask,
    TileCost,
    check_dtype,
    check_qkv,
    check_sinks,
    check_softcap,
    default_scale,
    fold_sinks,
    kernel_mask,
    launch_cost,
    round_up,
    sink_grad,
    visible,
)

DTYPES = (jnp.float32, jnp.bfloat16)
# q/k and v head dims, each (v's may differ from q/k's): compiled ahead of time for v4 and
# v5e (tests/test_attention_aot.py); Mosaic tiles the head dim on the 128 lanes.
HEAD_DIMS = (64, 128, 256)
# What the dispatch may pass beyond plain attention (common.FEATURE_NAMES).
FEATURES = frozenset(
    {"softcap", "sinks", "lse", "value_dim", "empty_rows", "segments", "lengths", "window"}
)
LANES = 128  # Mosaic's lane width: the key block is the lane dim of every score tile
NT_DIMS = (((1,), (1,)), ((), ()))  # a·bᵀ without materialising the transpose


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes; compiled kernels need key blocks in whole lanes (128), interpret any 8."""

    block_q: int = 128  # query rows per forward tile
    block_k: int = 128  # key columns per forward tile
    block_q_bwd: int = 128  # query rows per backward tile (dQ and dK/dV kernels)
    block_k_bwd: int = 128  # key columns per backward tile

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value <= 0 or value % 8:
                raise ValueError(
                    f"BlockSizes.{field.name}={value!r}: must be a positive multiple of 8"
                )

    def check_compiled(self) -> None:
        """Mosaic needs the lane dim (keys) in whole 128s and bf16 rows in (16, 128) tiles."""
        for name in ("block_k", "block_k_bwd"):
            if getattr(self, name) % LANES:
                raise ValueError(
                    f"BlockSizes.{name}={getattr(self, name)}: a compiled TPU "
                    f"kernel needs a multiple of {LANES}"
                )
        for name in ("block_q", "block_q_bwd"):
            if getattr(self, name) % 16:
                raise ValueError(
                    f"BlockSizes.{name}={getattr(self, name)}: a compiled TPU "
                    "kernel needs a multiple of 16"
                )


def _scores(q_LxK, k_SxK, i, j, g: Geometry, cap, ok_LxS=None, plain: bool = True):
    """Scaled (soft-capped), masked f32 scores of query block i against key block j; with a
    cap also tanh(scores / cap), whose 1 - t² the backward needs (else None). `plain`: the
    causal and padding mask from `g`; else (a Mask's tile) `ok_LxS`, None for a full tile."""
    s_LxS = lax.dot_general(q_LxK, k_SxK, NT_DIMS, preferred_element_type=jnp.float32) * g.scale
    t_LxS = None
    if cap is not None:
        t_LxS = jnp.tanh(s_LxS * (1.0 / cap))
        s_LxS = cap * t_LxS
    if not plain:
        return (s_LxS if ok_LxS is None else jnp.where(ok_LxS, s_LxS, MASK_VALUE)), t_LxS
    if not g.needs_mask:
        return s_LxS, t_LxS
    q_pos_LxS = i * g.bq + lax.broadcasted_iota(jnp.int32, s_LxS.shape, 0)
    k_pos_LxS = j * g.bk + lax.broadcasted_iota(jnp.int32, s_LxS.shape, 1)
    ok_LxS = visible(q_pos_LxS, k_pos_LxS, causal=g.causal, kv_len=g.S, offset=g.offset)
    return jnp.where(ok_LxS, s_LxS, MASK_VALUE), t_LxS


def _capped_grad(ds_LxS, t_LxS):
    """dL/d(scale·q·k) from dL/d(cap·tanh(·/cap)): times 1 - tanh²."""
    return ds_LxS if t_LxS is None else ds_LxS * (1.0 - t_LxS * t_LxS)


def _when_seen(i, j, g: Geometry):
    """Decorator running the body only for tiles on or below the causal diagonal."""
    return pl.when(g.sees(i, j)) if g.causal else (lambda body: body())


@dataclasses.dataclass(frozen=True)
class _MaskPlan:
    """The static side of a Mask for the kernels (hashable: part of the jit key): its causal
    and window clauses, which of its arrays ride along, whether the block map is per sequence.

    The block map rides as scalar-prefetched int32 vectors (SMEM): per visit row (query
    block, or key block for dK/dV) its count of non-empty blocks, their list (the last one
    repeated: the index maps then fetch nothing new past the count), and the kinds; then
    the lengths. Segment ids ride as VMEM blocks: queries [B, Lp, 1], keys [B, 1, Sp]."""

    mask: Mask  # causal and window only (no arrays)
    segments: bool
    q_lengths: bool
    kv_lengths: bool
    per_seq: bool

    @staticmethod
    def of(mask: Mask) -> "_MaskPlan":
        return _MaskPlan(
            Mask.make(causal=mask.causal, window=mask.window),
            mask.segments,
            mask.q_lengths is not None,
            mask.kv_lengths is not None,
            mask.dynamic,
        )

    @property
    def n_prefetch(self) -> int:
        return 3 + self.q_lengths + self.kv_lengths

    def seq(self, b):
        return b if self.per_seq else 0

    def prefetch(self, mask: Mask, g: Geometry, query_major: bool) -> list:
        bm = mask.block_map(g.L, g.S, g.bq, g.bk)
        if query_major:
            maps = [bm.kv_count, bm.kv_blocks, bm.kind]
        else:
            maps = [bm.q_count, bm.q_blocks, jnp.swapaxes(jnp.asarray(bm.kind), 1, 2)]
        out = [jnp.asarray(x, jnp.int32).reshape(-1) for x in maps]
        for present, x in ((self.q_lengths, mask.q_lengths), (self.kv_lengths, mask.kv_lengths)):
            if present:
                out.append(jnp.asarray(x, jnp.int32))
        return out

    def segment_ids(self, mask: Mask, g: Geometry) -> list:
        if not self.segments:
            return []
        q = _pad(mask.q_segment_ids.astype(jnp.int32)[:, None, :, None], g.n_q * g.bq)[:, 0]
        kv = _pad(mask.kv_segment_ids.astype(jnp.int32)[:, None, :, None], g.n_k * g.bk)
        return [q, jnp.swapaxes(kv[:, 0], 1, 2)]  # [B, Lp, 1], [B, 1, Sp]

    def visited(self, g: Geometry, b, row, t, pf, query_major: bool):
        """The block a grid step visits: its index, whether the step is live (t < count)
        and whether the tile is full."""
        counts, blocks, kinds = pf[:3]
        n_other = g.n_k if query_major else g.n_q
        base = self.seq(b) * (g.n_q if query_major else g.n_k) + row
        n = blocks[base * n_other + t]
        return n, t < counts[base], kinds[base * n_other + n] == FULL

    def visible(self, g: Geometry, b, i, j, pf, segs, shape):
        q_pos_LxS = i * g.bq + lax.broadcasted_iota(jnp.int32, shape, 0)
        k_pos_LxS = j * g.bk + lax.broadcasted_iota(jnp.int32, shape, 1)
        extra = {}
        if self.segments:
            extra.update(q_seg=segs[0][...], kv_seg=segs[1][...])
        lens = iter(pf[3:])
        if self.q_lengths:
            extra["q_len"] = next(lens)[b]
        if self.kv_lengths:
            extra["kv_len"] = next(lens)[b]
        return self.mask.visible(q_pos_LxS, k_pos_LxS, L=g.L, S=g.S, **extra)


def _run(step, mp, g, i, j, live=None, full=None):
    """Run `step(masked)` for one grid step: plain (causal skip from g) without a Mask; else
    only live steps, full tiles bare and partial ones masked."""
    if mp is None:
        _when_seen(i, j, g)(lambda: step(None))
        return
    pl.when(live & full)(lambda: step(False))
    pl.when(live & jnp.logical_not(full))(lambda: step(True))


def _split(refs, mp):
    n = 0 if mp is None else mp.n_prefetch
    return refs[:n], refs[n:]


def _fwd_kernel(*refs, g: Geometry, cap, mp=None):
    # prefetch (with a Mask): _MaskPlan.prefetch; q_ref: [L, K]; k_ref: [S, K]; v_ref: [S, V];
    # segs (with segment ids): [L, 1], [1, S]; o_ref: [L, V]; lse_ref: [L, 1]
    # scratch: max_ref, sum_ref: [L, 1] f32; acc_ref: [L, V] f32, alive across key steps t
    pf, refs = _split(refs, mp)
    q_ref, k_ref, v_ref, *segs, o_ref, lse_ref, max_ref, sum_ref, acc_ref = refs
    b, i, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    j, live, full = (t, None, None) if mp is None else mp.visited(g, b, i, t, pf, True)

    @pl.when(t == 0)
    def _init():
        max_ref[...] = jnp.full(max_ref.shape, MASK_VALUE, jnp.float32)
        sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def step(masked):
        shape = (g.bq, g.bk)
        ok_LxS = mp.visible(g, b, i, j, pf, segs, shape) if masked else None
        s_LxS, _ = _scores(q_ref[...], k_ref[...], i, j, g, cap, ok_LxS, mp is None)
        max_prev_Lx1 = max_ref[...]
        max_Lx1 = jnp.maximum(max_prev_Lx1, s_LxS.max(axis=1, keepdims=True))
        p_LxS = jnp.exp(s_LxS - max_Lx1)
        if ok_LxS is not None:  # a row may have seen no key yet: its max is MASK_VALUE
            p_LxS = jnp.where(ok_LxS, p_LxS, 0.0)
        alpha_Lx1 = jnp.exp(max_prev_Lx1 - max_Lx1)
        sum_ref[...] = alpha_Lx1 * sum_ref[...] + p_LxS.sum(axis=1, keepdims=True)
        pv_LxK = jnp.dot(p_LxS.astype(v_ref.dtype), v_ref[...], preferred_element_type=jnp.float32)
        acc_ref[...] = alpha_Lx1 * acc_ref[...] + pv_LxK
        max_ref[...] = max_Lx1

    _run(step, mp, g, i, j, live, full)

    @pl.when(t == pl.num_programs(3) - 1)
    def _finish():
        if mp is None:
            o_ref[...] = (acc_ref[...] / sum_ref[...]).astype(o_ref.dtype)
            lse_ref[...] = max_ref[...] + jnp.log(sum_ref[...])
            return
        sum_Lx1 = sum_ref[...]
        seen_Lx1 = sum_Lx1 > 0  # a row that sees no key: output 0, lse +inf (its P is 0)
        o_ref[...] = (acc_ref[...] / jnp.where(seen_Lx1, sum_Lx1, 1.0)).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(seen_Lx1, max_ref[...] + jnp.log(sum_Lx1), jnp.inf)


def _dq_kernel(*refs, g: Geometry, cap, mp=None):
    # prefetch (with a Mask); q_ref, dq_ref: [L, K]; do_ref: [L, V]; k_ref: [S, K];
    # v_ref: [S, V]; lse_ref, delta_ref: [L, 1]; segs: [L, 1], [1, S]
    # scratch dq_acc: [L, K] f32, alive across key steps t
    pf, refs = _split(refs, mp)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *segs, dq_ref, dq_acc = refs
    b, i, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    j, live, full = (t, None, None) if mp is None else mp.visited(g, b, i, t, pf, True)

    @pl.when(t == 0)
    def _init():
        dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    def step(masked):
        k_SxK = k_ref[...]
        ok_LxS = mp.visible(g, b, i, j, pf, segs, (g.bq, g.bk)) if masked else None
        s_LxS, t_LxS = _scores(q_ref[...], k_SxK, i, j, g, cap, ok_LxS, mp is None)
        p_LxS = jnp.exp(s_LxS - lse_ref[...])
        dp_LxS = lax.dot_general(
            do_ref[...], v_ref[...], NT_DIMS, preferred_element_type=jnp.float32
        )
        ds_LxS = _capped_grad(p_LxS * (dp_LxS - delta_ref[...]), t_LxS)
        ds_LxS = (ds_LxS * g.scale).astype(k_SxK.dtype)
        dq_acc[...] += jnp.dot(ds_LxS, k_SxK, preferred_element_type=jnp.float32)

    _run(step, mp, g, i, j, live, full)

    @pl.when(t == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)


def _dkv_kernel(*refs, g, cap, mp=None):
    # prefetch (with a Mask); q_ref: [L, K], do_ref: [L, V] of query head kv·R + member;
    # k_ref, dk_ref: [S, K]; v_ref, dv_ref: [S, V]; lse_ref, delta_ref: [L, 1]; segs:
    # [L, 1], [1, S]; scratch dk_acc: [S, K], dv_acc: [S, V] f32, alive across (member, t)
    pf, refs = _split(refs, mp)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *segs = refs[:-4]
    dk_ref, dv_ref, dk_acc, dv_acc = refs[-4:]
    b, j, member, t = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    i, live, full = (t, None, None) if mp is None else mp.visited(g, b, j, t, pf, False)

    @pl.when((member == 0) & (t == 0))
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    def step(masked):
        q_LxK, do_LxK = q_ref[...], do_ref[...]
        ok_LxS = mp.visible(g, b, i, j, pf, segs, (g.bq, g.bk)) if masked else None
        s_LxS, t_LxS = _scores(q_LxK, k_ref[...], i, j, g, cap, ok_LxS, mp is None)
        p_LxS = jnp.exp(s_LxS - lse_ref[...])
        dv_acc[...] += jnp.dot(
            p_LxS.astype(do_LxK.dtype).T, do_LxK, preferred_element_type=jnp.float32
        )
        dp_LxS = lax.dot_general(do_LxK, v_ref[...], NT_DIMS, preferred_element_type=jnp.float32)
        ds_LxS = _capped_grad(p_LxS * (dp_LxS - delta_ref[...]), t_LxS)
        ds_LxS = (ds_LxS * g.scale).astype(q_LxK.dtype)
        dk_acc[...] += jnp.dot(ds_LxS.T, q_LxK, preferred_element_type=jnp.float32)

    _run(step, mp, g, i, j, live, full)

    @pl.when((member == pl.num_programs(3) - 1) & (t == pl.num_programs(4) - 1))
    def _finish():
        dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _row_spec(block: int, width: int, index_map):
    return pl.BlockSpec((None, None, block, width), index_map)


def _pad(x_BxHxSxK, length: int):
    """Zero-pad the sequence axis (2) to `length`: padded keys are masked, padded rows dropped."""
    extra = length - x_BxHxSxK.shape[2]
    return jnp.pad(x_BxHxSxK, ((0, 0), (0, 0), (0, extra), (0, 0))) if extra else x_BxHxSxK


def _padded(g: Geometry, q_rows: tuple, kv_rows: tuple) -> list:
    """Pad query-indexed arrays to whole query blocks and key-indexed ones to whole key blocks."""
    return [_pad(x, g.n_q * g.bq) for x in q_rows] + [_pad(x, g.n_k * g.bk) for x in kv_rows]


def _params(n_parallel: int, n_arbitrary: int):
    semantics = ("parallel",) * n_parallel + ("arbitrary",) * n_arbitrary
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _key_block(g: Geometry, mp, b, i, t, pf):
    """The key block a (query block i, step t) grid step reads: the block map's t-th
    non-empty block (a Mask), else t clamped to the causal diagonal (no DMA past it)."""
    if mp is not None:
        return mp.visited(g, b, i, t, pf, True)[0]
    return jnp.minimum(t, g.k_blocks_end(i) - 1) if g.causal else t


def _query_block(g: Geometry, mp, b, j, t, pf):
    """The query block a (key block j, step t) grid step of dK/dV reads."""
    if mp is not None:
        return mp.visited(g, b, j, t, pf, False)[0]
    return jnp.maximum(t, g.q_blocks_start(j)) if g.causal else t


def _estimate(g: Geometry, mp, part: str, *sizes):
    """The CostEstimate a launch's pallas_call carries: common.launch_cost of the mask's
    static part (the arrays are traced here)."""
    mask, dynamic = (None, False) if mp is None else (mp.mask, mp.per_seq)
    return launch_cost(g, mask, dynamic, part, *sizes).estimate()


def _call(kernel, *, grid, in_specs, out_specs, scratch_shapes, mask_in, seg_specs, **kwargs):
    """pl.pallas_call, with a Mask's block map scalar-prefetched and its segment ids as
    extra inputs where `mask_in` = (prefetch arrays, segment id arrays) is given."""
    if mask_in is None:
        return lambda *args: pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch_shapes,
            **kwargs,
        )(*args)
    prefetch, segs = mask_in
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        grid=grid,
        in_specs=[*in_specs, *seg_specs[: len(segs)]],
        out_specs=out_specs,
        scratch_shapes=scratch_shapes,
    )
    return lambda *args: pl.pallas_call(kernel, grid_spec=spec, **kwargs)(*prefetch, *args, *segs)


def _forward(q_BxHxLxK, k_BxGxSxK, v_BxGxSxV, g: Geometry, opts: "_Options", mask_in=None):
    B, H, L, K = q_BxHxLxK.shape
    V = v_BxGxSxV.shape[-1]
    q_BxHxLxK, k_BxGxSxK, v_BxGxSxV = _padded(g, (q_BxHxLxK,), (k_BxGxSxK, v_BxGxSxV))
    mp = opts.mp

    def kv_index(b, h, i, t, *pf):  # skipped steps repeat the last block read: no DMA
        return b, h // g.R, _key_block(g, mp, b, i, t, pf), 0

    q_index = lambda b, h, i, t, *pf: (b, h, i, 0)
    q_spec, o_spec = _row_spec(g.bq, K, q_index), _row_spec(g.bq, V, q_index)
    k_spec, v_spec = _row_spec(g.bk, K, kv_index), _row_spec(g.bk, V, kv_index)
    seg_specs = [
        pl.BlockSpec((None, g.bq, 1), lambda b, h, i, t, *pf: (b, i, 0)),
        pl.BlockSpec((None, 1, g.bk), lambda b, h, i, t, *pf: (b, 0, kv_index(b, h, i, t, *pf)[2])),
    ]
    o_BxHxLxV, lse_BxHxLx1 = _call(
        functools.partial(_fwd_kernel, g=g, cap=opts.softcap, mp=mp),
        mask_in=mask_in,
        seg_specs=seg_specs,
        grid=(B, H, g.n_q, g.n_k),
        in_specs=[q_spec, k_spec, v_spec],
        out_specs=[o_spec, _row_spec(g.bq, 1, q_index)],
        out_shape=[
            jax.ShapeDtypeStruct((*q_BxHxLxK.shape[:3], V), q_BxHxLxK.dtype),
            jax.ShapeDtypeStruct((*q_BxHxLxK.shape[:3], 1), jnp.float32),
        ],
        scratch_shapes=[
            pltpu.VMEM((g.bq, 1), jnp.float32),
            pltpu.VMEM((g.bq, 1), jnp.float32),
            pltpu.VMEM((g.bq, V), jnp.float32),
        ],
        compiler_params=_params(3, 1),
        interpret=opts.interpret,
        name="flash_attention_fwd",
        cost_estimate=_estimate(g, mp, "fwd", B, H, K, V, q_BxHxLxK.dtype.itemsize),
    )(q_BxHxLxK, k_BxGxSxK, v_BxGxSxV)
    return o_BxHxLxV[:, :, :L], lse_BxHxLx1[:, :, :L]


def _dq(q_BxHxLxK, k_BxGxSxK, v_BxGxSxV, do_BxHxLxV, lse_BxHxLx1, delta_BxHxLx1, g, opts, mask_in):
    B, H, L, K = q_BxHxLxK.shape
    V = v_BxGxSxV.shape[-1]
    q_rows = (q_BxHxLxK, do_BxHxLxV, lse_BxHxLx1, delta_BxHxLx1)
    q_BxHxLxK, do_BxHxLxV, lse_BxHxLx1, delta_BxHxLx1, k_BxGxSxK, v_BxGxSxV = _padded(
        g, q_rows, (k_BxGxSxK, v_BxGxSxV)
    )

    mp = opts.mp

    def kv_index(b, h, i, t, *pf):
        return b, h // g.R, _key_block(g, mp, b, i, t, pf), 0

    q_index = lambda b, h, i, t, *pf: (b, h, i, 0)
    q_spec, do_spec = _row_spec(g.bq, K, q_index), _row_spec(g.bq, V, q_index)
    k_spec, v_spec = _row_spec(g.bk, K, kv_index), _row_spec(g.bk, V, kv_index)
    row_spec = _row_spec(g.bq, 1, q_index)
    seg_specs = [
        pl.BlockSpec((None, g.bq, 1), lambda b, h, i, t, *pf: (b, i, 0)),
        pl.BlockSpec((None, 1, g.bk), lambda b, h, i, t, *pf: (b, 0, kv_index(b, h, i, t, *pf)[2])),
    ]
    dq_BxHxLxK = _call(
        functools.partial(_dq_kernel, g=g, cap=opts.softcap, mp=mp),
        mask_in=mask_in,
        seg_specs=seg_specs,
        grid=(B, H, g.n_q, g.n_k),
        in_specs=[q_spec, k_spec, v_spec, do_spec, row_spec, row_spec],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q_BxHxLxK.shape, q_BxHxLxK.dtype),
        scratch_shapes=[pltpu.VMEM((g.bq, K), jnp.float32)],
        compiler_params=_params(3, 1),
        interpret=opts.interpret,
        name="flash_attention_dq",
        cost_estimate=_estimate(g, mp, "dq", B, H, K, V, q_BxHxLxK.dtype.itemsize),
    )(q_BxHxLxK, k_BxGxSxK, v_BxGxSxV, do_BxHxLxV, lse_BxHxLx1, delta_BxHxLx1)
    return dq_BxHxLxK[:, :, :L]


def _dkv(q_BxHxLxK, k_BxGxSxK, v_BxGxSxV, do_BxHxLxV, lse_BxHxLx1, delta_BxHxLx1, g, opts, mask_in):
    B, G, S, K = k_BxGxSxK.shape
    V = v_BxGxSxV.shape[-1]
    q_rows = (q_BxHxLxK, do_BxHxLxV, lse_BxHxLx1, delta_BxHxLx1)
    q_BxHxLxK, do_BxHxLxV, lse_BxHxLx1, delta_BxHxLx1, k_BxGxSxK, v_BxGxSxV = _padded(
        g, q_rows, (k_BxGxSxK, v_BxGxSxV)
    )

    mp = opts.mp

    def q_index(b, kv, j, member, t, *pf):  # skipped steps repeat a block read: no DMA
        return b, kv * g.R + member, _query_block(g, mp, b, j, t, pf), 0

    kv_index = lambda b, kv, j, member, t, *pf: (b, kv, j, 0)
    q_spec, do_spec = _row_spec(g.bq, K, q_index), _row_spec(g.bq, V, q_index)
    k_spec, v_spec = _row_spec(g.bk, K, kv_index), _row_spec(g.bk, V, kv_index)
    row_spec = _row_spec(g.bq, 1, q_index)
    seg_specs = [
        pl.BlockSpec(
            (None, g.bq, 1), lambda b, kv, j, m, t, *pf: (b, q_index(b, kv, j, m, t, *pf)[2], 0)
        ),
        pl.BlockSpec((None, 1, g.bk), lambda b, kv, j, m, t, *pf: (b, 0, j)),
    ]
    dk_BxGxSxK, dv_BxGxSxV = _call(
        functools.partial(_dkv_kernel, g=g, cap=opts.softcap, mp=mp),
        mask_in=mask_in,
        seg_specs=seg_specs,
        grid=(B, G, g.n_k, g.R, g.n_q),
        in_specs=[q_spec, k_spec, v_spec, do_spec, row_spec, row_spec],
        out_specs=[k_spec, v_spec],
        out_shape=[
            jax.ShapeDtypeStruct(k_BxGxSxK.shape, k_BxGxSxK.dtype),
            jax.ShapeDtypeStruct(v_BxGxSxV.shape, v_BxGxSxV.dtype),
        ],
        scratch_shapes=[pltpu.VMEM((g.bk, K), jnp.float32), pltpu.VMEM((g.bk, V), jnp.float32)],
        compiler_params=_params(3, 2),
        interpret=opts.interpret,
        name="flash_attention_dkv",
        cost_estimate=_estimate(g, mp, "dkv", B, G * g.R, K, V, q_BxHxLxK.dtype.itemsize),
    )(q_BxHxLxK, k_BxGxSxK, v_BxGxSxV, do_BxHxLxV, lse_BxHxLx1, delta_BxHxLx1)
    return dk_BxGxSxK[:, :, :S], dv_BxGxSxV[:, :, :S]


@dataclasses.dataclass(frozen=True)
class _Options:
    """What every kernel of one call shares besides its Geometry (hashable: a jit key)."""

    interpret: bool
    softcap: float | None = None  # scores become softcap·tanh(scores / softcap)
    mp: _MaskPlan | None = None  # with a Mask: its static side (else causal and padding)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _flash(q_BxHxLxK, k_BxGxSxK, v_BxGxSxV, sinks_H, masks, g, g_bwd, opts: _Options):
    """(output [B, H, L, V], log-sum-exp [B, H, L, 1] f32): both differentiable. `masks`:
    the forward, dQ and dK/dV kernels' (prefetch, segment ids) inputs, or Nones. `sinks_H`
    (or None): one logit per query head in every row's denominator, folded into the kernels'
    output and log-sum-exp (common.fold_sinks), which makes their backward exact unchanged."""
    return _flash_fwd(q_BxHxLxK, k_BxGxSxK, v_BxGxSxV, sinks_H, masks, g, g_bwd, opts)[0]


def _flash_fwd(q_BxHxLxK, k_BxGxSxK, v_BxGxSxV, sinks_H, masks, g, g_bwd, opts):
    o_BxHxLxV, lse_BxHxLx1 = _forward(q_BxHxLxK, k_BxGxSxK, v_BxGxSxV, g, opts, masks[0])
    if sinks_H is not None:
        w_BxHxLx1, lse_BxHxLx1 = fold_sinks(lse_BxHxLx1, sinks_H[None, :, None, None])
        o_BxHxLxV = (o_BxHxLxV.astype(jnp.float32) * w_BxHxLx1).astype(o_BxHxLxV.dtype)
    residuals = (q_BxHxLxK, k_BxGxSxK, v_BxGxSxV, o_BxHxLxV, lse_BxHxLx1, sinks_H, masks)
    return (o_BxHxLxV, lse_BxHxLx1), residuals


def _flash_bwd(g, g_bwd, opts, residuals, cotangents):
    q_BxHxLxK, k_BxGxSxK, v_BxGxSxV, o_BxHxLxV, lse_BxHxLx1, sinks_H, masks = residuals
    do_BxHxLxV, dlse_BxHxLx1 = cotangents
    # delta_i = Σ_d dO_id·O_id: the softmax-backward row term, one f32 per query row. A
    # cotangent on the log-sum-exp adds dlse_i·P_ij to dS_ij: the same as delta_i - dlse_i.
    delta_BxHxLx1 = jnp.sum(
        o_BxHxLxV.astype(jnp.float32) * do_BxHxLxV.astype(jnp.float32), axis=-1, keepdims=True
    )
    delta_BxHxLx1 = delta_BxHxLx1 - dlse_BxHxLx1
    args = (q_BxHxLxK, k_BxGxSxK, v_BxGxSxV, do_BxHxLxV, lse_BxHxLx1, delta_BxHxLx1)
    dq_BxHxLxK = _dq(*args, g_bwd, opts, masks[1])
    dk_BxGxSxK, dv_BxGxSxV = _dkv(*args, g_bwd, opts, masks[2])
    dsinks_H = None
    if sinks_H is not None:
        sink_1xHx1x1 = sinks_H[None, :, None, None]
        dsinks_H = sink_grad(sink_1xHx1x1, lse_BxHxLx1, delta_BxHxLx1).sum((0, 2, 3))
        dsinks_H = dsinks_H.astype(sinks_H.dtype)
    return dq_BxHxLxK, dk_BxGxSxK, dv_BxGxSxV, dsinks_H, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def check_inputs(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, *, causal: bool) -> None:
    """What this kernel accepts (the dispatch asks before choosing it): dtypes float32 and
    bfloat16; q/k and v head dims each in HEAD_DIMS (v's may differ)."""
    check_qkv(q_BxLxHxK, k_BxSxGxK, k_BxSxGxK, causal=causal, empty_rows=True)
    k, v = k_BxSxGxK, v_BxSxGxV
    if v.ndim != 4 or v.shape[:3] != k.shape[:3] or v.dtype != k.dtype:
        raise ValueError(
            f"{k.shape=} {v.shape=} {k.dtype=} {v.dtype=}: keys and values must share batch, "
            "length, heads and dtype (only the head dim may differ)"
        )
    check_dtype(q_BxLxHxK, DTYPES, "pallas_tpu")
    for what, x in (("q/k", q_BxLxHxK), ("v", v)):
        if x.shape[-1] not in HEAD_DIMS:
            raise ValueError(
                f"{what} head_dim {x.shape[-1]}: pallas_tpu supports {what} head_dim in "
                f"{HEAD_DIMS} "
                "(dtypes float32, bfloat16)"
            )


def _geometries(q_shape, G: int, S: int, causal: bool, scale, block_sizes, interpret):
    """(forward, backward) Geometry: the blocks shrink to short sequences."""
    _, L, H, K = q_shape
    align = 8 if interpret else LANES

    def geometry(block_q, block_k):
        bq, bk = min(block_q, round_up(L, align)), min(block_k, round_up(S, align))
        return Geometry(
            L=L, S=S, G=G, R=H // G, bq=bq, bk=bk, causal=causal, scale=default_scale(K, scale)
        )

    bs = block_sizes
    return geometry(bs.block_q, bs.block_k), geometry(bs.block_q_bwd, bs.block_k_bwd)


def kernel_cost(
    q_shape, k_shape, v_dim: int, dtype, *, mask: Mask, backward: bool, block_sizes=None
) -> TileCost:
    """What the launches' cost estimates add up to for one call (forward, or forward and
    both backward kernels), counted from the same block classification. Given a Mask whose
    arrays are NumPy (e.g. a plan's packed documents) the count is exact for them, where the
    pallas_call's own estimate, built while tracing, sees only the mask's static part."""
    B, L, H, K = q_shape
    S, G = k_shape[1:3]
    bs = block_sizes or BlockSizes()
    g, g_bwd = _geometries(q_shape, G, S, mask.causal, None, bs, False)
    itemsize = jnp.dtype(dtype).itemsize
    total = launch_cost(g, mask, False, "fwd", B, H, K, v_dim, itemsize)
    if backward:
        for part in ("dq", "dkv"):
            total = total + launch_cost(g_bwd, mask, False, part, B, H, K, v_dim, itemsize)
    return total


@functools.partial(
    jax.jit,
    static_argnames=("causal", "scale", "softcap", "return_lse", "block_sizes", "interpret"),
)
def flash_attention_tpu(
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
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool = False,
):
    """softmax(Q·Kᵀ·scale)·V, [batch, seq, heads, head_dim]; any length (padded and masked).

    dtypes float32, bfloat16; head dims 64, 128, 256, and v's may differ from q/k's (the
    output takes v's). `softcap`: the scores become softcap·tanh(scores / softcap) before the
    softmax (Gemma 2), gradient included. `return_lse=True` returns (out, lse) with lse
    [batch, seq, heads] f32, each row's natural log-sum-exp of the (capped) scaled scores;
    both are differentiable. `sinks` [heads]: one learned logit per query head in every
    row's softmax denominator (no value; its gradient included), folded in exactly through the
    log-sum-exp. `mask` (common.Mask: causal, a window, segment ids, lengths,
    combined with `causal`): the block map (Mask.block_map) is scalar-prefetched, each
    kernel's grid steps visit only the non-empty tiles (the index maps repeat the last block
    past them: no DMA), full tiles run bare, partial ones masked; a row that sees no key gives
    0 (lse -inf). Causal with more queries than keys takes this path too.
    `interpret=True` runs the same kernels through the Pallas interpreter (CPU tests); blocks
    then only need multiples of 8. Each kernel pads its inputs to its own blocks, so forward
    and backward may use different tiles.
    """
    check_inputs(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, causal=causal)
    softcap = check_softcap(softcap)
    sinks = check_sinks(sinks, q_BxLxHxK.shape[2])
    if not interpret:
        block_sizes.check_compiled()
    B, L, H, K = q_BxLxHxK.shape
    S, G = k_BxSxGxK.shape[1:3]
    mask = kernel_mask(mask, causal, B, L, S)

    g, g_bwd = _geometries(q_BxLxHxK.shape, G, S, causal, scale, block_sizes, interpret)
    q_BxHxLxK = jnp.swapaxes(q_BxLxHxK, 1, 2)
    k_BxGxSxK = jnp.swapaxes(k_BxSxGxK, 1, 2)
    v_BxGxSxV = jnp.swapaxes(v_BxSxGxV, 1, 2)
    mp = None if mask is None else _MaskPlan.of(mask)
    opts = _Options(interpret=interpret, softcap=softcap, mp=mp)
    masks = (None, None, None)
    if mp is not None:  # each kernel's block map, classified before it runs
        masks = tuple(
            (mp.prefetch(mask, gk, query_major), mp.segment_ids(mask, gk))
            for gk, query_major in ((g, True), (g_bwd, True), (g_bwd, False))
        )
    o_BxHxLxV, lse_BxHxLx1 = _flash(q_BxHxLxK, k_BxGxSxK, v_BxGxSxV, sinks, masks, g, g_bwd, opts)
    o_BxLxHxV = jnp.swapaxes(o_BxHxLxV, 1, 2)
    if not return_lse:
        return o_BxLxHxV
    lse_BxHxL = lse_BxHxLx1[..., 0]
    lse_BxHxL = jnp.where(lse_BxHxL == jnp.inf, -jnp.inf, lse_BxHxL)  # rows that saw no key
    return o_BxLxHxV, jnp.swapaxes(lse_BxHxL, 1, 2)

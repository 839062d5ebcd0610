"""Flash attention as a Pallas GPU kernel (Triton lowering): forward, dQ and dK/dV kernels.

Why Triton and not Mosaic GPU. JAX offers two Pallas GPU back ends. Mosaic GPU
(`jax.experimental.pallas.mosaic_gpu`) exposes Hopper's TMA, warpgroup MMA and barriers and is
the faster path on H100/B200, but its kernels are written per architecture (explicit
pipelining, warp specialisation) and do not run on Ampere or older. The Triton lowering
(`jax.experimental.pallas.triton`) takes the same block-level program as the TPU kernel
— load a tile, `dot`, elementwise, store — and lets the Triton compiler pick layouts,
pipelining (`num_stages`) and parallelism (`num_warps`) on every NVIDIA GPU since Volta (and
ROCm). For a lab whose point is comparing one algorithm across backends, one portable kernel
that reads like the TPU one wins. The Hopper kernel is Mosaic GPU's (pallas_mgpu.py), which the
dispatch prefers on H100/H200; this one stays for every other GPU and input.

GPU form of the algorithm: one program per (query block, batch, head); the program loops over
key blocks *inside* the kernel (`fori_loop`, upper bound at the causal diagonal), with the
running max, sum and accumulator in registers. The dK/dV kernel runs one program per (key
block, batch, kv head) and loops over the R query heads of its group and the query blocks
from the diagonal down, so grouped-query heads are neither repeated in memory nor reduced
afterwards.

Options (keyword-only on `flash_attention_gpu`; dtypes float32, bfloat16, float16): head dims
any multiple of 8 up to 256 for q/k and for v, which may differ (zero-padded to Triton's
power-of-two tiles in the wrapper); `softcap` (cap·tanh(scores / cap) before the mask, its
1 - tanh² in both backward kernels); `sinks` (a logit per query head in the softmax
denominator, folded into the forward's output and log-sum-exp; the backward kernels then
need no change, and the sinks' gradient is -Σ P_sink·delta per head); `return_lse` (each
row's natural log-sum-exp as a second, differentiable output: its cotangent enters the
backward as delta - dlse).

Block sizes, warps, stages and the mask-split variant come from `tuned/<gpu>.json`, keyed by
`device_kind` and head_dim and written by the recorded search `python -m
lab.tools.attention_tune`; a GPU with no file gets `BLOCK_SIZES["default"]`. No GPU has been
searched yet: the folder is empty until one is.
"""

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lab.kernels import triton_deprecation
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
    device_kind,
    kernel_mask,
    launch_cost,
    sink_grad,
    sink_output,
    visible,
)

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Head dims (q/k and v alike): any multiple of 8 up to 256. Triton tiles are powers of two and
# tl.dot needs >= 16, so the wrapper zero-pads the head dims to the next such tile (zero
# columns add nothing to Q·Kᵀ, and the output's padded columns are dropped).
HEAD_DIM_MULTIPLE, MAX_HEAD_DIM = 8, 256
HEAD_DIMS = tuple(range(HEAD_DIM_MULTIPLE, MAX_HEAD_DIM + 1, HEAD_DIM_MULTIPLE))
# What the dispatch may pass beyond plain attention (common.FEATURE_NAMES).
FEATURES = frozenset(
    {"softcap", "sinks", "lse", "value_dim", "empty_rows", "segments", "lengths", "window"}
)


def _power_of_two(n) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def _tile_dim(head_dim: int) -> int:
    """The power-of-two (>= 16) tile a head dim is padded to."""
    return max(16, pl.next_power_of_2(head_dim))


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles and Triton launch parameters of the three kernels.

    The defaults spill no register on H100 for head_dim 64 and 128, bf16 and f16, causal and
    not, on jax 0.10 and the newest (compiled for sm_90a and read back from ptxas by
    tests/test_gpu_plans.py; the table is in BENCHMARKS.md). The earlier 64 × 64 tiles with 4
    warps and 2 stages spilled in dK/dV at head_dim 128 (255 registers). Fastest is the
    tuner's to find on a GPU; these are the largest tiles that spill nowhere.
    """

    block_q: int = 128  # forward: query rows per program
    block_k: int = 64  # forward: key columns per loop step
    block_q_dq: int = 128  # dQ kernel: query rows per program
    block_k_dq: int = 64  # dQ kernel: key columns per loop step
    block_q_dkv: int = 128  # dK/dV kernel: query rows per loop step
    block_k_dkv: int = 64  # dK/dV kernel: key columns per program
    num_warps: int = 8  # forward: warps per program (Triton)
    num_stages: int = 3  # forward: software-pipelining depth of the key loop (Triton)
    num_warps_bwd: int = 8  # both backward kernels
    num_stages_bwd: int = 1  # 2 stages spill in dK/dV at head_dim 128
    # Variant: run the key (or query) blocks that a tile sees whole in a loop without the
    # iota/compare/select of the mask, and mask only the diagonal and padded blocks (the
    # FlashAttention-2 split). Same result; whether it is faster is the tuner's to measure.
    split_mask: bool = True

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name.startswith("block_") and not (_power_of_two(value) and value >= 16):
                raise ValueError(f"BlockSizes.{field.name}={value!r}: must be a power of two >= 16")
            if field.name.startswith("num_warps") and not (_power_of_two(value) and value <= 32):
                raise ValueError(f"BlockSizes.{field.name}={value!r}: must be a power of two <= 32")
            if field.name.startswith("num_stages") and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"BlockSizes.{field.name}={value!r}: must be an int >= 1")
        if not isinstance(self.split_mask, bool):
            raise ValueError(f"BlockSizes.split_mask={self.split_mask!r}: must be a bool")


# What every GPU gets until it has been searched (tuned/<gpu>.json).
BLOCK_SIZES: dict[str, BlockSizes] = {
    "default": BlockSizes(),
}
TUNED_DIR = Path(__file__).parent / "tuned"


def load_tuned(folder: Path = TUNED_DIR) -> dict[str, dict[int, BlockSizes]]:
    """device_kind -> head_dim -> BlockSizes, from the JSON files `python -m
    lab.tools.attention_tune write=true` leaves in `tuned/` (one per GPU kind, with the search
    that chose them). Data, not code: a new GPU is one file."""
    table: dict[str, dict[int, BlockSizes]] = {}
    for path in sorted(folder.glob("*.json")):
        entry = json.loads(path.read_text())
        if entry.get("kernel", "pallas_gpu") != "pallas_gpu":  # pallas_mgpu's own files
            continue
        by_dim = {int(d): BlockSizes(**fields) for d, fields in entry["by_head_dim"].items()}
        table[entry["device_kind"]] = by_dim
    return table


TUNED = load_tuned()


def block_sizes_for(device_kind: str, head_dim: int | None = None) -> BlockSizes:
    """The searched entry for this GPU and head_dim (the nearest searched head_dim), else the
    default."""
    by_dim = TUNED.get(device_kind)
    if not by_dim:
        return BLOCK_SIZES.get(device_kind, BLOCK_SIZES["default"])
    if head_dim is None or head_dim not in by_dim:
        head_dim = min(by_dim, key=lambda d: (abs(d - (head_dim or 0)), d))
    return by_dim[head_dim]


def _dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """a·b (optionally transposed) accumulated in f32: the lax.dot_general that `pl.dot` wraps,
    written out because that helper moved between JAX versions. Triton transposes in
    registers; f32 inputs get IEEE precision (not TF32) under the default precision."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _scores(q_LxK, k_SxK, i, j, g: Geometry, masked: bool, cap: float | None, tiles=None):
    """Scaled (and soft-capped) f32 scores of query block i against key block j, masked where
    `masked` (by the Mask's `tiles` where given, else causal and padding); with the cap also
    tanh(scores / cap), whose 1 - t² the backward needs; and the tile's mask (or None)."""
    s_LxS = _dot(q_LxK, k_SxK, trans_b=True) * g.scale
    t_LxS = ok_LxS = None
    if cap is not None:
        t_LxS = jnp.tanh(s_LxS * (1.0 / cap))
        s_LxS = cap * t_LxS
    if masked:
        if tiles is not None:
            ok_LxS = tiles.visible(i, j)
        else:
            q_pos_Lx1 = (i * g.bq + jnp.arange(g.bq))[:, None]
            k_pos_1xS = (j * g.bk + jnp.arange(g.bk))[None, :]
            ok_LxS = visible(q_pos_Lx1, k_pos_1xS, causal=g.causal, kv_len=g.S, offset=g.offset)
        s_LxS = jnp.where(ok_LxS, s_LxS, MASK_VALUE)
    return s_LxS, t_LxS, ok_LxS


@dataclasses.dataclass(frozen=True)
class _MaskPlan:
    """The static side of a Mask for the kernels (hashable: part of the jit key): its causal
    and window clauses, which of its arrays ride along as kernel inputs, and whether the
    block map is per sequence."""

    mask: Mask  # causal and window only (no arrays)
    segments: bool
    q_lengths: bool
    kv_lengths: bool
    per_seq: bool

    @staticmethod
    def of(mask: Mask, per_seq: bool) -> "_MaskPlan":
        return _MaskPlan(
            Mask.make(causal=mask.causal, window=mask.window),
            mask.segments,
            mask.q_lengths is not None,
            mask.kv_lengths is not None,
            per_seq,
        )

    def arrays(self, mask: Mask, bm, g: Geometry, query_major: bool) -> list:
        """One kernel's mask inputs: its block-map rows (count, block list, kinds), then the
        segment ids padded to whole blocks, then the lengths."""
        if query_major:
            maps = [bm.kv_count, bm.kv_blocks, bm.kind]
        else:  # per key block: its query blocks, and the kinds of that column
            maps = [bm.q_count, bm.q_blocks, jnp.swapaxes(jnp.asarray(bm.kind), 1, 2)]
        out = [jnp.asarray(x, jnp.int32) for x in maps]
        if self.segments:
            out.append(_pad(mask.q_segment_ids.astype(jnp.int32), g.n_q * g.bq))
            out.append(_pad(mask.kv_segment_ids.astype(jnp.int32), g.n_k * g.bk))
        for present, x in ((self.q_lengths, mask.q_lengths), (self.kv_lengths, mask.kv_lengths)):
            if present:
                out.append(x.astype(jnp.int32))
        return out

    def specs(self, g: Geometry, query_major: bool) -> list:
        """BlockSpecs of `arrays` for a grid (query or key block, batch, head)."""
        seq = (lambda b: b) if self.per_seq else (lambda b: 0)
        n = g.n_k if query_major else g.n_q
        out = [
            pl.BlockSpec((None, None), lambda x, b, h: (seq(b), x)),
            pl.BlockSpec((None, None, n), lambda x, b, h: (seq(b), x, 0)),
            pl.BlockSpec((None, None, n), lambda x, b, h: (seq(b), x, 0)),
        ]
        if self.segments:
            Lp, Sp = g.n_q * g.bq, g.n_k * g.bk
            if query_major:
                out.append(pl.BlockSpec((None, g.bq), lambda i, b, h: (b, i)))
                out.append(pl.BlockSpec((None, Sp), lambda i, b, h: (b, 0)))
            else:
                out.append(pl.BlockSpec((None, Lp), lambda j, b, h: (b, 0)))
                out.append(pl.BlockSpec((None, g.bk), lambda j, b, h: (b, j)))
        out += [pl.BlockSpec((None,), lambda x, b, h: (b,))] * (self.q_lengths + self.kv_lengths)
        return out


class _Tiles:
    """Inside a kernel: its block map row (which blocks to visit, which need the mask) and
    the mask of one (query block i, key block j) tile, from the mask inputs."""

    def __init__(self, mp: _MaskPlan, refs, g: Geometry, query_major: bool):
        self.mp, self.g, self.query_major = mp, g, query_major
        self.count, self.blocks, self.kinds, *rest = refs
        rest = iter(rest)
        self.q_seg, self.kv_seg = (next(rest), next(rest)) if mp.segments else (None, None)
        self.q_len = next(rest) if mp.q_lengths else None
        self.kv_len = next(rest) if mp.kv_lengths else None

    def visible(self, i, j):
        g = self.g
        q_pos_Lx1 = (i * g.bq + jnp.arange(g.bq))[:, None]
        k_pos_1xS = (j * g.bk + jnp.arange(g.bk))[None, :]
        extra = {}
        if self.q_seg is not None:
            if self.query_major:
                q_seg, kv_seg = self.q_seg[...], self.kv_seg[pl.ds(j * g.bk, g.bk)]
            else:
                q_seg, kv_seg = self.q_seg[pl.ds(i * g.bq, g.bq)], self.kv_seg[...]
            extra.update(q_seg=q_seg[:, None], kv_seg=kv_seg[None, :])
        if self.q_len is not None:
            extra["q_len"] = self.q_len[...]
        if self.kv_len is not None:
            extra["kv_len"] = self.kv_len[...]
        return self.mp.mask.visible(q_pos_Lx1, k_pos_1xS, L=g.L, S=g.S, **extra)

    def loop(self, step, carry):
        """`step(n, carry, masked=...)` over this row's non-empty blocks n: full ones bare,
        partial ones masked; empty ones never visited."""

        def body(t, carry):
            n = self.blocks[t]
            return jax.lax.cond(
                self.kinds[n] == FULL,
                functools.partial(step, n, masked=False),
                functools.partial(step, n, masked=True),
                carry,
            )

        return jax.lax.fori_loop(0, self.count[...], body, carry)


def _capped_grad(ds_LxS, t_LxS):
    """dL/d(scale·q·k) from dL/d(cap·tanh(·/cap)): times 1 - tanh²."""
    return ds_LxS if t_LxS is None else ds_LxS * (1.0 - t_LxS * t_LxS)


def _loops(step, carry, spans):
    """Run `step(n, carry, masked=...)` over consecutive spans [(lo, hi, masked), ...]."""
    for lo, hi, masked in spans:
        carry = jax.lax.fori_loop(lo, hi, functools.partial(step, masked=masked), carry)
    return carry


def _key_spans(i, g: Geometry, split: bool):
    """The key blocks query block i sees, as spans: whole blocks unmasked, then the rest."""
    end = g.k_blocks_end(i)
    if not g.needs_mask:
        return [(0, end, False)]
    if not split:
        return [(0, end, True)]
    whole = g.k_blocks_whole(i)
    return [(0, whole, False), (whole, end, True)]


def _query_spans(j, g: Geometry, split: bool):
    """The query blocks that see key block j, as spans: masked ones, then whole ones."""
    start = g.q_blocks_start(j)
    if not g.needs_mask:
        return [(start, g.n_q, False)]
    if not split:
        return [(start, g.n_q, True)]
    mid = g.q_blocks_masked_end(j)
    return [(start, mid, True), (mid, g.n_q, False)]


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, g: Geometry, split: bool, cap, mp=None):
    # q_ref: [L, K]; k_ref: [Sp, K], v_ref: [Sp, Kv] (the whole padded sequence);
    # refs: the mask inputs (with a Mask: _MaskPlan.arrays), then o_ref: [L, Kv]; lse_ref: [L]
    *mask_refs, o_ref, lse_ref = refs
    tiles = None if mp is None else _Tiles(mp, mask_refs, g, query_major=True)
    i = pl.program_id(0)
    q_LxK = q_ref[...]

    def step(j, carry, masked):
        o_LxK, max_Q, sum_Q = carry
        keys = pl.ds(j * g.bk, g.bk)
        s_LxS, _, ok_LxS = _scores(q_LxK, k_ref[keys, :], i, j, g, masked, cap, tiles)
        new_max_Q = jnp.maximum(max_Q, s_LxS.max(axis=1))
        p_LxS = jnp.exp(s_LxS - new_max_Q[:, None])
        if tiles is not None and masked:  # a row may have seen no key yet: its max is MASK
            p_LxS = jnp.where(ok_LxS, p_LxS, 0.0)
        alpha_Q = jnp.exp(max_Q - new_max_Q)
        pv_LxK = _dot(p_LxS.astype(v_ref.dtype), v_ref[keys, :])
        return alpha_Q[:, None] * o_LxK + pv_LxK, new_max_Q, alpha_Q * sum_Q + p_LxS.sum(axis=1)

    init = (
        jnp.zeros(o_ref.shape, jnp.float32),
        jnp.full((g.bq,), MASK_VALUE, jnp.float32),
        jnp.zeros((g.bq,), jnp.float32),
    )
    if tiles is None:
        o_LxK, max_Q, sum_Q = _loops(step, init, _key_spans(i, g, split))
        o_ref[...] = (o_LxK / sum_Q[:, None]).astype(o_ref.dtype)
        lse_ref[...] = max_Q + jnp.log(sum_Q)
        return
    o_LxK, max_Q, sum_Q = tiles.loop(step, init)
    seen_Q = sum_Q > 0  # a row that sees no key: output 0, log-sum-exp +inf (its P is 0)
    o_ref[...] = (o_LxK / jnp.where(seen_Q, sum_Q, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen_Q, max_Q + jnp.log(sum_Q), jnp.inf)


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, g: Geometry, split, cap, mp=None
):
    # q_ref, dq_ref: [L, K]; do_ref: [L, Kv]; k_ref: [Sp, K]; v_ref: [Sp, Kv];
    # lse_ref, delta_ref: [L]; refs: the mask inputs, then dq_ref
    *mask_refs, dq_ref = refs
    tiles = None if mp is None else _Tiles(mp, mask_refs, g, query_major=True)
    i = pl.program_id(0)
    q_LxK, do_LxK = q_ref[...], do_ref[...]
    lse_Lx1, delta_Lx1 = lse_ref[...][:, None], delta_ref[...][:, None]

    def step(j, dq_LxK, masked):
        keys = pl.ds(j * g.bk, g.bk)
        k_SxK = k_ref[keys, :]
        s_LxS, t_LxS, _ = _scores(q_LxK, k_SxK, i, j, g, masked, cap, tiles)
        p_LxS = jnp.exp(s_LxS - lse_Lx1)
        dp_LxS = _dot(do_LxK, v_ref[keys, :], trans_b=True)
        ds_LxS = _capped_grad(p_LxS * (dp_LxS - delta_Lx1), t_LxS)
        ds_LxS = (ds_LxS * g.scale).astype(k_SxK.dtype)
        return dq_LxK + _dot(ds_LxS, k_SxK)

    zeros = jnp.zeros(q_LxK.shape, jnp.float32)
    if tiles is None:
        dq_LxK = _loops(step, zeros, _key_spans(i, g, split))
    else:
        dq_LxK = tiles.loop(step, zeros)
    dq_ref[...] = dq_LxK.astype(dq_ref.dtype)


def _dkv_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, g: Geometry, split, cap, mp=None
):
    # q_ref: [Lp, R, K], do_ref: [Lp, R, Kv] (the group's query heads); lse_ref, delta_ref:
    # [R, Lp]; k_ref, dk_ref: [S, K]; v_ref, dv_ref: [S, Kv]; refs: the mask inputs, dk, dv
    *mask_refs, dk_ref, dv_ref = refs
    tiles = None if mp is None else _Tiles(mp, mask_refs, g, query_major=False)
    j = pl.program_id(0)
    k_SxK, v_SxK = k_ref[...], v_ref[...]

    def step(i, carry, member, masked):
        dk_SxK, dv_SxK = carry
        rows = pl.ds(i * g.bq, g.bq)
        q_LxK, do_LxK = q_ref[rows, member, :], do_ref[rows, member, :]
        lse_Lx1, delta_Lx1 = lse_ref[member, rows][:, None], delta_ref[member, rows][:, None]
        s_LxS, t_LxS, _ = _scores(q_LxK, k_SxK, i, j, g, masked, cap, tiles)
        p_LxS = jnp.exp(s_LxS - lse_Lx1)
        dv_SxK += _dot(p_LxS.astype(do_LxK.dtype), do_LxK, trans_a=True)
        dp_LxS = _dot(do_LxK, v_SxK, trans_b=True)
        ds_LxS = _capped_grad(p_LxS * (dp_LxS - delta_Lx1), t_LxS)
        ds_LxS = (ds_LxS * g.scale).astype(q_LxK.dtype)
        dk_SxK += _dot(ds_LxS, q_LxK, trans_a=True)
        return dk_SxK, dv_SxK

    def one_member(member, carry):
        member_step = functools.partial(step, member=member)
        if tiles is not None:
            return tiles.loop(member_step, carry)
        return _loops(member_step, carry, _query_spans(j, g, split))

    zeros = (jnp.zeros(k_SxK.shape, jnp.float32), jnp.zeros(v_SxK.shape, jnp.float32))
    dk_SxK, dv_SxK = jax.lax.fori_loop(0, g.R, one_member, zeros)
    dk_ref[...] = dk_SxK.astype(dk_ref.dtype)
    dv_ref[...] = dv_SxK.astype(dv_ref.dtype)


def _pad(x_BxSxHxK, length: int, axis: int = 1):
    """Zero-pad one axis to `length`: padded keys are masked, padded rows dropped, padded head
    dim columns add zeros to every product."""
    widths = [(0, 0)] * x_BxSxHxK.ndim
    widths[axis] = (0, length - x_BxSxHxK.shape[axis])
    return jnp.pad(x_BxSxHxK, widths) if widths[axis][1] else x_BxSxHxK


def _triton(num_warps: int, num_stages: int):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _forward(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, g: Geometry, plan: "_Plan", masks=()):
    B, L, H, K = q_BxLxHxK.shape
    V = v_BxSxGxV.shape[-1]
    bs = plan.block_sizes
    Lp, Sp = g.n_q * g.bq, g.n_k * g.bk
    q_spec = pl.BlockSpec((None, g.bq, None, K), lambda i, b, h: (b, i, h, 0))
    o_spec = pl.BlockSpec((None, g.bq, None, V), lambda i, b, h: (b, i, h, 0))
    k_spec = pl.BlockSpec((None, Sp, None, K), lambda i, b, h: (b, 0, h // g.R, 0))
    v_spec = pl.BlockSpec((None, Sp, None, V), lambda i, b, h: (b, 0, h // g.R, 0))
    o_BxLxHxV, lse_BxHxL = pl.pallas_call(
        functools.partial(_fwd_kernel, g=g, split=bs.split_mask, cap=plan.softcap, mp=plan.mp),
        grid=(g.n_q, B, H),
        in_specs=[q_spec, k_spec, v_spec, *_mask_specs(plan, g, query_major=True)],
        out_specs=[o_spec, pl.BlockSpec((None, None, g.bq), lambda i, b, h: (b, h, i))],
        out_shape=[
            jax.ShapeDtypeStruct((B, Lp, H, V), q_BxLxHxK.dtype),
            jax.ShapeDtypeStruct((B, H, Lp), jnp.float32),
        ],
        compiler_params=_triton(bs.num_warps, bs.num_stages),
        interpret=plan.interpret,
        name="flash_attention_fwd",
        cost_estimate=_estimate(g, plan, "fwd", B, H, K, V, q_BxLxHxK.dtype.itemsize),
    )(_pad(q_BxLxHxK, Lp), _pad(k_BxSxGxK, Sp), _pad(v_BxSxGxV, Sp), *masks)
    return o_BxLxHxV[:, :L], lse_BxHxL[:, :, :L]


def _dq(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, do_BxLxHxV, lse_BxHxL, delta_BxHxL, g, plan, masks):
    B, L, H, K = q_BxLxHxK.shape
    V = v_BxSxGxV.shape[-1]
    bs = plan.block_sizes
    Lp, Sp = g.n_q * g.bq, g.n_k * g.bk
    q_spec = pl.BlockSpec((None, g.bq, None, K), lambda i, b, h: (b, i, h, 0))
    do_spec = pl.BlockSpec((None, g.bq, None, V), lambda i, b, h: (b, i, h, 0))
    k_spec = pl.BlockSpec((None, Sp, None, K), lambda i, b, h: (b, 0, h // g.R, 0))
    v_spec = pl.BlockSpec((None, Sp, None, V), lambda i, b, h: (b, 0, h // g.R, 0))
    row_spec = pl.BlockSpec((None, None, g.bq), lambda i, b, h: (b, h, i))
    dq_BxLxHxK = pl.pallas_call(
        functools.partial(_dq_kernel, g=g, split=bs.split_mask, cap=plan.softcap, mp=plan.mp),
        grid=(g.n_q, B, H),
        in_specs=[
            *(q_spec, k_spec, v_spec, do_spec, row_spec, row_spec),
            *_mask_specs(plan, g, query_major=True),
        ],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct((B, Lp, H, K), q_BxLxHxK.dtype),
        compiler_params=_triton(bs.num_warps_bwd, bs.num_stages_bwd),
        interpret=plan.interpret,
        name="flash_attention_dq",
        cost_estimate=_estimate(g, plan, "dq", B, H, K, V, q_BxLxHxK.dtype.itemsize),
    )(
        _pad(q_BxLxHxK, Lp),
        _pad(k_BxSxGxK, Sp),
        _pad(v_BxSxGxV, Sp),
        _pad(do_BxLxHxV, Lp),
        _pad(lse_BxHxL, Lp, axis=2),
        _pad(delta_BxHxL, Lp, axis=2),
        *masks,
    )
    return dq_BxLxHxK[:, :L]


def _dkv(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, do_BxLxHxV, lse_BxHxL, delta_BxHxL, g, plan, masks):
    B, S, G, K = k_BxSxGxK.shape
    V = v_BxSxGxV.shape[-1]
    bs = plan.block_sizes
    Lp, Sp = g.n_q * g.bq, g.n_k * g.bk
    q_spec = pl.BlockSpec((None, Lp, g.R, K), lambda j, b, kv: (b, 0, kv, 0))
    do_spec = pl.BlockSpec((None, Lp, g.R, V), lambda j, b, kv: (b, 0, kv, 0))
    group_rows_spec = pl.BlockSpec((None, g.R, Lp), lambda j, b, kv: (b, kv, 0))
    k_spec = pl.BlockSpec((None, g.bk, None, K), lambda j, b, kv: (b, j, kv, 0))
    v_spec = pl.BlockSpec((None, g.bk, None, V), lambda j, b, kv: (b, j, kv, 0))
    dk_BxSxGxK, dv_BxSxGxV = pl.pallas_call(
        functools.partial(_dkv_kernel, g=g, split=bs.split_mask, cap=plan.softcap, mp=plan.mp),
        grid=(g.n_k, B, G),
        in_specs=[
            *(q_spec, k_spec, v_spec, do_spec, group_rows_spec, group_rows_spec),
            *_mask_specs(plan, g, query_major=False),
        ],
        out_specs=[k_spec, v_spec],
        out_shape=[
            jax.ShapeDtypeStruct((B, Sp, G, K), k_BxSxGxK.dtype),
            jax.ShapeDtypeStruct((B, Sp, G, V), v_BxSxGxV.dtype),
        ],
        compiler_params=_triton(bs.num_warps_bwd, bs.num_stages_bwd),
        interpret=plan.interpret,
        name="flash_attention_dkv",
        cost_estimate=_estimate(g, plan, "dkv", B, G * g.R, K, V, q_BxLxHxK.dtype.itemsize),
    )(
        _pad(q_BxLxHxK, Lp),
        _pad(k_BxSxGxK, Sp),
        _pad(v_BxSxGxV, Sp),
        _pad(do_BxLxHxV, Lp),
        _pad(lse_BxHxL, Lp, axis=2),
        _pad(delta_BxHxL, Lp, axis=2),
        *masks,
    )
    return dk_BxSxGxK[:, :S], dv_BxSxGxV[:, :S]


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Geometry of each kernel (their tiles differ) plus launch parameters: one jit key."""

    fwd: Geometry
    dq: Geometry
    dkv: Geometry
    block_sizes: BlockSizes
    interpret: bool
    softcap: float | None = None  # scores become softcap·tanh(scores / softcap)
    mp: _MaskPlan | None = None  # with a Mask: its static side (else causal and padding)


def _estimate(g: Geometry, plan: _Plan, part: str, *sizes):
    """The CostEstimate a launch's pallas_call carries: common.launch_cost of the mask's
    static part (its arrays are traced here). The Triton lowering drops it (jax 0.10 to
    0.12): a plan counts the same tiles with `kernel_cost` instead."""
    mask, dynamic = (None, False) if plan.mp is None else (plan.mp.mask, plan.mp.per_seq)
    return launch_cost(g, mask, dynamic, part, *sizes).estimate()


def _geometries(q_shape, S: int, G: int, causal: bool, scale, bs) -> tuple:
    """The forward, dQ and dK/dV kernels' Geometry: tiles shrink to the (power-of-two)
    sequence lengths."""
    _, L, H, K = q_shape

    def geometry(block_q, block_k):
        bq = min(block_q, max(16, pl.next_power_of_2(L)))
        bk = min(block_k, max(16, pl.next_power_of_2(S)))
        return Geometry(
            L=L, S=S, G=G, R=H // G, bq=bq, bk=bk, causal=causal, scale=default_scale(K, scale)
        )

    return (
        geometry(bs.block_q, bs.block_k),
        geometry(bs.block_q_dq, bs.block_k_dq),
        geometry(bs.block_q_dkv, bs.block_k_dkv),
    )


def kernel_cost(
    q_shape, k_shape, v_dim: int, dtype, *, mask: Mask, backward: bool, block_sizes=None
) -> TileCost:
    """What the launches' cost estimates add up to for one call (forward, or forward, dQ and
    dK/dV), from the same block classification; with a Mask of NumPy arrays (a plan's packed
    documents) exact for them. `block_sizes=None`: the device's tuned entry, as the kernel."""
    B, L, H, K = q_shape
    S, G = k_shape[1:3]
    bs = block_sizes or block_sizes_for(device_kind(), K)
    geometries = _geometries(q_shape, S, G, mask.causal, None, bs)
    Kt, Vt = _tile_dim(K), _tile_dim(v_dim)
    itemsize = jnp.dtype(dtype).itemsize
    parts = zip(geometries, ("fwd", "dq", "dkv")[: 3 if backward else 1], strict=False)
    total = None
    for g, part in parts:
        c = launch_cost(g, mask, False, part, B, H, Kt, Vt, itemsize)
        total = c if total is None else total + c
    return total


def _mask_specs(plan: _Plan, g: Geometry, query_major: bool) -> list:
    return [] if plan.mp is None else plan.mp.specs(g, query_major)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, sinks_H, masks, plan: _Plan):
    """(output [B, L, H, V], log-sum-exp [B, H, L] f32): both differentiable. `masks`: the
    forward, dQ and dK/dV kernels' mask inputs (three lists; empty without a Mask). `sinks_H`
    (or None): one logit per query head in every row's denominator, folded into the kernels'
    output and log-sum-exp (common.fold_sinks), which makes their backward exact unchanged."""
    return _flash_fwd(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, sinks_H, masks, plan)[0]


def _flash_fwd(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, sinks_H, masks, plan: _Plan):
    o_BxLxHxV, lse_BxHxL = _forward(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, plan.fwd, plan, masks[0])
    if sinks_H is not None:
        o_BxLxHxV, lse_BxHxL = sink_output(o_BxLxHxV, lse_BxHxL, sinks_H)
    residuals = (q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, o_BxLxHxV, lse_BxHxL, sinks_H, masks)
    return (o_BxLxHxV, lse_BxHxL), residuals


def _flash_bwd(plan: _Plan, residuals, cotangents):
    q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, o_BxLxHxV, lse_BxHxL, sinks_H, masks = residuals
    do_BxLxHxV, dlse_BxHxL = cotangents
    # delta_i = Σ_d dO_id·O_id: the softmax-backward row term, one f32 per query row. A
    # cotangent on the log-sum-exp adds dlse_i·P_ij to dS_ij: the same as delta_i - dlse_i.
    delta_BxHxL = jnp.einsum(
        "blhk,blhk->bhl", o_BxLxHxV.astype(jnp.float32), do_BxLxHxV.astype(jnp.float32)
    )
    delta_BxHxL = delta_BxHxL - dlse_BxHxL
    args = (q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, do_BxLxHxV, lse_BxHxL, delta_BxHxL)
    dq_BxLxHxK = _dq(*args, plan.dq, plan, masks[1])
    dk_BxSxGxK, dv_BxSxGxV = _dkv(*args, plan.dkv, plan, masks[2])
    dsinks_H = None
    if sinks_H is not None:
        dsinks_H = sink_grad(sinks_H[None, :, None], lse_BxHxL, delta_BxHxL).sum((0, 2))
        dsinks_H = dsinks_H.astype(sinks_H.dtype)
    return dq_BxLxHxK, dk_BxSxGxK, dv_BxSxGxV, dsinks_H, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _check_head_dim(x, what: str) -> None:
    d = x.shape[-1]
    if d % HEAD_DIM_MULTIPLE or not 0 < d <= MAX_HEAD_DIM:
        raise ValueError(
            f"{what} head_dim {d}: pallas_gpu supports {what} head_dim a multiple of "
            f"{HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM} (dtypes float32, bfloat16, float16)"
        )


def check_inputs(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, *, causal: bool) -> None:
    """What this kernel accepts (the dispatch asks before choosing it): dtypes float32,
    bfloat16, float16; q/k and v head dims each a multiple of 8 up to 256 (v's may differ)."""
    check_qkv(q_BxLxHxK, k_BxSxGxK, k_BxSxGxK, causal=causal, empty_rows=True)
    k, v = k_BxSxGxK, v_BxSxGxV
    if v.ndim != 4 or v.shape[:3] != k.shape[:3] or v.dtype != k.dtype:
        raise ValueError(
            f"{k.shape=} {v.shape=} {k.dtype=} {v.dtype=}: keys and values must share batch, "
            "length, heads and dtype (only the head dim may differ)"
        )
    check_dtype(q_BxLxHxK, DTYPES, "pallas_gpu")
    _check_head_dim(q_BxLxHxK, "q/k")
    _check_head_dim(v_BxSxGxV, "v")


@functools.partial(
    jax.jit,
    static_argnames=("causal", "scale", "softcap", "return_lse", "block_sizes", "interpret"),
)
def flash_attention_gpu(
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
    interpret: bool = False,
):
    """softmax(Q·Kᵀ·scale)·V, [batch, seq, heads, head_dim]; any length (padded and masked).

    dtypes float32, bfloat16, float16; head dims any multiple of 8 up to 256, and v's head
    dim may differ from q/k's (the output takes v's). `softcap`: the scores become
    softcap·tanh(scores / softcap) before the softmax (Gemma 2), gradient included.
    `return_lse=True` returns (out, lse) with lse [batch, seq, heads] f32, each row's
    natural log-sum-exp of the (capped) scaled scores; both are differentiable.
    `sinks` [heads]: one learned logit per query head in every row's softmax denominator
    (no value; its gradient included), folded in exactly through the log-sum-exp.
    `mask` (common.Mask: causal, a window, segment ids, lengths, combined with `causal`):
    each kernel visits only the tiles its block map (Mask.block_map) does not classify empty,
    and applies the mask only to the partial ones; a row that sees no key gives 0 (lse -inf).
    Causal with more queries than keys takes this path too.
    `block_sizes=None` looks the device up in `BLOCK_SIZES`; `interpret=True` runs the same
    kernels through the Pallas interpreter (CPU tests).
    """
    check_inputs(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, causal=causal)
    softcap = check_softcap(softcap)
    sinks = check_sinks(sinks, q_BxLxHxK.shape[2])
    if not interpret:
        triton_deprecation.explain()  # jax >= 0.11: one line instead of a warning per kernel
    B, L, H, K = q_BxLxHxK.shape
    S, G, V = k_BxSxGxK.shape[1], k_BxSxGxK.shape[2], v_BxSxGxV.shape[-1]
    mask = kernel_mask(mask, causal, B, L, S)
    if block_sizes is None:
        block_sizes = block_sizes_for(device_kind(), K)

    bs = block_sizes
    fwd, dq, dkv = _geometries(q_BxLxHxK.shape, S, G, causal, scale, bs)
    plan = _Plan(
        fwd=fwd,
        dq=dq,
        dkv=dkv,
        block_sizes=bs,
        interpret=interpret,
        softcap=softcap,
        mp=None if mask is None else _MaskPlan.of(mask, per_seq=mask.dynamic),
    )
    masks = ([], [], [])
    if mask is not None:  # each kernel's block map, classified before it runs
        masks = tuple(
            plan.mp.arrays(mask, mask.block_map(L, S, g.bq, g.bk), g, query_major)
            for g, query_major in ((plan.fwd, True), (plan.dq, True), (plan.dkv, False))
        )
    Kt, Vt = _tile_dim(K), _tile_dim(V)  # Triton's power-of-two tiles
    q, k = _pad(q_BxLxHxK, Kt, axis=3), _pad(k_BxSxGxK, Kt, axis=3)
    o_BxLxHxV, lse_BxHxL = _flash(q, k, _pad(v_BxSxGxV, Vt, axis=3), sinks, masks, plan)
    o_BxLxHxV = o_BxLxHxV[..., :V]
    if not return_lse:
        return o_BxLxHxV
    lse_BxHxL = jnp.where(lse_BxHxL == jnp.inf, -jnp.inf, lse_BxHxL)  # rows that saw no key
    return o_BxLxHxV, jnp.swapaxes(lse_BxHxL, 1, 2)

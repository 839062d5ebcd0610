"""Pipeline (layer) parallelism: the stacked layers split over the `stage` mesh axis, the batch
cut into microbatches that are passed stage to stage with `jax.lax.ppermute` under
`jax.shard_map`. No model code: a stage applies any `stage_fn(params, x) -> x`.

Letters (lab/names.py): M microbatches, P stages, B rows (of one microbatch inside the
pipeline), L sequence, D model width; repeats and ticks are spelled out.

Schedules (`Schedule`)
  GPipe     every microbatch passes stages 0 … P-1 once; at tick t stage s works on
            microbatch t - s. ticks = M + P - 1, each stage busy M of them:
            bubble = (P - 1) / (M + P - 1).
  circular  (repeats > 1, MaxText's "circular repeats") stage s holds `repeats` chunks of
            layers: chunk r is layers (r·P + s)·C … (r·P + s + 1)·C - 1, C = layers /
            (repeats·P); a microbatch goes round the ring of stages `repeats` times. A tick is
            1/repeats of a GPipe tick: ticks = repeats·M + P - 1,
            bubble = (P - 1) / (repeats·M + P - 1), for repeats·P - 1 hops per microbatch
            instead of P - 1 (and M >= P, so the ring never waits for stage 0). Its chunk
            is chosen per tick, so its ticks are recomputed in the backward (see `_ticks`).

The backward is `jax.grad` through the scanned ticks: the transpose of `ppermute(s → s+1)` is
`ppermute(s+1 → s)` in a reversed loop of as many ticks, so cotangents flow from the last stage
to the first with the same traffic as the forward. All forward ticks run before all backward
ticks: GPipe, not 1F1B (1F1B keeps P instead of M microbatches of residuals; here the memory
levers are remat and gradient accumulation around the pipeline).

SPMD: every stage runs its stage function at every tick, on padding during its bubble ticks;
those results are discarded and get zero cotangents. The time cost is the bubble; the memory
cost is residuals kept for `ticks`, not M, microbatches. The weights are kept once, not per
tick: GPipe takes its stage's layers outside the tick loop (a loop constant, whose derived
values JAX's scan hoists); indexed inside, every tick would save its own copy of them (seen:
a 70B stage's weights × 15 ticks in an H100 plan).

The shard_map is manual over `stage` and the batch axes (data, and fsdp under pp+fsdp); model
stays automatic, so inside a stage XLA splits tensor-parallel matmuls as in the unpipelined
step. Manual batch axes keep every weight collective out of the tick loop: the parameters are
cast to "varying" over the data axes once before the loop, and the transpose of that cast is
the one reduction per step (without it XLA all-reduces the stage's gradient at every tick);
weights split over fsdp (`weight_specs`) are all-gathered once before the loop, and the
transpose of that gather is their gradient's one reduce-scatter (left automatic, XLA gathers
every weight of every layer at every tick, forward and backward, as MaxText's
pipeline_fsdp_ag_once avoids).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from lab.names import STAGE

IO = ("replicated", "stage")
LAYER_ORDERS = ("natural", "stage_major")


# --- the schedule on paper ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: `stages` P, `microbatches` M, `repeats` (1 = GPipe, more =
    circular). Everything here is arithmetic; `pipeline_apply` runs it."""

    stages: int
    microbatches: int
    repeats: int = 1

    def __post_init__(self):
        if min(self.stages, self.microbatches, self.repeats) < 1:
            raise ValueError(f"{self}: stages, microbatches and repeats must be >= 1")
        if self.repeats > 1 and self.microbatches < self.stages:
            raise ValueError(
                f"circular schedule: microbatches={self.microbatches} must be >= "
                f"stages={self.stages}"
            )

    @property
    def ticks(self) -> int:
        """Ticks of the schedule: at each one every stage applies one chunk of its layers."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """Idle fraction of every stage: (P-1) / (repeats·M + P-1)."""
        return (self.stages - 1) / self.ticks

    def table(self) -> list[list[tuple[int, int] | None]]:
        """table[t][s] = (repeat, microbatch) stage s works on at tick t, None in the bubble."""
        M, R = self.microbatches, self.repeats
        rows = []
        for t in range(self.ticks):
            row = []
            for s in range(self.stages):
                k = t - s
                row.append((k // M, k % M) if 0 <= k < R * M else None)
            rows.append(row)
        return rows

    def permute_bytes(self, microbatch_bytes: int) -> dict[str, int]:
        """Bytes the forward sends between stages (the backward sends as many again).

        useful: every microbatch crosses repeats·P - 1 stage boundaries (P - 1 for GPipe).
        per_device: every device runs every tick (SPMD) and sends one microbatch per tick,
          bubble ticks included: what one device's compiled program sends.
        on_wire: per_device × the stages that send (P - 1; P for the circular ring).
        """
        P_, M, R, a = self.stages, self.microbatches, self.repeats, microbatch_bytes
        senders = P_ if R > 1 else P_ - 1
        return {
            "useful": M * (R * P_ - 1) * a,
            "per_device": self.ticks * a,
            "on_wire": self.ticks * senders * a,
        }


# --- inside a stage -----------------------------------------------------------------------


def scan_layers(layer_fn: Callable, *, remat: bool = False, remat_policy=None) -> Callable:
    """A stage function that applies `layer_fn(layer_params, x) -> x` to each of its layers in
    turn (lax.scan over the leading axis of its parameters); `remat` wraps each layer in
    jax.checkpoint with `remat_policy` (None: save nothing)."""
    fn = jax.checkpoint(layer_fn, policy=remat_policy, prevent_cse=False) if remat else layer_fn

    def stage_fn(params, x):
        x, _ = jax.lax.scan(lambda x, p: (fn(p, x), None), x, params)
        return x

    return stage_fn


# --- microbatches and layer order -----------------------------------------------------------


def to_microbatches(x_BxX, M: int, groups: tuple[int, int]):
    """[B, ...] → [M, B/M, ...] without moving rows between devices.

    groups = (S, G): the batch is laid out as S·G contiguous blocks (S stage blocks, each split
    into G data blocks; S = 1 when every stage holds the whole batch). Block (s, g) holds
    microbatches s·M/S … (s+1)·M/S - 1, rows g·(B/M)/G … of each: a local reshape and
    transpose, where a plain reshape(M, B/M) would be an all-to-all over the data axes.
    """
    S, G = groups
    B, rest = x_BxX.shape[0], x_BxX.shape[1:]
    x = x_BxX.reshape((S, G, M // S, B // M // G) + rest)
    return jnp.swapaxes(x, 1, 2).reshape((M, B // M) + rest)


def from_microbatches(y_MxBxX, groups: tuple[int, int]):
    """The inverse of `to_microbatches`."""
    S, G = groups
    M, B, rest = y_MxBxX.shape[0], y_MxBxX.shape[1], y_MxBxX.shape[2:]
    y = y_MxBxX.reshape((S, M // S, G, B // G) + rest)
    return jnp.swapaxes(y, 1, 2).reshape((M * B,) + rest)


def stage_major(stacked_params, stages: int, repeats: int = 1):
    """[layers, ...] in layer order → [P, repeats, C, ...]: stage s, repeat r holds layers
    (r·P + s)·C … (r·P + s + 1)·C - 1. With repeats = 1 a pure reshape: stage s holds a
    contiguous block of layers, the split that sharding the layer axis over `stage` gives."""

    def one(a):
        n = a.shape[0]
        if n % (stages * repeats):
            raise ValueError(
                f"{a.shape=}: {n} layers do not divide into stages={stages} x repeats={repeats}"
            )
        a = a.reshape((repeats, stages, n // (stages * repeats)) + a.shape[1:])
        return jnp.swapaxes(a, 0, 1)

    return jax.tree.map(one, stacked_params)


def to_stage_major_order(stacked_params, stages: int, repeats: int):
    """Layer order → the storage `layer_order="stage_major"` expects (index s·R·C + r·C + j
    holds layer (r·P + s)·C + j), so that the layer axis sharded over `stage` in contiguous
    blocks already gives every stage its chunks: no reshuffle per step."""
    return jax.tree.map(
        lambda a: a.reshape((-1,) + a.shape[3:]), stage_major(stacked_params, stages, repeats)
    )


def from_stage_major_order(stacked_params, stages: int, repeats: int):
    """The inverse of `to_stage_major_order`: stage-major storage → layer order (leaf index =
    layer), e.g. to serve a circular run's weights unscanned."""

    def one(a):
        n = a.shape[0]
        a = a.reshape((stages, repeats, n // (stages * repeats)) + a.shape[1:])
        return jnp.swapaxes(a, 0, 1).reshape((n,) + a.shape[3:])

    return jax.tree.map(one, stacked_params)


# --- the schedule run ------------------------------------------------------------------------


def _spec_axes(specs) -> set:
    """Every mesh axis a pytree of PartitionSpecs names."""
    if specs is None:
        return set()
    out = set()
    for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)):
        for axes in spec:
            out.update((axes,) if isinstance(axes, str) else tuple(axes or ()))
    return out


def _varying(tree, axes):
    """Values marked as differing per device along `axes` (vma typing), once, before the tick
    loop: the transpose of this cast is the backward's one reduction over those axes."""
    if not axes or not hasattr(jax.lax, "pcast"):
        return tree
    return jax.tree.map(lambda a: jax.lax.pcast(a, tuple(axes), to="varying"), tree)


def _gathered(params, specs):
    """The stage's weights whole over the axes `specs` name (a PartitionSpec per leaf, over
    its dims after the layer axis): one all-gather per weight before the tick loop, whose
    transpose is the gradient's one reduce-scatter after it (ZeRO-3 once per step, not once
    per layer per tick)."""
    if specs is None:
        return params

    def one(a, spec):
        for dim, axes in enumerate(spec, start=2):  # a: [repeats, C, ...]
            if axes:
                a = jax.lax.all_gather(a, axes, axis=dim, tiled=True)
        return a

    return jax.tree.map(one, params, specs, is_leaf=lambda x: isinstance(x, P))


def _chunk(params, r):
    """Repeat r's chunk of a stage's parameters [repeats, C, ...] → [C, ...]."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, 0, False), params)


def _in_float32(collective, x):
    """A collective of the pipeline's input or output run in float32, exact: each row comes
    from one stage (the others add zeros). XLA:CPU aborts on a 16-bit reduce-scatter or
    all-reduce (its all-reduce promotion pass cannot clone the copy-rooted reducer JAX emits),
    and the transposes of the input's all-gather and cast are such ops. Costs 2x the bytes of
    these collectives, once per step; the stage-to-stage permutes keep the compute dtype."""
    if jnp.dtype(x.dtype).itemsize >= 4:
        return collective(x)
    return collective(x.astype(jnp.float32)).astype(x.dtype)


def _ticks(
    stage_fn,
    params,
    x_MxBxLxD,
    *,
    schedule: Schedule,
    batch_axes,
    weight_specs,
    io,
    check_vma,
    remat_stage,
):
    """Per device (manual over the stage and batch axes): the tick loop of one stage."""
    P_, M, R = schedule.stages, schedule.microbatches, schedule.repeats
    T = schedule.ticks
    s = jax.lax.axis_index(STAGE)
    vary = _varying if check_vma else (lambda tree, axes: tree)
    params = jax.tree.map(lambda a: a[0], params)  # this stage's chunks: [repeats, C, ...]
    if weight_specs is None:
        params = vary(params, batch_axes)
    else:  # each weight over the batch axes it is not split over (those it is are gathered)
        params = jax.tree.map(
            lambda a, spec: vary(a, tuple(x for x in batch_axes if x not in _spec_axes(spec))),
            params,
            weight_specs,
            is_leaf=lambda x: isinstance(x, P),
        )
        params = _gathered(params, weight_specs)
    if io == "stage":  # each stage brought M/P microbatches: stage 0 needs them all
        gather = functools.partial(jax.lax.all_gather, axis_name=STAGE, axis=0, tiled=True)
        x_MxBxLxD = _in_float32(gather, x_MxBxLxD)
    else:  # the transpose of this cast is the input cotangent's one sum over stages
        x_MxBxLxD = _in_float32(lambda x: vary(x, (STAGE,)), x_MxBxLxD)
    pad = jnp.zeros((T - M,) + x_MxBxLxD.shape[1:], x_MxBxLxD.dtype)
    xs_TxBxLxD = jnp.concatenate([x_MxBxLxD, vary(pad, (STAGE, *batch_axes))])
    ring = R > 1  # the circular schedule closes the ring: the last stage feeds stage 0
    # What the backward keeps of the weights: GPipe takes its one chunk outside the tick loop,
    # a constant of the loop, so whatever the stage computes from it (bf16 casts) is saved
    # once, not once per tick. The circular schedule picks its chunk per tick: its ticks are
    # recomputed in the backward (remat of the stage), or each tick would keep its own copy.
    chunks = params if ring else jax.tree.map(lambda a: a[0], params)

    def run(chunks, r, x_BxLxD):
        return stage_fn(_chunk(chunks, r) if ring else chunks, x_BxLxD)

    if ring or remat_stage:
        run = jax.checkpoint(run, prevent_cse=False)
    perm = [(i, (i + 1) % P_) for i in range(P_ if ring else P_ - 1)]

    def tick(carry, t_and_x):
        recv_BxLxD, held_MxBxLxD = carry
        t, fresh_BxLxD = t_and_x
        k = t - s  # chunks this stage has started: repeat k // M of microbatch k % M
        r = jnp.clip(k // M, 0, R - 1)
        first_BxLxD = fresh_BxLxD
        if ring:  # stage 0 keeps what came round for the microbatch's next repeat
            slot = jnp.mod(t - P_, M)
            held_MxBxLxD = jax.lax.dynamic_update_index_in_dim(held_MxBxLxD, recv_BxLxD, slot, 0)
            again_BxLxD = jax.lax.dynamic_index_in_dim(held_MxBxLxD, jnp.mod(t, M), 0, False)
            first_BxLxD = jnp.where(t < M, fresh_BxLxD, again_BxLxD)
        inp_BxLxD = jnp.where(s == 0, first_BxLxD, recv_BxLxD)
        y_BxLxD = run(chunks, r, inp_BxLxD)
        return (jax.lax.ppermute(y_BxLxD, STAGE, perm), held_MxBxLxD), y_BxLxD

    empty = vary(jnp.zeros((0,), x_MxBxLxD.dtype), (STAGE, *batch_axes))
    held = jnp.zeros_like(x_MxBxLxD) if ring else empty
    init = (jnp.zeros_like(xs_TxBxLxD[0]), held)
    _, ys_TxBxLxD = jax.lax.scan(tick, init, (jnp.arange(T, dtype=jnp.int32), xs_TxBxLxD))
    done_MxBxLxD = ys_TxBxLxD[T - M :]  # the last stage's outputs of the last repeat
    mine_MxBxLxD = jnp.where(s == P_ - 1, done_MxBxLxD, jnp.zeros_like(done_MxBxLxD))
    if io == "stage":  # each stage keeps M/P microbatches (the head then runs split)
        scatter = functools.partial(
            jax.lax.psum_scatter, axis_name=STAGE, scatter_dimension=0, tiled=True
        )
        return _in_float32(scatter, mine_MxBxLxD)
    return _in_float32(lambda y: jax.lax.psum(y, STAGE), mine_MxBxLxD)


def pipeline_apply(
    stage_fn: Callable,
    stacked_params,
    x_BxLxD,
    *,
    microbatches: int,
    repeats: int = 1,
    mesh=None,
    batch_axes: tuple[str, ...] = (),
    batch_layout: tuple[str, ...] | None = None,
    weight_specs=None,
    io: str = "replicated",
    layer_order: str = "natural",
    remat_stage: bool = False,
    check_vma: bool = True,
):
    """`stage_fn` applied stage after stage to `x_BxLxD`, pipelined over the `stage` mesh axis.

    stacked_params: a pytree whose leaves lead with the layer axis (flax nn.scan's layout),
      best sharded over `stage` on it (the rule layers → stage); their other axes keep their
      shardings over the automatic axes (fsdp, model).
    stage_fn(params, x_BxLxD) -> x_BxLxD applies one stage's C layers (`scan_layers`).
    batch_axes: mesh axes the batch is split over and no parameter is (data parallelism):
      manual inside, so each device sums its gradient over every tick and the reduction over
      them happens once per step.
    batch_layout: every mesh axis besides `stage` the batch is split over outside (default
      batch_axes; with fsdp inside the stages, fsdp too, which stays automatic). Microbatches
      are cut so that each device keeps its own rows (`to_microbatches`); the result comes
      back in the same order, so the row assignment is invisible outside.
    weight_specs: None, or a PartitionSpec per leaf of stacked_params over its dims after the
      layer axis, naming batch_axes the weights are split over too (ZeRO-3 inside the
      stages: fsdp). Each stage gathers its weights over them once per step, before the tick
      loop, and reduce-scatters their gradient once after it; without it (fsdp automatic),
      XLA gathers every weight at every tick and reduces its gradient at every tick. The
      cost: a stage's weights are whole on its devices for the step (MaxText's
      pipeline_fsdp_ag_once).
    io: "replicated": x and the result are whole on every stage (the result by a psum over
      `stage`). "stage": both split over `stage` along the microbatch axis (M % P == 0), the
      batch outside laid out as (stage, *batch_layout): the input is all-gathered to stage 0,
      the output reduce-scattered from the last stage, and the caller's embedding, head and
      loss use the stage devices as more data parallelism.
    layer_order: "natural" (leaf index = layer) or "stage_major" (`to_stage_major_order`): the
      same for GPipe; for the circular schedule natural order sharded over `stage` costs an
      all-to-all of the block parameters (and of their gradients) every step.
    remat_stage: jax.checkpoint round a whole stage: only each tick's stage input is kept
      (always so for the circular schedule, see `_ticks`).
    mesh: a Mesh or AbstractMesh with a `stage` axis; None = the context mesh (jax.set_mesh).
    check_vma: False for stage functions whose ops carry no varying-axes types (the lab's
      blockwise loop and Pallas kernels, written for shard_map(check_vma=False)); the values
      and gradients are the same (tests), only JAX's type check is off.
    """
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if STAGE not in mesh.axis_names:
        raise ValueError(f"mesh axes {mesh.axis_names} have no {STAGE!r} axis")
    schedule = Schedule(mesh.shape[STAGE], microbatches, repeats)
    P_, M = schedule.stages, schedule.microbatches
    B = x_BxLxD.shape[0]
    batch_axes = tuple(a for a in batch_axes if a != STAGE)
    layout = batch_axes if batch_layout is None else tuple(a for a in batch_layout if a != STAGE)
    groups = (P_ if io == "stage" else 1, math.prod(mesh.shape[a] for a in layout))
    if io not in IO:
        raise ValueError(f"io={io!r}: expected one of {', '.join(IO)}")
    if io == "stage" and M % P_:
        raise ValueError(f"io='stage': microbatches={M} must divide by stages={P_}")
    if B % M or (B // M) % groups[1]:
        raise ValueError(
            f"{x_BxLxD.shape=}: batch {B} must divide into microbatches={M} whose rows split "
            f"over {layout} ({groups[1]} devices)"
        )
    stray = _spec_axes(weight_specs) - set(batch_axes)
    if stray:
        raise ValueError(
            f"weight_specs split weights over {sorted(stray)}: gathered inside the pipeline, "
            f"they must be manual batch_axes too (got {batch_axes})"
        )
    if layer_order == "stage_major":
        chunks = jax.tree.map(
            lambda a: a.reshape((P_, repeats, a.shape[0] // (P_ * repeats)) + a.shape[1:]),
            stacked_params,
        )
    elif layer_order == "natural":
        chunks = stage_major(stacked_params, P_, repeats)
    else:
        raise ValueError(f"layer_order={layer_order!r}: expected one of {LAYER_ORDERS}")
    body = functools.partial(
        _ticks,
        stage_fn,
        schedule=schedule,
        batch_axes=batch_axes,
        weight_specs=weight_specs,
        io=io,
        check_vma=check_vma,
        remat_stage=remat_stage,
    )
    x_spec = P(STAGE if io == "stage" else None, batch_axes or None)
    if weight_specs is None:
        chunk_specs = jax.tree.map(lambda _: P(STAGE), chunks)
    else:  # [P, repeats, C, ...]: the stage's weights arrive split as they are stored
        chunk_specs = jax.tree.map(
            lambda _, spec: P(STAGE, None, None, *spec),
            chunks,
            weight_specs,
            is_leaf=lambda x: isinstance(x, P),
        )
    y_MxBxLxD = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(chunk_specs, x_spec),
        out_specs=x_spec,
        axis_names={STAGE, *batch_axes},
        check_vma=check_vma,
    )(chunks, to_microbatches(x_BxLxD, M, groups))
    return from_microbatches(y_MxBxLxD, groups)


def pipeline_reference(stage_fn: Callable, stacked_params, x_BxLxD):
    """The same layers unpipelined: `stage_fn` over every layer, the whole batch at once."""
    return stage_fn(stacked_params, x_BxLxD)

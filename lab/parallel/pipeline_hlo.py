"""What a pipelined step really sends between stages, read from its compiled HLO.

The collective-permutes over the `stage` axis that JAX's `ppermute` produced are the pipeline's
traffic (lab/kernels/pipeline.py): one per tick in the forward loop, one per tick in the
backward loop (the transposed ppermute). Each sits in a while loop of the schedule's
ticks = repeats·M + P - 1 trips, so the compiled program itself says how many ticks it runs,
and the bubble follows from counting them: (ticks - repeats·M) / ticks. The ticks are the
forward permutes' executions over one run of the schedule: with accumulate=K the tick loops
sit inside the accumulation loop and each permute runs K·ticks times a step, and a tick XLA
peels out of its loop (XLA:TPU under remat=offload) is a permute of its own, run once. Bytes
are per device, per step, from each op's buffer (lab/parallel/collectives_hlo.py).

Analytic, per device: a microbatch's activation a = B/(K·M·W)·L·D·c (B the batch, K the
accumulation steps, W the devices the rows split over besides the stages, c the compute
dtype's bytes); every device runs every tick, so it sends K·ticks·a per direction a step, of
which the useful part, summed over a data replica's P stages, is K·M·(repeats·P - 1)·a.

Under pp+fsdp the stages' weights are split over fsdp as well: each stage gathers its own once
per step, before the tick loop, and reduce-scatters their gradient once after it (the
shard_map's all_gather and its transpose). The reading counts those ops and where they run:
once per step each, for every block weight split over fsdp, none inside the tick loop.
"""

import math

import jax
import numpy as np

from lab.measure.pipeline import Direction, PipelineReading
from lab.names import BATCH, STAGE
from lab.parallel.collectives_hlo import Collective


def stage_permutes(collectives: list[Collective]) -> dict[str, list[Collective]]:
    """The pipeline's collective-permutes over `stage` (from `ppermute`; XLA's own permutes,
    e.g. a reshuffle of parameters, are left out), split forward / backward."""
    out = {"forward": [], "backward": []}
    for c in collectives:
        if c.kind == "collective-permute" and c.axes == (STAGE,) and "ppermute" in c.op_name:
            out["backward" if "transpose(" in c.op_name else "forward"].append(c)
    return out


def stage_weight_collectives(collectives: list[Collective]) -> dict[str, list[Collective]]:
    """The pipeline's gathers of its stages' weights over the axes besides `stage` (fsdp),
    and their gradients' reduce-scatters: the pipeline shard_map's own all_gather and its
    transpose (its input and output move over `stage` alone, and are left out)."""
    out = {"gather": [], "scatter": []}
    for c in collectives:
        if "shard_map/" not in c.op_name or not c.axes or STAGE in c.axes:
            continue
        if c.kind == "all-gather":
            out["gather"].append(c)
        elif c.kind == "reduce-scatter":
            out["scatter"].append(c)
    return out


def weights_split(params, rules, sizes: dict[str, int]) -> int:
    """Block weights (the stacked layers) split over a batch axis besides `stage`: those a
    pipeline gathers once per step (pp+fsdp)."""
    axes = dict(rules).get(BATCH) or ()
    batch = {a for a in ((axes,) if isinstance(axes, str) else axes) if a != STAGE}
    batch = {a for a in batch if sizes.get(a, 1) > 1}
    n = 0
    for leaf in jax.tree.leaves(params.get("blocks", {})):
        used = set()
        for entry in leaf.sharding.spec:
            used.update((entry,) if isinstance(entry, str) else tuple(entry or ()))
        n += bool(used & batch)
    return n


def _direction(ops: list[Collective]) -> Direction:
    return Direction(
        ops=len(ops),
        executions=sum(c.count for c in ops),
        trip_counts=tuple(sorted({c.count for c in ops})),
        bytes_per_device=sum(c.buffer_bytes * c.count for c in ops),
        loop_trips=tuple(sorted({c.trips for c in ops})),
    )


def microbatch_bytes(cfg, rules, sizes: dict[str, int]) -> int:
    """One pipeline microbatch's activations [B, L, D] on one device, in the compute dtype."""
    axes = dict(rules).get(BATCH) or ()
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    W = math.prod(sizes.get(a, 1) for a in axes if a != STAGE)
    rows = cfg.batch_size // (cfg.accumulate * cfg.model.microbatches * W)
    return rows * cfg.seq_len * cfg.model.d_model * np.dtype(cfg.model.dtype).itemsize


def read(
    collectives: list[Collective],
    schedule,
    microbatch_bytes: int,
    weights_split: int = 0,
    accumulate: int = 1,
) -> PipelineReading:
    """The compiled pipeline (`collectives` of its step) against `schedule`
    (lab.kernels.pipeline.Schedule: stages, microbatches, repeats, ticks, bubble,
    permute_bytes); `weights_split` block weights are gathered once per step; the schedule
    runs `accumulate` times a step (once per accumulation microbatch)."""
    found = stage_permutes(collectives)
    weights = stage_weight_collectives(collectives)
    K = max(1, accumulate)
    want = {k: K * v for k, v in schedule.permute_bytes(microbatch_bytes).items()}
    return PipelineReading(
        stages=schedule.stages,
        microbatches=schedule.microbatches,
        repeats=schedule.repeats,
        microbatch_bytes=microbatch_bytes,
        ticks=schedule.ticks,
        bubble=schedule.bubble,
        bytes_per_device=want["per_device"],
        useful_bytes=want["useful"],
        forward=_direction(found["forward"]),
        backward=_direction(found["backward"]),
        weights_split=weights_split,
        weight_gathers=_direction(weights["gather"]),
        weight_scatters=_direction(weights["scatter"]),
        accumulate=K,
    )


def from_trainer(collectives: list[Collective], trainer) -> PipelineReading | None:
    """`read` for a lab Trainer (lab.train.make_trainer); None when it runs no pipeline."""
    if trainer.schedule is None:
        return None
    sizes = dict(trainer.mesh.shape)
    a = microbatch_bytes(trainer.cfg, trainer.rules, sizes)
    n = weights_split(trainer.abstract_state.params, trainer.rules, sizes)
    return read(collectives, trainer.schedule, a, n, trainer.cfg.accumulate)

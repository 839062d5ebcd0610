"""The training step and the sharded state it runs on: pure functions, jitted with shardings.

The state is first built abstractly (`jax.eval_shape`), its logical axis names turned into
mesh shardings, and only then materialised by a jitted init whose `out_shardings` put every
parameter and optimizer slot straight onto its devices: no host copy of the full model.

Fitting bigger models: `accumulate=K` runs the batch as K microbatches in a `lax.scan` and sums
their gradients before the one update (the same update as the whole batch, one microbatch's
activations live at a time; over the axes that split only the batch, reduced once);
`offload_optimizer=true` keeps the AdamW state in host memory (its shardings' memory kind),
brought to the device for the update and sent back by the step's `out_shardings`; a pipeline
(strategy=pp*) is the model's business (lab/model.py), its schedule is kept here for the
analysis (`Trainer.schedule`).
"""

import dataclasses
import functools
import json
import re
import zlib
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lab import checkpoint, quant
from lab.config import Config
from lab.errors import ConfigError
from lab.kernels.pipeline import Schedule, from_stage_major_order, to_stage_major_order
from lab.measure.memory import LayerCensus
from lab.mesh import axis_size, parse_mesh_spec, rules_for, strategy_mesh
from lab.model import (
    build,
    layer_census,
    layer_order,
    mesh_axes_of,
    rules_without,
    stack_layers,
    unstack_layers,
)
from lab.names import BATCH, HOST_MEMORY, PIPELINE_STRATEGIES, SEQ, STAGE
from lab.resolve import Platform, Request, Resolved, resolve


class TrainState(struct.PyTreeNode):
    step: jax.Array
    params: Any
    opt_state: Any


def lr_schedule(cfg: Config) -> optax.Schedule:
    """Learning rate by update count (0 for the first update): linear warm-up, cosine decay.
    The optimizer's own, and the loop's for the learning rate it logs."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.steps, cfg.warmup_steps + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


# The weights weight decay pulls toward zero: every matrix the model multiplies (lab/quant.py
# names them) and the embedding table. Never a norm's scale (it multiplies by 1 at init, not
# by a small weight; decay would shrink the activations it sets).
DECAYED = frozenset(quant.EINSUMS) | {"embed"}


def decay_mask(params):
    """True for each weight AdamW decays, chosen by its name, so that every layout decays the
    same weights: a norm's scale is a vector unscanned and a [layers, D] matrix when the layers
    are stacked (scan_layers, every pipeline), so a rule by rank would decay it in one layout
    and not the other, and the same seed would train two different models. A prefix of
    `params`: a flax box (logical axes) or a quantised weight answers for its leaves; int8
    codes are not trained (no gradient through integers), so are never decayed."""

    def one(path, leaf):
        named = bool(path) and isinstance(path[-1], jax.tree_util.DictKey)
        return named and path[-1].key in DECAYED and not isinstance(leaf, quant.Int8Weight)

    whole = lambda x: isinstance(x, nn.meta.AxisMetadata | quant.Int8Weight)  # noqa: E731
    return jax.tree_util.tree_map_with_path(one, params, is_leaf=whole)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """AdamW with linear warm-up then cosine decay; clipping first; decay on the matmul
    weights and the embedding only (`decay_mask`)."""
    schedule = lr_schedule(cfg)
    adamw = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=decay_mask)
    clip = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    return optax.chain(*clip, adamw)


def loss_scale_of(cfg: Config) -> float:
    """float16 underflows small gradients unless the loss is scaled up before the backward
    (resolve fills `auto`, 0, with the same value; a config built in code may keep 0)."""
    if cfg.loss_scale > 0:
        return cfg.loss_scale
    return 2.0**15 if cfg.model.dtype == "float16" else 1.0


def cross_entropy(logits_BxLxV, targets_BxL) -> jax.Array:
    """Mean next-token loss, in float32 whatever the compute dtype."""
    losses_BxL = optax.softmax_cross_entropy_with_integer_labels(
        logits_BxLxV.astype(jnp.float32), targets_BxL
    )
    return jnp.mean(losses_BxL)


def split_microbatches(batch_BxX, k: int):
    """[B, ...] → [K, B/K, ...], microbatch k = rows {i·K + k}: a device's contiguous block of
    rows splits into whole groups of K, so every device keeps its own rows (no data moves)."""

    def one(a):
        if a.shape[0] % k:
            raise ValueError(f"{a.shape=}: batch {a.shape[0]} does not divide into {k=}")
        return jnp.swapaxes(a.reshape((a.shape[0] // k, k) + a.shape[1:]), 0, 1)

    return jax.tree.map(one, batch_BxX)


def accumulated_grad(loss_fn, params, batch_BxX, k: int, *, constrain=None, wide=False):
    """(grads, aux) of `loss_fn(params, batch) -> (loss, aux)` averaged over K equal
    microbatches, run one after another in a `lax.scan` (one microbatch's activations live at
    a time), summed in float32; k=1 is plain `jax.grad`. With a mean loss this is the whole
    batch's gradient. `constrain(microbatch)` pins each microbatch's sharding. `wide`: the
    average is returned in float32, not cast back to the parameters' dtype."""
    grad_fn = jax.grad(loss_fn, has_aux=True)
    if k == 1:
        grads, aux = grad_fn(params, batch_BxX)
        if wide:
            grads = jax.tree.map(lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32)), grads)
        return grads, aux

    def body(total, micro):
        g, aux = grad_fn(params, micro if constrain is None else constrain(micro))
        return jax.tree.map(lambda t, x: t + x.astype(t.dtype), total, g), aux

    f32 = lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32))  # noqa: E731
    total, aux_K = jax.lax.scan(body, jax.tree.map(f32, params), split_microbatches(batch_BxX, k))
    grads = jax.tree.map(lambda t, p: t / k if wide else (t / k).astype(p.dtype), total, params)
    return grads, jax.tree.map(lambda a: jnp.mean(a, axis=0), aux_K)


def unreduced_axes(rules, mesh_shape: dict) -> tuple[str, ...]:
    """The mesh axes (size > 1) over which accumulate=K reduces the gradient once, after its
    K microbatches: those that split the batch and nothing else. Over them every device
    holds every weight whole, so its gradient is a partial sum of the whole gradient and the
    K partial sums add up locally. An axis that splits the sequence (cp's) carries
    attention's own collectives and stays automatic.

    Empty where an axis of the batch also splits weights (fsdp, fsdp+tp): there XLA gathers
    each weight once, before the microbatch loop, and reduce-scatters each microbatch's
    gradient, which keeps the gradient sharded as fsdp is meant to. Manual over the data
    axis, the same step gathered the weights once per microbatch instead, and sent as much
    in all (explain=true, mesh=2x2x2 accumulate=4: 1.64 MiB per device against 1.62)."""
    rules = dict(rules)
    batch = [a for a in mesh_axes_of(rules.get(BATCH)) if mesh_shape.get(a, 1) > 1]
    weights = {
        a for name, axes in rules.items() if name not in (BATCH, SEQ) for a in mesh_axes_of(axes)
    }
    if weights & set(batch):
        return ()
    seq = set(mesh_axes_of(rules.get(SEQ)))
    return tuple(a for a in batch if a not in seq)


def _accumulated_unreduced(loss_fn, params, tokens_BxL1, k: int, axes: tuple, rules):
    """accumulated_grad with the sum over `axes` (unreduced_axes) taken once, after the K
    microbatches: a shard_map manual over `axes` runs each device's rows as K microbatches
    (the other axes stay automatic, under the rules without `axes`) and one mean over `axes`
    joins the devices' gradients, instead of one reduction per microbatch. Equal rows per
    device, so the mean of the devices' means is the batch's mean. The mean is taken on the
    float32 sums and cast to the parameters' dtype after: a bfloat16 mean inside a partly
    manual shard_map stops XLA:CPU on a failed check (jaxlib 0.10 to 0.12), and a float16 sum
    of the devices' loss-scaled gradients could overflow where their mean does not."""
    inner = rules_without(rules, axes)
    rest = dict(inner).get(BATCH)

    def local(params, tokens_BxL1):
        with nn.logical_axis_rules(inner):
            constrain = lambda t: jax.lax.with_sharding_constraint(t, P(rest))  # noqa: E731
            grads, aux = accumulated_grad(
                loss_fn, params, tokens_BxL1, k, constrain=constrain, wide=True
            )
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), jax.lax.pmean(grads, axes), params)
        return grads, jax.lax.pmean(aux, axes)

    return jax.shard_map(
        local,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(P(), P(axes)),
        out_specs=(P(), P()),
        axis_names=set(axes),
        # the blockwise loop, the Pallas kernels and the FFI kernel carry no varying-axes types
        check_vma=False,
    )(params, tokens_BxL1)


def train_step(
    state: TrainState,
    tokens_BxL1,
    *,
    model,
    tx,
    loss_scale: float,
    accumulate: int = 1,
    batch_sharding=None,
    opt_device_shardings=None,
    unreduced: tuple = (),
):
    """One optimizer step on a batch of seq_len+1 tokens; returns (new state, metrics).
    A packed batch [B, 2, seq_len+1] (lab/data.py) carries each token's document too: the
    model attends within documents and restarts positions at each; every target counts.

    accumulate=K: the gradient summed over K microbatches of B/K rows (each kept on its
    devices by `batch_sharding`) before the one update; over the mesh axes `unreduced`
    (unreduced_axes) the devices' sums are reduced once, after the K microbatches.
    opt_device_shardings: the optimizer state lives in host memory and is brought to these
    device shardings for the update.
    """

    def loss_fn(params, tokens_BxL1):
        segments_BxL = None
        if tokens_BxL1.ndim == 3:  # packed: tokens, segment ids
            tokens_BxL1, segments_BxL = tokens_BxL1[:, 0], tokens_BxL1[:, 1, :-1]
        logits_BxLxV = model.apply({"params": params}, tokens_BxL1[:, :-1], None, segments_BxL)
        loss = cross_entropy(logits_BxLxV, tokens_BxL1[:, 1:])
        return loss * loss_scale, loss

    if accumulate > 1 and unreduced:
        grads, loss = _accumulated_unreduced(
            loss_fn, state.params, tokens_BxL1, accumulate, unreduced, nn.get_logical_axis_rules()
        )
    else:
        constrain = None
        if batch_sharding is not None:
            constrain = lambda t: jax.lax.with_sharding_constraint(t, batch_sharding)  # noqa: E731
        grads, loss = accumulated_grad(
            loss_fn, state.params, tokens_BxL1, accumulate, constrain=constrain
        )
    grads = jax.tree.map(lambda g: g / loss_scale, grads)
    opt_state = state.opt_state
    if opt_device_shardings is not None:
        opt_state = jax.device_put(opt_state, opt_device_shardings)
    updates, opt_state = tx.update(grads, opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # param_norm: a finite gradient times a huge learning rate can overflow the weights; the
    # loop stops before such a state is saved (lab/loop.py)
    metrics = {
        "loss": loss,
        "grad_norm": optax.tree.norm(grads),
        "param_norm": optax.tree.norm(params),
    }
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def _init_state(key, *, model, tx, seq_len: int, stages: int = 1) -> TrainState:
    """The initial state (`_init_params`, then the optimizer's)."""
    return _state_of(_init_params(key, model=model, seq_len=seq_len, stages=stages), tx=tx)


def _init_params(key, *, model, seq_len: int, stages: int = 1):
    """The initial parameters: the same weights for a seed whatever the layout. Scanned
    layers (and so every pipeline) take the unscanned model's init, stacked (nn.scan splits
    the key its own way, and a pipeline started from other weights than the run it is
    compared with). A circular pipeline stores its stacked blocks stage-major
    (lab.model.layer_order): the layer-order init is put in that storage."""
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    params = model.init(key, tokens)["params"]
    if "blocks" in params:  # the boxes (logical axes) of the scan's, the values unscanned
        same = _unscanned_init(model.cfg, key, tokens)
        params = jax.tree.map(
            lambda box, value: box.replace_boxed(value) if _boxed(box) else value,
            params,
            same,
            is_leaf=_boxed,
        )
    if layer_order(model.cfg) == "stage_major" and "blocks" in params:
        repeats = model.cfg.pipeline_repeats
        params = {**params, "blocks": to_stage_major_order(params["blocks"], stages, repeats)}
    return params


@dataclasses.dataclass(frozen=True)
class _Init:
    """key → TrainState: the parameters' program, then the optimizer's (see make_trainer)."""

    params: Any
    rest: Any

    def __call__(self, key) -> TrainState:
        return self.rest(self.params(key))


def _boxed(x) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def _unscanned_init(cfg, key, tokens) -> dict:
    """The parameters the unscanned model starts from for `key`, its blocks stacked in the
    scanned layout ("blocks", a leading layer axis)."""
    params = dict(
        nn.meta.unbox(
            build(dataclasses.replace(cfg, scan_layers=False)).init(key, tokens)["params"]
        )
    )
    return stack_layers(params, cfg.n_layers)


def _state_of(params, *, tx) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


@dataclasses.dataclass(frozen=True)
class Trainer:
    """Everything compiled for one config on one mesh: init, step and their shardings."""

    cfg: Config
    mesh: jax.sharding.Mesh
    rules: tuple
    state_shardings: Any
    batch_sharding: NamedSharding
    abstract_state: Any  # ShapeDtypeStructs of the unboxed state, with shardings
    init_jit: Any  # key → TrainState, sharded
    step_jit: Any  # (TrainState, tokens_BxL1) → (TrainState, metrics), state donated
    schedule: Schedule | None = None  # the pipeline's, under strategy=pp*
    notes: tuple[str, ...] = ()  # what the backend did not do that the config asked for
    attention_note: str | None = None  # why auto/pallas passed over a kernel (the toolchain)
    resolved: Resolved | None = None  # what the trainer was built from
    # accumulate=K: the mesh axes over which the K microbatches' gradients are reduced once
    unreduced: tuple[str, ...] = ()
    # scanned layers: what one block keeps for its backward (the memory calculator's figure)
    census: LayerCensus | None = None

    def batch_shape(self) -> jax.ShapeDtypeStruct:
        shape = (self.cfg.batch_size, self.cfg.seq_len + 1)
        if self.cfg.pack:  # tokens and segment ids (lab/data.py)
            shape = (shape[0], 2, shape[1])
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding)

    @property
    def layout(self) -> "Layout":
        """How this trainer's state stores its layers."""
        return layout_of(self.cfg, self.mesh)

    def init(self, key) -> TrainState:
        with jax.set_mesh(self.mesh):
            return self.init_jit(key)

    def init_params(self, key):
        """init(key)'s parameters, without the optimizer's state (twice their bytes): what a
        decoder holds."""
        with jax.set_mesh(self.mesh):
            return self.init_jit.params(key)

    def step(self, state: TrainState, tokens_BxL1):
        with jax.set_mesh(self.mesh):
            return self.step_jit(state, tokens_BxL1)

    def lower(self):
        with jax.set_mesh(self.mesh):
            return self.step_jit.lower(self.abstract_state, self.batch_shape())


def _with_rules(fn, rules):
    """Trace `fn` with the logical rules in scope (the model's sharding constraints), under
    the name of the function it runs (a partial's: `functools.wraps` keeps none of its own),
    which jax.jit gives the program: the profile's step and its ops read `jit(train_step)`."""

    @functools.wraps(fn)
    def wrapped(*args):
        with nn.logical_axis_rules(rules):
            return fn(*args)

    named = fn.func if isinstance(fn, functools.partial) else fn
    wrapped.__name__, wrapped.__qualname__ = named.__name__, named.__qualname__
    return wrapped


def resolved_for(cfg, mesh=None, purpose: str = "train") -> Resolved:
    """`cfg` as the builders take it: a Resolved as it is; a Config built in code resolved
    for `mesh` (lab/resolve.py), as a request of all its fields."""
    if isinstance(cfg, Resolved):
        return cfg
    return resolve(Request.from_config(cfg), Platform.of_mesh(mesh), purpose)


def make_trainer(resolved: Resolved | Config, mesh=None) -> Trainer:
    """Shardings from logical names, a jitted sharded init, a jitted donated step for a
    resolved config (lab/resolve.py; a Config with its mesh is resolved first), kept in
    `Trainer.cfg`. The rules were checked there: here they are trusted."""
    r = resolved_for(resolved, mesh)
    cfg, mesh = r.cfg, r.mesh
    rules = rules_for(cfg.strategy)
    model = r.model if r.model is not None else build(cfg.model)  # resolve's, where it built it
    tx = make_optimizer(cfg)
    stages = dict(mesh.shape).get(STAGE, 1)
    init_fn = functools.partial(_init_state, model=model, tx=tx, seq_len=cfg.seq_len, stages=stages)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        if r.abstract_params is not None:  # the model traced once, by the resolve step
            abstract_boxed = jax.eval_shape(functools.partial(_state_of, tx=tx), r.abstract_params)
        else:
            key = jax.eval_shape(jax.random.key, 0)  # abstract: the mesh may be a TPU topology
            abstract_boxed = jax.eval_shape(init_fn, key)
    state_sh = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract_boxed), mesh, rules)
    batch_axes = dict(rules).get(BATCH)
    assert cfg.batch_size % axis_size(mesh, batch_axes) == 0, (cfg.batch_size, batch_axes)
    batch_sh = NamedSharding(mesh, P(batch_axes, None))
    replicated = NamedSharding(mesh, P())
    state_sh, opt_device_sh = _offload_optimizer(r, state_sh)
    # Two programs: the parameters, then the optimizer's state beside them. In one, a scanned
    # model's unscanned blocks and their stacked copy were live beside every output (Adam's
    # moments included) at once: 5x the parameters' bytes, more than a step of remat=full.
    params_fn = functools.partial(_init_params, model=model, seq_len=cfg.seq_len, stages=stages)

    def init_params(key):  # named: a profile reads the program as jit(init_params)
        return nn.meta.unbox(params_fn(key))

    init_params = jax.jit(_with_rules(init_params, rules), out_shardings=state_sh.params)
    init_rest = jax.jit(
        _with_rules(functools.partial(_state_of, tx=tx), rules),
        in_shardings=(state_sh.params,),
        out_shardings=state_sh,
        donate_argnums=0,
    )
    init = _Init(init_params, init_rest)
    unreduced = ()
    if cfg.accumulate > 1 and not schedule_of(cfg, mesh):
        # (a pipeline runs its own shard_map, manual over the batch's axes: around it the
        # microbatches are reduced where XLA places the reductions, once each)
        unreduced = unreduced_axes(rules, dict(mesh.shape))
    step_fn = functools.partial(
        train_step,
        model=model,
        tx=tx,
        loss_scale=loss_scale_of(cfg),
        accumulate=cfg.accumulate,
        batch_sharding=batch_sh if cfg.accumulate > 1 else None,
        opt_device_shardings=opt_device_sh,
        unreduced=unreduced,
    )
    step = jax.jit(
        _with_rules(step_fn, rules),
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, replicated),
        donate_argnums=0,
    )
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        nn.meta.unbox(abstract_boxed),
        state_sh,
    )
    return Trainer(
        cfg,
        mesh,
        rules,
        state_sh,
        batch_sh,
        abstract,
        init_jit=init,
        step_jit=step,
        schedule=schedule_of(cfg, mesh),
        notes=r.notes,
        attention_note=r.attention_note,
        resolved=r,
        unreduced=unreduced,
        census=census_for(cfg, mesh),
    )


def census_for(cfg: Config, mesh) -> LayerCensus | None:
    """What one block keeps for its backward (lab.model.layer_census) where the config's
    layers are scanned, with the attention kernel of the platform `mesh` is on; None where
    they are not (the memory calculator's itemised formula serves there)."""
    if not cfg.model.scan_layers:
        return None
    model = cfg.model
    if model.attention == "ring":  # its blocks are blockwise's; the ring needs the whole step
        model = dataclasses.replace(model, attention="blockwise")
    # Traced on one device of the mesh's platform: the census is per token, and a kernel run
    # under shard_map on an unsharded block (the census's) would name each device's copy of
    # its residuals as one more sequence: a v5e-256 plan's census read 12x the block's.
    one = jax.sharding.Mesh(
        np.asarray(mesh.devices).flat[:1].reshape((1,) * len(mesh.axis_names)), mesh.axis_names
    )
    try:
        with jax.set_mesh(one):
            return layer_census(model, cfg.seq_len)
    except Exception:  # noqa: BLE001 - a block that cannot be traced alone: the formula serves
        return None


def schedule_of(cfg: Config, mesh) -> Schedule | None:
    """The pipeline's schedule where the blocks run as one (a pp strategy, stages > 1)."""
    if cfg.strategy in PIPELINE_STRATEGIES and mesh.shape[STAGE] > 1:
        return Schedule(mesh.shape[STAGE], cfg.model.microbatches, cfg.model.pipeline_repeats)
    return None


def _offload_optimizer(r: Resolved, state_sh) -> tuple:
    """(state shardings, the optimizer state's device shardings or None): where the resolve
    step placed the optimizer state in host memory, its shardings move there."""
    if not r.offload_optimizer:
        return state_sh, None
    host = jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), state_sh.opt_state)
    return state_sh.replace(opt_state=host), state_sh.opt_state


def compile_step(cfg: Resolved | Config, mesh=None):
    """The compiled train step for `cfg` (on `mesh`, for a Config), for memory and cost."""
    return make_trainer(cfg, mesh).lower().compile()


# --- how a state stores its layers, and a saved state moved into another layout ------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a state stores its layers: each its own (`block_0` … `block_{n-1}`), or stacked
    under `blocks` with a leading layer axis: in layer order, or under the circular pipeline
    schedule stage-major for its stage count and repeats (lab.model.layer_order). The same
    weights in every layout (the init takes the unscanned model's values in all), so a run can
    go on in another one: a run started on one device resumed as a pipeline, or back."""

    stacked: bool
    stages: int = 1
    repeats: int = 1

    def __post_init__(self):
        if not self.stage_major:  # in layer order, whatever the mesh (one stage: the same)
            object.__setattr__(self, "stages", 1)
            object.__setattr__(self, "repeats", 1)

    @property
    def stage_major(self) -> bool:
        return self.stacked and self.repeats > 1 and self.stages > 1

    def describe(self) -> str:
        if not self.stacked:
            return "each layer its own"
        if self.stage_major:
            return f"stacked by stage (stage={self.stages}, pipeline_repeats={self.repeats})"
        return "stacked in layer order"

    def record(self) -> dict:
        """What a checkpoint step keeps of it (JSON), with a checksum of its fields: a record
        edited or damaged into another valid layout would read every layer in another's
        place, and nothing else in the step would show it."""
        fields = {"stacked": self.stacked, "stages": self.stages, "repeats": self.repeats}
        return {**fields, "check": _record_check(fields)}

    @classmethod
    def from_record(cls, d) -> "Layout | None":
        """The layout a step recorded, or None where the record is not one (or its checksum
        does not match its fields)."""
        if not isinstance(d, dict) or not isinstance(d.get("stacked"), bool):
            return None
        counts = [d.get("stages"), d.get("repeats")]
        if not all(type(n) is int and n >= 1 for n in counts):
            return None
        fields = {"stacked": d["stacked"], "stages": counts[0], "repeats": counts[1]}
        if d.get("check") != _record_check(fields):
            return None
        return cls(d["stacked"], *counts)


def _record_check(fields: dict) -> int:
    return zlib.crc32(json.dumps(fields, sort_keys=True).encode())


def layout_of(cfg: Config, mesh) -> Layout:
    """The layout of the state a trainer for `cfg` on `mesh` holds."""
    stages = dict(mesh.shape).get(STAGE, 1)
    repeats = cfg.model.pipeline_repeats if layer_order(cfg.model) == "stage_major" else 1
    return Layout(cfg.model.scan_layers, stages, repeats)


def _is_params(x) -> bool:
    """A tree of the model's weights: the parameters, or an optimizer slot shaped like them."""
    return isinstance(x, dict) and ("blocks" in x or "block_0" in x)


def _in_layer_order(params: dict, src: Layout, n_layers: int) -> dict:
    if not src.stacked:
        return stack_layers(params, n_layers)
    if src.stage_major:
        blocks = from_stage_major_order(params["blocks"], src.stages, src.repeats)
        return {**params, "blocks": blocks}
    return params


def _laid_out(params: dict, dst: Layout, n_layers: int) -> dict:
    if not dst.stacked:
        return unstack_layers(params, n_layers)
    if dst.stage_major:
        return {**params, "blocks": to_stage_major_order(params["blocks"], dst.stages, dst.repeats)}
    return params


def relayout(state, src: Layout, dst: Layout, n_layers: int):
    """`state` (parameters and every optimizer slot shaped like them) stored as `dst` stores
    its layers, from `src`; values unchanged."""
    if src == dst:
        return state
    move = lambda p: _laid_out(_in_layer_order(p, src, n_layers), dst, n_layers)  # noqa: E731
    return jax.tree.map(lambda x: move(x) if _is_params(x) else x, state, is_leaf=_is_params)


def abstract_in(abstract_state, now: Layout, saved: Layout, n_layers: int):
    """The trainer's abstract state (`now`) as a step saved in layout `saved` holds it, each
    array placed as this mesh places it: stacked blocks into a stacked trainer exactly as its
    own (the same shapes, the layer axis split over its stages); otherwise a block weight
    split as one layer of the trainer's is, its layer axis whole, and read into a pipeline
    also split over its stages where a dimension allows (`_over_stages`); every other array
    as the trainer's."""
    shapes = jax.eval_shape(lambda s: relayout(s, now, saved, n_layers), abstract_state)
    sds = lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)  # noqa: E731

    def node(cur, new):
        if not _is_params(cur):
            return sds(new, cur.sharding)
        layer = _one_layer_shardings(cur, now)
        out = {}
        for k, v in new.items():
            if k == "blocks" and now.stacked:  # the same shapes: read as the trainer splits them
                out[k] = jax.tree.map(lambda x, c: sds(x, c.sharding), v, cur[k])
            elif k == "blocks":
                out[k] = jax.tree.map(lambda x, sh: sds(x, _with_layer_axis(sh)), v, layer)
            elif k.startswith("block_") and k not in cur:
                out[k] = jax.tree.map(lambda x, sh: sds(x, _over_stages(sh, x.shape)), v, layer)
            else:
                out[k] = jax.tree.map(lambda x, c: sds(x, c.sharding), v, cur[k])
        return out

    return jax.tree.map(node, abstract_state, shapes, is_leaf=_is_params)


def _over_stages(sharding, shape):
    """A layer's weight read for a pipeline: split over the stage axis too, along its first
    dimension that no axis splits and the stages divide (else as it is), so that a run whose
    layers were each their own is not read whole onto every stage (2x the state on 2 stages,
    3.9x on 4, measured)."""
    if not isinstance(sharding, NamedSharding) or dict(sharding.mesh.shape).get(STAGE, 1) == 1:
        return sharding
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    if any(STAGE in mesh_axes_of(m) for m in spec if m):
        return sharding
    stages = sharding.mesh.shape[STAGE]
    for i, (m, n) in enumerate(zip(spec, shape, strict=True)):
        if m is None and n % stages == 0:
            spec[i] = STAGE
            return NamedSharding(sharding.mesh, P(*spec), memory_kind=sharding.memory_kind)
    return sharding


def _one_layer_shardings(params, layout: Layout):
    """Where one layer's block weights live under `layout`'s shardings."""
    if not layout.stacked:
        return jax.tree.map(lambda x: x.sharding, params["block_0"])
    return jax.tree.map(lambda x: _without_layer_axis(x.sharding), params["blocks"])


def _without_layer_axis(sharding):
    if not isinstance(sharding, NamedSharding):
        return sharding
    return NamedSharding(
        sharding.mesh, P(*tuple(sharding.spec)[1:]), memory_kind=sharding.memory_kind
    )


def _with_layer_axis(sharding):
    if not isinstance(sharding, NamedSharding):
        return sharding
    return NamedSharding(sharding.mesh, P(None, *sharding.spec), memory_kind=sharding.memory_kind)


def into_layout(trainer: Trainer, state, saved: Layout):
    """A state (or its parameters alone) restored in layout `saved` (placed as `abstract_in`
    places it), stored as the trainer's: one jitted move onto the trainer's shardings. Between
    two stacked layouts the restored copy is donated (the same shapes); from or to layers each
    their own it is not (no output has its shape), and both copies are held during the move."""
    if saved == trainer.layout:
        return state
    whole = isinstance(state, TrainState)  # else the parameters alone
    move = jax.jit(
        functools.partial(
            relayout, src=saved, dst=trainer.layout, n_layers=trainer.cfg.model.n_layers
        ),
        out_shardings=trainer.state_shardings if whole else trainer.state_shardings.params,
        donate_argnums=0 if saved.stacked == trainer.layout.stacked else (),
    )
    with jax.set_mesh(trainer.mesh):
        return move(state)


def block_order(stages, repeats) -> str:
    """config.json's words for how the stacked blocks are stored (`block_order`): in layer
    order, or under the circular schedule by stage, a permutation fixed by the stage count
    and the repeats."""
    if (repeats or 1) <= 1:
        return "in layer order"
    return f"by stage (stage={stages}, pipeline_repeats={repeats})"


def saved_block_order(saved: dict) -> str:
    """A run folder's block order: its config.json's, or for a folder written before it kept
    one, read from the mesh it asked for (a stage axis of -1 is then named as -1)."""
    if isinstance(saved.get("block_order"), str):
        return saved["block_order"]
    repeats = (saved.get("model") or {}).get("pipeline_repeats")
    try:
        spec = strategy_mesh(saved.get("mesh"), saved.get("strategy"))
        stages = parse_mesh_spec(spec).get("stage", 1)
    except (ConfigError, AttributeError, TypeError):
        stages = saved.get("mesh")
    return block_order(stages, repeats)


_BY_STAGE = re.compile(r"by stage \(stage=(\d+), pipeline_repeats=(\d+)\)")


def config_layout(saved: dict) -> Layout | None:
    """The layout of a run's steps saved before steps kept their own: config.json's
    `older_steps_layout` once a resume in another layout rewrote it (lab.loop keeps it there
    while such steps remain), else the layout config.json describes; None where its stage
    count cannot be known (a folder written before config.json kept its block order, whose
    mesh's stage axis was -1)."""
    older = saved.get("older_steps_layout")
    if older is not None:
        return Layout.from_record(older)
    stacked = (saved.get("model") or {}).get("scan_layers") is True
    order = saved_block_order(saved)
    if order == "in layer order":
        return Layout(stacked)
    m = _BY_STAGE.fullmatch(order)
    return Layout(stacked, int(m[1]), int(m[2])) if m else None


def step_layout(step_dir: Path, config: Layout, n_layers: int) -> Layout:
    """How checkpoint step `step_dir` stores its layers: its own record (checkpoint.LAYOUT),
    checked against its arrays; or for a step saved before steps kept one, stacked or not as
    its arrays are named, in the order of `config` (config_layout). checkpoint.StepDamaged
    where the record is gone, unreadable, fails its checksum or contradicts the arrays."""
    raw = checkpoint.step_record(step_dir, checkpoint.LAYOUT)
    names = checkpoint.saved_names(step_dir)
    named = None if names is None else any("blocks" in n for n in names)
    if raw is None:
        stacked = config.stacked if named is None else named
        return Layout(stacked, config.stages, config.repeats)
    layout = Layout.from_record(raw)
    if layout is None:
        raise checkpoint.StepDamaged(f"its layout record is damaged ({checkpoint.LAYOUT}/)")
    if named is not None and named != layout.stacked:
        raise checkpoint.StepDamaged(
            f"its layout record says {layout.describe()}, its arrays are "
            f"{'stacked' if named else 'each layer its own'}"
        )
    if layout.stage_major and n_layers % (layout.stages * layout.repeats):
        raise checkpoint.StepDamaged(
            f"its layout record says {layout.describe()}, which {n_layers} layers cannot be"
        )
    return layout


def restore_in_layout(run_dir, trainer: Trainer, saved_config: dict, *, params_only=False, **kw):
    """(step, state, the step's layout) from the newest good checkpoint of `run_dir`
    (lab.checkpoint.restore_latest, `kw` passed on), stored as the trainer's state is
    whatever layout the step was saved in; (None, None, None) where none restores.
    `params_only` (a reader of the weights alone, lab.serve): the state is the parameters,
    the only arrays read and checked; the optimizer's moments (twice the parameters' bytes)
    are neither loaded nor judged, so a damaged moment costs no step its weights."""
    now, n = trainer.layout, trainer.cfg.model.n_layers
    config = config_layout(saved_config) or now
    layouts = {}

    def target(step_dir: Path):
        layouts[step_dir.name] = saved = step_layout(step_dir, config, n)
        if saved == now:
            abstract = trainer.abstract_state
        else:
            abstract = abstract_in(trainer.abstract_state, now, saved, n)
        return checkpoint.only_params(abstract) if params_only else abstract

    with jax.set_mesh(trainer.mesh):
        step, state = checkpoint.restore_latest(run_dir, target, **kw)
    if state is None:
        return step, None, None
    if params_only:
        state = state.params
    saved = layouts[str(step)]
    try:
        return step, into_layout(trainer, state, saved), saved
    except Exception as e:  # noqa: BLE001 — XLA's out-of-memory error has no type of its own
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise ConfigError(
            f"{kw.get('why', 'resume=true')}: checkpoint step {step} stores its layers "
            f"{saved.describe()}; moving them into this run's layout ({now.describe()}) holds "
            "both copies and ran out of device memory: resume with the run's saved mesh= "
            "and pipeline_repeats="
        ) from None

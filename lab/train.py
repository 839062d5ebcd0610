"""The training step and the sharded state it runs on: pure functions, jitted with shardings.

The state is first built abstractly (`jax.eval_shape`), its logical axis names turned into
mesh shardings, and only then materialised by a jitted init whose `out_shardings` put every
parameter and optimizer slot straight onto its devices: no host copy of the full model.
"""

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lab.config import Config, resolve_dtype, validate
from lab.errors import ConfigError
from lab.kernels.attention import choose
from lab.mesh import auto_strategy, check_divisible, rules_for
from lab.model import build
from lab.names import BATCH


class TrainState(struct.PyTreeNode):
    step: jax.Array
    params: Any
    opt_state: Any


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """AdamW with linear warm-up then cosine decay; clipping first; no decay on vectors."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.steps, cfg.warmup_steps + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    adamw = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=decay_mask)
    clip = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    return optax.chain(*clip, adamw)


def loss_scale_of(cfg: Config) -> float:
    """float16 underflows small gradients unless the loss is scaled up before the backward."""
    if cfg.loss_scale > 0:
        return cfg.loss_scale
    return 2.0**15 if cfg.model.dtype == "float16" else 1.0


def cross_entropy(logits_BxLxV, targets_BxL) -> jax.Array:
    """Mean next-token loss, in float32 whatever the compute dtype."""
    losses_BxL = optax.softmax_cross_entropy_with_integer_labels(
        logits_BxLxV.astype(jnp.float32), targets_BxL
    )
    return jnp.mean(losses_BxL)


def train_step(state: TrainState, tokens_BxL1, *, model, tx, loss_scale: float):
    """One optimizer step on a batch of seq_len+1 tokens; returns (new state, metrics)."""

    def loss_fn(params):
        logits_BxLxV = model.apply({"params": params}, tokens_BxL1[:, :-1])
        loss = cross_entropy(logits_BxLxV, tokens_BxL1[:, 1:])
        return loss * loss_scale, loss

    grads, loss = jax.grad(loss_fn, has_aux=True)(state.params)
    grads = jax.tree.map(lambda g: g / loss_scale, grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # param_norm: a finite gradient times a huge learning rate can overflow the weights; the
    # loop stops before such a state is saved (lab/loop.py)
    metrics = {
        "loss": loss,
        "grad_norm": optax.tree.norm(grads),
        "param_norm": optax.tree.norm(params),
    }
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def _init_state(key, *, model, tx, seq_len: int) -> TrainState:
    params = model.init(key, jnp.zeros((1, seq_len), jnp.int32))["params"]
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

    def batch_shape(self) -> jax.ShapeDtypeStruct:
        shape = (self.cfg.batch_size, self.cfg.seq_len + 1)
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding)

    def init(self, key) -> TrainState:
        with jax.set_mesh(self.mesh):
            return self.init_jit(key)

    def step(self, state: TrainState, tokens_BxL1):
        with jax.set_mesh(self.mesh):
            return self.step_jit(state, tokens_BxL1)

    def lower(self):
        with jax.set_mesh(self.mesh):
            return self.step_jit.lower(self.abstract_state, self.batch_shape())


def _with_rules(fn, rules):
    """Trace `fn` with the logical rules in scope (the model's sharding constraints)."""

    @functools.wraps(fn)
    def wrapped(*args):
        with nn.logical_axis_rules(rules):
            return fn(*args)

    return wrapped


def _check_state(abstract_boxed, mesh, rules) -> None:
    specs = nn.logical_to_mesh(nn.get_partition_spec(abstract_boxed), rules)
    leaves = jax.tree_util.tree_leaves_with_path(nn.meta.unbox(abstract_boxed))
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    for (path, leaf), spec in zip(leaves, spec_leaves, strict=True):
        check_divisible(jax.tree_util.keystr(path), leaf.shape, spec, mesh)


def backend_of(mesh) -> str:
    """cpu | gpu | tpu of the mesh's devices (an ahead-of-time target's included)."""
    platform = mesh.devices.flat[0].platform
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)


def resolve(cfg: Config, mesh) -> Config:
    """Every `auto` of `cfg` filled for `mesh`, in one place: the compute dtype (bfloat16 on
    GPU/TPU, float32 on CPU), the data (text for a byte vocabulary), the strategy (the rules
    that use every axis the mesh names) and the attention kernel (the dispatch's choice for
    this backend and shape, so the header and config.json name what ran). An attention
    implementation the inputs do not fit is a ConfigError before anything is traced."""
    backend = backend_of(mesh)
    model = resolve_dtype(cfg.model, backend)
    data = cfg.data if cfg.data != "auto" else ("text" if model.vocab_size == 256 else "synthetic")
    strategy = cfg.strategy if cfg.strategy != "auto" else auto_strategy(dict(mesh.shape))
    if model.attention != "ring":
        dtype = jnp.dtype(model.dtype)
        q = jax.ShapeDtypeStruct((1, cfg.seq_len, model.n_heads, model.head_dim), dtype)
        kv = jax.ShapeDtypeStruct((1, cfg.seq_len, model.n_kv_heads, model.head_dim), dtype)
        try:
            with jax.set_mesh(mesh):  # a plan's target decides (no cuDNN where none is here)
                impl = choose(model.attention, q, kv, kv, causal=True, backend=backend)
        except ValueError as e:
            raise ConfigError(f"attention={model.attention}: {e}") from None
        model = dataclasses.replace(model, attention=impl)
    cfg = dataclasses.replace(cfg, model=model, data=data, strategy=strategy)
    validate(cfg)
    return cfg


def make_trainer(cfg: Config, mesh) -> Trainer:
    """Shardings from logical names, a jitted sharded init, a jitted donated step; `cfg`
    resolved for the mesh first (`resolve`), and kept resolved in `Trainer.cfg`."""
    cfg = resolve(cfg, mesh)
    rules = rules_for(cfg.strategy)
    model, tx = build(cfg.model), make_optimizer(cfg)
    init_fn = functools.partial(_init_state, model=model, tx=tx, seq_len=cfg.seq_len)
    key = jax.eval_shape(jax.random.key, 0)  # abstract: the mesh may be a TPU topology
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract_boxed = jax.eval_shape(init_fn, key)
    _check_state(abstract_boxed, mesh, rules)
    state_sh = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract_boxed), mesh, rules)
    batch_axes = dict(rules).get(BATCH)
    check_divisible(
        "batch (batch_size x seq_len+1)",
        (cfg.batch_size, cfg.seq_len + 1),
        (batch_axes, None),
        mesh,
    )
    batch_sh = NamedSharding(mesh, P(batch_axes, None))
    replicated = NamedSharding(mesh, P())
    unboxed_init = lambda key: nn.meta.unbox(init_fn(key))
    init = jax.jit(_with_rules(unboxed_init, rules), out_shardings=state_sh)
    step_fn = functools.partial(train_step, model=model, tx=tx, loss_scale=loss_scale_of(cfg))
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
    return Trainer(cfg, mesh, rules, state_sh, batch_sh, abstract, init_jit=init, step_jit=step)


def compile_step(cfg: Config, mesh):
    """The compiled train step for `cfg` on `mesh` (for memory and cost analysis)."""
    return make_trainer(cfg, mesh).lower().compile()

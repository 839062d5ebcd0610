"""The decode step compiled for a target= (compiled, not run): the compiler's per-device
memory beside the calculator's weights + cache, against the chip's memory."""

import math
import time

import jax
import jax.numpy as jnp

from lab import decode, plans, quant
from lab.measure import memory, specs
from lab.measure.serving import PlanRow
from lab.session import Session
from lab.studies.serving.weights import for_decoding


def split_ways(tree) -> float:
    """How many ways the arrays of `tree` (ShapeDtypeStructs with their shardings) are split:
    their whole bytes over the bytes one device holds. 8 for weights split over a model axis
    of 8, 1 for weights copied to every device of a data axis."""
    whole = held = 0
    for a in jax.tree.leaves(tree):
        size = a.dtype.itemsize
        whole += math.prod(a.shape) * size
        held += math.prod(a.sharding.shard_shape(a.shape)) * size
    return whole / held if held else 1.0


def plan_serving(session: Session, *, batch: int, context: int, int8: bool) -> PlanRow:
    """The decode step of `batch` sequences over `context` cache slots, float or int8 weights
    and cache, compiled for the session's target; a compiler that refuses it (the program
    does not fit) is a row that says so."""
    session = for_decoding(session, (batch,))
    t = session.trainer
    model = t.cfg.model
    abstract = t.abstract_state.params
    if int8:
        abstract = jax.eval_shape(quant.quantize_params, abstract)
    shardings = decode.param_shardings(t.state_shardings.params, abstract)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    dec = decode.make_decoder(
        model, t.mesh, t.rules, shardings, batch=batch, max_len=context, int8_cache=int8
    )
    cache = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        dec.abstract_cache,
        dec.cache_sharding,
    )
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=dec.batch_sharding)
    t0 = time.perf_counter()
    refused = None
    with jax.set_mesh(t.mesh):
        try:
            compiled = dec.step.lower(abstract, tokens, cache).compile()
        except RuntimeError as e:  # a TPU compiler refuses a program its HBM cannot hold
            compiled, refused = None, plans.refusal(e)
            if refused is None:
                raise
    compile_s = time.perf_counter() - t0
    mem = (memory.compiled_memory(compiled) if compiled else None) or {}
    devices = t.mesh.devices.size
    predicted = memory.predict_serving_memory(
        model,
        batch=batch,
        context=context,
        weight_bytes=1 if int8 else jnp.dtype(model.param_dtype).itemsize,
        cache_bytes=1 if int8 else jnp.dtype(model.dtype).itemsize,
        devices=devices,
        # split as the plan splits them: a data axis copies the weights and splits the cache
        weight_split=split_ways(abstract),
        cache_split=split_ways(cache),
    )
    kind = t.mesh.devices.flat[0].device_kind
    capacity = memory.device_capacity_bytes(t.mesh.devices.flat[0])
    spec = specs.lookup(kind)
    return PlanRow(
        target=session.cfg.target,
        device_kind=kind,
        devices=devices,
        batch=batch,
        context=context,
        int8=int8,
        compiled=mem,
        predicted=predicted,
        # a GPU's: the share JAX's allocator takes, as a run there has (the plan's own rule)
        capacity_bytes=capacity
        or (
            memory.usable_bytes(spec.memory_bytes, kind, plans.gpu.reported_memory(kind))
            if spec
            else None
        ),
        compile_s=compile_s,
        refused=refused,
    )

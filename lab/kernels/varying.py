"""Types under `shard_map(check_vma=True)`: which mesh axes a value varies over.

Inside `shard_map`, JAX types each value with the mesh axes it may differ along. A value built
from nothing (`jnp.zeros` as a loop's first carry) or returned by an opaque call (an FFI call)
is typed as identical on every device, and JAX refuses it where it meets the inputs again: a
loop whose body mixes it with them, a custom_vjp whose gradients must have the inputs' types.
These helpers give such values the union of their inputs' axes, and sum a replicated input's
gradient over the axes it does not vary over.

The Pallas kernels are not covered: a pallas_call under check_vma=True asks for its outputs'
axes in `out_shape`, which this JAX's ShapeDtypeStruct carries only on some versions; call
them under `shard_map(..., check_vma=False)`, as the lab's own dispatch does.
"""

import jax
import jax.numpy as jnp
from jax import lax


def _probe(inputs):
    """A scalar read from one element of each input (None and empty ones skipped): its type
    varies over the union of their axes. Unused, it is removed by the compiler."""
    arrays = [x for x in inputs if x is not None and getattr(x, "size", 0)]
    return sum(x.reshape(-1)[:1].astype(jnp.float32).sum() for x in arrays) if arrays else None


def full(shape, value, dtype, *inputs):
    """jnp.full(shape, value, dtype), varying over the axes `inputs` vary over."""
    probe = _probe(inputs)
    if probe is None:
        return jnp.full(shape, value, dtype)
    return lax.full_like(probe, value, dtype, shape)


def _axes(x) -> frozenset:
    kind = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(kind, "varying", ()) or ())


def like(outputs, *inputs):
    """An opaque call's outputs (an FFI call's: typed as identical on every device) cast to
    vary over the axes `inputs` vary over; unchanged outside shard_map, or where this JAX has
    no manual axis types."""
    probe = _probe(inputs)
    axes = () if probe is None else tuple(sorted(_axes(probe)))
    if not axes:
        return outputs
    return jax.tree.map(lambda x: lax.pcast(x, axes, to="varying"), outputs)


def reduce_like(grads, primals):
    """A custom backward's gradients typed as their primal inputs: summed over the axes a
    gradient varies over and its input does not (a replicated input, as sinks in a
    data-parallel shard_map: its gradient is the sum of every device's, the transpose of the
    implicit broadcast). None where a gradient or input is None."""

    def one(g, x):
        if g is None or x is None:
            return g
        extra = tuple(sorted(_axes(g) - _axes(x)))
        return lax.psum(g, extra) if extra else g

    return tuple(one(g, x) for g, x in zip(grads, primals, strict=True))

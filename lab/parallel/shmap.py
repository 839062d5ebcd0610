"""`shard_map` across JAX versions: `jax.shard_map` (0.7+) or the experimental one before it.

The two spell the replication check differently (`check_vma` vs `check_rep`); the lab's
hand-written collectives vary per device on purpose, so the check is off everywhere.
"""

import jax


def shard_map(fn, *, mesh, in_specs, out_specs):
    """`fn` run once per device on its local block, with collectives over named mesh axes."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as legacy

    return legacy(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)

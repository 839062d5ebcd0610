"""All-gather matmul with the gather hidden behind compute: a ppermute ring (collective matmul).

Tensor parallelism often needs y = all_gather(x) @ w: x split by rows over an axis of W
devices, w split by columns (a column-parallel layer under sequence parallelism). Done
plainly, every device waits for the whole gather before it multiplies. The collective
matmul (Wang et al., "Overlap communication with dependent computation via decomposition",
ASPLOS 2023; the scaling book's "collective matmul") cuts the gather into W ring steps: each
step multiplies the row block a device holds while passing it to its neighbour, so on
hardware with asynchronous collectives the link and the matrix units work at once.

    step t on device i: holds x block (i - t) mod W → writes rows of that block of y,
                        sends the block to device i+1 (ppermute) for step t+1

Letters (lab/names.py), as the layer it serves: rows are tokens L (L/W per device), the
contraction is D, the columns F (F/W per device); W is the axis size.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P


def _ring_matmul(x_LxD, w_DxF, *, axis: str, W: int):
    """Per device (x_LxD: its L/W rows; w_DxF: its F/W columns): all rows of x times w."""
    i = lax.axis_index(axis)
    ring = [(d, (d + 1) % W) for d in range(W)]
    rows = x_LxD.shape[0]
    y_WxLxF = jnp.zeros((W, rows, w_DxF.shape[1]), jnp.result_type(x_LxD, w_DxF))
    for t in range(W):  # unrolled: W is a mesh axis size, and the scheduler sees every step
        x_next_LxD = lax.ppermute(x_LxD, axis, ring) if t + 1 < W else None  # in flight…
        block_LxF = jnp.dot(x_LxD, w_DxF, preferred_element_type=y_WxLxF.dtype)  # …during this
        y_WxLxF = lax.dynamic_update_index_in_dim(y_WxLxF, block_LxF, (i - t) % W, axis=0)
        x_LxD = x_next_LxD
    return y_WxLxF.reshape(W * rows, -1)


def _check(x_LxD, w_DxF, W: int, axis: str) -> None:
    if x_LxD.shape[0] % W or w_DxF.shape[1] % W or x_LxD.shape[1] != w_DxF.shape[0]:
        raise ValueError(
            f"{x_LxD.shape=} {w_DxF.shape=}: need x rows and w columns divisible by "
            f"{axis}={W} and matching contraction sizes"
        )


def collective_matmul(x_LxD, w_DxF, *, mesh, axis: str):
    """x_LxD (rows split over `axis`) @ w_DxF (columns split over `axis`) → y_LxF with its
    columns split over `axis`; equal to `x_LxD @ w_DxF`."""
    W = mesh.shape[axis]
    _check(x_LxD, w_DxF, W, axis)
    fn = jax.shard_map(
        functools.partial(_ring_matmul, axis=axis, W=W),
        mesh=mesh,
        in_specs=(P(axis, None), P(None, axis)),
        out_specs=P(None, axis),
        check_vma=False,
    )
    return fn(x_LxD, w_DxF)


def gathered_matmul(x_LxD, w_DxF, *, mesh, axis: str):
    """The same product the plain way: gather all rows of x first, then one matmul (baseline)."""
    _check(x_LxD, w_DxF, mesh.shape[axis], axis)

    def local(x_LxD, w_DxF):
        return jnp.dot(lax.all_gather(x_LxD, axis, tiled=True), w_DxF)

    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(axis, None), P(None, axis)),
        out_specs=P(None, axis),
        check_vma=False,
    )
    return fn(x_LxD, w_DxF)


def matmul_reference(x_LxD, w_DxF):
    """Plain jnp: what both sharded versions must equal."""
    return jnp.dot(x_LxD, w_DxF)

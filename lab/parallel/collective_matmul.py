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

Letters: M rows of x (global), C = M/W rows per block, K contraction, N columns of w (global),
F = N/W columns per device.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from lab.parallel.shmap import shard_map


def _ring_matmul(x_CxK, w_KxF, *, axis: str, W: int):
    """Per device: y_MxF = (all row blocks of x) @ w_KxF, one block per ring step."""
    i = lax.axis_index(axis)
    ring = [(d, (d + 1) % W) for d in range(W)]
    C = x_CxK.shape[0]
    y_WxCxF = jnp.zeros((W, C, w_KxF.shape[1]), jnp.result_type(x_CxK, w_KxF))
    for t in range(W):  # unrolled: W is a mesh axis size, and the scheduler sees every step
        x_next_CxK = lax.ppermute(x_CxK, axis, ring) if t + 1 < W else None  # in flight…
        block_CxF = jnp.dot(x_CxK, w_KxF, preferred_element_type=y_WxCxF.dtype)  # …during this
        y_WxCxF = lax.dynamic_update_index_in_dim(y_WxCxF, block_CxF, (i - t) % W, axis=0)
        x_CxK = x_next_CxK
    return y_WxCxF.reshape(W * C, -1)


def collective_matmul(x_MxK, w_KxN, *, mesh, axis: str):
    """x_MxK (rows split over `axis`) @ w_KxN (columns split over `axis`) → y_MxN with its
    columns split over `axis`; equal to `x_MxK @ w_KxN`. M and N must divide by the axis size."""
    W = mesh.shape[axis]
    if x_MxK.shape[0] % W or w_KxN.shape[1] % W or x_MxK.shape[1] != w_KxN.shape[0]:
        raise ValueError(
            f"{x_MxK.shape=} {w_KxN.shape=}: need x rows and w columns divisible by "
            f"{axis}={W} and matching contraction sizes"
        )
    fn = shard_map(
        functools.partial(_ring_matmul, axis=axis, W=W),
        mesh=mesh,
        in_specs=(P(axis, None), P(None, axis)),
        out_specs=P(None, axis),
    )
    return fn(x_MxK, w_KxN)


def gathered_matmul(x_MxK, w_KxN, *, mesh, axis: str):
    """The same product the plain way: gather all rows of x first, then one matmul (baseline)."""

    def local(x_CxK, w_KxF):
        return jnp.dot(lax.all_gather(x_CxK, axis, tiled=True), w_KxF)

    fn = shard_map(
        local, mesh=mesh, in_specs=(P(axis, None), P(None, axis)), out_specs=P(None, axis)
    )
    return fn(x_MxK, w_KxN)


def matmul_reference(x_MxK, w_KxN):
    """Plain jnp: what both sharded versions must equal."""
    return jnp.dot(x_MxK, w_KxN)


def compare(mesh, axis: str, M: int = 512, K: int = 512, N: int = 512, budget_s: float = 0.5):
    """Time the ring against gather-then-multiply on one input (lab.measure.timing.compare)."""
    from lab.measure import timing

    x_MxK, w_KxN = timing.random_inputs(0, [(M, K), (K, N)])
    impls = {
        "collective matmul (ring)": jax.jit(
            functools.partial(collective_matmul, mesh=mesh, axis=axis)
        ),
        "all-gather then matmul": jax.jit(functools.partial(gathered_matmul, mesh=mesh, axis=axis)),
    }
    return timing.compare(impls, x_MxK, w_KxN, baseline="all-gather then matmul", budget_s=budget_s)


def main(argv=None) -> int:
    """`python -m lab.parallel.collective_matmul [--mesh 1x8] [--axis model] [--size 2048]`:
    the ring against gather-then-multiply on one input, both checked against plain jnp."""
    import argparse
    import sys

    import numpy as np
    from rich.console import Console

    from lab import devices
    from lab.measure import records
    from lab.mesh import MeshSpecError, make_mesh

    p = argparse.ArgumentParser(
        prog="python -m lab.parallel.collective_matmul", description=__doc__
    )
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--mesh", default="1x8", help="mesh spec (lab.mesh): data x model")
    p.add_argument("--axis", default="model", help="the axis x's rows and w's columns split over")
    p.add_argument("--size", type=int, default=2048, help="M = K = N")
    p.add_argument("--budget", type=float, default=0.5, help="seconds of timed calls per impl")
    args = p.parse_args(argv)
    try:
        devices.prepare(args.mesh, cpu_devices=0)
        mesh = make_mesh(args.mesh)
        if mesh.shape.get(args.axis, 1) < 2:
            raise ValueError(
                f"--axis {args.axis}: the mesh {dict(mesh.shape)} gives it < 2 devices"
            )
        M = args.size
        x, w = (
            jax.random.normal(jax.random.key(0), (M, M)),
            jax.random.normal(jax.random.key(1), (M, M)),
        )
        got = collective_matmul(
            x, w, mesh=mesh, axis=args.axis
        )  # raises on sizes that do not split
    except (ValueError, MeshSpecError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    err = float(np.abs(np.asarray(got) - np.asarray(matmul_reference(x, w))).max())
    results = compare(mesh, args.axis, M, M, M, budget_s=args.budget)
    env = records.environment()
    sim = (
        " (simulated devices: one host, no interconnect to hide)" if env["backend"] == "cpu" else ""
    )
    console = Console()
    console.print(
        f"{M}×{M}×{M} over {args.axis}={mesh.shape[args.axis]} on {env['device_kind']}{sim}"
    )
    for name, r in results.items():
        console.print(f"  {name:<26} median {r['median_s'] * 1e3:8.2f} ms   ratio {r['ratio']:.2f}")
    console.print(f"  max |ring - jnp| = {err:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

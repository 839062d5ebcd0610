"""`python -m lab.tools.collective_matmul mesh=1x8`: the ppermute-ring matmul (the all-gather
hidden behind compute) against all-gather-then-multiply on one input, both checked against
plain jnp. See lab/kernels/collective_matmul.py.
"""

import dataclasses
import functools
import sys

import jax
import numpy as np

from lab import devices
from lab.config import cli, field
from lab.errors import ConfigError
from lab.kernels import collective_matmul as cm
from lab.measure import memory, records, timing
from lab.mesh import make_mesh
from lab.names import MESH_AXES, MODEL
from lab.report import progress, tables


@dataclasses.dataclass(frozen=True)
class Options:
    mesh: str = field("1x8", "mesh (lab.run's grammar): data x model", kind="mesh")
    axis: str = field(MODEL, "the axis x's rows and w's columns split over", choices=MESH_AXES)
    size: int = field(2048, "rows = contraction = columns", min=1)
    budget: float = field(0.5, "seconds of timed calls per implementation", min=0.01)


def run(o: Options) -> int:
    devices.prepare(o.mesh)
    mesh = make_mesh(o.mesh)
    if mesh.shape.get(o.axis, 1) < 2:
        raise ConfigError(f"axis={o.axis}: the mesh {dict(mesh.shape)} gives it < 2 devices")
    n, W = o.size, mesh.shape[o.axis]
    if n % W:
        raise ConfigError(
            f"size={n}: x's rows and w's columns split over {o.axis}={W}, so size must be a "
            f"multiple of {W} (e.g. size={max(W, n // W * W)})"
        )
    # per device: x and w's shards, the gathered x (n × n), the output and the reference's
    memory.check_fits("the product's inputs and outputs", 4 * n * n * (3 + 2 / W), f"size={n}")
    x, w = timing.random_inputs(0, [(n, n), (n, n)])
    try:
        got = cm.collective_matmul(x, w, mesh=mesh, axis=o.axis)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    ref = np.asarray(cm.matmul_reference(x, w))
    err = float(np.abs(np.asarray(got) - ref).max())
    gathered = cm.gathered_matmul(x, w, mesh=mesh, axis=o.axis)
    err_gathered = float(np.abs(np.asarray(gathered) - ref).max())
    impls = {
        "collective matmul (ring)": jax.jit(
            functools.partial(cm.collective_matmul, mesh=mesh, axis=o.axis)
        ),
        "all-gather then matmul": jax.jit(
            functools.partial(cm.gathered_matmul, mesh=mesh, axis=o.axis)
        ),
    }
    results = timing.comparison(impls, x, w, baseline="all-gather then matmul", budget_s=o.budget)
    env = records.environment()
    sim = " (simulated devices: one host, no link to hide)" if env["backend"] == "cpu" else ""
    title = f"{n}×{n}×{n} over {o.axis}={mesh.shape[o.axis]} on {env['device_kind']}{sim}"
    con = progress.console()
    con.print(tables.step_compare(results, title))
    con.print(
        f"max |ring - jnp| = {err:.1e}, max |all-gather then matmul - jnp| = {err_gathered:.1e}"
    )
    return 0


def main(argv=None) -> int:
    return cli(Options, run, prog="python -m lab.tools.collective_matmul", doc=__doc__, argv=argv)


if __name__ == "__main__":
    from lab.report.progress import survive_lost_output

    survive_lost_output()  # a reader gone (| head) loses no records or report
    sys.exit(main())

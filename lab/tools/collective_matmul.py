"""`python -m lab.tools.collective_matmul mesh=1x8`: the ppermute-ring matmul (the all-gather
hidden behind compute) against all-gather-then-multiply on one input, both checked against
plain jnp; the times, the ratio and both errors go to out_dir as records. See
lab/kernels/collective_matmul.py.
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
    out_dir: str = field("results", "folder for the records", kind="path")


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
    records.writable_dir(o.out_dir)  # refused before the work
    con = progress.console()
    if busy := records.busy_note():
        con.print(f"[yellow]{busy}")
    with progress.counted(con, "collective matmul", 3) as tick:  # compiles take most of it
        results, errors = _measure(o, mesh, tick)
    env = records.environment()
    sim = " (simulated devices: one host, no link to hide)" if env["backend"] == "cpu" else ""
    title = f"{n}×{n}×{n} over {o.axis}={mesh.shape[o.axis]} on {env['device_kind']}{sim}"
    con.print(tables.step_compare(results, title))
    err, err_gathered = errors["collective matmul (ring)"], errors["all-gather then matmul"]
    con.print(
        f"max |ring - jnp| = {err:.1e}, max |all-gather then matmul - jnp| = {err_gathered:.1e}"
    )
    config = dict(op="collective matmul", size=n, axis=o.axis, mesh=dict(mesh.shape))
    config["simulated_devices"] = bool(sim)
    stem = records.output_stem(o.out_dir, "collective-matmul")
    path = records.write_records(stem.with_suffix(".jsonl"), _records(results, errors, config))
    con.print(f"records → {path}", markup=False, soft_wrap=True)
    return 0


def _measure(o: Options, mesh, tick) -> tuple:
    """Both products checked against plain jnp, then timed alternately: (the comparison,
    each one's largest absolute error); `tick(label)` as each of the three parts starts."""
    x, w = timing.random_inputs(0, [(o.size, o.size), (o.size, o.size)])
    tick("compiling and checking the ring against jnp")
    try:
        got = cm.collective_matmul(x, w, mesh=mesh, axis=o.axis)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    ref = np.asarray(cm.matmul_reference(x, w))
    err = float(np.abs(np.asarray(got) - ref).max())
    tick("compiling and checking all-gather then matmul")
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
    tick(f"timing both alternately for {o.budget:g} s each")
    results = timing.comparison(impls, x, w, baseline="all-gather then matmul", budget_s=o.budget)
    errors = {"collective matmul (ring)": err, "all-gather then matmul": err_gathered}
    return results, errors


def _records(results, errors: dict, config: dict) -> list[dict]:
    """Per implementation: its median time with its spread (measured), its largest absolute
    difference from plain jnp (measured), and its ratio to the baseline's median (derived)."""
    out = []
    for c in results.contenders:
        cfg = dict(config, impl=c.name)
        spread = dict(p10_s=c.bench.p10_s, p90_s=c.bench.p90_s, runs=c.bench.runs)
        out.append(
            records.make_record("collective matmul time", c.bench.median_s, "s", **cfg, **spread)
        )
        out.append(
            records.make_record("collective matmul max abs error", errors[c.name], "1", **cfg)
        )
        if c.name != results.baseline:
            out.append(
                records.make_record(
                    f"collective matmul time ratio vs {results.baseline}",
                    c.ratio,
                    "x",
                    label="derived",
                    baseline_median_s=c.baseline_median_s,
                    **cfg,
                )
            )
    return out


def main(argv=None) -> int:
    return cli(Options, run, prog="python -m lab.tools.collective_matmul", doc=__doc__, argv=argv)


if __name__ == "__main__":
    from lab.report.progress import survive_lost_output

    survive_lost_output()  # a reader gone (| head) loses no records or report
    sys.exit(main())

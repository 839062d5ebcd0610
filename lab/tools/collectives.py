"""`python -m lab.tools.collectives mesh=4x2`: each collective timed over each mesh axis.

all-reduce, all-gather, reduce-scatter, all-to-all and ppermute, nccl-tests style: algbw and
busbw per message size, a table, records and a PNG of busbw against size. On CPU the devices
are simulated (slices of one host): the figures are memory copies, not a link. See
lab/measure/collectives.py.
"""

import dataclasses
import re
import sys
import time

import jax

from lab import devices, startup
from lab.config import cli, field
from lab.errors import ConfigError
from lab.measure import collectives as coll
from lab.measure import memory, records
from lab.mesh import MeshSpecError, make_mesh
from lab.report import plots, progress, tables

KiB, MiB = 2**10, 2**20


@dataclasses.dataclass(frozen=True)
class Options:
    mesh: str = field(
        "", "mesh (lab.run's grammar); default 4x2-like over the devices", kind="mesh"
    )
    ops: tuple = field(coll.OPS, "collectives to time", kind="names", choices=coll.OPS)
    min_size: str = field(
        "4KB",
        "smallest message S, e.g. 4KB (each size is rounded up to whole float32 elements on "
        "every device of the group; sizes that round alike are timed once)",
    )
    max_size: str = field("", "largest S; default 4MB on CPU, 256MB elsewhere")
    quick: bool = field(
        False, "two sizes, min_size and max_size (16× min_size if not given): a quick check"
    )
    budget: float = field(0.3, "seconds of timed calls per point", min=0.01)
    cpu_devices: int = field(8, "simulated devices on CPU", min=1)
    out_dir: str = field("results", "folder for the records and the plot", kind="path")
    plot: bool = field(True, "draw the PNG")


def parse_size(key: str, text: str) -> int:
    """'4KB' / '16MiB' / '1TB' / '1024' → bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)i?b?\s*", text.lower())
    if not m:
        raise ConfigError(
            f"{key}={text!r}: expected a whole number of bytes, alone or with a unit of B, KB, "
            "MB, GB or TB (binary: 1KB = 1024 bytes; KiB alike), like 4KB, 16MB or 1024"
        )
    units = {"": 1, "k": KiB, "m": MiB, "g": 1024 * MiB, "t": 1024**2 * MiB}
    return int(m.group(1)) * units[m.group(2)]


def run(o: Options) -> int:
    devices.prepare(o.mesh or "1", cpu_devices=o.cpu_devices)
    try:
        mesh = make_mesh(o.mesh or coll.default_mesh(jax.device_count()))
    except MeshSpecError as e:
        if jax.default_backend() != "cpu":
            raise
        raise ConfigError(
            f"{e} (cpu_devices= sets how many are simulated: {o.cpu_devices})"
        ) from None
    if not coll.bench_axes(mesh):
        raise ConfigError(f"mesh={o.mesh or dict(mesh.shape)}: no axis holds more than one device")
    lo = parse_size("min_size", o.min_size)
    cpu = jax.default_backend() == "cpu"
    hi = parse_size("max_size", o.max_size) if o.max_size else (4 * MiB if cpu else 256 * MiB)
    if lo < 1:
        raise ConfigError(f"min_size={o.min_size}: a message holds at least one byte")
    if lo > hi:
        shown = o.max_size or f"{hi // MiB}MB (the default here)"
        raise ConfigError(f"min_size={o.min_size} is above max_size={shown}")
    # quick: the two ends asked for, or the smallest and one 16× larger (4 and 64 KiB)
    top = hi if o.max_size else min(16 * lo, hi)
    sizes = sorted({lo, top}) if o.quick else coll.sizes_between(lo, hi)
    # a message's input, output and the collective's own buffer on every device
    memory.check_fits("the largest message", 3 * max(sizes), f"max_size={o.max_size or hi}")
    stem = records.output_stem(o.out_dir, "collectives")
    env = records.environment()
    simulated = env["backend"] == "cpu" and env["device_count"] > 1
    where = "simulated devices (one host's memory, not an interconnect)" if simulated else "devices"
    shape = " × ".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1) or "one device"
    title = f"collectives · {env['device_kind']} × {env['device_count']} {where} · {shape}"
    t0 = time.perf_counter()
    con = progress.console()
    if busy := records.busy_note("times", "bus bandwidths"):
        con.print(f"[yellow]{busy}")
    total = coll.points_planned(mesh, sizes, o.ops)
    asked = len(sizes) * len(o.ops) * len(coll.bench_axes(mesh))
    if total < asked:
        con.print(
            f"{asked - total} of the {asked} points asked for round to a size already timed "
            "(sizes are rounded up to whole float32 elements on every device of the group): "
            f"timing {total}"
        )
    points, timed = [], []  # every point; those not yet written

    written = []

    def write(taken) -> None:
        path = records.write_records(stem.with_suffix(".jsonl"), coll.to_records(taken, simulated))
        written.extend(taken)
        startup.note(f"the {len(written)} points timed so far are in {path}")

    flush = startup.keep_on_stop(timed, write)
    with progress.tasks(con) as bar:
        task = bar.add_task("collectives", total=total)
        started = []

        def tick(label: str) -> None:  # a point starts: the one before it is done
            bar.update(task, description=label, advance=1 if started else 0)
            started.append(label)

        def done(point) -> None:
            timed.append(point)  # the list a stop writes first: a point is never counted unwritten
            points.append(point)

        coll.run(mesh, sizes, o.ops, budget_s=o.budget, progress=tick, done=done)
        bar.update(task, completed=total)
    con.print(tables.collectives(points, title))
    flush()
    con.print(f"records → {stem.with_suffix('.jsonl')}", markup=False, soft_wrap=True)
    if o.plot:
        con.print(
            f"plot → {plots.collectives(points, stem.with_suffix('.png'), title)}", markup=False
        )
    con.print(f"done in {time.perf_counter() - t0:.1f} s; busbw = algbw · nccl-tests factor")
    return 0


def main(argv=None) -> int:
    return cli(Options, run, prog="python -m lab.tools.collectives", doc=__doc__, argv=argv)


if __name__ == "__main__":
    from lab.report.progress import survive_lost_output

    survive_lost_output()  # a reader gone (| head) loses no records or report
    sys.exit(main())

"""TPU targets: `tpu:GEN:TOPOLOGY`, compiled with libtpu (the `tpu` extra) on any Linux machine.

With `libtpu` installed, XLA compiles for a TPU slice that is not attached
(`jax.experimental.topologies.get_topology_desc("v5e:2x4", platform="tpu")`).
"""

import glob
import os

from lab.errors import ConfigError

# Generation → example topologies (chips per axis). Any topology libtpu accepts will do.
TPU_TARGETS = {
    "v4": ("2x2x1", "2x2x2", "4x4x4"),
    "v5e": ("2x2", "2x4", "4x4", "8x16"),
    "v5p": ("2x2x1", "2x2x2", "4x4x4"),
    "v6e": ("2x2", "2x4", "4x4", "16x16"),
}


MEGACORE = ("v4",)  # generations whose chips JAX drives as one device of two TensorCores
# Generations whose slices are a 3-D torus (the others: 2-D).
THREE_D = ("v4", "v5p")


def target_help() -> str:
    return ", ".join(f"tpu:{g}:{t}" for g, tops in TPU_TARGETS.items() for t in tops[:2])


def parse_target(target: str) -> tuple[str, str]:
    """'tpu:v5e:2x4' → ('v5e', '2x4'); errors list what is valid."""
    parts = target.split(":")
    if len(parts) != 3 or parts[0] != "tpu":
        raise ConfigError(
            f"target={target!r}: expected tpu:GENERATION:TOPOLOGY, e.g. {target_help()}"
        )
    _, gen, topo = parts
    if gen not in TPU_TARGETS:
        from lab.config import did_you_mean

        raise ConfigError(
            f"target={target!r}: unknown TPU generation {gen!r}; "
            f"choose one of {', '.join(TPU_TARGETS)}{did_you_mean(gen, TPU_TARGETS)}"
        )
    dims = topo.split("x")
    if not all(p.isdigit() for p in dims):
        raise ConfigError(f"target={target!r}: topology {topo!r} is not like 2x4 or 2x2x1")
    if any(int(p) < 1 for p in dims):  # libtpu divides by each (SIGFPE, a core dump)
        raise ConfigError(f"target={target!r}: every axis of the topology needs at least 1 chip")
    want = 3 if gen in THREE_D else 2
    if len(dims) != want:
        example = TPU_TARGETS[gen][0]
        raise ConfigError(
            f"target={target!r}: a {gen} slice is a {want}-D torus, so its topology has "
            f"{want} axes, e.g. tpu:{gen}:{example}"
        )
    return gen, topo


def quiet_libtpu_off_tpu(generation: str = "v5e") -> None:
    """With libtpu installed on a machine without TPU chips, JAX's start-up makes libtpu query
    a TPU VM's metadata server and print several lines of errors. Give it a local answer. And
    libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) for the chips it would drive:
    with no chip to share, two plans compiling at once would only refuse each other."""
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return  # a real TPU VM: leave the runtime alone
    for var, value in (
        ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
        ("TPU_SKIP_MDS_QUERY", "1"),
        ("TPU_WORKER_HOSTNAMES", "localhost"),
        ("TPU_ACCELERATOR_TYPE", f"{generation}-8"),
    ):
        os.environ.setdefault(var, value)


def prepare_host(target: str) -> None:
    gen, _ = parse_target(target)
    quiet_libtpu_off_tpu(gen)


def topology_devices(target: str) -> list:
    """The devices of a TPU slice that is not attached, for ahead-of-time compilation."""
    gen, topo = parse_target(target)
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise ConfigError("target=tpu:... needs libtpu: pip install -e '.[tpu]'") from None
    from jax.experimental import topologies

    try:
        # v4 chips hold two TensorCores that JAX on a v4 VM drives as one device (megacore);
        # libtpu's topology otherwise lists one device per core: half a chip's memory and peak
        kwargs = {"chip_config_name": "megacore"} if gen in MEGACORE else {}
        topology = topologies.get_topology_desc(f"{gen}:{topo}", platform="tpu", **kwargs)
    except Exception as e:  # libtpu reports bad layouts as several exception types
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"target={target!r}: libtpu refused the topology ({msg})") from None
    return list(topology.devices)

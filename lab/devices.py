"""Which devices the run has, and getting them ready before JAX starts its backends.

Two things must happen before the first JAX operation: `jax.distributed.initialize` (the
multi-controller runtime that joins hosts into one set of global devices) and, on CPU, the
number of simulated devices. `prepare` does both; `describe` reports what came of it.
"""

import dataclasses
import glob
import math
import os

import jax

from lab.mesh import MeshSpecError, known_size, resolve_shape


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What the run header prints about the hardware."""

    backend: str  # cpu | gpu | tpu
    device_kind: str  # jax's device_kind, the key of the spec table
    count: int  # global devices over all processes
    local_count: int  # devices attached to this process
    process_count: int  # jax.distributed processes (hosts)
    process_index: int  # this process
    simulated: bool  # CPU devices beyond one share the same cores: simulated
    aot: bool = False  # a TPU topology compiled for ahead of time: nothing runs

    def header(self) -> str:
        sim = " (simulated CPU devices)" if self.simulated else ""
        sim = " (ahead-of-time target: compiled, not run)" if self.aot else sim
        hosts = f", {self.process_count} processes" if self.process_count > 1 else ""
        return f"{self.backend} · {self.device_kind} × {self.count}{sim}{hosts}"


def quiet_libtpu_off_tpu(generation: str = "v5e") -> None:
    """With libtpu installed on a machine without TPU chips, JAX's start-up makes libtpu query
    a TPU VM's metadata server and print several lines of errors. Give it a local answer."""
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return  # a real TPU VM: leave the runtime alone
    for var, value in (
        ("TPU_SKIP_MDS_QUERY", "1"),
        ("TPU_WORKER_HOSTNAMES", "localhost"),
        ("TPU_ACCELERATOR_TYPE", f"{generation}-8"),
    ):
        os.environ.setdefault(var, value)


def _tpu_pod() -> bool:
    """A multi-host TPU slice: the runtime lists several worker hostnames."""
    return "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")


def _init_distributed(coordinator: str, num_processes: int, process_id: int) -> None:
    if coordinator:
        # CPU processes need a collectives library to talk; gloo ships with jaxlib.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
        )
    elif _tpu_pod():
        jax.distributed.initialize()  # TPU pods describe themselves through the environment


def _set_cpu_devices(n: int) -> None:
    """Simulate `n` CPU devices; a no-op once backends exist (e.g. under the test conftest)."""
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass


def prepare(
    mesh: str,
    *,
    cpu_devices: int = 0,
    coordinator: str = "",
    num_processes: int = 1,
    process_id: int = 0,
) -> None:
    """Call before any JAX operation: joins hosts, then sizes the simulated CPU devices."""
    quiet_libtpu_off_tpu()
    _init_distributed(coordinator, num_processes, process_id)
    wanted = cpu_devices or known_size(mesh)
    if wanted > 1:
        _set_cpu_devices(max(1, wanted // num_processes))


def describe() -> DeviceInfo:
    devices = jax.devices()
    backend = jax.default_backend()
    return DeviceInfo(
        backend=backend,
        device_kind=devices[0].device_kind,
        count=len(devices),
        local_count=jax.local_device_count(),
        process_count=jax.process_count(),
        process_index=jax.process_index(),
        simulated=backend == "cpu" and len(devices) > 1,
    )


def describe_target(devices: list) -> DeviceInfo:
    """A TPU slice known only from its topology (lab/aot.py)."""
    n = len(devices)
    return DeviceInfo(
        backend="tpu",
        device_kind=devices[0].device_kind,
        count=n,
        local_count=n,
        process_count=1,
        process_index=0,
        simulated=False,
        aot=True,
    )


def check_mesh_fits(mesh: str, info: DeviceInfo) -> dict[str, int]:
    """Mesh sizes for the devices present; an error with both numbers when it does not fit."""
    try:
        sizes = resolve_shape(mesh, info.count)
    except MeshSpecError as e:
        hint = " (on CPU, cpu_devices=N simulates more)" if info.backend == "cpu" else ""
        raise MeshSpecError(f"{e} [{info.backend}: {info.device_kind}]{hint}") from None
    used = math.prod(sizes.values())
    if info.aot and used != info.count:  # a plan is for the whole slice, as a real job runs
        raise MeshSpecError(
            f"mesh={mesh} uses {used} of the target's {info.count} devices: a TPU slice runs "
            f"one program over all of them (e.g. mesh={info.count} or mesh=-1)"
        )
    return sizes

"""Which devices the run has, and getting them ready before JAX starts its backends.

Two things must happen before the first JAX operation: `jax.distributed.initialize` (the
multi-controller runtime that joins hosts into one set of global devices) and, on CPU, the
number of simulated devices. `prepare` does both; `describe` reports what came of it.
"""

import dataclasses
import math
import os
import socket
import time

import jax

from lab.errors import ConfigError
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
    aot: bool = False  # a target compiled for ahead of time (lab/plans): nothing runs

    def header(self) -> str:
        sim = " (simulated CPU devices)" if self.simulated else ""
        sim = " (ahead-of-time target: compiled, not run)" if self.aot else sim
        hosts = f", {self.process_count} processes" if self.process_count > 1 else ""
        return f"{self.backend} · {self.device_kind} × {self.count}{sim}{hosts}"


def _tpu_pod() -> bool:
    """A multi-host TPU slice: the runtime lists several worker hostnames."""
    return "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")


def _reach(coordinator: str, timeout_s: float) -> None:
    """Wait until the coordinator accepts a TCP connection, or raise ConfigError. The runtime's
    own wait ends in a C++ abort with a stack trace, so a process that joins checks first."""
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"coordinator={coordinator!r}: expected host:port")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"coordinator={coordinator}: not reachable within {timeout_s:g} s "
                    f"(coordinator_timeout=); is process 0 started and the address right? "
                    f"({e.strerror or e})"
                ) from None
            time.sleep(0.5)


def _init_distributed(
    coordinator: str, num_processes: int, process_id: int, timeout_s: int = 60
) -> None:
    if coordinator:
        # CPU processes need a collectives library to talk; gloo ships with jaxlib.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if process_id > 0:
            _reach(coordinator, timeout_s)
        try:
            jax.distributed.initialize(
                coordinator_address=coordinator,
                num_processes=num_processes,
                process_id=process_id,
                initialization_timeout=timeout_s,
                shutdown_timeout_seconds=min(timeout_s, 30),
            )
        except Exception as e:  # noqa: BLE001 — the runtime raises XlaRuntimeError and others
            first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"coordinator={coordinator}: process {process_id} of {num_processes} could not "
                f"join within {timeout_s} s (coordinator_timeout=); is the address right and "
                f"every process started? ({first})"
            ) from None
    elif _tpu_pod():
        jax.distributed.initialize()  # TPU pods describe themselves through the environment


# Simulated CPU devices per process: 4,096 take ~3 s and 0.7 GB to create on 2 cores; the cost
# grows with the count (100,000 ran for minutes past 3.5 GB without a word), and no mesh a
# CPU can usefully simulate needs more.
MAX_CPU_DEVICES = 4096


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
    coordinator_timeout: int = 60,
) -> None:
    """Call before any JAX operation: joins hosts, then sizes the simulated CPU devices."""
    wanted = cpu_devices or known_size(mesh)
    if wanted // max(num_processes, 1) > MAX_CPU_DEVICES and jax.config.jax_platforms in (
        None,
        "",
        "cpu",
    ):
        what = f"cpu_devices={cpu_devices}" if cpu_devices else f"mesh={mesh}"
        raise ConfigError(
            f"{what}: {wanted:,} simulated CPU devices per process is more than the "
            f"{MAX_CPU_DEVICES:,} a CPU can create in reasonable time and memory; use a smaller "
            "mesh, or plan a big slice with target=tpu:… / target=gpu:…"
        )
    _init_distributed(coordinator, num_processes, process_id, coordinator_timeout)
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
    """A slice known only from its topology (lab/plans): compiled for, never run on."""
    n = len(devices)
    return DeviceInfo(
        backend={"cuda": "gpu", "rocm": "gpu"}.get(devices[0].platform, devices[0].platform),
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
            f"mesh={mesh} uses {used} of the target's {info.count} devices: a slice runs "
            f"one program over all of them (e.g. mesh={info.count} or mesh=-1)"
        )
    return sizes

"""Devices, mesh and trainer for one Config: what every command that trains, plans or measures
the lab's step starts from (lab.run, the step tools, the ledger's probes).

`open_session` does, in order: get a target's abstract devices (lab/plans) or prepare this
machine's (jax.distributed, simulated CPU devices); apply the backend's defaults to the keys
the user left out; check that the mesh fits; build the mesh and the trainer (which resolves
every `auto`). Every problem on the way is a ConfigError: one line, exit 2, before anything
compiles.
"""

import dataclasses

from lab import data, devices, plans
from lab.config import Config, make_config, override
from lab.devices import DeviceInfo
from lab.errors import ConfigError
from lab.mesh import make_mesh
from lab.train import Trainer, make_trainer


@dataclasses.dataclass(frozen=True)
class Session:
    cfg: Config  # resolved for the mesh (no `auto` left)
    info: DeviceInfo
    trainer: Trainer


def _devices(cfg: Config):
    """(DeviceInfo, the target's devices or None)."""
    if cfg.target:
        plans.prepare_host(cfg.target)
        target_devices = plans.topology_devices(cfg.target)
        return devices.describe_target(target_devices), target_devices
    devices.prepare(
        cfg.mesh,
        cpu_devices=cfg.cpu_devices,
        coordinator=cfg.coordinator,
        num_processes=cfg.num_processes,
        process_id=cfg.process_id,
        coordinator_timeout=cfg.coordinator_timeout,
    )
    return devices.describe(), None


def _check_data(cfg: Config) -> None:
    if cfg.data == "text" and cfg.seq_len + 1 >= len(data.corpus_bytes()):
        raise ConfigError(
            f"seq_len={cfg.seq_len} is longer than the bundled text ({len(data.corpus_bytes())} "
            "bytes): choose a shorter seq_len or data=synthetic"
        )


def _check_offload(cfg: Config, info: DeviceInfo) -> None:
    """Offloading to host memory on CPU: the CPU's host memory kinds are its device memory."""
    asked = ["offload_optimizer=true"] if cfg.offload_optimizer else []
    asked += ["remat=offload"] if cfg.model.remat == "offload" else []
    if asked and info.backend == "cpu":
        raise ConfigError(
            f"{' and '.join(asked)}: the cpu backend has no separate host memory (its "
            "pinned_host memory kind is the same RAM as its device memory), so nothing would "
            "move; plan it for an accelerator with target=tpu:v5e:2x4 or target=gpu:h100:1"
        )


def open_session(cfg: Config | None = None, *, keys: dict | None = None) -> Session:
    """A session for `cfg`, or for the user's typed `keys` (lab.config.parse_keys): then the
    keys left out take the defaults of the backend found (a GPU run is bigger than a CPU one)."""
    if cfg is None:
        cfg = make_config(**(keys or {}))
    info, target_devices = _devices(cfg)
    if keys is not None and info.backend != "cpu":
        cfg = make_config(backend=info.backend, **keys)
    if cfg.target:
        cfg = override(cfg, compile_only=True)  # a plan: nothing can run
    _check_offload(cfg, info)
    devices.check_mesh_fits(cfg.mesh, info)
    trainer = make_trainer(cfg, make_mesh(cfg.mesh, target_devices))
    _check_data(trainer.cfg)
    return Session(trainer.cfg, info, trainer)

"""Devices, mesh and trainer for one request: what every command that trains, plans or
measures the lab's step starts from (lab.run, the step tools, the ledger's probes).

`open_session` does, in order: find the platform once (a target's abstract devices from
lab/plans, or this machine's prepared: jax.distributed, simulated CPU devices); resolve the
request on it (lab/resolve.py: the backend's defaults, every `auto`, every rule, all broken
rules together as one ConfigError, exit 2, before anything compiles); build the trainer
from the resolved config.
"""

import dataclasses

from lab.config import Config
from lab.devices import DeviceInfo
from lab.errors import ConfigError
from lab.resolve import Platform, Request, Resolved, resolve
from lab.train import Trainer, make_trainer


@dataclasses.dataclass(frozen=True)
class Session:
    cfg: Config  # resolved for the mesh (no `auto` left)
    info: DeviceInfo
    trainer: Trainer
    resolved: Resolved | None = None


def open_session(
    cfg: Config | None = None,
    *,
    keys: dict | None = None,
    request: Request | None = None,
    purpose: str = "train",
    batches=(),
) -> Session:
    """A session for a `request` (or the user's typed `keys`, lab.config.parse_keys: the
    keys left out take the defaults of the backend found, a GPU run is bigger than a CPU
    one), or for a `cfg` built in code (every field as given); for decoding (purpose decode),
    `batches` are the batch sizes its decoders will be built for.

    A bad key or value, or a rule broken, is a ConfigError. Open it before any other JAX
    operation: JAX sizes its simulated CPU devices once, when it starts. A multi-host join
    (coordinator=) that does not finish within coordinator_timeout once inside JAX's runtime
    ends the process with one line and exit 2: the runtime's wait cannot be interrupted from
    Python (lab.devices says more); a coordinator that never answers is a ConfigError."""
    if request is None:
        request = Request.from_config(cfg) if cfg is not None else Request.of(**(keys or {}))
    if purpose == "train":  # resume=true: the run's own keys (config.json) under those given
        request = request.resumed()
    try:
        platform = Platform.found(request)
        if platform.aot and purpose == "train":
            purpose = "plan"  # a target's devices: nothing can run
        resolved = resolve(request, platform, purpose, batches=batches)
    except ConfigError as e:  # a key the user did not type is named as the run's own
        raise request.blame(e) from None
    return session_for(resolved)


def session_for(resolved: Resolved) -> Session:
    """The session of a resolved config: its trainer built on its mesh."""
    trainer = make_trainer(resolved)
    return Session(resolved.cfg, resolved.platform.info, trainer, resolved)

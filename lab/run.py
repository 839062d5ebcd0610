"""`python -m lab.run key=value ...`: train the transformer on a device mesh, on any backend.

Thin on purpose: parse, prepare the devices, build the mesh and the trainer, then hand over
to lab/loop.py. Every user mistake ends here as one line on stderr and exit code 2.
"""

import dataclasses
import os
import sys
import time

from lab.config import Config, ConfigError, help_text, parse_args, resolve_dtype
from lab.errors import RunError


def resolve(cfg: Config, backend: str, sizes: dict[str, int]) -> tuple[Config, str]:
    """Fill the `auto` choices for this backend: compute dtype, data, strategy, name."""
    from lab.mesh import auto_strategy

    model = resolve_dtype(cfg.model, backend)
    model = dataclasses.replace(model, attention=_attention_impl(model, cfg.seq_len, backend))
    data = cfg.data if cfg.data != "auto" else ("text" if model.vocab_size == 256 else "synthetic")
    name = cfg.name or f"{cfg.preset}-{cfg.mesh}-{time.strftime('%Y%m%d-%H%M%S')}"
    strategy = cfg.strategy if cfg.strategy != "auto" else auto_strategy(sizes)
    cfg = dataclasses.replace(cfg, model=model, data=data, name=name, strategy=strategy)
    if cfg.data == "text" and model.vocab_size < 256:
        raise ConfigError(f"data=text needs vocab_size >= 256 (bytes), got {model.vocab_size}")
    return cfg, strategy


def _attention_impl(model, seq_len: int, backend: str) -> str:
    """The kernel `attention=` runs on this backend (auto resolved, so the header and
    config.json name it); one the inputs do not fit is a ConfigError before any tracing."""
    if model.attention == "ring":
        return "ring"  # checked against the strategy in lab.config
    import jax
    import jax.numpy as jnp

    from lab.kernels.attention import choose

    dtype = jnp.dtype(model.dtype)
    q = jax.ShapeDtypeStruct((1, seq_len, model.n_heads, model.head_dim), dtype)
    kv = jax.ShapeDtypeStruct((1, seq_len, model.n_kv_heads, model.head_dim), dtype)
    try:
        impl = choose(model.attention, q, kv, kv, causal=True, backend=backend)
    except ValueError as e:
        raise ConfigError(f"attention={model.attention}: {e}") from None
    return impl if model.attention == "auto" else model.attention


def setup(cfg: Config, argv: list[str] | None = None):
    """Devices, mesh and trainer; mesh problems become ConfigError (exit 2).

    `argv` (the user's keys) lets an accelerator re-read them under its own defaults.
    """
    if cfg.target:
        from lab.aot import prepare_host

        prepare_host(cfg.target)
    from lab import aot, devices
    from lab.mesh import MeshSpecError, make_mesh
    from lab.train import make_trainer

    target_devices = None
    if cfg.target:
        target_devices = aot.topology_devices(cfg.target)
        info = devices.describe_target(target_devices)
    else:
        devices.prepare(
            cfg.mesh,
            cpu_devices=cfg.cpu_devices,
            coordinator=cfg.coordinator,
            num_processes=cfg.num_processes,
            process_id=cfg.process_id,
        )
        info = devices.describe()
    if argv is not None and info.backend != "cpu":
        cfg = parse_args(argv, backend=info.backend)
    if cfg.target:
        cfg = dataclasses.replace(cfg, compile_only=True)  # a plan: nothing can run
    try:
        sizes = devices.check_mesh_fits(cfg.mesh, info)
        cfg, strategy = resolve(cfg, info.backend, sizes)
        mesh = make_mesh(cfg.mesh, target_devices)
        trainer = make_trainer(cfg, mesh, strategy)
    except MeshSpecError as e:
        raise ConfigError(str(e)) from None
    return cfg, info, trainer


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(help_text())
        return 0
    try:
        cfg = parse_args(argv)
        if cfg.resume and not cfg.name:
            raise ConfigError("resume=true needs the run's name=NAME")
        cfg, info, trainer = setup(cfg, argv)
        from lab.loop import run_training  # heavy imports only once the config is sound

        return run_training(cfg, info, trainer)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    sys.exit(main())

"""Plans for TPUs from any machine: compile the real step for a TPU topology ahead of time.

With `libtpu` installed (the `tpu` extra), XLA can compile for a TPU slice that is not
attached (`jax.experimental.topologies`). What comes out is the compiler's view: per-device
memory, FLOPs and bytes, and its estimate of the step time. Every figure printed from here is
labelled *compiled, not run*.
"""

import os

from lab.config import ConfigError
from lab.devices import quiet_libtpu_off_tpu

# Generation → example topologies (chips per axis). Any topology libtpu accepts will do.
TPU_TARGETS = {
    "v4": ("2x2x1", "2x2x2", "4x4x4"),
    "v5e": ("2x2", "2x4", "4x4", "8x16"),
    "v5p": ("2x2x1", "2x2x2", "4x4x4"),
    "v6e": ("2x2", "2x4", "4x4", "16x16"),
}


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
        raise ConfigError(
            f"target={target!r}: unknown TPU generation {gen!r}; "
            f"choose one of {', '.join(TPU_TARGETS)}"
        )
    if not all(p.isdigit() for p in topo.split("x")):
        raise ConfigError(f"target={target!r}: topology {topo!r} is not like 2x4 or 2x2x1")
    return gen, topo


def prepare_host(target: str) -> None:
    """Before JAX starts: the local backend only hosts the compiler, so keep libtpu from
    probing this machine for chips (it would look up a TPU VM's metadata and complain)."""
    gen, _ = parse_target(target)
    quiet_libtpu_off_tpu(gen)
    if not os.environ.get("JAX_PLATFORMS"):
        import jax

        try:
            jax.config.update("jax_platforms", "cpu")
        except RuntimeError:  # backends already up: too late, harmless
            pass


def topology_devices(target: str) -> list:
    """The devices of a TPU slice that is not attached, for ahead-of-time compilation."""
    gen, topo = parse_target(target)
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise ConfigError("target=tpu:... needs libtpu: pip install -e '.[tpu]'") from None
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(f"{gen}:{topo}", platform="tpu")
    except Exception as e:  # libtpu reports bad layouts as several exception types
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"target={target!r}: libtpu refused the topology ({msg})") from None
    return list(topology.devices)


def estimated_seconds(compiled) -> float | None:
    """The compiler's own estimate of one step's time ('optimal_seconds'), where it gives one."""
    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, list | tuple) and costs else costs
    value = (costs or {}).get("optimal_seconds")
    return float(value) if value and value > 0 else None


def step_seconds(compiled, flops_per_device: float, spec, peak: float | None):
    """(seconds, source) for one call on the target: the compiler's estimate, floored by the
    roofline of the chip (spec-sheet peak and bandwidth).

    Why a floor: a Pallas (Mosaic) kernel is a custom call that XLA's cost model cannot see
    into — it counts ~0 FLOPs for it, and its estimate can then imply more than the chip's
    peak. `flops_per_device` (the analytic count) keeps the compute side honest.
    """
    from lab.measure import cost

    c = cost.compiled_cost(compiled) or {}
    est = estimated_seconds(compiled)
    if not (peak and spec):
        return est, "compiler estimate" if est else "none: no estimate and no spec entry"
    compute_s = max(c.get("flops") or 0.0, flops_per_device) / peak
    memory_s = (c.get("bytes accessed") or 0.0) / spec.memory_bandwidth
    floor = max(compute_s, memory_s)
    if est and est >= floor:
        return est, "compiler estimate"
    bound = "compute" if compute_s >= memory_s else "memory"
    above = "; the compiler's estimate was below it" if est else ""
    return floor, f"roofline floor ({bound}-bound{above}): no faster, likely slower"

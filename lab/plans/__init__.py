"""Plans for hardware that is not here: the real program compiled ahead of time for a target.

A target names a slice of accelerators: `tpu:GEN:TOPOLOGY` (libtpu compiles for a TPU slice
from any Linux machine; lab/plans/tpu.py) or `gpu:KIND[:N]` (JAX's CUDA plugin and ptxas compile
for N NVIDIA GPUs from any Linux machine; lab/plans/gpu.py). The target's devices are abstract:
a mesh over them, inputs as `ShapeDtypeStruct`s with shardings, and `jax.jit(...).lower(...)
.compile()` give the compiler's view — per-device memory, FLOPs and bytes, the resources of
every GPU kernel (lab/plans/resources.py) — and nothing runs. Every figure the compiler
gives is labelled *compiled, not run*; a time from the chip's roofs (`step_estimate`'s floor)
is a model's, labelled *predicted*.
"""

import dataclasses
import warnings

from lab.errors import ConfigError
from lab.plans import gpu, resources, tpu

PLATFORMS = {"tpu": tpu, "gpu": gpu}


def _module(target: str):
    platform = target.split(":", 1)[0]
    if platform not in PLATFORMS:
        raise ConfigError(
            f"target={target!r}: expected tpu:GEN:TOPOLOGY or gpu:KIND[:N], e.g. {target_help()}"
        )
    return PLATFORMS[platform]


def target_help() -> str:
    """Examples of every kind of target, for --help and errors."""
    return ", ".join(m.target_help() for m in PLATFORMS.values())


def parse_target(target: str):
    """The platform's parsed form of `target`; a ConfigError lists what is valid."""
    return _module(target).parse_target(target)


def prepare_host(target: str) -> None:
    """Before JAX starts: the local backend only hosts the compiler (JAX platform cpu), and
    the target's compiler is quieted where it would probe this machine for chips."""
    _module(target).prepare_host(target)
    import jax

    # jax's setting, not the environment: JAX_PLATFORMS set after jax was imported (lab's own
    # quieting, when a script imports jax first) never reached it
    if not jax.config.jax_platforms:
        try:
            jax.config.update("jax_platforms", "cpu")
        except RuntimeError:  # backends already up: too late, harmless
            pass


# jax's persistent compilation cache (JAX_COMPILATION_CACHE_DIR) keeps the executables of
# ahead-of-time compiles too, but one built for abstract devices cannot be loaded back: the next
# compile of the same program finds it, warns that it cannot read it and compiles afresh, which
# is what a plan does anyway. That warning says nothing about the plan; any other failure to
# read an entry is still shown.
UNLOADABLE_ENTRY = (
    r"(?s)Error reading persistent compilation cache entry for '[^']*': .*"
    r"must be constructed with a Client to call DeserializeLoadedExecutable"
)


def topology_devices(target: str) -> list:
    """The abstract devices of `target`, for ahead-of-time compilation."""
    warnings.filterwarnings("ignore", message=UNLOADABLE_ENTRY, category=UserWarning)
    return _module(target).topology_devices(target)


def gpu_kind(devices) -> str | None:
    """The lab's name (h100, …) of GPU devices (abstract or real), None for anything else."""
    return gpu_kind_of(devices[0].device_kind) if devices else None


def gpu_kind_of(device_kind: str) -> str | None:
    """'NVIDIA H100 80GB HBM3' → 'h100'; None for a kind the lab does not describe."""
    exact = next((k for k, g in gpu.GPUS.items() if g.device_kind == device_kind), None)
    if exact:
        return exact
    lowered = device_kind.lower()
    return next((k for k in gpu.GPUS if k in lowered), None)


def refusal(error: Exception) -> str | None:
    """A compiler's out-of-memory refusal in a few words ('needs 17.38G, 15.75G available':
    XLA:TPU will not compile a program its HBM cannot hold), None for any other error."""
    import re

    message = str(error)
    if "RESOURCE_EXHAUSTED" not in message:
        return None
    sizes = re.findall(r"\(([\d.]+[KMGT]?)\)", message)
    if len(sizes) >= 2:
        return f"needs {sizes[0]}, {sizes[1]} available"
    return message.split("RESOURCE_EXHAUSTED:")[-1].strip()[:120]


def compile_plan(lower, devices) -> tuple:
    """(compiled, kernels): `lower()` compiled for the target's devices; on a GPU target with
    every kernel's registers, spills and shared memory (lab/plans/resources.py), else []."""
    kind = gpu_kind(devices)
    if kind is None:
        return lower().compile(), []
    return resources.compile_with_kernels(lower, kind)


def estimated_seconds(compiled) -> float | None:
    """The compiler's own estimate of one call's time ('optimal_seconds'), where it gives one
    and it covers the whole call.

    None where the program has a while loop that runs more than once, or an unknown number of
    times (a scanned model, a pipeline's tick loop, an accumulation scan): XLA's estimate, like
    its FLOPs and bytes, counts each loop body once. It is not scaled by the trip counts
    because XLA gives one total, not its split by computation, so there is nothing exact to
    scale; a scanned plan then reads the roofline floor, labelled as such, instead of an
    estimate that sits below the floor only because it left out all but one trip."""
    try:
        costs = compiled.cost_analysis()
    except (NotImplementedError, RuntimeError):
        return None
    costs = costs[0] if isinstance(costs, list | tuple) and costs else costs
    value = (costs or {}).get("optimal_seconds")
    if not (value and value > 0):
        return None
    from lab.measure import cost

    program = cost.compiled_program(compiled)
    if program is None or any(n != 1 for _, n in program.loops):
        return None
    return float(value)


def compiler_estimate_error(
    device_kind: str, over_floor: float | None, no_floor: str = "no spec entry for the chip"
) -> str:
    """The error of a compiler's own time estimate in words: unchecked, and its ratio to the
    roofline floor of the same program where there is one (`no_floor`: why there is none)."""
    from lab.measure import cost
    from lab.report.format import significant

    known = (
        f"{significant(over_floor, 2)}× the roofline floor of the same program"
        if over_floor
        else f"no roofline floor beside it ({no_floor})"
    )
    return f"{cost.unchecked_estimate(device_kind)}; {known}"


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """One call's time on a target (`step_estimate`): the seconds, where they come from, and
    what is known of how far they may be from a measured time (a prediction states its error)."""

    seconds: float | None
    source: str  # cost.COMPILER_ESTIMATE, "roofline floor (…)", or "none: …"
    error: str | None  # in words; None where there is no time
    over_floor: float | None = None  # the compiler's estimate / the roofline floor, if both


def step_estimate(
    compiled,
    flops_per_device: float,
    spec,
    peak: float | None,
    *,
    cost_is_upper=False,
    device_kind: str = "",
) -> StepEstimate:
    """One call's time on the target: the compiler's estimate (none for a program whose loops
    repeat: `estimated_seconds`), floored by the roofline of the chip (spec-sheet peak and
    bandwidth), with its error in words (`compiler_estimate_error`; a
    floor is a least).

    Why a floor: a Pallas kernel is a custom call that XLA's cost model cannot see into — it
    counts ~0 FLOPs for it, and its estimate can then imply more than the chip's peak.
    `flops_per_device` (the analytic count) keeps the compute side honest. Where the compiler
    gives no cost analysis (XLA:GPU ahead of time), the bytes side is the least any program
    moves: its arguments read and its outputs written once (memory_analysis).

    `cost_is_upper`: the compiled FLOPs and bytes may overstate the call's work (a kernel's
    cost estimate counts a mask's static part, where the mask's data skips more tiles). A
    floor must come from work the call cannot avoid, so then neither they nor the compiler's
    estimate built on them enter: the floor is the roofline of `flops_per_device` and of the
    bytes every call moves (arguments read, outputs written).
    """
    from lab.measure import cost, memory

    c = {} if cost_is_upper else cost.compiled_cost(compiled) or {}
    est = None if cost_is_upper else estimated_seconds(compiled)
    if not (peak and spec):
        if not est:
            return StepEstimate(None, "none: no estimate and no spec entry", None)
        return StepEstimate(est, cost.COMPILER_ESTIMATE, compiler_estimate_error(device_kind, None))
    moved = c.get("bytes accessed")
    if not moved:
        mem = memory.compiled_memory(compiled) or {}
        moved = mem.get("argument_bytes", 0) + mem.get("output_bytes", 0)
    compute_s = max(c.get("flops") or 0.0, flops_per_device) / peak
    memory_s = (moved or 0.0) / spec.memory_bandwidth
    floor = max(compute_s, memory_s)
    if est and est >= floor:
        if not floor:  # a spec, but the program counts no FLOPs and moves no bytes
            why = "the program counts no FLOPs and no bytes moved"
            error = compiler_estimate_error(device_kind, None, why)
            return StepEstimate(est, cost.COMPILER_ESTIMATE, error)
        error = compiler_estimate_error(device_kind, est / floor)
        return StepEstimate(est, cost.COMPILER_ESTIMATE, error, est / floor)
    bound = "compute-bound" if compute_s >= memory_s else "memory-bound"
    if cost_is_upper:
        bound += "; analytic FLOPs, bytes read once: the compiled cost is an upper bound"
    above = "; the compiler's estimate was below it" if est else ""
    source = f"roofline floor ({bound}{above}): no faster, likely slower"
    return StepEstimate(floor, source, source)

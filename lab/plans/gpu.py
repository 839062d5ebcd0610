"""NVIDIA GPU targets: `gpu:KIND[:N]`, compiled with the CUDA PJRT plugin on any Linux machine.

No GPU, driver or CUDA libraries are needed: JAX's CUDA plugin (`jax[cuda13-local]`, pinned to
the installed jax) compiles for a GPU that a *target description* describes, and NVIDIA's
compiler wheel (`nvidia-cuda-nvcc`) brings ptxas; `pip install -e '.[gpu-plan]'` installs both.
`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)` then gives
abstract devices, and the real step compiles for them (sm_90a for H100/H200, sm_80 for A100).

The target description is written here from two tables: the spec table's datasheet figures
(memory, bandwidth; lab/measure/specs.py) and the streaming-multiprocessor facts below, from the
CUDA C++ Programming Guide ("Technical Specifications per Compute Capability") and the numbers
the devices report (as XLA's xla/backends/gpu/target_config/specs/*.txtpb record them). It uses
only fields that jax 0.10 and the newest both parse (XLA's own spec file adds one 0.10 rejects).
"""

import dataclasses
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

from lab.config import did_you_mean
from lab.errors import ConfigError
from lab.measure import specs, toolchain


@dataclasses.dataclass(frozen=True)
class Gpu:
    """What a compiler needs to know of one GPU besides its datasheet (specs.py)."""

    spec_key: str  # lab.measure.specs.SPECS key: memory, bandwidth, peaks
    device_kind: str  # as jax reports it; Pallas Triton reads the architecture from it (0.11+)
    compute_capability: tuple[int, int]
    arch_specific: bool  # sm_90a: wgmma, setmaxnreg, TMA multicast (Hopper)
    sm_count: int
    clock_ghz: float  # max boost
    fp32_lanes_per_sm: int
    smem_per_sm: int  # bytes; 1 KiB of it is reserved per resident block
    smem_per_block: int  # bytes: the opt-in maximum one block may use
    regs_per_sm: int
    threads_per_sm: int
    l2_bytes: int
    memory_reported: int  # bytes the device reports (the datasheet's "80 GB" is 80e9)
    per_host: int  # GPUs per host in the usual server (a DGX/HGX board): N > per_host spans hosts


_HOPPER = dict(  # H100 and H200 SXM: the same SM (compute capability 9.0, sm_90a)
    compute_capability=(9, 0),
    arch_specific=True,
    sm_count=132,
    clock_ghz=1.98,
    fp32_lanes_per_sm=128,
    smem_per_sm=233472,  # 228 KiB
    smem_per_block=232448,  # 227 KiB opt-in
    regs_per_sm=65536,
    threads_per_sm=2048,
    l2_bytes=50 * 2**20,
    per_host=8,
)
GPUS = {
    "h100": Gpu(
        spec_key="h100-sxm",
        device_kind="NVIDIA H100 80GB HBM3",
        memory_reported=84942979072,
        **_HOPPER,
    ),
    "h200": Gpu(
        spec_key="h200",
        device_kind="NVIDIA H200 141GB HBM3e",
        memory_reported=151397597184,
        **_HOPPER,
    ),
    "a100": Gpu(
        spec_key="a100-sxm4-80gb",
        device_kind="NVIDIA A100-SXM4-80GB",
        compute_capability=(8, 0),
        arch_specific=False,
        sm_count=108,
        clock_ghz=1.41,
        fp32_lanes_per_sm=64,
        smem_per_sm=167936,  # 164 KiB
        smem_per_block=166912,  # 163 KiB opt-in
        regs_per_sm=65536,
        threads_per_sm=2048,
        l2_bytes=40 * 2**20,
        memory_reported=85100068864,
        per_host=8,
    ),
}
INSTALL = "pip install -e '.[gpu-plan]'"


def reported_memory(device_kind: str) -> int | None:
    """Bytes a GPU the lab describes reports as its total memory (cudaMemGetInfo), which
    JAX's allocator takes its share of: more than the datasheet's (84.9e9 for an H100's
    "80 GB"). None for another kind."""
    return next((g.memory_reported for g in GPUS.values() if g.device_kind == device_kind), None)


def target_help() -> str:
    return ", ".join(f"gpu:{k}:8" for k in GPUS)


def parse_target(target: str) -> tuple[str, int]:
    """'gpu:h100:8' → ('h100', 8); 'gpu:h100' is one GPU. Errors list what is valid."""
    parts = target.split(":")
    if len(parts) not in (2, 3) or parts[0] != "gpu":
        raise ConfigError(f"target={target!r}: expected gpu:KIND[:N], e.g. {target_help()}")
    kind = parts[1].lower()
    if kind not in GPUS:
        raise ConfigError(
            f"target={target!r}: unknown GPU {parts[1]!r}{did_you_mean(kind, GPUS)}; the lab "
            f"describes {', '.join(GPUS)}"
        )
    n = parts[2] if len(parts) == 3 else "1"
    if not n.isdigit() or int(n) < 1:
        raise ConfigError(f"target={target!r}: N={n!r} must be a positive number of GPUs")
    n = int(n)
    per_host = GPUS[kind].per_host
    if n > per_host and n % per_host:
        raise ConfigError(
            f"target={target!r}: {n} GPUs span hosts of {per_host}; give a multiple of "
            f"{per_host} (or at most {per_host})"
        )
    return kind, n


def target_config(kind: str) -> str:
    """The GpuTargetConfigProto text that describes `kind` to XLA."""
    g = GPUS[kind]
    spec = specs.SPECS[g.spec_key]
    major, minor = g.compute_capability
    extension = "ACCELERATED_FEATURES" if g.arch_specific else "NONE"
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {g.smem_per_sm}
  threads_per_core_limit: {g.threads_per_sm}
  core_count: {g.sm_count}
  fpus_per_core: {g.fp32_lanes_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(spec.memory_bandwidth)}
  l2_cache_size: {g.l2_bytes}
  clock_rate_ghz: {g.clock_ghz}
  device_memory_size: {g.memory_reported}
  shared_memory_per_block_optin: {g.smem_per_block}
  cuda_compute_capability {{ major: {major} minor: {minor} feature_extension: {extension} }}
  registers_per_core_limit: {g.regs_per_sm}
  registers_per_block_limit: {g.regs_per_sm}
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
device_description_str: "{g.device_kind}"
"""


def _pjrt() -> tuple[str, str] | None:
    for major in ("13", "12"):
        try:
            return f"jax-cuda{major}-pjrt", importlib.metadata.version(f"jax-cuda{major}-pjrt")
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def cuda_root() -> str | None:
    """The folder jax hands XLA as xla_gpu_cuda_data_dir (lab/measure/toolchain.py)."""
    return toolchain.cuda_root()


def ptxas() -> str | None:
    """The ptxas XLA will run (lab/measure/toolchain.py finds it: records name its version)."""
    return toolchain.ptxas_path()


def check_compiler() -> None:
    """One line (ConfigError) naming the package to install when the plugin or ptxas is
    missing; before anything compiles."""
    import jaxlib

    pjrt = _pjrt()
    if pjrt is None:
        raise ConfigError(f"target=gpu:... needs JAX's CUDA plugin and ptxas: {INSTALL}")
    if pjrt[1] != jaxlib.__version__:
        raise ConfigError(
            f"{pjrt[0]} {pjrt[1]} does not match jaxlib {jaxlib.__version__}: {INSTALL} again"
        )
    if ptxas() is None:
        raise ConfigError(f"target=gpu:... needs ptxas (NVIDIA's nvcc wheel): {INSTALL}")


def prepare_host(target: str) -> None:
    parse_target(target)
    check_compiler()


def topology_devices(target: str) -> list:
    """N abstract GPUs of the target's kind: one host of N, or N/8 hosts of 8."""
    kind, n = parse_target(target)
    check_compiler()
    from jax.experimental import topologies

    per_host = min(n, GPUS[kind].per_host)
    topology = f"1x{n // per_host}x{per_host}"
    try:
        desc = topologies.get_topology_desc(
            platform="cuda", target_config=target_config(kind), topology=topology
        )
    except NotImplementedError:
        raise ConfigError(
            f"target={target!r}: the CUDA plugin did not load (JAX_PLATFORMS must be cpu for "
            f"a plan on a machine without a GPU; the lab sets it when nothing else did): "
            f"{INSTALL}"
        ) from None
    return list(desc.devices)


def quiet_cuda_off_gpu() -> None:
    """With the CUDA plugin installed (for GPU plans) on a machine without an NVIDIA GPU, JAX's
    start-up makes the plugin look for CUDA and cuDNN and log a screen of errors before every
    CPU run. Where no GPU device node exists and nobody chose the platforms, choose cpu: in
    the environment, which jax reads as it is imported, and in jax's config where something
    imported it first (its backends start later, on first use)."""
    if os.environ.get("JAX_PLATFORMS") or Path("/dev/nvidiactl").exists():
        return
    try:
        found = any(importlib.util.find_spec(f"jax_plugins.xla_cuda{m}") for m in ("13", "12"))
    except (ImportError, ValueError):
        found = False
    if found:
        os.environ["JAX_PLATFORMS"] = "cpu"
        jax = sys.modules.get("jax")
        if jax is not None and not jax.config.jax_platforms:  # read when its backends start
            jax.config.update("jax_platforms", "cpu")

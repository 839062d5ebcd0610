"""The CUDA toolchain that compiles the lab's GPU kernels: which ptxas, which CUDA runtime,
which JAX CUDA plugin, and the releases whose ptxas is known to miscompile the lab's kernels.

Why it is recorded: a GPU kernel's registers, spills and even its correctness are the
compiler's, not only the source's. XLA and Mosaic GPU hand their PTX to ptxas (the one in the
folder jax passes XLA as `xla_gpu_cuda_data_dir`, else on PATH), so a kernel table, a plan or
a benchmark record that does not name the ptxas it came from cannot be compared with another.

Why it is checked: ptxas of CUDA 12.8.0 up to (not including) 12.9.1 miscompiles the masked
wgmma code of a causal Mosaic GPU attention kernel; JAX's own Mosaic GPU attention
(jax/experimental/pallas/ops/gpu/attention_mgpu.py) refuses causal masking on those runtimes
for that reason. `jax[cuda12]` can install such a toolchain, so the lab checks the same range
before it compiles its own (lab/kernels/attention/pallas_mgpu.py).

Which version counts: ptxas's own (`ptxas --version`), and nvJitLink's where its library is
installed (`nvidia-nvjitlink-cu12` / `nvidia-nvjitlink`): XLA's compilation provider, which
Mosaic GPU uses too, prefers libnvJitLink to the ptxas binary when it loads, and nvJitLink
carries the same PTX assembler as the ptxas of its release. Either one in the range is a
problem. Only where neither is found (a GPU machine that compiles through the driver) the CUDA
runtime that jax's plugin loaded counts. The runtime reports no update number, so 12.9 from it
counts as 12.9.0, as JAX's own check counts it.
"""

import dataclasses
import functools
import os
import re
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

# CUDA releases [first, end) whose ptxas miscompiles causal-masked wgmma attention code.
CAUSAL_WGMMA_MISCOMPILED = ((12, 8, 0), (12, 9, 1))
FIXED_IN = ".".join(map(str, CAUSAL_WGMMA_MISCOMPILED[1]))  # '12.9.1', for messages

# ptxas prints its build ("release 12.9, V12.9.86"), not the CUDA update it shipped in. The
# first build of each update of the releases the range needs; NVIDIA's nvcc wheels carry the
# same numbers (nvidia-cuda-nvcc-cu12 12.9.86 is CUDA 12.9.1, 12.8.61 is 12.8.0).
_UPDATE_BUILDS = {(12, 8): ((61, 0), (93, 1)), (12, 9): ((41, 0), (86, 1))}
_PLUGINS = ("jax-cuda13-plugin", "jax-cuda12-plugin")
_NVJITLINK = ("nvidia-nvjitlink", "nvidia-nvjitlink-cu12")  # CUDA 13's wheel, CUDA 12's


def _dist_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cuda_root() -> str | None:
    """The folder jax hands XLA as xla_gpu_cuda_data_dir ($CUDA_ROOT, else NVIDIA's wheels)."""
    from jax._src import lib  # private: exactly what jax passes to XLA, on 0.10 and newer

    path = getattr(lib, "cuda_path", None)
    return None if path in (None, "None") else str(path)


def ptxas_path() -> str | None:
    """The ptxas XLA will run: <cuda_root>/bin/ptxas, else PATH, else /usr/local/cuda."""
    root = cuda_root()
    candidates = [Path(root, "bin", "ptxas")] if root else []
    candidates += [Path(p) for p in filter(None, [shutil.which("ptxas")])]
    candidates += [Path("/usr/local/cuda/bin/ptxas")]
    return next((str(c) for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


def parse_ptxas_version(text: str) -> str | None:
    """'Cuda compilation tools, release 12.9, V12.9.86' → '12.9.86'."""
    m = re.search(r"\bV(\d+\.\d+\.\d+)", text)
    return m.group(1) if m else None


@functools.cache
def _ptxas_version(path: str) -> str | None:
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_ptxas_version(done.stdout + done.stderr)


def _cuda_runtime() -> str | None:
    """The CUDA runtime jax's plugin loaded ('12.9'), None without a plugin or a runtime."""
    try:
        from jax._src.lib import cuda_versions  # private: what JAX's own kernels check
    except ImportError:
        return None
    if cuda_versions is None:
        return None
    try:
        v = int(cuda_versions.cuda_runtime_get_version())  # 1000 * major + 10 * minor
    except Exception:  # noqa: BLE001 — no runtime library loadable: nothing to report
        return None
    return f"{v // 1000}.{v % 1000 // 10}" if v > 0 else None


def release_of_ptxas(version: str) -> tuple[int, int, int]:
    """The CUDA release a ptxas build shipped in: '12.9.86' → (12, 9, 1); builds of releases
    whose updates the lab does not list count as update 0."""
    major, minor, build = (int(x) for x in version.split("."))
    update = 0
    for first_build, u in _UPDATE_BUILDS.get((major, minor), ()):
        if build >= first_build:
            update = u
    return major, minor, update


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """The CUDA compiler and runtime this process compiles GPU kernels with."""

    ptxas: str | None  # its version as it prints it ('12.9.86'); None where none is found
    ptxas_path: str | None
    cuda_runtime: str | None  # the runtime jax's CUDA plugin loaded ('12.9'), if any
    cuda_plugin: str | None  # 'jax-cuda13-plugin 0.10.2', if installed
    nvjitlink: str | None = None  # the nvJitLink wheel's version ('12.8.93'), if installed

    def compilers(self) -> list[tuple[str, tuple[int, int, int]]]:
        """(name, CUDA release) of each PTX assembler that may compile kernels here: ptxas
        and nvJitLink where found, else the runtime's (update 0); empty when none is."""
        out = []
        for name, version in (("ptxas", self.ptxas), ("nvJitLink", self.nvjitlink)):
            if version:
                out.append((f"{name} {version}", release_of_ptxas(version)))
        if not out and self.cuda_runtime:
            major, minor = (int(x) for x in self.cuda_runtime.split("."))
            out.append((f"CUDA runtime {self.cuda_runtime} (no ptxas found)", (major, minor, 0)))
        return out

    @property
    def release(self) -> tuple[int, int, int] | None:
        """The CUDA release that compiles kernels here: the oldest of ptxas's and nvJitLink's,
        else the runtime's."""
        found = [r for _, r in self.compilers()]
        return min(found) if found else None

    @property
    def compiler(self) -> str:
        """'ptxas 12.8.61 (CUDA 12.8.0)' (and nvJitLink's, where installed), or the runtime
        where neither is found."""
        parts = []
        for name, r in self.compilers():
            if name.startswith("CUDA runtime"):
                parts.append(name)
                continue
            known = r[:2] in _UPDATE_BUILDS  # else the build does not say the update
            parts.append(f"{name} (CUDA {'.'.join(map(str, r if known else r[:2]))})")
        return " and ".join(parts) or "no CUDA toolchain"

    def record(self) -> dict:
        """The fields every record carries (lab/measure/records.py)."""
        return {
            "ptxas_version": self.ptxas,
            "nvjitlink_version": self.nvjitlink,
            "cuda_runtime_version": self.cuda_runtime,
            "cuda_plugin_version": self.cuda_plugin,
        }

    @classmethod
    def from_record(cls, r: dict) -> "Toolchain":
        """The toolchain of a `record()` (a summary.json's, say). A record keeps no path, so
        `ptxas_path` is None: what is read back names versions, not where they were found."""
        return cls(
            ptxas=r.get("ptxas_version"),
            ptxas_path=None,
            cuda_runtime=r.get("cuda_runtime_version"),
            cuda_plugin=r.get("cuda_plugin_version"),
            nvjitlink=r.get("nvjitlink_version"),
        )


@functools.cache
def probe() -> Toolchain:
    """This process's toolchain, found once (the ptxas and the plugin do not change while it
    runs). Tests replace this function to fake a version."""
    path = ptxas_path()
    plugin = next(((d, v) for d in _PLUGINS if (v := _dist_version(d))), None)
    return Toolchain(
        ptxas=_ptxas_version(path) if path else None,
        ptxas_path=path,
        cuda_runtime=_cuda_runtime() if plugin else None,
        cuda_plugin=f"{plugin[0]} {plugin[1]}" if plugin else None,
        nvjitlink=next(filter(None, map(_dist_version, _NVJITLINK)), None) if plugin else None,
    )


def miscompiling(tc: Toolchain) -> list[str]:
    """The compilers of `tc` whose release is in CAUSAL_WGMMA_MISCOMPILED, as text
    ('nvJitLink 12.8.93 (CUDA 12.8.1)'); empty when none is (or none is found)."""
    first, end = CAUSAL_WGMMA_MISCOMPILED
    out = []
    for name, r in tc.compilers():
        if first <= r < end:
            known = r[:2] in _UPDATE_BUILDS and not name.startswith("CUDA runtime")
            out.append(name if not known else f"{name} (CUDA {'.'.join(map(str, r))})")
    return out


def miscompiles_causal_wgmma(tc: Toolchain) -> bool:
    """Whether a compiler of `tc` is in CAUSAL_WGMMA_MISCOMPILED (unknown: no, none runs)."""
    return bool(miscompiling(tc))


def range_text() -> str:
    """'CUDA 12.8.0 up to 12.9.1' for messages."""
    first, end = CAUSAL_WGMMA_MISCOMPILED
    return f"CUDA {'.'.join(map(str, first))} up to {'.'.join(map(str, end))}"

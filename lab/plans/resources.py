"""What every GPU kernel of a compiled program uses, read from the compiler: registers, spills,
shared memory, threads, grid, and the blocks per SM those allow.

`compile_with_kernels` compiles with two per-compile options, `xla_dump_to` (a temporary folder)
and `xla_dump_emitter_re="ptx"` (newer jax writes the per-kernel .ptx only with it), so nothing
has to be set before JAX starts. The dump's `*thunk_sequence.txt` holds every launch's grid,
threads per block and dynamic shared memory; `ptxas -v` on each .ptx, with the ptxas XLA itself
uses, gives registers, spill bytes, stack and static shared memory (the same figures XLA logs
for its own ptxas run). Mosaic GPU kernels are compiled by their custom call, not by XLA,
during lowering on jax 0.10 and during XLA's compile on newer JAX. The lowering runs with
`MOSAIC_GPU_DUMP_TO` set: on jax 0.10 that dumps every stage of every kernel (jaxlib's dump.cc
turns on all of MOSAIC_GPU_DUMP_PTXAS, _PTX, _MLIR_PASSES and _SASS: the ptxas `-v` log, the
PTX, the IR after every pass with its `gpu.launch`, SASS through nvdisasm), and on newer JAX a
few small files, among them the module with its `gpu.launch` (grid, threads, dynamic shared
memory). XLA's compile runs with only `MOSAIC_GPU_DUMP_PTXAS` and `_PTX` set and no folder:
Mosaic prints each kernel's PTX and ptxas log to stdout, which is read from file descriptor 1
for the compile. A folder there would also print the IR after every pass (tens of MB a kernel)
and disassemble the SASS, several times the kernel's own compile time. The folders the SASS
dump leaves under /tmp are removed. Nothing here runs a kernel: every figure is *compiled, not
run*.
"""

import contextlib
import ctypes
import dataclasses
import glob
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lab.errors import ConfigError
from lab.measure import hlo
from lab.measure.gpu_kernels import Kernel
from lab.plans import gpu as gpus

# Occupancy rules of compute capability 8.x/9.x (CUDA Programming Guide, occupancy calculator):
# registers are allocated per warp in units of 256, shared memory in units of 128 bytes, and the
# driver reserves 1 KiB of shared memory per resident block.
MAX_BLOCKS_PER_SM = 32
MAX_WARPS_PER_SM = 64
REG_ALLOC_UNIT = 256
SMEM_ALLOC_UNIT = 128
SMEM_RESERVED_PER_BLOCK = 1024


def occupancy(kind: str, *, threads: int, registers: int, smem: int) -> tuple[int, str, float]:
    """(blocks per SM, the limiting resource, warp occupancy), as the CUDA occupancy calculator."""
    g = gpus.GPUS[kind]
    warps = math.ceil(threads / 32)
    if threads > 1024:
        return 0, "threads > 1024", 0.0
    if smem > g.smem_per_block:
        return 0, f"smem > {g.smem_per_block}", 0.0
    regs_per_warp = math.ceil(max(registers, 1) * 32 / REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    if regs_per_warp * warps > g.regs_per_sm:
        return 0, "registers > block limit", 0.0
    smem_block = math.ceil(smem / SMEM_ALLOC_UNIT) * SMEM_ALLOC_UNIT + SMEM_RESERVED_PER_BLOCK
    limits = {
        "regs": (g.regs_per_sm // regs_per_warp) // warps,
        "smem": g.smem_per_sm // smem_block,
        "warps": MAX_WARPS_PER_SM // warps,
        "blocks": MAX_BLOCKS_PER_SM,
    }
    limiter = min(limits, key=limits.get)  # dicts keep order: regs first on a tie
    return limits[limiter], limiter, limits[limiter] * warps / MAX_WARPS_PER_SM


def _kernel(kind, name, launches, grid, threads, dynamic_smem, st) -> Kernel:
    smem = st["static_smem"] + dynamic_smem
    blocks, limiter, occ = occupancy(kind, threads=threads, registers=st["registers"], smem=smem)
    return Kernel(
        name=name,
        launches=launches,
        grid=grid,
        threads=threads,
        registers=st["registers"],
        spill_store_bytes=st["spill_store_bytes"],
        spill_load_bytes=st["spill_load_bytes"],
        stack_bytes=st["stack_bytes"],
        static_smem=st["static_smem"],
        dynamic_smem=dynamic_smem,
        blocks_per_sm=blocks,
        limiter=limiter,
        occupancy=occ,
        notes=st.get("notes", ()),
    )


# ------------------------------------------------------------------------------- ptxas


def parse_ptxas(log: str, ptx: str = "") -> dict[str, dict]:
    """`ptxas -v` output → {entry: registers, spills, stack, static smem, notes}."""
    out, notes, props = {}, {}, {}
    current = func = None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '([^']+)'", line):
            current = m.group(1)
        elif m := re.search(r"Function properties for (\S+)", line):
            func = m.group(1)
        elif m := re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line
        ):
            props[func] = tuple(int(x) for x in m.groups())
        elif (m := re.search(r"Used (\d+) registers", line)) and current:
            smem = re.search(r"(\d+) bytes smem", line)
            stack, stores, loads = props.get(current, (0, 0, 0))
            out[current] = dict(
                registers=int(m.group(1)),
                stack_bytes=stack,
                spill_store_bytes=stores,
                spill_load_bytes=loads,
                static_smem=int(smem.group(1)) if smem else 0,
            )
        elif "Potential Performance Loss" in line:
            where = re.search(r"in the function '([^']+)'", line)
            code = re.search(r"\((C\d+)\)", line)
            if where:
                notes.setdefault(where.group(1), []).append(code.group(1) if code else "remark")
    for name, found in notes.items():
        if name in out:
            out[name]["notes"] = tuple(found)
    for m in re.finditer(r"\.entry\s+(\w+)\s*\(", ptx):  # threads of kernels with no launch
        header = ptx[m.end() : ptx.find("{", m.end())]
        ntid = re.search(r"\.(?:reqntid|maxntid)\s+([\d, ]+)", header)
        if ntid and m.group(1) in out:
            out[m.group(1)]["ptx_threads"] = math.prod(int(x) for x in ntid.group(1).split(","))
    return out


def _run_ptxas(paths: list[str]) -> dict[str, dict]:
    exe = gpus.ptxas()
    if exe is None:
        raise ConfigError(f"reading GPU kernel resources needs ptxas: {gpus.INSTALL}")

    def one(path):
        text = Path(path).read_text()
        target = re.search(r"^\.target\s+(\w+)", text, re.M)
        if not target or ".entry" not in text:
            return {}
        cmd = [exe, "-v", f"--gpu-name={target.group(1)}", path, "-o", os.devnull]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"ptxas failed on {path}: {done.stderr.strip()[:300]}")
        return parse_ptxas(done.stdout + done.stderr, text)

    out: dict[str, dict] = {}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for found in pool.map(one, paths):
            out.update(found)
    return out


# ------------------------------------------------------------------------------- dumps

_LAUNCH = re.compile(
    r"(?P<name>[\w.\-$]+) grid: \[(?P<g>[\d, ]+)\] threads: \[(?P<t>[\d, ]+)\]\s+"
    r"shared_memory: (?P<smem>\d+) bytes"
)


_THUNK = re.compile(r"^(?P<indent> *)(?P<id>\d+): (?P<kind>\w+)")
_WHILE_THUNK = re.compile(
    r'profile_annotation: "(?P<name>[^"]+)"\s*thunk_id: (?P<id>\d+)\s*\}\s*thunk_kind: "kWhile"'
)


def while_thunk_trips(metadata: str, hlo_text: str) -> dict[int, int | None]:
    """{thunk id of every kWhile: its trip count, None where the program does not state it}:
    the thunk metadata names each while thunk's HLO instruction (`while.2`), whose trip count
    the optimized HLO gives (lab.measure.hlo, as the compiled FLOPs count their loops)."""
    trips = hlo.parse(hlo_text).trips if hlo_text else {}
    return {int(m["id"]): trips.get(m["name"]) for m in _WHILE_THUNK.finditer(metadata)}


def thunk_launches(sequence: str, trips: dict[int, int | None]) -> list[tuple[dict, int, bool]]:
    """Every kernel launch line of a thunk sequence as (its launch, launches per call, whether
    an enclosing loop's trip count is unknown). A while thunk's condition and body are the lines
    indented under it: a body runs its trip count times, a condition once more, nested loops
    multiply; a loop of unknown trip count is counted once."""
    out = []
    loops: list[list] = []  # [indent, trips or None, in the condition]
    for line in sequence.splitlines():
        label = line.strip()
        if label in ("condition:", "body:") and loops:
            loops[-1][2] = label == "condition:"
            continue
        m = _THUNK.match(line)
        if not m:
            continue
        indent = len(m["indent"])
        while loops and loops[-1][0] >= indent:
            loops.pop()
        if m["kind"] == "kWhile":
            loops.append([indent, trips.get(int(m["id"])), False])
            continue
        if launch := _LAUNCH.search(line):
            n = math.prod((t or 1) + cond for _, t, cond in loops)
            out.append((launch, n, any(t is None for _, t, _ in loops)))
    return out


def _read(pattern: str) -> str:
    return "".join(Path(p).read_text() for p in sorted(glob.glob(pattern)))


def xla_kernels(dump_dir: str, kind: str) -> list[Kernel]:
    """XLA's and Pallas Triton's kernels of a dump: launches per call from the thunk sequence
    (each multiplied by the trip counts of the loops around it: a scanned model launches its
    layer's kernels once per layer), figures from ptxas on each .ptx."""
    launches: dict[str, dict] = {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt"))):
        module = path[: -len("thunk_sequence.txt")]
        trips = while_thunk_trips(
            _read(module + "thunk_metadata.txt"), _read(module + "*gpu_after_optimizations.txt")
        )
        for m, n, unknown in thunk_launches(Path(path).read_text(), trips):
            grid = tuple(int(x) for x in m.group("g").split(","))
            threads = math.prod(int(x) for x in m.group("t").split(","))
            entry = launches.setdefault(
                m.group("name"),
                dict(grid=grid, threads=threads, smem=int(m["smem"]), n=0, unknown=False),
            )
            entry["n"] += n
            entry["unknown"] |= unknown
    stats = _run_ptxas(sorted(glob.glob(os.path.join(dump_dir, "*.ptx"))))
    out = []
    for name, launch in launches.items():
        st = stats.get(name) or stats.get(name.replace(".", "_"))
        if st is not None:
            k = _kernel(
                kind, name, launch["n"], launch["grid"], launch["threads"], launch["smem"], st
            )
            out.append(dataclasses.replace(k, launches_unknown_loop=launch["unknown"]))
    return out


def _mosaic_launch(log: str) -> tuple:
    """(grid, threads per block, dynamic smem) of the first gpu.launch of a Mosaic GPU
    mlir-passes log, its constants resolved in the same IR dump."""
    for section in log.split("// -----// IR Dump"):
        launch = re.search(
            r"gpu\.launch\b[^\n]*?blocks\([^)]*\) in \(([^)]*)\) threads\([^)]*\) in \(([^)]*)\)"
            r"[^\n]*?dynamic_shared_memory_size (%[\w]+)",
            section,
        )
        if not launch:
            continue
        consts = {k: int(v) for k, v in re.findall(r"(%[\w]+) = arith\.constant (\d+)", section)}
        dims = [
            [consts.get(v.split("=")[1].strip()) for v in group.split(",")]
            for group in (launch.group(1), launch.group(2))
        ]
        if any(d is None for d in dims[0] + dims[1]):
            continue
        return tuple(dims[0]), math.prod(dims[1]), consts.get(launch.group(3))
    return None, None, None


def _dumped_launch(base: str, module: str) -> tuple:
    """(grid, threads, dynamic smem) from the Mosaic dump `base + module` (a module holding
    the `gpu.launch`), the smem from `base.resources.txt` (jax 0.12+) where it has none."""
    path, resources = Path(base + module), Path(base + ".resources.txt")
    grid, threads, smem = _mosaic_launch(path.read_text() if path.exists() else "")
    if smem is None and resources.exists():
        m = re.search(r"smem_scratch_bytes=(\d+)", resources.read_text())
        smem = int(m.group(1)) if m else None
    return grid, threads, smem


def _mosaic_kernel(kind: str, name: str, st: dict, launch: tuple) -> Kernel:
    grid, threads, smem = launch
    return _kernel(kind, name, None, grid, threads or st.get("ptx_threads", 0), smem or 0, st)


def mosaic_kernels(dump_dir: str, kind: str, printed: str = "") -> list[Kernel]:
    """Mosaic GPU kernels of a compile. Those compiled while lowering (jax 0.10) are read from
    their MOSAIC_GPU_DUMP_TO folder `dump_dir`: ptxas log, PTX, and the launch from the MLIR
    passes log. Those compiled by XLA's compile (newer JAX) are read from what Mosaic printed
    then (`printed`: each kernel's PTX, then ptxas's log on it), with the launch from the
    module the lowering left in `dump_dir` (`<name>_<count>.before_layout_inference.txt`),
    matched by kernel name, in order."""
    out = []
    for ptxas_file in sorted(glob.glob(os.path.join(dump_dir, "*.ptxas"))):
        base = ptxas_file[: -len(".ptxas")]
        ptx = Path(base + ".ptx").read_text() if os.path.exists(base + ".ptx") else ""
        launch = _dumped_launch(base, ".mlir-passes.log")
        for name, st in parse_ptxas(Path(ptxas_file).read_text(), ptx).items():
            out.append(_mosaic_kernel(kind, name, st, launch))
    lowered: dict[str, list[tuple]] = {}  # kernel name → its launches, in lowering order
    bases = {  # `<kernel name>_<count>`, the count Mosaic's dump gives each module
        re.sub(r"\.(resources|before_layout_inference)\.txt$", "", f)
        for pattern in ("*.resources.txt", "*.before_layout_inference.txt")
        for f in glob.glob(os.path.join(dump_dir, pattern))
    }
    for base in sorted(bases, key=lambda b: int(re.sub(r".*?(\d*)$", r"0\1", b, count=1))):
        name = re.sub(r"_\d+$", "", os.path.basename(base))
        lowered.setdefault(name, []).append(_dumped_launch(base, ".before_layout_inference.txt"))
    for chunk in re.split(r"(?m)^(?=//\n// Generated by LLVM NVPTX)", printed):
        for name, st in parse_ptxas(chunk, chunk).items():
            seen = lowered.get(name.removesuffix("_mosaic_gpu_kernel")) or [(None, None, None)]
            out.append(_mosaic_kernel(kind, name, st, seen.pop(0) if len(seen) > 1 else seen[0]))
    return out


@contextlib.contextmanager
def _env(name: str, value: str | None):
    """`name` set to `value` (None: unset) during the block."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def _native_stdout():
    """What native code writes to file descriptor 1 during the block, as `text[0]` after it.
    Mosaic prints its dumps there when no dump folder is set. Python's own output (a progress
    bar's thread, print) keeps going where it went: sys.stdout is pointed at a copy of the old
    descriptor for the block."""
    text = [""]
    sys.stdout.flush()
    try:
        python_uses_fd1 = sys.stdout.fileno() == 1
    except (AttributeError, OSError, ValueError):  # pytest's capture, a StringIO
        python_uses_fd1 = False
    saved = os.dup(1)
    old_stdout = sys.stdout
    sink = tempfile.TemporaryFile()
    os.dup2(sink.fileno(), 1)
    if python_uses_fd1:
        sys.stdout = open(os.dup(saved), "w", buffering=1, encoding=old_stdout.encoding)
    try:
        yield text
    finally:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).fflush(None)  # C stdio's buffer, before fd 1 goes back
        if python_uses_fd1:
            sys.stdout.close()
            sys.stdout = old_stdout
        os.dup2(saved, 1)
        os.close(saved)
        sink.seek(0)
        text[0] = sink.read().decode(errors="replace")
        sink.close()


@contextlib.contextmanager
def _sass_scratch_removed(root: str = "/tmp"):
    """Removes the folders Mosaic's SASS dump leaves behind during the block. With
    MOSAIC_GPU_DUMP_TO set, every Mosaic kernel is also disassembled: its binary is written
    to a new `/tmp/mosaic-gpu-XXXXXX/kernel.bin` for nvdisasm, and the folder is never removed
    (jaxlib/mosaic/gpu/dump.cc), about 250 KB a kernel. Only folders that appeared during the
    block and hold that one file are removed. Another process compiling Mosaic kernels with
    SASS dumps at the same moment may lose its scratch too: its SASS dump then fails, and the
    lab reads no SASS."""
    pattern = os.path.join(root, "mosaic-gpu-*")
    before = set(glob.glob(pattern))
    try:
        yield
    finally:
        for folder in set(glob.glob(pattern)) - before:
            with contextlib.suppress(OSError):
                if os.listdir(folder) == ["kernel.bin"]:
                    shutil.rmtree(folder)


def compile_with_kernels(lower, kind: str):
    """(compiled, kernels): `lower()` → a jax Lowered, compiled for the GPU `kind` with every
    kernel's resources read from the compiler (the module's docstring says how). `lower` runs
    inside the caller's mesh."""
    tmp = tempfile.mkdtemp(prefix="lab-gpu-")
    xla_dir, mosaic_dir = os.path.join(tmp, "xla"), os.path.join(tmp, "mosaic")
    os.makedirs(mosaic_dir)
    options = {"xla_dump_to": xla_dir, "xla_dump_emitter_re": "ptx"}
    try:
        with _env("MOSAIC_GPU_DUMP_TO", mosaic_dir), _sass_scratch_removed():
            lowered = lower()
        with (
            _env("MOSAIC_GPU_DUMP_TO", None),
            _env("MOSAIC_GPU_DUMP_PTX", "1"),
            _env("MOSAIC_GPU_DUMP_PTXAS", "1"),
            _native_stdout() as printed,
        ):
            compiled = lowered.compile(compiler_options=options)
        if not glob.glob(os.path.join(xla_dir, "*thunk_sequence.txt")):
            raise RuntimeError(
                "XLA wrote no dump: the executable came from jax's persistent compilation "
                "cache; turn it off (jax_enable_compilation_cache=false) to read kernels"
            )
        kernels = xla_kernels(xla_dir, kind) + mosaic_kernels(mosaic_dir, kind, printed[0])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return compiled, kernels


def as_dicts(kernels: list[Kernel]) -> list[dict]:
    """The kernels as summary.json holds them (Kernel.record)."""
    return [k.record() for k in kernels]

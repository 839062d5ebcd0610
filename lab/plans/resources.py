"""What every GPU kernel of a compiled program uses, read from the compiler: registers, spills,
shared memory, threads, grid, and the blocks per SM those allow.

`compile_with_kernels` compiles with two per-compile options, `xla_dump_to` (a temporary folder)
and `xla_dump_emitter_re="ptx"` (newer jax writes the per-kernel .ptx only with it), so nothing
has to be set before JAX starts. The dump's `*thunk_sequence.txt` holds every launch's grid,
threads per block and dynamic shared memory; `ptxas -v` on each .ptx, with the ptxas XLA itself
uses, gives registers, spill bytes, stack and static shared memory (the same figures XLA logs
for its own ptxas run). Mosaic GPU kernels are compiled by their custom call, not by XLA,
during XLA's compile. With jaxlib 0.11.1 and newer the lowering runs with `MOSAIC_GPU_DUMP_TO`
set, which writes a few small files, among them each module with its `gpu.launch` (grid,
threads, dynamic shared memory), and XLA's compile runs with only `MOSAIC_GPU_DUMP_PTXAS` and
`_PTX` on (the IR and SASS dumps off, whatever the environment says) and no folder: Mosaic
prints each kernel's PTX and ptxas log to stdout, which is read from file descriptor 1 for the
compile. A folder there would turn on every dump (jaxlib's dump.cc: the IR after every pass,
tens of MB a kernel, and SASS through nvdisasm), several times the kernel's own compile time.
Older jaxlib dumps no launch while lowering, so there the folder stays set for the compile and
every dump is read from it (the launch from the pass log). Mosaic compiles a kernel once per
process: where jax reuses a lowering made earlier (no dump is written then) its caches are
cleared and the program lowered again, and a kernel lowered but not compiled again is the one
read the first time (on older jaxlib, the one whose custom call carries the same kernel hash).
The folders the SASS dump leaves under /tmp are removed. Nothing here runs a kernel: every
figure is *compiled, not run*.
"""

import contextlib
import ctypes
import dataclasses
import glob
import hashlib
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
from lab.report import progress

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
    if threads < 1:  # a kernel whose launch and PTX were not both dumped
        return 0, "threads unknown", 0.0
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


# Mosaic GPU kernels read in this process, by the digest of their lowered module: Mosaic keeps
# every kernel it compiled and compiles (and prints) it only once per process, so a later
# program holding the same kernel is read from here.
_MOSAIC_READ: dict[str, Kernel] = {}


def _module_digest(base: str) -> str | None:
    """The lowered module's identity: its dump less the dump's own name for it."""
    path = Path(base + ".before_layout_inference.txt")
    if not path.exists():
        return None
    text = re.sub(r'mosaic_gpu\.dump_basename = "[^"]*"', "", path.read_text())
    return hashlib.sha256(text.encode()).hexdigest()


# jaxlib before 0.11.1, which dumps a kernel only as it compiles it, in XLA's compile: the
# kernels read in this process by the kernel hashes their custom calls carry (all the hashes
# of one kernel name together), for a later program that calls the same ones (Mosaic compiles
# a kernel once a process, and dumps nothing then).
_MOSAIC_BY_HASH: dict[tuple[str, ...], list[Kernel]] = {}


def _kernel_name(op_name: str) -> str | None:
    """A Mosaic kernel's name in its call's op_name: the last part, Pallas's `mpmd_map` or
    `pallas_call` aside, out of the transforms' wrappers (`transpose(jvp(name))`)."""
    parts = [p for p in op_name.split("/") if p not in ("mpmd_map", "pallas_call")]
    if not parts:
        return None
    name = parts[-1]
    while (inner := re.fullmatch(r"[\w.-]+\((.*)\)", name)) is not None:
        name = inner[1]
    return name or None


def mosaic_calls(xla_dir: str) -> dict[str, list[str]]:
    """The Mosaic GPU kernels the program XLA dumped calls: each kernel's name
    (`_kernel_name`) → the kernel hashes of its calls, each once, in program order."""
    out: dict[str, list[str]] = {}
    for path in glob.glob(os.path.join(xla_dir, "*after_optimizations.txt")):
        with open(path, errors="replace") as f:
            for line in f:
                if 'custom_call_target="mosaic_gpu' not in line:
                    continue
                op = re.search(r'op_name="([^"]*)"', line)
                digest = re.search(r'kernel_hash = "((?:[^"\\]|\\.)*)"', line)
                name = _kernel_name(op[1]) if op is not None else None
                if name is None or digest is None:
                    continue
                hashes = out.setdefault(name, [])
                if digest[1] not in hashes:
                    hashes.append(digest[1])
    return out


def mosaic_kernels(
    dump_dir: str, kind: str, printed: str = "", calls: dict[str, list[str]] | None = None
) -> list[Kernel]:
    """Mosaic GPU kernels of a compile. Those compiled while lowering (jax 0.10) are read from
    their MOSAIC_GPU_DUMP_TO folder `dump_dir`: ptxas log, PTX, and the launch from the MLIR
    passes log; `calls` (`mosaic_calls` of the program) names the ones the program calls, so
    that one compiled by an earlier program of this process (not dumped again) is the one read
    then. Those compiled by XLA's compile (newer JAX) are read from what Mosaic printed
    then (`printed`: each kernel's PTX, then ptxas's log on it), with the launch from the
    module the lowering left in `dump_dir` (`<name>_<count>.before_layout_inference.txt`),
    matched by kernel name (two of one name: by threads, else in lowering order). A lowered
    kernel Mosaic did not compile again (it had in this process) is the one read then."""
    out = []
    dumped: dict[str, list[Kernel]] = {}  # by the name in the dump's `<name>_<count>`
    for ptxas_file in sorted(glob.glob(os.path.join(dump_dir, "*.ptxas"))):
        base = ptxas_file[: -len(".ptxas")]
        ptx = Path(base + ".ptx").read_text() if os.path.exists(base + ".ptx") else ""
        launch = _dumped_launch(base, ".mlir-passes.log")
        for name, st in parse_ptxas(Path(ptxas_file).read_text(), ptx).items():
            out.append(_mosaic_kernel(kind, name, st, launch))
            dumped.setdefault(re.sub(r"_\d+$", "", os.path.basename(base)), []).append(out[-1])
    for name, hashes in (calls or {}).items():
        now, key = dumped.get(name, []), tuple(hashes)
        if len(now) == len(hashes):  # every kernel of this name dumped now: kept together
            _MOSAIC_BY_HASH[key] = now
        elif not now:  # dumped by none: compiled by earlier programs of this process
            known = _MOSAIC_BY_HASH.get(key) or [
                k for h in hashes for k in _MOSAIC_BY_HASH.get((h,), [])
            ]
            out += known
        # (some dumped now, some earlier: which is which cannot be told; those now are listed)
    lowered: dict[str, list[tuple]] = {}  # name → [(launch, module digest)], lowering order
    bases = {  # `<kernel name>_<count>`, the count Mosaic's dump gives each module
        re.sub(r"\.(resources|before_layout_inference)\.txt$", "", f)
        for pattern in ("*.resources.txt", "*.before_layout_inference.txt")
        for f in glob.glob(os.path.join(dump_dir, pattern))
    }
    for base in sorted(bases, key=lambda b: int(re.sub(r".*?(\d*)$", r"0\1", b, count=1))):
        name = re.sub(r"_\d+$", "", os.path.basename(base))
        launch = _dumped_launch(base, ".before_layout_inference.txt")
        lowered.setdefault(name, []).append((launch, _module_digest(base)))
    for chunk in re.split(r"(?m)^(?=//\n// Generated by LLVM NVPTX)", printed):
        for name, st in parse_ptxas(chunk, chunk).items():
            if "ptx_threads" not in st:  # two compiles' prints interleaved: any PTX of it
                st = parse_ptxas(chunk, printed)[name]
            seen = lowered.get(name.removesuffix("_mosaic_gpu_kernel"), [])
            # two kernels of one name: the launch whose threads are the PTX's, else in order
            same = [i for i, (launch, _) in enumerate(seen) if launch[1] == st.get("ptx_threads")]
            i = same[0] if same else 0
            launch, digest = seen.pop(i) if seen else ((None, None, None), None)
            out.append(_mosaic_kernel(kind, name, st, launch))
            if digest is not None:
                _MOSAIC_READ[digest] = out[-1]
    for left in lowered.values():  # lowered, not compiled now: compiled before in this process
        out += [_MOSAIC_READ[d] for _, d in left if d in _MOSAIC_READ]
    return out


def _calls_mosaic(xla_dir: str) -> bool:
    """Whether the program XLA dumped calls a Mosaic GPU kernel."""
    for path in glob.glob(os.path.join(xla_dir, "*after_optimizations.txt")):
        with open(path, errors="replace") as f:
            if any('custom_call_target="mosaic_gpu' in line for line in f):
                return True
    return False


def lowering_dumped(dump_dir: str) -> bool:
    """Whether a lowering wrote Mosaic dumps into `dump_dir` (newer JAX: a module's launch and
    resources; jax 0.10: whole kernels)."""
    return any(
        glob.glob(os.path.join(dump_dir, f"*{end}"))
        for end in (".before_layout_inference.txt", ".resources.txt", ".ptxas")
    )


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


def _flush_c_stdio() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)  # what native code printed and C stdio still holds


@contextlib.contextmanager
def _native_stdout():
    """What native code writes to file descriptor 1 during the block, as `text[0]` after it.
    Mosaic prints its dumps there when no dump folder is set. Python's sys.stdout (print, a
    progress bar that writes through it) is pointed at a copy of the old descriptor for the
    block, wrapped as it was; anything holding the old stream object or descriptor 1 itself
    (another thread's native code, a subprocess) writes into the capture instead. Whatever
    happens in the block, descriptor 1 and sys.stdout are put back."""
    text = [""]
    old_stdout = sys.stdout
    try:
        saved = os.dup(1)
    except OSError:  # no descriptor 1 (a daemon): Mosaic's prints go nowhere, none to read
        yield text
        return
    python_uses_fd1 = False
    with contextlib.suppress(AttributeError, OSError, ValueError):  # pytest's capture, None
        python_uses_fd1 = old_stdout.fileno() == 1
    sink = None
    try:
        with contextlib.suppress(AttributeError, OSError, ValueError):
            old_stdout.flush()
        _flush_c_stdio()  # printed before the block: it goes where it was meant to
        sink = tempfile.TemporaryFile()
        os.dup2(sink.fileno(), 1)
        if python_uses_fd1:
            new = open(  # noqa: SIM115 - closed in the finally, after sys.stdout is back
                os.dup(saved),
                "w",
                buffering=1,
                encoding=getattr(old_stdout, "encoding", None) or "utf-8",
                errors=getattr(old_stdout, "errors", None) or "strict",
            )
            sys.stdout = progress.wrapped_like(old_stdout, new)
        yield text
    finally:
        _flush_c_stdio()
        replaced = sys.stdout if sys.stdout is not old_stdout else None
        sys.stdout = old_stdout
        os.dup2(saved, 1)
        os.close(saved)
        if replaced is not None:
            with contextlib.suppress(Exception):  # a reader gone: nothing more to say to it
                replaced.flush()
            with contextlib.suppress(Exception):
                replaced.close()
        if sink is not None:
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


# Mosaic's dumps that cost the most and that the lab does not read: off for XLA's compile,
# whatever the environment says (each would also print into what the compile reads)
_DUMPS_OFF = (
    "MOSAIC_GPU_DUMP_TO",
    "MOSAIC_GPU_DUMP_MLIR_PASSES",
    "MOSAIC_GPU_DUMP_SASS",
    "MOSAIC_GPU_DUMP_SASS_CTRL",
    "MOSAIC_GPU_DUMP_LLVM",
    "MOSAIC_GPU_DUMP_HOST_LLVM",
)


def _lowering_dumps_launches() -> bool:
    """Whether this jaxlib's Mosaic GPU lowering dumps each module with its launch (0.11.1 and
    newer: `get_or_set_dump_options`); older ones dump only while compiling the kernel."""
    try:
        from jax._src.lib import mosaic_gpu_dialect
    except ImportError:
        return False
    return hasattr(mosaic_gpu_dialect, "get_or_set_dump_options")


def _compiled_printing_mosaic(lower, mosaic_dir: str, options: dict) -> tuple:
    """(compiled, what Mosaic printed during XLA's compile): the lowering with its dump folder,
    the compile with only the PTX and ptxas dumps on. Where the lowering dumps no launch
    (jaxlib before 0.11.1), the folder stays set for the compile too, with every dump."""
    if not _lowering_dumps_launches():
        with _env("MOSAIC_GPU_DUMP_TO", mosaic_dir), _sass_scratch_removed():
            return lower().compile(compiler_options=options), ""
    with _env("MOSAIC_GPU_DUMP_TO", mosaic_dir), _sass_scratch_removed():
        lowered = lower()
    with contextlib.ExitStack() as stack:
        for name in _DUMPS_OFF:
            stack.enter_context(_env(name, None))
        stack.enter_context(_env("MOSAIC_GPU_DUMP_PTX", "1"))
        stack.enter_context(_env("MOSAIC_GPU_DUMP_PTXAS", "1"))
        printed = stack.enter_context(_native_stdout())
        compiled = lowered.compile(compiler_options=options)
    return compiled, printed[0]


def compile_with_kernels(lower, kind: str):
    """(compiled, kernels): `lower()` → a jax Lowered, compiled for the GPU `kind` with every
    kernel's resources read from the compiler (the module's docstring says how). `lower` runs
    inside the caller's mesh."""
    tmp = tempfile.mkdtemp(prefix="lab-gpu-")
    xla_dir, mosaic_dir = os.path.join(tmp, "xla"), os.path.join(tmp, "mosaic")
    os.makedirs(mosaic_dir)
    options = {"xla_dump_to": xla_dir, "xla_dump_emitter_re": "ptx"}
    try:
        compiled, printed = _compiled_printing_mosaic(lower, mosaic_dir, options)
        if (
            _lowering_dumps_launches()
            and _calls_mosaic(xla_dir)
            and not lowering_dumped(mosaic_dir)
        ):
            # jax reused a lowering made earlier in this process: no dump of its Mosaic
            # launches was written this time, and without them each kernel's grid and shared
            # memory are unknown. Lowered afresh once, they are.
            import jax  # here, not at the top: `import lab` must not start JAX (lab/__init__)

            shutil.rmtree(xla_dir, ignore_errors=True)
            jax.clear_caches()
            compiled, printed = _compiled_printing_mosaic(lower, mosaic_dir, options)
        if not glob.glob(os.path.join(xla_dir, "*thunk_sequence.txt")):
            raise RuntimeError(
                "XLA wrote no dump: the executable came from jax's persistent compilation "
                "cache; turn it off (jax_enable_compilation_cache=false) to read kernels"
            )
        calls = None if _lowering_dumps_launches() else mosaic_calls(xla_dir)
        kernels = xla_kernels(xla_dir, kind) + mosaic_kernels(mosaic_dir, kind, printed, calls)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return compiled, kernels


def as_dicts(kernels: list[Kernel]) -> list[dict]:
    """The kernels as summary.json holds them (Kernel.record)."""
    return [k.record() for k in kernels]

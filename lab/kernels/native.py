"""Building the lab's native CPU kernels: C++ sources that ship in the package, compiled on first
use against the FFI headers jaxlib ships (`jax.ffi.include_dir()`), and loaded with ctypes.

The system C++ compiler (`$CXX`, else c++ / g++ / clang++) builds each source into
`~/.cache/lab-kernels/<key>/` (or `$LAB_KERNEL_CACHE`), keyed by the source, the flags, the
compiler, jaxlib's version and the host CPU; a file lock and an atomic rename let parallel test
workers share one build. `-O3 -march=native` first, falling back to a portable `-O3` build
(LAB_KERNEL_SANITIZE=1: an AddressSanitizer and UndefinedBehaviorSanitizer build instead, for
the tests). A build says one line; no compiler, or a compiler that fails every attempt: one
line on stderr and `build` returns None, so the caller keeps its JAX kernels.

Thread counts (LAB_CPU_GEMV_THREADS, LAB_CPU_FLASH_THREADS) are checked here before a kernel
runs (`threads_from_env`): a count that is not a whole number >= 1 is refused in one line,
and one above `max_threads` is cut to it (the C++ kernels cut it too, as a guard).
"""

import fcntl
import hashlib
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import jax

from lab.errors import ConfigError

FLAGS = ["-std=c++17", "-shared", "-fPIC", "-fopenmp-simd", "-fno-math-errno", "-w"]
NATIVE, PORTABLE = ["-O3", "-march=native"], ["-O3"]
# LAB_KERNEL_SANITIZE=1: AddressSanitizer and UndefinedBehaviorSanitizer builds, any error
# fatal, for the kernel tests (tests/test_sanitizers.py); the process must preload libasan.
# For the host's vector ISA first (its micro-tiles and tails are the ones users run), else
# portable. -g1: line tables, all a sanitizer's stack trace reads (file and line), at 42 s
# for both kernels on 2 cores where full debug information (-g) took 56.
SANITIZE = ["-O1", "-g1", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all"]  # fmt: skip


def compiler() -> str | None:
    """The C++ compiler to build with: $CXX, else the first of c++, g++, clang++ on PATH (a
    $CXX that is not found is passed over for them; the build line names the compiler)."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cpu_id() -> str:
    """What -march=native depends on: the machine and its CPU model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [x for x in text.splitlines() if x.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "\n" + "\n".join(lines)


def cache_root() -> Path:
    env = os.environ.get("LAB_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "lab-kernels"


def _say_building(how: str) -> None:
    print(f"lab: building {how} once (tens of seconds) …", file=sys.stderr, flush=True)


def compile_library(cxx: str, opt: list[str], source: Path, out: Path, what: str) -> str | None:
    """Build `source` into the library at `out` (atomically); the compiler's first error line,
    or None.

    A build says one line: `built … → out` once it is there. A failed attempt says nothing
    here (`build` tries the portable flags next, and says one line if every attempt fails),
    so a compiler that fails is one line, not one per attempt. On a terminal a `building …`
    status shows while the compiler runs (seconds) and is erased when it ends."""
    cmd = [cxx, *opt, *FLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o"]
    how = f"the {what} with {cxx} ({' '.join(opt)})"
    status = sys.stderr.isatty()
    if status:
        sys.stderr.write(f"lab: building {how} once …")
        sys.stderr.flush()
    # off a terminal (a log, a pipe) a line, but only once the build has taken a while: a real
    # build takes tens of seconds and a silent pause that long reads as a hang, while a
    # compiler that fails at once is the one line `build` says
    slow = None if status else threading.Timer(2.0, _say_building, (how,))
    if slow:
        slow.daemon = True
        slow.start()
    try:
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            partial = Path(tmp) / out.name
            env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # a sanitized parent
            done = subprocess.run(
                [*cmd, str(partial), "-lpthread"], capture_output=True, text=True, env=env
            )
            if done.returncode:
                errors = [x for x in done.stderr.splitlines() if "error" in x] or ["failed"]
                return errors[0].strip()
            os.replace(partial, out)
    finally:
        if slow:
            slow.cancel()
        if status:
            sys.stderr.write("\r\033[K")  # the status line, erased
            sys.stderr.flush()
    print(f"lab: built {how} → {out}", file=sys.stderr)
    return None


def _lock_waiting(lock, what: str, folder: Path) -> None:
    """Take the build's lock; where another process holds it (building the same library),
    say so once and wait for it."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"lab: waiting for another process's build of the {what} ({folder})",
              file=sys.stderr)  # fmt: skip
        fcntl.flock(lock, fcntl.LOCK_EX)


def build(
    source: Path,
    *,
    what: str,
    fallback: str,
    cxx: str | None,
    compile_fn: Callable[[str, list[str], Path], str | None],
    portable: bool = False,
) -> Path | None:
    """The compiled library of `source`, built now if no cached one matches; None (one line
    printed, ending in `fallback`: what runs instead) if there is no compiler or every build
    fails. `compile_fn(cxx, opt, out)` builds one attempt (its error line, or None)."""
    if cxx is None:
        print(f"lab: no C++ compiler (set CXX or install g++): the {what} is off, {fallback}",
              file=sys.stderr)  # fmt: skip
        return None
    attempts = [PORTABLE] if portable else [NATIVE, PORTABLE]
    if os.environ.get("LAB_KERNEL_SANITIZE") == "1":
        attempts = [SANITIZE + ["-march=native"], SANITIZE]
    error = None
    for opt in attempts:
        key = hashlib.sha256()
        for part in (source.read_bytes(), " ".join(opt + FLAGS).encode(), cxx.encode()):
            key.update(part)
        key.update(f"jaxlib {importlib.metadata.version('jaxlib')}\n{cpu_id()}".encode())
        folder = cache_root() / key.hexdigest()[:16]
        lib = folder / f"lib{source.stem}.so"
        if lib.exists():
            return lib
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / ".lock", "w") as lock:
                _lock_waiting(lock, what, folder)  # another process may be building it
                error = None if lib.exists() else compile_fn(cxx, opt, lib)
        except OSError as e:  # a cache that cannot be written: a read-only home, a file
            where = e.filename or folder
            print(f"lab: the {what} cannot be built: {where} cannot be written "
                  f"({e.strerror or e}; LAB_KERNEL_CACHE names another folder): {fallback}",
                  file=sys.stderr)  # fmt: skip
            return None
        if error is None:
            return lib
    print(f"lab: the {what} did not build ({error}): {fallback}", file=sys.stderr)
    return None


# Every thread a kernel's pool starts is an OS thread, and past the host's cores more threads
# never speed these kernels up (each call is cut into parts that the threads claim from one
# counter; a thread without a core only waits for a timeslice). A count mistyped by a few
# digits (100000) started that many threads and starved the whole host. Four per core leaves
# room to try oversubscription; the C++ sources hold the same cap (kThreadsPerCore).
THREADS_PER_CORE = 4
_SAID: set = set()  # the (variable, value) pairs whose cut has been said


def max_threads() -> int:
    """The most threads a native kernel runs: THREADS_PER_CORE per core of this host (the
    count the C++ kernels read, std::thread::hardware_concurrency, is os.cpu_count's)."""
    return THREADS_PER_CORE * (os.cpu_count() or 1)


def threads_from_env(var: str) -> int | None:
    """The thread count the environment variable `var` sets: None where it is unset or empty
    (the kernel takes every core), a ConfigError (a ValueError: one line naming `var`) where
    it is not a whole number >= 1, which the C++ kernels would ignore without a word, and
    `max_threads()` where it is above that, said once on stderr."""
    text = os.environ.get(var, "")
    if not text.strip():
        return None
    if not re.fullmatch(r"[0-9]+", text.strip()) or int(text) < 1:
        raise ConfigError(
            f"{var}={text!r}: must be a whole number of threads, at least 1 (unset: one per core)"
        )
    n, cap = int(text), max_threads()
    if n <= cap:
        return n
    if (var, n) not in _SAID:
        _SAID.add((var, n))
        print(f"lab: {var}={n} is more than {THREADS_PER_CORE} threads per core of this "
              f"host's {os.cpu_count() or 1}: the kernel runs {cap}", file=sys.stderr)  # fmt: skip
    return cap

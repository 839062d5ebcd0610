"""Ctrl-C and SIGTERM outside the training loop (start-up, lab.serve): one line, 130/143.

The line and the exit come at once, also while the main thread is inside an XLA compile or
another native call (a large compile: minutes): a thread the signal wakes says the line when
the main thread has not taken the signal within a second. Not sooner: the main thread may
hold a lock that what a stop writes needs (rich's console's, while it prints a progress line),
and only the main thread itself can take it again.

Python's own Ctrl-C raises KeyboardInterrupt into whatever bytecode runs next: inside JAX's
gc callback it is ignored (the run trains on), and unwinding out of an import or a compile
while XLA's threads still run let the interpreter's teardown crash (SIGSEGV). The package's
first import calls `install()` for `python -m lab.run` and `lab.serve` (the package, and jax
with it, is imported before the command's module); the loop's own handler (lab/loop.py
`_Stop`) replaces it for the training steps and puts it back after. Nothing before the loop
needs finishing: every start-up write is whole or not at all (written aside, then renamed; an
interrupted overwrite leaves its hidden folder for the next one) and the kernel releases the
folder's lock.
`note()` says what the folder keeps at each stage, for the one line; a write that must be
whole (lab.serve's records) runs under `held()`, and a signal during it exits after it;
`on_stop()` registers what to write first (lab.serve's finished points).
Once a command has finished (`finished()`, called by the shared exit_code with the command's
code), a signal in its last tenths of a second exits with that code, quietly: finished work is
never reported as interrupted.
"""

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

# The signal the kernel sends a launched process when its launcher dies (PR_SET_PDEATHSIG).
# Not SIGTERM: the kernel sends it once per launcher thread that had the process as child, as
# those threads exit one by one, and a second SIGTERM means "exit now, unsaved".
PARENT_DEATH_SIGNAL = "SIGUSR1"
_PARENT_DEATH = signal.Signals[PARENT_DEATH_SIGNAL]  # before the loop: exits as SIGTERM does
_STOPPING = (signal.SIGINT, signal.SIGTERM, _PARENT_DEATH)  # what the handlers here take
_kept = ["nothing was written"]
_held = {"on": False, "signum": None}
_last_words = []  # called once before a signal's exit: what can still be kept is written


# The ledger's claims whose topic compiles for hardware that is not here on every run, plans or
# not: the inference topic's decode steps for H100s (experiments/inference.py's CLAIMS; a
# test holds the two together, as this module must not import the experiments).
COMPILES_ALWAYS = ("C16", "C18", "C21", "C22")


def _selects(argv, claims) -> bool:
    """Whether `python -m experiments argv` runs a topic of `claims`: all of them without
    `only=`, else where `only=` names one (C8 and c08 as C08, as experiments reads them)."""
    only = [a.partition("=")[2] for a in argv if a.partition("=")[0].strip() == "only"]
    if not only or not only[-1].strip():
        return True
    asked = {x.strip().upper().removeprefix("C").lstrip("0") for x in only[-1].split(",")}
    return any(c.removeprefix("C").lstrip("0") in asked for c in claims)


def native_log_level(module: str, argv) -> None:
    """XLA's own C++ log threshold (TF_CPP_MIN_LOG_LEVEL) for `python -m module argv`, unless
    the user set it: informational lines hidden (1), and where the command compiles for
    hardware that is not here (target=…, the prediction tool's published points, the
    attention plans, the ledger with plans on or with the topic that compiles H100 decode
    steps on every run) its warnings and errors too (3). XLA logs
    lines about that hardware's memory that the plan itself reports (a scheduler's "This
    indicates an error in the calculation!" on a compile that succeeds); a fatal line still
    prints. Read once, when jaxlib loads: set before anything imports JAX (lab/__init__.py)."""
    plan = any(a.startswith("target=") and a != "target=" for a in argv)
    if module == "lab.tools.prediction":  # cpu= and here= as lab.config reads a bool
        plan = not any(_true(a, key) for a in argv for key in ("cpu", "here"))
    elif module in ("lab.tools.attention_plan", "lab.tools.attention_targets"):
        plan = True
    elif module == "experiments":
        plan = "plans=on" in argv or ("size=full" in argv and "plans=off" not in argv)
        plan = plan or _selects(argv, COMPILES_ALWAYS)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3" if plan else "1")


def _true(arg: str, key: str) -> bool:
    """Whether `arg` is `key=` a true value as lab.config reads one (true, 1, yes, on)."""
    name, _, value = arg.partition("=")
    return name.strip() == key and value.strip().lower() in ("true", "1", "yes", "on")


def on_stop(keep) -> None:
    """Call `keep()` when a signal stops the process, before its one line: it writes what
    finished (lab.serve's measured points) and may `note()` where. Its failure is ignored:
    the process still exits with its line."""
    _last_words.append(keep)


def note(kept) -> None:
    """What a signal from now on leaves behind, as the exit line says it: a string, or a
    function that reads it when the signal comes (what a folder keeps changes as saves end)."""
    _kept[0] = kept


@contextlib.contextmanager
def held():
    """A write that must finish whole: a signal during it exits once it is done (held
    within held: once the outermost is done). The outermost holds the lock the signal
    watcher (install) takes, so a signal the watcher hears waits for the write too. The wait
    for the watcher is bounded (`_SAYING_WAIT_S`, none once a wait has run out): a watcher
    that never ends (stuck on a lock this thread holds) does not keep the write from being made."""
    outer = not _held["on"]
    got = outer and _saying.acquire(timeout=0 if _stuck else _SAYING_WAIT_S)
    if outer and not got:
        _stuck.append(True)
    _held["on"] = True
    try:
        yield
    finally:
        if outer:
            _held["on"] = False
            signum = _held["signum"]
            if got:
                _saying.release()
            if signum is not None:
                _exit(signum, None)


def keep_on_stop(finished: list, write) -> Callable[[], None]:
    """A command's points as they finish, kept by a stop: `finished` (appended to as each
    point finishes) is written by `write(points)` if a signal stops the process, and by the
    returned `flush()` at the end. Each point is written once: a flush takes the points and
    writes them with signals held, so a stop during it finds none left to write again."""

    def take_and_write() -> None:
        with held():
            taken = list(finished)
            finished.clear()
            if taken:
                write(taken)

    on_stop(take_and_write)
    return take_and_write


def last_words() -> None:
    """Run what on_stop registered (newest first, each once), as a signal's exit does; for
    an exit that cannot go through the handler (a thread's, while the main thread waits
    inside a native call)."""
    while _last_words:
        keep = _last_words.pop()
        try:
            keep()
        except Exception:  # noqa: BLE001 - the exit line must still come
            pass


# The handler and the watcher (install) never both say the line: the second to come waits
# here for the first's exit, and a held write (held) for its end. Bounded: a thread stuck
# (a write into a full pipe, a lock the other holds) never keeps the other from exiting.
_saying = threading.RLock()
_SAYING_WAIT_S = 10.0
_stuck = []  # set once a wait for the other ran out: no later wait of this stop waits again
# The main thread's handler ran: the stop is its own (the watcher leaves it alone). The
# watcher waits this long for it before it stops the process itself: the main thread takes a
# signal within milliseconds unless it is inside a native call.
_taken = threading.Event()
MAIN_TAKES_S = 1.0


def _exit(signum, _frame) -> None:
    if threading.current_thread() is threading.main_thread():
        _taken.set()
    got = _saying.acquire(timeout=0 if _stuck else _SAYING_WAIT_S)
    if not got:
        _stuck.append(True)
    try:
        if got and _held["on"]:
            _held["signum"] = _held["signum"] or signum
            return
        _say_and_exit(signum)
    finally:
        if got:
            _saying.release()


def _say_and_exit(signum) -> None:
    name = "SIGTERM" if signum == _PARENT_DEATH else signal.Signals(signum).name
    last_words()
    try:  # one write, then out: no exception may reach the code the signal interrupted
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - a closed pipe must not keep the process alive
        pass
    kept = _kept[0]
    if callable(kept):
        try:
            kept = kept()
        except Exception:  # noqa: BLE001 - the exit line must still come
            kept = "what the folder keeps could not be read"
    os.write(2, f"{name}: exiting; {kept}\n".encode())
    os._exit(130 if signum == signal.SIGINT else 143)


# The commands whose signals are one line from the start: lab.run, lab.serve and the tools
# that measure or compile and write their records at the end (a signal's default action would
# leave their reserved records file empty, and libtpu's or Mosaic GPU's handler, once loaded,
# prints a C++ stack). The launcher and the runbook handle signals themselves: they stop their
# processes or steps and keep what those saved.
COMMANDS = (
    "lab.run",
    "lab.serve",
    *(
        f"lab.tools.{tool}"
        for tool in (
            "attention_bench",
            "attention_plan",
            "attention_targets",
            "attention_tune",
            "bench_step",
            "ceilings",
            "collective_matmul",
            "collectives",
            "prediction",
            "scaling",
            "tune_step",
        )
    ),
)


# glibc's allocator in transparent huge pages (glibc 2.35+; a kernel whose THP mode is
# "madvise"). XLA:CPU frees a step's temporaries and allocates them again every step, and
# glibc hands freed memory back to the kernel, so each step faults its temporaries in again 4
# KiB at a time: lab.run model=small on the 2-core VM took 58,000 page faults a step, its
# step 262 ms; in huge pages 198 ms (BENCHMARKS.md). LAB_HUGE_PAGES=0 keeps the system's.
HUGE_PAGES = "glibc.malloc.hugetlb=1"


_STARTED = "LAB_HUGE_PAGES_STARTED"  # set in the command started again: it never starts a third


def huge_pages_tunables(environ, libc: tuple[str, str], thp_mode: str) -> str | None:
    """The GLIBC_TUNABLES value that puts the allocator in huge pages, or None where it would
    change nothing or the user decided (LAB_HUGE_PAGES=0, a hugetlb tunable of their own,
    no glibc 2.35+, THP "never" or already "always"), or where this is the command started
    again already (a secure-execution process has its tunables cleared by glibc: asking
    again would start it forever)."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    # off for 0 (and the usual words for no); any other value leaves it on
    off = environ.get("LAB_HUGE_PAGES", "1").strip().lower() in ("0", "false", "no", "off")
    if off or "glibc.malloc.hugetlb" in tunables:
        return None
    if environ.get(_STARTED):
        return None
    name, version = libc
    try:
        new_enough = tuple(int(x) for x in version.split(".")[:2]) >= (2, 35)
    except ValueError:
        new_enough = False
    if name != "glibc" or not new_enough or "[madvise]" not in thp_mode:
        return None
    return f"{tunables}:{HUGE_PAGES}" if tunables else HUGE_PAGES


def in_huge_pages() -> bool:
    """Whether this process's allocator was started in huge pages (huge_pages)."""
    return "glibc.malloc.hugetlb=1" in os.environ.get("GLIBC_TUNABLES", "")


def huge_pages() -> None:
    """Start this command (`python -m lab.…` or `python -m experiments`) again with its
    allocator in huge pages (huge_pages_tunables), once: glibc reads its tunables only as a
    process starts. Nothing else has run yet (the package's first import calls it), and the
    process keeps its id, streams and signals."""
    if not sys.platform.startswith("linux"):
        return
    import platform

    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp_mode = f.read()
    except OSError:
        return
    value = huge_pages_tunables(os.environ, platform.libc_ver(), thp_mode)
    module = main_module()
    if value is None or not (module.startswith("lab.") or module == "experiments"):
        return  # only the lab's own commands: a program importing lab is left as it runs
    before = os.environ.get("GLIBC_TUNABLES")
    os.environ["GLIBC_TUNABLES"], os.environ[_STARTED] = value, "1"
    # a signal that comes now stays pending across the exec (a handler's flag would be lost
    # with this process image: a Ctrl-C ignored); the command started again takes it once its
    # handlers are set (install, guard_imports)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPPING)
    try:
        os.execv(sys.executable, sys.orig_argv)
    except OSError:  # no interpreter to start (sys.executable empty): go on as it is
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        os.environ.pop(_STARTED, None)
        if before is None:
            os.environ.pop("GLIBC_TUNABLES", None)
        else:
            os.environ["GLIBC_TUNABLES"] = before


def main_module() -> str:
    """The module this interpreter was started to run with `python -m`, or "": read from the
    interpreter's own options (`-m` before the program's arguments), not from an argument
    of a script that happens to be "-m"."""
    orig, argv = getattr(sys, "orig_argv", []), sys.argv
    if not argv or len(orig) < len(argv) + 1 or orig[-len(argv) - 1] != "-m":
        return ""
    return orig[-len(argv)]


def command() -> bool:
    """Whether this process is `python -m` one of COMMANDS."""
    return main_module() in COMMANDS


def install() -> None:
    """SIGINT, SIGTERM and the launcher's death exit with one line, at once: a thread that
    the signal wakes (`signal.set_wakeup_fd`) says it while the main thread is still inside
    a native call (a compile of minutes, which `timeout` or a scheduler's stop must not wait
    for), after `MAIN_TAKES_S` (the main thread, running Python, takes it itself within
    milliseconds, with the locks it holds). Only while these handlers are the ones
    installed: the training loop's own, which stops between steps and saves, is left to do
    so."""
    handled = _STOPPING
    for sig in handled:
        signal.signal(sig, _exit)
    with contextlib.suppress(AttributeError, OSError):  # the launcher starts its processes
        signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)  # with them blocked: taken now
    keep_python_handlers()
    try:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except (OSError, ValueError):  # no pipe, or not the main thread: the handlers alone
        return

    def ours(signum) -> bool:
        return signum in handled and signal.getsignal(signum) is _exit

    def watch() -> None:
        heard = 0
        while data := os.read(read_fd, 64):
            for signum in data:
                if signum in handled and signal.getsignal(signum) is _after_finish:
                    # finished: the main thread exits at once unless it is inside a native
                    # call (a distributed shutdown's wait); then this thread does
                    time.sleep(MAIN_TAKES_S)
                    os._exit(_finished[-1])
                if not ours(signum):
                    continue
                heard += 1
                # a later signal, the main thread finishing a held write for the first (a
                # write that may hang): ends the process, within _exit's bounded wait
                if heard > 1 and _taken.is_set() or not _taken.wait(MAIN_TAKES_S):
                    if ours(signum):
                        _exit(signum, None)

    threading.Thread(target=watch, name="lab-signal-watch", daemon=True).start()


@contextlib.contextmanager
def watch_paused():
    """The watcher (install) hears no signal inside: for a handler of its own that decides
    when to stop (the training loop finishes its step and saves). Without the pause, a
    signal that handler took could wake the watcher only after the start-up handlers were put
    back, and end the process the handler had meant to finish. Enter before installing the
    other handler; leave after putting the start-up handlers back."""
    try:
        old = signal.set_wakeup_fd(-1)
    except ValueError:  # not the main thread: nothing to pause
        yield
        return
    try:
        yield
    finally:
        signal.set_wakeup_fd(old)


@contextlib.contextmanager
def signals_read(on_signal: Callable[[int], None]):
    """Inside, `on_signal(signum)` is called from a thread for each signal this process
    receives, as the interpreter's C handler writes it to the wakeup descriptor
    (`signal.set_wakeup_fd`): at once, also while the main thread is inside a native call,
    where Python's own handlers wait for the call to end. The descriptor in place before is
    put back after. Yields False (and reads nothing) where none can be set: not the main
    thread, or no pipe."""
    try:
        read_fd, write_fd = os.pipe()
    except OSError:
        yield False
        return
    os.set_blocking(write_fd, False)
    try:
        old = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:  # not the main thread
        os.close(read_fd)
        os.close(write_fd)
        yield False
        return

    def watch() -> None:
        while data := os.read(read_fd, 64):  # until the write end is closed
            for signum in data:
                on_signal(signum)

    thread = threading.Thread(target=watch, name="lab-signals-read", daemon=True)
    thread.start()
    try:
        yield True
    finally:
        signal.set_wakeup_fd(old)
        os.close(write_fd)  # the thread reads what is left, then the end
        thread.join(timeout=5)
        if not thread.is_alive():
            os.close(read_fd)


@contextlib.contextmanager
def second_signal(signals, on_second: Callable[[int], None]):
    """Inside, `on_second(signum)` is called from a thread at the second of `signals` this
    process receives, also while the main thread is inside a native call (a training step).
    Python runs a signal's handler once for every signal of that kind that arrived during
    such a call, so a handler that counts its calls never sees a second Ctrl-C sent during a
    long step; the bytes the wakeup descriptor gets are one per signal. Use inside
    `watch_paused()`, whose watcher this one stands in for; yields False (and counts nothing)
    where no wakeup file can be set."""
    wanted = {int(s) for s in signals}
    heard = [0]

    def count(signum: int) -> None:
        if signum in wanted:
            heard[0] += 1
            if heard[0] == 2:
                on_second(signum)

    with signals_read(count) as reading:
        yield reading


def guard_imports() -> None:
    """For a lab command whose handling of signals begins in its main (the launcher, the
    runbook, the ledger, compare): until `imports_done()`, a Ctrl-C or SIGTERM is one line
    and exit 130/143, not a traceback out of the import it lands in (jax, the lab's modules:
    seconds)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is signal.SIG_IGN:  # ignored by who started it: stays so
            continue
        with contextlib.suppress(ValueError):  # not the main thread: left as it is
            signal.signal(sig, _import_exit)
    with contextlib.suppress(AttributeError, OSError):  # held across huge_pages' exec: now
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPPING)


def finished(code: int) -> None:
    """The command this process runs (`python -m lab…` or `experiments…`) has done its work
    and said so: a Ctrl-C, SIGTERM or its launcher's death from here to the process's end
    (the interpreter's shutdown, some tenths of a second) exits quietly with the command's
    own code, not as interrupted (130, with no line) — what it wrote is whole. Its output is
    flushed here, so that such an exit loses none of it. A signal ignored by who started the
    command stays ignored."""
    if main_module().partition(".")[0] not in ("lab", "experiments"):
        return  # called in another program (a test): its handlers are its own
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe: nothing more to lose
            stream.flush()
    _finished.append(code)
    for sig in _STOPPING:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            with contextlib.suppress(ValueError):  # not the main thread: left as it is
                signal.signal(sig, _after_finish)


_finished: list[int] = []  # the finished command's exit code
# How long the native libraries' teardown may take once signals are ignored (_ignored_to_the_end):
# past it the process is taken to hang there and is ended (SIGALRM), as a signal would have.
_TEARDOWN_S = 30


def _after_finish(_signum, _frame) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # (flushed when the command finished)
            stream.flush()
    os._exit(_finished[-1])


@atexit.register  # at import, before JAX's: among the last exit hooks to run
def _ignored_to_the_end() -> None:
    """After the Python exit hooks, the interpreter puts back the signals' default actions and
    the native libraries' teardown runs (tenths of a second): a finished command's signals
    are ignored there instead, so that it still exits with its own code. A teardown that
    hangs is still ended, by an alarm `_TEARDOWN_S` later."""
    if _finished:
        for sig in _STOPPING:
            if signal.getsignal(sig) is _after_finish:
                with contextlib.suppress(ValueError):
                    signal.signal(sig, signal.SIG_IGN)
        with contextlib.suppress(AttributeError, ValueError):  # no alarm (not POSIX)
            signal.alarm(_TEARDOWN_S)


def _import_exit(signum, _frame) -> None:
    name = signal.Signals(signum).name
    with contextlib.suppress(OSError):
        os.write(2, f"{name}: exiting; nothing was written\n".encode())
    os._exit(130 if signum == signal.SIGINT else 143)


def imports_done() -> None:
    """Python's own handlers back where `guard_imports` set its: the command's main (the
    shared `cli`) handles Ctrl-C (KeyboardInterrupt) and SIGTERM from here on."""
    defaults = ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL))
    for sig, default in defaults:
        if signal.getsignal(sig) is _import_exit:
            signal.signal(sig, default)


_SIGACTION_BYTES = 512  # struct sigaction: 152 bytes on Linux x86-64 and aarch64; room to spare


def _native_action(libc, sig):
    """The kernel's record of `sig`'s handler (an opaque struct sigaction), or None."""
    import ctypes

    buf = ctypes.create_string_buffer(_SIGACTION_BYTES)
    return buf if libc.sigaction(int(sig), None, buf) == 0 else None


def keep_python_handlers(signals=(signal.SIGINT, signal.SIGTERM), every_s: float = 0.1):
    """Put Python's handlers for `signals` back whenever a native library replaces them;
    returns a function that stops the watch (a daemon thread, polling every `every_s`).

    Mosaic GPU's extension, which JAX's Pallas GPU attention imports (a bench peer, and the
    lab's Hopper kernel), installs absl's failure handler for SIGTERM when it loads. On a
    signal it prints a C++ stack trace, calls Python's handler and aborts the process 3 s
    later, so a scheduler's stop would cut short the report or checkpoint being written and
    exit 134 instead of the one line. Call it from the main thread after Python's handlers
    are set; a signal whose Python handler is later reset to the default is left alone. No
    ctypes or sigaction (not Linux or macOS): nothing is watched."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        saved = {sig: _native_action(libc, sig) for sig in signals}
    except (OSError, AttributeError):
        return lambda: None
    saved = {sig: a for sig, a in saved.items() if a is not None}
    done = threading.Event()

    def watch() -> None:
        while not done.wait(every_s):
            for sig, want in saved.items():
                if not callable(signal.getsignal(sig)):  # SIG_DFL or SIG_IGN: Python's choice
                    continue
                now = _native_action(libc, sig)
                if now is not None and now.raw[:8] != want.raw[:8]:  # the handler's address
                    libc.sigaction(int(sig), want, None)

    watcher = threading.Thread(target=watch, name="keep-signal-handlers", daemon=True)
    watcher.start()

    def stop() -> None:  # joined: no pass may put a handler back after the caller resets it
        done.set()
        watcher.join()

    return stop

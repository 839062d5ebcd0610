"""What the commands set before JAX's backend starts: XLA's own log threshold; signal
handlers that native libraries loaded later cannot take over."""

import os

import pytest

from lab import startup


@pytest.mark.parametrize(
    "module, argv, preset, want",
    [
        ("lab.run", ["mesh=4x2"], None, "1"),  # a run: XLA's informational lines hidden
        ("lab.run", ["target=gpu:h100", "model=1b"], None, "3"),  # a plan: its warnings too
        ("lab.run", ["target="], None, "1"),  # an empty target is no plan (its check says so)
        ("lab.run", ["target=tpu:v5e:2x4"], "0", "0"),  # what the user set is kept
        ("lab.tools.prediction", [], None, "3"),  # the published points: plans
        ("lab.tools.prediction", ["cpu=true"], None, "1"),
        ("lab.tools.prediction", ["cpu=1"], None, "1"),  # a bool as lab.config reads one
        ("lab.tools.prediction", ["here=Yes"], None, "1"),
        ("lab.tools.prediction", ["here=false"], None, "3"),
        ("experiments", ["size=tiny", "plans=on"], None, "3"),
        ("experiments", ["size=full", "plans=off", "only=C03"], None, "1"),
        ("experiments", ["size=tiny", "only=c3,C8"], None, "1"),
        # the inference topic compiles H100 decode steps on every run
        ("experiments", ["size=full", "plans=off"], None, "3"),
        ("experiments", ["size=tiny", "only=C03,c18"], None, "3"),
    ],
)
def test_the_native_log_level_follows_the_command(monkeypatch, module, argv, preset, want):
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    if preset is not None:
        monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", preset)
    startup.native_log_level(module, argv)
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == want


def test_the_claims_that_always_compile_are_the_inference_topics():
    """lab.startup cannot import the experiments: its copy of the topic's claims is held here."""
    from experiments import inference

    assert startup.COMPILES_ALWAYS == inference.CLAIMS


_SEE_JAXLIB_LOAD = """
import importlib.abc, os, sys

class See(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "jaxlib" and "seen" not in os.environ:
            os.environ["seen"] = "1"
            with open(os.environ["LEVEL_AT_JAXLIB"], "w") as f:
                f.write(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "unset"))
        return None

sys.meta_path.insert(0, See())
"""


def test_the_level_is_set_before_jaxlib_loads(tmp_path):
    """jaxlib reads it once, when it loads: a command whose module imports JAX at its top
    (the prediction tool) still has it set by then, from the package's import."""
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "sitecustomize.py").write_text(_SEE_JAXLIB_LOAD)
    seen = tmp_path / "level"
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env.update(PYTHONPATH=f"{tmp_path}:{root}", LEVEL_AT_JAXLIB=str(seen), JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-m", "lab.tools.prediction", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert seen.read_text() == "3"  # the published points are plans


def test_a_cpu_run_beside_the_gpu_plan_extra_starts_without_the_plugins_errors():
    """With JAX's CUDA plugin installed for GPU plans, on a machine with no NVIDIA GPU, JAX's
    start-up made the plugin look for CUDA and cuDNN and print a traceback before every CPU
    run (README's main command too). Importing the package chooses the cpu platform first,
    which needs JAX not imported yet: `import lab` imports no JAX."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    if Path("/dev/nvidiactl").exists():
        pytest.skip("this machine shows an NVIDIA GPU: the plugin has one to start")
    if not any(importlib.util.find_spec(f"jax_plugins.xla_cuda{m}") for m in ("13", "12")):
        pytest.skip("no CUDA plugin installed (the gpu-plan extra)")
    code = (
        "import sys, lab; imported = 'jax' in sys.modules; import jax; jax.devices(); "
        "print(imported, jax.config.jax_platforms)"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "cpu"], out.stdout
    for line in ("Traceback", "Jax plugin configuration error"):
        assert line not in out.stderr, out.stderr


_PALLAS = """
import sys
def pallas():
    return sorted(m for m in sys.modules if any(w in m for w in ("pallas", "mosaic", "triton")))
if sys.argv[1] == "flax":  # what flax and JAX's plugins (found as its backends start) load
    import flax.linen, jax
    jax.devices()
    print(pallas())
    sys.exit()
import jax, jax.numpy as jnp
import lab.run, lab.serve
from lab.kernels.attention import attention, decode_attention
q = jax.random.normal(jax.random.key(0), (1, 16, 2, 64))
jax.block_until_ready(jax.grad(lambda q: attention(q, q, q).sum())(q))  # auto: a CPU kernel
kv = q.transpose(0, 2, 1, 3)
jax.block_until_ready(decode_attention(q[:, 0], kv, kv, jnp.array([9])))
print(pallas())
from lab.kernels.attention import pallas_tpu
print(pallas_tpu.BlockSizes().block_q > 0, "jax.experimental.pallas.tpu" in sys.modules)
"""


def test_a_cpu_process_imports_no_pallas_backend_until_a_kernel_needs_one():
    """JAX's Pallas TPU, Triton and Mosaic GPU backends take a quarter of a lab process's
    imports (each test's subprocess too): a CPU process that trains and decodes with the CPU
    kernels imports no more of them than flax and JAX's own start do, and a Pallas kernel module
    still imports when asked for."""
    import ast
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    said = {}
    for what in ("flax", "lab"):
        out = subprocess.run(
            [sys.executable, "-c", _PALLAS, what],
            cwd=root, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        said[what] = out.stdout.splitlines()
    extra = set(ast.literal_eval(said["lab"][0])) - set(ast.literal_eval(said["flax"][0]))
    assert extra <= {"lab.kernels.triton_deprecation"}, extra  # a warnings filter, no Pallas
    assert said["lab"][1] == "True True", said


def test_a_kernel_that_fails_to_load_is_an_error_not_a_kernel_passed_over(monkeypatch):
    """The Pallas kernels are imported on first use. One that fails to load (a damaged tuned
    table, a JAX without its backend) raises ImportError at every use, not the ValueError by
    which a kernel refuses an input: `auto` does not quietly take another kernel instead."""
    import types

    import jax.numpy as jnp

    from lab.kernels import attention as A

    def broken(name):
        raise ValueError(f"{name}: a damaged table")

    monkeypatch.setattr(A, "importlib", types.SimpleNamespace(import_module=broken))
    q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
    for _ in range(2):
        with pytest.raises(ImportError, match="the pallas_gpu attention kernel did not load"):
            A._first_fit(["pallas_gpu", "blockwise"], q, q, q, causal=True)


_TAKEN_OVER = """
import ctypes, signal, sys, time
from lab import startup
libc = ctypes.CDLL(None)
def native():
    buf = ctypes.create_string_buffer(512)
    libc.sigaction(int(signal.SIGTERM), None, buf)
    return buf.raw[:8]
signal.signal(signal.SIGTERM, lambda *_: (print("python's handler"), sys.exit(7)))
mine = native()
startup.keep_python_handlers(every_s=5.0)  # its first look after the import below
if sys.argv[1] == "mosaic":  # the library that does it: absl's failure handler on import
    import jax.experimental.pallas.ops.gpu.attention_mgpu  # noqa: F401
else:
    libc.signal(int(signal.SIGTERM), ctypes.c_void_p(0))  # SIG_DFL behind Python's back
print("replaced" if native() != mine else "kept", flush=True)
time.sleep(5.5)
print("restored" if native() == mine else "lost", flush=True)
signal.raise_signal(signal.SIGTERM)
time.sleep(5)
"""


@pytest.mark.parametrize("library", ["ctypes", "mosaic"])
def test_a_native_library_cannot_keep_sigterm(library):
    """A handler a native library puts on SIGTERM behind Python's back is replaced by
    Python's own within the watch's period: the signal reaches the command's handler."""
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-c", _TAKEN_OVER, library], capture_output=True, text=True, timeout=120
    )
    if library == "mosaic" and "No module named" in p.stderr:
        pytest.skip("this jax has no Pallas Mosaic GPU attention")
    out = p.stdout.split()
    if library == "mosaic" and out[:1] == ["kept"]:
        pytest.skip("importing Mosaic GPU left SIGTERM alone on this jax")
    assert out == ["replaced", "restored", "python's", "handler"], (p.stdout, p.stderr)
    assert p.returncode == 7 and "SIGTERM received" not in p.stderr


GLIBC = ("glibc", "2.36")
MADVISE = "always [madvise] never\n"


@pytest.mark.parametrize(
    "environ, libc, thp, want",
    [
        ({}, GLIBC, MADVISE, "glibc.malloc.hugetlb=1"),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, GLIBC, MADVISE,
         "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),  # the user's tunables kept
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, GLIBC, MADVISE, None),  # their choice
        ({"LAB_HUGE_PAGES": "0"}, GLIBC, MADVISE, None),
        ({"LAB_HUGE_PAGES": "off"}, GLIBC, MADVISE, None),
        ({"LAB_HUGE_PAGES": "false"}, GLIBC, MADVISE, None),
        ({}, ("glibc", "2.31"), MADVISE, None),  # no hugetlb tunable before 2.35
        ({}, ("", ""), MADVISE, None),  # musl, or no libc to name
        ({}, GLIBC, "[always] madvise never\n", None),  # every allocation is in them already
        ({}, GLIBC, "always madvise [never]\n", None),
        # started again already: glibc clears a secure-execution process's tunables, and
        # asking again would start it forever
        ({"LAB_HUGE_PAGES_STARTED": "1"}, GLIBC, MADVISE, None),
    ],
)  # fmt: skip
def test_the_allocator_goes_in_huge_pages_only_where_it_changes_something(environ, libc, thp, want):
    assert startup.huge_pages_tunables(environ, libc, thp) == want


@pytest.mark.once
def test_a_command_starts_again_in_huge_pages_and_says_so(tmp_path):
    """XLA:CPU faults its temporaries in again every step unless glibc keeps them in huge
    pages: a lab command starts itself again with the tunable (once), and its header says
    so (LAB_HUGE_PAGES=0 and the other cases are the decision's own test, above)."""
    import platform
    import subprocess
    import sys

    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        pytest.skip("no transparent huge pages here")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if startup.huge_pages_tunables(env, platform.libc_ver(), thp) is None:
        pytest.skip("this host's glibc or kernel would not change")
    argv = [sys.executable, "-m", "lab.run", "model=tiny", "steps=1", "compile_only=true"]
    out = subprocess.run(  # in a folder of its own: its plan's run folder is not the checkout's
        argv, env={**env, "LAB_HUGE_PAGES": "1", "JAX_PLATFORMS": "cpu"},
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "allocator in huge pages" in out.stdout, out.stdout


@pytest.mark.parametrize(
    "orig, argv, want",
    [
        (["py", "-m", "lab.run", "a"], ["-m", "a"], "lab.run"),  # while the module is found
        (["py", "-X", "dev", "-u", "-m", "lab.run", "a"], ["/p/run.py", "a"], "lab.run"),
        (["py", "-m", "lab.run", "-m", "x"], ["-m", "-m", "x"], "lab.run"),
        (["py", "s.py", "-m", "lab.x"], ["s.py", "-m", "lab.x"], ""),  # a script's argument
        (["py", "-c", "import lab", "-m", "lab.x"], ["-c", "-m", "lab.x"], ""),
        (["py", "-", "-m", "lab.x"], ["-", "-m", "lab.x"], ""),
        (["py"], [""], ""),
    ],
)
def test_the_main_module_is_read_from_the_interpreters_own_options(monkeypatch, orig, argv, want):
    monkeypatch.setattr(startup.sys, "orig_argv", orig)
    monkeypatch.setattr(startup.sys, "argv", argv)
    assert startup.main_module() == want


def test_a_command_that_cannot_start_again_goes_on_as_it_is(monkeypatch):
    """No interpreter to start (sys.executable empty): the command runs with the system's
    allocator, its environment as it was, and says nothing of huge pages."""
    monkeypatch.setattr(startup.sys, "orig_argv", ["py", "-m", "lab.run"])
    monkeypatch.setattr(startup.sys, "argv", ["-m"])
    monkeypatch.setattr(startup.sys, "executable", "")
    monkeypatch.setattr(startup.sys, "platform", "linux")
    monkeypatch.setattr(startup, "huge_pages_tunables", lambda *a: "glibc.malloc.hugetlb=1")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("LAB_HUGE_PAGES_STARTED", raising=False)
    import builtins
    import io

    real_open = builtins.open
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    monkeypatch.setattr(
        builtins,
        "open",
        lambda f, *a, **k: io.StringIO(MADVISE) if f == thp else real_open(f, *a, **k),
    )
    startup.huge_pages()  # os.execv("") raises; caught
    assert "GLIBC_TUNABLES" not in os.environ and "LAB_HUGE_PAGES_STARTED" not in os.environ
    assert not startup.in_huge_pages()


def test_a_signal_reads_what_the_folder_keeps_when_it_comes(monkeypatch):
    """After the training loop the exit line said "before training: … keeps config.json" (the
    note set before the loop): a note may be a function, read when the signal comes; one that
    fails still lets the line out."""
    import signal

    written, codes = [], []
    monkeypatch.setattr(startup.os, "write", lambda fd, data: written.append(data.decode()))
    monkeypatch.setattr(startup.os, "_exit", codes.append)
    monkeypatch.setattr(startup, "_kept", [None])
    folder = {"step": 4}
    startup.note(lambda: f"after training: checkpoint step {folder['step']}")
    folder["step"] = 8
    startup._exit(signal.SIGTERM, None)
    assert written[-1] == "SIGTERM: exiting; after training: checkpoint step 8\n"
    startup.note(lambda: 1 / 0)
    startup._exit(signal.SIGINT, None)
    assert written[-1].startswith("SIGINT: exiting; what the folder keeps could not")
    assert codes == [143, 130]


def _python(script: str):
    """`python -c script` started with its output read as text through pipes."""
    import subprocess
    import sys

    return subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


_NATIVE_CALL = """
import sys, time
import numpy as np
from lab import startup

startup.install()
startup.note("nothing was written")
a = np.ones((6000, 6000), np.float32)
t0 = time.perf_counter()
a @ a  # the host's pace
print(time.perf_counter() - t0, flush=True)
b = np.ones((9000, 9000), np.float32)
b @ b  # one native call of seconds, as a compile is: Python's handler waits for its end
"""


def test_a_signal_during_a_native_call_exits_at_once_with_its_line():
    """SIGTERM while the main thread is inside one long native call (a compile, a matmul):
    the line and exit 143 come at once, from the thread the signal wakes, not when the call
    returns (a compile of minutes would keep `timeout` or a scheduler waiting)."""
    import signal
    import time

    p = _python(_NATIVE_CALL)
    call_s = float(p.stdout.readline()) * 1.5**3  # the second call's time; it has begun
    t0 = time.perf_counter()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    left_s = time.perf_counter() - t0
    assert p.returncode == 143, err
    assert err == "SIGTERM: exiting; nothing was written\n"
    if call_s < 3 * startup.MAIN_TAKES_S:  # the watcher first leaves the main thread a second
        pytest.skip(f"a {call_s:.2f} s call on this host is too short to tell at once from after")
    assert left_s < call_s / 2, (left_s, call_s)  # during the call, not after it


_SECOND_DURING_A_STEP = """
import sys, time
import numpy as np
from lab.loop import _Stop

def final(name):
    print(f"{name} again: exiting at once", file=sys.stderr, flush=True)

with _Stop(final=final) as stop:  # the training loop's handler
    a = np.ones((6000, 6000), np.float32)
    t0 = time.perf_counter()
    a @ a  # the host's pace
    print(time.perf_counter() - t0, flush=True)
    b = np.ones((9000, 9000), np.float32)
    b @ b  # one native call of seconds, as a training step is: the two signals come here
print("the step ended; the loop took", stop.signal, flush=True)
"""


def test_a_second_signal_during_a_step_exits_at_once():
    """Two SIGINTs while the main thread is inside one training step (a native call): Python
    runs the loop's handler once for both when the call returns, so the second was taken for
    the first and the run went on to its next checkpoint. A thread counts them as they come:
    the second exits at once (130) with the loop's line."""
    import signal
    import time

    from lab import startup

    p = _python(_SECOND_DURING_A_STEP)
    call_s = float(p.stdout.readline()) * 1.5**3  # the second call's time; it has begun
    if call_s < 4 * startup.MAIN_TAKES_S:  # the thread first leaves the main thread a second
        p.kill()
        p.communicate()
        pytest.skip(f"a {call_s:.2f} s call on this host is too short to tell at once from after")
    t0 = time.perf_counter()
    p.send_signal(signal.SIGINT)
    time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    left_s = time.perf_counter() - t0
    assert p.returncode == 130, (out, err)
    assert err == "SIGINT again: exiting at once\n", err
    assert "the step ended" not in out
    assert left_s < call_s / 2, (left_s, call_s)  # during the call, not after it


_LOOP_TOOK_IT = """
import os, signal, time
from lab import startup
from lab.loop import _Stop

startup.install()
startup.note("after training: saved")
with _Stop() as stop:  # the training loop's handler: it stops between steps
    os.kill(os.getpid(), signal.SIGTERM)  # a SIGTERM just before the loop ends
print("the loop took", stop.signal, flush=True)
t = time.time()
while time.time() - t < 1:  # the rest of lab.run after the loop, in Python
    pass
print("the run finished", flush=True)
"""


def test_a_signal_the_training_loop_took_is_not_heard_again_by_the_watcher():
    """The loop's own handler takes SIGTERM and finishes the run; the start-up watcher, put
    back after the loop, must not read that signal late and end the process."""
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-c", _LOOP_TOOK_IT], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert "the loop took SIGTERM" in p.stdout and "the run finished" in p.stdout, p.stdout
    assert "exiting" not in p.stderr


_WRITES_RACE = """
import sys, time
import numpy as np
from lab import startup

startup.install()
startup.note("the points so far are kept")

def keep():  # what a stop writes first (lab.serve's finished points): slow, and whole
    with startup.held():
        time.sleep(5)
        print("the stop's write", flush=True)

startup.on_stop(keep)
a = np.ones((9000, 9000), np.float32)
print("go", flush=True)
a @ a  # the signal comes here: the watcher writes while this thread is in the call
with startup.held():
    print("this thread's write", flush=True)
"""


def test_a_write_the_stop_makes_is_never_joined_by_the_main_threads():
    """The watcher's own held write (the points a stop keeps) holds the main thread back: it
    does not go on to write beside it once its native call returns; the process exits with
    the stop's write whole and its one line."""
    import signal

    p = _python(_WRITES_RACE)
    assert p.stdout.readline().strip() == "go"
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 143, err
    assert "the stop's write" in out and "this thread's write" not in out, out
    assert err == "SIGTERM: exiting; the points so far are kept\n"


def test_the_import_guard_keeps_a_signal_ignored_by_who_started_the_command():
    """A command started with SIGINT ignored (a shell's background job, `trap '' INT`) keeps
    it ignored through the guard and after it; SIGTERM gets the guard's one line."""
    import subprocess
    import sys

    script = (
        "import signal\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "from lab import startup\n"
        "startup.guard_imports()\n"
        "print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN,"
        " signal.getsignal(signal.SIGTERM) is startup._import_exit)\n"
        "startup.imports_done()\n"
        "print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN,"
        " signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)\n"
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert p.stdout.split() == ["True"] * 4, (p.stdout, p.stderr)


@pytest.mark.parametrize("command", [["lab.run", "steps=2"], ["lab.tools.launch", "steps=2"]])
def test_a_signal_pending_as_a_command_starts_again_is_taken(tmp_path, command):
    """A signal that comes while a lab command starts itself again (its allocator in huge
    pages) is held pending across the exec and taken once its handlers are set: one line and
    exit 130, not lost (the command ran to its end) nor a traceback."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", *command, f"out_dir={tmp_path}", "name=pending"]
    script = (
        "import os, signal, sys\n"
        "signal.signal(signal.SIGINT, signal.SIG_DFL)  # not ignored, as a background job's\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\n"
        "os.kill(os.getpid(), signal.SIGINT)  # pending, as one that came during the exec\n"
        f"os.execv(sys.executable, {argv!r})\n"
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == 130, (p.stdout, p.stderr)
    assert p.stderr.startswith("SIGINT: exiting; nothing was written"), p.stderr


_HELD_HANGS = """
import os
from lab import startup

startup.install()
startup._SAYING_WAIT_S = 1.0  # the bound on waiting for a held write, short for the test
startup.note("the write that hung is not whole")
r, w = os.pipe()
with startup.held():  # a write that must be whole, and hangs (a dead network disk)
    print("writing", flush=True)
    os.read(r, 1)
"""


def test_a_second_signal_ends_a_held_write_that_hangs():
    """A signal during a held write waits for its end; a second one, when the write hangs,
    ends the process within the bounded wait, with its line."""
    import signal
    import time

    p = _python(_HELD_HANGS)
    assert p.stdout.readline().strip() == "writing"
    p.send_signal(signal.SIGTERM)
    time.sleep(1.5)
    assert p.poll() is None  # the first waits for the write
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    assert err == "SIGINT: exiting; the write that hung is not whole\n", err


_LOCK_HELD = """
import os, signal, threading, time
from lab import startup

startup.install()
startup.note("the rows so far are kept")
console = threading.RLock()  # rich's console's lock: held while a progress line is written

def show():  # a stop's table of the rows so far
    with console:
        print("the table so far", flush=True)

startup.keep_on_stop(["row"], lambda taken: print("records of", taken, flush=True))
startup.on_stop(show)
r, w = os.pipe()
threading.Thread(target=lambda: (time.sleep(0.3), os.write(w, b"x")), daemon=True).start()
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # the kernel picks another thread
with console:
    print("go", flush=True)
    os.read(r, 1)  # the line's write, not interrupted: the signal comes here
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    time.sleep(5)  # Python again, the lock still held: the handler runs here
"""


def test_a_signal_is_the_main_threads_while_it_runs_python():
    """A signal the kernel gives another thread while the main thread holds a lock the stop's
    writes need (the console's, during a progress line) is taken by the main thread once it
    runs Python again: the watcher does not start the stop itself, wait on that lock and keep
    the main thread waiting on it in turn (the ceilings, stopped, hung this way)."""
    import signal
    import time

    p = _python(_LOCK_HELD)
    assert p.stdout.readline().strip() == "go"
    t0 = time.perf_counter()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 143, err
    assert out == "the table so far\nrecords of ['row']\n", out
    assert err == "SIGTERM: exiting; the rows so far are kept\n"
    assert time.perf_counter() - t0 < 5, "the stop waited for a lock instead of taking it"


def test_a_signal_after_a_command_has_finished_keeps_its_exit_code(tmp_path):
    """A Ctrl-C while a command's process shuts down, its work done and its last line said
    (here an atexit hook holds the shutdown), exits quietly with the command's own code, not
    as interrupted (130, with no line, or a traceback out of the shutdown)."""
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "sitecustomize.py").write_text(  # an exit hook that runs last (registered
        "import atexit, signal, time\n"  # first), as the native libraries' teardown does
        "def last():\n"
        "    print('ignored', signal.getsignal(signal.SIGINT) is signal.SIG_IGN, flush=True)\n"
        "    time.sleep(3)\n"
        "atexit.register(last)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.Popen(
        [sys.executable, "-m", "experiments.compare", "dirs=nowhere"],  # exit 2, one line
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    line = p.stderr.readline()
    assert line.startswith("error: ") and "nowhere" in line, line
    time.sleep(0.5)  # in the exit hook's sleep, past the command's end
    p.send_signal(signal.SIGINT)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2, (p.returncode, err)
    assert err == "" and "ignored True" in out, (out, err)


_FINISHED = """
import sys
import numpy as np
from lab import startup

startup.install()
# as `python -m lab.tools.x` reads to finished() (set after the import: the lab's start-up
# would start such a command again)
sys.orig_argv, sys.argv = [sys.executable, "-m", "lab.tools.x"], ["lab.tools.x"]
startup.finished(5)  # the command's code, its work done
a = np.ones((8000, 8000), np.float32)
print("go", flush=True)
for _ in range(50):
    a @ a  # the signal comes here: the main thread is inside a native call (seconds each)
"""


def test_a_signal_after_the_finish_ends_a_native_wait_with_the_commands_code():
    """A command finished, its main thread inside a native call (a distributed shutdown's
    wait): the watcher exits with the command's code within its second, not after the call."""
    import signal
    import time

    p = _python(_FINISHED)
    assert p.stdout.readline().strip() == "go"
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 5 and err == "", (p.returncode, err)
    assert time.monotonic() - t0 < 4  # one product of 8000² takes 10 s on 2 cores

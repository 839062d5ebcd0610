"""`python -m lab.tools.launch processes=2 mesh=4x2 steps=20`: one run over N local processes.

Multi-host JAX for real, on one machine: N processes of `python -m lab.run`, each joined by
`jax.distributed` (coordinator on localhost, a free port; gloo collectives on CPU) and each
holding mesh_size/N simulated CPU devices, form one global mesh: the same program a TPU pod
slice or a GPU cluster runs, with every cross-process collective going through the network
stack. Their output is gathered line by line, prefixed with the process id. Takes every key of
lab.run but coordinator, num_processes and process_id, which it sets; without mesh=, the run is
data parallel over the simulated devices (mesh=data:-1), and a mesh must use every device.

What the launcher guarantees, because a process of such a job cannot go on alone (its next
collective waits for every peer, forever):

- A signal to one process stops every process after the same step. The signalled process posts
  the step it will stop after to the runtime's key-value store, every process checks it after
  each step, and each one saves its checkpoint (checkpoint_every > 0) and exits 130/143 there;
  the launcher exits with the same code.
- SIGINT and SIGTERM to the launcher are sent on to every process and end the same way. (A
  process in a join, a compile or its first step when another one stops at once, before
  training, cannot finish it alone: it aborts in the runtime, and the last line says after
  whose end.) A second one is sent on too (lab.run exits at once on a second signal,
  unsaved), and a process still running 5 s later is killed: one blocked inside the runtime
  cannot run its handler, so a second Ctrl-C never waits out coordinator_timeout.
- A process that dies (a crash, SIGKILL, an abort) or stops on its own ends the job: the rest
  are sent SIGTERM at once, and SIGKILL 5 s later if a collective holds them. After a stop
  every process agreed on, or a process that finished, the rest get coordinator_timeout
  seconds to finish too. So every process has ended within coordinator_timeout seconds and
  one step of a signal or of the first one's end, and none waits for a peer that is gone.
- The launcher's last line says which process ended the job and how (its exit code, or the
  signal that killed it), and what became of the others; the exit code is that process's
  (128 + N for a signal N), 124 for timeout=, 0 when every process finished. Where the run
  folder holds a checkpoint, that line ends with the launcher command that resumes it. A process's
  traceback or the runtime's fatal log is shown when that process failed first, and left out
  in one line when it only echoes another's death.
- The processes die with the launcher, even when it is killed with SIGKILL (on Linux the kernel
  signals them, and they stop at an agreed step and save as on SIGTERM): none is left training
  and holding the run folder's lock, and no checkpoint is lost.
- Joining is bounded: a process that cannot join within coordinator_timeout prints one line
  and exits 2 (never the runtime's abort and stack trace), and so does the launcher.
"""

import contextlib
import dataclasses
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax

from lab import checkpoint, loop, rundir, startup
from lab.config import cli, field, make_config, stamped_name
from lab.devices import PARENT_DEATH_SIGNAL, STOP_LINE
from lab.errors import ConfigError
from lab.measure.records import writable_dir
from lab.mesh import MeshSpecError, cpu_devices_for, resolve_shape
from lab.report.format import key_args
from lab.resolve import Request, check_on_cpu, defaults

OWN_KEYS = ("coordinator", "num_processes", "process_id")  # set here, per process
DEFAULT_MESH = "data:-1"  # without mesh=: data parallel over the simulated devices
# gloo's per-connection chatter: one line per peer and collective group (at times cut in two)
NOISE = re.compile(
    r"\s*(\[Gloo\] Rank|\d* ?is connected to \d+ peer ranks"
    r"|Expected number of connected peer ranks is ?: ?\d+)"
)
GRACE_S = 60.0  # after a signal or a stop every process agreed on: time to save and exit
KILL_AFTER_S = 5.0  # after SIGTERM from the launcher: a process blocked in a collective ignores it
# A process's errors once it is dying (a Python traceback, the runtime's fatal log and stack):
# held until it is known whether they are the job's cause or an echo of another's death.
FATAL = re.compile(
    r"(Traceback \(most recent call last\)|\*\*\* Check failure|F\d{4} |E\d{4} .*coordination)"
)
RUNTIME_LOG = re.compile(r"([EWF]\d{4} \d|\s+@\s+0x|\s*\[type\.googleapis)")  # glog, C++ frames
STOP_RE = re.compile(
    re.escape(STOP_LINE)
    .replace(r"\{signal\}", r"(SIG[A-Z]+)")
    .replace(r"\{process\}", r"(\d+)")
    .replace(r"\{step\}", r"(\d+)")
)


@dataclasses.dataclass(frozen=True)
class Options:
    processes: int = field(2, "local jax.distributed processes", min=1)
    timeout: float = field(0.0, "stop every process after this many seconds; 0 = never", min=0.0)
    coordinator_timeout: int = field(
        60,
        "seconds a process waits for the others to join; also the time the others get to "
        "finish once one has finished or stopped at an agreed step",
        min=1,
    )


def free_port() -> int:
    """A TCP port nobody listens on now (the coordinator binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def check(processes: int, keys: dict) -> dict:
    """The lab.run keys every process gets; ConfigError (one line) if they cannot work."""
    clash = [k for k in OWN_KEYS if k in keys]
    if clash:
        raise ConfigError(
            f"{', '.join(clash)}: set by lab.tools.launch for each process; leave out"
        )
    if keys.get("target"):
        raise ConfigError(
            f"target={keys['target']}: a plan for hardware that is not here compiles in one "
            "process and runs nothing: python -m lab.run target=… (without the launcher)"
        )
    if "mesh" not in keys and not keys.get("resume"):  # lab.run's one device cannot be split
        keys = {**keys, "mesh": DEFAULT_MESH}
    # a resume's processes take the run's own keys (Request.resumed): checked as they will run
    asked = Request.of(**keys).resumed().dict()
    cfg = defaults(make_config(**asked))
    loop.check_trains(cfg)  # lab.run's own refusal, before anything is built
    devices = cfg.cpu_devices or cpu_devices_for(cfg.mesh)
    try:
        used = math.prod(resolve_shape(cfg.mesh, devices).values())
    except MeshSpecError as e:
        raise ConfigError(f"{e} (cpu_devices={devices})" if cfg.cpu_devices else str(e)) from None
    if used != devices:  # the mesh takes the first processes' devices: the last hold none of it
        raise ConfigError(
            f"mesh={cfg.mesh} uses {used} of the {devices} devices (cpu_devices={devices}): "
            f"split over {processes} processes, some would hold no device of the mesh; give a "
            f"mesh over all {devices}, or cpu_devices={used}"
        )
    if devices % processes:
        if keys.get("resume") and "mesh" not in keys:  # the run's mesh, not a default
            default = f" (the run's: {Path(cfg.out_dir) / keys.get('name', '') / 'config.json'})"
        elif "mesh" not in asked or asked["mesh"] == DEFAULT_MESH:
            default = " (the default)"
        else:
            default = ""
        raise ConfigError(
            f"processes={processes} does not divide the {devices} "
            f"{'device' if devices == 1 else 'devices'} of mesh={cfg.mesh}"
            f"{default}: every process must hold the same number of devices"
        )
    if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":  # the children's platform, known
        # the weights' split is traced on the model's shapes in this process: on the CPU the
        # children use, never on an accelerator here that they leave alone
        jax.config.update("jax_platforms", "cpu")
        check_on_cpu(Request.of(**asked), devices)  # every process would refuse it alike
    writable_dir(cfg.out_dir)  # refused here, not by one process while the others wait for it
    name = keys.get("name") or stamped_name("launch", cfg.mesh)
    check_folder(Path(cfg.out_dir) / name, cfg)
    return {**keys, "name": name}  # one name for all: process 0 writes the run folder


def check_folder(run_dir: Path, cfg) -> None:
    """What process 0 will check of the run folder, checked here first: a folder another run
    holds (its lock), an earlier run's folder without resume or overwrite, a checkpoints
    folder that cannot be written. Refused by process 0 alone, it would leave the others
    waiting at the runtime's barrier until it aborts them all."""
    if not run_dir.exists():
        return  # a new folder: process 0 creates it
    writable_dir(run_dir)  # a file, a folder that cannot be written: one line
    with checkpoint.Lock(run_dir):  # held a moment: a folder a live run holds is refused now
        pass
    if not (cfg.resume or cfg.overwrite):
        rundir.check_fresh(run_dir)
    if cfg.checkpoint_every or cfg.resume:
        checkpoint.check_folder(run_dir)
    loop.refused_resume(cfg, run_dir)  # no checkpoint, or steps= not past it


def resume_hint(processes: int, keys: dict, since: float | None = None) -> str:
    """The launcher command that resumes the job's run folder from its newest checkpoint
    (resume=true takes the keys config.json keeps: the folder's name= and out_dir= are all it
    needs, with steps= where this launch gave one), or "" where the folder holds none saved
    since `since` (a time.time()): a job stopped before it saved anything (while starting,
    compiling, or in a refused overwrite) has nothing new to resume, and the command it was
    started with is the one to run again."""
    try:
        asked = Request.of(**keys).resumed().dict() if keys.get("resume") else keys
        cfg = defaults(make_config(**asked))
        run_dir = Path(cfg.out_dir) / cfg.name
        saved = checkpoint.saved_steps(run_dir)
        if saved and since is not None:
            newest = checkpoint.folder(run_dir) / str(saved[-1])
            saved = saved if newest.stat().st_mtime >= since else []
    except (ConfigError, OSError):  # a folder damaged on the way: its own lines say so
        return ""
    if not saved:
        return ""
    args = [f"processes={processes}", f"name={cfg.name}"]
    if "out_dir" in keys:
        args.append(f"out_dir={cfg.out_dir}")
    args.append("resume=true")
    if "steps" in keys and saved[-1] < cfg.steps:  # the steps this launch asked for
        args.append(f"steps={cfg.steps}")
    further = ""
    if saved[-1] >= cfg.steps:  # at its end: a resume needs steps= past it
        args.append("steps=N")
        further = f" (N > {cfg.steps}: the run reached its steps={cfg.steps})"
    command = shlex.join(["python", "-m", "lab.tools.launch", *args])
    return f"to resume from checkpoint step {saved[-1]}: {command}{further}"


def commands(processes: int, keys: dict, port: int, join_timeout: int = 60) -> list[list[str]]:
    own = {"coordinator": f"localhost:{port}", "num_processes": processes}
    own["coordinator_timeout"] = join_timeout
    return [
        [sys.executable, "-m", "lab.run", *key_args({**keys, **own, "process_id": i})]
        for i in range(processes)
    ]


# Run before a child's own command (Linux): the kernel sends it PARENT_DEATH_SIGNAL when the
# launcher dies, even by SIGKILL, which no handler sees; the setting survives the exec, and
# lab.run stops on that signal as on SIGTERM, however many times it comes. A trampoline, not a
# preexec_fn: forking a process that runs threads (JAX's) and then running Python is unsafe.
# The launcher starts it with SIGINT and SIGTERM blocked (`_signals_held`), so that one sent
# on while a child's interpreter starts waits instead of killing that start (Python's "Fatal
# Python error: init_import_site"); a lab command unblocks them once its handlers are set
# (lab.startup.install), any other command as it starts.
_DIE_WITH_PARENT = f"""import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.{PARENT_DEATH_SIGNAL}, 0, 0, 0)  # PDEATHSIG
if os.getppid() != int(sys.argv[1]):  # the launcher died before the call: nobody would tell
    sys.exit(143)
if sys.argv[3:5] != ["-m", "lab.run"]:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))
os.execv(sys.argv[2], sys.argv[2:])
"""


@contextlib.contextmanager
def _signals_held():
    """SIGINT and SIGTERM blocked in this thread while it starts the processes (Linux, where
    the trampoline unblocks them): the processes inherit the block; one that reaches the
    launcher meanwhile is taken once they have started."""
    if not sys.platform.startswith("linux"):
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _dies_with_launcher(cmd: list[str]) -> list[str]:
    """`cmd`, started so that it stops like a signalled process when the launcher dies instead
    of training on as an orphan that holds the run folder's lock."""
    if not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]


def _fate(code: int) -> str:
    if code == -signal.SIGABRT:
        return "aborted in the runtime (SIGABRT)"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    if code > 128 and code - 128 in (signal.SIGINT, signal.SIGTERM):
        return f"stopped on {signal.Signals(code - 128).name} (exit {code})"
    said = {0: "finished", 2: "exited 2 (a user error: its line is above)"}
    return said.get(code, f"exited {code}")


class _Job:
    """N processes, their output relayed line by line (`[pI] `), and what became of each."""

    def __init__(self, cmds: list[list[str]], out, grace_s: float):
        # the processes are this launcher's, joined at its coordinator: not the tasks of a
        # SLURM job the launcher may run in, whose variables JAX's cluster detection reads
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["JAX_PLATFORMS"] = os.environ.get("JAX_PLATFORMS", "cpu")
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.out, self.grace_s, self.lock = out, grace_s, threading.Lock()
        self.ended: dict[int, float] = {}  # process → when its output ended (monotonic)
        self.signalled: dict[int, tuple[str, int]] = {}  # process → (signal, agreed stop step)
        self.stopped: dict[int, set] = {}  # process → the signals the launcher sent it
        # a process group of its own: a Ctrl-C in the terminal reaches the launcher only,
        # which forwards it once to each child
        with _signals_held():
            self.procs = [
                subprocess.Popen(
                    _dies_with_launcher(cmd),
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    errors="replace",
                    start_new_session=True,
                )
                for cmd in cmds
            ]
        self.pumps = [
            threading.Thread(target=self._pump, args=(i,), daemon=True)
            for i in range(len(self.procs))
        ]
        for t in self.pumps:
            t.start()

    def _write(self, i: int, line: str) -> None:
        with self.lock:
            self.out.write(f"[p{i}] {line}")
            self.out.flush()

    def _failed_before(self, i: int) -> int | None:
        """Another process that has already ended badly on its own (not stopped by the
        launcher): i's errors are then the echo of its end."""
        for j, p in enumerate(self.procs):
            if j != i and j not in self.stopped and p.poll() not in (None, 0):
                return j
        return None

    def _pump(self, i: int) -> None:
        held: list[str] = []  # a dying process's errors, kept until we know whose fault
        for line in self.procs[i].stdout:
            if NOISE.match(line):
                continue
            # a stop a process posts on a signal of its own; one the launcher's stop caused
            # (another process had died: this one was told to end) is not the job's cause
            if (m := STOP_RE.search(line)) and int(m[2]) not in self.stopped:
                self.signalled[int(m[2])] = (m[1], int(m[3]))
            if held or FATAL.match(line):
                held.append(line)
            elif RUNTIME_LOG.match(line) and self._failed_before(i) is not None:
                continue  # the runtime's complaints about a peer that is gone
            else:
                self._write(i, line)
        self.ended.setdefault(i, time.monotonic())
        if held:
            other = self._failed_before(i)
            if other is None:  # this process failed first: its errors are the story
                for line in held:
                    self._write(i, line)
            else:
                self._write(
                    i,
                    f"({len(held)} lines of errors left out: this process cannot go on "
                    f"without process {other})\n",
                )

    def alive(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p.poll() is None]

    def first_end(self) -> int | None:
        """The process that ended first (by its output's end, which its exit closes)."""
        done = [i for i, p in enumerate(self.procs) if p.poll() is not None]
        return min(done, key=lambda i: self.ended.get(i, time.monotonic())) if done else None

    def stop(self, sig=signal.SIGTERM) -> None:
        for i in self.alive():
            self.stopped.setdefault(i, set()).add(sig)
            self.procs[i].send_signal(sig)

    def join(self) -> None:
        for p in self.procs:
            p.wait()
        for t in self.pumps:
            t.join(timeout=5)

    def fates(self, skip: int | None = None) -> str:
        parts = []
        for i, p in enumerate(self.procs):
            if i == skip:
                continue
            rc, sent = p.returncode, self.stopped.get(i, set())
            by = next((s for s in sent if rc in (-s, 128 + s)), None)
            how = f"was stopped by the launcher ({by.name})" if by else _fate(rc)
            before = [j for j in self.ended if j != i and self.ended[j] < self.ended.get(i, 0)]
            if rc == -signal.SIGABRT and before:  # a collective or join that lost its peer
                how += f" once process {min(before, key=self.ended.get)} had ended"
            parts.append(f"process {i} {how}")
        return "; ".join(parts)


class _Forward:
    """SIGINT/SIGTERM to the launcher → the same signal to every child (which checkpoints and
    exits); the launcher then waits for them instead of leaving them orphaned."""

    def __init__(self, job: _Job):
        self.job, self.signal, self.count, self._old = job, None, 0, {}
        self.sent = False  # whether a signal went on to a process still running

    def __enter__(self):
        startup.imports_done()  # the handlers put back after the job: Python's, not the guard's
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (tests): nothing to forward
                pass
        return self

    def _handle(self, signum, _frame):
        self.signal = self.signal or signum  # the first one names the end
        self.count += 1
        for i in self.job.alive():
            self.sent = True
            self.job.procs[i].send_signal(signum)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def run(
    cmds: list[list[str]],
    *,
    timeout_s: float | None = None,
    grace_s: float = GRACE_S,
    out=None,
    err=None,
    then=None,
) -> int:
    """Start every process, relay their output prefixed `[pI] `, return the job's exit code
    and say in one line on `err` how it ended when it did not end well (see the module's
    docstring for the guarantees). `then()`, called once every process has ended, gives what
    that line ends with (how to go on), or ""."""
    out, err = out or sys.stdout, err or sys.stderr
    job = _Job(cmds, out, grace_s)
    try:
        with _Forward(job) as fwd:
            cause = _wait(job, timeout_s, grace_s, fwd)
    finally:
        for i in job.alive():  # the launcher itself failed: never leave a child behind
            job.procs[i].kill()
        job.join()
    code, line = _verdict(job, cause, timeout_s, fwd)
    if line and then is not None and (more := then()):
        line = f"{line}; {more}"
    if line:
        with job.lock:
            print(f"launch: {line}", file=err, flush=True)
    return code


def _wait(job: _Job, timeout_s: float | None, grace_s: float, fwd: _Forward) -> str | None:
    """Wait until every process has ended, stopping the rest once one has (see the module's
    docstring); what ended the job first: "signal", "process", "timeout" or None."""
    start = time.monotonic()
    stop_at = kill_at = None  # when the rest get SIGTERM, then SIGKILL
    cause = None  # "signal" | "process" | "timeout": what ended the job first
    while job.alive():
        now = time.monotonic()
        if cause is None:
            first = job.first_end()
            if fwd.signal is not None:  # the children were told: give them time to save
                cause, stop_at = "signal", now + grace_s
            elif first is not None:
                cause = "process"
                # it finished, or stopped at the step every process agreed on: the rest are
                # finishing too. Anything else: the rest wait for it in a collective, forever.
                rc = job.procs[first].returncode
                agreed = rc == 0 or (job.signalled and rc in (130, 143))
                stop_at = now + grace_s if agreed else now
            elif timeout_s is not None and now > start + timeout_s:
                cause, stop_at = "timeout", now
        if fwd.count > 1 and kill_at is None:  # a second signal: sent on, then no grace
            kill_at = now + KILL_AFTER_S
        if stop_at is not None and kill_at is None and now >= stop_at:
            job.stop()
            kill_at = now + KILL_AFTER_S
        if kill_at is not None and now >= kill_at:
            job.stop(signal.SIGKILL)
            kill_at = float("inf")
        time.sleep(0.1)
    if cause is None and fwd.sent:  # they ended on it before the loop looked again
        cause = "signal"
    return cause


def _verdict(job: _Job, cause, timeout_s, fwd: _Forward) -> tuple[int, str]:
    """(the launcher's exit code, its last line: '' when every process finished)."""
    codes, fates = [p.returncode for p in job.procs], job.fates()
    if cause == "signal":
        name = signal.Signals(fwd.signal).name
        if fwd.count > 1:
            return 128 + fwd.signal, (
                f"{name} to the launcher, then another: each sent on to every process, and any "
                f"still running {KILL_AFTER_S:g} s after the second is killed: {fates}"
            )
        return 128 + fwd.signal, f"{name} to the launcher, sent on to every process: {fates}"
    if cause == "timeout":
        return 124, f"timeout={timeout_s:g} s reached: stopped every process ({fates})"
    if not any(codes):
        return 0, ""
    if job.signalled:  # a signal to one process: every process was to stop at the posted step
        i = min(job.signalled, key=lambda j: job.signalled[j][1])
        name, step = job.signalled[i]
        if all(c in (130, 143) for c in codes):
            how = f"every process stopped after step {step} ({fates})"
        else:
            how = f"every process was to stop after step {step}; {fates}"
        return 128 + signal.Signals[name].value, f"process {i} got {name}: {how}"
    # the first process to end badly on its own is the cause; the others' ends follow from it
    bad = sorted((i for i in range(len(codes)) if codes[i]), key=lambda i: job.ended.get(i, 0))
    first = next((i for i in bad if i not in job.stopped), bad[0])
    code = 128 - codes[first] if codes[first] < 0 else codes[first]
    if first in job.stopped:  # none failed: this one was still running after the others ended
        return code, f"process {first} had not ended {job.grace_s:g} s after the others; {fates}"
    return code, f"process {first} {_fate(codes[first])}; {job.fates(skip=first)}"


def main(argv=None) -> int:
    def launch(o: Options, keys: dict) -> int:
        keys = check(o.processes, keys)
        cmds = commands(o.processes, keys, free_port(), o.coordinator_timeout)
        n = f"{o.processes} process{'es' if o.processes != 1 else ''}"
        started = time.time()
        print(f"launching {n} of lab.run: {' '.join(key_args(keys))}")
        sys.stdout.flush()
        return run(
            cmds,
            timeout_s=o.timeout or None,
            grace_s=o.coordinator_timeout,
            then=lambda: resume_hint(o.processes, keys, since=started),
        )

    return cli(
        Options,
        launch,
        prog="python -m lab.tools.launch",
        doc=__doc__,
        argv=argv,
        run_keys=True,
        guarded=True,  # until its processes start, a signal ends it in one line
    )


if __name__ == "__main__":
    from lab.report.progress import survive_lost_output

    survive_lost_output()  # a reader gone (| head) loses no records or report
    sys.exit(main())

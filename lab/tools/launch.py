"""`python -m lab.tools.launch processes=2 mesh=4x2 steps=20`: one run over N local processes.

Multi-host JAX for real, on one machine: N processes of `python -m lab.run`, each joined by
`jax.distributed` (coordinator on localhost, a free port; gloo collectives on CPU) and each
holding mesh_size/N simulated CPU devices, form one global mesh: the same program a TPU pod
slice or a GPU cluster runs, with every cross-process collective going through the network
stack. Their output is gathered line by line, prefixed with the process id. The exit code is
the first failure's, and the others are stopped at once (they would wait for it forever).
SIGINT and SIGTERM sent to the launcher reach every process: each finishes its step, saves a
checkpoint when checkpointing is on, and exits (130/143), and so does the launcher. Takes every
key of lab.run but coordinator, num_processes and process_id, which it sets.
"""

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from lab.config import cli, field, make_config
from lab.errors import ConfigError
from lab.measure.records import writable_dir
from lab.mesh import known_size
from lab.report.format import key_args

OWN_KEYS = ("coordinator", "num_processes", "process_id")  # set here, per process
NOISE = ("[Gloo] Rank",)  # gloo's per-connection chatter: one line per peer, per collective group
GRACE_S = 60.0  # after forwarding a signal: time for every process to save and exit


@dataclasses.dataclass(frozen=True)
class Options:
    processes: int = field(2, "local jax.distributed processes", min=1)
    timeout: float = field(0.0, "stop every process after this many seconds; 0 = never", min=0.0)
    coordinator_timeout: int = field(
        60, "seconds each process waits for the others to join before giving up", min=1
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
    cfg = make_config(**keys)
    devices = cfg.cpu_devices or known_size(cfg.mesh)
    if devices % processes:
        raise ConfigError(
            f"processes={processes} does not divide the {devices} devices of mesh={cfg.mesh}: "
            "every process must hold the same number of devices"
        )
    writable_dir(cfg.out_dir)  # refused here, not by one process while the others wait for it
    name = keys.get("name") or f"launch-{cfg.mesh}-{time.strftime('%Y%m%d-%H%M%S')}"
    return {**keys, "name": name}  # one name for all: process 0 writes the run folder


def commands(processes: int, keys: dict, port: int, join_timeout: int = 60) -> list[list[str]]:
    own = {"coordinator": f"localhost:{port}", "num_processes": processes}
    own["coordinator_timeout"] = join_timeout
    return [
        [sys.executable, "-m", "lab.run", *key_args({**keys, **own, "process_id": i})]
        for i in range(processes)
    ]


def _pump(stream, prefix: str, out, lock: threading.Lock) -> None:
    for line in stream:
        if line.lstrip().startswith(NOISE):
            continue
        with lock:
            out.write(f"{prefix}{line}")
            out.flush()


class _Forward:
    """SIGINT/SIGTERM to the launcher → the same signal to every child (which checkpoints and
    exits); the launcher then waits for them instead of leaving them orphaned."""

    def __init__(self, procs):
        self.procs, self.signal, self._old = procs, None, {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (tests): nothing to forward
                pass
        return self

    def _handle(self, signum, _frame):
        self.signal = signum
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def run(cmds: list[list[str]], *, timeout_s: float | None = None, out=None) -> int:
    """Start every process, relay their output prefixed `[pI] `, return the first non-zero
    exit code (0 if all succeed); once one fails or time runs out, the rest are stopped."""
    out = out or sys.stdout
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    env.setdefault("PYTHONUNBUFFERED", "1")
    lock = threading.Lock()
    procs, pumps = [], []
    for i, cmd in enumerate(cmds):
        # a process group of its own: a Ctrl-C in the terminal reaches the launcher only,
        # which forwards it once to each child
        p = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        t = threading.Thread(target=_pump, args=(p.stdout, f"[p{i}] ", out, lock), daemon=True)
        t.start()
        procs.append(p)
        pumps.append(t)
    with _Forward(procs) as fwd:
        code = _wait(procs, timeout_s, fwd)
    for t in pumps:
        t.join(timeout=5)
    return code


def _wait(procs, timeout_s: float | None, fwd: _Forward) -> int:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    late = False
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if fwd.signal is not None:  # the children were told: give them time to save
            deadline = min(deadline or float("inf"), time.monotonic() + GRACE_S)
            if all(c is not None for c in codes):
                break
        elif failed:
            break
        late = deadline is not None and time.monotonic() > deadline
        if late or all(c == 0 for c in codes):
            break
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if fwd.signal is not None:
        return 128 + fwd.signal
    if late and not failed:
        return 124
    return failed[0] if failed else 0


def main(argv=None) -> int:
    def launch(o: Options, keys: dict) -> int:
        keys = check(o.processes, keys)
        cmds = commands(o.processes, keys, free_port(), o.coordinator_timeout)
        print(f"launching {o.processes} processes of lab.run: {' '.join(key_args(keys))}")
        sys.stdout.flush()
        return run(cmds, timeout_s=o.timeout or None)

    return cli(
        Options, launch, prog="python -m lab.tools.launch", doc=__doc__, argv=argv, run_keys=True
    )


if __name__ == "__main__":
    sys.exit(main())

"""`python -m lab.launch --processes 2 -- mesh=4x2 steps=20`: one run over N local processes.

Multi-host JAX for real, on one machine: N processes of `python -m lab.run`, each joined by
`jax.distributed` (coordinator on localhost, a free port; gloo collectives on CPU) and each
holding mesh_size/N simulated CPU devices, form one global mesh: the same program a TPU pod
slice or a GPU cluster runs, with every cross-process collective going through the network
stack. Their output is gathered line by line, prefixed with the process id; the exit code is
the first failure's (the others are stopped, since they would wait for it forever).
"""

import argparse
import os
import socket
import subprocess
import sys
import threading
import time

from lab.config import ConfigError, parse_args
from lab.mesh import MeshSpecError, known_size

OWN_KEYS = ("coordinator", "num_processes", "process_id")  # set here, per process


def free_port() -> int:
    """A TCP port nobody listens on now (the coordinator binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def check(processes: int, run_args: list[str]) -> list[str]:
    """The lab.run arguments every process gets; ConfigError (one line) if they cannot work."""
    if processes < 1:
        raise ConfigError(f"--processes {processes}: must be >= 1")
    given = {a.split("=", 1)[0].strip() for a in run_args}
    clash = [k for k in OWN_KEYS if k in given]
    if clash:
        raise ConfigError(f"{', '.join(clash)}: set by lab.launch for each process; leave out")
    cfg = parse_args(run_args)
    try:
        devices = known_size(cfg.mesh)
    except MeshSpecError as e:
        raise ConfigError(f"mesh={cfg.mesh}: {e}") from None
    devices = cfg.cpu_devices or devices
    if devices % processes:
        raise ConfigError(
            f"--processes {processes} does not divide the {devices} devices of mesh={cfg.mesh}: "
            "every process must hold the same number of devices"
        )
    name = [] if "name" in given else [f"name=launch-{cfg.mesh}-{time.strftime('%Y%m%d-%H%M%S')}"]
    return [*run_args, *name]  # one name for all: process 0 writes the run folder


def commands(processes: int, run_args: list[str], port: int) -> list[list[str]]:
    coordinator = [f"coordinator=localhost:{port}", f"num_processes={processes}"]
    return [
        [sys.executable, "-m", "lab.run", *run_args, *coordinator, f"process_id={i}"]
        for i in range(processes)
    ]


NOISE = ("[Gloo] Rank",)  # gloo's per-connection chatter: one line per peer, per collective group


def _pump(stream, prefix: str, out, lock: threading.Lock) -> None:
    for line in stream:
        if line.lstrip().startswith(NOISE):
            continue
        with lock:
            out.write(f"{prefix}{line}")
            out.flush()


def run(cmds: list[list[str]], *, timeout_s: float | None = None, out=None) -> int:
    """Start every process, relay their output prefixed `[pI] `, return the first non-zero
    exit code (0 if all succeed); once one fails or time runs out, the rest are stopped."""
    out = out or sys.stdout
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    env.setdefault("PYTHONUNBUFFERED", "1")
    lock = threading.Lock()
    procs, pumps = [], []
    for i, cmd in enumerate(cmds):
        p = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        t = threading.Thread(target=_pump, args=(p.stdout, f"[p{i}] ", out, lock), daemon=True)
        t.start()
        procs.append(p)
        pumps.append(t)
    code = _wait(procs, timeout_s)
    for t in pumps:
        t.join(timeout=5)
    return code


def _wait(procs, timeout_s: float | None) -> int:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        late = deadline is not None and time.monotonic() > deadline
        if failed or late or all(c == 0 for c in codes):
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
    if late and not failed:
        return 124
    return failed[0] if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, run_args = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    p = argparse.ArgumentParser(prog="python -m lab.launch", description=__doc__.split("\n")[0])
    p.add_argument("--processes", type=int, default=2, help="local jax.distributed processes")
    p.add_argument("--timeout", type=float, default=None, help="stop every process after S s")
    args = p.parse_args(own)
    try:
        run_args = check(args.processes, run_args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"launching {args.processes} processes of lab.run: {' '.join(run_args)}", flush=True)
    return run(commands(args.processes, run_args, free_port()), timeout_s=args.timeout)


if __name__ == "__main__":
    sys.exit(main())

"""Which devices the run has, and getting them ready before JAX starts its backends.

Two things must happen before the first JAX operation: `jax.distributed.initialize` (the
multi-controller runtime that joins hosts into one set of global devices) and, on CPU, the
number of simulated devices. `prepare` does both; `describe` reports what came of it.

A process joins when given coordinator= (and num_processes=, process_id=), when it is one task
of a SLURM step of several tasks (`srun python -m lab.run …`: `slurm_step` checks SLURM's
variables and reads the coordinator, the step's first node; JAX's own SLURM detection fills
the process count and id), or on a multi-host TPU slice.

Joining never ends in the runtime's C++ abort (a stack trace, exit 134), and is bounded by
coordinator_timeout. A process that joins first waits for the coordinator's port, in Python: a
coordinator that never answers is a ConfigError in the caller (from a command, one line and exit
2). The wait inside JAX's runtime that follows (process 0 for its peers, the others for the rest
to register) cannot be interrupted from Python, and the runtime itself aborts the process when
its timeout runs out; so a watchdog thread ends the process first, with one line and exit 2,
from library code as from a command: no exception reaches the caller. Once joined, a process whose
peer dies mid-run is not left blocked in a collective until the runtime aborts it: `PeerWatch`
ends it in one line, exit 1, naming what the run folder keeps. (gloo, the CPU collectives, can
still end a survivor at once in its own abort when a peer's connection breaks mid-transfer.)
Once joined, `agreed_stop`
makes a signal to any one process stop every process after the same step, and `agreed_folder`
gives every process process 0's run folder, or its refusal.
"""

import atexit
import contextlib
import dataclasses
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path

import jax
from jax._src import distributed as _distributed  # the key-value store of the runtime
from jax._src.clusters.slurm_cluster import SlurmCluster  # JAX's own reading of SLURM's variables

from lab.config import check_coordinator
from lab.errors import ConfigError
from lab.mesh import cpu_devices_for
from lab.startup import (
    PARENT_DEATH_SIGNAL,  # noqa: F401 - where the launcher and loop find it
    command,
    in_huge_pages,
    last_words,
    signals_read,
)


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What the run header prints about the hardware."""

    backend: str  # cpu | gpu | tpu
    device_kind: str  # jax's device_kind, the key of the spec table
    count: int  # global devices over all processes
    local_count: int  # devices attached to this process
    process_count: int  # jax.distributed processes (hosts)
    process_index: int  # this process
    simulated: bool  # CPU devices beyond one share the same cores: simulated
    aot: bool = False  # a target compiled for ahead of time (lab/plans): nothing runs
    joined: str = ""  # how the processes found each other when not through coordinator=

    def header(self) -> str:
        sim = " (simulated CPU devices)" if self.simulated else ""
        sim = " (ahead-of-time target: compiled, not run)" if self.aot else sim
        hosts = f", {self.process_count} processes" if self.process_count > 1 else ""
        if hosts and self.joined:
            hosts = f", joined {self.process_count} processes {self.joined}"
        # the host's allocator decides how fast XLA:CPU gets its temporaries (lab.startup)
        pages = " · allocator in huge pages" if self.backend == "cpu" and in_huge_pages() else ""
        return f"{self.backend} · {self.device_kind} × {self.count}{sim}{hosts}{pages}"


def _tpu_pod() -> bool:
    """A multi-host TPU slice: GKE lists several worker hostnames in TPU_WORKER_HOSTNAMES; a
    Cloud TPU VM's workers are in its metadata server (`worker-network-endpoints`), which JAX's
    own TPU cluster detection reads (its private module: asked only on a machine with TPU chips,
    and any failure to read it is taken as a single host)."""
    if "," in os.environ.get("TPU_WORKER_HOSTNAMES", ""):
        return True
    try:
        from jax._src.clusters import cloud_tpu_cluster as tpu

        if not tpu.running_in_cloud_tpu_vm or not tpu.GceTpuCluster.is_env_present():
            return False
        return len(tpu.GceTpuCluster._get_worker_list_in_slice()) > 1
    except Exception:  # noqa: BLE001 — a private module that moves between versions
        return False


STOP_KEYS = "lab/stop/"  # where a signalled process posts "STEP SIGNAL" in the key-value store
STOP_LINE = "{signal} to process {process}: every process stops after step {step}"
FOLDER_KEYS = "lab/folder/"  # where each process posts its verdict on the run folder


def _reach(coordinator: str, deadline: float) -> bool:
    """Wait until the coordinator accepts a TCP connection, or until `deadline` (a
    time.monotonic() time): whether it did. A process that joins before process 0 listens
    would otherwise wait inside the runtime, where no Python code can stop the wait."""
    host, _, port = coordinator.rpartition(":")
    while (left := deadline - time.monotonic()) > 0:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(2, left)):
                return True
        except OSError:
            time.sleep(max(0.0, min(0.5, deadline - time.monotonic())))
    return False


def _resolve(coordinator: str, where: str) -> None:
    """ConfigError (one line) for a host name that does not resolve: the runtime would retry
    it until its timeout and then abort."""
    host, _, port = coordinator.rpartition(":")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except OSError as e:
        raise ConfigError(f"{where}: unknown host {host!r} ({e})") from None


def _check_port_free(coordinator: str, where: str) -> None:
    """Process 0 serves the coordinator on its port, on every interface: a port another
    server listens on is one line here. The runtime's server binds with SO_REUSEPORT, so a
    second job's process 0 would share a live job's port and the two jobs' processes join each
    other's (one aborts), and a listener with SO_REUSEADDR crashed the runtime (SIGSEGV)."""
    import errno

    port = int(coordinator.rpartition(":")[2])
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is free
            if family == socket.AF_INET6:  # both families, whatever net.ipv6.bindv6only says
                with contextlib.suppress(OSError, AttributeError):
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                probe.bind((host, port))
                probe.listen(1)
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    continue  # not this family's to judge (an address it cannot bind)
                # a SLURM job's port is derived from its id, unless JAX_COORDINATOR_PORT says
                fix = (
                    "export JAX_COORDINATOR_PORT=<a free port> before srun"
                    if where.startswith("SLURM")
                    else "give coordinator= a free port"
                )
                raise ConfigError(
                    f"{where}: port {port} is already in use on this host (another job's "
                    f"coordinator, or another server): {fix}"
                ) from None
            return  # IPv6's wildcard covers IPv4 too where dual-stack; else IPv4's is tried


def _an_address_here(coordinator: str) -> bool:
    """Whether the coordinator's host is an address of this host (one of its addresses binds),
    as it should be for process 0, which serves the coordinator. Only a definite "cannot
    assign that address" counts as not; anything else is taken as here. Not a refusal: a
    forwarded or NAT address is reached by the others and never bound here."""
    import errno

    host = coordinator.rpartition(":")[0].strip("[]")
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return True
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((addr[0], 0))
            return True
        except OSError as e:
            if e.errno != errno.EADDRNOTAVAIL:
                return True
    return False


@dataclasses.dataclass(frozen=True)
class _Join:
    """One process's join, and the words its errors use."""

    where: str  # what the user gave: "coordinator=HOST:PORT" or the SLURM job
    coordinator: str  # host:port of process 0's coordination service
    num_processes: int
    process_id: int
    start_hint: str  # how to start every process the same way
    kwargs: dict  # for jax.distributed.initialize, besides the timeouts


def _join_timeout(j: _Join, timeout_s: int, reached) -> str:
    """The one line for a join that did not finish within timeout_s."""
    where = f"{j.where}: process {j.process_id} of {j.num_processes}"
    if not reached.is_set():
        return (
            f"{where} could not reach the coordinator within {timeout_s} s "
            f"(coordinator_timeout={timeout_s}): is process 0 started and the address right?"
        )
    waited = "for the other processes to join" if j.process_id == 0 else "to join"
    if j.process_id == 0 and not _an_address_here(j.coordinator):
        # the others reach whatever host the address names, not this process's coordinator
        return (
            f"{where} waited {timeout_s} s (coordinator_timeout={timeout_s}) {waited}: "
            f"{j.coordinator} is not an address of this host (process 0 runs the "
            "coordinator): give process 0's own address"
        )
    return (
        f"{where} waited {timeout_s} s (coordinator_timeout={timeout_s}) {waited}; {j.start_hint}, "
        "or raise coordinator_timeout="
    )


@contextlib.contextmanager
def _a_signal_ends_the_wait(line):
    """While the main thread waits inside JAX's runtime (a join), a signal's Python handler
    cannot run until the wait ends, coordinator_timeout later: a Ctrl-C or a scheduler's
    SIGTERM (scancel) would be held that long and then hidden by the timeout's line. Here a
    thread reads the signals from the interpreter's wakeup descriptor, which its C handler
    writes at once, runs what the command registered to keep on a stop (startup.on_stop: an
    empty results folder it made goes) and ends the process with `line(signal name)` on
    stderr, exit 130 (SIGINT) or 143. Nothing has run yet. Only in a lab command's main
    thread: a program that imports the lab keeps its own handlers and wakeup descriptor."""
    import signal

    if not command():
        yield
        return

    ends = {int(signal.SIGINT): 130, int(signal.SIGTERM): 143}
    ends[int(signal.Signals[PARENT_DEATH_SIGNAL])] = 143  # the launcher died: as SIGTERM

    def on_signal(signum: int) -> None:
        if signum in ends:
            name = "SIGTERM" if ends[signum] == 143 and signum != signal.SIGTERM else None
            name = name or signal.Signals(signum).name
            last_words()
            with contextlib.suppress(OSError):
                os.write(2, f"error: {line(name)}\n".encode())
            os._exit(ends[signum])

    with signals_read(on_signal):
        yield


def _watchdog(timeout_s: float, line) -> threading.Timer:
    """A timer that ends this process with `line()` and exit 2 unless cancelled within
    timeout_s: it bounds a wait inside JAX's runtime, which Python cannot interrupt (the caller's
    thread is blocked in C++) and which itself ends later in a C++ abort with a stack trace. A
    thread can still print while the main thread is blocked inside the runtime. In library code
    (not a lab command) the line says why no exception reached the caller."""

    def give_up():
        why = "" if command() else " (JAX's runtime cannot be interrupted: the process ends)"
        print(f"error: {line()}{why}", file=sys.stderr, flush=True)
        os._exit(2)

    timer = threading.Timer(timeout_s, give_up)
    timer.daemon = True
    timer.start()
    return timer


# --- SLURM: the variables JAX's SLURM detection reads (jax/_src/clusters/slurm_cluster.py) ---


@dataclasses.dataclass(frozen=True)
class SlurmStep:
    """One task of a SLURM step of several tasks, its variables checked."""

    job: str  # SLURM_JOB_ID: JAX derives the coordinator's port from it
    tasks: int  # SLURM_NTASKS: the process count
    task: int  # SLURM_PROCID: this process's id
    node_list: str  # SLURM_STEP_NODELIST: the coordinator is on its first node
    coordinator: str  # host:port: that node, and the port JAX derives from the job

    def joined(self) -> str:
        where = f"job {self.job}, node list {self.node_list}, coordinator {self.coordinator}"
        return f"through SLURM ({where})"


# A SLURM node list ("node001,gpu[003-005,007]", "rack[1-2]-node[01-04]"), and a host name
# with a letter in it (an all-digit name like "001" would be taken for an IP address).
_RANGES = r"\[\d+(-\d+)?(,\d+(-\d+)?)*\]"
_NAME = rf"([A-Za-z0-9._-]|{_RANGES})+"
_NODE_LIST = re.compile(rf"{_NAME}(,{_NAME})*")
_HOST = re.compile(r"(?=.*[A-Za-z])[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")


def _node_names(node_list: str) -> list[str]:
    """The names of a node list (SLURM's hostlist expression), each a run of literal text and
    bracket groups (`rack[1-2]-node[01-04]` is 8 names)."""
    return [m.group(0) for m in re.finditer(_NAME, node_list)]


def _ranges(group: str) -> list[tuple[int, int, int]]:
    """(first, last, digits) of each range of a bracket group's "01-04,07"; a range that runs
    down is refused (SLURM's own hostlist refuses it too)."""
    out = []
    for part in group.split(","):
        lo, _, hi = part.partition("-")
        if int(hi or lo) < int(lo):
            raise ValueError(part)
        out.append((int(lo), int(hi or lo), len(lo)))  # a bound's digits are its zero padding
    return out


def _first_host_and_count(node_list: str) -> tuple[str, int]:
    """The first host of a SLURM node list and how many hosts it names, as SLURM expands it:
    every bracket group of a name (`rack[1-2]-node[01-04]` starts at rack1-node01), with the
    zero padding of each range's bounds. ValueError for a list that is not one."""
    if not _NODE_LIST.fullmatch(node_list):
        raise ValueError(node_list)
    first, count = "", 0
    for i, name in enumerate(_node_names(node_list)):
        host, n = "", 1
        for text, group in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", name):
            host += text
            if group:
                ranges = _ranges(group)
                lo, _, digits = ranges[0]
                host += str(lo).zfill(digits)
                n *= sum(hi - lo + 1 for lo, hi, _ in ranges)
        first, count = first if i else host, count + n
    return first, count


def _tasks_on_node(env, tasks: int, nodes: int) -> int:
    """The most tasks this task's node runs: from SLURM_STEP_TASKS_PER_NODE ("2(x3),1") where
    it reads, else what the step's counts allow (every other node runs at least one)."""
    per_node = []
    for part in env.get("SLURM_STEP_TASKS_PER_NODE", "").split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if not m:
            per_node = []
            break
        per_node += [int(m.group(1))] * int(m.group(2) or 1)
    node = env.get("SLURM_NODEID", "")
    if per_node and node.isascii() and node.isdigit() and int(node) < len(per_node):
        return per_node[int(node)]
    return max(per_node) if per_node else tasks - nodes + 1


def _slurm_int(env, name: str, low: int, high: int | None = None, why: str = "") -> int:
    value = env.get(name)
    if value is None:
        raise ConfigError(f"{name} is unset in a SLURM step of several tasks ({why})")
    if (
        not (value.isascii() and value.isdigit())
        or int(value) < low
        or (high is not None and int(value) >= high)
    ):
        bound = f"in {low}..{high - 1}" if high is not None else f"≥ {low}"
        raise ConfigError(f"{name}={value!r} is not a whole number {bound} ({why})")
    return int(value)


def slurm_step() -> SlurmStep | None:
    """This process as a task of a SLURM step of several tasks; None outside SLURM or for a
    single task. ConfigError (one line) for variables JAX could not use: it would fail on them
    with a traceback, or wait for processes that never come."""
    env = os.environ  # what JAX reads
    if "SLURM_JOB_ID" not in env or "SLURM_NTASKS" not in env:
        return None
    tasks = _slurm_int(env, "SLURM_NTASKS", 1, why="the number of processes to join")
    if tasks == 1:
        return None
    job = env["SLURM_JOB_ID"]
    if "SLURM_STEP_NODELIST" not in env:
        raise ConfigError(
            f"SLURM job {job} has SLURM_NTASKS={tasks} but this process is not a task of an "
            "srun step (no SLURM_STEP_NODELIST): start every task with srun (srun python -m "
            "lab.run …), or give coordinator=, num_processes= and process_id="
        )
    task = _slurm_int(env, "SLURM_PROCID", 0, tasks, why=f"this task's id, of SLURM_NTASKS={tasks}")
    port = env.get("JAX_COORDINATOR_PORT")
    if port is None:
        _slurm_int(env, "SLURM_JOB_ID", 0, why="JAX derives the coordinator's port from it")
    elif not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise ConfigError(f"JAX_COORDINATOR_PORT={port!r}: the port must be a number in 1..65535")
    node_list = env["SLURM_STEP_NODELIST"]
    given = env.get("JAX_COORDINATOR_ADDRESS")  # initialize() prefers it to SLURM's
    try:
        host, hosts = _first_host_and_count(node_list)
    except ValueError:
        host, hosts = "", 0
    # an address given by hand is the way round node names the lab cannot read: then the node
    # list is checked only where it reads
    if not given and not _HOST.fullmatch(host):
        raise ConfigError(
            f"SLURM_STEP_NODELIST={node_list!r} is not a node list the coordinator's host can be "
            "taken from (its first node): expected host names like node001,node002, "
            "node[001-004] or rack[1-2]-node[01-04]"
        )
    nodes = hosts or 1
    if "SLURM_STEP_NUM_NODES" in env:
        nodes = _slurm_int(env, "SLURM_STEP_NUM_NODES", 1, why="the step's number of nodes")
        if hosts and nodes != hosts:
            raise ConfigError(
                f"SLURM_STEP_NODELIST={node_list!r} names {hosts} node{'s' * (hosts != 1)} but "
                f"SLURM_STEP_NUM_NODES={nodes}: the step's variables disagree (set by hand?)"
            )
    if nodes > tasks:
        raise ConfigError(
            f"SLURM_STEP_NODELIST={node_list!r} names {nodes} nodes for SLURM_NTASKS={tasks} "
            "tasks: every node of a step runs at least one task"
        )
    on_node = _tasks_on_node(env, tasks, nodes)
    _slurm_int(
        env,
        "SLURM_LOCALID",
        0,
        on_node,
        why=f"this task's index on its node, which runs at most {on_node} of the step's tasks",
    )
    if given:
        check_coordinator(given, "JAX_COORDINATOR_ADDRESS")
        return SlurmStep(job, tasks, task, node_list, given)
    # the node list's first host, and the port JAX derives from the job (or its override)
    port = SlurmCluster.get_coordinator_address(None, override_coordinator_port=port)
    return SlurmStep(job, tasks, task, node_list, f"{host}:{port.rpartition(':')[2]}")


def _init_distributed(
    coordinator: str, num_processes: int, process_id: int, timeout_s: int = 60
) -> None:
    if coordinator:
        # CPU processes need a collectives library to talk; gloo ships with jaxlib.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        given = dict(coordinator_address=coordinator, num_processes=num_processes)
        j = _Join(
            where=f"coordinator={coordinator}",
            coordinator=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            start_hint="start every process with the same coordinator= and num_processes=",
            kwargs={**given, "process_id": process_id},
        )
        _join(j, timeout_s)
    elif step := slurm_step():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        j = _Join(
            where=f"SLURM job {step.job}, coordinator {step.coordinator} "
            f"(SLURM_STEP_NODELIST={step.node_list})",
            coordinator=step.coordinator,
            num_processes=step.tasks,
            process_id=step.task,
            start_hint=f"every one of the step's SLURM_NTASKS={step.tasks} tasks must run lab.run",
            # the coordinator the lab read (JAX's own reading takes only a name's first bracket
            # group: "rack1" of rack[1-2]-node[01-04]); JAX's SLURM detection fills the count
            # and id (named, so that no other cluster whose variables are set is taken first)
            kwargs={
                "coordinator_address": step.coordinator,
                "cluster_detection_method": SlurmCluster.name,
            },
        )
        _join(j, timeout_s)
    elif _tpu_pod():
        _join_tpu_slice(timeout_s)


def _join_tpu_slice(timeout_s: int) -> None:
    """A TPU slice's workers describe themselves (the metadata server, GKE's variables), and
    the join is bounded like any other: one line and exit 2 if a worker is missing."""
    _no_preemption_notifier()
    where = "this TPU slice's workers"
    timer = _watchdog(
        timeout_s,
        lambda: (
            f"{where}: not every worker joined within {timeout_s} s (coordinator_timeout=); "
            "start lab.run on every worker at once (tpu/run.sh runs it with --worker=all)"
        ),
    )
    try:
        jax.distributed.initialize(
            initialization_timeout=timeout_s, shutdown_timeout_seconds=min(timeout_s, 30)
        )
    except Exception as e:  # noqa: BLE001 — the runtime raises XlaRuntimeError and others
        first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{where}: this worker could not join ({first})") from None
    finally:
        timer.cancel()


def _no_preemption_notifier() -> None:
    """The runtime's preemption notifier takes SIGTERM for itself and swallows it (a process
    signalled before the training loop would never stop); `agreed_stop` does its work."""
    jax.config.update("jax_enable_preemption_service", False)


ALIVE_KEYS = "lab/alive/"  # each joined process's beat counter, "done" once it ends cleanly
PEER_LOST_S = 30.0  # a peer silent this long is lost (JAX's own heartbeat timeout is 100 s)
BEAT_S = 1.0


class PeerWatch:
    """Ends this process in one line (exit 1) when a peer of the job is gone.

    A process that dies (SIGKILL, a crash, a host lost) leaves its peers blocked in their next
    collective until JAX's distributed service misses its heartbeats (100 s) and aborts them in
    the runtime: a fatal log, a stack trace, exit 134. JAX's runtime takes a callback for that
    moment, but it cannot call Python (the status it passes has no Python type: std::bad_cast,
    then std::terminate). So the lab keeps its own beat in the runtime's key-value store: each
    process counts up every BEAT_S seconds and watches the others' counts. A peer whose count
    has not moved for `lost_s` seconds (by this process's clock: no clocks are compared), or a
    coordinator that has not answered for as long, ends this process with the line, before the
    runtime's abort. The watch judges only while this process trains: each process leaves
    its loop at the same step (`left_loop`), and what follows (the last save, a summary) may
    take any time without a peer being judged lost; it beats on until the process exits,
    when it posts "done". A peer that left earlier (a refusal, a failed write) is named as
    ended: it is lost all the same, as this process's next collective would wait for it."""

    def __init__(self, client, j: _Join, lost_s: float = PEER_LOST_S, beat_s: float = BEAT_S):
        self.client, self.j, self.lost_s, self.beat_s = client, j, lost_s, beat_s
        self.kept = None  # a callable naming what the run folder keeps (set by the loop)
        self.count = 0
        now = time.monotonic()
        self.answered = now  # the coordinator's last answer
        self.seen: dict[str, tuple[str, float]] = {}  # peer key → (its value, when it changed)
        self.lock = threading.Lock()  # `seen` is written by the beat and read by the judge
        self.idle = threading.Event()  # set once this process has left its training loop
        self.started = now
        self.done = threading.Event()

    def start(self) -> "PeerWatch":
        for target in (self._beat, self._judge):
            threading.Thread(target=target, daemon=True, name="lab-peer-watch").start()
        return self

    def _beat(self) -> None:
        me = f"{ALIVE_KEYS}{self.j.process_id}"
        while not self.done.wait(self.beat_s):
            try:
                self.count += 1
                self.client.key_value_set(me, str(self.count), allow_overwrite=True)
                if self.done.is_set():  # stop() posted "done" while this count was on its way
                    self.client.key_value_set(me, "done", allow_overwrite=True)
                    return
                posted = dict(self.client.key_value_dir_get(ALIVE_KEYS))
            except Exception:  # noqa: BLE001 — the coordinator gone: _judge decides when
                continue
            now = time.monotonic()
            self.answered = now
            with self.lock:
                for key, value in posted.items():
                    if key != me and self.seen.get(key, ("", 0.0))[0] != value:
                        self.seen[key] = (value, now)

    def lost(self, now: float) -> str | None:
        """Why this process must end now, or None."""
        if now - self.answered > self.lost_s:
            return (
                f"the coordinator ({self.j.coordinator}, process 0) has not answered for "
                f"{self.lost_s:g} s"
            )
        with self.lock:
            seen = dict(self.seen)
        # a peer's silence counts only while the coordinator answers: with the coordinator
        # gone, every count stops and the coordinator is what was lost
        answered = self.answered
        quiet = {
            int(key.rsplit("/", 1)[-1]): value
            for key, (value, when) in seen.items()
            if answered - when > self.lost_s
        }
        if answered - self.started > 2 * self.lost_s:  # never heard from at all
            heard = {int(key.rsplit("/", 1)[-1]) for key in seen}
            others = set(range(self.j.num_processes)) - {self.j.process_id}
            quiet.update({p: "" for p in others - heard})
        ended = sorted(p for p, v in quiet.items() if v == "done")
        silent = sorted(p for p, v in quiet.items() if v != "done")
        why = []
        if silent:
            which = ", ".join(str(p) for p in silent)
            why.append(f"process {which} has been silent for {self.lost_s:g} s")
        if ended:
            which = ", ".join(str(p) for p in ended)
            why.append(f"process {which} ended more than {self.lost_s:g} s ago, mid-run")
        return "; ".join(why) or None

    def _judge(self) -> None:
        while not self.done.wait(self.beat_s):
            try:
                why = self.lost(time.monotonic())
            except Exception:  # noqa: BLE001 — a watch that fails must not end a healthy job
                continue
            if why and not self.done.is_set() and not self.idle.is_set():
                self._end(why)

    def _end(self, why: str, cause: str = ": it died, was killed or cannot be reached") -> None:
        try:
            kept = self.kept() if self.kept else ""
        except Exception:  # noqa: BLE001 — the folder's state is a courtesy: the line must go out
            kept = ""
        print(
            f"error: {self.j.where}: process {self.j.process_id} of {self.j.num_processes} "
            f"lost its peers ({why}{cause}); this process "
            f"cannot go on alone{'; ' + kept if kept else ''}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    def stop(self) -> None:
        """This process ends cleanly: its peers are told, and the watch stops."""
        if self.done.is_set():
            return
        self.done.set()
        with contextlib.suppress(Exception):
            self.client.key_value_set(
                f"{ALIVE_KEYS}{self.j.process_id}", "done", allow_overwrite=True
            )


_WATCH: list[PeerWatch] = []


def left_loop() -> None:
    """This process has left its training loop: its watch stops judging its peers (every
    process leaves at the same step; what follows, the last save or a summary, may take any
    time) and beats on until the process exits."""
    for w in _WATCH:
        w.idle.set()


# what a collective over gloo, or the runtime's coordination service, says when a peer is
# gone, in their own words only: "connection reset" alone is also what a storage write says
_PEER_GONE = re.compile(r"\bGloo [\w-]+ failed\b|stopped sending heartbeats")


def peer_gone(e: BaseException | str) -> str | None:
    """Why `e` (an error or its text) means a peer of this multi-process job is gone, in a few
    words, or None (one process, or another error). A collective over gloo fails at once when
    a peer's connection drops, well before the peer watch judges the peer silent."""
    text = str(e)
    if not _WATCH or not _PEER_GONE.search(text):
        return None
    said = re.sub(r"\[[^\]]*\.(cc|h):\d+\]\s*", "", text)  # gloo's source file and line
    line = next((x.strip() for x in said.splitlines() if _PEER_GONE.search(x)), "")
    line = re.sub(r"^.*?\b(?=gloo\b)", "", line, flags=re.IGNORECASE)  # from gloo's own words
    line = re.sub(r"^[A-Z_]+:\s*", "", line)  # the runtime's status code
    while line.count(")") > line.count("("):  # the close of a message it was quoted in
        line = line[: line.rindex(")")]
    return f"a collective failed, {line[:160]}: a peer died, was killed or cannot be reached"


def leave_now(why: str) -> None:
    """Ends this process in the peer watch's line (exit 1) for `why` (peer_gone's words).

    Not through the interpreter's exit: at exit JAX's runtime waits in a shutdown barrier for
    every process of the job, up to 30 s for the one that is gone, and then aborts this one
    with a page of its own log (exit 134) over the line."""
    for w in _WATCH:
        w.idle.set()
        w._end(why, cause="")


def on_peer_lost(kept) -> None:
    """`kept()` names what the run folder keeps, for the line printed if a peer is lost."""
    for w in _WATCH:
        w.kept = kept


def _watch_peers(j: _Join) -> None:
    client = getattr(_distributed.global_state, "client", None)
    if client is None or j.num_processes < 2:
        return
    w = PeerWatch(client, j).start()
    _WATCH.append(w)
    atexit.register(w.stop)


def _join(j: _Join, timeout_s: int) -> None:
    """Join within timeout_s: a ConfigError where the join fails before JAX's runtime waits
    (a host that does not resolve, a port in use, a coordinator that never answers); past
    that, the watchdog's line and exit 2 (the module's docstring says why)."""
    _no_preemption_notifier()
    deadline = time.monotonic() + timeout_s
    reached = threading.Event()
    try:
        _resolve(j.coordinator, j.where)
        if j.process_id == 0:
            _check_port_free(j.coordinator, j.where)
        elif not _reach(j.coordinator, deadline):
            raise ConfigError(_join_timeout(j, timeout_s, reached))
        reached.set()
        left = max(deadline - time.monotonic(), 0.1)
        timer = _watchdog(left, lambda: _join_timeout(j, timeout_s, reached))
        who = f"{j.where}: process {j.process_id} of {j.num_processes}"
        try:
            with _a_signal_ends_the_wait(lambda sig: f"{who}: {sig} while joining: nothing ran"):
                jax.distributed.initialize(
                    **j.kwargs,
                    initialization_timeout=timeout_s,
                    shutdown_timeout_seconds=min(timeout_s, 30),
                )
        finally:
            timer.cancel()
        _watch_peers(j)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 — the runtime raises XlaRuntimeError and others
        first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        slurm = sorted(k for k in os.environ if k.startswith("SLURM_"))
        read = f" (JAX also reads {', '.join(slurm[:3])}{', …' if len(slurm) > 3 else ''})"
        raise ConfigError(
            f"{j.where}: process {j.process_id} of {j.num_processes} could not "
            f"join ({first}){read if slurm else ''}; is the address right and every process "
            "started?"
        ) from None


def agreed_stop(stop, step: int, ahead: int = 1) -> bool:
    """Asked by the training loop after it has queued `step`: stop after it? The same answer
    on every process. `stop.signal` is the name of the signal this process got (or None); a
    process that got none takes the name of the one every process stops on.

    One process stops on its own signal at once. Several must stop after the same step, or
    one waits in its checkpoint save (or its exit) for a peer blocked in the next step's
    collectives: a signalled process posts step + `ahead` to the runtime's key-value store
    (its peers may already be inside the `ahead` steps after this one, and none can finish
    them without this process), and every process stops once the earliest posted step is
    reached. `ahead` is 1 for a loop that waits for each step before queuing the next, 2 for
    one that reads each step's results one step late."""
    client = _distributed.global_state.client
    if client is None:
        return stop.signal is not None
    me = f"{STOP_KEYS}{jax.process_index()}"
    posted = dict(client.key_value_dir_get(STOP_KEYS))
    if stop.signal and me not in posted:
        posted[me] = f"{step + ahead} {stop.signal}"
        client.key_value_set(me, posted[me])
        at = step + ahead
        line = STOP_LINE.format(signal=stop.signal, process=jax.process_index(), step=at)
        with contextlib.suppress(OSError):  # the launcher that reads it may be gone
            print(line, file=sys.stderr, flush=True)
    if not posted:
        return False
    at, name = min((int(v.split()[0]), v.split()[1]) for v in posted.values())
    if step < at:
        return False
    stop.signal = stop.signal or name
    return True


# Process 0 writes a token here in the run folder it claimed while the others check they see the
# same folder (removed once every process has answered)
JOIN_FILE = ".lab-join"


def agreed_folder(claim, follow, timeout_s: int, keys: dict | None = None, shared: bool = False):
    """The run folder every process of a run uses, or one refusal for all of them.

    Process 0 chooses and checks the folder (`claim()` → (cfg, run_dir); a name lab.run chose
    may take -2, -3, …, and each process stamps its own name in its own second); every other
    process takes the name process 0 posts in the runtime's key-value store and checks what it
    needs itself (`follow(name)` → (cfg, run_dir)). Each posts its verdict, and each waits for
    every other's: one process alone refusing (an earlier run there, a live run's lock, a
    folder it cannot write) would leave its peers waiting in their first collective until the
    runtime aborts them. A refusal is a ConfigError on every process, naming the process that
    refused; `timeout_s` bounds each wait. `keys` (the run's resolved keys, flat) are compared
    with process 0's: processes started with different keys would train different programs
    in lockstep (replicas drifting apart unseen) or abort at the end in the runtime's
    barrier, so a difference is one line on every process.

    `shared`: every process writes into the folder (its part of each checkpoint), so each must
    see process 0's: process 0 leaves a token in it (JOIN_FILE) and `follow(name, token)` checks
    it reads the same, instead of a first save that waits for parts written elsewhere."""
    import json
    import secrets

    client = _distributed.global_state.client
    if client is None or jax.process_count() == 1:
        return claim()
    me, n = jax.process_index(), jax.process_count()

    def post(verdict: dict) -> None:
        client.key_value_set(f"{FOLDER_KEYS}{me}", json.dumps(verdict))

    def read(i: int) -> dict:
        try:
            return json.loads(client.blocking_key_value_get(f"{FOLDER_KEYS}{i}", timeout_s * 1000))
        except Exception:  # noqa: BLE001 — the runtime raises XlaRuntimeError on its deadline
            raise ConfigError(
                f"process {me} of {n}: process {i} did not say within {timeout_s} s whether it "
                "can use the run folder (did it fail or stop?)"
            ) from None

    def refused(i: int, verdict: dict) -> ConfigError:
        return ConfigError(f"process {i} of {n} refused the run: {verdict['error']}")

    if me != 0 and "error" in (first := read(0)):
        raise refused(0, first)
    if me != 0 and (theirs := first.get("keys")) is not None and keys is not None:
        differ = sorted(k for k in {*keys, *theirs} if keys.get(k) != theirs.get(k))
        if differ:
            shown = "; ".join(
                f"{k}: {theirs.get(k)!r} on process 0, {keys.get(k)!r} on process {me}"
                for k in differ[:3]
            )
            more = f"; and {len(differ) - 3} more" if len(differ) > 3 else ""
            why = f"the processes were started with different keys ({shown}{more})"
            post({"error": why})
            raise ConfigError(f"{why}: start every process with the same keys")
    token = joined = None
    try:
        if me == 0:
            result = claim()
            if shared:
                token, joined = secrets.token_hex(8), Path(result[1]) / JOIN_FILE
                try:
                    joined.write_text(token)
                except OSError as e:  # a full disk: refused as a folder that cannot be used
                    raise ConfigError(f"run folder {result[1]}: cannot write in it ({e})") from None
        else:
            result = follow(first["name"], first.get("token"))
    except BaseException as e:  # its own refusal, failure or Ctrl-C: the others are told
        post({"error": str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})
        raise
    try:
        post({"name": result[0].name, "keys": keys, "token": token})
        for i in range(n):
            if i != me and "error" in (verdict := read(i)):
                raise refused(i, verdict)
    finally:
        if joined is not None:
            joined.unlink(missing_ok=True)
    return result


def check_joined(run_dir: Path, token: str | None, otherwise: str = "", wait_s: float = 10.0):
    """ConfigError unless `run_dir` holds process 0's token (agreed_folder's JOIN_FILE): this
    process writes its part of each checkpoint there, and a folder process 0 cannot see would
    leave the first save waiting for parts that never arrive. A network file system may show a
    new file a few seconds late: read again for up to `wait_s`. `otherwise`: the other way out
    (", or give checkpoint_every=0")."""
    if token is None:
        return
    path = Path(run_dir) / JOIN_FILE
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if path.read_text().strip() == token:
                return
        except OSError:
            pass
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    raise ConfigError(
        f"process {jax.process_index()} does not see process 0's run folder at {run_dir}: "
        "every process writes and reads its part of each checkpoint there, so out_dir= must be "
        f"a folder all hosts share (a network file system){otherwise}"
    )


# Simulated CPU devices per process. XLA:CPU runs a collective's participants on one thread
# each and waits for all of them: past a few hundred devices a training step's all-reduce
# waited for threads that never came, and the runtime aborted the process with a stack trace
# per thread (lab.run mesh=N batch_size=N seq_len=2 n_layers=1 steps=3 on a 2-core VM: 1,024
# and 512 aborted, 512 also with steps=1 beside other work; 384 and 256 ran, in 17-29 s). A
# plain psum across 1,024 ran: the bound is a training step's, kept with a margin, and holds
# for every command (the count is set once per process, before any program is known).
MAX_CPU_DEVICES = 256


def started_line(count: int) -> str:
    """Why the simulated CPU devices cannot be changed now that JAX has created `count`."""
    devices = f"{count} CPU device{'' if count == 1 else 's'}"
    return (
        f"JAX has already started with {devices}: cpu_devices must be set before JAX's first "
        "use; or call jax.config.update('jax_num_cpu_devices', N) right after importing jax, "
        "or set XLA_FLAGS=--xla_force_host_platform_device_count=N before importing it"
    )


def _set_cpu_devices(n: int, given: int = 0) -> bool:
    """Simulate `n` CPU devices in this process. JAX reads the count once, when its backends
    start: after that (e.g. under the test conftest, or after a library caller's first JAX
    operation) the count is JAX's. False where it then differs on CPU (the mesh's size is
    checked against the devices present, and the line says why there are not more); a
    ConfigError where cpu_devices= (`given`) asked for another count. True otherwise."""
    try:
        jax.config.update("jax_num_cpu_devices", n)
        return True
    except RuntimeError:  # the backends have started
        pass
    present = jax.local_device_count()
    if jax.default_backend() != "cpu" or present == n:
        return True
    if given:
        raise ConfigError(f"cpu_devices={given}: {started_line(present)}")
    return False


JOIN_KEYS = "lab/join/"  # where each process started by hand posts the keys that size its devices


def _agree_on_join(keys: dict, me: int, n: int, timeout_s: int) -> None:
    """A ConfigError on every process where processes started by hand (coordinator=) were given
    different `keys` that size the job (num_processes, mesh, cpu_devices), before anything
    counts the devices: the coordinator takes process 0's count, so a process told another
    count (or another mesh) makes its own share of devices, and the run was then refused for
    a batch that does not split over a device count nobody asked for. Process 0 reads every
    other process's keys, the others read process 0's, through the runtime's key-value
    store."""
    import json

    client = getattr(_distributed.global_state, "client", None)
    if client is None:
        return
    client.key_value_set(f"{JOIN_KEYS}{me}", json.dumps(keys))
    for i in range(1, n) if me == 0 else (0,):
        try:
            theirs = json.loads(client.blocking_key_value_get(f"{JOIN_KEYS}{i}", timeout_s * 1000))
        except Exception:  # noqa: BLE001 — the runtime raises XlaRuntimeError on its deadline
            raise ConfigError(
                f"process {me} of {n}: process {i} joined but did not say its keys within "
                f"{timeout_s} s (did it fail or stop?)"
            ) from None
        differ = [k for k in keys if keys[k] != theirs.get(k)]
        if differ:
            low, high = sorted((me, i))
            mine_low = me == low
            shown = "; ".join(
                f"{k}: {(keys if mine_low else theirs)[k]!r} on process {low}, "
                f"{(theirs if mine_low else keys)[k]!r} on process {high}"
                for k in differ
            )
            raise ConfigError(
                f"the processes were started with different keys ({shown}): start every "
                "process with the same keys"
            )


def prepare(
    mesh: str,
    *,
    cpu_devices: int = 0,
    coordinator: str = "",
    num_processes: int = 1,
    process_id: int = 0,
    coordinator_timeout: int = 60,
    join: bool = True,
) -> bool:
    """Call before any JAX operation: joins hosts (unless `join` is false: this process
    alone, as for a request that cannot run), then sizes the simulated CPU devices; False
    where JAX had already started on CPU with another count (`started_line` says why), and
    a ConfigError where cpu_devices= asked for one in so many words.

    A join is bounded by coordinator_timeout: a coordinator that never answers is a
    ConfigError, but once inside JAX's runtime the wait cannot be interrupted from Python,
    and a join that does not finish ends the process with one line and exit 2 (the module's
    docstring says why), from library code as from a command."""
    if not coordinator and (step := slurm_step()):
        num_processes = step.tasks  # checked here, before the size check that divides by it
    wanted = cpu_devices or cpu_devices_for(mesh)
    if wanted // max(num_processes, 1) > MAX_CPU_DEVICES and jax.config.jax_platforms in (
        None,
        "",
        "cpu",
    ):
        what = f"cpu_devices={cpu_devices}" if cpu_devices else f"mesh={mesh}"
        raise ConfigError(
            f"{what}: {wanted:,} simulated CPU devices per process is more than the "
            f"{MAX_CPU_DEVICES:,} whose collectives XLA:CPU runs reliably (past a few hundred "
            "a step's all-reduce can wait forever on threads, and the runtime aborts); use a "
            "smaller mesh, or plan a big slice with target=tpu:… / target=gpu:…"
        )
    if join:
        _init_distributed(coordinator, num_processes, process_id, coordinator_timeout)
        if coordinator and num_processes > 1:
            keys = {"num_processes": num_processes, "mesh": mesh, "cpu_devices": cpu_devices}
            _agree_on_join(keys, process_id, num_processes, coordinator_timeout)
    if wanted > 1 or cpu_devices:
        return _set_cpu_devices(max(1, wanted // num_processes), cpu_devices)
    return True


def describe() -> DeviceInfo:
    devices = jax.devices()
    backend = jax.default_backend()
    return DeviceInfo(
        backend=backend,
        device_kind=devices[0].device_kind,
        count=len(devices),
        local_count=jax.local_device_count(),
        process_count=jax.process_count(),
        process_index=jax.process_index(),
        simulated=backend == "cpu" and len(devices) > 1,
        joined=_joined(),
    )


def _joined() -> str:
    """How the processes joined when JAX's SLURM detection set the coordinator, else ""."""
    coordinator = _distributed.global_state.coordinator_address
    with contextlib.suppress(ConfigError):  # joined by coordinator=: SLURM's variables unused
        step = slurm_step()
        if step and coordinator == step.coordinator:
            return step.joined()
    return ""


def describe_target(devices: list) -> DeviceInfo:
    """A slice known only from its topology (lab/plans): compiled for, never run on."""
    n = len(devices)
    return DeviceInfo(
        backend={"cuda": "gpu", "rocm": "gpu"}.get(devices[0].platform, devices[0].platform),
        device_kind=devices[0].device_kind,
        count=n,
        local_count=n,
        process_count=1,
        process_index=0,
        simulated=False,
        aot=True,
    )

"""lab.tools.launch: two jax.distributed processes of four simulated devices each train exactly like
one process of eight; bad input and failing processes end with a clear non-zero exit."""

import fcntl
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab import checkpoint, devices
from lab.config import make_config
from lab.run import main as run_main
from lab.tools import launch

TINY = ["model=tiny", "n_layers=1", "batch_size=8", "seq_len=16", "log_every=1", "steps=3"]


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").open()]


def test_two_processes_train_like_one(tmp_path, capsys):
    """... and save a checkpoint at every step. Four layers make ~80 leaves whose checksums
    are each a program with collectives between the processes: run at once, as XLA:CPU runs
    independent programs, they paired up wrongly and the job hung at its first save (jax
    0.10, 4 of 4 tries; the launcher's timeout= ends it here instead)."""
    tiny = [k for k in TINY if not k.startswith("n_layers=")] + ["n_layers=4", "checkpoint_every=1"]
    args = [*tiny, "mesh=4x2", f"out_dir={tmp_path}"]
    assert launch.main(["processes=2", "timeout=150", *args, "name=two"]) == 0
    out = capsys.readouterr().out
    assert "[p0]" in out and "2 processes" in out  # the run header counts the hosts
    assert checkpoint.saved_steps(tmp_path / "two") == [1, 2, 3]
    assert run_main([*args, "name=one"]) == 0
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(two) == 3
    assert two == pytest.approx(one, rel=1e-5)  # gloo may sum in another order


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["processes=3", "mesh=4x2"], "processes=3 does not divide the 8 devices"),
        (["processes=2", "mesh=1"], "processes=2 does not divide the 1 device of mesh=1"),
        (["mesh=8", "cpu_devices=16"], "mesh=8 uses 8 of the 16 devices (cpu_devices=16)"),
        (["mesh=8", "cpu_devices=3"], "mesh=8 needs 8 devices but only 3 are present"),
        (["processes=2", "mesh=4x2", "process_id=1"], "process_id: set by lab.tools.launch"),
        (["processes=2", "mesh=4x2", "stepz=3"], "unknown key 'stepz'"),
        (["processes=0", "mesh=4x2"], "must be >= 1"),
        # a rule between keys: refused before any process starts, not once by each
        (["processes=2", "mesh=4x2", "batch_size=8", "accumulate=3"], "must divide batch_size=8"),
        # lab.run's own refusal of a run that trains nothing: before any process starts
        (["processes=2", "mesh=4x2", "steps=0"], "steps=0 trains nothing: give steps >= 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    assert launch.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_without_a_mesh_the_launch_is_data_parallel_over_the_devices():
    assert launch.check(2, {"steps": 3})["mesh"] == "data:-1"
    assert launch.check(2, {"mesh": "4x2"})["mesh"] == "4x2"


def test_a_run_folder_process_0_would_refuse_is_refused_before_any_process_starts(tmp_path, capsys):
    """An earlier run's folder, one a live run holds, a checkpoints folder that is a file:
    process 0 alone would refuse them and leave the others at the runtime's barrier."""
    from lab import checkpoint

    run = tmp_path / "R"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    argv = ["processes=2", "mesh=2", f"out_dir={tmp_path}", "name=R", "steps=2"]
    assert launch.main(argv) == 2
    assert "already holds a run" in capsys.readouterr().err
    with checkpoint.Lock(run):
        assert launch.main([*argv, "overwrite=true"]) == 2
        err = capsys.readouterr().err
        assert "is in use by pid" in err and err.count("\n") == 1
    (run / "checkpoints").write_text("")
    assert launch.main([*argv, "overwrite=true", "checkpoint_every=1"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    (tmp_path / "F").write_text("")  # the run folder itself a file
    assert launch.main([*argv[:-2], "name=F", "steps=2"]) == 2
    assert "it is not a folder" in capsys.readouterr().err


def test_a_resume_lab_run_would_refuse_is_refused_before_any_process_starts(
    tmp_path, capsys, monkeypatch
):
    """steps= not past the run's checkpoint: lab.run refuses it from the folder's checkpoint
    steps before it compiles, so the launcher does too, before starting anything."""
    keys = ["model=tiny", "n_layers=1", "batch_size=8", "seq_len=16", "mesh=2"]
    keys += [f"out_dir={tmp_path}", "name=R", "checkpoint_every=2"]
    assert run_main([*keys, "steps=2"]) == 0
    capsys.readouterr()
    started = []
    monkeypatch.setattr(launch, "run", lambda *a, **k: started.append(a) or 0)
    assert launch.main(["processes=2", *keys, "steps=2", "resume=true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "steps=2" in err and not started, err
    # the launcher's last line after a failure names the command that resumes the folder
    hint = launch.resume_hint(2, {"out_dir": str(tmp_path), "name": "R", "resume": True})
    assert hint == (
        f"to resume from checkpoint step 2: python -m lab.tools.launch processes=2 name=R "
        f"out_dir={tmp_path} resume=true steps=N (N > 2: the run reached its steps=2)"
    )
    assert launch.resume_hint(2, {"out_dir": str(tmp_path), "name": "none"}) == ""
    # the steps= a launch gave, which a launch stopped before its processes rewrote
    # config.json would otherwise lose
    given = {"out_dir": str(tmp_path), "name": "R", "resume": True, "steps": 5}
    assert launch.resume_hint(2, given).endswith("resume=true steps=5"), launch.resume_hint(
        2, given
    )
    # nothing saved since the launch started: no command of its own (the user's is the one)
    assert launch.resume_hint(2, given, since=time.time() + 60) == ""
    # a resume's mesh is the run's (config.json), never called a default
    one = [k for k in keys if not k.startswith(("mesh=", "name="))] + ["name=one", "steps=1"]
    assert run_main(one) == 0  # lab.run's default mesh: one device
    capsys.readouterr()
    assert launch.main(["processes=2", *one[:-1], "steps=2", "resume=true"]) == 2
    err = capsys.readouterr().err
    assert f"of mesh=1 (the run's: {tmp_path / 'one' / 'config.json'})" in err, err


def test_weights_the_mesh_cannot_split_are_refused_before_any_process_starts(
    tmp_path, capsys, monkeypatch
):
    """mesh=4x3 puts tiny's 2 kv heads over a model axis of 3: lab.run refuses it once its mesh
    is built, so both processes joined jax.distributed and then each printed the same error.
    The launcher traces the weights' shapes on an abstract mesh and refuses it first."""
    started = []
    monkeypatch.setattr(launch, "run", lambda *a, **k: started.append(a) or 0)
    argv = ["processes=2", "mesh=4x3", "steps=2", "model=tiny", f"out_dir={tmp_path}"]
    assert launch.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not started, err
    needle = "params['block_0']['attn']['wk']: dimension 1 (size 2) does not divide mesh axis"
    assert f"{needle} model (size 3)" in err, err
    assert launch.main([*argv[:1], "mesh=4x2", *argv[2:]]) == 0 and len(started) == 1


def _by_hand(keys_of, n_of=lambda i: 2) -> tuple[list[int], list[str]]:
    """Two lab.run processes started by hand, without the launcher, on a fresh coordinator port:
    `keys_of(i)` gives process i's keys beyond its place in the job, `n_of(i)` the job's size
    it is told (num_processes=). (exit codes, stderrs)."""
    port = launch.free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "lab.run", *keys_of(i)]
            + [f"num_processes={n_of(i)}", f"process_id={i}", f"coordinator=localhost:{port}"],
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (0, 1)
    ]
    errs = [p.communicate(timeout=240)[1] for p in procs]
    return [p.returncode for p in procs], errs


@pytest.mark.once
def test_processes_started_by_hand_share_process_0s_refusal(tmp_path):
    """Without the launcher nothing checks the folder before the processes join: process 0
    refuses an earlier run's folder after the join, and its peer, told through the runtime's
    key-value store, exits with the same line instead of waiting in its first collective."""
    run = tmp_path / "R"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    codes, errs = _by_hand(lambda i: [*TINY, "mesh=4x2", f"out_dir={tmp_path}", "name=R"])
    assert codes == [2, 2], errs
    assert "already holds a run" in errs[0] and errs[0].count("\n") == 1, errs[0]
    assert errs[1].startswith("error: process 0 of 2 refused the run: run folder"), errs[1]
    assert errs[1].count("\n") == 1


def test_the_launchers_processes_do_not_read_a_slurm_jobs_variables(monkeypatch):
    """The processes join the launcher's coordinator: a SLURM job the launcher runs in is not
    theirs (JAX's cluster detection would read SLURM_LOCALID and the rest)."""
    seen = {}

    class Popen:
        def __init__(self, cmd, env, **kw):
            seen.update(env)
            raise OSError("not started")

    monkeypatch.setenv("SLURM_LOCALID", "zz")
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setattr(launch.subprocess, "Popen", Popen)
    with pytest.raises(OSError):
        launch._Job([["true"]], out=None, grace_s=1.0)
    assert seen and not [k for k in seen if k.startswith("SLURM_")]
    assert seen["JAX_PLATFORMS"]


def test_one_failure_stops_the_others_and_sets_the_exit_code():
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    failer = [sys.executable, "-c", "print('boom'); raise SystemExit(3)"]
    out = io.StringIO()
    assert launch.run([sleeper, failer], timeout_s=30, out=out) == 3
    assert "[p1] boom" in out.getvalue()


# A job must end as a whole: a process of it cannot go on alone (its next collective waits for
# every peer), so whatever happens to one process (a signal, SIGKILL, a failed join, its
# launcher killed), every process ends within coordinator_timeout and a step, and one line
# says what happened. The jobs below are tiny and every wait is bounded, so a regression
# fails instead of hanging.

LONG = [*TINY[:-1], "mesh=4x2", "steps=100000", "coordinator_timeout=10"]
JOIN_S = 10  # coordinator_timeout of the jobs below
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _launch(tmp_path: Path, *keys: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lab.tools.launch", "processes=2", *LONG, *keys]
    cmd += [f"out_dir={tmp_path}", "name=J"]
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _training(tmp_path: Path, proc: subprocess.Popen, steps: int = 3, timeout_s: float = 90):
    """Wait until the job has trained `steps` steps; the pids of its lab.run processes."""
    metrics = tmp_path / "J" / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    try:
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.2)
    except AssertionError:  # never leave a job of 100,000 steps training after the test
        proc.kill()  # its processes stop with it (the kernel sends them SIGTERM)
        proc.communicate()
        raise
    pids = _children(tmp_path)
    assert sorted(pids) == [0, 1], pids
    return pids


def _children(tmp_path: Path) -> dict[int, int]:
    """process_id → pid of the lab.run processes that write under tmp_path."""
    ps = subprocess.run(["pgrep", "-af", f"out_dir={tmp_path}"], capture_output=True, text=True)
    found = {}
    for line in ps.stdout.splitlines():
        if "lab.run" in line and "process_id=" in line:
            pid, rest = line.split(" ", 1)
            found[int(rest.split("process_id=")[1].split()[0])] = int(pid)
    return found


def _ended(proc: subprocess.Popen, within_s: float) -> tuple[str, str, float]:
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=within_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the job hung:\n{out[-2000:]}\n{err[-2000:]}") from None
    return out, err, time.monotonic() - t0


@pytest.mark.once  # two processes trained to a signal: the launch itself runs on both legs
@pytest.mark.parametrize("victim", [0, 1])  # process 0 also hosts the coordinator
def test_a_signal_to_one_process_stops_every_process_after_the_same_step(tmp_path, victim):
    proc = _launch(tmp_path, "checkpoint_every=1000")  # the stop's save is the only one
    pids = _training(tmp_path, proc)
    os.kill(pids[victim], signal.SIGTERM)
    out, err, took = _ended(proc, within_s=JOIN_S + 30)
    assert proc.returncode == 143, err[-3000:]
    assert took < JOIN_S + 15  # one step, one save, the runtime's shutdown
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        f"launch: process {victim} got SIGTERM: every process stopped after step"
    ), last
    step = int(last.split("after step ")[1].split()[0])
    assert [int(p.name) for p in (tmp_path / "J" / "checkpoints").iterdir()] == [step]
    assert f"[p0] SIGTERM: checkpoint saved at step {step}" in out
    # how to go on: the processes' launch is never inherited, the run's keys are
    assert f"[p0] to resume from checkpoint step {step}: start the same processes again" in out
    # and the launcher's last line gives its own command for it
    assert last.endswith(
        f"to resume from checkpoint step {step}: python -m lab.tools.launch processes=2 "
        f"name=J out_dir={tmp_path} resume=true steps=100000"  # the steps= it was given
    ), last
    assert "Traceback" not in out + err and "Check failure" not in out + err
    assert not _children(tmp_path)


@pytest.mark.once
@pytest.mark.parametrize("victim", [0, 1])  # process 0 also hosts the coordinator
def test_sigkill_to_one_process_is_named_and_stops_the_rest(tmp_path, victim):
    proc = _launch(tmp_path)
    pids = _training(tmp_path, proc)
    os.kill(pids[victim], signal.SIGKILL)
    out, err, took = _ended(proc, within_s=JOIN_S + 30)
    assert proc.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert took < launch.KILL_AFTER_S + 5
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"launch: process {victim} was killed by SIGKILL; process "), last
    assert "Traceback" not in out and "Check failure" not in out  # the survivor's echo
    assert not _children(tmp_path)


@pytest.mark.once
def test_sigkill_to_the_launcher_takes_its_processes_with_it(tmp_path):
    """They stop like signalled processes (after the same step, saving it), although nobody
    reads their output any more, and free the run folder. The kernel's parent-death signal
    can reach a process once per launcher thread: the repeats are not a second signal, which
    would exit at once, unsaved."""
    proc = _launch(tmp_path, "checkpoint_every=1000")
    pids = _training(tmp_path, proc)
    proc.kill()
    proc.communicate(timeout=10)
    deadline = time.monotonic() + JOIN_S + 15  # they stop like signalled processes
    while any(map(_alive, pids.values())) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in pids.values() if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes outlived their launcher: {left} of {pids}"
    assert len(checkpoint.saved_steps(tmp_path / "J")) == 1  # the stop's save: the only one
    with open(tmp_path / "J" / ".lock", "a+") as f:  # the run folder is free again
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


@pytest.mark.parametrize(
    "process_id, address, needle",
    [
        (
            0,
            "",
            "process 0 of 2 waited 3 s (coordinator_timeout=3) for the other processes to join",
        ),
        (
            1,
            "",
            "process 1 of 2 could not reach the coordinator within 3 s (coordinator_timeout=3)",
        ),
        (1, "no.such.host.invalid:1234", "unknown host 'no.such.host.invalid'"),
        # process 0 serves the coordinator: an address of another host is named as the cause
        (0, "192.0.2.1:", "192.0.2.1:{port} is not an address of this host (process 0 runs"),
    ],
)
def test_a_join_that_cannot_finish_is_one_line_and_exit_2(tmp_path, process_id, address, needle):
    """Process 0 waiting for a peer that never starts, a process whose coordinator never
    answers, a host that does not resolve: one line, before the runtime's own abort (a C++
    stack trace, exit 134) and never past coordinator_timeout."""
    port = launch.free_port()
    address = f"{address}{port}" if address.endswith(":") else address or f"localhost:{port}"
    needle = needle.format(port=port)
    cmd = [sys.executable, "-m", "lab.run", *TINY, "mesh=4x2", f"out_dir={tmp_path}", "name=j"]
    cmd += ["num_processes=2", f"process_id={process_id}", "coordinator_timeout=3"]
    cmd += [f"coordinator={address}"]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert needle in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr[-3000:]


def test_process_0_knows_its_own_addresses():
    assert devices._an_address_here("127.0.0.1:1234") and devices._an_address_here("localhost:1")
    assert not devices._an_address_here("192.0.2.1:1234")  # TEST-NET: no host's own


def test_a_coordinator_that_never_answers_is_an_exception_in_library_code():
    """From Python, a join whose coordinator never answers is a ConfigError the caller can
    catch, not the end of the interpreter: the wait for the port is Python's own (a wait
    inside JAX's runtime, once it answers, cannot be interrupted, and still ends the process)."""
    port = launch.free_port()
    keys = f"model='tiny', coordinator='localhost:{port}', num_processes=2, process_id=1, "
    keys += "mesh='data:-1'"
    code = (
        "from lab.errors import ConfigError\n"
        "from lab.session import open_session\n"
        "try:\n"
        f"    open_session(keys=dict({keys}, coordinator_timeout=2))\n"
        "except ConfigError as e:\n"
        "    print('caught:', e)\n"
    )
    run = [sys.executable, "-c", code]
    proc = subprocess.run(run, env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    needle = f"caught: coordinator=localhost:{port}: process 1 of 2 could not reach the coordinator"
    assert needle in proc.stdout and "within 2 s (coordinator_timeout=2)" in proc.stdout


@pytest.mark.parametrize(
    "address, needle",
    [
        ("nonsense", "expected host:port"),
        ("localhost:99999", "the port must be a number in 1..65535"),
        ("localhost:", "the port must be a number in 1..65535"),
        (":1234", "expected host:port"),
        ("::1:1234", "expected host:port"),
    ],
)
def test_a_bad_coordinator_is_one_line_and_exit_2_never_a_join_timeout(address, needle, capsys):
    args = [*TINY, "mesh=4x2", f"coordinator={address}", "num_processes=2", "process_id=0"]
    assert run_main([*args, "coordinator_timeout=5"]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err
    assert "join" not in err


def test_good_coordinators_pass():
    for address in ("localhost:1234", "10.0.0.1:80", "[::1]:1234", "host-1.example.com:65535"):
        assert make_config(coordinator=address, num_processes=2).coordinator == address


# The launcher's own rules, on plain processes (fast).

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_process_killed_by_a_signal_is_named_with_it_and_sets_128_plus_n():
    killed = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    err = io.StringIO()
    t0 = time.monotonic()
    assert launch.run([SLEEPER, killed], out=io.StringIO(), err=err) == 137
    assert time.monotonic() - t0 < 10  # the sleeper was stopped, not waited for
    line = err.getvalue()
    assert line.count("\n") == 1
    assert line.startswith("launch: process 1 was killed by SIGKILL; process 0 was stopped by")


def test_a_stop_the_launchers_own_sigterm_causes_is_not_named_as_the_cause():
    """Process 1 is killed; the launcher stops process 0 with SIGTERM, which posts a stop
    step as a signalled lab.run does, then hangs (its peer is gone) until SIGKILL. The job
    was ended by process 1's death: its code (137) and its name lead the last line."""
    from lab.devices import STOP_LINE

    posted = STOP_LINE.format(signal="SIGTERM", process=0, step=7)
    hangs = (
        "import signal, sys, time\n"
        "def on(*_):\n"
        f"    print({posted!r}, flush=True)\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "signal.signal(signal.SIGTERM, on)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    killed = [
        sys.executable,
        "-c",
        "import os, signal, time; time.sleep(1); os.kill(os.getpid(), signal.SIGKILL)",
    ]
    err = io.StringIO()
    t0 = time.monotonic()
    code = launch.run([[sys.executable, "-c", hangs], killed], out=io.StringIO(), err=err)
    assert code == 137, err.getvalue()
    assert time.monotonic() - t0 < launch.KILL_AFTER_S + 10
    line = err.getvalue()
    assert line.startswith("launch: process 1 was killed by SIGKILL; process 0 was stopped by")


def test_a_survivors_traceback_is_left_out_and_the_first_failures_is_shown():
    """A process that fails because another died prints the echo of that death (gloo: the
    connection was closed); the launcher keeps it to one line. The first failure's own
    traceback is the story, and it is shown."""
    dies = [sys.executable, "-c", "import os, signal, time; time.sleep(1); os.kill(os.getpid(), 9)"]
    echo = "def f(*_):\n    raise RuntimeError('gloo: Connection closed by peer')\n"
    echo += "import signal, time\nsignal.signal(signal.SIGTERM, f)\ntime.sleep(60)\n"
    out, err = io.StringIO(), io.StringIO()
    assert launch.run([dies, [sys.executable, "-c", echo]], out=out, err=err) == 137
    assert "Traceback" not in out.getvalue(), out.getvalue()
    assert "[p1] (" in out.getvalue() and "lines of errors left out" in out.getvalue()
    assert err.getvalue().startswith("launch: process 0 was killed by SIGKILL")
    bug = [sys.executable, "-c", "raise ValueError('a bug')"]
    out = io.StringIO()
    assert launch.run([SLEEPER, bug], out=out, err=io.StringIO()) == 1
    assert "[p1] Traceback" in out.getvalue() and "[p1] ValueError: a bug" in out.getvalue()


def _ctrl_c_when_both_ready(out: io.StringIO, times: int) -> None:
    """Ctrl-C to this process (the launcher's), `times` times 0.3 s apart, once both of its
    processes have printed 'ready' to `out` (or after 30 s): from a thread, in the background."""
    import threading

    def ctrl_c():
        deadline = time.monotonic() + 30
        while out.getvalue().count("ready") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        for _ in range(times):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)

    threading.Thread(target=ctrl_c, daemon=True).start()


def test_a_second_signal_to_the_launcher_kills_what_still_runs(capsys):
    """A process blocked inside the runtime cannot run its signal handler: the first Ctrl-C
    gives every process coordinator_timeout (here 60 s) to save and exit; a second one kills
    what still runs KILL_AFTER_S later, never waiting out the grace."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed from the main thread only")
    deaf = "import signal, time\nfor s in (signal.SIGINT, signal.SIGTERM):\n"
    deaf += "    signal.signal(s, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(60)\n"
    out, err = io.StringIO(), io.StringIO()
    _ctrl_c_when_both_ready(out, times=2)
    t0 = time.monotonic()
    code = launch.run([[sys.executable, "-c", deaf]] * 2, grace_s=60, out=out, err=err)
    assert code == 130
    assert time.monotonic() - t0 < 20  # ready, two signals, KILL_AFTER_S: not the 60 s grace
    line = err.getvalue()
    assert line.count("\n") == 1, line
    assert line.startswith("launch: SIGINT to the launcher, then another: "), line
    assert "process 0 was stopped by the launcher (SIGKILL)" in line, line


def test_a_signal_to_the_launcher_is_named_as_its_own(capsys):
    """Processes that end on the launcher's signal at once, before its loop looks again,
    still make the last line say the signal was the launcher's (not blame process 1)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed from the main thread only")
    ends = "import os, signal, time\n"
    ends += "signal.signal(signal.SIGINT, lambda s, f: os._exit(130))\n"
    ends += "print('ready', flush=True)\ntime.sleep(60)\n"
    out, err = io.StringIO(), io.StringIO()
    _ctrl_c_when_both_ready(out, times=1)
    code = launch.run([[sys.executable, "-c", ends]] * 2, grace_s=60, out=out, err=err)
    assert code == 130
    line = err.getvalue()
    assert line.startswith("launch: SIGINT to the launcher, sent on to every process: "), line


@pytest.mark.parametrize("after_s", [1.0, 2.0])  # past the interpreter's own start
def test_ctrl_c_while_the_launcher_starts_is_one_line(tmp_path, after_s):
    """While the launcher imports and checks (JAX's start-up there swallows a
    KeyboardInterrupt), a Ctrl-C is one line and exit 130, never a traceback or a run."""
    # SIGINT at its default: a shell's background job (CI's) starts with it ignored, which a
    # command started from it keeps
    default = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    default += "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    cmd = [sys.executable, "-c", default, "-m", "lab.tools.launch", "processes=2", "steps=3"]
    cmd += [f"out_dir={tmp_path}", "name=starting"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(after_s)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, (out, err)
    assert "Traceback" not in err + out and len(err.strip().splitlines()) == 1, err
    assert err.startswith(("SIGINT: exiting; nothing was written", "launch: SIGINT to")), err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the trampoline is Linux's")
def test_a_signal_as_a_process_starts_waits_for_its_handlers(tmp_path):
    """A signal sent on the moment a process starts (its interpreter still starting) waits,
    blocked, for lab.run's handlers: one line and exit 130, not a fatal interpreter error."""
    cmd = [sys.executable, "-m", "lab.run", "steps=2", f"out_dir={tmp_path}", "name=s"]
    with launch._signals_held():
        p = subprocess.Popen(
            launch._dies_with_launcher(cmd), stderr=subprocess.PIPE, stdout=subprocess.PIPE
        )
    p.send_signal(signal.SIGINT)  # at once: the trampoline, or the interpreter it starts
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, (out, err)
    assert err.decode().startswith("SIGINT: exiting; "), err


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_processes_die_with_their_launcher(tmp_path):
    """SIGKILL to the launcher: no handler runs, the kernel tells the children (Linux)."""
    pidfile = tmp_path / "pids"
    child = f"import os, time; open({str(pidfile)!r}, 'a').write(f'{{os.getpid()}}\\n'); "
    child += "time.sleep(60)"
    script = "import sys\nfrom lab.tools import launch\n"
    script += f"launch.run([[sys.executable, '-c', {child!r}]] * 2)\n"
    proc = subprocess.Popen([sys.executable, "-c", script], env=ENV)
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and len(pidfile.read_text().split()) == 2):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.kill()
    proc.wait(timeout=10)
    pids = [int(p) for p in pidfile.read_text().split()]
    deadline = time.monotonic() + 10
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, "a child outlived its launcher"


def test_process_0_refuses_a_port_another_server_listens_on():
    """The runtime's server shares a port with SO_REUSEPORT (two jobs' processes then join each
    other's) and crashed on one held with SO_REUSEADDR: process 0 checks the port first."""
    import socket

    from lab.errors import ConfigError

    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port} is already in use.*coordinator="):
            devices._check_port_free(f"localhost:{port}", "coordinator")
        # a SLURM job's port comes from its id: the way to move it is JAX_COORDINATOR_PORT
        with pytest.raises(
            ConfigError, match="export JAX_COORDINATOR_PORT=<a free port> before srun"
        ):
            devices._check_port_free(f"localhost:{port}", "SLURM job 7, coordinator x")
    devices._check_port_free(f"localhost:{launch.free_port()}", "coordinator")  # a free one


@pytest.mark.once
def test_processes_started_with_different_keys_are_refused(tmp_path):
    """Two processes of one run asked for different learning rates: each would train its own
    program in lockstep. Both refuse in one line naming the key, before any step."""
    lr = {0: 0.003, 1: 0.1}
    base = [*TINY, "mesh=4x2", f"out_dir={tmp_path}", "name=R"]
    codes, errs = _by_hand(lambda i: [*base, f"lr={lr[i]}"])
    assert codes == [2, 2], errs
    assert errs[1].count("\n") == 1 and "lr: 0.003 on process 0, 0.1 on process 1" in errs[1]
    assert errs[0].startswith("error: process 1 of 2 refused the run: the processes were"), errs
    assert not (tmp_path / "R").exists()


@pytest.mark.once
def test_processes_told_different_job_sizes_are_refused_naming_it(tmp_path):
    """Process 1 told num_processes=3 where process 0 said 2: the coordinator takes 2, each
    process made its own share of 12 simulated devices (6 + 4), and both refused a batch
    that did not split over 10 devices, a count nobody asked for. Both now name the key."""
    tiny = [k for k in TINY if not k.startswith("batch_size=")]
    keys = [*tiny, "batch_size=12", "mesh=data:-1", "cpu_devices=12", f"out_dir={tmp_path}"]
    codes, errs = _by_hand(lambda i: keys, n_of=lambda i: 2 + i)
    assert codes == [2, 2], errs
    for err in errs:
        assert err.count("\n") == 1, err
        assert "different keys (num_processes: 2 on process 0, 3 on process 1)" in err, err


@pytest.mark.once
def test_checkpointing_processes_that_do_not_share_the_run_folder_are_refused(tmp_path):
    """Every process writes its part of each checkpoint into the run folder: a process that
    sees another folder (out_dir on its own host's disk) would leave the first save waiting
    for parts that never arrive. Both refuse in one line before any step, and nothing is left."""
    own = {0: tmp_path / "shared", 1: tmp_path / "local"}
    keys = [*TINY, "mesh=4x2", "name=R", "coordinator_timeout=60"]
    t0 = time.monotonic()
    codes, errs = _by_hand(lambda i: [*keys, f"out_dir={own[i]}", "checkpoint_every=1"])
    assert codes == [2, 2], errs
    assert time.monotonic() - t0 < 120, errs  # not a save's timeout
    needle = f"process 1 does not see process 0's run folder at {own[1] / 'R'}"
    assert errs[1].count("\n") == 1 and needle in errs[1], errs[1]
    assert "out_dir= must be a folder all hosts share" in errs[1]
    assert errs[0].startswith("error: process 1 of 2 refused the run: process 1 does not"), errs
    assert errs[0].count("\n") == 1
    assert not (own[0] / "R").exists()  # process 0's folder made for the run is removed
    # Processes that share it train and checkpoint, and leave no token behind: every launched
    # job that checkpoints shows it (the check is lab.run's own, by hand or launched), here
    # test_a_launched_circular_run_goes_on_as_fsdp_past_a_damaged_step.


@pytest.mark.once
def test_a_launched_circular_run_goes_on_as_fsdp_past_a_damaged_step(tmp_path):
    """Two processes resume a circular pipeline's run as an fsdp one over 8 devices, its
    newest step damaged. Every process reads each step's layout record by itself (a reader
    that waits on the whole job, called by the first process alone while it checks the
    folder, stalled 30 s and read every step as unrecorded); each holds only its shards of
    every weight, so the resume checks the restored state is finite without fetching another
    process's shards; the damaged newest step is moved aside once, by the first process,
    while both go on from the circular step before it. (One job for what two tests launched
    twice each: a circular run resumed as a plain one, and an fsdp run resumed past a
    damaged step.)"""
    tiny = [k for k in TINY if not k.startswith(("n_layers=", "steps="))] + ["n_layers=4"]
    base = [sys.executable, "-m", "lab.tools.launch", "processes=2", *tiny]
    base += [f"out_dir={tmp_path}", "name=C", "checkpoint_every=2", "coordinator_timeout=30"]
    circular = ["mesh=data:4,stage:2", "strategy=pp", "pipeline_repeats=2"]
    first = subprocess.run(
        [*base, *circular, "steps=4"], env=ENV, capture_output=True, text=True, timeout=300
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert checkpoint.saved_steps(tmp_path / "C") == [2, 4]
    # both processes wrote their parts into the folder they share, its token gone once checked
    assert not (tmp_path / "C" / devices.JOIN_FILE).exists()
    (tmp_path / "C" / "checkpoints" / "4" / "default" / "_METADATA").write_text("x")
    again = subprocess.run(
        [*base, "mesh=fsdp:8", "strategy=fsdp", "steps=6", "resume=true"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    said = again.stdout + again.stderr  # the launcher passes on its processes' lines
    assert "resumed from checkpoint at step 2" in said
    assert "layers: saved stacked by stage (stage=2, pipeline_repeats=2), moved" in said
    assert said.count("checkpoint step 4 is damaged") == 1  # said and moved by process 0
    assert [p.name.split("-")[0] for p in (tmp_path / "C" / "checkpoints-damaged").iterdir()] == [
        "4"
    ]

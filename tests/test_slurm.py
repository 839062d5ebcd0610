"""`srun python -m lab.run …`: the tasks of a SLURM step join one jax.distributed job with no
coordinator= keys (JAX's own SLURM detection fills them), train exactly like one process, and a
SLURM environment JAX could not use is one line and exit 2, never a traceback or a hang.

No SLURM here: two local processes get the variables srun sets for two tasks on one node, and
gloo collectives, as lab.tools.launch gives its processes."""

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from lab.devices import DeviceInfo, slurm_step
from lab.errors import ConfigError
from lab.run import main as run_main

TINY = ["model=tiny", "n_layers=1", "batch_size=8", "seq_len=16", "log_every=1", "steps=3"]
PORTS = range(65535 - 2**12 + 1, 65536)  # JAX's port for a job: this range, by job id
CLEAN = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAX_COORD"))}


def _job_with_free_port() -> int:
    """A job id whose coordinator port (JAX: 61440 + id mod 4096) nobody listens on now."""
    for port in random.sample(PORTS, 50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("localhost", port))
            except OSError:
                continue
        return 4096 * 7 + port - PORTS[0]
    raise AssertionError("no free port in JAX's SLURM range")


def _task(job: int, task: int, tasks: int = 2, **extra) -> dict:
    """The variables srun sets for task `task` of a step of `tasks` tasks on one node."""
    return {
        "SLURM_JOB_ID": str(job),
        "SLURM_NTASKS": str(tasks),
        "SLURM_PROCID": str(task),
        "SLURM_LOCALID": str(task),
        "SLURM_NODEID": "0",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_STEP_NUM_TASKS": str(tasks),
        **extra,
    }


def _lab_run(env: dict, *keys: str) -> subprocess.Popen:
    """lab.run in a process of its own; its output goes to files, so that a process nobody
    reads yet never blocks on a full pipe."""
    env = {**CLEAN, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", **env}
    cmd = [sys.executable, "-m", "lab.run", *keys]
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
    proc.files = out, err
    return proc


def _finish(proc: subprocess.Popen, timeout_s: float) -> tuple[str, str]:
    """(stdout, stderr) of `proc` once it has ended; an AssertionError if it hangs."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        out, err = map(_read, proc.files)
        raise AssertionError(f"lab.run hung:\n{out[-2000:]}\n{err[-2000:]}") from None
    out, err = map(_read, proc.files)
    return out, err


def _read(f) -> str:
    f.seek(0)
    text = f.read()
    f.close()
    return text


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").open()]


@pytest.mark.once
def test_two_slurm_tasks_train_like_one_process(tmp_path):
    """mesh=4x2 over two tasks of four simulated devices each, joined through SLURM's
    variables only, gives the losses of one process with all eight."""
    job = _job_with_free_port()
    args = [*TINY, "mesh=4x2", f"out_dir={tmp_path}", "coordinator_timeout=30"]
    procs = [_lab_run(_task(job, i), *args, "name=two") for i in range(2)]
    assert run_main([*args, "name=one"]) == 0  # meanwhile: most of their time is start-up
    done = [_finish(p, timeout_s=120) for p in procs]
    for p, (_, err) in zip(procs, done, strict=True):
        assert p.returncode == 0, err[-3000:]
    port = PORTS[0] + job % 4096
    header = f"joined 2 processes through SLURM (job {job}, node list localhost, coordinator "
    assert f"{header}localhost:{port})" in " ".join(done[0][0].split()), done[0][0]  # rich wraps
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(two) == 3
    assert two == pytest.approx(one, rel=1e-5)  # gloo may sum in another order


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"SLURM_NTASKS": "two"}, "SLURM_NTASKS='two' is not a whole number ≥ 1"),
        ({"SLURM_NTASKS": "0"}, "SLURM_NTASKS='0' is not a whole number ≥ 1"),
        ({"SLURM_PROCID": "2"}, "SLURM_PROCID='2' is not a whole number in 0..1"),
        ({"SLURM_PROCID": "-1"}, "SLURM_PROCID='-1' is not a whole number in 0..1"),
        ({"SLURM_LOCALID": None}, "SLURM_LOCALID is unset in a SLURM step of several tasks"),
        ({"SLURM_JOB_ID": "12x"}, "SLURM_JOB_ID='12x' is not a whole number"),
        ({"JAX_COORDINATOR_PORT": "99999"}, "JAX_COORDINATOR_PORT='99999': the port must be"),
        ({"SLURM_STEP_NODELIST": "node[001-"}, "SLURM_STEP_NODELIST='node[001-' is not a node"),
        ({"SLURM_STEP_NODELIST": "[1-2]"}, "SLURM_STEP_NODELIST='[1-2]' is not a node list"),
        ({"SLURM_STEP_NODELIST": ""}, "SLURM_STEP_NODELIST='' is not a node list"),
        ({"SLURM_STEP_NODELIST": None}, "is not a task of an srun step (no SLURM_STEP_NODELIST)"),
        ({"SLURM_STEP_NODELIST": "no-such-node.invalid"}, "unknown host 'no-such-node.invalid'"),
        ({"SLURM_STEP_NODELIST": "node[04-01]"}, "SLURM_STEP_NODELIST='node[04-01]' is not a"),
        (
            {"SLURM_STEP_NUM_NODES": "2"},
            "SLURM_STEP_NODELIST='localhost' names 1 node but SLURM_STEP_NUM_NODES=2",
        ),
        (
            {"SLURM_STEP_NODELIST": "node[01-03]", "SLURM_STEP_NUM_NODES": "3"},
            "names 3 nodes for SLURM_NTASKS=2 tasks: every node of a step runs at least one task",
        ),
        (
            {"SLURM_LOCALID": "5", "SLURM_STEP_TASKS_PER_NODE": "2"},
            "SLURM_LOCALID='5' is not a whole number in 0..1 (this task's index on its node",
        ),
        ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID='2' is not a whole number in 0..1"),
        (
            {"JAX_COORDINATOR_ADDRESS": "foo"},
            "JAX_COORDINATOR_ADDRESS='foo': expected host:port",
        ),
    ],
)
def test_a_bad_slurm_environment_is_one_line_and_exit_2(env, needle, monkeypatch, capsys):
    """Checked before any join (this process's backends are the conftest's already)."""
    for k, v in {**_task(1234, 1), **env}.items():
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, v)
    assert run_main([*TINY, "mesh=4x2", "coordinator_timeout=5"]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "task, needle",
    [
        (0, "process 0 of 2 waited 3 s (coordinator_timeout=3) for the other processes to join; "
         "every one of the step's SLURM_NTASKS=2 tasks must run lab.run"),
        (1, "process 1 of 2 could not reach the coordinator within 3 s (coordinator_timeout=3)"),
    ],
)  # fmt: skip
def test_a_slurm_join_that_cannot_finish_is_one_line_and_exit_2(tmp_path, task, needle):
    """Task 0 whose peer never starts, task 1 whose coordinator never answers: one line within
    coordinator_timeout, never the runtime's abort or a hang."""
    job = _job_with_free_port()
    keys = [*TINY, "mesh=4x2", f"out_dir={tmp_path}", "coordinator_timeout=3"]
    proc = _lab_run(_task(job, task), *keys)
    _, err = _finish(proc, timeout_s=60)
    assert proc.returncode == 2, err[-3000:]
    assert needle in err and err.count("\n") == 1, err[-3000:]
    assert f"SLURM job {job}, coordinator localhost:{PORTS[0] + job % 4096}" in err


def test_slurm_step_reads_what_jax_reads(monkeypatch):
    for k in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(k)
    assert slurm_step() is None  # not under SLURM
    env = _task(4097, 3, tasks=16, SLURM_STEP_NODELIST="gpu[003-004],gpu007")
    env["SLURM_STEP_NUM_NODES"] = "3"
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    step = slurm_step()
    assert (step.tasks, step.task, step.coordinator) == (16, 3, "gpu003:61441")
    monkeypatch.setenv("JAX_COORDINATOR_PORT", "2222")  # JAX's override of the derived port
    assert slurm_step().coordinator == "gpu003:2222"
    monkeypatch.delenv("JAX_COORDINATOR_PORT")
    # several bracket groups in a name, each range with its own zero padding: the first host
    # is every group's first value (JAX's own reading stops at the first group: "rack1")
    for nodes, count, first in (
        ("rack[1-2]-node[01-04]", "8", "rack1-node01"),
        ("r[08-9,11]n[007],login1", "4", "r08n007"),
    ):
        monkeypatch.setenv("SLURM_STEP_NODELIST", nodes)
        monkeypatch.setenv("SLURM_STEP_NUM_NODES", count)
        assert slurm_step().coordinator == f"{first}:61441"
    # node names the lab cannot read: an address given by hand is the way round them
    monkeypatch.setenv("SLURM_STEP_NODELIST", "10-0-0-[1-2]")
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", "2")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    assert slurm_step().coordinator == "10.0.0.1:1234"
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS")
    monkeypatch.setenv("SLURM_NTASKS", "1")  # one task: nothing to join
    assert slurm_step() is None
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.delenv("SLURM_STEP_NODELIST")  # the batch script itself, not an srun task
    with pytest.raises(ConfigError, match="start every task with srun"):
        slurm_step()


def test_a_slurm_join_names_the_coordinator_the_lab_read(monkeypatch):
    """JAX's SLURM detection would derive its own coordinator host from the node list (the
    text before a name's first bracket group): the join is given the lab's, the first host."""
    from lab import devices

    for k, v in _task(4097, 1, SLURM_STEP_NODELIST="rack[1-2]-node[01]", SLURM_LOCALID="0").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", "2")
    joins = []
    monkeypatch.setattr(devices, "_join", lambda j, timeout_s: joins.append(j))
    devices._init_distributed("", 1, 0)
    assert joins[0].kwargs["coordinator_address"] == "rack1-node01:61441"


def test_the_header_says_how_the_processes_joined():
    info = DeviceInfo("gpu", "NVIDIA H100", 16, 8, 2, 0, False, joined="through SLURM (job 7)")
    assert info.header() == "gpu · NVIDIA H100 × 16, joined 2 processes through SLURM (job 7)"
    plain = DeviceInfo("gpu", "NVIDIA H100", 16, 8, 2, 0, False)
    assert plain.header() == "gpu · NVIDIA H100 × 16, 2 processes"


def test_a_cloud_tpu_vms_workers_are_read_from_its_metadata(monkeypatch):
    """A Cloud TPU VM sets no TPU_WORKER_HOSTNAMES (GKE's): its workers are in the metadata
    server, as JAX's own TPU cluster detection reads them. Several workers are a pod slice
    (joined); one, an unreadable server or no TPU chips here are a single host."""
    from jax._src.clusters import cloud_tpu_cluster as tpu

    from lab import devices

    monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
    assert not devices._tpu_pod()  # this machine has no TPU chips
    monkeypatch.setattr(tpu, "running_in_cloud_tpu_vm", True)
    monkeypatch.setattr(tpu.GceTpuCluster, "is_env_present", classmethod(lambda cls: True))
    for workers, pod in ((["w0", "w1"], True), (["w0"], False)):
        monkeypatch.setattr(tpu.GceTpuCluster, "_get_worker_list_in_slice", lambda w=workers: w)
        assert devices._tpu_pod() is pod

    def unreadable():
        raise RuntimeError("Getting metadata['worker-network-endpoints'] failed for 6 tries")

    monkeypatch.setattr(tpu.GceTpuCluster, "_get_worker_list_in_slice", unreadable)
    assert devices._tpu_pod() is False
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "a,b")  # GKE
    assert devices._tpu_pod() is True

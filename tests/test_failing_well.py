"""What a run folder guarantees when things go wrong, each held for its whole class: a folder
belongs to one run (a fresh run never mixes into an earlier one; overwrite=true clears it, and
only once the new run is sure to start), every way out of the loop finishes or reports its
save and writes summary.json, a write that fails (a full disk) is one line naming the folder
and what it keeps, a metrics or config file that is not what the lab wrote is kept apart or
refused in one line, and every message about checkpoints says what the folder really holds.
"""

import errno
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lab import checkpoint, rundir
from lab.run import main

TINY = ["model=tiny", "n_layers=1", "batch_size=4", "seq_len=16", "log_every=1"]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _run(out, *args) -> int:
    return main([*TINY, f"out_dir={out}", *args])


def _one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for needle in needles:
        assert needle in err, err
    return err


def _snapshot(folder: Path) -> dict:
    """Every file under the folder with its bytes (the lock's content comes and goes)."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def earlier(tmp_path_factory):
    """Folders an earlier run left: a finished run with checkpoints, and a compile-only run
    (config.json and summary.json, nothing else)."""
    out = tmp_path_factory.mktemp("earlier")
    assert _run(out, "name=ckpt", "steps=6", "checkpoint_every=2") == 0
    assert _run(out, "name=compiled", "compile_only=true") == 0
    return out


def _copy(earlier: Path, name: str, tmp_path: Path) -> Path:
    shutil.copytree(earlier / name, tmp_path / name)
    return tmp_path / name


# ---------------------------------------------------------------- a folder belongs to one run


@pytest.mark.parametrize("name", ["ckpt", "compiled"])
@pytest.mark.parametrize(
    "new",
    [
        ["steps=4", "checkpoint_every=2"],  # the same model, fewer steps: saves would be dropped
        ["compile_only=true"],
        ["steps=2", "d_model=128"],  # another model
    ],
)
def test_a_fresh_run_refuses_a_folder_that_holds_a_run(earlier, tmp_path, capsys, name, new):
    run_dir = _copy(earlier, name, tmp_path)
    before = _snapshot(run_dir)
    capsys.readouterr()
    assert _run(tmp_path, f"name={name}", *new) == 2
    line = _one_line_error(capsys, f"run folder {run_dir} already holds a run", "overwrite=true")
    # resume=true is offered only where a checkpoint is there to continue from, and never to
    # compile_only=true, which refuses resume=true
    assert ("resume=true" in line) == (name == "ckpt" and "compile_only=true" not in new), line
    assert _snapshot(run_dir) == before  # nothing written, nothing removed


@pytest.mark.once
def test_overwrite_clears_the_earlier_run_and_the_folder_resumes_with_the_new_model(
    earlier, tmp_path, capsys
):
    run_dir = _copy(earlier, "ckpt", tmp_path)  # d_model=64, saved at steps 2, 4, 6
    args = ["name=ckpt", "checkpoint_every=2", "d_model=128"]
    assert _run(tmp_path, *args, "steps=4", "overwrite=true") == 0
    assert "cleared the earlier run" in capsys.readouterr().out
    assert checkpoint.saved_steps(run_dir) == [2, 4]  # the new run's own saves, kept
    assert json.loads((run_dir / "config.json").read_text())["model"]["d_model"] == 128
    assert _steps(run_dir) == [1, 2, 3, 4]
    assert not list(run_dir.glob("metrics-*")) and not list(run_dir.glob(".overwritten*"))
    assert _run(tmp_path, *args, "steps=6", "resume=true") == 0
    assert "resumed from checkpoint at step 4" in capsys.readouterr().out


def _refuse_memory(monkeypatch):
    from lab import summary

    monkeypatch.setattr(summary.memory, "device_capacity_bytes", lambda device: 1024)


@pytest.mark.parametrize(
    "args, code, needle",
    [
        (["resume=true"], 2, "choose one"),
        (["lr=-1"], 2, "lr="),
        (["refuse_memory"], 2, "available now"),
    ],
)
def test_overwrite_never_costs_the_earlier_run_of_a_run_that_is_refused(
    earlier, tmp_path, capsys, monkeypatch, args, code, needle
):
    run_dir = _copy(earlier, "ckpt", tmp_path)
    before = _snapshot(run_dir)
    if args == ["refuse_memory"]:
        _refuse_memory(monkeypatch)
        args = []
    capsys.readouterr()
    assert _run(tmp_path, "name=ckpt", "steps=4", "overwrite=true", *args) == code
    _one_line_error(capsys, needle)
    assert _snapshot(run_dir) == before


def test_compile_only_never_shares_the_folder_of_the_run_it_would_resume(earlier, tmp_path, capsys):
    run_dir = _copy(earlier, "ckpt", tmp_path)
    before = _snapshot(run_dir)
    capsys.readouterr()
    assert _run(tmp_path, "name=ckpt", "compile_only=true", "resume=true") == 2
    _one_line_error(capsys, "compile_only=true writes a config.json and summary.json")
    assert _snapshot(run_dir) == before
    # a plan for a target is compiled only too: named as the user typed it
    assert _run(tmp_path, "name=ckpt", "target=tpu:v5e:2x2", "resume=true") == 2
    _one_line_error(capsys, "target=tpu:v5e:2x2 (a plan) writes a config.json")
    assert _snapshot(run_dir) == before


def test_an_interrupted_overwrite_leaves_no_mix_and_the_next_one_finishes(tmp_path):
    run_dir = tmp_path / "R"
    (run_dir / "checkpoints" / "6").mkdir(parents=True)
    (run_dir / "config.json").write_text("{}")
    (run_dir / ".overwritten-1").mkdir()  # what a clear killed part-way leaves
    (run_dir / ".overwritten-1" / "metrics.jsonl").write_text("{}\n")
    (run_dir / "lab.log").write_text("log\n")
    (run_dir / "outside").symlink_to(tmp_path)  # a link is removed, never followed
    (tmp_path / "keep.txt").write_text("not the run's")
    assert rundir.clear(run_dir) == [".overwritten-1", "checkpoints", "config.json", "outside"]
    assert sorted(p.name for p in run_dir.iterdir()) == ["lab.log"]
    assert (tmp_path / "keep.txt").read_text() == "not the run's"


# ------------------------------------------------- every way out of the loop finishes its save

_SIGNAL_SCRIPT = """
import os, signal, sys
from lab import loop
from lab.run import main

SIG, COUNT = getattr(signal, sys.argv[1]), int(sys.argv[2])
real = loop._End.finish_saves

def signalled(self):  # the signal(s) arrive while the last checkpoint is being written
    for _ in range(COUNT):
        os.kill(os.getpid(), SIG)
    return real(self)

loop._End.finish_saves = signalled
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.once
@pytest.mark.parametrize(
    "sig, count, every, code",
    [("SIGTERM", 1, 2, 143), ("SIGINT", 1, 0, 130), ("SIGTERM", 2, 2, 143)],
)
def test_a_signal_while_the_last_checkpoint_is_written_is_reported_in_one_line(
    tmp_path, sig, count, every, code
):
    args = [*TINY, f"out_dir={tmp_path}", "name=S", "steps=4", f"checkpoint_every={every}"]
    cmd = [sys.executable, "-c", _SIGNAL_SCRIPT, sig, str(count), *args]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    run_dir = tmp_path / "S"
    assert json.loads((run_dir / "summary.json").read_text())["steps_run"] == 4
    last = proc.stdout.strip().splitlines()[-1]  # how to go on, the last line
    resume = f"python -m lab.run name=S out_dir={shlex.quote(str(tmp_path))} resume=true"
    if count == 1 and every:
        assert f"{sig}: checkpoint saved at step 4" in proc.stdout and proc.stderr == ""
        assert checkpoint.saved_steps(run_dir) == [2, 4]
        assert not list((run_dir / "checkpoints").glob("*tmp*"))
        # at the run's last step: a resume goes further only with a larger steps=
        further = "steps=N (N > 4: the run reached its steps=4)"
        assert last == f"to resume from checkpoint step 4: {resume} {further}", last
    elif count == 1:
        assert f"{sig}: stopped at step 4; kept in {run_dir}: no checkpoint" in proc.stdout
        assert last.startswith("nothing to resume: no checkpoint (checkpoint_every=0); "), last
    else:  # a second signal is final: it says what it leaves unfinished, and what is kept
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(f"{sig} again: exiting at once; "), line
        newest = checkpoint.saved_steps(run_dir)[-1]
        assert f"checkpoint step {newest} in" in line
        assert ("checkpoint step 4 was not finished" in line) == (newest != 4), line
        further = " steps=N (N > 4: the run reached its steps=4)" if newest == 4 else ""
        assert line.endswith(f"; to resume from checkpoint step {newest}: {resume}{further}")


# ------------------------------------------------------------- a write that fails: one line


def _enospc(path="") -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def _fill_metrics_at_line(monkeypatch, n: int):
    """The n-th line of metrics.jsonl hits a full disk after part of it is written."""
    real, lines = os.write, []

    def write(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl"):
            lines.append(data)
            if len(lines) >= n:
                real(fd, bytes(data[:9]))  # a torn start of the line
                raise _enospc()
        return real(fd, data)

    monkeypatch.setattr(rundir.os, "write", write)


def _fill_checkpoint(monkeypatch, at_step: int, *, in_background: bool):
    """Orbax's words for a full disk (TensorStore's error, raised by save or by the wait)."""
    import orbax.checkpoint as ocp

    err = ValueError(
        'OUT_OF_RANGE: Error writing "params" in OCDBT database: Failed to write 631715 bytes '
        "to file 6: No space left on device [os_error_code='28']"
    )
    save, wait, started = ocp.CheckpointManager.save, ocp.CheckpointManager.wait_until_finished, []

    def failing_save(self, step, *a, **kw):
        if step == at_step and not in_background:
            raise err
        done = save(self, step, *a, **kw)
        started.append(step)
        return done

    def failing_wait(self):
        wait(self)
        if in_background and started and started[-1] == at_step:
            started.clear()  # the step's folder stays unfinished, as a failed write leaves it
            step_dir = Path(str(self.directory)) / str(at_step)
            step_dir.rename(step_dir.with_name(f"{at_step}.orbax-checkpoint-tmp-0"))
            raise err

    monkeypatch.setattr(ocp.CheckpointManager, "save", failing_save)
    monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", failing_wait)


def _fill_summary(monkeypatch):
    from lab import summary

    def write(folder, _):
        (folder / "summary.json").write_text('{"steps_run": ')  # torn by the full disk
        raise _enospc(str(folder / "summary.json"))

    monkeypatch.setattr(summary, "write_summary", write)


def _fill_config(monkeypatch):
    """The disk is full from the first write of config.json: as a real write() fails, the
    OSError names no file (the line must still name it)."""
    real = Path.write_text

    def write_text(self, data, *a, **kw):
        if self.name.startswith(".config.json."):
            self.touch()  # open() succeeded, write() did not
            raise _enospc()
        return real(self, data, *a, **kw)

    monkeypatch.setattr(Path, "write_text", write_text)


DISK_FULL = {
    "metrics line 3": (
        lambda mp: _fill_metrics_at_line(mp, 3),
        "metrics.jsonl could not be written in {run_dir} (No space left on device): training "
        "stopped at step 2; kept in {run_dir}: checkpoint step 2",
    ),
    "checkpoint 4 (save)": (
        lambda mp: _fill_checkpoint(mp, 4, in_background=False),
        "checkpoint step 4 could not be saved in {run_dir}/checkpoints (No space left on "
        "device): training stopped at step 4; kept in {run_dir}: checkpoint step 2",
    ),
    "checkpoint 4 (background)": (
        lambda mp: _fill_checkpoint(mp, 4, in_background=True),
        "checkpoint step 4 could not be saved in {run_dir}/checkpoints (No space left on "
        "device): training ended at step 6; kept in {run_dir}: checkpoint step 2",
    ),
    "last checkpoint": (
        lambda mp: _fill_checkpoint(mp, 6, in_background=True),
        "checkpoint step 6 could not be saved in {run_dir}/checkpoints (No space left on "
        "device): training ended at step 6; kept in {run_dir}: checkpoint step 4",
    ),
    "summary.json": (
        _fill_summary,
        "summary.json could not be written in {run_dir} (No space left on device): training "
        "ended at step 6; kept in {run_dir}: checkpoint step 6",
    ),
    "config.json": (
        _fill_config,
        "config.json could not be written in {run_dir} (No space left on device): nothing was run",
    ),
}


@pytest.mark.parametrize("where", DISK_FULL)
def test_a_full_disk_is_one_line_naming_the_folder_and_what_it_keeps(
    tmp_path, capsys, monkeypatch, where
):
    fill, message = DISK_FULL[where]
    fill(monkeypatch)
    run_dir = tmp_path / "D"
    assert _run(tmp_path, "name=D", "steps=6", "checkpoint_every=2") == 1
    _one_line_error(capsys, message.format(run_dir=run_dir))
    monkeypatch.undo()
    if (run_dir / "metrics.jsonl").exists():  # whole lines only: none torn by the failure
        lines = (run_dir / "metrics.jsonl").read_bytes().splitlines()
        assert all(rundir._record(line) for line in lines)
    if (run_dir / "summary.json").exists():  # replaced whole or not at all
        json.loads((run_dir / "summary.json").read_text())
    assert not list(run_dir.glob(".*staging*")) and not list(run_dir.glob(".*.tmp"))
    if "background" in where:  # and the folder resumes from what it kept
        assert _run(tmp_path, "name=D", "steps=8", "resume=true") == 0
        assert not list((run_dir / "checkpoints").glob("*tmp*"))  # the unfinished save


_FSIZE_SCRIPT = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
from lab.run import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_real_failed_checkpoint_write_is_one_line_and_nothing_else(tmp_path):
    """The operating system refuses the write inside TensorStore's threads (files over 100 kB
    fail): once the noise of every failing thread and coroutine went to the terminal."""
    args = [*TINY, f"out_dir={tmp_path}", "name=F", "steps=6", "checkpoint_every=2"]
    cmd = [sys.executable, "-c", _FSIZE_SCRIPT, *args]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    run_dir = tmp_path / "F"
    assert proc.stderr.splitlines() == [
        f"error: checkpoint step 2 could not be saved in {run_dir}/checkpoints (File too "
        f"large): training stopped at step 4; kept in {run_dir}: no checkpoint (none saved "
        "yet); metrics.jsonl to step 4"
    ]
    assert "Traceback" not in proc.stdout


# --------------------------- files that are not what the lab wrote: kept apart, or one line

TAILS = {
    "torn json": b'{"step": 7, "loss": 3.1',
    "not utf-8": b'{"step": 7, "loss": \xff\xfe3.1}',
    "zero bytes": b"\x00" * 64,
    "not a record": b"[7, 3.1]",
    "no integer step": b'{"step": "7", "loss": 3.1}',
    "a value not a number": b'{"step": 5, "loss": "NaN"}',  # TensorBoard could not take it
    "a step past int64": b'{"step": 9223372036854775808, "loss": 3.1}',
}


@pytest.mark.parametrize("tail", TAILS)
def test_metrics_lines_that_are_not_records_are_kept_apart_byte_for_byte(tmp_path, tail):
    good = b"".join(json.dumps({"step": s, "loss": 1.0}).encode() + b"\n" for s in (1, 2, 3))
    (tmp_path / "metrics.jsonl").write_bytes(good + TAILS[tail] + b"\n" + b'{"step": 4}')
    rundir.keep_metrics_before(tmp_path, 2)
    assert _steps(tmp_path) == [1, 2]
    superseded = (tmp_path / "metrics-superseded.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in superseded] == [3, 4]
    assert (tmp_path / "metrics-torn.jsonl").read_bytes() == TAILS[tail] + b"\n"


def test_resume_after_non_utf8_bytes_at_the_end_of_metrics(earlier, tmp_path, capsys):
    run_dir = _copy(earlier, "ckpt", tmp_path)
    with open(run_dir / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 7, "lo\xe9\x80')  # a kill or a full disk mid-write
    assert _run(tmp_path, "name=ckpt", "steps=8", "checkpoint_every=2", "resume=true") == 0
    assert _steps(run_dir) == list(range(1, 9))
    assert (run_dir / "metrics-torn.jsonl").read_bytes() == b'{"step": 7, "lo\xe9\x80\n'
    out = capsys.readouterr().out  # torn after the last record: nothing is missing
    assert "a line that is not a whole record (torn mid-write) set aside in " in out
    assert "no record is missing" in out and "lost from a damaged" not in out


def test_resume_after_metrics_lost_one_record_names_it_in_the_singular(earlier, tmp_path, capsys):
    run_dir = _copy(earlier, "ckpt", tmp_path)  # steps 1-6, checkpoints at 2, 4 and 6
    lines = (run_dir / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_bytes(b"".join(lines[:5]) + lines[5][:20])  # step 6 cut
    assert _run(tmp_path, "name=ckpt", "steps=7", "checkpoint_every=2", "resume=true") == 0
    out = capsys.readouterr().out
    assert "; the record of step 6 is missing" in out, out


def test_a_resume_says_metrics_jsonl_is_gone(earlier, tmp_path, capsys):
    run_dir = _copy(earlier, "ckpt", tmp_path)
    (run_dir / "metrics.jsonl").unlink()
    assert _run(tmp_path, "name=ckpt", "steps=7", "checkpoint_every=2", "resume=true") == 0
    out = capsys.readouterr().out
    assert f"metrics.jsonl: none in {run_dir}; the records of steps 1-6 are missing" in out, out
    # the last line's account of the folder keeps saying so
    assert "metrics.jsonl to step 7 (without steps 1-6, lost from a damaged or deleted file)" in out


def test_a_resume_whose_checkpoints_folder_is_gone_says_so(earlier, tmp_path, capsys):
    run_dir = _copy(earlier, "ckpt", tmp_path)
    shutil.rmtree(run_dir / "checkpoints")
    assert _run(tmp_path, "name=ckpt", "steps=7", "resume=true") == 2
    _one_line_error(capsys, "its checkpoints/ folder is missing, though the run saved every 2")


def test_resume_after_metrics_cut_mid_line_names_the_torn_line_and_the_lost_steps(
    earlier, tmp_path, capsys
):
    run_dir = _copy(earlier, "ckpt", tmp_path)  # steps 1-6, checkpoints at 2, 4 and 6
    whole = (run_dir / "metrics.jsonl").read_bytes()
    (run_dir / "metrics.jsonl").write_bytes(whole[: whole.index(b"\n") + 20])  # step 2 cut
    assert _run(tmp_path, "name=ckpt", "steps=8", "checkpoint_every=2", "resume=true") == 0
    out = capsys.readouterr().out
    aside = run_dir / "metrics-torn.jsonl"
    assert f"set aside in {aside}; the records of steps 2-6 are missing" in out
    assert "metrics.jsonl to step 8 (without steps 2-6, lost from a damaged or deleted file)" in out
    assert _steps(run_dir) == [1, 7, 8]


def test_step_ranges():
    assert rundir.step_ranges([2, 3, 4, 8, 10, 11]) == "2-4, 8, 10-11"
    assert rundir.step_ranges([1, 3, 5, 7, 9]) == "1, 3, 5, 7, … (5 steps)"


@pytest.mark.parametrize(
    "content", [b'{"model": {"d_model": \xff}}', b"[1, 2]", b'{"steps": 6}', b"", b"\x00" * 8]
)
def test_a_config_json_that_is_not_a_runs_config_is_one_line(tmp_path, content):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(rundir.ConfigError, match="config.json is damaged"):
        rundir.saved_config(tmp_path)


def test_a_lock_file_with_any_bytes_in_it_still_locks(tmp_path):
    (tmp_path / ".lock").write_bytes(b"\xff\xfe pid")
    with checkpoint.Lock(tmp_path):
        pass


# ------------------------------------------------- messages say what the folder really holds


def _nan_at_step_3(monkeypatch):
    import jax.numpy as jnp

    from lab import train

    real = train.train_step

    def poisoned(state, tokens, **kw):
        new, metrics = real(state, tokens, **kw)
        return new, {**metrics, "loss": jnp.where(state.step == 2, jnp.nan, metrics["loss"])}

    monkeypatch.setattr(train, "train_step", poisoned)


@pytest.mark.parametrize(
    "every, kept",
    [
        (0, "no checkpoint (checkpoint_every=0)"),
        (5, "no checkpoint (none saved yet)"),
        (1, "checkpoint step 2 in {run_dir}/checkpoints"),
    ],
)
def test_a_stopped_run_names_the_checkpoint_it_really_kept(
    tmp_path, capsys, monkeypatch, every, kept
):
    _nan_at_step_3(monkeypatch)
    run_dir = tmp_path / "N"
    assert _run(tmp_path, "name=N", "steps=6", f"checkpoint_every={every}") == 1
    err = _one_line_error(capsys, "loss is nan at step 3: training stopped; kept in")
    assert kept.format(run_dir=run_dir) in err and "last good" not in err
    assert checkpoint.saved_steps(run_dir) == ([1, 2] if every == 1 else [])
    assert json.loads((run_dir / "summary.json").read_text())["steps_run"] == 2


@pytest.mark.parametrize(
    ("sig", "code", "wait_for"),
    [("SIGINT", 130, "lab.log"), ("SIGTERM", 143, "lab.log"), ("SIGINT", 130, None)],
)
def test_a_signal_during_start_up_is_one_line_and_its_exit_code(tmp_path, sig, code, wait_for):
    """Before the loop's own handler: during the imports (wait_for=None: at once) or the
    compile (once the folder is locked and lab.log opened). Never a KeyboardInterrupt raised
    into JAX (swallowed in a gc callback, or a SIGSEGV in the teardown), never the default
    action; the folder takes a fresh run of the same name afterwards."""
    import signal
    import time

    cmd = [sys.executable, "-m", "lab.run", *TINY, f"out_dir={tmp_path}", "name=s", "steps=3000"]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while wait_for and time.time() < deadline and not (tmp_path / "s" / wait_for).exists():
        time.sleep(0.02)
    time.sleep(0.3 if wait_for else 1.0)  # the compile; or jax's import
    proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, (out, err)
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"{sig}: exiting; "), err
    assert wait_for is None or "before training: nothing was written" in err, err
    assert not (tmp_path / "s" / "metrics.jsonl").exists()
    assert _run(tmp_path, "name=s", "steps=2") == 0


def test_a_signal_while_a_resume_compiles_says_the_folder_is_as_it_was(tmp_path):
    """A stop before a resume's first step said "nothing was written in <folder> but
    lab.log", of a folder that holds the whole earlier run: it says the folder is as that run
    left it, and that the same command resumes it."""
    import signal

    assert _run(tmp_path, "name=r", "steps=2", "checkpoint_every=1") == 0
    keys = [*TINY, f"out_dir={tmp_path}", "name=r", "resume=true", "steps=3000"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "lab.run", *keys],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:  # the header is printed once the folder is claimed
        if line.startswith("compiling"):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    run_dir = tmp_path / "r"
    said = f"SIGINT: exiting; before training: {run_dir} keeps the earlier run; the same "
    assert err.strip() == said + "command resumes it", err
    assert checkpoint.saved_steps(run_dir) == [1, 2]


@pytest.mark.parametrize(
    ("every", "ckpt"),
    # checkpoint_every=2 over 3 steps: step 2, and step 3 where the run ends
    [(2, "checkpoint step 3 in"), (0, "no checkpoint (checkpoint_every=0)")],
)
def test_a_finished_run_ends_with_the_line_of_what_its_folder_keeps(tmp_path, capsys, every, ckpt):
    """... naming the folder as it is: a name's [brackets] are not markup, its :b: no emoji
    (printed through rich, name=[red]f lost its tag and a:b:x read a🅱x)."""
    name = "[red]f:b:x"
    assert _run(tmp_path, f"name={name}", "steps=3", f"checkpoint_every={every}") == 0
    out = capsys.readouterr().out.strip().splitlines()
    last = out[-1]
    assert last.startswith(f"finished at step 3; kept in {tmp_path / name}: {ckpt}"), last
    assert last.endswith("; metrics.jsonl to step 3"), last
    assert f"run folder: {tmp_path / name}" in out and f"lab.run {name}" in out, out[:3]
    assert checkpoint.saved_steps(tmp_path / name) == ([2, 3] if every else [])


def test_a_signal_to_a_tool_is_one_line_and_leaves_no_empty_records(tmp_path):
    """A measuring tool stopped mid-run: one line and 143, never the default action (which
    left the reserved records file empty) or a native library's stack trace."""
    import signal
    import time

    cmd = [sys.executable, "-m", "lab.tools.ceilings", f"out_dir={tmp_path}", "plot=false"]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not list(tmp_path.glob("*.jsonl")):
        time.sleep(0.05)
    time.sleep(0.5)  # measuring
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, (out[-2000:], err[-2000:])
    assert err == "SIGTERM: exiting; nothing was written\n", err
    assert not list(tmp_path.iterdir())


def test_a_signal_keeps_the_points_a_tool_measured(tmp_path):
    """A sweep stopped part-way keeps every point it finished (it wrote nothing before), and
    its line says where: the collectives, timed point by point."""
    import signal

    cmd = [sys.executable, "-m", "lab.tools.collectives", f"out_dir={tmp_path}", "plot=false"]
    cmd += ["ops=all-reduce,all-gather", "budget=0.05"]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # without a terminal, each point's label is a line of its own
        if "(3/" in line:
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, (out[-2000:], err[-2000:])
    (path,) = tmp_path.glob("*.jsonl")
    n = int(err.split("the ")[1].split(" points")[0])
    assert err == f"SIGTERM: exiting; the {n} points timed so far are in {path}\n", err
    kept = [json.loads(x) for x in path.read_text().splitlines()]
    assert n >= 2 and len(kept) == 2 * n  # algbw and busbw of each, written once
    assert {r["what"] for r in kept} == {"collective algbw", "collective busbw"}


def test_a_signal_keeps_the_ceilings_a_run_measured(tmp_path):
    """The ceilings stopped part-way keep every row they finished: their records, a table of
    them, and a line that says where they are and which rows were never reached."""
    import signal

    cmd = [sys.executable, "-m", "lab.tools.ceilings", f"out_dir={tmp_path}", "plot=false"]
    cmd += ["quick=true", "budget=0.05"]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # without a terminal, each row's end is a line of its own
        if "(3/" in line:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out[-2000:], err[-2000:])
    (path,) = tmp_path.glob("*.jsonl")
    kept = [json.loads(x) for x in path.read_text().splitlines()]
    whats = [r["what"] for r in kept]
    assert len(whats) >= 3 and len(set(whats)) == len(whats)  # each row written once
    assert err.startswith(f"SIGINT: exiting; stopped after {len(kept)} of "), err
    assert f"their records in {path}; not measured: " in err and err.count("\n") == 1, err
    assert "ridge point (compute roof / memory roof)" in err  # the last row, never reached
    assert f"ceilings · stopped after {len(kept)} rows" in out  # the table of what was done
    assert whats[0] == "matmul float32 precision=highest" and whats[0] in out


def test_keep_on_stop_writes_each_point_once():
    from lab import startup

    written, finished = [], ["a", "b"]
    flush = startup.keep_on_stop(finished, written.append)
    try:
        flush()
        finished.append("c")
        startup._last_words[-1]()  # what a signal calls: only the point not yet written
        flush()  # and the end's flush after it: nothing left
        assert written == [["a", "b"], ["c"]]
    finally:
        startup._last_words.remove(flush)  # this test's own, no other


def test_a_non_finite_first_step_after_a_resume_suspects_the_checkpoint(
    tmp_path, capsys, monkeypatch
):
    """A checkpoint saved before checksums were kept (or damaged in memory before its save)
    restores finite, and the first step after it goes non-finite on every resume. That step's
    line says so, and names the keys that resume changed, the other suspect."""
    assert _run(tmp_path, "name=N", "steps=2", "checkpoint_every=2") == 0
    assert _run(tmp_path, "name=O", "steps=2", "checkpoint_every=1") == 0
    _nan_at_step_3(monkeypatch)  # the step after the checkpoint at 2
    capsys.readouterr()
    assert _run(tmp_path, "name=N", "steps=4", "resume=true") == 1
    err = _one_line_error(
        capsys,
        "loss is nan at step 3, the first after resuming from checkpoint step 2",
        "training stopped. That checkpoint may be damaged; kept in",
        "(checkpoint 2 is the run's oldest: none before it to resume from)",
    )
    assert "unless" not in err  # nothing changed: the checkpoint is the one suspect
    # a resume that changed a key names it beside the checkpoint, with what it was
    assert _run(tmp_path, "name=N", "steps=4", "resume=true", "lr=0.5") == 1
    _one_line_error(capsys, "may be damaged, unless this resume's change (lr 0.003 → 0.5) is")
    assert _run(tmp_path, "name=O", "steps=4", "resume=true") == 1  # step 1 saved too
    _one_line_error(capsys, "(to resume from the one before, move checkpoints/2 out of the run")


def test_a_folder_that_cannot_take_the_metrics_is_a_mistake_exit_2(tmp_path, capsys):
    """A run folder whose metrics.jsonl is a folder cannot be used as it is: one line naming
    the file and why, exit 2 (a full disk, the machine's doing, stays exit 1), the checkpoint
    kept, and the run resumes once the folder is mended."""
    run_dir = tmp_path / "M"
    assert _run(tmp_path, "name=M", "steps=2", "checkpoint_every=2") == 0
    capsys.readouterr()
    kept = (run_dir / "metrics.jsonl").read_bytes()
    (run_dir / "metrics.jsonl").unlink()
    (run_dir / "metrics.jsonl").mkdir()
    assert _run(tmp_path, "name=M", "steps=4", "resume=true") == 2
    _one_line_error(capsys, "metrics.jsonl could not be written in", "(Is a directory)")
    assert (run_dir / "checkpoints" / "2").is_dir()
    (run_dir / "metrics.jsonl").rmdir()
    (run_dir / "metrics.jsonl").write_bytes(kept)
    assert _run(tmp_path, "name=M", "steps=4", "resume=true") == 0


def test_checkpoints_removed_during_a_run_are_said_to_be_gone(tmp_path, capsys, monkeypatch):
    """A run whose checkpoints folder is emptied under it ends saying the checkpoints it saved
    are gone, not that none was saved yet."""
    import shutil

    real = checkpoint.Saver.finish

    def finish_then_remove(self):
        real(self)
        if self.started and self.started[-1] == 4:
            shutil.rmtree(self.mngr.directory)

    monkeypatch.setattr(checkpoint.Saver, "finish", finish_then_remove)
    run_dir = tmp_path / "G"
    assert _run(tmp_path, "name=G", "steps=4", "checkpoint_every=2") == 0
    out = capsys.readouterr().out
    assert (
        f"no checkpoint: the 2 this run saved (the last at step 4) are gone from "
        f"{run_dir}/checkpoints" in " ".join(out.split())
    ), out


def test_the_summary_after_a_resume_covers_the_run(tmp_path, capsys):
    """After a resume the loss row starts at the run's first logged loss, not the segment's,
    and the segment is named apart, in the table and in summary.json."""
    run_dir = tmp_path / "R"
    assert _run(tmp_path, "name=R", "steps=3", "checkpoint_every=3") == 0
    first = json.loads((run_dir / "summary.json").read_text())["loss_first"]
    capsys.readouterr()
    assert _run(tmp_path, "name=R", "steps=5", "resume=true") == 0
    s = json.loads((run_dir / "summary.json").read_text())
    records, _ = rundir.read_metrics(run_dir / "metrics.jsonl")
    by_step = {r["step"]: r["loss"] for r in records}
    assert s["loss_first"] == first == by_step[1] and s["loss_first_step"] == 1
    assert s["resumed_from"] == 3 and s["steps_run"] == 2
    assert s["segment_loss_first"] == by_step[4] and s["loss_last"] == by_step[5]
    out = " ".join(capsys.readouterr().out.split())
    assert "since the resume at step 3" in out, out


def test_a_step_the_device_cannot_hold_is_refused_before_its_state_is_made(
    tmp_path, capsys, monkeypatch
):
    """The compiled step's memory is checked before the weights are drawn: a model the host
    cannot hold is one line and exit 2, not the kernel's kill while its state is made."""
    from lab import summary, train
    from lab.measure import memory

    monkeypatch.setattr(memory, "device_capacity_bytes", lambda device: 2**20)
    monkeypatch.setattr(summary, "PRECHECK_MARGIN", 1e30)  # the compiled figure decides here

    def drawn(self, key):
        raise AssertionError("the state was made before the step's memory was checked")

    monkeypatch.setattr(train.Trainer, "init", drawn)
    assert _run(tmp_path, "name=B", "steps=2") == 2
    _one_line_error(capsys, "the compiled step needs", "but the host has 0.00 GiB available now")


@pytest.mark.parametrize("value", ["abc", "1.5", "0", "-0.2"])
def test_a_bad_allocator_share_is_one_line_before_anything_runs(
    tmp_path, value, monkeypatch, capsys
):
    # JAX reads it as the GPU backend starts: a traceback, then a plan blaming the CUDA plugin
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", value)
    assert _run(tmp_path, "name=share", "compile_only=true") == 2
    _one_line_error(capsys, f"XLA_PYTHON_CLIENT_MEM_FRACTION={value!r}", "at most 1")
    assert not (tmp_path / "share").exists()


def test_the_allocator_share_under_both_its_names_is_one_line(tmp_path, monkeypatch, capsys):
    # JAX's GPU backend raises a ValueError at start when both are set
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.6")
    assert _run(tmp_path, "name=share", "compile_only=true") == 2
    _one_line_error(capsys, "XLA_CLIENT_MEM_FRACTION and XLA_PYTHON_CLIENT_MEM_FRACTION", "older")
    assert not (tmp_path / "share").exists()


def test_a_bad_allocator_share_for_a_gpu_plan_is_one_line_not_a_traceback(tmp_path):
    env = {**ENV, "XLA_PYTHON_CLIENT_MEM_FRACTION": "abc"}
    cmd = [sys.executable, "-m", "lab.run", "target=gpu:h100:1", f"out_dir={tmp_path}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-3000:]
    assert proc.stderr.startswith("error: XLA_PYTHON_CLIENT_MEM_FRACTION='abc'")
    assert len(proc.stderr.splitlines()) == 1


@pytest.mark.parametrize("steps", [2, 4])
def test_a_refused_resume_writes_nothing_in_the_folder(earlier, capsys, steps):
    # checkpoints 2, 4, 6: steps=2 is refused from every one of them, before the header and
    # the compile; steps=4 once the restore has taken step 6, after orbax has logged its
    # "Metadata file does not exist" lines, which must not reach the run's lab.log
    run_dir = earlier / "ckpt"
    before = _snapshot(run_dir)
    assert _run(earlier, "name=ckpt", f"steps={steps}", "resume=true") == 2
    out = capsys.readouterr()
    assert out.err.strip() == (
        f"error: resume=true: the run is saved at step 6 and steps={steps} leaves nothing to "
        "train; ask for steps > 6"
    )
    assert (out.out == "") == (steps == 2)
    assert _snapshot(run_dir) == before


def test_a_resume_with_another_model_shape_says_so_before_any_other_rule(earlier, capsys):
    """d_model=66 also breaks a rule of its own (heads split it): the resume named that rule,
    and a user who mended it was then told the model differs from the one saved. The shape
    comes first: no other change makes the checkpoints load."""
    run_dir = earlier / "ckpt"
    before = _snapshot(run_dir)
    assert _run(earlier, "name=ckpt", "steps=8", "resume=true", "d_model=66") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: resume=true: this run's model differs from the one saved"), err
    assert "(d_model=64 → 66)" in err and len(err.splitlines()) == 1, err
    assert _snapshot(run_dir) == before


def test_the_missing_steps_follow_the_files_own_cadence(tmp_path):
    """A file logged every 10 steps, torn, resumed with log_every=1: the steps it lost are
    its own multiples of 10, not every step since the first."""
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (10, 20)] + ['{"step": 3']
    lines += [json.dumps({"step": 50, "loss": 1.0})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    torn, missing = rundir.keep_metrics_before(tmp_path, 40, log_every=1)
    assert torn == 1 and missing == [30, 40]


def test_a_cpu_step_is_refused_against_the_memory_the_host_has_available_now(monkeypatch):
    """On a shared host the others' memory is not the run's: a CPU step that fits the host's
    total but not what is available now is refused, in a line that says 'available'; one that
    fits what is available passes. A GPU's capacity is its allocator's own, checked as before."""
    import types

    from lab import summary
    from lab.measure import memory

    gib = 2**30
    analysis = {"compiled_memory_per_device": {"total_bytes": 2 * gib}}
    analysis["capacity_bytes_per_device"] = 64 * gib  # the host's total
    cpu = types.SimpleNamespace(backend="cpu", local_count=1, aot=False)
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 1 * gib)
    line = summary.memory_problem(analysis, cpu)
    assert line and "the host has 1.00 GiB available now (of 64.00 GiB)" in line, line
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 4 * gib)
    assert summary.memory_problem(analysis, cpu) is None
    gpu = types.SimpleNamespace(backend="gpu", local_count=1, aot=False)
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 1 * gib)
    assert summary.memory_problem(analysis, gpu) is None  # the host's RAM is not the GPU's
    # simulated devices share the host: the line gives their sum and each one's part, not a
    # "per device" figure that is really the sum
    cpu8 = types.SimpleNamespace(backend="cpu", local_count=8, aot=False)
    line = summary.memory_problem({**analysis, "devices": 8}, cpu8)
    assert "needs 16.00 GiB over its 8 simulated devices (2.00 GiB each)" in line, line
    assert "per device" not in line
    # a one-device mesh among eight (the timing tools') holds one device's part, not eight
    line = summary.memory_problem({**analysis, "devices": 1}, cpu8)
    assert "needs 2.00 GiB but the host has 1.00 GiB available now" in line, line


def test_the_attention_sweep_sizes_its_programs_by_the_hosts_available_memory(monkeypatch):
    """On CPU the sweep's free memory is the host's available memory, read in one place."""
    from lab.studies import attention as bench

    monkeypatch.setattr(bench, "device_memory_stats", lambda device: None)
    monkeypatch.setattr(bench, "host_available_bytes", lambda: 12345)
    assert bench._free_bytes() == 12345

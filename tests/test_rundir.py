"""The run folder under a demanding user: damaged, incomplete and non-finite checkpoints, a
changed model, two runs at once, torn metrics, paths, hangs and signals. Every refusal is one
line and exit 2; no good checkpoint or metrics line is lost.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from lab import checkpoint, rundir
from lab.run import main

TINY = ["model=tiny", "n_layers=1", "batch_size=4", "seq_len=16", "log_every=1"]


def _run(tmp_path, *args) -> int:
    return main([*TINY, f"out_dir={tmp_path}", *args])


def _one_line_error(capsys, needle: str) -> str:
    err = capsys.readouterr().err.strip()
    assert needle in err, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def _saved_once(tmp_path_factory):
    """The run `saved` copies: trained once per test process, not once per test."""
    root = tmp_path_factory.mktemp("saved")
    assert _run(root, "name=R", "steps=6", "checkpoint_every=2") == 0
    return root / "R"


@pytest.fixture
def saved(_saved_once, tmp_path):
    """A run saved at steps 2, 4, 6 (max_to_keep=3), a copy of its own in this test's folder
    (a run folder holds no path of its own: it resumes wherever it is)."""
    shutil.copytree(_saved_once, tmp_path / "R", symlinks=True)
    return tmp_path, tmp_path / "R"


def _damage_metadata(step_dir: Path):
    (step_dir / "default" / "_METADATA").unlink()


def _damage_data(step_dir: Path):
    for f in (step_dir / "default").rglob("d/*"):  # the array data files
        f.write_bytes(b"garbage")


def _truncate_data(step_dir: Path):
    for f in (step_dir / "default").rglob("d/*"):
        f.write_bytes(f.read_bytes()[:7])


def _damage_manifest(step_dir: Path):
    (step_dir / "default" / "manifest.ocdbt").write_bytes(b"\x00not a manifest")


def _remove_item(step_dir: Path):
    import shutil

    shutil.rmtree(step_dir / "default")


def _empty_folder(step_dir: Path):
    import shutil

    shutil.rmtree(step_dir)
    step_dir.mkdir()


def _flip_a_saved_value(step_dir: Path):
    """One bit of one saved weight, in files that are otherwise whole: the step's arrays are
    written again with the sign of one value flipped (a disk's or a copy's flip inside
    compressed data can decode as well, to other numbers). Only the checksums tell."""
    import shutil

    import numpy as np

    item = step_dir / "default"
    ckptr = checkpoint._orbax().StandardCheckpointer()
    saved = ckptr.restore(item)
    path, weight = max(
        jax.tree_util.tree_leaves_with_path(saved["params"]), key=lambda kx: np.size(kx[1])
    )
    flipped = np.asarray(weight).copy()
    flipped.reshape(-1)[0] *= -1  # finite, and wrong
    saved = jax.tree_util.tree_map_with_path(
        lambda p, x: flipped if p == path else x, saved["params"]
    )
    whole = ckptr.restore(item)
    shutil.rmtree(item)
    ckptr.save(item, {**whole, "params": saved})
    ckptr.wait_until_finished()


def _damage_checksums(step_dir: Path):
    (step_dir / checkpoint.SUMS / "metadata").write_bytes(b"{not json")


def _empty_checksums(step_dir: Path):  # an edited record: valid, and checking nothing
    (step_dir / checkpoint.SUMS / "metadata").write_text("{}")


def _remove_checksums(step_dir: Path):  # the step's metadata still names them
    import shutil

    shutil.rmtree(step_dir / checkpoint.SUMS)


@pytest.mark.parametrize(
    "damage",
    [
        _damage_metadata,
        _damage_data,
        _truncate_data,
        _damage_manifest,
        _remove_item,
        _empty_folder,
        _flip_a_saved_value,
        _damage_checksums,
        _empty_checksums,
        _remove_checksums,
    ],
)
def test_a_damaged_newest_step_is_moved_aside_and_the_run_goes_on(saved, capsys, damage):
    tmp_path, run_dir = saved
    damage(run_dir / "checkpoints" / "6")
    capsys.readouterr()
    assert _run(tmp_path, "name=R", "steps=8", "checkpoint_every=2", "resume=true") == 0
    out = capsys.readouterr()
    assert "resumed from checkpoint at step 4" in out.out
    assert "checkpoint step 6 is damaged" in out.err and len(out.err.strip().splitlines()) == 1
    assert "TensorStore details" not in out.err and "bound method" not in out.err  # the cause
    (moved,) = (run_dir / "checkpoints-damaged").iterdir()  # moved aside, never deleted
    assert moved.name.startswith("6-")
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [4, 6, 8]
    assert _steps(run_dir) == list(range(1, 9))  # every step once
    superseded = run_dir / "metrics-superseded.jsonl"  # the repeated steps 5-6, not deleted
    assert [json.loads(x)["step"] for x in superseded.read_text().splitlines()] == [5, 6]
    # and the folder resumes again, from the step the second run saved
    assert _run(tmp_path, "name=R", "steps=10", "checkpoint_every=2", "resume=true") == 0
    assert "resumed from checkpoint at step 8" in capsys.readouterr().out


def test_a_flipped_value_is_named_by_its_checksum(saved, capsys):
    tmp_path, run_dir = saved
    _flip_a_saved_value(run_dir / "checkpoints" / "6")
    capsys.readouterr()
    assert _run(tmp_path, "name=R", "steps=7", "resume=true") == 0
    err = capsys.readouterr().err
    assert "checkpoint step 6 is damaged (params." in err, err
    assert "the values differ from those saved (checksum)" in err, err


def test_a_step_saved_before_checksums_restores_unchecked(saved, capsys):
    """A step of an older lab: no checksum folder, and its metadata names none."""
    tmp_path, run_dir = saved
    step = run_dir / "checkpoints" / "6"
    _remove_checksums(step)
    meta = json.loads((step / "_CHECKPOINT_METADATA").read_text())
    del meta["item_handlers"][checkpoint.SUMS]
    (step / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))
    capsys.readouterr()
    assert _run(tmp_path, "name=R", "steps=8", "resume=true") == 0
    out = capsys.readouterr()
    assert "resumed from checkpoint at step 6" in out.out and "damaged" not in out.err


@pytest.mark.parametrize(
    "error, needle",
    [
        (PermissionError(13, "Permission denied"), "permission denied"),
        (ValueError("UNKNOWN: Gloo context initialization failed: DEADLINE_EXCEEDED"), "together"),
        (RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 4 GiB"), "out of memory"),
    ],
)
def test_a_step_the_reader_cannot_restore_is_left_in_place_and_the_resume_stops(
    saved, capsys, monkeypatch, error, needle
):
    """Permissions, memory or the run's other processes failing a restore say nothing about
    the step's files: it stays where it is, no earlier step is tried, one line and exit 2."""
    tmp_path, run_dir = saved
    metrics = (run_dir / "metrics.jsonl").read_text()

    def fail(self, *args, **kwargs):
        raise RuntimeError("restore failed") from error

    monkeypatch.setattr(checkpoint._orbax().StandardCheckpointer, "restore", fail)
    capsys.readouterr()
    assert _run(tmp_path, "name=R", "steps=8", "resume=true") == 2
    err = _one_line_error(capsys, "checkpoint step 6 was not restored")
    assert needle in err and "it was not moved" in err
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [2, 4, 6]
    assert not (run_dir / "checkpoints-damaged").exists()
    assert (run_dir / "metrics.jsonl").read_text() == metrics


def test_a_damaged_step_in_a_folder_named_like_a_reader_failure_is_still_damage(tmp_path, capsys):
    """The error's text names the folder: what it is called decides nothing."""
    assert _run(tmp_path, "name=resource_exhausted-deadline_exceeded", "steps=4",
                "checkpoint_every=2") == 0  # fmt: skip
    run_dir = tmp_path / "resource_exhausted-deadline_exceeded"
    _truncate_data(run_dir / "checkpoints" / "4")
    capsys.readouterr()
    assert _run(tmp_path, f"name={run_dir.name}", "steps=6", "resume=true") == 0
    out = capsys.readouterr()
    assert "resumed from checkpoint at step 2" in out.out
    assert "checkpoint step 4 is damaged" in out.err


def test_a_refusal_after_a_damaged_step_was_moved_says_so_in_its_one_line(saved, capsys):
    """The newest step is damaged and moved aside; the one before restores but steps= leaves
    nothing to train after it: one line, which says what the resume did move."""
    tmp_path, run_dir = saved
    _damage_data(run_dir / "checkpoints" / "6")
    capsys.readouterr()
    assert _run(tmp_path, "name=R", "steps=4", "resume=true") == 2
    err = _one_line_error(capsys, "steps=4 leaves nothing to train")
    assert err.endswith("(before it, step 6 moved to checkpoints-damaged/ as damaged)"), err
    assert checkpoint.saved_steps(run_dir) == [2, 4]


def test_a_resume_with_nothing_to_resume_is_refused_not_started_again(saved, capsys):
    """A folder with no checkpoint, or none that restores, is not silently trained from step
    0 under the name of a resume (its metrics put aside as superseded): one line, exit 2,
    overwrite=true named; damaged steps stay in checkpoints-damaged/."""
    tmp_path, run_dir = saved
    assert _run(tmp_path, "name=N", "steps=3") == 0  # checkpoint_every=0: saves none
    metrics = (tmp_path / "N" / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert _run(tmp_path, "name=N", "steps=5", "resume=true") == 2
    out = capsys.readouterr()
    assert out.out == ""  # refused before the run's header and compile
    assert out.err.startswith("error: resume=true:") and "holds no checkpoint" in out.err
    assert len(out.err.strip().splitlines()) == 1
    assert (tmp_path / "N" / "metrics.jsonl").read_text() == metrics
    assert _run(tmp_path, "name=N", "steps=5") == 2  # and a fresh run does not send them back
    assert "resume=true" not in _one_line_error(capsys, "already holds a run")
    for step in (2, 4, 6):
        _damage_metadata(run_dir / "checkpoints" / str(step))
    capsys.readouterr()
    assert _run(tmp_path, "name=R", "steps=8", "resume=true") == 2
    # one line: the steps moved aside, why the newest failed, and how to start again
    err = _one_line_error(capsys, "steps 2, 4, 6 damaged, moved to checkpoints-damaged/; step 6: ")
    assert "overwrite=true" in err
    assert len(list((run_dir / "checkpoints-damaged").iterdir())) == 3
    # asked again, the folder says where its steps went, as lab.serve does
    assert _run(tmp_path, "name=R", "steps=8", "resume=true") == 2
    err = _one_line_error(capsys, "checkpoints-damaged/ keeps 2-")
    assert err.index("2-") < err.index("4-") < err.index("6-"), err
    from lab.serve import main as serve

    assert serve([f"out_dir={tmp_path}", "run=R", f"results={tmp_path / 'served'}"]) == 2
    _one_line_error(capsys, "checkpoints-damaged keeps 2-")


def test_a_step_folder_renamed_by_hand_is_set_aside_and_damage_with_nowhere_to_go_is_one_line(
    saved, capsys
):
    """A step folder renamed with a leading zero ("06", which the checkpoint library would
    read as step 6 and then skip saving step 6) is moved aside with a warning and the run
    saves step 6 again; a damaged step that cannot be moved aside (checkpoints-damaged is a
    file) is one line and exit 2, the folder as it was: never a step left to be skipped."""
    tmp_path, run_dir = saved
    (run_dir / "checkpoints" / "6").rename(run_dir / "checkpoints" / "06")
    capsys.readouterr()
    assert _run(tmp_path, "name=R", "steps=7", "checkpoint_every=3", "resume=true") == 0
    out = capsys.readouterr()
    assert "resumed from checkpoint at step 4" in out.out
    (line,) = out.err.strip().splitlines()
    assert "checkpoints/06 is not a step folder the lab writes; moved to" in line
    assert checkpoint.saved_steps(run_dir)[-2:] == [6, 7]  # step 6 saved again, and the end
    _damage_data(run_dir / "checkpoints" / "7")
    shutil.rmtree(run_dir / "checkpoints-damaged")
    (run_dir / "checkpoints-damaged").write_text("not a folder")
    assert _run(tmp_path, "name=R", "steps=9", "resume=true") == 2
    err = _one_line_error(capsys, "checkpoint step 7 is damaged")
    assert "cannot be moved to" in err and (run_dir / "checkpoints" / "7").is_dir()
    assert "moved to checkpoints-damaged/ as damaged" not in err  # it was not


def test_resuming_with_another_model_is_refused_and_changes_nothing(saved, capsys):
    tmp_path, run_dir = saved
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    metrics = (run_dir / "metrics.jsonl").read_text()
    assert _run(tmp_path, "name=R", "steps=8", "resume=true", "d_model=128") == 2
    _one_line_error(capsys, "d_model=64 → 128")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    assert (run_dir / "metrics.jsonl").read_text() == metrics


def test_a_resume_takes_the_keys_the_run_was_started_with(saved, capsys):
    """name= and resume=true alone continue the run as it was asked for: its checkpoint
    cadence, model and batch come from config.json (the keys given now over them), so the
    resumed steps are saved; a second resume takes the first resume's steps= again."""
    tmp_path, run_dir = saved
    asked = json.loads((run_dir / "config.json").read_text())["request"]
    assert asked["checkpoint_every"] == 2 and asked["n_layers"] == 1 and "resume" not in asked
    first = json.loads((run_dir / "summary.json").read_text())
    first_records = (run_dir / "records.jsonl").read_text().splitlines()
    assert main([f"out_dir={tmp_path}", "name=R", "resume=true", "steps=8"]) == 0
    assert "resumed from checkpoint at step 6" in capsys.readouterr().out
    assert checkpoint.saved_steps(run_dir) == [4, 6, 8]
    # the summary and records are the resumed segment's; the first segment's are kept whole
    assert json.loads((run_dir / "summary.json").read_text())["steps_run"] == 2
    (kept,) = (run_dir / "summaries-superseded.jsonl").read_text().splitlines()
    kept = json.loads(kept)
    assert kept["summary"] == first and kept["summary"]["steps_run"] == 6
    assert kept["records"] == [json.loads(r) for r in first_records] and "what" not in kept
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["checkpoint_every"] == 2 and cfg["batch_size"] == 4 and cfg["seq_len"] == 16
    assert cfg["request"]["steps"] == 8
    assert main([f"out_dir={tmp_path}", "name=R", "resume=true"]) == 2
    _one_line_error(capsys, "saved at step 8 and steps=8 leaves nothing to train")


def test_the_backends_defaults_are_kept_with_the_keys_asked(tmp_path):
    """Keys the user left to the backend (a GPU's default model, batch and length differ from
    a CPU's) are kept with the values they took, so a resume elsewhere goes on alike."""
    from lab.config import BACKEND_DEFAULTS, BACKEND_KEYS, Config

    assert main([f"out_dir={tmp_path}", "name=D", "n_layers=1", "steps=1"]) == 0
    asked = json.loads((tmp_path / "D" / "config.json").read_text())["request"]
    assert set(BACKEND_KEYS) == set(BACKEND_DEFAULTS["gpu"])
    assert {k: asked[k] for k in BACKEND_KEYS} == {
        "preset": Config().preset,
        "batch_size": Config().batch_size,
        "seq_len": Config().seq_len,
        "steps": 1,
    }


def test_a_folder_from_before_the_request_was_kept_resumes_with_its_config(saved, capsys):
    tmp_path, run_dir = saved
    cfg = json.loads((run_dir / "config.json").read_text())
    del cfg["request"]
    (run_dir / "config.json").write_text(json.dumps(cfg))
    assert main([f"out_dir={tmp_path}", "name=R", "resume=true", "steps=8"]) == 0
    assert checkpoint.saved_steps(run_dir) == [4, 6, 8]


@pytest.mark.parametrize(
    "damage, needle",
    [
        (lambda c: c["request"].update(steps="abc"), "config.json is damaged (steps='abc'"),
        (lambda c: c["model"].update(d_model="big"), "config.json is damaged (d_model='big'"),
        (lambda c: c["request"].update(mesh="abc"), "config.json is damaged (mesh='abc'"),
        (lambda c: c.update(request="steps=8"), "damaged (its request is not a table)"),
        (lambda c: c["model"].pop("n_layers"), "n_layers=None → 1"),
        # a key this lab does not know (a hand edit, another version): a warning, and on
        (lambda c: c["request"].update(stpes=1), "stpes=1 (did you mean steps?), not a key"),
        (lambda c: c.update(target="tpu:v5e:2x4"), "holds a plan (target=tpu:v5e:2x4"),
    ],
)
def test_a_damaged_config_refuses_the_resume_in_one_line(saved, capsys, damage, needle):
    tmp_path, run_dir = saved
    cfg = json.loads((run_dir / "config.json").read_text())
    damage(cfg)
    (run_dir / "config.json").write_text(json.dumps(cfg))
    code = main([f"out_dir={tmp_path}", "name=R", "resume=true", "steps=8"])
    if "not a key" in needle:
        assert code == 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("warning: ") and needle in err[0], err
        return
    assert code == 2
    err = _one_line_error(capsys, needle)
    if "damaged" in needle:  # what to do about it, too
        assert err.endswith("start the run again with overwrite=true or another name="), err


def test_a_moved_run_folder_resumes_where_it_is_and_a_model_asked_now_is_checked(saved, capsys):
    """The folder named now is the run (out_dir and name are never taken from config.json);
    a model asked on resume replaces the saved one's fields and is refused when the shapes
    differ, for folders written before config.json kept the request too."""
    tmp_path, run_dir = saved
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    run_dir.rename(moved / "R")
    assert main([f"out_dir={moved}", "name=R", "resume=true", "steps=8"]) == 0
    assert checkpoint.saved_steps(moved / "R") == [4, 6, 8]
    assert not run_dir.exists()
    cfg = json.loads((moved / "R" / "config.json").read_text())
    del cfg["request"]
    (moved / "R" / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert main([f"out_dir={moved}", "name=R", "resume=true", "steps=10", "model=small"]) == 2
    _one_line_error(capsys, "d_model=64 → 256")


def test_a_launched_resume_is_checked_with_the_runs_own_mesh(tmp_path):
    """lab.tools.launch checks the keys its processes will run with: a resume's come from
    the run (mesh=4x2: 8 devices for 2 processes), not the defaults (1 device)."""
    from lab.tools import launch

    assert _run(tmp_path, "name=M", "mesh=4x2", "steps=2", "checkpoint_every=2") == 0
    keys = {"name": "M", "resume": True, "out_dir": str(tmp_path), "steps": 4}
    assert launch.check(2, keys) == keys


def test_a_run_folder_without_its_config_says_so(saved, capsys):
    """A fresh run sends the user to resume=true; the resume must not send them back."""
    tmp_path, run_dir = saved
    (run_dir / "config.json").unlink()
    assert _run(tmp_path, "name=R", "steps=8", "resume=true") == 2
    _one_line_error(capsys, "holds a run's files (checkpoints")
    (tmp_path / "F").write_text("a file")
    assert _run(tmp_path, "name=F", "resume=true") == 2
    _one_line_error(capsys, "F is a file, not a run folder")


def test_steps_below_the_saved_step_are_refused_and_the_summary_kept(saved, capsys):
    tmp_path, run_dir = saved
    summary = (run_dir / "summary.json").read_text()
    assert _run(tmp_path, "name=R", "steps=4", "resume=true") == 2
    _one_line_error(capsys, "saved at step 6 and steps=4 leaves nothing to train")
    assert (run_dir / "summary.json").read_text() == summary


def test_a_torn_metrics_line_is_kept_apart_and_the_run_resumes(saved, capsys):
    tmp_path, run_dir = saved
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 3.1')  # a kill during the write
    assert _run(tmp_path, "name=R", "steps=8", "resume=true", "checkpoint_every=2") == 0
    assert _steps(run_dir) == list(range(1, 9))
    assert (run_dir / "metrics-torn.jsonl").read_text().startswith('{"step": 7')


# lr=1e39 is past float32's range: numpy says so as jax makes it a float32 constant
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_nan_at_step_1_saves_no_checkpoint_of_it(tmp_path, capsys):
    """lr=1e39: the first update overflows the weights while loss and gradient are finite."""
    args = ["name=N", "steps=5", "checkpoint_every=1", "lr=1e39", "warmup_steps=0"]
    assert _run(tmp_path, *args) == 1
    _one_line_error(capsys, "weights are inf at step 1: training stopped")
    assert not list((tmp_path / "N" / "checkpoints").glob("[0-9]*"))


def test_a_run_folder_belongs_to_one_live_run(saved, capsys):
    tmp_path, run_dir = saved
    with checkpoint.Lock(run_dir):
        assert _run(tmp_path, "name=R", "steps=8", "resume=true") == 2
    _one_line_error(capsys, f"run folder {run_dir} is in use by pid {os.getpid()}")


def test_checkpoints_that_are_a_file_are_refused(tmp_path, capsys):
    (tmp_path / "F").mkdir()
    (tmp_path / "F" / "checkpoints").write_text("not a folder")
    assert _run(tmp_path, "name=F", "steps=2", "checkpoint_every=1") == 2
    _one_line_error(capsys, "checkpoints is a file, not a folder")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["name=never", "resume=true"], "no run named 'never'"),
        (["name=../../x"], "a run name is one folder name"),
        (["name=/elsewhere/x"], "a run name is one folder name"),
        (["lr=nan"], "lr='nan': expected a finite number"),
        (["lr=inf"], "lr='inf': expected a finite number"),
        (["seq_len=20000", "data=text"], "is longer than the bundled text"),
        (["out_dir=/dev/null/x", "name=a"], "cannot write to '/dev/null/x'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, needle):
    given = {a.split("=")[0] for a in args}
    base = [a for a in [*TINY, f"out_dir={tmp_path}"] if a.split("=")[0] not in given]
    assert main([*base, *args]) == 2
    _one_line_error(capsys, needle)


def test_a_read_only_out_dir_is_one_line(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user who may write anywhere (root)")
        assert main([*TINY, f"out_dir={ro}", "name=a"]) == 2
        _one_line_error(capsys, "cannot write to")
    finally:
        ro.chmod(0o700)


def test_ctrl_c_during_compilation_is_one_line(tmp_path, capsys, monkeypatch):
    from lab import train

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(train.Trainer, "lower", interrupted)
    assert _run(tmp_path, "name=k", "steps=2") == 130
    err = capsys.readouterr().err.strip()
    assert "interrupted" in err and len(err.splitlines()) == 1


def test_an_unreachable_coordinator_is_one_line_within_its_timeout():
    cmd = [sys.executable, "-m", "lab.run", *TINY, "coordinator=127.0.0.1:9"]
    cmd += ["num_processes=2", "process_id=1", "coordinator_timeout=5", "mesh=data:-1"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 60
    lines = [x for x in proc.stderr.strip().splitlines() if x.startswith("error:")]
    assert lines and "coordinator=127.0.0.1:9" in lines[0] and "within 5 s" in lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_joining_ends_the_wait_in_one_line(sig):
    """Process 0 waits inside JAX's runtime for a peer that never comes; a scheduler's
    SIGTERM (scancel) or a Ctrl-C ends it at once, in one line naming the signal, 143 or 130,
    instead of after coordinator_timeout (60 s here) with the timeout's line."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "lab.run", *TINY, f"coordinator=localhost:{port}"]
    cmd += ["num_processes=2", "process_id=0", "coordinator_timeout=60", "mesh=data:-1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while True:  # process 0 serves the coordinator: once it listens, the wait has begun
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        try:
            socket.create_connection(("localhost", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - t0 < 10
    assert proc.returncode == (143 if sig == signal.SIGTERM else 130), err
    name = signal.Signals(sig).name
    assert err.strip().splitlines()[-1] == (
        f"error: coordinator=localhost:{port}: process 0 of 2: {name} while joining: nothing ran"
    ), err


def _wait_for(path: Path, lines: int, proc, timeout_s: float = 180):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= lines:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError(f"{path} did not reach {lines} lines")


@pytest.mark.once
def test_a_signal_on_a_checkpoint_step_saves_once_and_exits_143(tmp_path):
    """checkpoint_every=1: every step is a checkpoint step, so SIGTERM lands on one."""
    cmd = [sys.executable, "-m", "lab.run", *TINY, f"out_dir={tmp_path}", "name=T"]
    cmd += ["steps=100000", "checkpoint_every=1"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(tmp_path / "T" / "metrics.jsonl", 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "SIGTERM: checkpoint saved at step" in out
    saved = int(out.split("checkpoint saved at step ")[1].split()[0])
    assert saved in [int(p.name) for p in (tmp_path / "T" / "checkpoints").iterdir()]


@pytest.mark.once
def test_sigterm_to_the_launcher_reaches_its_processes(tmp_path):
    cmd = [sys.executable, "-m", "lab.tools.launch", "processes=2", "mesh=2", *TINY]
    cmd += [f"out_dir={tmp_path}", "name=L", "steps=100000", "checkpoint_every=2"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    _wait_for(tmp_path / "L" / "metrics.jsonl", 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out[-3000:]
    assert "[p0] SIGTERM: checkpoint saved at step" in out
    ps = subprocess.run(["pgrep", "-f", f"out_dir={tmp_path}"], capture_output=True, text=True)
    assert ps.stdout.strip() == "", "a child process outlived the launcher"


def test_a_resume_never_reads_a_circular_pipelines_layers_in_another_order():
    """A circular pipeline's checkpoint holds its blocks by stage. Its order is known from
    the step's own record, or for older steps from config.json (its block order, or the mesh
    it asked for): a resume in another layout moves them (lab.train.Layout). The one order
    nothing records, a folder from before config.json kept it whose stage axis was -1, is
    refused where it would be read in another order."""
    import dataclasses

    from lab.config import make_config
    from lab.errors import ConfigError
    from lab.loop import _check_same_block_order, block_order
    from lab.train import Layout, config_layout

    def saved(stages, **keys):
        cfg = make_config(**keys)
        return {
            **dataclasses.asdict(cfg),
            "block_order": block_order(stages, cfg.model.pipeline_repeats),
        }

    circular = dict(
        mesh="stage:-1", strategy="pp", n_layers=8, pipeline_repeats=2, scan_layers=True
    )
    for change, stages in (
        (dict(pipeline_repeats=1), 4),
        ({}, 8),  # the same stage:-1 filled by more devices
        (dict(mesh="1", strategy="dp", pipeline_repeats=1), 1),
    ):  # known: moved, not refused
        _check_same_block_order(saved(4, **circular), make_config(**{**circular, **change}), stages)
    assert config_layout(saved(4, **circular)) == Layout(True, 4, 2)
    # a folder written before config.json kept the order: read from the mesh it asked for
    old = dataclasses.asdict(make_config(**{**circular, "mesh": "stage:4"}))
    assert config_layout(old) == Layout(True, 4, 2)
    _check_same_block_order(old, make_config(**circular), 2)
    unknown = dataclasses.asdict(make_config(**circular))  # stage:-1, no block order kept
    assert config_layout(unknown) is None
    _check_same_block_order(unknown, make_config(**circular), -1)  # the same words: read
    with pytest.raises(ConfigError, match="stage=-1, pipeline_repeats=2"):
        _check_same_block_order(unknown, make_config(**{**circular, "pipeline_repeats": 1}), 4)


def test_runs_lab_run_names_in_the_same_second_never_share_a_folder(tmp_path, monkeypatch, capsys):
    """A name lab.run chose is never another run's: a second run in the same second (its
    folder held by a live run, or finished) takes -2; a name the user gave is refused."""
    from lab import config

    monkeypatch.setattr(config.time, "strftime", lambda fmt: "20261129-101043")
    assert _run(tmp_path, "steps=1") == 0
    (first,) = tmp_path.iterdir()
    (tmp_path / f"{first.name}-2").mkdir()
    with checkpoint.Lock(tmp_path / f"{first.name}-2"):  # a live run holds the next name
        assert _run(tmp_path, "steps=1", "overwrite=true") == 0  # never clears another's run
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [first.name, f"{first.name}-2", f"{first.name}-3"]
    assert _steps(first) == [1] and _steps(tmp_path / f"{first.name}-3") == [1]
    capsys.readouterr()
    assert _run(tmp_path, "steps=1", f"name={first.name}") == 2  # the user's own name: refused
    _one_line_error(capsys, "already holds a run")


def test_steps_0_trains_nothing_and_says_so(tmp_path, capsys):
    assert _run(tmp_path, "steps=0") == 2
    _one_line_error(capsys, "steps=0 trains nothing")
    assert not any(tmp_path.iterdir())


def test_a_folder_holding_a_plan_is_not_offered_a_resume(tmp_path):
    """A plan (target=) trains nothing: refusing a new run in its folder names the plan and
    offers another name or overwrite=true, not resume=true (which refuses a plan)."""
    import pytest

    from lab import rundir
    from lab.errors import ConfigError

    (tmp_path / "config.json").write_text('{"target": "tpu:v5e:2x2", "compile_only": true}')
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match="already holds a plan for target=tpu:v5e:2x2") as e:
        rundir.check_fresh(tmp_path)
    assert "resume" not in str(e.value)


def test_a_libraries_log_that_cannot_be_written_is_one_line(tmp_path):
    """lab.log a folder (or read-only): refused in one line naming it, not a traceback."""
    from lab.errors import ConfigError

    (tmp_path / "lab.log").mkdir()
    for delay in (False, True):
        with pytest.raises(ConfigError, match=r"lab.log \(the libraries' log\): a folder"):
            rundir.quiet_libraries(tmp_path, delay=delay)
    (tmp_path / "lab.log").rmdir()
    import logging
    import threading

    names = (*rundir.LIBRARY_LOGGERS, "lab.background")
    kept = {n: (logging.getLogger(n).handlers, logging.getLogger(n).propagate) for n in names}
    hooks = sys.unraisablehook, threading.excepthook
    try:
        rundir.quiet_libraries(tmp_path, delay=True)  # a shared results folder: no empty file
        assert not (tmp_path / "lab.log").exists()
    finally:  # the process's logging as it was, for the tests after this one
        for n, (handlers, propagate) in kept.items():
            logging.getLogger(n).handlers, logging.getLogger(n).propagate = handlers, propagate
        sys.unraisablehook, threading.excepthook = hooks


def test_a_resume_says_which_keys_it_changes(tmp_path, capsys):
    """Keys given with resume=true that differ from the run's are said once: the run goes on
    with them, and they are its keys from then on."""
    args = [*TINY, f"out_dir={tmp_path}", "name=r", "checkpoint_every=2"]
    assert main([*args, "steps=2", "coordinator_timeout=30"]) == 0  # the invocation's own
    capsys.readouterr()
    assert main([*args, "steps=3", "resume=true", "lr=0.01", "seed=3"]) == 0
    assert "changed from the run's keys: lr 0.003 → 0.01, seed 0 → 3" in capsys.readouterr().out
    assert main([*args, "steps=4", "resume=true"]) == 0
    assert "changed from the run's keys" not in capsys.readouterr().out


@pytest.mark.once
def test_a_resume_that_moves_the_learning_rates_decay_says_so(tmp_path, capsys):
    """The cosine decays over the run's steps: a resume with another steps= takes another
    learning rate from the next step on, said once with the rates before and after."""
    args = [*TINY, f"out_dir={tmp_path}", "name=r", "warmup_steps=5", "checkpoint_every=5"]
    assert main([*args, "steps=25"]) == 0
    capsys.readouterr()
    assert main([*args, "steps=40", "resume=true"]) == 0
    out = capsys.readouterr().out
    assert "steps 25 → 40: the learning rate's decay now ends at step 40 (step 26: lr" in out
    assert main([*args, "steps=45", "resume=true", "lr=0.01"]) == 0  # 40 → 45 moves it again
    out = capsys.readouterr().out
    assert "steps 40 → 45" in out and "lr 0.003 → 0.01" in out
    # the rate the run as saved would have taken (lr 0.003), against this one's (lr 0.01)
    was, now = (float(x) for x in out.split("(step 41: lr ")[1].split(")")[0].split(" → "))
    assert was < now  # a longer decay from a higher peak
    # inside the warm-up the rate is the same either way: the moved decay is still said
    args = [*TINY, f"out_dir={tmp_path}", "name=w", "warmup_steps=20", "checkpoint_every=3"]
    assert main([*args, "steps=3"]) == 0
    capsys.readouterr()
    assert main([*args, "steps=30", "resume=true"]) == 0
    out = capsys.readouterr().out
    assert "steps 3 → 30: the learning rate's decay now ends at step 30\n" in out


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda c: c.update(grad_clip=None), "grad_clip=None"),
        (lambda c: c.update(grad_clip="x"), "grad_clip='x'"),
        (lambda c: c["model"].update(pipeline_repeats="2"), "pipeline_repeats='2'"),
        (lambda c: c["model"].update(d_model=64.5), "d_model=64.5"),
        (lambda c: c["model"].update(scan_layers=1), "scan_layers=1"),
    ],
)
def test_a_config_that_parses_but_holds_another_type_is_damaged_not_a_traceback(
    saved, capsys, edit, needle
):
    tmp_path, run_dir = saved
    path = run_dir / "config.json"
    config = json.loads(path.read_text())
    config.pop("block_order", None)  # read from the model's fields then
    edit(config)
    path.write_text(json.dumps(config))
    capsys.readouterr()
    assert _run(tmp_path, "name=R", "steps=8", "resume=true") == 2
    err = _one_line_error(capsys, "config.json is damaged")
    assert needle in err


def test_a_compile_only_command_is_not_offered_resume_true(tmp_path):
    """A folder holding a run with a checkpoint offers resume=true to a training command, not
    to compile_only=true, which refuses resume=true: the advice must be one it can take."""
    from lab import rundir
    from lab.errors import ConfigError

    run_dir = tmp_path / "r"
    (run_dir / "checkpoints" / "2").mkdir(parents=True)
    (run_dir / "config.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="continue it with resume=true"):
        rundir.check_fresh(run_dir)
    with pytest.raises(ConfigError) as e:
        rundir.check_fresh(run_dir, compile_only=True)
    assert "resume=true" not in str(e.value) and "overwrite=true" in str(e.value), e.value


def test_a_metrics_line_holds_its_steps_split_and_numbers_only_otherwise(tmp_path):
    """A metrics line is a record with an integer step, the step's split (a strategy's name,
    the mesh's axis sizes) and numbers or null: a strategy that is not a name, a mesh whose
    sizes are not integers, or text where a number goes is set aside as torn."""
    lines = [
        {"step": 1, "loss": 2.5, "strategy": "fsdp", "mesh": {"data": 2, "fsdp": 4}, "mfu": None},
        {"step": 2, "loss": 2.4},  # written before the split was on every line
        {"step": 3, "loss": 2.3, "strategy": 3},
        {"step": 4, "loss": 2.2, "mesh": {"data": "2"}},
        {"step": 5, "loss": "2.1"},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    good, torn = rundir.read_metrics(path)
    assert [r["step"] for r in good] == [1, 2]
    assert [json.loads(t)["step"] for t in torn] == [3, 4, 5]

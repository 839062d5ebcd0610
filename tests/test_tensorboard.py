"""TensorBoard scalars of lab.run, read back from the event files: every scalar at every logged
step, one unbroken curve across a stop and a resume, process 0 only, a full disk in one line."""

import errno
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.record_writer import masked_crc32c

from lab import tensorboard
from lab.run import main

TINY = ["model=tiny", "n_layers=1", "batch_size=4", "seq_len=16", "log_every=1"]


def _run(tmp_path, *args) -> int:
    return main([*TINY, f"out_dir={tmp_path}", *args])


def _read_records(path: Path) -> list[Event]:
    """The events of one TFRecord file (length, its checksum, data, its checksum), every
    checksum checked: a torn or misframed record fails here."""
    data, events, i = path.read_bytes(), [], 0
    while i < len(data):
        header = data[i : i + 8]
        (n,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[i + 8 : i + 12])[0] == masked_crc32c(header)
        body = data[i + 12 : i + 12 + n]
        assert struct.unpack("<I", data[i + 12 + n : i + 16 + n])[0] == masked_crc32c(body)
        events.append(Event.FromString(body))
        i += 16 + n
    return events


def _curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag → [(step, value)] in file order, over every event file of the run, as a reader
    keeps them: a SessionLog START (a restart) drops the points at its step and after."""
    files = sorted((run_dir / tensorboard.FOLDER).glob("*tfevents*"))
    assert files, f"no event file in {run_dir}"
    curves: dict[str, list] = {}
    for f in files:
        events = _read_records(f)
        assert events[0].file_version == "brain.Event:2"
        for e in events[1:]:
            if e.HasField("session_log") and e.session_log.status == e.session_log.START:
                curves = {t: [p for p in c if p[0] < e.step] for t, c in curves.items()}
            for v in e.summary.value:
                curves.setdefault(v.tag, []).append((e.step, v.simple_value))
    return curves


def _in_tensorboard(run_dir: Path) -> dict[str, list[int]] | None:
    """tag → steps as TensorBoard's own reader loads them (the dev extra installs the
    tensorboard package; the lab itself does not need it); None where it is missing."""
    try:
        from tensorboard.backend.event_processing import event_accumulator as ea
    except ImportError:
        return None
    acc = ea.EventAccumulator(str(run_dir / tensorboard.FOLDER))
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


CPU_TAGS = {t for k, t in tensorboard.TAGS.items() if not k.startswith("device_")}


def test_every_scalar_is_written_at_every_logged_step(tmp_path):
    assert _run(tmp_path, "name=A", "steps=5", "warmup_steps=2") == 0
    run_dir = tmp_path / "A"
    curves = _curves(run_dir)
    assert set(curves) == CPU_TAGS  # CPU: the process's memory, no device allocator
    for tag, points in curves.items():
        assert [s for s, _ in points] == [1, 2, 3, 4, 5], tag
    recs = _metrics(run_dir)
    for key, tag in tensorboard.TAGS.items():
        if tag in curves:  # the event file and metrics.jsonl carry the same numbers
            want = np.float32([r[key] for r in recs])
            assert [v for _, v in curves[tag]] == pytest.approx(want, rel=1e-6), key
    lr = [v for _, v in curves["train/learning_rate"]]
    assert lr[0] == 0.0 and lr[1] == pytest.approx(1.5e-3)  # warm-up from 0 to lr=3e-3
    assert all(0 < v < 1 for _, v in curves["perf/mfu"])
    seen = _in_tensorboard(run_dir)
    assert seen is None or seen == {tag: [1, 2, 3, 4, 5] for tag in CPU_TAGS}


def _wait_for_lines(path: Path, lines: int, proc, timeout_s: float = 180):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= lines:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError(f"{path} did not reach {lines} lines")


@pytest.mark.once
def test_a_run_stopped_and_resumed_is_one_curve(tmp_path):
    """SIGTERM mid-run, then the newest checkpoint lost (as a kill before it was written would
    leave it): the resume repeats the steps after the older checkpoint, and the curve still
    holds each step once, strictly increasing, every step from 1 to the end."""
    run_dir = tmp_path / "S"
    cmd = [sys.executable, "-m", "lab.run", *TINY, f"out_dir={tmp_path}", "name=S"]
    cmd += ["steps=100000", "checkpoint_every=3"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_lines(run_dir / "metrics.jsonl", 5, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    stopped = _metrics(run_dir)[-1]["step"]
    assert [s for s, _ in _curves(run_dir)["train/loss"]] == list(range(1, stopped + 1))
    saved = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    (run_dir / "checkpoints" / str(saved[-1])).rename(run_dir / "newest-lost")
    assert saved[-2] < stopped  # the resume repeats steps already in the event file

    end = stopped + 3
    assert _run(tmp_path, "name=S", f"steps={end}", "resume=true", "checkpoint_every=3") == 0
    curves = _curves(run_dir)
    assert len(list((run_dir / tensorboard.FOLDER).glob("*tfevents*"))) == 2  # none rewritten
    for tag, points in curves.items():
        assert [s for s, _ in points] == list(range(1, end + 1)), tag
    assert [r["step"] for r in _metrics(run_dir)] == list(range(1, end + 1))
    seen = _in_tensorboard(run_dir)
    assert seen is None or seen == {tag: list(range(1, end + 1)) for tag in CPU_TAGS}


def test_only_process_0_writes_events(tmp_path, monkeypatch):
    import jax

    monkeypatch.setattr(jax, "process_index", lambda *a, **k: 1)
    assert _run(tmp_path, "name=P", "steps=2") == 0
    assert not (tmp_path / "P" / tensorboard.FOLDER).exists()


def test_a_full_disk_in_the_event_file_is_one_line_and_leaves_whole_events(
    tmp_path, capsys, monkeypatch
):
    real, writes = os.write, []

    def write(fd, data):
        if "tfevents" in os.readlink(f"/proc/self/fd/{fd}"):
            writes.append(data)
            if len(writes) >= 3:
                real(fd, bytes(data[:5]))  # a torn start of the event
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(tensorboard.os, "write", write)
    assert _run(tmp_path, "name=D", "steps=6") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: events.out.tfevents."), err
    assert "could not be written in" in err and "(No space left on device)" in err, err
    # step 3 is whole in metrics.jsonl (written before its event): the line says so alike
    assert "training stopped at step 3;" in err and "metrics.jsonl to step 3" in err, err
    monkeypatch.undo()
    assert [s for s, _ in _curves(tmp_path / "D")["train/loss"]] == [1, 2]
    assert [r["step"] for r in _metrics(tmp_path / "D")] == [1, 2, 3]


def test_memory_is_the_device_allocators_where_it_keeps_counters(monkeypatch):
    """GPU and TPU report their allocator's bytes; CPU (no counters) the process's memory."""
    from lab import loop

    stats = {"bytes_in_use": 5, "peak_bytes_in_use": 7, "bytes_limit": 9}
    monkeypatch.setattr(loop.memory, "device_memory_stats", lambda _: stats)
    rec = {"step": 3, **loop._memory_now()}
    assert rec == {"step": 3, "device_bytes_in_use": 5, "device_peak_bytes_in_use": 7}
    tags = {v.tag: v.simple_value for v in tensorboard._event(rec).summary.value}
    assert tags == {"memory/device_bytes_in_use": 5, "memory/device_peak_bytes_in_use": 7}
    monkeypatch.setattr(loop.memory, "device_memory_stats", lambda _: None)
    assert list(loop._memory_now()) == ["host_rss_bytes"]


def test_a_resume_keeps_every_event_file_and_marks_its_restart(tmp_path):
    """A resume writes a new event file, named to sort after every earlier one (even one from a
    later second: another host's clock), that begins with a SessionLog START at its first
    step; no earlier file, the lab's or the user's, is rewritten or removed."""
    folder = tmp_path / tensorboard.FOLDER
    folder.mkdir()
    theirs = folder / "events.out.tfevents.123.host.custom"
    older = folder / f"events.out.tfevents.{int(time.time()) + 100}.host.1.lab"
    theirs.write_bytes(b"x")
    older.write_bytes(b"y")
    made = tensorboard.start(tmp_path, [{"step": 1, "loss": 2.0}], resumed_from=4)
    made.close()
    assert theirs.read_bytes() == b"x" and older.read_bytes() == b"y"
    assert sorted(folder.iterdir())[-1] == made.path
    events = _read_records(made.path)  # START twice: a first START is no restart to a server
    assert len(events) == 3 and [e.step for e in events[1:]] == [5, 5]
    assert all(e.session_log.status == e.session_log.START for e in events[1:])


def test_a_reader_watching_the_folder_follows_a_resume(tmp_path):
    """TensorBoard's Python loaders (the event accumulator, and the server's own with
    --load_fast=false), reading the folder while the run stops and resumes (the resume repeats
    steps 3-4), and one started afresh afterwards, all show each step once."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.backend.event_processing import plugin_event_multiplexer as pem

    assert _run(tmp_path, "name=W", "steps=4", "checkpoint_every=2") == 0
    run_dir = tmp_path / "W"
    live = ea.EventAccumulator(str(run_dir / tensorboard.FOLDER))
    server = pem.EventMultiplexer()
    server.AddRunsFromDirectory(str(tmp_path))
    read = lambda: [e.step for e in server.GetAccumulator("W/tensorboard").Tensors("train/loss")]  # noqa: E731
    live.Reload()
    server.Reload()
    assert [e.step for e in live.Scalars("train/loss")] == read() == [1, 2, 3, 4]
    (run_dir / "checkpoints" / "4").rename(tmp_path / "lost")
    assert _run(tmp_path, "name=W", "steps=6", "resume=true") == 0
    live.Reload()
    server.Reload()
    assert [e.step for e in live.Scalars("train/loss")] == read() == [1, 2, 3, 4, 5, 6]
    fresh = pem.EventMultiplexer()
    fresh.AddRunsFromDirectory(str(tmp_path))
    fresh.Reload()
    steps = [e.step for e in fresh.GetAccumulator("W/tensorboard").Tensors("train/loss")]
    assert steps == [1, 2, 3, 4, 5, 6]
    seen = _in_tensorboard(run_dir)
    assert seen == {tag: [1, 2, 3, 4, 5, 6] for tag in CPU_TAGS}
    assert [s for s, _ in _curves(run_dir)["train/loss"]] == [1, 2, 3, 4, 5, 6]


def test_an_unusable_tensorboard_folder_is_named_in_one_line(tmp_path, capsys, monkeypatch):
    """A resume writes a new event file: a read-only folder (a mount) or a file in its place
    is one line, exit 2, naming the folder, never the file written aside in it."""
    assert _run(tmp_path, "name=R", "steps=2", "checkpoint_every=2") == 0
    capsys.readouterr()
    real = Path.write_bytes

    def read_only(self, data):
        if self.name.startswith(".start-"):  # root writes through chmod: a read-only mount
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", read_only)
    assert _run(tmp_path, "name=R", "steps=3", "resume=true") == 2
    err = capsys.readouterr().err
    line = f"error: tensorboard could not be written in {tmp_path / 'R'} (Read-only file system)"
    assert err.startswith(line) and err.count("\n") == 1, err
    monkeypatch.undo()

    folder = tmp_path / "R" / tensorboard.FOLDER
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()
    folder.write_text("")
    assert _run(tmp_path, "name=R", "steps=3", "resume=true") == 2
    err = capsys.readouterr().err
    line = f"error: tensorboard could not be written in {tmp_path / 'R'} (a file, not a folder)"
    assert err.startswith(line) and err.count("\n") == 1, err


def test_a_missing_tensorboardx_is_one_line_before_any_write(tmp_path, capsys, monkeypatch):
    """Without tensorboardX a run is refused in one line naming the package and how to
    install it, exit 2, before it compiles or makes its folder (it crashed after the
    compile, leaving a folder that then refused the rerun and the resume)."""
    for name in [m for m in sys.modules if m.split(".")[0] == "tensorboardX"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # an import of it fails
    tensorboard._tbx.cache_clear()
    try:
        assert _run(tmp_path, "name=T", "steps=2") == 2
    finally:
        tensorboard._tbx.cache_clear()
    err = capsys.readouterr().err
    assert err.startswith("error: tensorboardX cannot be imported") and err.count("\n") == 1, err
    assert "pip install tensorboardX" in err
    assert not (tmp_path / "T").exists()


def test_an_empty_tensorboard_folder_is_no_run(tmp_path):
    """A folder holding lab.log and an empty tensorboard/ (a run stopped before it wrote an
    event) takes a fresh run: nothing in it is a run's output."""
    from lab import rundir

    (tmp_path / "lab.log").write_text("a library's line\n")
    (tmp_path / tensorboard.FOLDER).mkdir()
    assert rundir.previous_run(tmp_path) == []
    rundir.check_fresh(tmp_path)
    (tmp_path / tensorboard.FOLDER / "events.out.tfevents.1.h.2.lab").write_bytes(b"")
    assert rundir.previous_run(tmp_path) == [tensorboard.FOLDER]

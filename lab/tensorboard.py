"""TensorBoard scalars of a training run: `run_dir/tensorboard/`, read by `tensorboard --logdir`.

The event files are a second view of metrics.jsonl: every record the loop logs there is
appended here as one event (its scalars under the tags of `TAGS`, at its step). Each start
of a run writes a new event file and never touches the earlier ones; each file begins with a
SessionLog START at its first step (a resume's with two, `start` says why), and a START after
the first is TensorBoard's sign of a job
restarted from a checkpoint: TensorBoard's Python loaders, live or fresh, drop the steps from
there on that they read before, and its Rust data server drops them at the repeated step (a
series' points from a step seen again on), so each shows one curve with each step once.
Nothing is lost by dropping them: metrics-superseded.jsonl keeps their records.

tensorboardX makes the events (its protocol buffers, scalar summaries and record checksums,
without TensorFlow). Its SummaryWriter is not used: it writes from a thread, where a full disk
is an error nobody sees and its queue then blocks the loop for good. Here each event is
appended whole in the caller's thread, or cut off again, with the OSError for the caller, as
metrics.jsonl lines are (lab.rundir.MetricsLog).
"""

import errno
import functools
import os
import socket
import struct
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from lab import rundir
from lab.errors import ConfigError

FOLDER = "tensorboard"

# metrics.jsonl key → TensorBoard tag; a record writes the keys it has (memory: the device's
# allocator where it reports one, GPU and TPU; the process's resident memory on CPU)
TAGS = {
    "loss": "train/loss",
    "learning_rate": "train/learning_rate",
    "grad_norm": "train/grad_norm",
    "step_s": "perf/step_time_s",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "device_bytes_in_use": "memory/device_bytes_in_use",
    "device_peak_bytes_in_use": "memory/device_peak_bytes_in_use",
    "host_rss_bytes": "memory/host_rss_bytes",
}


@functools.cache
def _tbx() -> SimpleNamespace:
    """tensorboardX's Event, scalar summary and record checksum, imported when a run first
    writes. Its package imports torch wherever torch is installed (for its SummaryWriter, not
    used here), seconds at every run's start: unless torch is loaded already, that import is
    turned away for the while (an ImportError, which tensorboardX expects where torch is absent).
    """
    turned_away = "torch" not in sys.modules
    if turned_away:
        sys.modules["torch"] = None
    try:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.record_writer import masked_crc32c
        from tensorboardX.summary import scalar
    finally:
        if turned_away and sys.modules.get("torch", False) is None:
            del sys.modules["torch"]
    return SimpleNamespace(Event=Event, crc=masked_crc32c, scalar=scalar)


def check_installed() -> None:
    """ConfigError (one line) where tensorboardX cannot be imported: checked before a training
    run compiles or writes anything, rather than failing at its first event file."""
    try:
        _tbx()
    except ImportError as e:
        raise ConfigError(
            f"tensorboardX cannot be imported ({e}): a training run writes its TensorBoard "
            "scalars with it; install it with pip install tensorboardX (or pip install -e . "
            "for every dependency of the lab)"
        ) from None


def _framed(event) -> bytes:
    """One TFRecord: length, its checksum, the event, its checksum."""
    crc = _tbx().crc
    data = event.SerializeToString()
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", crc(header)) + data + struct.pack("<I", crc(data))


def _event(rec: dict):
    """The scalars of one metrics record, at its step and wall time."""
    tbx = _tbx()
    event = tbx.Event(wall_time=rec.get("wall_time", time.time()), step=rec["step"])
    for key, tag in TAGS.items():
        if rec.get(key) is not None:
            event.summary.value.extend(tbx.scalar(tag, rec[key]).value)
    return event


def _first() -> bytes:
    return _framed(_tbx().Event(wall_time=time.time(), file_version="brain.Event:2"))


class EventFile(rundir.WholeAppends):
    """The run's one event file, appended one whole event at a time (OSError for the caller,
    the file cut back to its last whole event)."""

    def write(self, rec: dict) -> None:
        self.append(_framed(_event(rec)))


def check_folder(run_dir: Path) -> None:
    """NotADirectoryError where the folder's place holds a file (checked before a resume
    writes anything, so that its refusal leaves the run folder as it was)."""
    folder = run_dir / FOLDER
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "a file, not a folder", str(folder))


def _stamp(path: Path) -> int:
    """The time field of an event file's name (events.out.tfevents.TIME.…), 0 if none."""
    field = path.name.split(".")[3:4]
    return int(field[0]) if field and field[0].isdigit() else 0


def start(run_dir: Path, records: list[dict], resumed_from: int = 0) -> EventFile:
    """A new event file of the lab's (named *.lab, sorted after every earlier one, written
    aside and renamed in whole), returned open for this run's records. Where the folder holds
    the lab's earlier event files (a resume), they stay as they are. Every file begins with
    a SessionLog START at step `resumed_from` + 1, as a TensorFlow session's does (a resume's
    with two at that step: see below): a START
    after the first is TensorBoard's sign of a restart, by which a reader drops the steps from
    there on that it read from the earlier files (the ones this run logs again;
    metrics-superseded.jsonl keeps their records). Where the folder holds none of the lab's
    files (a fresh run, or a folder that lost them), `records` (metrics.jsonl's steps up to
    `resumed_from`) follow the START. Earlier files are never rewritten or
    deleted: a reader that is watching the folder, which keeps reading the file it has open
    and then the ones after it, sees the same curve as one that starts afresh. OSError for
    the caller, naming the folder (the user's to fix) rather than the file written aside in
    it."""
    folder = run_dir / FOLDER
    check_folder(run_dir)
    tmp = folder / f".start-{os.getpid()}.tmp"  # readers read only names with 'tfevents'
    try:
        folder.mkdir(exist_ok=True)
        earlier = list(folder.glob("events.out.tfevents.*.lab"))  # the lab's own
        stamp = max([int(time.time()), *(_stamp(p) + 1 for p in earlier)])
        name = f"events.out.tfevents.{stamp}.{socket.gethostname()}.{os.getpid()}.lab"
        session = _tbx().Event(wall_time=time.time(), step=resumed_from + 1)
        session.session_log.status = session.session_log.START
        if earlier:
            # twice: TensorBoard's server takes the first START it reads in a folder for the
            # run's beginning, not a restart, and the lab's files from before each one began
            # with a START hold none
            body = _framed(session) * 2
        else:
            body = _framed(session) + b"".join(_framed(_event(r)) for r in records)
        try:
            tmp.write_bytes(_first() + body)
            tmp.replace(folder / name)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(folder)) from None
    return EventFile(folder / name)

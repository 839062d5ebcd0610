"""The run folder `out_dir/name/`: what may go in it, who may write it, and how its files survive.

A run folder belongs to one run: a fresh run refuses a folder an earlier run left output in
(resume it, pick another name, or clear it with overwrite=true), and to one live run at a time
(a lock). A resume takes the keys the run was started with (config.json keeps them) under
the ones given now, and a model that changes the saved state's shapes is refused before
anything runs. Metrics lines are never deleted (a resume that repeats steps moves the
repeated lines to metrics-superseded.jsonl; a line that is not a whole record, torn by a kill
or a full disk mid-write or not text at all, is kept byte for byte in metrics-torn.jsonl), a
line is appended whole or not at all, and the JSON files are replaced whole (written aside,
then renamed). Libraries' log output, including errors their threads cannot raise, goes to
lab.log in the folder, so the user reads the lab's own one-line messages.
"""

import contextlib
import json
import logging
import os
import shlex
import shutil
import sys
import threading
from pathlib import Path

from lab.errors import ConfigError

# Fields that decide the shape of the saved state: a resume that changes one cannot load it.
STATE_FIELDS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "d_ff",
    "tie_embeddings",
    "param_dtype",
    "scan_layers",
)
# of those, the ones that only say how the layers are stored: a resume may change them (the
# restore moves the saved weights into the run's layout, lab.train.Layout)
LAYOUT_FIELDS = ("scan_layers",)


# What the folder holds for its run's sake, not as the run's output: the lock of the live run and
# the libraries' log, which every run in the folder appends to, and the token a multi-process
# run's processes check they share the folder by (devices.JOIN_FILE, left by a crash at most).
NOT_OUTPUT = (".lock", "lab.log", ".lab-join")


def previous_run(run_dir: Path) -> list[str]:
    """The names an earlier run left in the folder (none for a new or empty folder). An empty
    folder in it (a run stopped before it wrote there, as tensorboard/ can be) holds no run's
    output."""
    if not run_dir.is_dir():
        return []
    return sorted(
        p.name for p in run_dir.iterdir() if p.name not in NOT_OUTPUT and not _empty_dir(p)
    )


def _empty_dir(path: Path) -> bool:
    """A folder with nothing in it (not a link to one)."""
    try:
        return path.is_dir() and not path.is_symlink() and not any(path.iterdir())
    except OSError:
        return False


def check_fresh(run_dir: Path, *, compile_only: bool = False) -> None:
    """A run that neither resumes nor overwrites needs a folder with no earlier run in it:
    two runs' checkpoints, metrics and summaries in one folder cannot be told apart, and a
    resume would load whichever saved the highest step. ConfigError (one line) otherwise.
    `compile_only`: the command trains nothing, so resume=true is not offered to it."""
    left = previous_run(run_dir)
    if left:
        shown = ", ".join(left[:4]) + (", …" if len(left) > 4 else "")
        try:
            target = json.loads((run_dir / "config.json").read_text()).get("target")
        except (OSError, ValueError, AttributeError):
            target = None
        if target:  # a plan trains nothing: there is nothing to continue
            raise ConfigError(
                f"run folder {run_dir} already holds a plan for target={target} ({shown}): "
                "choose another name=, or replace it with overwrite=true"
            )
        # resume=true is offered only where there is a checkpoint to continue from
        saved = any(p.name.isdigit() for p in (run_dir / "checkpoints").glob("*"))
        go_on = "continue it with resume=true, " if saved and not compile_only else ""
        raise ConfigError(
            f"run folder {run_dir} already holds a run ({shown}): a folder belongs to one run; "
            f"{go_on}choose another name=, or clear it first with overwrite=true"
        )


def clear(run_dir: Path) -> list[str]:
    """Remove the earlier run from the folder for overwrite=true (the caller holds the folder's
    lock, which stays, and lab.log, which is appended to). Every entry is first renamed into one
    hidden folder, so an interrupted clear never leaves a mix of two runs in place (the next
    overwrite removes the leftover), then that folder is deleted; links are removed, never
    followed. Returns what was removed."""
    left = previous_run(run_dir)
    if not left:
        return []
    trash = run_dir / f".overwritten-{os.getpid()}"
    try:
        trash.mkdir()
        for name in left:
            (run_dir / name).rename(trash / name)
        shutil.rmtree(trash)
    except OSError as e:
        raise ConfigError(
            f"overwrite=true: could not clear {run_dir} ({e.strerror or e}); "
            f"what was not removed is in {run_dir} or {trash}"
        ) from None
    return left


def write_json(path: Path, obj) -> None:
    """Replace `path` with `obj` as JSON whole or not at all: written beside it, then renamed
    over it (a full disk leaves the old file, never a torn one). OSError for the caller."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=2, default=str))
        tmp.replace(path)
    except OSError as e:  # a failed write() names no file: the one line names the one asked for
        raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        tmp.unlink(missing_ok=True)


def lock_holder(run_dir: Path) -> str | None:
    """Who holds the run folder's lock ("pid 123"), where a live process holds it; None where
    none does or there is no lock. Asked without waiting: a lock free at the moment is let go
    at once."""
    import fcntl

    try:
        f = open(run_dir / ".lock", errors="replace")  # noqa: SIM115 - closed below
    except OSError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().strip() or "another process"
        except OSError:
            return None
        fcntl.flock(f, fcntl.LOCK_UN)
        return None


# what a user can do about a config.json that cannot be read: the run's settings are in it
DAMAGED_NEXT = (
    "; put back a good copy of it, or start the run again with overwrite=true or another name="
)


def saved_config(run_dir: Path, asked: str = "resume=true") -> dict:
    """config.json of an earlier run in this folder; ConfigError if there is none to resume.
    `asked`: the key the user gave that needs it (resume=true, or lab.serve's run=NAME), so
    the refusal names what the user actually asked for."""
    path = run_dir / "config.json"
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"{asked}: {run_dir} is a file, not a run folder")
    if not path.exists():
        if holder := lock_holder(run_dir):  # a run still starting: no config.json yet
            raise ConfigError(
                f"{asked}: run folder {run_dir} is in use by {holder} (a run still starting: "
                "no config.json yet); wait for it, or choose another name="
            )
        left = previous_run(run_dir)
        if left and asked == "resume=true":  # a run's files without the config that reads them
            shown = ", ".join(left[:4]) + (", …" if len(left) > 4 else "")
            raise ConfigError(
                f"resume=true: {run_dir} holds a run's files ({shown}) but no config.json, "
                "so it cannot be resumed (a damaged run folder); start it again with "
                "overwrite=true or choose another name="
            )
        raise ConfigError(
            f"{asked}: no run named {run_dir.name!r} in {str(run_dir.parent)!r} "
            "(nothing to resume; leave out resume=true to start it)"
            if asked == "resume=true"
            else f"{asked}: {run_dir} holds no config.json (not a run folder, or a damaged one)"
        )
    # lab.run's keys only where lab.run asked: another command (lab.serve run=) says whose
    mend = (
        DAMAGED_NEXT
        if asked == "resume=true"
        else f"; put back a good copy of it, or train it again with its settings (python -m "
        f"lab.run {shlex.join([f'name={run_dir.name}', f'out_dir={run_dir.parent}'])} "
        "overwrite=true …)"
    )
    try:
        saved = json.loads(path.read_bytes())  # bytes: JSON's own UTF-8 check, as ValueError
    except (OSError, ValueError) as e:
        raise ConfigError(f"{asked}: {path} is damaged ({str(e)[:160]}){mend}") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        raise ConfigError(f"{asked}: {path} is damaged (not a run's config){mend}")
    for section, fields in ((saved, _TYPES), (saved["model"], _MODEL_TYPES)):
        for key, types in fields.items():
            value = section.get(key)
            # (a bool is an int to Python, not to the config)
            wrong = not isinstance(value, types) or (types is not bool and type(value) is bool)
            if key in section and wrong:
                raise ConfigError(f"{asked}: {path} is damaged ({key}={value!r}){mend}")
    return saved


# The types of the fields a resume compares or computes with before the config is parsed
# again: a config.json that parses as JSON but holds another type is damaged, not a traceback.
_TYPES = {"grad_clip": (int, float), "steps": int, "batch_size": int, "seq_len": int}
_MODEL_TYPES = {
    **{k: int for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")},
    "pipeline_repeats": int,
    "microbatches": int,
    "tie_embeddings": bool,
    "scan_layers": bool,
    "param_dtype": str,
}


# Keys that say how this invocation runs, not what the run is: a resume never takes them from
# the run it continues (a single process resuming a job of several must not wait for their
# coordinator, the verbs resume/overwrite/compile_only are the user's each time, and the
# folder is the one named now: a moved or copied run folder resumes where it is).
INVOCATION_KEYS = (
    "name",
    "out_dir",
    "resume",
    "overwrite",
    "compile_only",
    "coordinator",
    "coordinator_timeout",
    "num_processes",
    "process_id",
)


def asked_keys(request_keys: dict) -> dict:
    """What config.json keeps of the keys a run was asked with (`request`): those a resume
    takes again, the invocation's own left out."""
    return {k: v for k, v in request_keys.items() if k not in INVOCATION_KEYS}


def check_same_state(saved: dict, new: dict) -> None:
    """The fields that shape the saved state must match; ConfigError naming every one that
    differs (the checkpoints would not load, and a fresh start would replace them)."""
    diffs = [
        f"{k}={saved['model'].get(k)!r} → {new['model'].get(k)!r}"
        for k in STATE_FIELDS
        if k not in LAYOUT_FIELDS and saved.get("model", {}).get(k) != new["model"].get(k)
    ]
    if (saved.get("grad_clip", 0) > 0) != (new.get("grad_clip", 0) > 0):
        diffs.append(f"grad_clip={saved.get('grad_clip')!r} → {new.get('grad_clip')!r}")
    if diffs:
        raise ConfigError(
            f"resume=true: this run's model differs from the one saved in the folder "
            f"({', '.join(diffs)}); resume with the saved keys or choose a new name="
        )


def check_steps(saved_step: int, steps: int) -> None:
    if steps <= saved_step:
        raise ConfigError(
            f"resume=true: the run is saved at step {saved_step} and steps={steps} leaves "
            f"nothing to train; ask for steps > {saved_step}"
        )


def _number(v) -> bool:
    return v is None or (isinstance(v, int | float) and not isinstance(v, bool))


def _field(key: str, value) -> bool:
    """Whether `value` is what a metrics line holds under `key`: the split of the step (a
    strategy's name, the mesh's axis sizes), else a number or null."""
    if key == "strategy":
        return isinstance(value, str)
    if key == "mesh":
        return isinstance(value, dict) and all(type(n) is int for n in value.values())
    return _number(value)


def _record(line: bytes) -> dict | None:
    """The metrics record on one line, or None where the line is not one (torn by a kill or a
    full disk, bytes that are not UTF-8, JSON that is not a record: an integer step a
    TensorBoard event can hold, the step's split (strategy, mesh) and numbers, or null, for
    every other value)."""
    try:
        rec = json.loads(line)
    except ValueError:  # UnicodeDecodeError is a ValueError
        return None
    if not isinstance(rec, dict) or type(rec.get("step")) is not int:
        return None
    fields = all(_field(k, v) for k, v in rec.items())
    return rec if fields and 0 <= rec["step"] < 2**63 else None


def read_metrics(path: Path) -> tuple[list[dict], list[bytes]]:
    """(records, other lines): every line of metrics.jsonl that is a record, and the bytes of
    every non-empty line that is not one."""
    if not path.exists():
        return [], []
    good, torn = [], []
    for line in path.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        rec = _record(line)
        if rec is None:
            torn.append(line)
        else:
            good.append(rec)
    return good, torn


def keep_metrics_before(run_dir: Path, start: int, log_every: int = 1) -> tuple[int, list[int]]:
    """metrics.jsonl keeps the steps up to `start` (where the run resumes); the steps after
    it, which this run will log again, move to metrics-superseded.jsonl, and lines that are not
    records to metrics-torn.jsonl (as they were, bytes and all): every step appears once in
    metrics.jsonl, and no line is lost. The moved lines are written before metrics.jsonl is
    replaced (whole, by a rename), so a failure part-way loses nothing.

    Returns (the number of lines set aside as torn, the steps up to `start` whose records
    are missing where there were any: every `log_every`-th, the steps a torn line may have
    held or followed; a file cut mid-line loses the lines after the cut too)."""
    path = run_dir / "metrics.jsonl"
    good, torn = read_metrics(path)
    kept = [r for r in good if r["step"] <= start]
    moved = [r for r in good if r["step"] > start]
    have = {r["step"] for r in kept}
    every = _cadence(sorted(r["step"] for r in good), log_every)
    missing = [s for s in range(every, start + 1, every) if s not in have] if torn else []
    if not moved and not torn:
        return 0, []
    if moved:
        with _named(run_dir / "metrics-superseded.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in moved)
    if torn:
        with _named(run_dir / "metrics-torn.jsonl", "ab") as f:
            f.writelines(line + b"\n" for line in torn)
    tmp = run_dir / f".metrics.jsonl.{os.getpid()}.tmp"
    try:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(path)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        tmp.unlink(missing_ok=True)
    return len(torn), missing


def _cadence(steps: list[int], log_every: int) -> int:
    """How often the file's whole records were logged: the commonest gap between them (a
    run's last step may break the rhythm), else `log_every` (the run's, which a resume may
    have changed since the file was written)."""
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False) if b > a]
    if not gaps:
        return max(1, log_every)
    return max(set(gaps), key=lambda g: (gaps.count(g), -g))


def step_ranges(steps: list[int], most: int = 4) -> str:
    """'2-40' or '2-5, 8, 10-40' for sorted steps; past `most` ranges, '… (N steps)'."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s <= runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    words = [f"{a}-{b}" if b > a else f"{a}" for a, b in runs]
    if len(words) > most:
        return ", ".join(words[:most]) + f", … ({len(steps)} steps)"
    return ", ".join(words)


@contextlib.contextmanager
def _named(path: Path, mode: str):
    """`path` open for appending; an OSError of its writes (a full disk: write() names no
    file) names it, for the one line."""
    try:
        with open(path, mode) as f:
            yield f
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None


class WholeAppends:
    """A file appended one whole record at a time: a record that cannot be written whole (a
    full disk) is cut off again, so the file never ends in a record this run tore; the
    OSError, naming the file, goes to the caller, who reports it."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, data: bytes) -> None:
        data = memoryview(data)
        end = os.fstat(self._fd).st_size
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, end)
            raise OSError(e.errno, e.strerror, str(self.path)) from None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class MetricsLog(WholeAppends):
    """metrics.jsonl, one whole JSON line per record; `last_step` is the last step written;
    `gaps`: the steps whose records it lacks ('2-40'), where a damaged file lost some."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.last_step = None
        self.gaps = ""

    def write(self, rec: dict) -> None:
        self.append((json.dumps(rec) + "\n").encode())
        self.last_step = rec["step"]


class _LogHandler(logging.FileHandler):
    """lab.log: a record that cannot be written (a full disk) is dropped, not printed to the
    terminal with a traceback (logging's default); the lab reports the disk itself. `held`:
    records are kept in memory, the file untouched, until `write_held()` writes them (the run
    has started); a command refused before then leaves nothing in the folder."""

    HELD_MOST = 10_000  # records kept while held; later ones are dropped

    def __init__(self, path: Path, *, delay: bool = False, held: bool = False):
        super().__init__(path, delay=delay)
        self.held: list | None = [] if held else None

    def emit(self, record):  # (called under self.lock, by logging.Handler.handle)
        held = self.held
        if held is None:
            try:  # opening the file (delay=True) is not covered by handleError
                super().emit(record)
            except OSError:  # its folder removed (a refused command cleans up): dropped
                pass
        elif len(held) < self.HELD_MOST:
            held.append(record)

    def write_held(self) -> None:  # (not `release`: logging.Handler's lock method)
        with self.lock:  # a library's thread logging meanwhile waits, then writes after them
            held, self.held = self.held or [], None
            for record in held:
                super().emit(record)

    def handleError(self, record):  # noqa: N802 — logging's name
        pass


LIBRARY_LOGGERS = ("absl", "orbax", "jax._src.distributed", "tensorstore", "concurrent", "asyncio")


def quiet_libraries_here() -> None:
    """A process other than 0 writes no lab.log (its run folder may be another host's): the
    libraries' warnings, which process 0 keeps in lab.log, are not printed here either (each
    process printed orbax's 'Metadata file does not exist' on a resume); their errors are."""
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def quiet_libraries(run_dir: Path, *, delay: bool = False, held: bool = False):
    """Python logging of the libraries (orbax, absl, TensorStore's Python side) to lab.log in
    the run folder instead of the terminal, and so are the errors their background threads
    cannot raise (a failed checkpoint write fails every pending write of its step, each in its
    own thread or coroutine, some only found at interpreter exit): the lab reports the
    failure once, in one line, where it surfaces in the loop. `delay`: the file is made at the
    first record, not before (a shared results folder gets no empty lab.log); `held`: the
    records wait in memory until the returned function is called (the run has started), so a
    command refused before then writes nothing there."""
    path = run_dir / "lab.log"
    try:
        if delay and path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(13, "Permission denied")
        if delay and path.is_dir():
            raise IsADirectoryError(21, "Is a directory")
        handler = _LogHandler(path, delay=delay, held=held)
    except OSError as e:  # a read-only file, a folder of that name
        what = "a folder" if path.is_dir() else (e.strerror or str(e)).lower()
        raise ConfigError(
            f"cannot write {path} (the libraries' log): {what}; make it a writable file or "
            "remove it"
        ) from None
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    for name in LIBRARY_LOGGERS:
        log = logging.getLogger(name)
        log.handlers = [handler]
        log.propagate = False
    lab_log = logging.getLogger("lab.background")
    lab_log.handlers, lab_log.propagate = [handler], False

    def unraisable(u):
        with contextlib.suppress(Exception):  # at interpreter exit even logging may be gone
            where = f" in {u.object!r}" if u.object is not None else ""
            exc = (u.exc_type, u.exc_value, u.exc_traceback)
            lab_log.error("unraisable error%s", where, exc_info=exc)

    def thread_error(a):
        with contextlib.suppress(Exception):
            exc = (a.exc_type, a.exc_value, a.exc_traceback)
            lab_log.error("error in thread %s", getattr(a.thread, "name", "?"), exc_info=exc)

    sys.unraisablehook = unraisable
    threading.excepthook = thread_error
    return handler.write_held

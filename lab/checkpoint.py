"""A run folder's checkpoints: atomic saves of finite state, restores that never load a damaged
step, damaged steps moved aside (never deleted), and a lock so a folder belongs to one live run.

Orbax writes each step to a temporary folder and renames it when complete, so an interrupted
save is never listed (and its leftover temporary folder is cleaned at the next start). A step
that is listed but does not restore — a file truncated, deleted or overwritten afterwards, an
empty step folder — is moved to `checkpoints-damaged/<step>-<time>/` with a one-line warning, and
the next older step is tried; each step is read on its own (orbax's manager infers the layout
of every step from the newest one, so one broken step used to make all of them unreadable).
A step whose arrays have other shapes than the model's is not damaged: the run asked for
another model, which is a ConfigError before anything is moved.

Each step also keeps a checksum of every array (`fingerprint`: two 32-bit sums of its bits, one
weighted by position), saved in the same atomic step as the arrays. A restore recomputes them: a
bit flipped in a saved value (the file format reads most such flips back without complaint) makes
the step damaged like any other, instead of a resume from silently wrong numbers. Steps saved
before checksums were kept restore unchecked.

A save that fails (a full disk) is reported once, as a SaveError naming its step, the folder
and the operating system's reason, wherever orbax raises it (`Saver`); its unfinished folder
keeps its temporary name, so it is never listed as a step, and is removed at the next start.
"""

import contextlib
import errno
import fcntl
import json
import os
import re
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np

from lab.errors import ConfigError

if TYPE_CHECKING:
    import orbax.checkpoint as ocp

# A write that fails part-way (a full disk) leaves orbax's unstarted fragment writes behind as
# coroutines; Python reports each as "never awaited" when it collects them at exit, after the
# run's one-line error. Nothing in them is the user's to act on: the error line says what failed.
warnings.filterwarnings(
    "ignore", message=r"coroutine '.*write_fragment' was never awaited", category=RuntimeWarning
)

ITEM = "default"  # the name orbax's manager gives a single saved item
SUMS = "fingerprint"  # the step's item that keeps every array's checksums (JSON)
LAYOUT = "layout"  # the step's item that says how its state stores the layers (JSON)


def _orbax():
    """orbax.checkpoint, imported where a checkpoint is first saved or read, not with this
    module: importing orbax logs through absl, whose first log call gives the root logger a
    handler (logging.basicConfig), after which a program's own logging.basicConfig does
    nothing. A program that imports lab.train, lab.session or lab.loop keeps its logging
    (and its start-up is spared orbax's import, ~0.2 s)."""
    import orbax.checkpoint

    return orbax.checkpoint


def folder(run_dir) -> Path:
    return Path(run_dir).absolute() / "checkpoints"


def damaged_folder(run_dir) -> Path:
    """Where damaged steps (and stray folders) are moved aside, never deleted."""
    return Path(run_dir).absolute() / "checkpoints-damaged"


def damaged_steps(run_dir) -> list[str]:
    """The names of what `damaged_folder` holds (`<step>-<time>`), by step; [] where
    there is none or it cannot be read."""
    try:
        names = [p.name for p in damaged_folder(run_dir).iterdir()]
    except OSError:
        return []

    def by_step(name: str):
        head = name.partition("-")[0]
        return (int(head), name) if head.isascii() and head.isdigit() else (-1, name)

    return sorted(names, key=by_step)


def check_folder(run_dir) -> None:
    """The checkpoints folder can be written: a ConfigError (one line) before the run starts,
    instead of a save that waits forever on a file or a read-only folder."""
    path = folder(run_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{path} is a file, not a folder: move it away to checkpoint here")
    if path.exists() and not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{path} is not writable: checkpoints cannot be saved there")


def manager(run_dir, *, max_to_keep: int = 3) -> "ocp.CheckpointManager":
    ocp = _orbax()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, cleanup_tmp_directories=True
    )
    return ocp.CheckpointManager(folder(run_dir), options=options)


def saved_steps(run_dir) -> list[int]:
    """The steps whose saves completed (orbax renames a step's folder to its number only when
    the save is whole; an unfinished one keeps a temporary name), oldest first."""
    path = folder(run_dir)
    if not path.is_dir():
        return []
    return sorted(int(p.name) for p in path.iterdir() if _is_step(p.name))


def _is_step(name: str) -> bool:
    """A step's folder name as the saver writes it: digits, no leading zero (a renamed
    "01279" is not step 1279's folder, whose path is rebuilt from the number)."""
    return name.isascii() and name.isdigit() and str(int(name)) == name


def failure_reason(e: BaseException) -> str:
    """Why a write failed, in a few words: the operating system's words where the error
    carries its code (TensorStore writes `[os_error_code='28']` into its message), else the
    error's first line."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    code = re.search(r"os_error_code='?(\d+)", str(e))
    return os.strerror(int(code.group(1))) if code else _first_line(e)


class SaveError(Exception):
    """A checkpoint that could not be written (a full disk, a folder gone): which step, where
    and why, in one line."""

    def __init__(self, step: int | None, path, reason: str):
        what = f"checkpoint step {step}" if step is not None else "a checkpoint"
        super().__init__(f"{what} could not be saved in {path} ({reason})")
        self.step = step


class Saver:
    """Saves of one run through orbax's manager, each awaited before the next starts, so a
    failure is reported with the step that failed (orbax raises it at the next call, in the
    words of a background thread), and `pending` names a save still being written."""

    def __init__(self, mngr: "ocp.CheckpointManager", layout: dict | None = None):
        self.mngr = mngr
        self.layout = layout  # kept with every step (LAYOUT): how its state stores the layers
        self.pending: int | None = None
        self.started: list[int] = []  # every step this run began saving

    def save(self, step: int, state) -> bool:
        """Start saving `state` as `step` unless that step is already saved (a signal arriving
        on a checkpoint step asks for the same step twice); True if it started one."""
        self.finish()
        if step in self.mngr.all_steps():
            return False
        sums = fingerprint(state)  # before the save: its failure is not the disk's
        self.pending = step
        ocp = _orbax()
        try:
            args = {ITEM: ocp.args.StandardSave(state), SUMS: ocp.args.JsonSave(sums)}
            if self.layout is not None:
                args[LAYOUT] = ocp.args.JsonSave(self.layout)
            self.mngr.save(step, args=ocp.args.Composite(**args))
        except Exception as e:  # noqa: BLE001 — orbax/TensorStore raise many types for a failed write
            self.pending = None
            raise SaveError(step, self.mngr.directory, failure_reason(e)) from e
        self.started.append(step)
        return True

    def finish(self) -> None:
        """Wait for the save in flight; SaveError if it failed."""
        step, self.pending = self.pending, None
        try:
            self.mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001 — as in save()
            if step in self.started:
                self.started.remove(step)
            raise SaveError(step, self.mngr.directory, failure_reason(e)) from e


def _words(x):
    """`x`'s bits as unsigned words of its own width (a 64-bit value as two 32-bit words)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jax.numpy.bool_:
        x = x.astype(jax.numpy.uint8)
    width = {1: jax.numpy.uint8, 2: jax.numpy.uint16, 4: jax.numpy.uint32, 8: jax.numpy.uint32}
    return jax.lax.bitcast_convert_type(x, width[x.dtype.itemsize])


@jax.jit
def _sums(x):
    """Two 32-bit sums over the bits of `x` (wrapping): the words, and the words times an odd
    weight per flat position (2·i + 1). A change of any one word changes both (an odd weight is
    invertible modulo 2**32); words that trade places change the second. Reduced where the
    shards are, so every process of a multi-process run reads the same two numbers."""
    words = _words(x).astype(jax.numpy.uint32)
    position = jax.numpy.zeros(words.shape, jax.numpy.uint32)
    for axis in range(words.ndim):  # the flat index, without a reshape that would gather
        position = position * words.shape[axis] + jax.lax.broadcasted_iota(
            jax.numpy.uint32, words.shape, axis
        )
    u32 = jax.numpy.uint32
    return jax.numpy.stack([words.sum(dtype=u32), (words * (2 * position + 1)).sum(dtype=u32)])


def _host_sums(x, chunk: int = 1 << 20) -> list[int]:
    """`_sums` computed by NumPy on an array in this host's memory: the same two numbers, at
    about 8 GB/s where XLA:CPU's integer reductions run at 1.6 (measured on 2 cores)."""
    words = np.asarray(jax.device_get(_words(x) if x.dtype.itemsize == 8 else x))
    words = words.reshape(-1).view(f"u{min(words.dtype.itemsize, 4)}")
    odd = 2 * np.arange(chunk, dtype=np.uint32) + np.uint32(1)
    plain = weighted = 0
    for i in range(0, words.size, chunk):
        part = words[i : i + chunk].astype(np.uint32)
        plain += int(part.sum(dtype=np.uint32))
        weight = odd[: part.size] + np.uint32((2 * i) % 2**32)  # 2·(i + k) + 1, wrapping
        weighted += int((part * weight).sum(dtype=np.uint32))
    return [plain % 2**32, weighted % 2**32]


def _on_host(x) -> bool:
    return x.is_fully_addressable and all(d.platform == "cpu" for d in x.devices())


def fingerprint(state) -> dict[str, list[int]]:
    """Every array leaf's two checksums (`_sums`), keyed by its path in the state
    ("params.embed", "opt_state.1.0.mu.embed")."""
    host, device = {}, {}
    # In a job of several processes each leaf's sums is a program with collectives between
    # them. XLA:CPU runs programs that do not depend on each other at the same time, and
    # their collectives then pair up wrongly across processes: a 2-process run of the default
    # model hung at every checkpoint save, one process in an all-reduce of these sums, the
    # other in orbax's next collective. One such program in flight at a time, in the same
    # order on every process, pairs them.
    one_at_a_time = jax.process_count() > 1
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        if isinstance(x, jax.Array) and x.dtype.itemsize in (1, 2, 4, 8):
            name = ".".join(_names(path))
            if _on_host(x) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                host[name] = _host_sums(x)
            else:
                device[name] = _sums(x)
                if one_at_a_time:
                    device[name].block_until_ready()
    device = {k: [int(v) for v in s] for k, s in jax.device_get(device).items()}
    return {**host, **device}


def _lists_sums(step_dir: Path) -> bool:
    """Whether the step's own metadata names a checksum item: a step saved with checksums
    whose folder is gone, not one saved before they were kept."""
    return _lists_item(step_dir, SUMS)


def _lists_item(step_dir: Path, name: str) -> bool:
    """Whether the step's own metadata names the item `name` (it was saved with it)."""
    try:
        meta = json.loads((Path(step_dir) / "_CHECKPOINT_METADATA").read_text())
        return name in (meta.get("item_handlers") or {})
    except (OSError, ValueError, AttributeError, TypeError):
        return False  # no readable metadata: nothing says the item was saved


def _sums_differ(step_dir: Path, state) -> str | None:
    """Why a restored state is not what was saved ('params…: its checksum differs'), or None;
    None also for a step saved before checksums were kept (nothing to compare)."""
    sums_dir = step_dir / SUMS
    if not sums_dir.exists():
        return f"its checksums ({SUMS}/) are missing" if _lists_sums(step_dir) else None
    # (every process of a job reads the same files: all return here alike, or all go on to
    # the fingerprint's collective reductions together)
    try:
        ocp = _orbax()
        saved = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(sums_dir)
        if not isinstance(saved, dict):
            raise ValueError(f"{type(saved).__name__}, not a table")
    except Exception as e:  # noqa: BLE001 — a damaged JSON file, whatever the reader raises
        return f"its checksums cannot be read: {_first_line(e)}"
    now = fingerprint(state)
    for path, sums in saved.items():
        if path in now and list(sums) != now[path]:
            return f"{path or 'the state'}: the values differ from those saved (checksum)"
    if unchecked := [p for p in now if p not in saved]:  # an edited or truncated record
        more = f" and {len(unchecked) - 1} more" if len(unchecked) > 1 else ""
        return f"its checksums do not cover {unchecked[0] or 'the state'}{more}"
    return None


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:160]


def _damage(e: Exception) -> str:
    """Why a step did not restore, in a phrase: the innermost error orbax raised it from
    (TensorStore's own: which array, which bytes), its first line without the database's path
    (the warning names the step) or the TensorStore spec some versions print after it."""
    root, depth = e, 0
    while root.__cause__ is not None and depth < 8:  # raised from it, not met while handling
        root, depth = root.__cause__, depth + 1
    text = str(root).strip().split("\n")[0] if str(root).strip() else type(root).__name__
    if "tree structures do not match" in text:  # orbax lists the trees on the next lines
        return "its arrays are not this model's: a part of them is missing"
    text = re.sub(r' in OCDBT database at local file "[^"]*"', "", text)
    text = text.split(" See full TensorStore details")[0]
    return text if len(text) <= 200 else text[:199] + "…"


# What the reader met, not damage in the files: a step that failed to restore for one of
# these may be whole, so it is never moved aside and the resume stops instead. Matched in the
# first line of each error, paths taken out (a folder may be named anything).
_READER_FAILURES = (
    ("permission denied", "its files cannot be read here: permission denied"),
    ("operation not permitted", "its files cannot be read here: operation not permitted"),
    ("resource_exhausted", "out of memory while restoring it"),
    ("out of memory", "out of memory while restoring it"),
    ("cannot allocate memory", "out of memory while restoring it"),
    ("too many open files", "too many open files"),
    ("stale file handle", "its file system went away (stale file handle)"),
    ("transport endpoint is not connected", "its file system went away"),
    ("unavailable:", "its storage did not answer (UNAVAILABLE)"),
    ("deadline_exceeded", "the run's processes did not restore it together (a peer stopped?)"),
    ("gloo context", "the run's processes did not restore it together (a peer stopped?)"),
)
_READER_ERRNOS = {
    errno.EACCES: _READER_FAILURES[0][1],
    errno.EPERM: _READER_FAILURES[1][1],
    errno.ENOMEM: _READER_FAILURES[2][1],
    errno.EMFILE: _READER_FAILURES[5][1],
    errno.ENFILE: _READER_FAILURES[5][1],
    errno.ESTALE: _READER_FAILURES[6][1],
    errno.ENOTCONN: _READER_FAILURES[7][1],
}


def _reader_failure(e: BaseException) -> str | None:
    """Why a restore failed where the cause is the reader (permissions, memory, the file
    system, the other processes of the run), not the step: from the error or any it came
    from."""
    seen = 0
    while e is not None and seen < 16:
        if isinstance(e, OSError) and e.errno in _READER_ERRNOS:
            return _READER_ERRNOS[e.errno]
        if isinstance(e, MemoryError):
            return _READER_FAILURES[2][1]
        first = (str(e).strip().splitlines() or [""])[0]
        first = re.sub(r"""("[^"]*"|'[^']*'|/\S+)""", "", first).lower()
        for needle, why in _READER_FAILURES:
            if needle in first:
                return why
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


class StepDamaged(Exception):
    """Raised while a step is read, by what a caller checks in it (`restore_latest`'s
    `abstract_state` function): the step is damaged, for the reason given, and set aside."""


def step_record(step_dir: Path, name: str):
    """A JSON item a step keeps beside its arrays (e.g. LAYOUT), or None for a step saved
    before the item was kept; StepDamaged where the step was saved with it and it is gone or
    unreadable. Read as the file the JSON handler writes (`<item>/metadata`), by this process
    alone: orbax's reader waits on every process of the job, and a caller may be only one."""
    path = Path(step_dir) / name / "metadata"
    if not (Path(step_dir) / name).exists() and not _lists_item(step_dir, name):
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise StepDamaged(f"its {name} record ({name}/) cannot be read: {_first_line(e)}") from None


def saved_names(step_dir: Path) -> set[tuple] | None:
    """Every array's path in the state a step saved, as plain names (("params", "embed"),
    …); None where its metadata cannot be read (a damaged step: the restore judges it)."""
    try:
        meta = _orbax().StandardCheckpointer().metadata(Path(step_dir) / ITEM)
        meta = getattr(meta, "item_metadata", meta)
        return {_names(p) for p, _ in jax.tree_util.tree_leaves_with_path(meta)}
    except Exception:  # noqa: BLE001 — unreadable metadata
        return None


def only_params(abstract_state):
    """`abstract_state` (a TrainState's shapes) with every array but the parameters a
    placeholder: a restore of it reads the weights alone and leaves the rest unread."""
    skip = lambda x: _orbax().PLACEHOLDER  # noqa: E731
    return abstract_state.replace(
        step=_orbax().PLACEHOLDER, opt_state=jax.tree.map(skip, abstract_state.opt_state)
    )


def _is_placeholder(x) -> bool:
    return x is ...  # orbax's PLACEHOLDER


def _read(item: Path, target):
    """The arrays of `target` from a step's item; a target with placeholders (only_params)
    through orbax's PyTree reader, which skips them (its standard reader refuses them)."""
    ocp = _orbax()
    if not any(_is_placeholder(x) for x in jax.tree.leaves(target)):
        return ocp.StandardCheckpointer().restore(item, target)
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    args = ocp.args.PyTreeRestore(item=target, restore_args=restore_args)
    return ocp.PyTreeCheckpointer().restore(item, args=args)


def _shape_mismatch(path: Path, abstract_state) -> str | None:
    """'params.…: saved (64, 256), this model (128, 256)' for the first leaf whose saved shape
    differs from the model's; None when they agree or the metadata cannot be read whole (then
    the restore decides whether the step is damaged). lab.rundir.check_same_state catches a
    changed model from config.json first; this is the check of the arrays themselves."""
    try:
        meta = _orbax().StandardCheckpointer().metadata(path)
        meta = getattr(meta, "item_metadata", meta)
        saved = jax.tree_util.tree_leaves_with_path(meta)
    except Exception:  # noqa: BLE001 — unreadable metadata: a damaged step, judged by restore
        return None
    want = jax.tree_util.tree_leaves_with_path(abstract_state)
    if len(saved) != len(want):
        # arrays this model has not: another model's step (a damaged step's metadata reads
        # as a part of its tree, or not at all, never as names it did not save); arrays
        # missing only: a partial tree, which the restore judges
        have, need = {_names(p) for p, _ in saved}, {_names(p) for p, _ in want}
        weights_first = lambda n: (n[:1] != ("params",), n)  # noqa: E731
        if extra := sorted(have - need, key=weights_first):
            return f"{'.'.join(extra[0])}: saved, not in this model"
        return None
    saved_shapes = {_names(p): tuple(getattr(x, "shape", ()) or ()) for p, x in saved}
    for p, x in want:
        if _is_placeholder(x):  # not read (only_params)
            continue
        shape = saved_shapes.get(_names(p))
        if shape is not None and shape != tuple(x.shape):
            return f"{jax.tree_util.keystr(p)}: saved {shape}, this model {tuple(x.shape)}"
    return None


def _names(path) -> tuple:
    """A key path as plain names: dict keys, attribute names and indices alike (the saved
    metadata has dicts where the state has optax's named tuples)."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def quarantine(run_dir, step: int, why: str, warn) -> Path:
    """Move a damaged step out of the checkpoints folder (never delete it) and say so; a
    ConfigError (one line) where it cannot be moved."""
    src = folder(run_dir) / str(step)
    dst = damaged_folder(run_dir) / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
    _move_aside(src, dst, f"checkpoint step {step} is damaged ({why})")
    warn(f"warning: checkpoint step {step} is damaged ({why}); moved to {dst}")
    return dst


def _move_aside(src: Path, dst: Path, what: str) -> None:
    """Rename `src` to `dst`; where it cannot be (checkpoints-damaged is a file, a read-only
    folder), one line: left in place, the step would be skipped by every later save of that
    step number and found damaged again by every resume."""
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        src.rename(dst)
    except OSError as e:
        raise ConfigError(
            f"{what} and cannot be moved to {dst.parent} ({e.strerror or e}): move it out of "
            f"{src.parent} yourself, then resume"
        ) from None


def set_aside_strays(run_dir, warn) -> None:
    """Folders of digits that the saver never writes (a leading zero: "06"): the checkpoint
    library would read "06" as step 6 and skip saving step 6, while the lab never restores
    it. Moved beside the damaged steps, with a warning."""
    path = folder(run_dir)
    if not path.is_dir():
        return
    for p in sorted(path.iterdir()):
        if p.name.isascii() and p.name.isdigit() and not _is_step(p.name):
            dst = damaged_folder(run_dir) / f"{p.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            _move_aside(p, dst, f"{p} is not a step folder the lab writes")
            warn(f"warning: {p} is not a step folder the lab writes; moved to {dst}")


def _finite(state) -> bool:
    """Every floating value of `state` finite, checked where the values are: a jitted
    reduction whose one boolean every process can read (in a job of several processes a
    process holds only its shards of a split weight, and cannot fetch the others')."""
    leaves = [
        x
        for x in jax.tree.leaves(state)
        if hasattr(x, "dtype") and jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
    ]
    if not leaves:
        return True
    ok = jax.jit(lambda xs: jax.numpy.stack([jax.numpy.isfinite(x).all() for x in xs]).all())
    return bool(ok(leaves))


def restore_latest(
    run_dir,
    abstract_state,
    *,
    warn=print,
    why: str = "resume=true",
    moved: list | None = None,
    read_only: bool = False,
    finite=None,
):
    """(step, state) from the newest step that restores whole and finite, or (None, None).
    `abstract_state` is the state's shapes and shardings, or a function of a step's folder
    giving them (a run whose steps store their state in more than one way).

    Damaged steps are moved aside as they are found (their steps appended to `moved`, for a
    caller that must say why none is left); a step saved for another model shape raises
    ConfigError (one line, starting with `why`: what asked for the state) and nothing is moved;
    so does a step that failed for a reason of the reader's (`_reader_failure`: permissions,
    memory, the run's other processes), which may be whole. `read_only` (a reader such as
    lab.serve, which may share the folder with a live run or have no right to write it, or a
    process of a multi-process run other than the first, which moves for all): damaged steps
    are skipped and nothing in the folder is touched. `finite(state)` picks what must be
    finite (default: all of it).
    """
    moved = [] if moved is None else moved
    finite = finite or (lambda state: state)

    def set_aside(step: int, reason: str) -> None:
        moved.append(step)
        if read_only:
            warn(f"checkpoint step {step} is damaged ({reason}): skipped")
        else:
            quarantine(run_dir, step, reason, warn)

    if not read_only:
        set_aside_strays(run_dir, warn)
    path = folder(run_dir)
    steps = sorted((int(p.name) for p in path.glob("[0-9]*") if _is_step(p.name)), reverse=True)
    for step in steps:
        item = path / str(step) / ITEM
        try:
            target = (
                abstract_state(path / str(step)) if callable(abstract_state) else abstract_state
            )
        except StepDamaged as e:
            set_aside(step, str(e))
            continue
        mismatch = _shape_mismatch(item, target)
        if mismatch:
            raise ConfigError(
                f"{why}: checkpoint step {step} holds another model ({mismatch}) than "
                f"{run_dir / 'config.json'} (with any model keys given) describes; use the "
                "run's own model keys"
                + (", or start a new name=" if why == "resume=true" else "")
                + " (without model keys, the folder's config.json is not its checkpoints')"
            )
        try:
            state = _read(item, target)
        except Exception as e:  # noqa: BLE001 — orbax/TensorStore raise many types for damage
            reader = _reader_failure(e)
            if reader:
                raise ConfigError(
                    f"{why}: checkpoint step {step} was not restored ({reader}); it was not "
                    f"moved: fix that, then run it again"
                ) from None
            set_aside(step, _damage(e))
            continue
        differ = _sums_differ(path / str(step), state)
        if differ:
            set_aside(step, differ)
            continue
        if not _finite(finite(state)):
            set_aside(step, "non-finite values")
            continue
        return step, state
    return None, None


class Lock:
    """An exclusive lock on the run folder for the life of the process (fcntl: released by
    the kernel when the process dies, so a crash never leaves a stale lock)."""

    def __init__(self, run_dir):
        self.path = Path(run_dir) / ".lock"
        self._f = None

    def __enter__(self):
        # held open for the lock's life; a damaged lock file is read, never a UnicodeDecodeError
        self._f = open(self.path, "a+", errors="replace")  # noqa: SIM115
        try:
            fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._f.seek(0)
            holder = self._f.read().strip() or "another process"
            self._f.close()
            raise ConfigError(
                f"run folder {self.path.parent} is in use by {holder}: wait for it, or choose "
                "another name="
            ) from None
        try:  # who holds it, for the message above; the lock holds without it (a full disk)
            self._f.seek(0)
            self._f.truncate()
            self._f.write(f"pid {os.getpid()}")
            self._f.flush()
        except OSError:
            pass
        return self

    def __exit__(self, *exc):
        if self._f:
            with contextlib.suppress(OSError):
                self._f.seek(0)
                self._f.truncate()
            fcntl.flock(self._f, fcntl.LOCK_UN)
            with contextlib.suppress(OSError):
                self._f.close()

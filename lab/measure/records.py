"""One JSON record per measurement, carrying the environment it was measured in.

A number without its backend, device kind, device count and library versions cannot be
compared with another run's, so `make_record` stamps every record with them; reports are
rendered from records, never from numbers typed into code. Files are JSON Lines, appended,
so several runs (and several backends) can write into one results folder and be merged.
"""

import atexit
import contextlib
import datetime
import errno
import functools
import itertools
import json
import os
import platform
import resource
import socket
import sys
import time
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

import jax
import numpy as np

from lab import startup
from lab.errors import ConfigError, RunError
from lab.measure import toolchain

# measured: timed or counted at run time here; compiled: read from a program compiled for the
# hardware here (XLA's FLOP count, its buffer assignment), exact for that program, not timed;
# compiled, not run: the same for hardware that is not here; predicted: a model's figure;
# derived: arithmetic over other records.
LABELS = ("measured", "compiled", "predicted", "compiled, not run", "derived")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def cpu_model() -> str:
    """This host's processor as /proc/cpuinfo names it, with its family and model numbers (a
    VM may name only the vendor's line: "AMD EPYC") and the host's core count."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields:
        name += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    return f"{name}, {os.cpu_count() or 1} cores"


def _load_avg() -> float | None:
    """Runnable processes (1-minute average): a busy host makes every time slower."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def busy_host() -> tuple[float, int] | None:
    """(load average, cores) where other work shares this host (a load above half its cores),
    None on a quiet host: every time taken then comes out high (a rate from it low) and noisy."""
    load, cores = _load_avg(), os.cpu_count() or 1
    return None if load is None or load <= 0.5 * cores else (load, cores)


def _cpu_seconds() -> tuple[float, float, float] | None:
    """(the host's busy CPU seconds from /proc/stat, this process's and its children's CPU
    seconds, a monotonic clock); None off Linux."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    except (OSError, ValueError):
        return None
    host = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    own = sum(
        r.ru_utime + r.ru_stime
        for r in (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
    )
    return host, own, time.monotonic()


class OtherWork:
    """How much of the host's CPU other processes took while a block ran: the host's busy
    CPU time less this process's own, over the wall time × cores. A check before a
    measurement (`busy_host`) cannot see work that starts during it, and the load average
    after it counts the measurement's own threads. `share` is None off Linux."""

    def __enter__(self):
        self._start = _cpu_seconds()
        self.share: float | None = None
        return self

    def __exit__(self, *exc):
        end = _cpu_seconds()
        if self._start is not None and end is not None and end[2] > self._start[2]:
            other = (end[0] - self._start[0]) - (end[1] - self._start[1])
            self.share = max(0.0, other / ((end[2] - self._start[2]) * (os.cpu_count() or 1)))
        return False

    @property
    def busy(self) -> bool:
        """Other work took over half the cores on average, as `busy_host` judges a host."""
        return self.share is not None and self.share > 0.5


# Units of measured records that are amounts, not times or rates: a busy host leaves them as
# they are, so the caution about a shared host does not count them.
UNTIMED_UNITS = ("B", "FLOP", "devices", "cores", "loss", "max |Δ|", "exponent")


def busy_records(records) -> tuple[int, int, float, int]:
    """(busy, timed, highest load, cores) over the measured CPU records that say their host's
    load and cores: `busy` of `timed` were taken with a load above half the cores, as
    `busy_host` judges a host before it times anything. A record a comparison set aside
    (`set_aside`: it judges no claim there) is not counted, nor one in a unit of amount
    (bytes, a device count, an error: `UNTIMED_UNITS`), which no other work changes."""
    timed = [
        r
        for r in records
        if r.get("label") == "measured"
        and not r.get("set_aside")
        and r.get("unit") not in UNTIMED_UNITS
        and isinstance(r.get("value"), int | float)  # a reason, or no figure: nothing timed
        and r.get("backend") == "cpu"
        and isinstance(r.get("load_avg_1m"), int | float)
        and isinstance(r.get("cpu_count"), int)
    ]
    busy = [r for r in timed if r["load_avg_1m"] > 0.5 * r["cpu_count"]]
    top = max(busy, key=lambda r: r["load_avg_1m"], default=None)
    return len(busy), len(timed), top["load_avg_1m"] if top else 0.0, top["cpu_count"] if top else 0


def busy_note(slow: str = "times", fast: str = "rates") -> str:
    """A line for a command to print before it times anything on a shared host
    (`busy_host`): other work takes cores from it, so its times (`slow`: what grows with
    them) come out high and its rates (`fast`: what shrinks) low, both noisy. Empty on a
    quiet host."""
    busy = busy_host()
    if busy is None:
        return ""
    return (
        f"host load average {busy[0]:.1f} on {busy[1]} cores: other work shares them, so "
        f"{slow} will come out high and {fast} low, both noisy"
    )


@functools.cache
def environment() -> dict:
    """Backend, devices and versions of this process (fixed once JAX has started), with the
    ptxas, CUDA runtime and JAX CUDA plugin that compile its GPU kernels (a GPU figure, or a
    GPU plan's, is the compiler's as much as the kernel's; None where there is none)."""
    devices = jax.devices()
    return {
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "local_device_count": jax.local_device_count(),
        "process_count": jax.process_count(),
        "jax_version": jax.__version__,
        "jaxlib_version": _version("jaxlib"),
        "flax_version": _version("flax"),
        "libtpu_version": _version("libtpu"),  # what compiles a TPU plan (None: not installed)
        **toolchain.probe().record(),
        "python_version": platform.python_version(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count() or 1,
        # the allocator XLA:CPU gets its temporaries from: a step's time on CPU depends on it
        # (lab.startup); None off CPU
        "allocator": (
            ("huge pages" if startup.in_huge_pages() else "system")
            if jax.default_backend() == "cpu"
            else None
        ),
        "platform": f"{sys.platform}-{platform.machine()}",
        "command": command(),
    }


def command() -> str | None:
    """The command this process runs, as its user typed it after `python -m` (lab.run,
    experiments, lab.tools.attention_bench) or the script's file name: a record names what
    wrote it, so a reader given the wrong file can say whose it is. None from an
    interactive session."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return spec.name.removesuffix(".__main__")
    path = getattr(main, "__file__", None)
    return os.path.basename(path) if path else None


def _is_dtype(x) -> bool:
    """A dtype or a scalar type that names one (np.float32, jnp.bfloat16, np.dtype("int8"))."""
    if isinstance(x, np.dtype):
        return True
    return isinstance(x, type) and (
        issubclass(x, np.generic) or isinstance(getattr(x, "dtype", None), np.dtype)
    )


def _scalar(x):
    """A NumPy or JAX number (a scalar, or an array of no dimensions) as the Python number it
    holds; anything else unchanged."""
    if isinstance(x, np.generic | np.ndarray | jax.Array) and np.ndim(x) == 0:
        if np.issubdtype(x.dtype, np.bool_):
            return bool(x)
        if np.issubdtype(x.dtype, np.integer):
            return int(x)
        # bfloat16 and the other ml_dtypes floats are not np.floating; jnp.issubdtype knows them
        if np.issubdtype(x.dtype, np.floating) or jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
            return float(x)
    return x


def plain(x):
    """`x` with what JSON has no word for made plain, inside dicts, lists and tuples: a dtype
    by its name ("float32", not the repr of its class), a NumPy or JAX number as a Python
    one. Other values are left as they are (the writer stores them as text)."""
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if type(x) in (list, tuple):
        return type(x)(plain(v) for v in x)
    if _is_dtype(x):
        return np.dtype(x).name
    return _scalar(x)


def _value(what: str, value, unit: str):
    """A record's value as readers take it (`_wrong_type`): a Python number or None, or the
    text of a reason for a skipped point (unit "reason"); a NumPy or JAX number is made a
    Python one, anything else refused here rather than written as text no reader takes."""
    if unit == "reason":
        if not isinstance(value, str):
            raise ValueError(
                f"record {what!r}: value={value!r}: a skipped point's reason must be text"
            )
        return value
    value = _scalar(value)
    if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
        return value
    raise ValueError(
        f"record {what!r}: value={value!r} ({type(value).__name__}) is not a number: "
        "records hold an int or float (a NumPy or JAX scalar is taken) or None"
    )


def make_record(what: str, value, unit: str, *, label: str = "measured", **config) -> dict:
    """{what, value, unit, label, config, <environment>, timestamp} for one measurement.

    `value`: a number (int, float, or a NumPy/JAX scalar or 0-d array, stored as the Python
    number) or None; for unit "reason" the text of why a point was skipped. Anything else is
    a ValueError here, since no reader of records would take it back.
    `label` says how the figure was obtained (DESIGN.md, "honest numbers"): measured here,
    predicted from measurements and a spec entry, compiled but not run, or derived.
    `config` holds whatever identifies the measurement (shape, dtype, precision, …); dtypes
    are stored by name and NumPy/JAX numbers as Python ones (`plain`).
    """
    if label not in LABELS:
        raise ValueError(f"label={label!r}: expected one of {', '.join(map(repr, LABELS))}")
    return {
        "what": what,
        "value": _value(what, value, unit),
        "unit": unit,
        "label": label,
        "config": plain(config),
        **environment(),
        "load_avg_1m": _load_avg(),
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def writable_dir(folder) -> Path:
    """`folder`, created if needed; a ConfigError (one line) where it cannot be written, so a
    command can refuse a bad out_dir= before it measures anything. A path that is, or lies
    under, something other than a folder (a file, /dev/full) is named as such: the operating
    system's own words for it ("File exists", "Not a directory") do not say what is wrong."""
    if isinstance(folder, str) and not folder.strip():  # Path("") is the current folder
        raise ConfigError("an empty folder name: give the folder to write to (e.g. results)")
    folder = Path(folder)
    try:  # a name longer than the file system allows: exists() raises (Python < 3.12)
        blocker = next((p for p in (folder, *folder.parents) if p.exists() or p.is_symlink()), None)
    except OSError as e:
        raise ConfigError(f"cannot write to {str(folder)!r}: {e.strerror or e}") from None
    if blocker is not None and not blocker.exists():  # a link to nothing
        what = "it" if blocker == folder else repr(str(blocker))
        raise ConfigError(
            f"cannot write to {str(folder)!r}: {what} is a link to {os.readlink(blocker)!r}, "
            "which does not exist"
        )
    if blocker is not None and not blocker.is_dir():
        what = "it" if blocker == folder else repr(str(blocker))
        raise ConfigError(f"cannot write to {str(folder)!r}: {what} is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        why = e.strerror or str(e)
        if e.errno == errno.ENOENT and blocker is not None:  # /proc exists, takes no files
            where = "it" if blocker == folder else repr(str(blocker))
            why = f"{where} takes no new files (a folder of the system's, not for output)"
        raise ConfigError(f"cannot write to {str(folder)!r}: {why}") from None
    return folder


def fresh_dir(root, name: str) -> Path:
    """root/name, created, and never one that exists: root/name-2, -3, … when another run
    (started in the same second, say) has it. The root is checked as `writable_dir` does."""
    root = writable_dir(root)
    for n in range(1, 10_000):
        path = root / (name if n == 1 else f"{name}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise ConfigError(f"cannot write to {str(root)!r}: 10,000 folders named {name}-… exist")


def output_stem(folder, name: str, backend: str | None = None) -> Path:
    """folder/name-<backend>-<time> (no suffix): where a command writes its records and plots
    (`backend`: the one the figures are for, a plan's target's; default this process's);
    the folder is created and checked first. A stem that files already use (an earlier run
    in the same second) gets -2, -3, …, so a run's records are not appended to a finished
    run's. The stem is reserved: its `.jsonl` is created here, exclusively, so two commands
    started in the same second get two stems; a reservation still empty when the process
    ends (the command stopped before it wrote a record) is removed then."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = writable_dir(folder) / f"{name}-{backend or jax.default_backend()}-{stamp}"
    for n in itertools.count(1):
        stem = base if n == 1 else base.with_name(f"{base.name}-{n}")
        if any(stem.parent.glob(f"{stem.name}.*")):
            continue
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY
        try:
            os.close(os.open(stem.with_suffix(".jsonl"), flags, 0o666))
        except FileExistsError:
            continue
        path = stem.with_suffix(".jsonl")
        _RESERVED.add(path)
        atexit.register(_drop_if_empty, path)
        startup.on_stop(functools.partial(_drop_if_empty, path))  # a signal runs no atexit
        return stem
    raise AssertionError("unreachable")


_RESERVED: set = set()  # the records files output_stem reserved: a signal says where they are


def drop_empty_reservations(folder) -> None:
    """Remove the records files `output_stem` reserved in `folder` that are still empty (the
    command stopped before it wrote a record), now rather than at exit: a command that made
    the folder can then remove it, empty, as it found the place."""
    for path in [p for p in _RESERVED if p.parent == Path(folder)]:
        _drop_if_empty(path)


def _drop_if_empty(path: Path) -> None:
    try:
        if path.stat().st_size == 0:
            path.unlink()
    except OSError:
        pass


def _json_default(x):
    """What json.dumps writes for a value it has no word for: a dtype by its name, a NumPy
    or JAX number as the number, anything else as its text."""
    made = plain(x)
    return str(x) if made is x else made


def write_records(path, records: dict | Iterable[dict]) -> Path:
    """Append records (one dict or many) to a JSON Lines file, creating its folder. The
    lines are written whole: a signal during the write exits once it is done. A dtype is
    written by its name and a NumPy or JAX number as a number (`plain`), other values JSON
    has no word for as their text."""
    path = Path(path)
    writable_dir(path.parent)
    if isinstance(records, dict):
        records = [records]
    text = "".join(json.dumps(r, default=_json_default) + "\n" for r in records)
    data = text.encode()
    with startup.held():
        # unbuffered, appended: a write that fails (a full disk) leaves nothing in a buffer
        # for close() to retry, and what reached the file is cut back to its length before
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            start = os.fstat(fd).st_size
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            n = text.count("\n")
            raise RunError(
                f"cannot write records to {path}: {e.strerror or e} ({n} "
                f"record{'s' * (n != 1)} not written"
                + (", the earlier ones kept)" if start else ")")
            ) from None
        finally:
            os.close(fd)
    if path in _RESERVED:  # a command's own records: a signal from now on says they are kept
        startup.note(f"the records written so far are in {path}")
    return path


RECORD_KEYS = ("what", "value", "unit", "label", "config", "backend", "device_kind")


_KEY_TYPES = {"what": str, "unit": str, "label": str, "config": dict, "backend": str}


def _wrong_type(r: dict) -> str | None:
    """'value is a str, not a number' for the first field of a record that holds another type
    than the lab writes: every reader of records (the report, compare) trusts these."""
    for key, kind in _KEY_TYPES.items():
        if not isinstance(r[key], kind):
            return f"{key} is {_json_type(r[key])}, not {_json_type(kind())}"
    if not isinstance(r["device_kind"], str | type(None)):
        return f"device_kind is {_json_type(r['device_kind'])}, not a string"
    v = r["value"]
    if r["unit"] == "reason":  # why a point was skipped: its value is the reason's text
        return None if isinstance(v, str) else f"value is {_json_type(v)}, not a reason's text"
    if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
        return f"value is {_json_type(v)}, not a number"
    if isinstance(v, int) and abs(v) > _LARGEST:  # JSON's integers have no bound; floats do
        return "value is an integer past the largest number a float holds"
    return None


_LARGEST = 1.7976931348623157e308


def json_type(x) -> str:
    """'a string', 'a list', 'null', …: how a JSON value is named in a refusal."""
    return _json_type(x)


def _json_type(x) -> str:
    names = {str: "a string", dict: "an object", list: "a list", bool: "true/false"}
    if x is None:
        return "null"
    return names.get(type(x), "a number" if isinstance(x, int | float) else type(x).__name__)


def _keep_before(line: int, whole: int) -> str:
    """The way past a last line cut short: the whole records before it can be kept."""
    if not whole:
        return ""
    these = "the record before it is" if whole == 1 else f"the {whole} records before it are"
    return f"; {these} whole: remove line {line} to use {'it' if whole == 1 else 'them'}"


def read_records(path, check=None) -> list[dict]:
    """Every record of a JSON Lines file (blank lines skipped). A line that is not a record
    (a write cut short by a kill, a file of something else) is a ValueError naming the file
    and the line: one damaged line is not a damaged folder the user must search. A last line
    cut short says how many whole records come before it, and that removing it keeps them.
    `check(record)`, where given, says why a reader refuses a well-formed record (None: it
    does not); the ValueError names the line."""
    out = []
    try:
        with Path(path).open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                except ValueError as e:
                    if line.endswith("\n"):
                        raise ValueError(f"{path}, line {n}: not JSON: {e}") from None
                    # no newline: the last line, a write that was stopped
                    raise ValueError(
                        f"{path}, line {n}: not JSON (cut short: a write that was stopped?): "
                        f"{e}{_keep_before(n, len(out))}"
                    ) from None
                missing = [k for k in RECORD_KEYS if k not in r] if isinstance(r, dict) else None
                if missing is None or missing:
                    what = f"no {', '.join(missing)}" if missing else f"a JSON {type(r).__name__}"
                    raise ValueError(f"{path}, line {n}: not a lab record ({what})")
                wrong = _wrong_type(r)
                if wrong:
                    raise ValueError(f"{path}, line {n}: not a lab record ({wrong})")
                if check is not None and (why := check(r)):
                    raise ValueError(f"{path}, line {n}: {why}")
                out.append(r)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    return out

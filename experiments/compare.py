"""`python -m experiments.compare dirs=DIR,DIR,...`: several backends side by side.

Each DIR is a folder `python -m experiments` wrote (CPU here, a GPU VM, a TPU VM). The
records are merged into one list, figures that need two backends at once are derived from
them (labelled `derived`, backend `multi` where the claim is about a pair: C19's TPU/H100 and
MI300X/H100 ratios; C02's accelerator-over-CPU training speedup on the accelerator's
backend), and one report sets the articles' "GPU vs TPU vs CPU" figures beside each other:
the measured numbers per folder, then every claim's verdict per folder and merged.

Each folder is a column named backend · device kind · size; folders that share that name add
the host their records name, else as much of their path as tells them apart (hostA/run). Each
merged record carries `machine`, its column's name: the plots draw a series or a panel per
machine, and the report tags each figure with it (a reference figure every folder carries
alike, a datasheet's, is shown once, untagged). A folder's column judges the claims its
run selected (run.json's `only`) as its own REPORT.md does, and says "not run", "failed" or
"cut short" where run.json says so; the comparison judges the claims some folder selected,
each from the folders that selected it, setting a tiny-size folder's records aside where a
folder at size quick or full has records of the claim (`judged`).

Refused with one line (exit 2): a folder given twice, or two folders that hold the same
records (a copy of one run); a comparison (give the folders it merged: its records are
theirs); a folder of another command's records (lab.run, a lab tool); a run.json missing,
damaged, not a regular file or naming another size than its records (it says the run's size
and the claims it selected); a record of a claim or a label the lab does not know; a value
that is not a finite number; a record of a claim's figure in another unit than its range, or
negative where its unit cannot be; a name the ledger reads (claim, metric, size, host) that is
not text; a line that is not a record (a last line cut short says which to remove).
"""

import dataclasses
import datetime
import itertools
import json
import math
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from experiments.common import SIZES
from lab.config import cli, field
from lab.errors import ConfigError
from lab.measure import records as rec
from lab.report import markdown, progress, tables
from lab.report.claims import BY_ID, CLAIMS
from lab.report.verdict import judge_all, unjudged_parts


@dataclasses.dataclass(frozen=True)
class Options:
    dirs: tuple = field(
        (),
        "results folders of python -m experiments, comma-separated (for a comparison, give "
        "the folders it merged)",
        kind="names",
    )
    out_dir: str = field("results", "where compare-<time>/ is written", kind="path")


def _train(c: dict) -> bool:
    return c.get("series") == "train_throughput"


def _bf16(c: dict) -> bool:
    return c.get("metric") == "bf16_matmul_flops" and "target" not in c  # measured here


def _roof(which: str):
    return lambda c: c.get("series") == "roof" and c.get("roof") == which


def _set_by(r: dict) -> str | None:
    """The op that set a roof: its config's `set_by` (experiments/roofline.py), else read
    from the words of a record written before it had one; None where neither says."""
    if r["config"].get("set_by"):
        return r["config"]["set_by"]
    what = r["what"]
    for pattern, name in (
        (r"the sweep's (\w+)", "{}"),  # a compute roof an op of the sweep set
        (r"^roof: matmul peak \(([^()]+)\)$", "matmul {}"),
        (r"best measured \((\w+), which moved bytes faster", "{}"),
        (r"best measured \(the copy kernel's", "copy"),
    ):
        if m := re.search(pattern, what):
            return name.format(*m.groups())
    return None


@dataclasses.dataclass(frozen=True)
class Row:
    """A row of the side-by-side table: the records of one quantity and one kind of figure
    (measured beside measured; a prediction in a row that says so)."""

    name: str
    match: Callable[[dict], bool]  # a record's config → whether it is this row's
    note: Callable[[dict], str] = lambda r: ""  # what tells this folder's figure apart
    value: Callable[[dict], tuple] = lambda r: (r["value"], r["unit"], r["label"])


def _batch(r: dict) -> str:
    return f"(batch {r['config']['batch']})"


def _step_note(r: dict) -> str:
    params, batch, seq = _step(r)
    return f"({batch} × {seq})"


def _roof_note(r: dict) -> str:
    op = _set_by(r)
    return f"(set by {op})" if op else ""


# The side-by-side table: how to find each row's record in one folder (the best, where several).
FIGURES = (
    Row(
        "matmul float32, no TF32",
        lambda c: (
            c.get("series") == "matmul_precision"
            and c.get("dtype") == "float32"
            and c.get("precision") == "highest"
        ),
    ),
    Row("matmul bf16", _bf16),
    # the roofs are the best rates measured by any op: a matmul on one machine, an elementwise
    # polynomial on another; each cell says which
    Row("compute roof (fastest op measured)", _roof("peak"), _roof_note),
    Row("memory roof (fastest op measured)", _roof("bandwidth"), _roof_note),
    Row(
        "copy bandwidth (x ← x·s)",
        lambda c: _roof("bandwidth")(c) and isinstance(c.get("copy_bytes_per_s"), int | float),
        # the copy kernel's own timing, carried on the memory roof's record (a derived best)
        value=lambda r: (r["config"]["copy_bytes_per_s"], "B/s", "measured"),
    ),
    Row("host→device copy", lambda c: c.get("metric") == "pcie_bandwidth"),
    Row("training tokens/s (lab step, one device)", _train, _step_note),
    Row(
        "compiled step memory",
        lambda c: c.get("series") == "memory_breakdown" and c.get("case") == "remat=none",
    ),
    # measured at each batch; the best batch's (the CPU's 16-core figure is a prediction)
    Row(
        "classifier requests/s (best batch measured)",
        lambda c: c.get("series") == "inference_batch",
        _batch,
    ),
    Row(
        "classifier requests/s, a 16-core CPU (predicted from the best batch)",
        lambda c: c.get("metric") == "cpu16_rps" and "target" not in c,
    ),
    Row("naive over flash attention time", lambda c: c.get("metric") == "flash_speedup"),
)


def _finite(r: dict) -> str | None:
    """Why compare refuses a record: a label or a claim the lab does not know (a made-up label
    would be shown as if it said how the figure was obtained; an unknown claim's record would
    be dropped unseen), a value that is NaN or inf (it sets no figure beside another
    machine's and judges no claim), a name the ledger reads that is not text, or a figure its
    claim's range cannot be read against (`_against_claim`)."""
    if r["label"] not in rec.LABELS:
        return f"label {r['label']!r} is none of the lab's: {', '.join(map(repr, rec.LABELS))}"
    if not isinstance(r.get("hostname", ""), str | type(None)):
        return f"hostname is {rec.json_type(r['hostname'])}, not a string"
    for key in _CONFIG_TEXT:  # the ledger groups and looks records up by these
        if not isinstance(r["config"].get(key, ""), str | type(None)):
            return f"config.{key} is {rec.json_type(r['config'][key])}, not a string"
    claim = r["config"].get("claim")
    if claim is not None and claim not in BY_ID:
        return f"claim {claim!r} is none of the ledger's: {', '.join(BY_ID)}"
    v = r["value"]
    if isinstance(v, float) and not math.isfinite(v):
        return f"value is {v}, not a finite number: fix or remove the line to compare the folder"
    return _against_claim(r) if claim is not None else None


# config keys the ledger and compare read as names (a list or a number there is a damaged line)
_CONFIG_TEXT = ("claim", "metric", "role", "size", "bound", "target", "on", "series")


_SIGNED_UNITS = ("exponent",)  # the stated units a figure may be negative in (a fitted slope)


def _against_claim(r: dict) -> str | None:
    """Why a record of a stated part cannot be judged against it: another unit than the
    claim's range (its figure would be read in the range's unit), or a negative value in a
    unit that has none (a count, a time, a ratio: its distance from the range is no figure)."""
    v = r["value"]
    for s in BY_ID[r["config"]["claim"]].stated:
        if s.metric != r["config"].get("metric") or r["unit"] == "reason":
            continue
        if r["unit"] != s.unit:
            return (
                f"unit {r['unit']!r}, but {s.metric} of {r['config']['claim']} is in {s.unit!r}: "
                "a record of another figure?"
            )
        signed = s.unit in _SIGNED_UNITS or any(b is not None and b < 0 for b in (s.lo, s.hi))
        if isinstance(v, int | float) and v < 0 and not signed:
            return f"value {v} is negative, where {s.metric} ({s.unit}) cannot be"
    return None


def _ledger_record(r: dict) -> str | None:
    """Why compare refuses a record: not finite, or not the ledger's (every record
    python -m experiments writes names its claim, or None)."""
    if "claim" not in r["config"]:
        writer = r.get("command")
        if writer == "experiments":  # the ledger names the claim of every record it writes
            return "a record of python -m experiments that names no claim: edited or damaged?"
        whose = f"{writer}'s" if isinstance(writer, str) else "a lab tool's?"
        return f"a record that names no claim: not python -m experiments' ({whose})"
    return _finite(r)


def _run_json(folder: Path) -> dict | None:
    """What the folder's run.json says (size, only, each topic's wall time and error); None
    where there is none (load refuses that once it knows the folder is a ledger's).

    Refused (ValueError, one line naming the file): not a regular file (a FIFO would
    hang the read), not JSON, not an object, a field of the wrong type. The records carry no
    size: without run.json a tiny run's verdicts would pass as a real run's, and a run of
    `only=` would be judged on claims it did not select."""
    path = folder / "run.json"
    if not path.exists() and not path.is_symlink():
        return None
    if not path.is_file():
        raise _bad(path, "not a regular file")
    try:
        run = json.loads(path.read_bytes())
    except OSError as e:
        raise _bad(path, f"cannot be read ({e.strerror or e})") from None
    except ValueError as e:
        raise _bad(path, f"not JSON ({e})") from None
    if "merged" in (run if isinstance(run, dict) else {}):
        return run  # a comparison's: load() says so
    if not isinstance(run, dict):
        raise _bad(path, f"not a JSON object ({_json_kind(run)})")
    if run.get("size") not in SIZES:
        got = "no size" if "size" not in run else f"size is {json.dumps(run['size'])}"
        raise _bad(path, f"{got}, not one of {', '.join(SIZES)}")
    only = run.get("only")
    if only is not None and not (
        isinstance(only, list) and only and all(isinstance(i, str) and i in BY_ID for i in only)
    ):
        raise _bad(
            path,
            f"only is {json.dumps(only)}, not null or a list of claim ids ({', '.join(BY_ID)})",
        )
    modules = run.get("modules")
    if modules is not None and not (
        isinstance(modules, dict) and all(isinstance(m, dict) for m in modules.values())
    ):
        raise _bad(path, "modules is not an object of topics, each an object")
    return run


def _bad(path: Path, why: str) -> ValueError:
    return ValueError(f"{path}: {why}")


def _json_kind(x) -> str:
    return {list: "a list", str: "a string", bool: "true/false"}.get(
        type(x), "null" if x is None else "a number"
    )


def load(folder) -> dict:
    """One results folder: its records, what its run.json says it ran (size, the claims it
    selected, each topic's error) and a column name (backend · device kind · size).

    Refused (ValueError, one line): a folder of another command's records (lab.run's, a lab
    tool's), a comparison (its records are its inputs': give those), a value that is not a
    finite number."""
    folder = Path(folder)
    path = folder / "records.jsonl"
    if not folder.is_dir():
        raise ValueError(f"{folder}: {'not a folder' if folder.exists() else 'no such folder'}")
    if (folder / "metrics.jsonl").is_file() and (folder / "config.json").is_file():
        raise ValueError(
            f"{folder}: a lab.run folder (one run's records); compare takes the folders "
            "python -m experiments writes (results/<name>/)"
        )
    run = _run_json(folder)
    if run is not None and "merged" in run:
        merged = ", ".join(str(d) for d in run["merged"]) if isinstance(run["merged"], list) else ""
        raise ValueError(
            f"{folder}: a comparison (its records are its inputs'): give the folders it merged"
            + (f" ({merged})" if merged else "")
        )
    if not path.is_file():
        raise ValueError(f"{folder}: no records.jsonl (not a python -m experiments folder)")
    records = rec.read_records(path, check=_finite)
    if not records:
        raise ValueError(f"{path}: empty")
    if not any("claim" in r["config"] for r in records):
        n = len(records)
        which = (
            f"none of its {n} records names a claim" if n > 1 else "its one record names no claim"
        )
        writer = next((r["command"] for r in records if isinstance(r.get("command"), str)), None)
        whose = f"{writer}'s records" if writer else "a lab tool's records (python -m lab.tools.…)"
        raise ValueError(
            f"{path}: {which}: {whose}, not python -m experiments'; compare takes the "
            "folders python -m experiments writes"
        )
    if not all("claim" in r["config"] for r in records):
        rec.read_records(path, check=_ledger_record)  # raises, naming the first such line
    if any("machine" in r for r in records):
        raise ValueError(
            f"{path}: a comparison's records (each names its column): give the folders it merged"
        )
    if run is None:
        raise ValueError(
            f"{folder / 'run.json'}: missing (the ledger writes it with REPORT.md: a run stopped "
            "before its report?); the records do not say the run's size or the claims it "
            'selected: write {"size": "tiny|quick|full", "only": null} there as the run was '
            "asked for, to compare them"
        )
    size, only, modules = run["size"], run.get("only"), run.get("modules")
    stamped = {r["config"].get("size") for r in records} - {None}  # records since they say it
    if stamped - {size}:
        raise ValueError(
            f"{folder / 'run.json'}: size {size}, but its records were measured at size "
            f"{', '.join(sorted(map(str, stamped)))}: a run.json of another run?"
        )
    machines = sorted({f"{r['backend']} · {r['device_kind']}" for r in records})
    if len(machines) > 1:  # its column would be named after the first record's alone
        raise ValueError(
            f"{path}: records of {len(machines)} machines ({'; '.join(machines)}): one ledger "
            "run is one machine; give each machine's run folder to compare"
        )
    name = f"{machines[0]} · {size}"
    return {
        "dir": folder,
        "records": records,
        "name": name,
        "size": size,
        "only": only,
        "modules": modules,
    }


def _host(f: dict) -> str | None:
    """The host every record of the folder names, None where they name none or several."""
    hosts = {r.get("hostname") for r in f["records"]}
    return hosts.pop() if len(hosts) == 1 and None not in hosts else None


def _tails(f: dict) -> list:
    """What tells two folders of one machine apart, tried in turn: the host their records
    name, then their paths' last 1, 2, … parts (run, hostA/run, …) up to the whole path."""
    parts = Path(f["dir"]).resolve().parts
    return [_host(f)] + ["/".join(parts[-k:]) for k in range(1, len(parts) + 1)]


def name_columns(folders: list[dict]) -> None:
    """Give each folder a column name of its own (f["name"]): folders of one backend, device
    and size add the first of `_tails` that differs between them, and the names are checked
    again (a name made so may meet another folder's); a number where nothing tells them
    apart. The plots draw a series per name and the report tags every figure with it: two
    folders under one name would be drawn and judged as one machine."""
    for _ in range(len(folders)):
        names = [f["name"] for f in folders]
        clashes = {n for n in names if names.count(n) > 1}
        if not clashes:
            return
        for name in clashes:
            group = [f for f in folders if f["name"] == name]
            tails = [_tails(f) for f in group]
            for k in range(max(len(t) for t in tails)):
                tags = [t[k] if k < len(t) else None for t in tails]
                if None not in tags and len(set(tags)) == len(tags):
                    break
            else:
                tags = [f"#{i}" for i in range(1, len(group) + 1)]
            for f, tag in zip(group, tags, strict=True):
                f["name"] = f"{name} · {tag}"
    names = [f["name"] for f in folders]
    for i, f in enumerate(folders):  # still clashing after every pass: numbered
        if names.count(f["name"]) > 1:
            f["name"] += f" · #{i + 1}"


def _fingerprint(r: dict) -> str:
    return json.dumps(r, sort_keys=True, default=str)


def refuse_repeats(folders: list[dict]) -> None:
    """A ValueError naming both folders where one holds another's records (a copy of one
    run, a comparison's input given beside it): merged, they would be counted twice, as two
    machines that agree. A timed figure never repeats by chance; a computed one (a datasheet
    ratio, a FLOP count) can, in two runs on one host in one second, so those alone refuse
    only where every record of one folder is the other's."""
    seen = {}
    for f in folders:
        mine = {_fingerprint(r): r for r in f["records"]}
        for other, theirs in seen.items():
            same = mine.keys() & theirs.keys()
            timed = any(mine[k].get("label") == "measured" for k in same)
            if timed or (same and len(same) == min(len(mine), len(theirs))):
                raise ValueError(
                    f"{other} and {f['dir']} hold the same records ({len(same)} of the "
                    f"{len(mine)} in {f['dir']}; a copy of one run?): each run's records are "
                    "merged once"
                )
        seen[f["dir"]] = mine


def _step(r: dict) -> tuple:
    """What a training-throughput record timed: (params, batch, seq_len)."""
    c = r["config"]
    return c.get("params"), c.get("batch"), c.get("seq_len")


def _same_step(a: dict, b: dict) -> bool:
    """Two folders' tokens/s compare only for the same step (model, batch, length): folders
    run at different sizes time different steps."""
    return _step(a) == _step(b)


def _find(records, match) -> dict | None:
    hits = [r for r in records if isinstance(r.get("value"), int | float) and match(r["config"])]
    return max(hits, key=lambda r: r["value"]) if hits else None


def _kind(folder: dict) -> str:
    """The folder's hardware as a slug (gpu-nvidia-h100-80gb-hbm3), read from its records:
    what the pair ratios match on (the column name may carry a folder's name as well)."""
    r = folder["records"][0]
    return markdown.slug(f"{r['backend']} {r['device_kind']}")


def _pair_record(claim, metric, what, num: dict, den: dict, **config) -> dict:
    value = num["value"] / den["value"]
    r = rec.make_record(
        what,
        value,
        "×",
        label="derived",
        claim=claim,
        metric=metric,
        role="evidence",
        inputs={"numerator": num["value"], "denominator": den["value"]},
        **config,
    )
    # the two machines the figures came from, not the one that merged them
    r.update(
        backend="multi",
        device_kind=f"{_machine(num)} over {_machine(den)}",
        device_count=2,
    )
    return r


def _machine(r: dict) -> str:
    return f"{r['device_kind']} × {r['device_count']}"


def derived(folders: list[dict]) -> list[dict]:
    """Figures only a merge can give: ratios between folders of different hardware, named by
    the folders' columns; a ratio for a claim only from folders whose run selected it."""
    out = []
    train = [(f, _find(f["records"], _train)) for f in folders]
    train = [(f, r) for f, r in train if r]
    bf16 = [(f, _find(f["records"], _bf16)) for f in folders]
    bf16 = [(f, r) for f, r in bf16 if r]

    def first(pairs, test, claim, like=None):
        """The first folder that selected `claim`, of the kind `test` accepts (and timed the
        step `like` did): one at size quick or full before a tiny one."""
        hits = [
            (f, r)
            for f, r in pairs
            if picks(f, claim) and test(_kind(f)) and (like is None or _same_step(r, like))
        ]
        hits.sort(key=lambda hit: hit[0].get("size") == "tiny")  # stable: the given order
        return hits[0] if hits else (None, None)

    def tiny_aside(claim, *pair) -> bool:
        """A ratio with a tiny folder in it, where a folder at a real size holds records of
        the claim: set aside, as `judged` sets the tiny folders' own records aside."""
        if all(f.get("size") != "tiny" for f in pair):
            return False
        return any(
            f.get("size") != "tiny"
            and picks(f, claim)
            and any(r["config"].get("claim") == claim for r in f["records"])
            for f in folders
        )

    tpu, tpu_r = first(train, lambda k: k.startswith("tpu"), "C19")
    h100, h100_r = first(train, lambda k: "h100" in k, "C19", like=tpu_r)
    if tpu and h100 and _same_step(tpu_r, h100_r) and not tiny_aside("C19", tpu, h100):
        out.append(
            _pair_record(
                "C19",
                "tpu_over_h100",
                f"training tokens/s per chip, {tpu['name']} over {h100['name']}",
                tpu_r,
                h100_r,
                on="multi",
            )
        )
    mi, mi_r = first(bf16, lambda k: "mi300" in k, "C19")
    h100_mm, h100_mm_r = first(bf16, lambda k: "h100" in k, "C19")
    if mi and h100_mm and not tiny_aside("C19", mi, h100_mm):
        out.append(
            _pair_record(
                "C19",
                "mi300x_over_h100",
                f"bf16 matmul FLOP/s, {mi['name']} over {h100_mm['name']}",
                mi_r,
                h100_mm_r,
                on="multi",
            )
        )
    for f, r in train:
        if not picks(f, "C02") or _kind(f).startswith("cpu"):
            continue
        cpu, cpu_r = first(train, lambda k: k.startswith("cpu"), "C02", like=r)
        if cpu and not tiny_aside("C02", f, cpu):
            out.append(
                _pair_record(
                    "C02",
                    "gpu_cpu_train_speedup",
                    f"training tokens/s, {f['name']} over {cpu['name']} (two machines)",
                    r,
                    cpu_r,
                    on=r["backend"],
                    target=r["device_kind"],
                )
            )
    return out


def side_by_side(folders: list[dict]) -> list[str]:
    """The articles' GPU vs TPU vs CPU table, with this lab's measured numbers: the figures
    some folder holds (a row of dashes says nothing), or one line where none does."""
    head = "| figure | " + " | ".join(f["name"] for f in folders) + " |"
    rows = [head, "|---" * (len(folders) + 1) + "|"]
    for row in FIGURES:
        if all(_find(f["records"], row.match) is None for f in folders):
            continue
        cells = []
        for f in folders:
            r = _find(f["records"], row.match)
            if r is None:
                cells.append("—")
                continue
            value, unit, label = row.value(r)
            cells.append(
                " ".join(filter(None, (markdown.fmt(value, unit), f"*{label}*", row.note(r))))
            )
        rows.append(f"| {row.name} | " + " | ".join(cells) + " |")
    if len(rows) == 2:
        return ["None of these folders holds a figure of this table (their claims measure others)."]
    return rows


def unmatched_steps(folders: list[dict]) -> list[str]:
    """A line for each pair of folders whose training steps differ (no cross-machine ratio)."""
    train = [(f, _find(f["records"], _train)) for f in folders]
    train = [(f, r) for f, r in train if r]
    lines = []
    for (fa, a), (fb, b) in itertools.combinations(train, 2):
        if not _same_step(a, b):
            lines.append(
                f"- No ratio of training tokens/s between {fa['name']} and {fb['name']}: they "
                f"timed different steps (batch × length {_step(a)[1]} × {_step(a)[2]} against "
                f"{_step(b)[1]} × {_step(b)[2]}); run both at one size."
            )
    return lines


def picks(f: dict, claim) -> bool:
    """Whether folder f's run selected `claim` (run.json's `only`; every claim where it
    selected all): a folder's records judge only the claims its run selected."""
    return f.get("only") is None or claim in f["only"]


def judged(folders: list[dict]) -> tuple[list[dict], set]:
    """The folders' records as the merged verdicts judge them, and the claims only tiny
    folders decide though another folder ran at a real size.

    A claim is judged from the folders that selected it (an only=C03 run's attention topic
    records C05 too: its own report leaves C05 out, and so does the merge). Where one of them
    ran at size quick or full and has records of the claim, the tiny folders' records of it
    are set aside: size=tiny checks that the studies run, its figures do not judge claims. A
    record set aside names no claim here (records.jsonl keeps it whole) and says `set_aside`:
    it judges nothing, so the host-busy caution does not count it, and it is still plotted
    and counted where the report lists what each machine ran."""
    holding = {}  # claim → the folders that selected it and hold records of it
    for f in folders:
        for claim in {r["config"].get("claim") for r in f["records"]}:
            if claim is not None and picks(f, claim):
                holding.setdefault(claim, []).append(f)
    real = {c for c, fs in holding.items() if any(f.get("size") != "tiny" for f in fs)}

    def judges(f, claim) -> bool:
        return picks(f, claim) and (f.get("size") != "tiny" or claim not in real)

    out = [
        r
        if (c := r["config"].get("claim")) is None or judges(f, c)
        else {**r, "config": {**r["config"], "claim": None}, "set_aside": True}
        for f in folders
        for r in f["records"]
    ]
    mixed = any(f.get("size") != "tiny" for f in folders)
    return out, (set(holding) - real if mixed else set())


def _selected(folders: list[dict]) -> tuple | None:
    """The claims the comparison judges: those some folder selected (its run.json's `only`),
    every claim where a folder selected all (or does not say)."""
    if any(f.get("only") is None for f in folders):
        return None
    ids = {i for f in folders for i in f["only"]}
    return tuple(c.id for c in CLAIMS if c.id in ids)


def _cell(f: dict, claim, status: str) -> str:
    """A folder's verdict on a claim, as its own REPORT.md judges it: a claim it did not
    select, a topic it never reached, a topic that failed or was cut short say so instead of
    a bare "no record"."""
    only = f.get("only")
    if only is not None and claim.id not in only:
        return f"not selected (only={','.join(map(str, only))})"
    return markdown.topic_status({"modules": f.get("modules")}, claim, status)


def verdict_grid(folders: list[dict], merged_verdicts, tiny_only=frozenset()) -> list[str]:
    claims = [v.claim for v in merged_verdicts]
    per = [{v.claim.id: v.status for v in judge_all(f["records"], claims)} for f in folders]
    head = "| id | " + " | ".join(f["name"] for f in folders) + " | merged |"
    rows = [head, "|---" * (len(folders) + 2) + "|"]
    for v in merged_verdicts:
        cells = [_cell(f, v.claim, p[v.claim.id]) for f, p in zip(folders, per, strict=True)]
        tiny = " (size tiny only)" if v.claim.id in tiny_only else ""
        left = unjudged_parts(v)  # holds on the parts judged anywhere: the rest said
        part = f" ({left})" if left else ""
        rows.append(f"| {v.claim.id} | " + " | ".join(cells) + f" | **{v.status}**{part}{tiny} |")
    return rows


GRID_NOTE = (
    "A folder's column judges the claims its run selected (`only=`), as its own REPORT.md "
    "does, and says where a topic was not run, failed or was cut short; *merged* judges "
    "each claim from the records of the folders that selected it, leaving out a tiny-size "
    "folder's where a folder at size quick or full has records of the claim (size tiny checks "
    "that the studies run, not the claims), and says *size tiny only* where tiny folders alone "
    "decide it."
)


def merge(dirs, out_root="results") -> dict:
    """Merge result folders into out_root/compare-<timestamp>/ (records.jsonl, REPORT.md)."""
    folders = [load(d) for d in dirs]
    refuse_repeats(folders)
    name_columns(folders)
    for f in folders:  # each record names its column: the plots and the verdicts say whose it is
        f["records"] = [{**r, "machine": f["name"]} for r in f["records"]]
    pairs = derived(folders)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = rec.fresh_dir(out_root, f"compare-{stamp}")
    try:
        return _write(out, folders, pairs, dirs)
    except BaseException:  # a half-written comparison is nobody's result: not left behind
        shutil.rmtree(out, ignore_errors=True)
        raise


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' * (n != 1)}"


def _write(out, folders, pairs, dirs) -> dict:
    records = [r for f in folders for r in f["records"]] + pairs
    rec.write_records(out / "records.jsonl", records)  # every record whole, judged or not
    tiny = [str(Path(f["dir"]).absolute()) for f in folders if f.get("size") == "tiny"]
    # absolute (as `tiny`): a refusal of this comparison as input names folders that exist
    # from anywhere
    shown, tiny_only = judged(folders)
    meta = {"merged": [str(Path(d).absolute()) for d in dirs], "tiny": tiny}
    meta["tiny_only"] = sorted(tiny_only)  # REPORT.md's verdict table says so, as the grid
    only = _selected(folders)
    report = markdown.write_report(out, records=shown + pairs, meta=meta, only=only)
    text = report["path"].read_text()
    intro = [
        "# Across backends",
        "",
        *[f"- `{f['dir']}`: {f['name']}, {_count(len(f['records']), 'record')}" for f in folders],
        "",
        "## Side by side (measured unless labelled)",
        "",
        *side_by_side(folders),
        "",
        *unmatched_steps(folders),
        "",
        "## Verdicts per machine and merged",
        "",
        *verdict_grid(folders, report["verdicts"], tiny_only),
        "",
        GRID_NOTE,
        "",
    ]
    report["path"].write_text("\n".join(intro) + "\n" + text)
    judging = [r for r in shown if not r.get("set_aside")] + pairs
    return {
        **report,
        "records": records,
        "judged": judging,
        "dir": out,
        "folders": folders,
        "tiny_only": frozenset(tiny_only),
    }


def run(o: Options) -> int:
    if len(o.dirs) < 1:
        raise ConfigError("dirs=: give the results folders to merge, e.g. dirs=results/cpu-…")
    seen = {}
    for d in o.dirs:
        key = Path(d).resolve()
        if key in seen:
            same = "is given twice" if d == seen[key] else f"is the same folder as {seen[key]}"
            raise ConfigError(f"{d} {same} in dirs=: each folder is merged once")
        seen[key] = d
    try:
        result = merge(o.dirs, o.out_dir)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    tiny = [f["name"] for f in result["folders"] if f.get("size") == "tiny"]
    caution = (
        f"{', '.join(tiny)}: size=tiny checks that every study runs; the verdicts its records "
        "decide do not judge the claims"
        if tiny
        else ""
    )
    # as REPORT.md and python -m experiments: over the records that judge (none set aside)
    busy = markdown.busy_caution(result["judged"])
    caution = "; ".join(c for c in (caution, busy and f"host busy: {busy}") if c)
    # as REPORT.md's grid: a claim only tiny folders decide says so; all tiny judges nothing
    all_tiny = len(tiny) == len(result["folders"])
    table = tables.verdicts(
        result["verdicts"], caution, judged=not all_tiny, tiny_only=result["tiny_only"]
    )
    progress.console().print(table)
    n = len(o.dirs)
    print(
        f"{_count(len(result['records']), 'record')} from {_count(n, 'folder')} → {result['path']}"
    )
    return 0


def main(argv=None) -> int:
    return cli(Options, run, prog="python -m experiments.compare", doc=__doc__, argv=argv)


if __name__ == "__main__":
    from lab.report.progress import survive_lost_output

    survive_lost_output()  # a reader gone (| head) loses no records or report
    sys.exit(main())

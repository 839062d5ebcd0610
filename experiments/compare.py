"""`python -m experiments.compare dirs=DIR,DIR,...`: several backends side by side.

Each DIR is a folder `python -m experiments` wrote (CPU here, a GPU VM, a TPU VM). The
records are merged into one list, figures that need two backends at once are derived from
them (labelled `derived`, backend `multi` where the claim is about a pair: C19's TPU/H100 and
MI300X/H100 ratios; C02's accelerator-over-CPU training speedup on the accelerator's
backend), and one report sets the articles' "GPU vs TPU vs CPU" figures beside each other:
the measured numbers per folder, then every claim's verdict per folder and merged. Each
merged record carries `machine`, its folder's column name (a merge's own records keep the
one they had): the plots draw a series or a panel per machine and the verdict table names
the machine of every value it shows.
"""

import dataclasses
import datetime
import itertools
import json
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from lab.config import cli, field
from lab.errors import ConfigError
from lab.measure import records as rec
from lab.report import markdown, progress, tables
from lab.report.verdict import judge_all


@dataclasses.dataclass(frozen=True)
class Options:
    dirs: tuple = field(
        (), "results folders of python -m experiments, comma-separated", kind="names"
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
        value=lambda r: (r["config"]["copy_bytes_per_s"], "B/s", r["label"]),
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


def load(folder) -> dict:
    """One results folder: its records and a column name (backend · device kind)."""
    folder = Path(folder)
    path = folder / "records.jsonl"
    if not folder.is_dir():
        raise ValueError(f"{folder}: {'not a folder' if folder.exists() else 'no such folder'}")
    if (folder / "metrics.jsonl").is_file() and (folder / "config.json").is_file():
        raise ValueError(
            f"{folder}: a lab.run folder (one run's records); compare takes the folders "
            "python -m experiments writes (results/<name>/)"
        )
    if not path.is_file():
        raise ValueError(f"{folder}: no records.jsonl (not a python -m experiments folder)")
    records = rec.read_records(path)
    if not records:
        raise ValueError(f"{path}: empty")
    r = records[0]
    name = f"{r['backend']} · {r['device_kind']}"
    try:  # the size the folder was run at, where its run.json says (a merge's has none)
        size = json.loads((folder / "run.json").read_text()).get("size")
    except (OSError, ValueError):
        size = None
    name += f" · {size}" if size else ""
    return {"dir": folder, "records": records, "name": name, "size": size}


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
    return markdown.slug(folder["name"])


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
    """Figures only a merge can give: ratios between folders of different hardware."""
    out = []
    train = {_kind(f): _find(f["records"], _train) for f in folders}
    bf16 = {_kind(f): _find(f["records"], _bf16) for f in folders}
    tpu = next((k for k in train if k.startswith("tpu") and train[k]), None)
    h100 = next((k for k in train if "h100" in k and train[k]), None)
    cpu = next((k for k in train if k.startswith("cpu") and train[k]), None)
    if tpu and h100 and _same_step(train[tpu], train[h100]):
        out.append(
            _pair_record(
                "C19",
                "tpu_over_h100",
                f"training tokens/s per chip, {tpu} over {h100}",
                train[tpu],
                train[h100],
                on="multi",
            )
        )
    mi = next((k for k in bf16 if "mi300" in k and bf16[k]), None)
    h100_mm = next((k for k in bf16 if "h100" in k and bf16[k]), None)
    if mi and h100_mm:
        out.append(
            _pair_record(
                "C19",
                "mi300x_over_h100",
                f"bf16 matmul FLOP/s, {mi} over {h100_mm}",
                bf16[mi],
                bf16[h100_mm],
                on="multi",
            )
        )
    for k, r in train.items():
        if cpu and r and not k.startswith("cpu") and _same_step(r, train[cpu]):
            out.append(
                _pair_record(
                    "C02",
                    "gpu_cpu_train_speedup",
                    f"training tokens/s, {k} over {cpu} (two machines)",
                    r,
                    train[cpu],
                    on=r["backend"],
                    target=r["device_kind"],
                )
            )
    return out


def side_by_side(folders: list[dict]) -> list[str]:
    """The articles' GPU vs TPU vs CPU table, with this lab's measured numbers."""
    head = "| figure | " + " | ".join(f["name"] for f in folders) + " |"
    rows = [head, "|---" * (len(folders) + 1) + "|"]
    for row in FIGURES:
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


def verdict_grid(folders: list[dict], merged_verdicts) -> list[str]:
    per = [{v.claim.id: v.status for v in judge_all(f["records"])} for f in folders]
    head = "| id | " + " | ".join(f["name"] for f in folders) + " | merged |"
    rows = [head, "|---" * (len(folders) + 2) + "|"]
    for v in merged_verdicts:
        cells = [p[v.claim.id] for p in per]
        rows.append(f"| {v.claim.id} | " + " | ".join(cells) + f" | **{v.status}** |")
    return rows


def merge(dirs, out_root="results") -> dict:
    """Merge result folders into out_root/compare-<timestamp>/ (records.jsonl, REPORT.md)."""
    folders = [load(d) for d in dirs]
    names = [f["name"] for f in folders]
    for f in folders:  # two folders of one machine and size: their columns say which is which
        if names.count(f["name"]) > 1:
            f["name"] += f" · {f['dir'].name}"
    for f in folders:  # each record names its column: the plots and the verdicts say whose it is
        f["records"] = [{**r, "machine": r.get("machine") or f["name"]} for r in f["records"]]
    records = [r for f in folders for r in f["records"]]
    records += derived(folders)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = rec.fresh_dir(out_root, f"compare-{stamp}")
    try:
        return _write(out, folders, records, dirs)
    except BaseException:  # a half-written comparison is nobody's result: not left behind
        shutil.rmtree(out, ignore_errors=True)
        raise


def _write(out, folders, records, dirs) -> dict:
    rec.write_records(out / "records.jsonl", records)
    tiny = [str(f["dir"]) for f in folders if f.get("size") == "tiny"]
    meta = {"merged": [str(d) for d in dirs], "tiny": tiny}
    report = markdown.write_report(out, records=records, meta=meta)
    text = report["path"].read_text()
    intro = [
        "# Across backends",
        "",
        *[f"- `{f['dir']}`: {f['name']}, {len(f['records'])} records" for f in folders],
        "",
        "## Side by side (measured unless labelled)",
        "",
        *side_by_side(folders),
        "",
        *unmatched_steps(folders),
        "",
        "## Verdicts per machine and merged",
        "",
        *verdict_grid(folders, report["verdicts"]),
        "",
    ]
    report["path"].write_text("\n".join(intro) + "\n" + text)
    return {**report, "dir": out, "folders": folders}


def run(o: Options) -> int:
    if len(o.dirs) < 1:
        raise ConfigError("dirs=: give the results folders to merge, e.g. dirs=results/cpu-…")
    seen = {}
    for d in o.dirs:
        key = Path(d).resolve()
        if key in seen:
            same = "is given twice" if d == seen[key] else f"is the same folder as {seen[key]}"
            raise ConfigError(f"dirs=: {d} {same}: each folder is merged once")
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
    progress.console().print(tables.verdicts(result["verdicts"], caution))
    n = len(o.dirs)
    print(f"{len(result['records'])} records from {n} folder{'s' * (n != 1)} → {result['path']}")
    return 0


def main(argv=None) -> int:
    return cli(Options, run, prog="python -m experiments.compare", doc=__doc__, argv=argv)


if __name__ == "__main__":
    from lab.report.progress import survive_lost_output

    survive_lost_output()  # a reader gone (| head) loses no records or report
    sys.exit(main())

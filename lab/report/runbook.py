"""The runbook's outcome as BENCHMARKS-ready Markdown: one row per step, read from its records.

A row: step, status (with the reason where it did not finish), seconds, the headline figures
its records hold, the lab's predicted figure for the same program where there is one, and the
record files it came from. Every figure is read from the records the step wrote (JSON lines)
or its summary files; nothing here measures anything.
"""

import json
import re
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from lab.measure.tuning import within_noise
from lab.report.format import NA, NOISE, OVERLAP, duration, fmt, ranges_overlap

PREDICTED_NOTE = (
    "*predicted*: the step-time model's figure for the same compiled program (the training "
    "step's, and each configuration of the prediction step; where a run has none, the step's "
    "time floor: its model FLOPs at the peak the run names); the other steps have no predicted "
    "figure for the same program yet, so their column is empty."
)


def _fmt(r: dict) -> str:
    if r["unit"] == "fraction":
        return f"{100 * r['value']:.1f}%"
    if r["unit"] == "relative":
        return f"{r['value']:.2g}"
    return fmt(r["value"], r["unit"])


def _what(records, what: str) -> list[dict]:
    return [r for r in records if r["what"] == what and isinstance(r["value"], int | float)]


def correctness(records: Sequence[dict], folder: Path) -> tuple[str, str]:
    """The largest error vs float64 of each impl (and why an impl did not run)."""
    errors: dict[str, float] = {}
    for r in _what(records, "attention max error"):
        impl = r["config"]["impl"]
        errors[impl] = max(errors.get(impl, 0.0), r["value"])
    parts = [f"{impl} max error {e:.2g}" for impl, e in sorted(errors.items())]
    skipped = {r["config"]["impl"]: r["value"] for r in records if r["what"] == "attention skipped"}
    parts += [f"{impl} did not run: {why}" for impl, why in sorted(skipped.items())]
    return "; ".join(parts), ""


def ceilings(records: Sequence[dict], folder: Path) -> tuple[str, str]:
    """Matmul FLOP/s per dtype (JAX's, not numpy's), copy bandwidth, the memory roof, ridge."""
    parts = [
        f"{r['what'].replace(' precision=default', '')} {_fmt(r)}"
        for r in records
        if r["what"].startswith("matmul ") and r["unit"] == "FLOP/s" and "numpy" not in r["what"]
    ]
    for what, name in (("copy bandwidth (read+write)", "copy"), ("memory roof", "memory roof")):
        parts += [f"{name} {_fmt(r)}" for r in _what(records, what)]
    parts += [f"ridge {_fmt(r)}" for r in records if r["what"].startswith("ridge point")]
    return "; ".join(parts), ""


def targets(records: Sequence[dict], folder: Path) -> tuple[str, str]:
    """The 'N of M points meet their target' line of the Markdown the targets wrote."""
    for md in sorted(folder.glob("*.md")):
        m = re.search(r"\*\*(\d+ of \d+ points meet their target)\.\*\*", md.read_text())
        if m:
            return m.group(1), ""
    return "", ""


def attention(records: Sequence[dict], folder: Path) -> tuple[str, str]:
    """Each impl's best TFLOP/s and where it was reached."""
    best: dict[str, dict] = {}
    for r in _what(records, "attention TFLOP/s"):
        impl = r["config"]["impl"]
        if impl not in best or r["value"] > best[impl]["value"]:
            best[impl] = r
    parts = []
    for impl, r in sorted(best.items(), key=lambda kv: -kv[1]["value"]):
        c = r["config"]
        where = f"L={c['seq']}{' causal' if c.get('causal') else ''} {c['mode']}"
        parts.append(f"{impl} {r['value']:.3g} TFLOP/s ({where})")
    return "; ".join(parts), ""


def tune_step(records: Sequence[dict], folder: Path) -> tuple[str, str]:
    rows = _what(records, "training tokens/s")
    if not rows:
        return "", ""
    best = max(rows, key=lambda r: r["value"])
    c = best["config"]
    text = f"best remat={c['remat']} batch {c['batch']}: {_fmt(best)}"
    names = [f"remat={t['remat']} batch {t['batch']}" for t in _as_good(records, rows, best)]
    if len(names) == 1:  # the medians' order alone named the best: every one as good is named
        text += f" ({NOISE}: {names[0]} is as good)"
    elif names:
        text += f" ({NOISE}: {len(names)} others are as good: {', '.join(names)})"
    return text, ""


def _as_good(records: Sequence[dict], rows: list[dict], best: dict) -> list[dict]:
    """The remat and batch of every candidate within the run's noise of the best, highest
    tokens/s first: as tune_step's `tune_step best tokens/s` record names them (its
    `within_noise_of`); recomputed from the candidates' spans only for records written
    before that record carried them."""
    c = best["config"]
    for r in reversed(_what(records, "tune_step best tokens/s")):
        rc = r["config"]
        if (rc.get("remat"), rc.get("batch")) == (c["remat"], c["batch"]):
            if isinstance(rc.get("within_noise_of"), list):
                return rc["within_noise_of"]
            break
    top = next(i for i, r in enumerate(rows) if r is best)
    tied = [rows[i] for i in within_noise([_tokens_span(r) for r in rows], top)]
    tied.sort(key=lambda r: r["value"], reverse=True)
    return [dict(remat=r["config"]["remat"], batch=r["config"]["batch"]) for r in tied]


def _tokens_span(r: dict) -> tuple[float, float] | None:
    """A tune_step record's p10–p90 range in tokens/s (its slowest steps give the low end)."""
    c = r["config"]
    if not (c.get("step_s") and c.get("p10_s") and c.get("p90_s")):
        return None
    tokens = r["value"] * c["step_s"]  # per step
    return tokens / c["p90_s"], tokens / c["p10_s"]


def train(records: Sequence[dict], folder: Path) -> tuple[str, str]:
    """Step time, tokens/s and MFU; predicted: the step-time model's figure for the same
    compiled step where the run has one, else the time floor (model FLOPs at the peak)."""
    picked = _what(records, "training step time") + _what(records, "training tokens/s")
    picked += _what(records, "training MFU")
    names = {"training tokens/s": ""}  # the unit says it
    measured = "; ".join(
        f"{names.get(r['what'], r['what'].removeprefix('training ') + ' ')}{_fmt(r)}"
        for r in picked
    )
    predicted = ""
    for path in sorted(folder.rglob("summary.json")):
        s = json.loads(path.read_text())
        model = s.get("predicted_step_time")
        if model and model.get("seconds"):  # the step-time model of the same compiled program
            predicted = (
                f"step {duration(model['seconds'])} "
                f"({_against_measured(model['ratio_to_measured'])}; step-time model)"
            )
        elif s.get("mfu") and s.get("step_time"):
            floor = s["step_time"]["median_s"] * s["mfu"]  # FLOPs per step / peak
            source = s["peak_source"].split(";")[0]  # not the busy-host note: it is the run's
            predicted = f"step ≥ {duration(floor)} (model FLOPs at the {source})"
    return measured, predicted


def bench_step(records: Sequence[dict], folder: Path) -> tuple[str, str]:
    """The bare and lab steps' median times and the lab's ratio, from bench_step's records
    (a folder written before it wrote records: its table's rows, read from its log)."""
    times = {r["config"].get("step"): r for r in _what(records, "bench_step step time")}
    ratio = _what(records, "bench_step time ratio vs bare")
    if {"bare", "lab"} <= set(times) and ratio:
        bare, lab = times["bare"], times["lab"]
        runs = [r["config"].get("runs") for r in (bare, lab)]
        each = f" ({runs[0]} runs each)" if runs[0] and runs[0] == runs[1] else ""
        text = f"bare {_fmt(bare)}, lab {_fmt(lab)}{each}: ratio {ratio[0]['value']:.3f} (medians)"
        spread = [(r["config"].get("p10_s"), r["config"].get("p90_s")) for r in (bare, lab)]
        if all(lo and hi for lo, hi in spread) and ranges_overlap(spread):
            text += f"; {OVERLAP}"
        return text, ""
    log = folder / "output.log"
    cells = {}
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        row = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(row) == 6 and row[0] in ("bare", "lab"):
            cells[row[0]] = row
    if set(cells) != {"bare", "lab"}:
        return "", ""
    bare, lab = cells["bare"], cells["lab"]
    return f"bare {bare[1]}, lab {lab[1]}: ratio {lab[5]} (medians; from its log)", ""


def serve(records: Sequence[dict], folder: Path) -> tuple[str, str]:
    rows = [r for r in _what(records, "decode tokens/s, batch 1, float")]
    decode = [r for r in records if r["what"].startswith("decode tokens/s")]
    parts = [f"decode batch 1 {_fmt(r)}" for r in rows]
    if decode:
        top = max(decode, key=lambda r: r["value"])
        parts.append(f"best {top['what'].removeprefix('decode tokens/s, ')} {_fmt(top)}")
    parts += [f"memory roof {_fmt(r)}" for r in _what(records, "memory roof")]
    return "; ".join(parts), ""


def ledger(records: Sequence[dict], folder: Path) -> tuple[str, str]:
    """The verdicts' counts (run.json) and the report's path."""
    for path in sorted(folder.rglob("run.json")):
        verdicts = json.loads(path.read_text()).get("verdicts", {})
        counts: dict[str, int] = {}
        for status in verdicts.values():
            counts[status] = counts.get(status, 0) + 1
        text = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
        return f"{len(verdicts)} claims: {text} ({path.parent / 'REPORT.md'})", ""
    return "", ""


def prediction(records: Sequence[dict], folder: Path) -> tuple[str, str]:
    """The step times measured on the device, and the model's error on them (held out)."""
    rows = [r for r in _what(records, "step time, measured and predicted")]
    rows = [r for r in rows if r["config"].get("predicted_s")]
    if not rows:
        return "", ""
    errs = [abs(r["config"]["predicted_s"] / r["value"] - 1) for r in rows]
    worst = max(max(x, 1 / x) for x in (r["config"]["predicted_s"] / r["value"] for r in rows))
    measured = "; ".join(f"{r['config']['config']} {fmt(r['value'], 's')}" for r in rows[:3]) + (
        f"; {len(rows) - 3} more" if len(rows) > 3 else ""
    )
    median = statistics.median(errs)
    return measured, f"model error on {len(rows)} steps: median {median:.0%}, worst {worst:.2f}×"


HEADLINES: dict[str, Callable] = {
    "prediction": prediction,
    "correctness": correctness,
    "ceilings": ceilings,
    "targets": targets,
    "attention": attention,
    "tune-step": tune_step,
    "train": train,
    "bench-step": bench_step,
    "serve": serve,
    "ledger": ledger,
}


def headline(kind: str, records: Sequence[dict], folder: Path, log: str = "") -> tuple[str, str]:
    """(measured, predicted) for a step of `kind`; a step with no reader of its own, or whose
    records hold none of the figures looked for, shows its first few records or its log."""
    measured, predicted = HEADLINES.get(kind, lambda r, f: ("", ""))(records, folder)
    if not measured and records:
        measured = "; ".join(f"{r['what']} {_fmt(r)}" for r in records[:3])
    if not measured and log:
        measured = f"no records; see {log}"
    return measured, predicted


def _relative(path: str, root: Path | None) -> str:
    try:
        return str(Path(path).relative_to(root)) if root else path
    except ValueError:
        return path


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ") if text not in (None, "") else "–"


def rows(
    steps: Sequence, state: dict, gather: Callable[[str], list[dict]], root: Path | None = None
) -> list[dict]:
    """One dict per step: name, status, seconds, measured, predicted, records (file names,
    relative to `root` where they are under it)."""
    out = []
    for step in steps:
        entry = state["steps"].get(step.name, {})
        status = entry.get("status", "not started")
        if entry.get("reason"):
            status = f"{status}: {entry['reason']}"
        folder = Path(entry["folder"]) if entry.get("folder") else None
        records = gather(entry["folder"]) if folder else []
        measured, predicted = (
            headline(step.kind, records, folder, _relative(entry.get("log", ""), root))
            if folder
            else ("", "")
        )
        if measured and entry.get("tuned"):  # the remat × batch it ran at, and whence
            measured += f" (at {entry['tuned']})"
        files = sorted({_relative(r["_file"], root) for r in records})
        out.append(
            dict(
                step=step.name,
                status=status,
                seconds=entry.get("seconds"),
                measured=measured,
                predicted=predicted,
                records=files,
            )
        )
    return out


def markdown(table: Sequence[dict], platform: dict, command: str, date: str) -> str:
    """The block for BENCHMARKS.md: a heading with the machine, the table, the column's note.
    The heading names the machine the rows were measured on: rows of a rehearsal on another
    backend (size=tiny on CPU) are not the GPU runbook's, and must not read as if they were."""
    kind = platform.get("device_kind", "unknown")
    backend = platform.get("backend", "unknown")
    machine = f"{kind} × {platform.get('device_count', '?')}"
    title = (
        f"GPU runbook on {machine}"
        if backend == "gpu"
        else f"GPU runbook rehearsed on {machine} ({backend}, no GPU)"
    )
    lines = [
        f"### {title} — `{command}`",
        "",
        f"{date}, {machine} ({backend}), jax {platform.get('jax_version', NA)}.",
        "",
        "| step | status | seconds | measured | predicted | records |",
        "|---|---|---|---|---|---|",
    ]
    for r in table:
        seconds = f"{r['seconds']:.1f}" if r["seconds"] is not None else "–"
        files = ", ".join(f"`{f}`" for f in r["records"])
        cells = (r["step"], r["status"], seconds, r["measured"], r["predicted"], files)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join([*lines, "", PREDICTED_NOTE, ""])


def _against_measured(ratio: float) -> str:
    """'10% below measured' for a prediction 0.9× the measured step, '25% above measured'
    for 1.25×, 'as measured' within 0.5%."""
    off = ratio - 1
    if abs(off) < 0.005:
        return "as measured"
    return f"{abs(off):.0%} {'below' if off < 0 else 'above'} measured"

"""REPORT.md from a results folder's records: the verdict table, then one section per topic.

Everything printed is read from records.jsonl (numbers) and lab/report/claims.py (the
articles' words and ranges). A predicted figure always says so; an `off` verdict says by how
much and, where the claims file knows it, why the article is likely wrong.
"""

import datetime
import json
import re
from collections.abc import Sequence
from pathlib import Path

from lab.measure import records as rec
from lab.measure.attention import TargetVerdict
from lab.report import plots, tables
from lab.report.claims import BY_ID, CLAIMS, SOURCES, TOPICS
from lab.report.format import fmt, fmt_range, ratio
from lab.report.verdict import (
    MISSING,
    NA,
    OFF,
    PREDICTED,
    Verdict,
    backend_of,
    judge_all,
    outside,
    unjudged_parts,
)

CAVEAT = (
    "Times are medians after warm-up, blocked on every output; on a machine shared with other "
    "work they are noisy. Figures labelled *predicted* were not measured on the hardware they "
    "describe: they combine a number measured here with a spec-table entry, whose source each "
    "record names. Figures labelled *compiled* are read from a program compiled here (XLA's "
    "FLOP count or buffer assignment): exact for that program, not timed."
)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def results_dir(root, env: dict) -> Path:
    """results/<backend>-<device>-<timestamp>/, created, and this run's alone (-2, -3, …
    where another run started in the same second)."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return rec.fresh_dir(root, f"{env['backend']}-{slug(env['device_kind'])}-{stamp}")


def _tag(r: dict, machine: bool = True) -> str:
    """How a figure was obtained and where: `*measured*, cpu, cpu × 8`. In a comparison the
    column of the folder it came from leads (`machine`), unless `machine` is False (a
    reference figure every folder carries alike)."""
    column = f"{r['machine']}: " if machine and r.get("machine") else ""
    on = r["config"].get("on") or r["backend"]
    target = r["config"].get("target")
    devices = f"{r['device_kind']} × {r['device_count']}"
    if r["backend"] == "multi":  # a merge's ratio of two folders' figures
        where = f"two machines, {r['device_kind']}"
    elif target:
        where = f"for {target}"
    elif on == "cpu" and r["backend"] != "cpu":  # the host CPU in an accelerator's process
        where = f"{on}, the host of {devices}"
    else:
        where = f"{on}, {devices}"
    return f"{column}*{r['label']}*, {where}"


def _reading_text(x) -> str:
    unit = x.record["unit"]
    bound = x.record["config"].get("bound")
    kind = {"upper": ", an upper bound", "lower": ", a lower bound"}.get(bound, "")
    text = f"{fmt(x.record['value'], unit)} ({_tag(x.record)}{kind})"
    if not x.in_range:
        text += (
            f" — outside {fmt_range(x.lo, x.hi, unit, False)} by ×{x.factor:,.3g} ({x.direction})"
        )
    return text


def _whose(r: dict, merged: bool) -> str:
    """In a merge, the column a figure came from (`machine`, compare's), or "merged" for a
    ratio of two folders' figures; nothing in one folder's report."""
    if not merged:
        return ""
    return r.get("machine") or ("merged" if r.get("backend") == "multi" else "")


def measured_cell(v: Verdict, records: Sequence[dict]) -> str:
    """The table's 'measured' column: the deciding figures, else what was recorded. In a
    merge each value names its folder's column (`0.0686× step` alone did not say whose)."""
    merged = any("machine" in r for r in records)
    parts = []
    for c in v.checks:
        shown = {}  # the first two of each machine's (a third folder's were cut off)
        for x in c.readings:
            whose = _whose(x.record, merged)
            shown[whose] = shown.get(whose, 0) + 1
            if shown[whose] > 2:
                continue
            notes = ["pred."] if c.status == PREDICTED else []
            # a part stated per device (C16's RTX 4090 and H100) says which each figure is
            target = x.record["config"].get("target")
            notes += [target] if c.stated.devices and target else []
            notes += [whose] if whose else []
            parts.append(
                f"{c.stated.name}: {fmt(x.record['value'], x.record['unit'])}"
                + (f" ({', '.join(notes)})" if notes else "")
                + ("" if x.in_range else f" ×{x.factor:,.3g} {x.direction}")
            )
    # else the stated parts' own figures first, a figure taken here before a spec table's
    shown = [i for c in v.checks for i in c.context]
    shown.sort(key=lambda i: records[i]["config"].get("role") == "reference")
    if not parts and (shown or v.records):
        r = records[(shown or v.records)[0]]
        whose = _whose(r, merged)
        reference = r["config"].get("role") == "reference"
        what = _without_asides(r["what"])  # the whole text is in the claim's section
        if shown:  # the tag names the machine (a reference figure is every machine's)
            where = f"{what}; {_tag(r, not reference)}"
        else:
            where = what + (f"; {whose}" if whose else "")
        kind = "reference, not measured" if reference else "context"
        parts.append(f"{kind}: {fmt(r['value'], r['unit'])} ({where})")
    return "; ".join(parts) or "—"


def _without_asides(text: str, most: int = 200) -> str:
    """`text` without its parenthesised asides, cut at a word near `most` characters: a table
    cell's short form of a record's description, which the claim's section gives whole."""
    whole = text
    # an aside follows a space: log(L) and x[8×n] are words, not asides
    while (short := re.sub(r"\s+\([^()]*\)", "", text)) != text:
        text = short
    text = re.sub(r"\s+", " ", text).strip() or whole  # all of it an aside: kept whole
    if len(text) <= most:
        return text
    cut = text.rfind(" ", 0, most)
    return text[: cut if cut > 0 else most].rstrip(" ,;:") + " …"


def _env_lines(records: Sequence[dict], meta: dict) -> list[str]:
    """Where the records were taken: backend, devices and JAX, in a comparison per column
    (which folder ran which JAX), then the run's size and topics or the merge's folders."""
    envs = {}  # in a merge, column → its environments, in the folders' order
    for r in records:
        if r["backend"] == "multi":  # a merge's ratios: their machines are listed already
            continue
        env = (r["backend"], r["device_kind"], r["device_count"], r["jax_version"])
        envs.setdefault(r.get("machine"), set()).add(env)
    lines = [
        f"- {f'{machine}: ' if machine else ''}backend {b}, {k} × {n}, jax {j}"
        for machine, found in envs.items()
        for b, k, n, j in sorted(found, key=str)
    ]
    if meta.get("merged"):  # a merge timed nothing: it names its sources
        lines.append("- merged from " + ", ".join(f"`{d}`" for d in meta["merged"]))
        if meta.get("tiny"):
            lines.append(
                "  - **" + ", ".join(f"`{d}`" for d in meta["tiny"]) + " ran at size `tiny`**, "
                "which checks that every study runs: the verdicts their records decide do not "
                "judge the claims"
            )
    elif meta:
        lines.append(f"- size `{meta.get('size')}`, wall time {meta.get('wall_s', 0):.0f} s")
        if meta.get("size") == "tiny":
            lines.append(
                "  - **size `tiny` checks that every study runs**: its models, lengths and "
                "batches are too small for the verdicts to judge the claims (a few-MFLOP step, "
                "two lengths for a slope); `size=quick` or `full` judges them"
            )
        modules = meta.get("modules", {})
        for name, m in modules.items():
            error = str(m.get("error") or "")
            if error.startswith("cut short"):  # "cut short by SIGTERM: …", said once
                err = f" — **cut short**{error.removeprefix('cut short')}"
            else:
                err = f" — **failed**: {error}" if error else ""
            lines.append(f"  - `{name}`: {m['wall_s']:.0f} s, {m['records']} records{err}")
        for name in meta.get("topics", ()):
            if name not in modules:  # after a stop: the topics it never reached
                lines.append(f"  - `{name}`: not run (the run was stopped before it)")
    if caution := busy_caution(records):
        lines.append(f"- **Host busy**: {caution}")
    return lines


def busy_caution(records: Sequence[dict]) -> str:
    """A sentence where CPU figures were timed on a shared host (`rec.busy_records`): a
    verdict that rests on a time or a ratio of times is then not the machine's own. Empty on a
    quiet host."""
    busy, timed, load, cores = rec.busy_records(records)
    if not busy:
        return ""
    return (
        f"{busy} of {timed} CPU measurements were timed while other work shared the host "
        f"(load average up to {load:.1f} on {cores} cores): their times come out high and their "
        "rates low, both noisy, and the verdicts on rates, speed-ups and ratios with them; rerun "
        "on a quiet host to judge them"
    )


def topic_status(meta: dict | None, claim, status: str) -> str:
    """A run's verdict on a claim as its topic ended: where the topic was never reached (a
    stopped run), failed or was cut short, that instead of a bare "no record" (or beside the
    verdict its finished points decide). A run's run.json `modules` says how each ended."""
    modules = (meta or {}).get("modules")
    if modules is None or (meta or {}).get("merged"):  # a merge: each column says its own
        return status
    if claim.topic not in modules:
        return "not run" if status == MISSING else status
    topic = modules[claim.topic]
    error = topic.get("error") if isinstance(topic, dict) else None
    if not error:
        return status
    word = "cut short" if str(error).startswith("cut short") else "failed"
    return word if status == MISSING else f"{status} ({claim.topic} {word})"


def verdict_rows(
    verdicts: Sequence[Verdict], records: Sequence[dict], meta: dict | None = None
) -> list[str]:
    rows = ["| id | claim | source | measured | verdict |", "|---|---|---|---|---|"]
    for v in verdicts:
        c = v.claim
        cell = measured_cell(v, records).replace("|", "\\|")
        status = f"**{topic_status(meta, c, v.status)}**"
        if part := unjudged_parts(v):  # holds on the parts judged; the rest said
            status += f" ({part})"
        if c.id in (meta or {}).get("tiny_only", ()):  # a merge: tiny folders alone decide it
            status += " (size tiny only)"
        rows.append(f"| {c.id} | {c.text} | {', '.join(c.sources)} | {cell} | {status} |")
    return rows


def stated_range(s) -> str:
    """The stated range as text: one range, or one per device kind."""
    if not s.devices:
        return fmt_range(s.lo, s.hi, s.unit, s.strict)
    parts = [f"{k} {fmt_range(lo, hi, s.unit, s.strict)}" for k, (lo, hi) in s.devices.items()]
    return "per device: " + ", ".join(parts)


def _once(records: Sequence[dict], indices) -> list[tuple[int, bool]]:
    """`indices` with each reference figure (a spec table's, an analytic count) once: in a
    comparison every folder carries it alike, and it is one figure, not one per machine. Each
    index comes with whether to name its machine: not for a figure several folders share."""
    out, first = [], {}
    for i in indices:
        r = records[i]
        if r["config"].get("role") != "reference":
            out.append((i, True))
            continue
        key = (r["what"], r["value"], r["unit"], r["label"])
        if key in first:
            out[first[key]] = (out[first[key]][0], False)
            continue
        first[key] = len(out)
        out.append((i, True))
    return out


def _reference_notes(c, records: Sequence[dict]) -> list[str]:
    """Reference figures (spec table, not measured) that carry this part's metric: whether
    they contradict the article and by how much. Never a verdict: nothing was measured."""
    out = []
    for i, named in _once(records, c.context):
        r = records[i]
        if r["config"].get("role") != "reference" or not isinstance(r["value"], int | float):
            continue
        bounds = c.stated.range_for(r["config"].get("target") or r["device_kind"])
        if bounds is None:
            continue
        factor, direction = outside(r["value"], *bounds, c.stated.strict)
        where = (
            "inside the stated range"
            if factor is None
            else (f"outside {fmt_range(*bounds, r['unit'], False)} by ×{factor:,.3g} ({direction})")
        )
        whose = f" ({r['machine']})" if named and r.get("machine") else ""
        out.append(
            f"  - reference, not a verdict: {r['what']} = {fmt(r['value'], r['unit'])}{whose}, "
            f"{where}"
        )
    contradicted = any("outside" in line for line in out)
    if contradicted and c.status in (NA, MISSING, PREDICTED) and c.stated.if_off:
        out.append(f"  - why the article is likely wrong: {c.stated.if_off}")
    return out


def _context_what(r: dict) -> str:
    """A context record's name with what tells it from its neighbours where the name leaves
    that to its config (the scaling study's rows: the same names at 1, 2, 4 and 8 devices)."""
    what, c = r["what"], r["config"]
    words = set(re.findall(r"[\w.+-]+", what))  # whole words: devices=1 is not in "1024"
    extra = [
        f"{c[key]} {word}"
        for key, word in (("strategy", "strategy"), ("devices", "devices"))
        if c.get(key) is not None and str(c[key]) not in words
    ]
    return f"{what}, {', '.join(extra)}" if extra else what


def _spread(r: dict) -> str:
    """' (p10–p90 0.77–1.27 s, 3 runs)' for a median time whose record keeps its samples'
    spread, so a median taken from a few scattered samples reads as such; else empty."""
    c = r["config"]
    lo, hi = c.get("p10_s"), c.get("p90_s")
    if r["unit"] != "s" or not isinstance(lo, int | float) or not isinstance(hi, int | float):
        return ""
    runs = f", {c['runs']} runs" if c.get("runs") else ""
    return f" (p10–p90 {fmt(lo, 's')}–{fmt(hi, 's')}{runs})"


def _check_lines(v: Verdict, records: Sequence[dict]) -> list[str]:
    lines = []
    for c in v.checks:
        s = c.stated
        lines.append(
            f"- **{s.name}** (`{s.metric}`) — *{s.quote}* ({s.source}); stated range "
            f"{stated_range(s)}. "
            f"{s.reading}"
        )
        lines.append(f"  - verdict: **{c.status}**")
        for x in c.readings:
            lines.append(f"  - {x.record['what']}: {_reading_text(x)}")
        if c.status == OFF and s.if_off:
            lines.append(f"  - why the article is likely wrong: {s.if_off}")
        if c.status == PREDICTED:
            inside = sum(x.in_range for x in c.readings)
            lines.append(f"  - predictions inside the stated range: {inside} of {len(c.readings)}")
        if c.status in (NA, MISSING) and not c.context:
            present = {backend_of(records[i]) for i in v.records}
            if present and not present & set(s.backends):
                lines.append(f"  - measured on {' or '.join(s.backends)} only")
            else:
                lines.append("  - nothing recorded for this part on this backend")
        lines += _reference_notes(c, records)
    shown = {x.index for c in v.checks for x in c.readings}
    rest = [i for i in v.records if i not in shown]
    if rest:
        lines.append("- context and reference records:")
        for i, named in _once(records, rest):
            r = records[i]
            lines.append(
                f"  - {_context_what(r)}: {fmt(r['value'], r['unit'])}{_spread(r)} "
                f"({_tag(r, named)}"
                + (f", {r['config']['role']}" if r["config"].get("role") != "evidence" else "")
                + (
                    f", {'an upper' if r['config']['bound'] == 'upper' else 'a lower'} bound: "
                    "it decides nothing here"
                    if r["config"].get("bound") and r["config"].get("role") in (None, "evidence")
                    else ""
                )
                + ")"
            )
    return lines


def render(
    records: Sequence[dict], verdicts: Sequence[Verdict], plot_files: dict, meta=None
) -> str:
    out = [
        "# Claims ledger",
        "",
        *_env_lines(records, meta or {}),
        "",
        CAVEAT,
        "",
        "## Verdicts",
        "",
        *verdict_rows(verdicts, records, meta),
        "",
    ]
    counts = {}
    for v in verdicts:
        # a missing record counted by why it is missing (not run, cut short, failed)
        status = topic_status(meta, v.claim, v.status) if v.status == MISSING else v.status
        counts[status] = counts.get(status, 0) + 1
    out += [", ".join(f"{k}: {n}" for k, n in counts.items()), ""]
    by_topic = {}
    for v in verdicts:
        by_topic.setdefault(v.claim.topic, []).append(v)
    for topic, title in TOPICS.items():
        shown = topic in by_topic or topic in plot_files
        if not shown and not (topic == "prediction" and tables.prediction_markdown(records)):
            continue
        out += [f"## {title}", ""]
        for name in plot_files.get(topic, ()):
            out += [f"![{topic}]({name})", ""]
        if topic == "prediction":
            out += tables.prediction_markdown(records)
        for v in by_topic.get(topic, []):
            out += [
                f"### {v.claim.id} — {topic_status(meta, v.claim, v.status)}",  # as its row
                "",
                f"> {v.claim.text}",
                "",
                f"Measures: {v.claim.measure}.",
                "",
                *_check_lines(v, records),
                "",
            ]
    out += ["## Sources", ""]
    out += [f"- {k}: *{title}* (`{name}`)" for k, (name, title) in SOURCES.items()]
    return "\n".join(out) + "\n"


def write_report(out_dir, *, meta: dict | None = None, only=None, records=None) -> dict:
    """Judge the folder's records, plot, write REPORT.md and run.json; return what was made."""
    out_dir = Path(out_dir)
    if records is None:  # every module may have failed: then there is no file, and no record
        path = out_dir / "records.jsonl"
        records = rec.read_records(path) if path.exists() else []
    claims = [BY_ID[i] for i in only] if only else list(CLAIMS)
    verdicts = judge_all(records, claims)
    plot_files = plots.make_all(records, out_dir)
    path = out_dir / "REPORT.md"
    path.write_text(render(records, verdicts, plot_files, meta))
    # as REPORT.md says them: a claim whose topic was not reached, or was cut short, says so
    summary = {v.claim.id: topic_status(meta, v.claim, v.status) for v in verdicts}
    (out_dir / "run.json").write_text(json.dumps({**(meta or {}), "verdicts": summary}, indent=2))
    return {"path": path, "verdicts": verdicts, "plots": plot_files, "records": records}


def targets_block(verdicts: list[TargetVerdict], env: dict, command: str, date: str) -> str:
    """A block to paste into BENCHMARKS.md: what ran where, and every GPU-speed point's
    verdict (lab.studies.targets)."""
    met = sum(v.met for v in verdicts)
    lines = [
        f"### Flash attention targets — `{command}`",
        "",
        f"{date}, {env['device_kind']} × {env['device_count']}, "
        f"jax {env['jax_version']}, jaxlib {env['jaxlib_version']}. bf16, B=2, H=32. "
        f"Speed = reference time / the kernel's time (median of alternated calls). "
        f"**{met} of {len(verdicts)} points meet their target.**",
        "",
        "| D | L=S | causal | mode | kernel | reference | speed | target | kernel TFLOP/s | "
        "ref TFLOP/s | ahead of | met | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        tf = f"{v.kernel_tflops:.0f}" if v.kernel_tflops else "–"
        ref_tf = f"{v.reference_tflops:.0f}" if v.reference_tflops else "–"
        lines.append(
            f"| {v.head_dim} | {v.seq} | {'yes' if v.causal else 'no'} | {v.mode} | "
            f"{v.kernel} | {v.reference or '–'} | "
            f"{ratio(v.speed) or '–'} | ≥ {v.target}× | "
            f"{tf} | {ref_tf} | {', '.join(v.ahead_of) or '–'} | "
            f"{'yes' if v.met else 'no'} | {v.note} |"
        )
    return "\n".join(lines) + "\n"

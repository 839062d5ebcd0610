"""Tuning: the attention tile search (its stages and its static pass) and the remat × batch
search of lab.tools.tune_step. Each renderer takes the tuners' types (lab.measure.tuning).
"""

import dataclasses
import math

from rich.table import Table
from rich.text import Text

from lab.measure.toolchain import Toolchain
from lab.measure.tuning import Stage, StaticPass, StepCandidate
from lab.report.format import NOISE, duration, mib, percent, ratio, size
from lab.report.tables.compiled import toolchain_line


def _varying_fields(candidates) -> list[str]:
    rows = [dataclasses.asdict(c) for c in candidates]
    if len(rows) < 2:
        return sorted(rows[0]) if rows else []
    return sorted(k for k in rows[0] if len({r[k] for r in rows}) > 1)


def tune_stage(stage: Stage, baseline: str) -> Table:
    """One stage of the tile search: every candidate's score and its p10–p90 span, best
    first; where other candidates' spans overlap the chosen one's, the chosen row and the
    caption name them (their count where several): a rerun may name any of them."""
    t = Table(title=f"stage {stage.stage} ({stage.mode}): geometric-mean time / {baseline}")
    fields = _varying_fields(stage.candidates)
    for col in (*fields, f"vs {baseline}", "p10–p90", ""):
        t.add_column(col, justify="right")
    tied = stage.within_noise_of
    for i in sorted(range(len(stage.candidates)), key=lambda i: stage.scores[i]):
        c = dataclasses.asdict(stage.candidates[i])
        score = stage.scores[i]
        span = stage.spans[i] if i < len(stage.spans) else None
        mark = "← chosen" if i == stage.best else ""
        if i == stage.best and tied:
            mark += f" (within noise of {tied_text(stage, tied)})"
        t.add_row(
            *(str(c[f]) for f in fields),
            ratio(score, 3) if math.isfinite(score) else "rejected",
            f"{ratio(span[0], 3)}–{ratio(span[1], 3)}" if span else "",
            mark,
        )
    if tied:
        other = "either" if len(tied) == 1 else "any of them"
        t.caption = f"the chosen and {tied_text(stage, tied)}: {NOISE}; a rerun may name {other}"
    return t


def tied_text(stage: Stage, tied: list[int]) -> str:
    """The candidates within noise of the chosen one: 'block_q=32', or with their count where
    several: '2 others (block_q=32, block_q=64)'."""
    names = [candidate_text(stage, i) for i in tied]
    return names[0] if len(names) == 1 else f"{len(names)} others ({', '.join(names)})"


def candidate_text(stage: Stage, i: int) -> str:
    """A candidate by the fields that vary in its stage: 'block_q=64 block_k=32'."""
    c = dataclasses.asdict(stage.candidates[i])
    return " ".join(f"{f}={c[f]}" for f in _varying_fields(stage.candidates))


def static_pass(p: StaticPass, title: str, toolchain: Toolchain | None = None) -> Table:
    """The tuner's static pass: per candidate, its worst kernel's registers, spills and shared
    memory (compiled, not run), and whether it was kept; the caption names the compiler."""
    t = Table(title=f"static pass · {title} · compiled, not run")
    if toolchain:
        t.caption = toolchain_line(toolchain)
    fields = _varying_fields([c.candidate for c in p.candidates])
    for col in (*fields, "max registers", "spill bytes", "max smem", "kept"):
        t.add_column(col, justify="right")
    for c in p.candidates:
        regs, spill = c.max_registers, c.spill_bytes
        if not c.kernels:  # refused by the compiler: no kernel, so no figure (not a zero)
            spill_text = "–"
        else:
            spill_text = f"[red]{spill}" if spill else "0"
        t.add_row(
            *(str(dataclasses.asdict(c.candidate)[f]) for f in fields),
            "–" if regs is None else str(regs),
            spill_text,
            "–" if c.max_smem is None else size(c.max_smem),
            "yes" if c.kept else f"[red]no: {c.dropped}",
        )
    return t


def tune_step(
    rows: list[StepCandidate],
    top: StepCandidate | None,
    title: str,
    tied: list[StepCandidate] = (),
) -> Table:
    """lab.tools.tune_step: every (remat, batch) with its compiled memory and, where it ran,
    step time, tokens/s and MFU; the best one marked, and those as good as it within the
    run's noise (their p10–p90 ranges overlap). A skipped candidate's step says "skipped [n]"
    and the caption gives note n, its reason (one note per reason, however many it skips):
    a reason in the column made the table as wide as the console, each row lines deep."""
    t = Table(title=title, caption_justify="left")
    cols = ("remat", "batch", "compiled MiB/device", "step", "p10–p90", "tokens/s", "MFU", "")
    for col in cols:
        t.add_column(col, justify="right")
    notes: dict[str, int] = {}  # reason → its number
    for r in rows:
        spread = f"{duration(r.p10_s)}–{duration(r.p90_s)}" if r.p10_s and r.p90_s else ""
        if not r.ran:
            n = notes.setdefault(r.skipped, len(notes) + 1)
        mark = "← best" if r is top else ("within noise" if any(r is x for x in tied) else "")
        t.add_row(
            r.remat,
            str(r.batch),
            mib(r.memory_bytes, 0) if r.memory_bytes else "–",
            duration(r.step_s) if r.ran else f"skipped [{n}]",
            spread,
            f"{r.tokens_per_s:,.0f}" if r.ran else "",
            percent(r.mfu) if r.mfu is not None else "",
            mark,
        )
    if notes:
        t.caption = Text("\n".join(f"[{n}] skipped: {why}" for why, n in notes.items()))
    return t

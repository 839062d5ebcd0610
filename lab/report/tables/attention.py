"""Attention studies: the benchmark sweep, the kernel compiled for a target, and the GPU kernels
against their speed targets. Each renderer takes the study's types (lab.measure.attention),
whose fields and properties say what every figure is.
"""

from rich.table import Table

from lab.measure.attention import PlanPoint, SweepRow, TargetVerdict
from lab.measure.cost import COMPILER_ESTIMATE, estimate_with_error, unchecked_estimate
from lab.report.format import duration, percent, ratio, significant, size
from lab.report.tables.common import _mem


def attention_sweep(rows: list[SweepRow], baseline: str, title: str) -> Table:
    """`lab.studies.attention.rows_of(records)`: one line per (seq, causal, mode, impl). Where
    the baseline never ran (it cannot take the masks asked for, say), the caption says why the
    ratio column is empty and how to give another baseline."""
    base = [r for r in rows if r.impl == baseline]
    caption = None
    if rows and not any(r.ran for r in rows):  # nothing to compare: each row says why
        caption = "no impl asked for ran: each row says why it was skipped"
    elif rows and not any(r.ran for r in base):
        why = f" ({base[0].skipped})" if base and base[0].skipped else ""
        caption = (
            f"time ÷ {baseline}'s is empty: {baseline} did not run{why}; give baseline= one "
            "of the impls that ran"
        )
    t = Table(title=title, caption=caption, caption_justify="left")
    # the time over the baseline's: below 1× is faster
    cols = ("L=S", "causal", "mode", "impl", "time", f"time ÷ {baseline}'s (<1: faster)", "TFLOP/s")
    for col in (*cols, "peak temp mem", "max rel. error vs f64"):  # |out − ref| / max |ref|
        t.add_column(col, justify="right")
    for r in rows:
        mem = size(r.peak_temp_bytes)
        if r.memory_label == "compiled, not run":
            mem += " (compiled, not run)"
        if r.memory_excludes:
            mem += " + kernel's own"
        t.add_row(
            str(r.seq),
            "yes" if r.causal else "no",
            r.mode,
            r.impl,
            duration(r.time_s) if r.ran else f"skipped: {r.skipped}",
            ratio(r.ratio),
            significant(r.tflops) if r.ran else "",
            mem,
            f"{r.max_error:.1e}" if r.ran else "",
        )
    return t


BLOCK_MAP = "derived (block map)"  # the plan's FLOPs where the compiler reports none


def _block_map_only(r: PlanPoint) -> bool:
    """The compiled count misses the kernels (Triton's lowering drops their cost estimate,
    ~0) and the block map's count stands in for it."""
    return r.flops_derived and not r.estimate_compiled


def attention_plan(rows: list[PlanPoint], title: str) -> Table:
    """The kernel compiled for a target: memory and FLOPs (compiled, not run), and the time per
    call with the rates it implies (predicted: a model of the compiled program; a floor
    reads ≥, the rates it bounds ≤)."""
    # each row's estimate names its source by a number, each source said once below the
    # table (one sentence per row wrapped a row over eight lines)
    sources = list(dict.fromkeys(_source_note(r) for r in rows))
    lines = [f"({i}) {text}" for i, text in enumerate(sources, 1)]
    derived = [r for r in rows if _block_map_only(r)]
    if derived:  # a lowering with no cost analysis (Triton): ~0 compiled is no count
        how = derived[0].flops_source
        lines.append(f"{BLOCK_MAP}: counted by the lab, not the compiler: {how}")
    t = Table(title=title, caption="\n".join(lines) or None, caption_justify="left")
    cols = ("L=S", "K", "mask", "mode", "memory / device", "of HBM")
    for col in (*cols, "FLOPs / device (compiled | analytic)", "time (predicted)", "TFLOP/s"):
        t.add_column(col, justify="right")
    for col in ("of peak", "estimate"):
        t.add_column(col, justify="right")
    for r in rows:
        need = r.memory_bytes
        hbm = percent(need / r.hbm_bytes) if need and r.hbm_bytes else "–"
        least, most = ("≥ ", "≤ ") if r.estimate_is_a_floor else ("", "")
        compiled_g = max(r.compiled_flops or 0.0, 0.0) / 1e9  # XLA can report -0
        counted = f"{compiled_g:,.1f}{r.compiled_flops_note}"
        if _block_map_only(r):
            counted = f"{r.flops / 1e9:,.1f} {BLOCK_MAP}"
        t.add_row(
            "" if r.seq is None else str(r.seq),
            "" if r.head_dim is None else str(r.head_dim),
            r.mask,
            r.mode,
            _mem(need) if need else "–",
            hbm,
            f"{counted} | {r.analytic_flops_per_device / 1e9:,.1f} G",
            least + duration(r.estimated_s) if r.estimated_s else "–",
            f"{most}{r.tflops:.1f}" if r.tflops else "–",
            most + percent(r.peak_share, 0) if r.peak_share else "–",
            f"({sources.index(_source_note(r)) + 1})"
            + (f" {significant(r.estimate_over_floor, 2)}×" if r.estimate_over_floor else ""),
        )
    return t


def _source_note(r: PlanPoint) -> str:
    """A row's estimate source as said under the table: the compiler's own estimate with
    what is known of its error (no measurement checks it; the row gives its ratio to the
    roofline floor of the same program beside the number)."""
    if r.estimate_source != COMPILER_ESTIMATE:
        return r.estimate_source
    ratio = "; N× beside the number: its ratio to the roofline floor of the same program"
    error = unchecked_estimate(r.device_kind) + (ratio if r.estimate_over_floor else "")
    return estimate_with_error(r.estimate_source, error)


def attention_plan_masks(rows: list[PlanPoint], title: str) -> Table:
    """The plan's FLOPs per device by mask, side by side: one line per (L, K, mode), the
    first mask (the plain one) as the base of each ratio; `PlanPoint.flops_source` says
    where each count comes from."""
    masks = list(dict.fromkeys(r.mask for r in rows))
    t = Table(title=title)
    for col in ("L=S", "K", "mode", *masks):
        t.add_column(col, justify="right")
    points: dict[tuple, dict[str, PlanPoint]] = {}
    for r in rows:
        points.setdefault((r.seq, r.head_dim, r.mode), {})[r.mask] = r
    for (seq, head_dim, mode), by_mask in points.items():
        base = by_mask.get(masks[0])
        cells = []
        for m in masks:
            r = by_mask.get(m)
            if r is None or r.flops is None:
                cells.append("–")
                continue
            cell = f"{r.flops / 1e9:,.1f} G"
            if base is not None and base.flops and r is not base:
                cell += f" ({base.flops / r.flops:.1f}x fewer)"
            cells.append(cell)
        t.add_row(str(seq), str(head_dim), mode, *cells)
    return t


def attention_targets(verdicts: list[TargetVerdict]) -> Table:
    """One line per lab kernel and point of the GPU-speed grid (lab.studies.targets.judge)."""
    t = Table(title="the lab's GPU kernels against the GPU-speed targets")
    cols = ("D", "L=S", "causal", "mode", "kernel", "reference", "speed", "target", "met", "note")
    for col in cols:
        t.add_column(col, justify="right")
    for v in verdicts:
        t.add_row(
            str(v.head_dim),
            str(v.seq),
            "yes" if v.causal else "no",
            v.mode,
            v.kernel,
            v.reference or "–",
            ratio(v.speed) or "–",
            f">= {v.target}x",
            "[green]yes" if v.met else "[red]no",
            v.note,
        )
    return t

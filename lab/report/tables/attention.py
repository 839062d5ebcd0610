"""Attention studies: the benchmark sweep, the kernel compiled for a target, and the GPU kernels
against their speed targets. Each renderer takes the study's types (lab.measure.attention),
whose fields and properties say what every figure is.
"""

from rich.table import Table

from lab.measure.attention import PlanPoint, SweepRow, TargetVerdict
from lab.report.format import duration, percent, ratio, size
from lab.report.tables.common import _mem


def attention_sweep(rows: list[SweepRow], baseline: str, title: str) -> Table:
    """`lab.studies.attention.rows_of(records)`: one line per (seq, causal, mode, impl)."""
    t = Table(title=title)
    cols = ("L=S", "causal", "mode", "impl", "time", f"vs {baseline}", "TFLOP/s")
    for col in (*cols, "peak temp mem", "max error"):
        t.add_column(col, justify="right")
    for r in rows:
        mem = size(r.peak_temp_bytes)
        if r.memory_label == "compiled, not run":
            mem += " (compiled, not run)"
        t.add_row(
            str(r.seq),
            "yes" if r.causal else "no",
            r.mode,
            r.impl,
            duration(r.time_s) if r.ran else f"skipped: {r.skipped}",
            ratio(r.ratio),
            f"{r.tflops:.3f}" if r.ran else "",
            mem,
            f"{r.max_error:.1e}" if r.ran else "",
        )
    return t


def attention_plan(rows: list[PlanPoint], title: str) -> Table:
    """The kernel compiled for a target: memory, FLOPs, time floor (compiled, not run)."""
    t = Table(title=title)
    cols = ("L=S", "K", "mode", "memory / device", "of HBM")
    for col in (*cols, "FLOPs / device (compiled | analytic)", "est. time", "TFLOP/s"):
        t.add_column(col, justify="right")
    for col in ("of peak", "estimate"):
        t.add_column(col, justify="right")
    for r in rows:
        need = r.memory_bytes
        hbm = percent(need / r.hbm_bytes) if need and r.hbm_bytes else "–"
        compiled_g = max(r.compiled_flops or 0.0, 0.0) / 1e9  # XLA can report -0
        t.add_row(
            "" if r.seq is None else str(r.seq),
            "" if r.head_dim is None else str(r.head_dim),
            r.mode,
            _mem(need) if need else "–",
            hbm,
            f"{compiled_g:,.1f}{r.compiled_flops_note} | "
            f"{r.analytic_flops_per_device / 1e9:,.1f} G",
            duration(r.estimated_s) if r.estimated_s else "–",
            f"{r.tflops:.1f}" if r.tflops else "–",
            percent(r.peak_share, 0) if r.peak_share else "–",
            r.estimate_source,
        )
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

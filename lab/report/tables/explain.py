"""lab.run explain=true: memory per device, a pipeline's stage traffic and each role's
collectives, the compiled program beside the analytic figures.
"""

from rich.table import Table

from lab.measure.memory import MemorySplit
from lab.measure.pipeline import PipelineReading
from lab.report.format import mib, ratio


def explain_memory(m: MemorySplit) -> Table:
    """Per-device bytes from the shardings, the calculator and the compiler (MiB)."""
    pred, comp = m.predicted or {}, m.compiled or {}
    t = Table(title="memory per device (MiB)")
    for col in ("component", "from shardings (exact)", "calculator (predicted)", "compiled"):
        t.add_column(col)
    for k in ("params", "grads", "optimizer"):
        t.add_row(k, mib(getattr(m, k), 3), mib(pred.get(k), 3), "")
    t.add_row("activations", "", mib(pred.get("activations"), 3), "")
    t.add_row("workspace", "", mib(pred.get("workspace"), 3), "")
    t.add_row("arguments (params, optimizer, batch)", "", "", mib(comp.get("argument_bytes"), 3))
    t.add_row("temporaries (grads, activations, …)", "", "", mib(comp.get("temp_bytes"), 3))
    t.add_row("total", "", mib(pred.get("total"), 3), mib(comp.get("total_bytes"), 3))
    if "error" in pred:
        t.add_row("calculator", f"unavailable: {pred['error']}", "", "")
    return t


def explain_pipeline(p: PipelineReading) -> Table:
    """A pipelined step's stage permutes and ticks: the compiled program against the schedule."""
    t = Table(title="pipeline: stage-to-stage traffic per step, per device")
    for col in ("", "compiled", "analytic"):
        t.add_column(col)
    K = p.accumulate
    runs = f" (the schedule runs {K}× a step: accumulate={K})" if K > 1 else ""
    t.add_row(f"ticks (forward permutes a run){runs}", str(p.compiled_ticks), str(p.ticks))
    bubble = p.compiled_bubble
    t.add_row("bubble", "n/a" if bubble is None else f"{bubble:.3f}", f"{p.bubble:.3f}")
    t.add_row("microbatch activation a", "", f"{p.microbatch_bytes:,} B")
    for d, r in (("forward", p.forward), ("backward", p.backward)):
        t.add_row(
            f"{d} collective-permutes",
            f"{r.ops} op × {r.executions} runs, {r.bytes_per_device:,} B",
            f"{'K·' if K > 1 else ''}ticks × a = {p.bytes_per_device:,} B",
        )
    t.add_row(  # the only row that is not per device: the whole pipeline's useful transfers
        "useful, a data replica's P stages together, each way",
        "",
        f"{'K·' if K > 1 else ''}M·(R·P-1)·a = {p.useful_bytes:,} B",
    )
    return t


def explain_collectives(ex) -> Table:
    """Each role's collectives read from the compiled HLO beside the analytic figure."""
    sizes = " × ".join(f"{a}={n}" for a, n in ex.mesh.items() if n > 1) or "1 device"
    t = Table(title=f"collectives per step, per device — {ex.strategy} on {sizes} ({ex.backend})")
    for col in ("role", "measured (kind @ axes: ops)", "MiB sent", "analytic MiB", "ratio"):
        t.add_column(col)
    for r in ex.rows:
        what = "; ".join(f"{k} @ {','.join(a)}: {o}" for k, a, o, _ in r.measured) or "none"
        e = r.expected
        analytic = mib(e.bus_bytes, 3) if e else "—"
        if e and e.high > e.low * 1.001:
            analytic += f" ({mib(e.low, 3)}–{mib(e.high, 3)})"
        t.add_row(r.role, what, mib(r.measured_bus_bytes, 3), analytic, ratio(r.ratio, 3) or "—")
    for r in ex.rows:
        if r.expected:
            note = r.dtype_note
            if note and ex.backend == "cpu" and "f32" in r.dtypes:
                note += " (XLA:CPU runs 16-bit collectives in float32)"
            note = f"; {note}" if note else ""
            t.add_row(
                "", f"[dim]{r.role}: expected {r.expected.kind}; {r.expected.formula}{note}", ""
            )
    return t

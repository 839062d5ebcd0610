"""lab.run's terminal output: the header before compiling, the compiled step per device (memory,
FLOPs, a plan's fit and predicted time), the pipeline and offloading lines, the summary.
"""

import math

from rich.markup import escape
from rich.table import Table

from lab.measure import memory
from lab.measure.offload import OffloadCost
from lab.measure.pipeline import PipelineReading
from lab.measure.predicted import PredictedStep
from lab.measure.run import CANNOT_RUN, RunSummary, StepAnalysis
from lab.report.format import duration, mib, percent
from lab.report.tables.common import GIB, _mem


def run_header(
    cfg,
    info,
    n_params: int,
    mesh_shape: dict,
    attention_note=None,
    offloaded: bool = True,
    split: str = "",
) -> str:
    """The lines lab.run prints before compiling (rich markup); `split`: what the strategy
    splits over which axes (lab.mesh.split_words); `attention_note`: why the
    dispatch passed over the kernel it prefers here (lab.kernels.attention.choose_noted);
    `offloaded`: whether the program keeps the optimizer state in host memory where
    offload_optimizer=true asked for it (a plan's devices may list no host memory)."""
    m = cfg.model
    sizes = " × ".join(f"{a}={n}" for a, n in mesh_shape.items() if n > 1) or "1 device"
    return "\n".join(
        [
            f"[bold]lab.run[/bold] {escape(cfg.name)}",  # a name's [brackets] are not markup
            f"  devices   {info.header()}",
            f"  mesh      {sizes}  (mesh={cfg.mesh}, strategy={cfg.strategy}"
            f"{': ' + split if split else ''})",
            f"  model     {cfg.preset}: {n_params / 1e6:.2f}M params, d_model={m.d_model}, "
            f"layers={m.n_layers}, heads={m.n_heads}/{m.n_kv_heads} kv, attention={m.attention}, "
            f"remat={m.remat}{_mask_words(m)}",
            *([f"  attention [yellow]{attention_note}"] if attention_note else []),
            f"  precision params {m.param_dtype}, compute {m.dtype}, softmax and loss float32"
            f"{_loss_scale_words(cfg)}",
            f"  data      {escape(cfg.data)}{' (packed documents)' if cfg.pack else ''}, "
            f"batch {cfg.batch_size} × {cfg.seq_len} tokens, {cfg.steps} "
            f"step{'s' if cfg.steps != 1 else ''}",
            *_fitting_header(cfg, offloaded),
        ]
    )


def _loss_scale_words(cfg) -> str:
    """The static loss scale, where the loss is scaled (float16's 2^15 when auto, or one given;
    0 is auto in a config that was not resolved)."""
    scale = cfg.loss_scale or (2.0**15 if cfg.model.dtype == "float16" else 1.0)
    return "" if scale == 1.0 else f", static loss scale {scale:g}"


def _mask_words(m) -> str:
    """What the attention's mask holds beyond causal: a window (its layers) and a soft-cap."""
    words = ""
    if any(m.layer_windows):
        local = sum(w is not None for w in m.layer_windows)
        words += f", window={m.window} ({local} of {m.n_layers} layers)"
    if m.softcap:
        words += f", softcap={m.softcap:g}"
    return words


def _fitting_header(cfg, offloaded: bool = True) -> list[str]:
    """The header's line for a pipeline, gradient accumulation or offloading, if any."""
    m, parts = cfg.model, []
    if cfg.strategy.startswith("pp") and m.microbatches:
        kind = "GPipe" if m.pipeline_repeats == 1 else f"circular × {m.pipeline_repeats}"
        # the stages hold slices of the stacked layers: the strategy turns scan_layers on
        each = "microbatch" if m.microbatches == 1 else "microbatches"
        parts.append(f"pipeline of {m.microbatches} {each} ({kind}), layers stacked")
    if cfg.accumulate > 1:
        parts.append(f"gradients accumulated over {cfg.accumulate} microbatches")
    host = ["optimizer state"] if cfg.offload_optimizer and offloaded else []
    host += ["block inputs"] if m.remat == "offload" else []
    if host:
        parts.append(f"in host memory: {' and '.join(host)}")
    return [f"  fitting   {'; '.join(parts)}"] if parts else []


def analysis(a: StepAnalysis, compile_s: float) -> Table:
    """The compiled step per device: memory (compiled and predicted), FLOPs, bytes; a plan's
    fit, time and MFU."""
    t = Table(title="compiled step (per device)", show_header=False)
    for k, v in a.compiled_memory:
        if k.startswith("host_") and not v:
            continue  # nothing in host memory: the usual case, not worth a row
        t.add_row(k, _mem(v) if isinstance(v, int | float) else str(v))
    pred = a.predicted_memory
    parts = ", ".join(f"{k} {_mem(v)}" for k, v in pred.parts)
    if pred.host:
        parts += f"; in host memory {_mem(pred.host)}"
    compiled = a.compiled_total_bytes
    # the calculator's error on this very program, beside its figure (a prediction states it)
    ratio = f"; {pred.total / compiled:.2f}× the compiled" if compiled and pred.total else ""
    if ratio and str(a.source.get("device_kind", "")).startswith("TPU"):
        # memory_analysis counts HBM; the calculator has no term for what XLA:TPU's memory-
        # space assignment moves on chip, so it reads over where that is much
        ratio += ", which counts HBM only: XLA:TPU keeps some temporaries in on-chip VMEM"
    t.add_row("predicted total (calculator)", f"{_mem(pred.total)}  ({parts}{ratio})")
    c = a.compiled_cost
    note = c.lower_bound_note
    trips = c.loop_trips
    how = f"  (loops counted × their trips: {', '.join(map(str, trips))})" if trips else ""
    t.add_row("compiled FLOPs", f"{c.flops or math.nan:.4g}{note}{how}")
    t.add_row("compiled bytes accessed", _mem(c.bytes_accessed) + note)
    t.add_row("model FLOPs / token", f"{a.model_flops_per_token:.4g}")
    t.add_row("compile time", f"{compile_s:.2f} s")
    _fitting_rows(t, a)
    if a.plan is not None:
        _plan_rows(t, a)
    return t


def pipeline_line(p: PipelineReading) -> str:
    """The bubble of a pipelined step, analytic beside the compiled schedule's."""
    compiled = "n/a" if p.compiled_bubble is None else f"{p.compiled_bubble:.3f}"
    kind = "GPipe" if p.repeats == 1 else f"circular × {p.repeats}"
    return (
        f"{p.bubble:.3f} analytic (P-1)/(R·M+P-1), {compiled} from the compiled schedule "
        f"({p.compiled_ticks} ticks; {kind}, P={p.stages} stages, M={p.microbatches})"
    )


def offload_line(o: OffloadCost) -> str:
    """Bytes offloading moves per step and the time they would add (predicted)."""
    moved = f"{mib(o.bytes_to_device)} MiB in, {mib(o.bytes_to_host)} MiB out per step"
    if o.added_step_s is None:
        return f"{moved}; no host-link bandwidth ({o.bandwidth_source})"
    return (
        f"{moved}: ≤ {duration(o.added_step_s)} added, predicted, no overlap ({o.bandwidth_source})"
    )


def _fitting_rows(t: Table, a: StepAnalysis) -> None:
    """Pipeline bubble, offloading's traffic and what the backend did not do (lab.run)."""
    if a.pipeline:
        t.add_row("pipeline bubble", pipeline_line(a.pipeline))
    if a.offload:
        t.add_row("host offload", offload_line(a.offload))
    for note in a.notes:
        t.add_row("note", note)


def _plan_rows(t: Table, a: StepAnalysis) -> None:
    plan, cap = a.plan, a.capacity_bytes
    if cap:
        where = "(spec)"
        if (a.source.get("aot") or {}).get("allocator_share"):
            share = a.source["aot"]["allocator_share"]
            reported = a.source["aot"].get("reported_bytes")
            total = f"the {reported / GIB:.1f} GiB it reports" if reported else "spec"
            source = memory.gpu_allocator_fraction_source()
            where = f"({total} × {share:g}: JAX's allocator share, {source})"
        elif (a.source.get("aot") or {}).get("capacity_source") == "compiler":
            where = "(what XLA:TPU lets a program hold)"
        t.add_row(f"memory per device {where}", f"{cap / GIB:.1f} GiB: {plan.fit}")
    est = plan.estimated_step_s
    predicted = a.predicted_step
    # a loop of unknown trip count is timed once, like its FLOPs: the time is a floor
    floor = a.compiled_cost.lower_bound_note.replace("at least", "a floor") if predicted else ""
    # a step that does not fit keeps its figures, each labelled as one the target cannot run
    caveat = f" [yellow]({CANNOT_RUN})[/]" if plan.cannot_run else ""
    t.add_row(
        "predicted step time" if predicted else "estimated step time",
        "n/a" if est is None else f"{duration(est)}{floor}{caveat} ({plan.estimate_how})",
    )
    if predicted:
        t.add_row("  where it goes", breakdown_line(predicted))
        t.add_row("  top ops", top_ops_line(predicted))
        tokens = a.tokens_per_step
        if tokens and est:
            at_most = "at most " if floor else ""
            # the step's tokens are the whole mesh's, as the measured run's "global" figure
            t.add_row("predicted tokens/s, all devices", f"{at_most}{tokens / est:,.0f}{caveat}")
    mfu = plan.implied_mfu
    bound = "at most " if plan.mfu_is_a_bound or floor else ""
    t.add_row("implied MFU", "n/a" if mfu is None else f"{bound}{percent(mfu)}{caveat}")
    # the model's time is predicted; a plan with no step time labels none
    step = plan.source.get("estimate_label") or plan.label
    t.add_row("label", plan.label + ("" if step == plan.label else f"; step time {step}"))


def breakdown_line(predicted: PredictedStep) -> str:
    """'compute 61%, memory 30%, exposed communication 9%': where a predicted step goes (parts
    under 1% left out, so the line stays short)."""
    return ", ".join(f"{k} {share:.0%}" for k, share in predicted.shares if share >= 0.01)


def top_ops_line(predicted: PredictedStep, n: int = 3) -> str:
    """The ops the predicted step spends most on, with their share."""
    total = predicted.seconds or 1.0
    return "; ".join(
        f"{op.name} ({op.what}, {op.kind}) {op.exposed_s / total:.0%}"
        for op in predicted.top_ops[:n]
    )


# Fewer timed steps than this make no median: one step is one sample (its p10 and p90 are
# itself), two are their mean; the figures derived from the time say so beside them.
FEW_TIMED = 3


def few_timed(runs: int, warmup: bool = False) -> str:
    """'' for enough timed steps, else what the step time is instead of a median; `warmup`:
    the steps timed are warm-up steps (a run too short to time one past them), slower than
    the steady step by their allocations and first transfers."""
    if warmup:
        steps = "one warm-up step" if runs == 1 else f"{runs} warm-up steps"
        return f"{steps} timed: not the steady step"
    if runs >= FEW_TIMED:
        return ""
    return (
        "one step timed: not a median" if runs == 1 else f"{runs} steps timed: too few for a median"
    )


def run_summary(s: RunSummary) -> Table:
    t = Table(title="summary", show_header=False)
    st, a = s.step_time, s.analysis
    since = f" since the resume at step {s.resumed_from}" if s.resumed_from is not None else ""
    if s.profiled_steps:
        first, last = s.profiled_steps
        since += f"; steps {first}-{last} profiled, left out"
    few = few_timed(st.runs, s.warmup_timed)
    if few:  # one sample or two: no spread worth a p10 and p90
        t.add_row("step time", f"{duration(st.median_s)}  ([yellow]{few}[/]{since})")
    else:
        t.add_row(
            "step time (median)",
            f"{duration(st.median_s)}  (p10 {duration(st.p10_s)}, "
            f"p90 {duration(st.p90_s)}, {st.runs} steps{since})",
        )
    caveat = f"; [yellow]{few}[/]" if few else ""  # on every figure derived from the time
    p = s.predicted
    if p:
        busy = f"; [yellow]{p.caveat}[/]" if p.caveat else ""
        t.add_row(
            "predicted step time",
            f"{duration(p.seconds)}  ({p.ratio_to_measured:.2f}× the measured{caveat}; "
            f"{breakdown_line(a.predicted_step)}; {p.error}{busy})",
        )
    t.add_row("compile time", f"{st.compile_s:.2f} s (not in the step time)")
    if s.checkpoint_saves:
        n, total = s.checkpoint_saves
        t.add_row(
            "checkpoint saves",
            f"{n}, {total:.2f} s in all (the loop's wait for each; not in the step time)",
        )
    t.add_row(
        "tokens/s",
        f"{s.tokens_per_s:,.0f} global, {s.tokens_per_s_per_device:,.0f} per device"
        + (f"  ([yellow]{few}[/])" if few else ""),
    )
    t.add_row("model FLOPs/token", f"{a.model_flops_per_token:.4g}  [{a.flops_convention}]")
    mfu = "unavailable" if s.mfu is None else percent(s.mfu)
    if s.mfu is not None and s.mfu > 1:
        mfu += " [above the peak: the load on the host changed between run and peak]"
    t.add_row("MFU", f"{mfu}  (vs {s.peak_source}{caveat})")
    peak = s.peak_bytes_in_use
    t.add_row(
        "memory / device",
        f"{_mem(a.compiled_total_bytes)} compiled"
        + (f", {_mem(peak)} peak in use" if peak is not None else ""),
    )
    if s.loss_first is not None:
        loss = f"{s.loss_first:.4f} → {s.loss_last:.4f}"
        if s.resumed_from is not None and s.segment_loss_first is not None:
            loss += (
                f"  (the run from step {s.loss_first_step}, as metrics.jsonl logged it; since "
                f"the resume at step {s.resumed_from}: "
                f"{s.segment_loss_first:.4f} → {s.loss_last:.4f})"
            )
        t.add_row("loss", loss)
    _fitting_rows(t, a)
    return t

"""Every table the lab prints in a terminal (rich), built from plain dicts and records.

The library returns numbers; the commands hand them here. Numbers become text only through
lab/report/format.py, so a figure reads the same in every table.
"""

import dataclasses
import math
import re

from rich.table import Table

from lab.measure import cost
from lab.report.format import duration, mib, percent, rate, ratio, size

GIB = 2**30

# ------------------------------------------------------------------------------- lab.run


def run_header(cfg, info, n_params: int, mesh_shape: dict, attention_note=None) -> str:
    """The lines lab.run prints before compiling (rich markup); `attention_note`: why the
    dispatch passed over the kernel it prefers here (lab.kernels.attention.choose_noted)."""
    m = cfg.model
    sizes = " × ".join(f"{a}={n}" for a, n in mesh_shape.items() if n > 1) or "1 device"
    return "\n".join(
        [
            f"[bold]lab.run[/bold] {cfg.name}",
            f"  devices   {info.header()}",
            f"  mesh      {sizes}  (mesh={cfg.mesh}, strategy={cfg.strategy})",
            f"  model     {cfg.preset}: {n_params / 1e6:.2f}M params, d_model={m.d_model}, "
            f"layers={m.n_layers}, heads={m.n_heads}/{m.n_kv_heads} kv, attention={m.attention}, "
            f"remat={m.remat}",
            *([f"  attention [yellow]{attention_note}"] if attention_note else []),
            f"  precision params {m.param_dtype}, compute {m.dtype}, softmax and loss float32",
            f"  data      {cfg.data}, batch {cfg.batch_size} × {cfg.seq_len} tokens, "
            f"{cfg.steps} steps",
            *_fitting_header(cfg),
        ]
    )


def _fitting_header(cfg) -> list[str]:
    """The header's line for a pipeline, gradient accumulation or offloading, if any."""
    m, parts = cfg.model, []
    if cfg.strategy.startswith("pp") and m.microbatches:
        kind = "GPipe" if m.pipeline_repeats == 1 else f"circular × {m.pipeline_repeats}"
        parts.append(f"pipeline of {m.microbatches} microbatches ({kind})")
    if cfg.accumulate > 1:
        parts.append(f"gradients accumulated over {cfg.accumulate} microbatches")
    offloaded = ["optimizer state"] if cfg.offload_optimizer else []
    offloaded += ["block inputs"] if m.remat == "offload" else []
    if offloaded:
        parts.append(f"in host memory: {' and '.join(offloaded)}")
    return [f"  fitting   {'; '.join(parts)}"] if parts else []


def _mem(n) -> str:
    return "n/a" if n is None else f"{mib(n)} MiB"


def analysis(a: dict, compile_s: float) -> Table:
    """The compiled step per device: memory (compiled and predicted), FLOPs, bytes; a plan's
    fit, time and MFU."""
    t = Table(title="compiled step (per device)", show_header=False)
    for k, v in (a["compiled_memory_per_device"] or {}).items():
        if k.startswith("host_") and not v:
            continue  # nothing in host memory: the usual case, not worth a row
        t.add_row(k, _mem(v) if isinstance(v, int | float) else str(v))
    pred = a["predicted_memory_per_device"]
    parts = ", ".join(
        f"{k} {_mem(pred[k])}" for k in ("params", "grads", "optimizer", "activations", "workspace")
    )
    if pred.get("host"):
        parts += f"; in host memory {_mem(pred['host'])}"
    t.add_row("predicted total (calculator)", f"{_mem(pred['total'])}  ({parts})")
    c = a["compiled_cost_per_device"] or {}
    note = cost.lower_bound_note(c)
    loops = [n for _, n in c.get("loops", []) if n]
    how = f"  (loops counted × their trips: {', '.join(map(str, loops))})" if loops else ""
    t.add_row("compiled FLOPs", f"{c.get('flops') or math.nan:.4g}{note}{how}")
    t.add_row("compiled bytes accessed", _mem(c.get("bytes accessed")) + note)
    t.add_row("model FLOPs / token", f"{a['model_flops_per_token']:.4g}")
    t.add_row("compile time", f"{compile_s:.2f} s")
    _fitting_rows(t, a)
    if "aot" in a:
        _plan_rows(t, a)
    return t


def pipeline_line(p: dict) -> str:
    """The bubble of a pipelined step, analytic beside the compiled schedule's."""
    compiled = "n/a" if p["compiled_bubble"] is None else f"{p['compiled_bubble']:.3f}"
    kind = "GPipe" if p["repeats"] == 1 else f"circular × {p['repeats']}"
    return (
        f"{p['bubble']:.3f} analytic (P-1)/(R·M+P-1), {compiled} from the compiled schedule "
        f"({p['compiled_ticks']} ticks; {kind}, P={p['stages']} stages, M={p['microbatches']})"
    )


def offload_line(o: dict) -> str:
    """Bytes offloading moves per step and the time they would add (predicted)."""
    moved = f"{mib(o['bytes_to_device'])} MiB in, {mib(o['bytes_to_host'])} MiB out per step"
    if o["added_step_s"] is None:
        return f"{moved}; no host-link bandwidth ({o['bandwidth_source']})"
    return (
        f"{moved}: ≤ {duration(o['added_step_s'])} added, predicted, no overlap "
        f"({o['bandwidth_source']})"
    )


def _fitting_rows(t: Table, a: dict) -> None:
    """Pipeline bubble, offloading's traffic and what the backend did not do (lab.run)."""
    if a.get("pipeline"):
        t.add_row("pipeline bubble", pipeline_line(a["pipeline"]))
    if a.get("offload"):
        t.add_row("host offload", offload_line(a["offload"]))
    for note in a.get("notes", ()):
        t.add_row("note", note)


def _plan_rows(t: Table, a: dict) -> None:
    plan, cap = a["aot"], a["capacity_bytes_per_device"]
    if cap:
        t.add_row("memory per device (spec)", f"{cap / GIB:.1f} GiB: {plan['fit']}")
    est = plan["estimated_step_s"]
    predicted = a.get("predicted_step")
    t.add_row(
        "predicted step time" if predicted else "estimated step time",
        "n/a" if est is None else f"{duration(est)} ({plan['estimate_source']})",
    )
    if predicted:
        t.add_row("  where it goes", breakdown_line(predicted))
        t.add_row("  top ops", top_ops_line(predicted))
        tokens = a.get("tokens_per_step")
        if tokens and est:
            t.add_row("predicted tokens/s", f"{tokens / est:,.0f}")
    mfu = plan["implied_mfu"]
    bound = "at most " if plan["estimate_source"].startswith("roofline floor") else ""
    t.add_row("implied MFU", "n/a" if mfu is None else f"{bound}{percent(mfu)}")
    t.add_row("label", plan["label"])


def breakdown_line(predicted: dict) -> str:
    """'compute 61%, memory 30%, exposed communication 9%': where a predicted step goes."""
    parts = predicted["breakdown"]
    total = sum(parts.values()) or 1.0
    shown = [(k, v) for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v / total >= 0.01]
    return ", ".join(f"{k} {v / total:.0%}" for k, v in shown)


def top_ops_line(predicted: dict, n: int = 3) -> str:
    """The ops the predicted step spends most on, with their share."""
    total = predicted["seconds"] or 1.0
    out = []
    for op in predicted.get("top_ops", [])[:n]:
        what = op["op_name"].rsplit("/", 1)[-1] or op["opcode"]
        out.append(f"{op['name']} ({what}, {op['kind']}) {op['exposed_s'] / total:.0%}")
    return "; ".join(out)


def run_summary(s: dict) -> Table:
    t = Table(title="summary", show_header=False)
    st = s["step_time"]
    t.add_row(
        "step time (median)",
        f"{duration(st['median_s'])}  (p10 {duration(st['p10_s'])}, "
        f"p90 {duration(st['p90_s'])}, {st['runs']} steps)",
    )
    p = s.get("predicted_step_time")
    if p:
        t.add_row(
            "predicted step time",
            f"{duration(p['seconds'])}  ({p['ratio_to_measured']:.2f}× the measured; "
            f"{breakdown_line(p)}; {p['error']})",
        )
    t.add_row("compile time", f"{st['compile_s']:.2f} s (not in the step time)")
    t.add_row(
        "tokens/s",
        f"{s['tokens_per_s']:,.0f} global, {s['tokens_per_s_per_device']:,.0f} per device",
    )
    t.add_row("model FLOPs/token", f"{s['model_flops_per_token']:.4g}  [{s['flops_convention']}]")
    mfu = "unavailable" if s["mfu"] is None else percent(s["mfu"])
    if s["mfu"] is not None and s["mfu"] > 1:
        mfu += " [above the peak: the load on the host changed between run and peak]"
    t.add_row("MFU", f"{mfu}  (vs {s['peak_source']})")
    mem = s["compiled_memory_per_device"] or {}
    peak = (s["memory_stats"] or {}).get("peak_bytes_in_use")
    t.add_row(
        "memory / device",
        f"{_mem(mem.get('total_bytes'))} compiled"
        + (f", {_mem(peak)} peak in use" if peak is not None else ""),
    )
    if s["loss_first"] is not None:
        t.add_row("loss", f"{s['loss_first']:.4f} → {s['loss_last']:.4f}")
    _fitting_rows(t, s)
    return t


_XLA_KERNEL = re.compile(
    r"^(loop_|input_|wrapped_|gemm_|fusion|triton_gemm|triton_softmax|copy|transpose|"
    r"reduce|concatenate|dynamic|bitcast|convert|slice|cutlass|rng|select|scatter|gather)"
)


def kernels(rows: list[dict], title: str, toolchain: dict | None = None) -> Table:
    """The custom (Pallas, Mosaic) kernels of a compiled program one by one, XLA's own in one
    summary row (every one is in summary.json): lab/plans/resources.py, compiled, not run.
    `toolchain` (lab.measure.toolchain.Toolchain.record) is the caption: registers and spills
    are ptxas's, so the table names the ptxas and plugin it came from."""
    t = Table(title=title, caption=toolchain_line(toolchain) if toolchain else None)
    cols = ("kernel", "launches", "grid", "threads", "registers", "spills (st/ld)", "smem")
    for col in (*cols, "blocks/SM", "limit", "occupancy"):
        left = col == "kernel"
        t.add_column(
            col, justify="left" if left else "right", no_wrap=left, min_width=20 if left else None
        )
    xla = [k for k in rows if _XLA_KERNEL.match(k["name"])]
    custom = [k for k in rows if not _XLA_KERNEL.match(k["name"])]
    for k in custom:
        spill = f"{k['spill_store_bytes']}/{k['spill_load_bytes']} B"
        t.add_row(
            k["name"][:48],
            str(k["launches"] or "–"),
            "×".join(map(str, k["grid"])) if k["grid"] else "?",
            str(k["threads"]),
            str(k["registers"]),
            f"[red]{spill}" if k["spill_bytes"] else spill,
            size(k["smem"]),
            str(k["blocks_per_sm"]),
            k["limiter"],
            percent(k["occupancy"], 0),
        )
    if xla:
        spills = sum(k["spill_bytes"] for k in xla)
        t.add_row(
            f"[dim]{len(xla)} XLA kernels",
            str(sum(k["launches"] for k in xla)),
            "",
            "",
            f"≤ {max(k['registers'] for k in xla)}",
            f"[red]{spills} B" if spills else "0 B",
            f"≤ {size(max(k['smem'] for k in xla))}",
            f"≥ {min(k['blocks_per_sm'] for k in xla)}",
            "",
            "",
        )
    return t


def toolchain_line(tc: dict) -> str:
    """'compiled by ptxas 13.5.37 · jax-cuda13-plugin 0.10.2 · CUDA runtime 13.5'."""
    parts = [f"ptxas {tc['ptxas_version']}" if tc.get("ptxas_version") else "no ptxas found"]
    if tc.get("nvjitlink_version"):
        parts.append(f"nvJitLink {tc['nvjitlink_version']}")
    if tc.get("cuda_plugin_version"):
        parts.append(tc["cuda_plugin_version"])
    if tc.get("cuda_runtime_version"):
        parts.append(f"CUDA runtime {tc['cuda_runtime_version']}")
    return "compiled by " + " · ".join(parts)


def kernel_grid(rows: list[dict], title: str, toolchain: dict | None = None) -> Table:
    """One kernel table for a grid of attention plans (lab.studies.plan.grid): every point's
    forward + backward kernels, each named by its L=S and K; XLA's kernels in one row."""
    named = []
    for r in rows:
        if r["mode"] != "fwd+bwd":
            continue
        for k in r["kernels"]:
            name = k["name"].removesuffix("_mosaic_gpu_kernel").removeprefix("flash_attention_")
            custom = not _XLA_KERNEL.match(k["name"])
            named.append({**k, "name": f"L={r['seq']} K={r['head_dim']} {name}"} if custom else k)
    return kernels(named, title, toolchain)


# ------------------------------------------------------------------------------- explain


def explain_memory(ex) -> Table:
    """Per-device bytes from the shardings, the calculator and the compiler (MiB)."""
    m = ex.memory
    pred, comp = m.get("predicted") or {}, m.get("compiled") or {}
    t = Table(title="memory per device (MiB)")
    for col in ("component", "from shardings (exact)", "calculator (predicted)", "compiled"):
        t.add_column(col)
    for k in ("params", "grads", "optimizer"):
        t.add_row(k, mib(m["sharded"][k], 3), mib(pred.get(k), 3), "")
    t.add_row("activations", "", mib(pred.get("activations"), 3), "")
    t.add_row("workspace", "", mib(pred.get("workspace"), 3), "")
    t.add_row("arguments (params, optimizer, batch)", "", "", mib(comp.get("argument_bytes"), 3))
    t.add_row("temporaries (grads, activations, …)", "", "", mib(comp.get("temp_bytes"), 3))
    t.add_row("total", "", mib(pred.get("total"), 3), mib(comp.get("total_bytes"), 3))
    if "error" in pred:
        t.add_row("calculator", f"unavailable: {pred['error']}", "", "")
    return t


def explain_pipeline(p: dict) -> Table:
    """A pipelined step's stage permutes and ticks: the compiled program against the schedule."""
    t = Table(title="pipeline: stage-to-stage traffic per step, per device")
    for col in ("", "compiled", "analytic"):
        t.add_column(col)
    t.add_row("ticks (loop trip count)", str(p["compiled_ticks"]), str(p["ticks"]))
    bubble = p["compiled_bubble"]
    t.add_row("bubble", "n/a" if bubble is None else f"{bubble:.3f}", f"{p['bubble']:.3f}")
    t.add_row("microbatch activation a", "", f"{p['microbatch_bytes']:,} B")
    for d in ("forward", "backward"):
        r = p[d]
        t.add_row(
            f"{d} collective-permutes",
            f"{r['ops']} op × {r['executions']} runs, {r['bytes_per_device']:,} B",
            f"ticks × a = {p['bytes_per_device']:,} B",
        )
    t.add_row("useful per data replica, each way", "", f"M·(R·P-1)·a = {p['useful_bytes']:,} B")
    return t


def explain_collectives(ex) -> Table:
    """Each role's collectives read from the compiled HLO beside the analytic figure."""
    sizes = " × ".join(f"{a}={n}" for a, n in ex.mesh.items())
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
            t.add_row("", f"[dim]{r.role}: expected {r.expected.kind}; {r.expected.formula}", "")
    return t


# ------------------------------------------------------------------------------- attention


def attention_sweep(rows: list[dict], baseline: str, title: str) -> Table:
    """`lab.studies.attention.rows_of(records)`: one line per (seq, causal, mode, impl)."""
    t = Table(title=title)
    cols = ("L=S", "causal", "mode", "impl", "time", f"vs {baseline}", "TFLOP/s")
    for col in (*cols, "peak temp mem", "max error"):
        t.add_column(col, justify="right")
    for r in rows:
        rat = next((v for k, v in r.items() if k.startswith("attention time ratio")), None)
        mem = size(r.get("attention peak temp memory"))
        if r.get("memory label") == "compiled, not run":
            mem += " (compiled, not run)"
        ran = "attention time" in r
        t.add_row(
            str(r["seq"]),
            "yes" if r["causal"] else "no",
            r["mode"],
            r["impl"],
            duration(r["attention time"]) if ran else f"skipped: {r.get('attention skipped')}",
            ratio(rat),
            f"{r['attention TFLOP/s']:.3f}" if ran else "",
            mem,
            f"{r['attention max error']:.1e}" if ran else "",
        )
    return t


def _varying_fields(candidates) -> list[str]:
    rows = [dataclasses.asdict(c) for c in candidates]
    if len(rows) < 2:
        return sorted(rows[0]) if rows else []
    return sorted(k for k in rows[0] if len({r[k] for r in rows}) > 1)


def tune_stage(stage: dict, baseline: str) -> Table:
    """One stage of the tile search: every candidate's score, best first."""
    t = Table(title=f"stage {stage['stage']} ({stage['mode']}): geometric-mean time / {baseline}")
    fields = _varying_fields(stage["candidates"])
    for col in (*fields, f"vs {baseline}", ""):
        t.add_column(col, justify="right")
    for i in sorted(range(len(stage["candidates"])), key=lambda i: stage["scores"][i]):
        c = dataclasses.asdict(stage["candidates"][i])
        score = stage["scores"][i]
        t.add_row(
            *(str(c[f]) for f in fields),
            ratio(score, 3) if math.isfinite(score) else "rejected",
            "← chosen" if i == stage["best"] else "",
        )
    return t


def static_pass(
    candidates, dropped: dict, records: list[dict], title: str, toolchain: dict | None = None
) -> Table:
    """The tuner's static pass: per candidate, its worst kernel's registers, spills and shared
    memory (compiled, not run), and whether it was kept; the caption names the compiler."""
    t = Table(title=f"static pass · {title} · compiled, not run")
    if toolchain:
        t.caption = toolchain_line(toolchain)
    fields = _varying_fields(candidates)
    for col in (*fields, "max registers", "spill bytes", "max smem", "kept"):
        t.add_column(col, justify="right")
    for i, c in enumerate(candidates):
        mine = [r for r in records if r["config"]["candidate"] == dataclasses.asdict(c)]
        regs = max((r["value"] for r in mine), default=None)
        spill = sum(r["config"]["spill_bytes"] for r in mine)
        smem = max((r["config"]["smem"] for r in mine), default=None)
        t.add_row(
            *(str(dataclasses.asdict(c)[f]) for f in fields),
            "–" if regs is None else str(regs),
            f"[red]{spill}" if spill else "0",
            size(smem),
            f"[red]no: {dropped[i]}" if i in dropped else "yes",
        )
    return t


def attention_plan(rows: list[dict], title: str) -> Table:
    """The kernel compiled for a target: memory, FLOPs, time floor (compiled, not run)."""
    t = Table(title=title)
    cols = ("L=S", "K", "mode", "memory / device", "of HBM")
    for col in (*cols, "FLOPs / device (compiled | analytic)", "est. time", "TFLOP/s"):
        t.add_column(col, justify="right")
    for col in ("of peak", "estimate"):
        t.add_column(col, justify="right")
    for r in rows:
        need = r["memory"]["total_bytes"] if r["memory"] else None
        hbm = percent(need / r["hbm_bytes"]) if need and r["hbm_bytes"] else "–"
        compiled_g = max(r["compiled_flops"] or 0.0, 0.0) / 1e9  # XLA can report -0
        t.add_row(
            str(r.get("seq", "")),
            str(r.get("head_dim", "")),
            r["mode"],
            _mem(need) if need else "–",
            hbm,
            f"{compiled_g:,.1f} | {r['analytic_flops_per_device'] / 1e9:,.1f} G",
            duration(r["estimated_s"]) if r["estimated_s"] else "–",
            f"{r['tflops']:.1f}" if r["tflops"] else "–",
            percent(r["peak_share"], 0) if r["peak_share"] else "–",
            r["estimate_source"],
        )
    return t


def attention_targets(verdicts: list[dict]) -> Table:
    t = Table(title="the lab's GPU kernels against the GPU-speed targets")
    cols = ("D", "L=S", "causal", "mode", "kernel", "reference", "speed", "target", "met", "note")
    for col in cols:
        t.add_column(col, justify="right")
    for v in verdicts:
        t.add_row(
            str(v["head_dim"]),
            str(v["seq"]),
            "yes" if v["causal"] else "no",
            v["mode"],
            v.get("kernel", "pallas_gpu"),
            v.get("reference") or "–",
            ratio(v.get("speed")) or "–",
            f">= {v['target']}x",
            "[green]yes" if v["met"] else "[red]no",
            v["note"],
        )
    return t


# ------------------------------------------------------------------------------- parallelism


def collectives(points, title: str) -> Table:
    t = Table(title=title)
    for col in ("op", "axis", "W", "size", "time", "algbw GB/s", "busbw GB/s"):
        t.add_column(col, justify="right" if col not in ("op", "axis") else "left")
    for p in points:
        t.add_row(
            p.op,
            str(p.axis),
            str(p.group_size),
            size(p.size_bytes),
            duration(p.result.median_s),
            f"{p.algbw / 1e9:,.2f}",
            f"{p.busbw / 1e9:,.2f}",
        )
    return t


def _by(recs: list[dict], experiment: str, what: str) -> list[dict]:
    return [r for r in recs if r["config"].get("experiment") == experiment and r["what"] == what]


def _value(recs, experiment, what, **match):
    for r in _by(recs, experiment, what):
        if all(r["config"].get(k) == v for k, v in match.items()):
            return r["value"]
    return None


def _ms(x) -> str:
    return "—" if x is None else f"{x * 1e3:,.2f}"


def scaling(recs: list[dict]) -> list[Table]:
    """The scaling study's three tables: strong scaling, DP extrapolation, remat × batch."""
    sim = any(r["config"].get("simulated_devices") for r in recs)
    t1 = Table(
        title="scaling (strong, fixed global batch)" + (" · simulated CPU devices" if sim else "")
    )
    t1.caption = "collectives: HLO bus bytes / busbw measured per kind (derived); compute: the rest"
    cols = ("strategy", "devices", "mesh", "step ms", "collectives ms", "compute ms", "MiB/dev")
    for col in cols:
        t1.add_column(col, no_wrap=True)
    for r in _by(recs, "scaling", "step time"):
        c = r["config"]
        key = dict(strategy=c["strategy"], devices=c["devices"])
        comm = _value(recs, "scaling", "collective time (HLO bytes / measured busbw)", **key)
        comp = _value(recs, "scaling", "compute time (step - collectives)", **key)
        mem = _value(recs, "scaling", "memory per device", **key)
        t1.add_row(
            c["strategy"],
            str(c["devices"]),
            c["mesh"],
            _ms(r["value"]),
            _ms(comm),
            _ms(comp),
            mib(mem, 2),
        )
    rows = _by(recs, "dp extrapolation", "DP efficiency (extrapolated, no overlap)")
    src = rows[0]["config"]["bandwidth_source"] if rows else ""
    t2 = Table(title=f"data-parallel efficiency — EXTRAPOLATED, not measured (bandwidth: {src})")
    for col in (
        "devices",
        "per-device batch",
        "compute ms (measured)",
        "all-reduce ms (model)",
        "efficiency",
        "with overlap",
    ):
        t2.add_column(col)
    for r in rows:
        c = r["config"]
        what = "DP efficiency (extrapolated, perfect overlap)"
        over = _value(recs, "dp extrapolation", what, devices=c["devices"])
        t2.add_row(
            str(c["devices"]),
            str(c["per_device_batch"]),
            _ms(c["compute_s"]),
            _ms(c["comm_s"]),
            percent(r["value"]),
            percent(over),
        )
    t3 = Table(title="remat × batch on one device (scanned blocks): the real compiled step")
    for col in ("remat", "batch", "step ms", "peak MiB (memory_analysis)", "temporaries MiB"):
        t3.add_column(col)
    for r in _by(recs, "remat", "peak memory per device"):
        c = r["config"]
        step = _value(recs, "remat", "step time", remat=c["remat"], batch=c["batch"])
        t3.add_row(
            c["remat"],
            str(c["batch"]),
            _ms(step),
            mib(r["value"], 2),
            mib(c.get("temp_bytes"), 2),
        )
    return [t1, t2, t3]


# ------------------------------------------------------------------------------- steps


def step_compare(results: dict, title: str, baseline: str = "bare") -> Table:
    """`lab.measure.timing.compare` results: times and the ratio to the baseline."""
    t = Table(title=title)
    for col in ("", "median", "p10", "p90", "runs", f"ratio vs {baseline}"):
        t.add_column(col, justify="right")
    for name, r in results.items():
        t.add_row(
            name,
            duration(r["median_s"]),
            duration(r["p10_s"]),
            duration(r["p90_s"]),
            str(r["runs"]),
            f"{r['ratio']:.3f}",
        )
    return t


def tune_step(rows: list[dict], top: dict | None, title: str) -> Table:
    t = Table(title=title)
    for col in ("remat", "batch", "compiled MiB/device", "step", "tokens/s", "MFU", ""):
        t.add_column(col, justify="right")
    for r in rows:
        ran = "tokens_per_s" in r
        t.add_row(
            r["remat"],
            str(r["batch"]),
            mib(r.get("memory_bytes"), 0) if r.get("memory_bytes") else "–",
            duration(r["step_s"]) if ran else f"skipped: {r['skipped']}",
            f"{r['tokens_per_s']:,.0f}" if ran else "",
            percent(r["mfu"]) if ran and r["mfu"] is not None else "",
            "← best" if r is top else "",
        )
    return t


# ------------------------------------------------------------------------------- ceilings


def _vs_spec(what: str, value, spec) -> str:
    """Share of the datasheet figure, where the device has a spec entry."""
    if spec is None or value is None:
        return ""
    if what.startswith("matmul ") and "numpy" not in what and "/" not in what:
        dtype = what.split()[1]
        key = "tf32" if dtype == "float32" and "default" in what else dtype
        peak = spec.peak_flops.get(key)
        return f"{percent(value / peak, 0)} of {key} spec" if peak else ""
    if what.startswith("copy"):
        return f"{percent(value / spec.memory_bandwidth, 0)} of spec"
    return ""


def ceilings(result: dict, title: str) -> Table:
    t = Table(title=title)
    for col in ("measurement", "value", "note", "vs datasheet"):
        t.add_column(col)
    for what, value, unit, note in result["rows"]:
        if value is None:
            text = "n/a"
        else:
            text = rate(value, unit) if unit in ("FLOP/s", "B/s") else f"{value:.3g} {unit}"
        t.add_row(what, text, note, _vs_spec(what, value, result["spec"]))
    return t


# ------------------------------------------------------------------------------- ledger


def verdicts(vs) -> Table:
    """The claims ledger's verdicts for the terminal."""
    colours = {"holds": "green", "off": "red", "predicted": "yellow"}
    t = Table(title="claims ledger")
    for col in ("id", "claim", "verdict"):
        t.add_column(col)
    for v in vs:
        colour = colours.get(v.status, "dim")
        text = v.claim.text if len(v.claim.text) < 70 else v.claim.text[:67] + "…"
        t.add_row(v.claim.id, text, f"[{colour}]{v.status}[/{colour}]")
    return t


# ------------------------------------------------------------------------------- serving


def serving_prefill(rows: list[dict], title: str) -> Table:
    """Prefill points of lab.studies.serving: the prompt through the model at once."""
    t = Table(title=title)
    for col in ("batch", "prompt", "latency", "p10–p90", "tokens/s", "GFLOP/s", "compile"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            str(r["batch"]),
            str(r["prompt_len"]),
            duration(r["median_s"]),
            f"{duration(r['p10_s'])}–{duration(r['p90_s'])}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['flops_per_s'] / 1e9:,.1f}",
            duration(r["compile_s"]),
        )
    return t


def serving_decode(rows: list[dict], title: str, *, ridge: float) -> Table:
    """Decode points: time per step, tokens/s, bytes a step must move, the bandwidth that
    makes and its share of the measured memory roof; FLOPs per byte against the ridge."""
    t = Table(title=title)
    cols = ("batch", "weights", "cache", "ms/step", "tokens/s", "bytes/step", "GB/s", "% roof")
    for col in (*cols, "FLOP/B", "bound"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            str(r["batch"]),
            "int8" if r.get("int8_weights") else "float",
            "int8" if r["int8_cache"] else "float",
            f"{r['ms_per_token']:,.2f}",
            f"{r['tokens_per_s']:,.1f}",
            size(r["bytes"]),
            f"{r['bytes_per_s'] / 1e9:,.2f}",
            percent(r["memory_roof_share"], 0),
            f"{r['intensity']:.2f}",
            "memory" if r["intensity"] < ridge else "compute",
        )
    return t


def serving_int8(e: dict, speedup: dict) -> Table:
    """What int8 weights and an int8 KV cache cost in accuracy and buy in bytes and speed."""
    t = Table(title="int8 weights (per output channel) and int8 KV cache", show_header=False)
    t.add_row(
        "weights",
        f"{size(e['weight_bytes_float'])} → {size(e['weight_bytes_int8'])} "
        f"({ratio(e['weight_bytes_float'] / e['weight_bytes_int8'])} smaller)",
    )
    t.add_row(
        "loss on the bundled text",
        f"{e['loss_float']:.4f} float, {e['loss_int8']:.4f} "
        f"int8 weights ({e['loss_int8'] - e['loss_float']:+.4f})",
    )
    t.add_row(
        "decode logits vs float",
        f"relative RMS {e['logits_rel_rms']:.2e}, max |Δ| "
        f"{e['logits_max_abs']:.3g} (logits up to {e['logits_scale']:.3g}); same top-1 "
        f"token {percent(e['top1_agreement'], 1)}",
    )
    for b, x in sorted(speedup.items()):
        t.add_row(f"decode speed-up, batch {b}", ratio(x))
    return t


def serving_summary(s: dict, roofs) -> Table:
    """The derived figures of a serving study (lab.studies.serving.summarise)."""
    t = Table(title="what decoding is bound by", show_header=False)
    t.add_row(
        "memory roof (best measured)",
        f"{roofs.bandwidth / 1e9:,.2f} GB/s, set by {roofs.how}; compute roof "
        f"{roofs.peak_flops / 1e9:,.1f} GFLOP/s ({roofs.dtype} matmul); "
        f"ridge {roofs.ridge:.1f} FLOP/B",
    )
    t.add_row(
        "batch 1",
        f"{percent(s['batch1_roof_share'], 0)} of the memory roof, {s['batch1_intensity']:.2f} "
        "FLOP/B: memory-bound"
        if s["batch1_intensity"] < roofs.ridge
        else "compute-bound",
    )
    crit = s["critical_batch"]
    t.add_row(
        "critical batch (intensity = ridge)",
        "never (the cache's bytes grow with the FLOPs)" if math.isinf(crit) else f"{crit:,.1f}",
    )
    if "output_input_cost_ratio" in s:
        p, d = s["best_prefill"], s["best_decode"]
        t.add_row(
            "output / input token cost",
            f"{s['output_input_cost_ratio']:,.1f}× at the best rates (prefill "
            f"{p['tokens_per_s']:,.0f} tok/s at batch {p['batch']}, decode "
            f"{d['tokens_per_s']:,.1f} tok/s at batch {d['batch']}); "
            f"{s['output_input_cost_ratio_batch1']:,.0f}× against decode at batch 1",
        )
    return t


def serving_plans(rows: list[dict], title: str) -> Table:
    """Decode steps compiled for a target: memory per device, compiler beside calculator."""
    t = Table(title=title)
    cols = ("weights/cache", "batch", "context", "compiled/device", "calculator", "HBM", "fits")
    for col in cols:
        t.add_column(col, justify="right")
    for r in rows:
        got = (r["compiled"] or {}).get("total_bytes")
        cap = r["capacity_bytes"]
        fits = "n/a" if got is None or cap is None else ("yes" if got <= cap else "no")
        if fits != "n/a":
            fits += f" ({size(abs(cap - got))} {'free' if got <= cap else 'over'})"
        elif r.get("refused"):
            fits = f"no: the compiler refused it ({r['refused']})"
        t.add_row(
            "int8" if r["int8"] else "float",
            str(r["batch"]),
            str(r["context"]),
            size(got),
            size(r["predicted"]["total"]),
            size(cap),
            fits,
        )
    return t


def prediction_rows(rows, fits: dict) -> Table:
    """One row per published point: what was measured, what the model predicts, the error,
    and whether the point calibrated the model or was held out (lab.studies.prediction)."""
    t = Table(title="the step-time model against published measurements (predicted)")
    for col in (
        "point",
        "publisher",
        "hardware",
        "work",
        "published",
        "predicted",
        "error",
        "role",
    ):
        t.add_column(col)
    for r in sorted(rows, key=lambda r: (r.role == "dropped", r.hardware, r.id)):
        unit = r.unit.split("(")[0].strip()
        pred = "—" if r.predicted is None else f"{r.predicted:,.4g}"
        err = "—" if r.error is None else f"{r.error:+.0%}"
        role = r.role if r.role != "dropped" else f"dropped: {r.note}"
        t.add_row(
            r.id, r.publisher, r.hardware, r.workload, f"{r.published:,.4g} {unit}", pred, err, role
        )
    for v, f in fits.items():
        t.caption = (t.caption + "; " if t.caption else "fitted on the calibration points: ") + (
            f"{v}: compute {f['compute_efficiency']:.2f}, memory {f['memory_efficiency']:.2f}, "
            f"op {f['op_overhead_s'] * 1e6:.1f} µs, collective {f['link_latency_s'] * 1e6:.1f} µs"
        )
    return t


def prediction_cpu_rows(rows, fit: dict) -> Table:
    """The CPU self-check: each lab.run configuration measured here and predicted."""
    t = Table(title="the step-time model on this CPU (measured vs predicted, one run)")
    for col in ("lab.run keys", "measured", "predicted", "error", "role"):
        t.add_column(col)
    for r in rows:
        t.add_row(
            r.config, duration(r.measured_s), duration(r.predicted_s), f"{r.error:+.0%}", r.role
        )
    t.caption = (
        f"fitted on the calibration rows: compute {fit['compute_efficiency']:.2f} of the "
        f"measured matmul peak, memory {fit['memory_efficiency']:.2f} of the measured copy "
        f"bandwidth, {fit['op_overhead_s'] * 1e6:.1f} µs per op"
    )
    return t


def prediction_here_rows(rows, device_kind: str) -> Table:
    """The model against the accelerator at hand: measured, predicted, the error and where the
    predicted time goes (nothing fitted on these rows: all held out)."""
    t = Table(title=f"the step-time model on {device_kind} (measured vs predicted, held out)")
    for col in ("lab.run keys", "measured", "predicted", "error", "predicted breakdown"):
        t.add_column(col)
    for r in rows:
        if r.error is None:
            t.add_row(r.config, "—", "—", "—", r.error_text)
            continue
        parts = sorted(r.breakdown.items(), key=lambda kv: -kv[1])[:3]
        where = ", ".join(f"{k} {duration(v)}" for k, v in parts if v)
        t.add_row(
            r.config, duration(r.measured_s), duration(r.predicted_s), f"{r.error:+.0%}", where
        )
    return t


def prediction_markdown(records) -> list[str]:
    """The ledger's prediction section as Markdown lines: the error lines, then one table row
    per published point (records of experiments/prediction.py; empty without them)."""
    points = [r for r in records if r["config"].get("series") == "prediction_point"]
    if not points:
        return []
    lines = []
    for name in ("prediction_error", "prediction_fallback_error"):
        for r in (x for x in records if x["config"].get("series") == name):
            c = r["config"]
            lines.append(
                f"- {r['what']}: **{r['value']:.0%}**, worst {c['worst_ratio']:.2f}×, over "
                f"{c['points']} points" + (f" ({c['source']})" if c.get("source") else "")
            )
    lines += [
        "",
        "| point | publisher | hardware | work | published | predicted | error | role |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = {"held-out": 0, "calibration": 1, "dropped": 2}
    for r in sorted(points, key=lambda r: (order.get(r["config"]["fit_role"], 3), r["what"])):
        c = r["config"]
        unit = r["unit"].split("(")[0].strip()
        pred = "—" if r["value"] is None else f"{r['value']:,.4g}"
        err = "—" if c.get("error") is None else f"{c['error']:+.0%}"
        role = c["fit_role"] + (f": {c['note']}" if c.get("note") else "")
        cells = [c["point"], c["publisher"], c["hardware"], c["workload"]]
        cells += [f"{c['published']:,.4g} {unit}", pred, err, role.replace("|", "/")]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]

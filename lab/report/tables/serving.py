"""lab.serve: prefill and decode points, int8's cost and gain, what decoding is bound by, and
decode steps compiled for a target. Each renderer takes the study's types
(lab.measure.serving), whose fields and properties say what every figure is.
"""

import math

from rich.table import Table

from lab.measure import cost
from lab.measure.serving import (
    OVERHEAD_SHARE,
    DecodePoint,
    Int8Error,
    PeerPoint,
    PlanRow,
    PrefillPoint,
    Roofs,
    Summary,
)
from lab.report.format import duration, percent, ratio, rough, size


def serving_prefill(rows: list[PrefillPoint], title: str) -> Table:
    """Prefill points of lab.studies.serving: the prompt through the model at once."""
    t = Table(title=title)
    for col in ("batch", "prompt", "latency", "p10–p90", "tokens/s", "GFLOP/s", "compile"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            str(r.batch),
            str(r.prompt_len),
            duration(r.bench.median_s),
            f"{duration(r.bench.p10_s)}–{duration(r.bench.p90_s)}",
            f"{r.tokens_per_s:,.0f}",
            f"{r.flops_per_s / 1e9:,.1f}",
            duration(r.bench.compile_s),
        )
    return t


def serving_decode(rows: list[DecodePoint], title: str, *, peak_flops: float) -> Table:
    """Decode points: time per step, tokens/s, bytes a step must move, the bandwidth that
    makes and its share of the measured memory roof; FLOPs per byte, and what bounds the step
    (DecodePoint.bound: the roof its FLOPs per byte put it under, or overhead where it
    reaches under OVERHEAD_SHARE of both roofs)."""
    t = Table(title=title)
    cols = ("batch", "weights", "cache", "ms/step", "tokens/s", "bytes/step", "GB/s", "% roof")
    for col in (*cols, "FLOP/B", "bound"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            str(r.batch),
            "int8" if r.int8_weights else "float",
            "int8" if r.int8_cache else "float",
            f"{r.ms_per_token:,.2f}",
            f"{r.tokens_per_s:,.1f}",
            size(r.bytes),
            f"{r.bytes_per_s / 1e9:,.2f}",
            percent(r.memory_roof_share, 0),
            f"{r.intensity:.2f}",
            r.bound(peak_flops),
        )
    return t


def serving_int8(e: Int8Error, speedup, points: list[DecodePoint] = ()) -> Table:
    """What int8 weights and an int8 KV cache cost in accuracy, for each way the weights
    were multiplied (a row per matmul, named, with the batches whose speed row kept it:
    `points`, the int8 decode points), and buy in bytes and speed; `speedup`: (batch, int8
    tokens/s over float) pairs (Summary.int8_speedup)."""
    t = Table(title="int8 weights (per output channel) and int8 KV cache", show_header=False)
    t.add_row(
        "weights",
        f"{size(e.weight_bytes_float)} → {size(e.weight_bytes_int8)} "
        f"({ratio(e.weight_bytes_float / e.weight_bytes_int8)} smaller)",
    )
    window = e.window_len or e.prompt_len
    t.add_row(
        f"loss on the bundled text ({e.windows} window{'s' if e.windows > 1 else ''} of "
        f"{window:,} tokens spread over it, {e.windows * (window - 1):,} tokens predicted)",
        f"{e.loss_float:.4f} float weights",
    )
    rows: dict[tuple[str, str], list] = {}  # matmuls whose figures print the same: one row
    for m in e.matmuls:
        how = "int8 activations too" if m.matmul == "w8a8" else "weight-only"
        # the windows' spread: a change within about two standard errors is noise
        se = f" ± {m.loss_change_se:.4f} s.e. over windows" if m.loss_change_se is not None else ""
        text = (
            f"loss {m.loss_int8:.4f} ({e.loss_change(m.matmul):+.4f}{se}); decode logits vs "
            f"float: relative RMS {m.logits_rel_rms:.2e}, max |Δ| {m.logits_max_abs:.3g} "
            f"(logits up to {e.logits_scale:.3g}); same top-1 token {m.top1_same} of "
            f"{m.positions} ({percent(m.top1_agreement, 1)})"
        )
        rows.setdefault((how, text), []).append(m.matmul)
    for (how, text), names in rows.items():
        kept = sorted({p.batch for p in points if p.matmul in names})
        if kept:
            how += f"; kept at batch {', '.join(map(str, kept))}"
        plural = "s" if len(names) > 1 else ""
        t.add_row(f"int8 weights, {', '.join(names)} matmul{plural} ({how})", text)
    for b, x in sorted(dict(speedup).items()):
        t.add_row(f"decode speed-up, batch {b}", ratio(x))
    return t


def serving_summary(s: Summary, roofs: Roofs) -> Table:
    """The derived figures of a serving study (lab.studies.serving.study.summarise)."""
    t = Table(title="what decoding is bound by", show_header=False)
    t.add_row(
        "memory roof (best measured)",
        f"{roofs.bandwidth / 1e9:,.2f} GB/s, set by {roofs.how}; compute roof "
        f"{roofs.peak_flops / 1e9:,.1f} GFLOP/s ({roofs.peak_name}); "
        f"ridge {roofs.ridge:.1f} FLOP/B",
    )
    if roofs.copy_after:  # the host's bandwidth before and after the sweep
        before, after = roofs.copy["bytes_per_s"], roofs.copy_after["bytes_per_s"]
        moved = roofs.copy_moved
        note = (
            f": it moved {percent(moved, 0)} during the run (a shared host?), and every share "
            "of the roof with it"
            if roofs.copy_noisy
            else ""
        )
        t.add_row(
            "copy before / after the sweep",
            f"{before / 1e9:,.2f} / {after / 1e9:,.2f} GB/s{note}",
        )
    rate = roofs.best_read
    if rate:  # decode mostly reads: its share of a pure read stream, beside the roof
        t.add_row(
            "read stream (sum of x, best)",
            f"{rate / 1e9:,.2f} GB/s ({percent(rate / roofs.bandwidth, 0)} of the memory roof); "
            f"batch {s.smallest.batch} reads at {percent(s.smallest.bytes_per_s / rate, 0)} of it",
        )
    one = s.smallest
    bound = one.bound(roofs.peak_flops)
    if bound == "overhead":  # near neither roof: naming one would say what does not bind
        bound += f"-bound (under {percent(OVERHEAD_SHARE, 0)} of both roofs)"
    else:
        bound += "-bound"
    t.add_row(  # the smallest batch measured: batch 1 unless the mesh's batch split needs more
        f"batch {one.batch}",
        f"{percent(s.batch1_roof_share, 0)} of the memory roof, {s.batch1_intensity:.2f} "
        f"FLOP/B: {bound}",
    )
    t.add_row("critical batch (intensity = ridge)", critical_batch_text(s))
    if s.best_prefill is not None:
        p, d = s.best_prefill, s.best_decode
        one = s.output_input_cost_ratio_batch1
        one_text = f"{one:,.0f}" if one >= 100 else f"{one:,.1f}"  # 1.35 is not "1"
        t.add_row(
            "output / input token cost",
            f"{s.output_input_cost_ratio:,.1f}× at the best rates (prefill "
            f"{p.tokens_per_s:,.0f} tok/s at batch {p.batch}, decode "
            f"{d.tokens_per_s:,.1f} tok/s at batch {d.batch}); "
            f"{one_text}× against decode at batch {s.smallest.batch}",
        )
    return t


def critical_batch_text(s) -> str:
    """The critical batch as the summary prints it: never, a figure, or, where a few % of a
    roof would move it many times over, a rounded estimate that says why."""
    crit, k = s.critical_batch, s.critical_batch_sensitivity
    if math.isinf(crit):
        return "never (the cache's bytes grow with the FLOPs)"
    if k <= cost.ILL_DETERMINED:
        return f"{crit:,.1f}"
    above = s.cache_intensity / s.ridge - 1
    return (
        f"~{rough(crit)}, not well determined: decode's intensity can only approach "
        f"{s.cache_intensity:.2f} FLOP/B (the FLOPs per cache byte), {percent(above, 0)} above "
        f"the ridge, so 1% in either roof moves it {k:,.0f}%"
    )


_PLAN_CAPTION = (
    "per device. compiled: the compiler's total (arguments, outputs not aliased to them, "
    "temporaries), of it args (weights + cache: what the calculator counts) and temp (the "
    "step's temporaries: dequantised int8 weights, attention scores); calculator: "
    "parameters × bytes + the KV cache, split as the plan splits them"
)


def serving_plans(rows: list[PlanRow], title: str) -> Table:
    """Decode steps compiled for a target: memory per device, compiler beside calculator.
    The compiled total is split into what the calculator counts (the step's arguments: the
    weights and the cache) and what it does not (temporaries: an int8 step's dequantised
    weights, the attention's scores), so the two are compared like for like."""
    t = Table(title=title, caption=_PLAN_CAPTION)
    cols = (
        "weights/cache",
        "batch",
        "context",
        "compiled",
        "args",
        "temp",
        "calculator",
        "usable",
        "fits",
    )
    for col in cols:
        t.add_column(col, justify="right")
    for r in rows:
        mem = r.compiled or {}
        got = r.compiled_bytes
        cap = r.capacity_bytes
        fits = "n/a" if got is None or cap is None else ("yes" if got <= cap else "no")
        if fits != "n/a":
            fits += f" ({size(abs(cap - got))} {'free' if got <= cap else 'over'})"
        elif r.refused:
            fits = f"no: the compiler refused it ({r.refused})"
        t.add_row(
            "int8" if r.int8 else "float",
            str(r.batch),
            str(r.context),
            size(got),
            size(mem.get("argument_bytes")),
            size(mem.get("temp_bytes")),
            size(r.predicted["total"]),
            size(cap),
            fits,
        )
    return t


# what each matmul a decode point tries is, said once under their lines
MATMUL_NAMES = {
    "xla": "XLA's dot",
    "w8a8": "XLA's int8 × int8 → int32 dot",
    "native": "the native CPU kernel on every core",
    "native1": "the native CPU kernel on the calling thread alone",
}


def serving_matmuls(points: list[DecodePoint]) -> list[str]:
    """One line per decode point: the matmul it kept and every candidate's tokens/s; then
    one line naming the candidates."""
    out, seen = [], {}
    for p in points:
        weights = "int8" if p.int8_weights else "float"
        tried = ", ".join(f"{m} {v:,.1f}" for m, v in dict(p.matmuls).items())
        out.append(f"batch {p.batch} {weights}: {p.matmul} (tokens/s: {tried})")
        seen.update(dict.fromkeys(m for m in dict(p.matmuls) if m in MATMUL_NAMES))
    if seen:
        out.append("; ".join(f"{m}: {MATMUL_NAMES[m]}" for m in seen))
    return out


def serving_peers(rows: list[PeerPoint], decode_steps: int = 0) -> list[str]:
    """One line per batch: the PyTorch decoder's tokens/s and lab.serve's over it, and the
    steps per sample where budget= made them fewer than the lab's (`decode_steps`)."""
    return [
        f"batch {r.batch}: PyTorch {r.torch} ({r.threads} thread{'s' if r.threads != 1 else ''}) "
        f"{r.tokens_per_s:,.1f} tokens/s; lab.serve {r.lab_over_torch:.2f}× that"
        + (
            f" (budget= cut its samples to {r.steps} step{'s' if r.steps != 1 else ''})"
            if r.steps and decode_steps and r.steps < decode_steps
            else ""
        )
        for r in rows
    ]

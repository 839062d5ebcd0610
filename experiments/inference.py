"""C16, C18: requests per second of a BERT-base-sized classifier, and what a token costs.

The lab's transformer at BERT-base size (12 layers, d_model 768, 12 heads, d_ff 3072) with a
small output head stands in for the articles' sentiment classifier: one request is one
128-token sequence, forward only, timed at several batch sizes (experiments.common.
forward_probe). C16 scales the best CPU rate to the article's 16 cores by the cores this
process used; the GPUs' rates are predicted from their datasheet peak × the forward's MFU
measured here. C18 prices prefill tokens of Llama-2 7B and 70B on H100s the same way, with
the rental price of the spec table.

C18 (output tokens), C21, C22: the lab's model is served (lab.studies.serving) on the backend
present — prefill and decode timed apart, decode over a batch sweep against the measured memory
roof, all context: what this CPU reaches says nothing of an H100 — and what a self-hoster pays
per output token is predicted for Llama-2 7B/70B on H100s by the step-time model of lab.serve's
decode step compiled for them (lab.predict, as it predicts the published decode points; its
error is its error on those held out). C22 sizes a 70B model's serving memory (weights + KV
cache) at bf16, int8 and int4 and with weights offloaded to host memory (calculator), and under
size=full compiles the int8 decode step for one H100 (lab.plans; compiled, not run). Prefill
(C18's input tokens, C21's numerator) still uses the fallback rule (datasheet peak × the
forward's MFU measured here), labelled with its error on the held-out published prefills
(lab.studies.prediction).
"""

import math

from experiments.common import (
    accel_peak,
    backend,
    cores_used,
    fallback,
    forward_probe,
    llama_preset,
    llama_shape,
    mfu_peak,
    pick,
    predicted_decode,
    record,
    say_step,
    spec_inputs,
)
from lab import plans
from lab.config import make_config
from lab.errors import ConfigError
from lab.measure import cost, memory, specs
from lab.measure.serving import NOISY_ROOF, Roofs, Study
from lab.session import open_session
from lab.studies.serving import compiled, study, weights
from lab.studies.serving.records import to_records

CLAIMS = ("C16", "C18", "C21", "C22")

BERT_BASE = dict(n_layers=12, d_model=768, n_heads=12, n_kv_heads=12, d_ff=3072)
ARTICLE_CORES = 16  # "CPU (16-core)"
REQUEST_TOKENS = 128
RPS_TARGETS = {"rtx-4090": "RTX 4090", "h100-sxm": "H100"}
RENTAL = ("t4", "rtx-4090", "a100-sxm4-80gb", "h100-sxm", "h200", "mi300x")
PREFILL_SEQ = 2048  # context over which the 7B/70B prefill's attention is counted


def _sweep(size: str) -> list[dict]:
    shape = pick(size, tiny={}, quick=BERT_BASE, full=BERT_BASE)
    model = make_config(preset="tiny", **shape).model
    seq = pick(size, tiny=32, quick=REQUEST_TOKENS, full=REQUEST_TOKENS)
    budget = pick(size, tiny=0.01, quick=0.5, full=2.0)
    # the classifier the rows timed, named in their records (size=tiny's is not BERT-base)
    named = "BERT-base size" if shape else "the tiny preset"
    classifier = f"{named}: {model.n_layers} layers, d_model {model.d_model}, {seq} tokens"
    return [
        {**forward_probe(model, batch=b, seq_len=seq, budget_s=budget), "classifier": classifier}
        for b in pick(size, tiny=(1, 4), quick=(1, 8), full=(1, 8, 32))
    ]


def _classifier_requests_per_s(rows: list[dict], mfu: float) -> list[dict]:
    """C16: classifier requests/s at each batch measured here; on CPU the best scaled to the
    article's 16 cores, the GPUs' rates predicted."""
    recs = []
    for r in rows:
        recs.append(
            record(
                "C16",
                None,
                f"classifier requests/s at batch {r['batch']} ({r['classifier']})",
                r["requests_per_s"],
                "req/s",
                role="context",
                series="inference_batch",
                batch=r["batch"],
                seq_len=r["seq_len"],
                median_s=r["median_s"],
                flops_per_request=r["flops_per_request"],
            )
        )
    best = max(rows, key=lambda r: r["requests_per_s"])
    cores = cores_used()
    if backend() == "cpu":
        recs.append(
            record(
                "C16",
                "cpu16_rps",
                f"best requests/s (batch {best['batch']}, {best['classifier']}) × "
                f"{ARTICLE_CORES}/{cores} cores",
                best["requests_per_s"] * ARTICLE_CORES / cores,
                "req/s",
                # a 16-core CPU is absent: linear scaling in cores is an extrapolation
                label="predicted",
                model_error="linear scaling with cores, unchecked here (an upper bound: the "
                "memory bandwidth and the clocks do not grow with the cores)",
                cores_used=cores,
                seq_len=best["seq_len"],
                inputs={"requests_per_s": best["requests_per_s"]},
            )
        )
    else:
        recs.append(
            record(
                "C16",
                "gpu_rps",
                f"best requests/s (batch {best['batch']})",
                best["requests_per_s"],
                "req/s",
                label="derived",
            )
        )
    for key, name in RPS_TARGETS.items():
        peak, dtype = accel_peak(key)
        recs.append(
            record(
                "C16",
                "gpu_rps",
                f"{name}: {dtype} peak × forward MFU measured here over FLOPs per request",
                peak * mfu / best["flops_per_request"],
                "req/s",
                label="predicted",
                target=key,
                inputs={"mfu_forward": mfu, "flops_per_request": best["flops_per_request"]},
                model_error=fallback(mfu, "prefill"),
                **spec_inputs(key, f"peak_flops.{dtype}"),
            )
        )
    return recs


def _prefill_flops_per_token(shape: dict) -> float:
    embed = shape["vocab_size"] * shape["d_model"]
    return cost.transformer_flops_per_token(
        shape["n_params"] - embed, shape["n_layers"], PREFILL_SEQ, shape["d_model"], training=False
    )


def _input_token_cost(mfu: float) -> list[dict]:
    """C18: $ per 1M input tokens, Llama-2 7B and 70B prefill on H100s at the forward MFU
    measured here (predicted)."""
    key = "h100-sxm"
    spec = specs.SPECS[key]
    peak, dtype = accel_peak(key)
    recs = []
    for name, metric in (
        ("7B", "usd_per_m_input_tokens_7b"),
        ("70B", "usd_per_m_input_tokens_70b"),
    ):
        shape = llama_shape(name)
        gpus = math.ceil(2 * shape["n_params"] / spec.memory_bytes)  # bf16 weights must fit
        tokens_per_s = gpus * peak * mfu / _prefill_flops_per_token(shape)
        usd = gpus * spec.price_usd_per_hour / (tokens_per_s * 3600) * 1e6
        recs.append(
            record(
                "C18",
                metric,
                f"Llama-2 {name} prefill on {gpus} × H100 at the forward MFU "
                "measured here: $ per 1M input tokens",
                usd,
                "$",
                label="predicted",
                target=key,
                gpus=gpus,
                tokens_per_s=tokens_per_s,
                inputs={"mfu_forward": mfu},
                model_error=fallback(mfu, "prefill"),
                **spec_inputs(key, f"peak_flops.{dtype}", "price_usd_per_hour"),
            )
        )
    for k in RENTAL:
        s = specs.SPECS[k]
        recs.append(
            record(
                "C18",
                None,
                f"{s.name}: on-demand $/hour (spec table, {s.price_as_of})",
                s.price_usd_per_hour,
                "$",
                label="derived",
                role="reference",
                target=k,
                source=s.source_of("price_usd_per_hour"),
            )
        )
    return recs


# --- serving: prefill and decode of the lab's model, then 7B/70B on H100s -----------------

SERVE_CONTEXT = PREFILL_SEQ  # tokens of KV cache per sequence in the 7B/70B predictions
MAX_SERVING_BATCH = 256
# The batch and context at which the claim states the 70B serving memory
SERVE_70B_BATCH, SERVE_70B_CONTEXT = 1, 4096
# Share of a card's memory a server fills (the rest: runtime, fragmentation): vLLM's default
# gpu_memory_utilization. A JAX process takes 75% unless XLA_PYTHON_CLIENT_MEM_FRACTION says more.
HBM_USE = 0.9


def _serving_study(size: str) -> tuple[Study, str, str]:
    """lab.studies.serving on the backend present: the `base` preset from quick on (weights
    several times a CPU's last-level cache), tiny for the test suite; (the study, the preset,
    where its weights came from)."""
    preset = pick(size, tiny="tiny", quick="base", full="base")
    say_step(f"serving model={preset}: prefill and decode timed with a KV cache")
    session = open_session(make_config(preset=preset, steps=0, backend=backend()))
    plan = study.Plan(
        batches=pick(size, tiny=(1, 2), quick=(1, 4, 16), full=(1, 2, 4, 8, 16, 32, 64)),
        prefill_batches=pick(size, tiny=(1,), quick=(1,), full=(1, 4)),
        prompt_len=pick(size, tiny=8, quick=128, full=128),
        steps=pick(size, tiny=4, quick=16, full=32),
        budget_s=pick(size, tiny=0.01, quick=0.3, full=1.0),
        int8=size == "full",
    )
    decoding = weights.for_decoding(session, (*plan.batches, *plan.prefill_batches))
    session, params, source = weights.load_params(session, None, seed=0, decoding=decoding)
    return study.measure(session, params, plan), preset, source


def _noisy_roof(roofs: Roofs) -> list[dict]:
    """C21: a caution where the copy bandwidth moved more than NOISY_ROOF between before and
    after the serving sweep, as lab.serve calls it out (the memory roof every share is taken
    against moved with it); nothing on a steady host."""
    if not roofs.copy_noisy:
        return []
    before, after = roofs.copy["bytes_per_s"], roofs.copy_after["bytes_per_s"]
    return [
        record(
            "C21",
            None,
            f"CAUTION: the copy bandwidth {'rose' if after > before else 'fell'} "
            f"{abs(after / before - 1):.0%} during the serving "
            f"sweep ({before / 1e9:,.1f} GB/s before, {after / 1e9:,.1f} after; more than "
            f"{NOISY_ROOF:.0%}: a shared host?): decode's share of the memory roof, and C22's "
            "intensity over the ridge point, moved with it",
            after / before,
            "×",
            label="derived",
            role="context",
            noisy_roof=True,
            copy_before=before,
            copy_after=after,
        )
    ]


def _serving_records(out: Study, preset: str, source: str) -> list[dict]:
    """The study's own records (the decode plot's series) and C21/C22's measured evidence."""
    config = {"preset": preset, "weights": source, "claim": "C21", "metric": None}
    recs = to_records(out, {**config, "role": "context"})
    s, roofs = out.summary, out.roofs
    one = min(out.decode, key=lambda r: r.batch)
    recs.append(
        record(
            "C21",
            "output_input_cost_ratio",
            f"prefill tokens/s over decode tokens/s, best batch of each ({preset})",
            s.output_input_cost_ratio,
            "×",
            label="derived",
            prefill=s.best_prefill.tokens_per_s,
            prefill_batch=s.best_prefill.batch,
            decode=s.best_decode.tokens_per_s,
            decode_batch=s.best_decode.batch,
            batch1_ratio=s.output_input_cost_ratio_batch1,
        )
    )
    recs += _noisy_roof(roofs)
    recs.append(
        record(
            "C21",
            None,
            f"decode at batch 1 ({preset}): achieved bandwidth over the memory roof",
            one.memory_roof_share,
            "×",
            label="derived",
            role="context",
            bytes_per_s=one.bytes_per_s,
            memory_roof=roofs.bandwidth,
        )
    )
    recs.append(
        record(
            "C22",
            "decode_intensity_over_ridge",
            f"decode at batch 1 ({preset}): FLOPs per byte over the ridge point",
            one.intensity / roofs.ridge,
            "×",
            label="derived",
            intensity=one.intensity,
            ridge=roofs.ridge,
            memory_roof_share=one.memory_roof_share,
        )
    )
    return recs


def _llama_model(name: str):
    return make_config(preset=llama_preset(name)).model


def _decode_batch(model, gpus: int, key: str = "h100-sxm") -> int:
    """As many 2048-token bf16 caches as fit beside the bf16 weights in HBM_USE of `gpus`
    cards (tensor parallel: both split over them), at most MAX_SERVING_BATCH."""
    spec = specs.SPECS[key]
    one = memory.predict_serving_memory(model, batch=1, context=SERVE_CONTEXT, devices=gpus)
    free = HBM_USE * spec.memory_bytes - one["weights"]
    return max(1, min(MAX_SERVING_BATCH, int(free // one["kv_cache"])))


def _decode_rate(name: str, gpus: int, key: str = "h100-sxm") -> dict | None:
    """Predicted decode tokens/s of Llama-2 `name` on `gpus` H100s (tensor parallel) at the
    batch a server keeps in flight (`_decode_batch`): lab.serve's decode step compiled for them
    and timed by the step-time model (experiments.common.predicted_decode). None where it
    cannot be compiled here."""
    model = _llama_model(name)
    batch = _decode_batch(model, gpus, key)
    pred = predicted_decode(key, llama_preset(name), gpus, batch, SERVE_CONTEXT)
    if pred is None:
        return None
    per_gpu = memory.predict_serving_memory(
        model, batch=batch, context=SERVE_CONTEXT, devices=gpus
    )["total"]
    return {
        "batch": batch,
        "tokens_per_s": pred["tokens_per_s"],
        "step_s": pred["seconds"],
        "bytes_per_gpu": per_gpu,
        "breakdown": pred["breakdown"],
        "statement": pred["statement"],
    }


def _not_predicted(name: str, gpus: int) -> dict:
    """Where the decode step cannot be compiled for H100s here, the claim has no figure: a
    context record says why (no other rule stands in for the step-time model)."""
    return record(
        "C18",
        None,
        f"Llama-2 {name} decode on {gpus} × H100 not predicted: its decode step could not be "
        "compiled for H100s here (the gpu-plan extra: pip install -e '.[gpu-plan]')",
        None,
        "$",
        label="predicted",
        role="context",
        target="h100-sxm",
    )


def _output_token_cost(mfu: float, here_share: float | None = None) -> list[dict]:
    """C18, C21: $ per 1M output tokens, Llama-2 7B and 70B decode on H100s predicted by the
    step-time model of the decode step compiled for them, and output over input cost
    (predicted). `here_share`, the share of the memory roof decode reached at batch 1 on the
    backend measured, is kept beside them as context, never as an input: a CPU's load and
    batch-1 overheads say nothing of an H100's step at a server's batch."""
    key = "h100-sxm"
    spec = specs.SPECS[key]
    peak, dtype = accel_peak(key)
    context = {} if here_share is None else {"memory_roof_share_here": here_share}
    recs = []
    for name, metric in (
        ("7B", "usd_per_m_output_tokens_7b"),
        ("70B", "usd_per_m_output_tokens_70b"),
    ):
        shape = llama_shape(name)
        gpus = math.ceil(2 * shape["n_params"] / spec.memory_bytes)
        d = _decode_rate(name, gpus)
        if d is None:
            recs.append(_not_predicted(name, gpus))
            continue
        statement = d.pop("statement")
        usd = gpus * spec.price_usd_per_hour / (d["tokens_per_s"] * 3600) * 1e6
        recs.append(
            record(
                "C18",
                metric,
                f"Llama-2 {name} decode on {gpus} × H100, batch {d['batch']} (as many "
                f"{SERVE_CONTEXT}-token caches as fit in {HBM_USE:.0%} of the memory), "
                f"{d['tokens_per_s']:,.0f} tokens/s: "
                "$ per 1M output tokens",
                usd,
                "$",
                label="predicted",
                target=key,
                gpus=gpus,
                context=context,
                model_error=statement,
                **d,
                **spec_inputs(key, "memory_bandwidth", "memory_bytes", "price_usd_per_hour"),
            )
        )
        if name == "7B":
            prefill = gpus * peak * mfu / _prefill_flops_per_token(shape)
            recs.append(
                record(
                    "C21",
                    "output_input_cost_ratio",
                    f"Llama-2 7B on {gpus} × H100: prefill tokens/s (forward MFU measured here) "
                    f"over decode tokens/s (batch {d['batch']}, the decode step's step-time "
                    "model)",
                    prefill / d["tokens_per_s"],
                    "×",
                    label="predicted",
                    target=key,
                    prefill_tokens_per_s=prefill,
                    decode_tokens_per_s=d["tokens_per_s"],
                    inputs={"mfu_forward": mfu},
                    context=context,
                    model_error=f"{fallback(mfu, 'prefill')} (prefill); {statement} (decode)",
                    **spec_inputs(key, f"peak_flops.{dtype}", "memory_bandwidth"),
                )
            )
    return recs


def _serving_memory_70b() -> list[dict]:
    """C22: a 70B model's serving memory on one card, by the calculator: bf16, int8, int4 weights
    (the cache int8 with int8 and int4 weights), and bf16 with weights offloaded to host."""
    key = "h100-sxm"
    spec = specs.SPECS[key]
    model = _llama_model("70B")
    kw = dict(batch=SERVE_70B_BATCH, context=SERVE_70B_CONTEXT)
    recs = []
    for name, wb, cb in (("bf16", 2, 2), ("int8", 1, 1), ("int4", 0.5, 1)):
        m = memory.predict_serving_memory(model, weight_bytes=wb, cache_bytes=cb, **kw)
        recs.append(
            record(
                "C22",
                "serving_memory_70b_int8" if name == "int8" else None,
                f"Llama-2 70B serving memory, {name} weights, batch {SERVE_70B_BATCH}, context "
                f"{SERVE_70B_CONTEXT} (calculator; an H100 holds {spec.memory_bytes / 1e9:.0f} GB)",
                m["total"],
                "B",
                label="predicted",
                model_error="serving-memory calculator: weights + cache, which the compiled "
                "decode steps' arguments match within 15% in the serving plans' tests (3% in "
                "BENCHMARKS.md's 7B and 70B plans for H100 and TPU v5e); temporaries not counted",
                role="evidence" if name == "int8" else "context",
                target=key,
                **m,
            )
        )
    bf16 = memory.predict_serving_memory(model, **kw)
    cache = bf16["kv_cache"]
    fraction = max(0.0, 1 - (HBM_USE * spec.memory_bytes - cache) / bf16["weights"])
    m = memory.predict_serving_memory(model, offload_fraction=fraction, **kw)
    link = spec.host_bandwidth / 2  # one direction of the host link
    recs.append(
        record(
            "C22",
            None,
            f"Llama-2 70B bf16 with {fraction:.0%} of the weights in host memory: the time each "
            "decode step spends streaming them over PCIe (host link, one direction)",
            m["host_weights"] / link,
            "s",
            label="predicted",
            role="context",
            target=key,
            offload_fraction=fraction,
            **m,
            **spec_inputs(key, "host_bandwidth", "memory_bandwidth"),
        )
    )
    return recs


def _serving_plan_70b_int8() -> list[dict]:
    """C22: the 70B int8 decode step compiled for one H100 (size=full; needs the gpu-plan extra)."""
    target = "gpu:h100:1"
    try:
        plans.parse_target(target)
        cfg = make_config(preset=llama_preset("70B"), param_dtype="bfloat16", target=target)
        session = open_session(cfg)
        r = compiled.plan_serving(
            session, batch=SERVE_70B_BATCH, context=SERVE_70B_CONTEXT, int8=True
        )
    except ConfigError as e:  # no CUDA plugin or ptxas here: the calculator stands alone
        return [
            record(
                "C22",
                None,
                f"70B int8 plan for {target} not compiled: {e}",
                None,
                "B",
                label="compiled, not run",
                role="context",
            )
        ]
    got = r.compiled_bytes
    return [
        record(
            "C22",
            "serving_memory_70b_int8",
            f"Llama-2 70B decode step, int8 weights and cache, batch {SERVE_70B_BATCH}, context "
            f"{SERVE_70B_CONTEXT}: compiled memory on one H100",
            got,
            "B",
            label="compiled, not run",
            target="h100-sxm",
            predicted=r.predicted["total"],
            compile_s=r.compile_s,
        )
    ]


def run(size: str = "quick", plans: bool | None = None) -> list[dict]:
    rows = _sweep(size)
    best = max(rows, key=lambda r: r["flops_per_s"])
    mfu = best["flops_per_s"] / mfu_peak(size)
    out, preset, source = _serving_study(size)
    recs = (
        _classifier_requests_per_s(rows, mfu)
        + _input_token_cost(mfu)
        + _serving_records(out, preset, source)
    )
    # tens of seconds that time nothing here: said, not left under the last timing's line
    say_step("Llama-2 7B and 70B decode steps compiled for H100s, for the step-time model")
    recs += _output_token_cost(mfu, min(out.decode, key=lambda r: r.batch).memory_roof_share)
    recs += _serving_memory_70b()
    if size == "full" if plans is None else plans:
        recs += _serving_plan_70b_int8()
    return recs

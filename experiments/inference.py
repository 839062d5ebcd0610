"""C16, C18: requests per second of a BERT-base-sized classifier, and what a token costs.

The lab's transformer at BERT-base size (12 layers, d_model 768, 12 heads, d_ff 3072) with a
small output head stands in for the articles' sentiment classifier: one request is one
128-token sequence, forward only, timed at several batch sizes (experiments.common.
forward_probe). C16 scales the best CPU rate to the article's 16 cores by the cores this
process used; the GPUs' rates are predicted from their datasheet peak × the forward's MFU
measured here. C18 prices prefill tokens of Llama-2 7B and 70B on H100s the same way, with
the rental price of the spec table.
"""

import math
import os

from experiments.common import (
    accel_peak,
    backend,
    forward_probe,
    mfu_peak,
    pick,
    record,
    spec_inputs,
)
from experiments.memory import LLAMA
from lab.config import make_config
from lab.measure import cost, specs

CLAIMS = ("C16", "C18")

BERT_BASE = dict(n_layers=12, d_model=768, n_heads=12, n_kv_heads=12, d_ff=3072)
ARTICLE_CORES = 16  # "CPU (16-core)"
REQUEST_TOKENS = 128
RPS_TARGETS = {"rtx-4090": "RTX 4090", "h100-sxm": "H100"}
RENTAL = ("t4", "rtx-4090", "a100-sxm4-80gb", "h100-sxm", "h200", "mi300x")
PREFILL_SEQ = 2048  # context over which the 7B/70B prefill's attention is counted


def cores_used() -> int:
    """CPU cores this process may run on (XLA's CPU thread pool is sized to them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _sweep(size: str) -> list[dict]:
    shape = pick(size, tiny={}, quick=BERT_BASE, full=BERT_BASE)
    model = make_config(preset="tiny", **shape).model
    seq = pick(size, tiny=32, quick=REQUEST_TOKENS, full=REQUEST_TOKENS)
    budget = pick(size, tiny=0.01, quick=0.5, full=2.0)
    return [
        forward_probe(model, batch=b, seq_len=seq, budget_s=budget)
        for b in pick(size, tiny=(1, 4), quick=(1, 8), full=(1, 8, 32))
    ]


def _c16(rows: list[dict], mfu: float) -> list[dict]:
    recs = []
    for r in rows:
        recs.append(
            record(
                "C16",
                None,
                f"classifier requests/s at batch {r['batch']}",
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
                f"best requests/s (batch {best['batch']}) × {ARTICLE_CORES}/{cores} cores",
                best["requests_per_s"] * ARTICLE_CORES / cores,
                "req/s",
                # a 16-core CPU is absent: linear scaling in cores is an extrapolation
                label="predicted",
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
                **spec_inputs(key, f"peak_flops.{dtype}"),
            )
        )
    return recs


def _prefill_flops_per_token(shape: dict) -> float:
    embed = shape["vocab_size"] * shape["d_model"]
    return cost.transformer_flops_per_token(
        shape["n_params"] - embed, shape["n_layers"], PREFILL_SEQ, shape["d_model"], training=False
    )


def _c18(mfu: float) -> list[dict]:
    key = "h100-sxm"
    spec = specs.SPECS[key]
    peak, dtype = accel_peak(key)
    recs = []
    for name, metric in (
        ("7B", "usd_per_m_input_tokens_7b"),
        ("70B", "usd_per_m_input_tokens_70b"),
    ):
        shape = LLAMA[name]
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


def run(size: str = "quick") -> list[dict]:
    rows = _sweep(size)
    best = max(rows, key=lambda r: r["flops_per_s"])
    mfu = best["flops_per_s"] / mfu_peak(size)
    return _c16(rows, mfu) + _c18(mfu)

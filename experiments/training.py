"""C02, C04, C15, C17: how fast the lab's training step runs, in float32 and in bf16 compute.

One step (experiments.common.STEP_ARGS) is compiled and timed in float32 and in bfloat16
compute with float32 weights and AdamW state (the articles' mixed-precision recipe). From
it: C04's memory ratio and loss agreement (measured on any backend; the speedup only means
something where matrix units exist); the step's model FLOP/s and MFU against the matmul peak
measured in the same process. C15 and C17 divide published model sizes by that measured
FLOP/s. Figures for hardware that is absent (T4, RTX 4090, H100, A100 clusters) are
predicted: with plans=on, from the same step compiled for the GPUs the lab compiles for
(H100, A100) and timed by the step-time model (lab.predict); otherwise, and for GPUs with no
compiler here (T4, RTX 4090), by the fallback rule (the device's datasheet peak × the MFU
measured here). Each carries its error, measured on held-out published points. C02's
speed-up is never that rule: over this CPU's measured rate, the datasheet peak × the MFU
measured here is the peak ratio (the MFU cancels), shown as context; the prediction is this
CPU's step time over the step time predicted for the same step compiled for an H100.
"""

from experiments.common import (
    DAY_S,
    STEP_BUDGET_S,
    YEAR_S,
    accel_peak,
    backend,
    compute_dtype,
    cores_used,
    cpu_device,
    fallback,
    mfu_peak,
    mfu_peak_name,
    pick,
    predicted_step,
    record,
    spec_inputs,
    step_config,
    train_probe,
)
from lab.measure import cost, specs

CLAIMS = ("C02", "C04", "C15", "C17")
# The articles name no CPU for GPT-3's 355 years; C15 also gives this CPU's rate scaled to a
# large server CPU of one socket, so the verdict is seen not to rest on a 2-core machine.
SERVER_CORES = 128

# GPT-3 175B on 300B tokens (Brown et al. 2020, table 2.1 and section 2.2).
GPT3_PARAMS, GPT3_TOKENS = 175e9, 300e9
# GPT-2 small (Radford et al. 2019): 12 layers, d_model 768, 1024 context, a 50,257-token
# vocabulary; 124M parameters of which 85M outside the embeddings. Its output head is the
# embedding (tied), still a matmul every token: counted, as the lab counts its own head.
# C17's "GPT-like model" is read as this size.
GPT2_SMALL = {
    "nonembed": 85e6 + 50257 * 768,
    "n_layers": 12,
    "seq_len": 1024,
    "d_model": 768,
}
A100_CLUSTER = 1024  # GPUs of the GPT-3-scale run in Narayanan et al. 2021
SPEEDUP_TARGETS = {"t4": "T4 (the article's BERT GPU)", "h100-sxm": "H100"}


def gpt2_small_flops_per_token() -> float:
    g = GPT2_SMALL
    return cost.transformer_flops_per_token(
        g["nonembed"], g["n_layers"], g["seq_len"], g["d_model"]
    )


def _precision_pair(size: str) -> dict:
    """The same step in float32 and in bf16 compute, with losses over the same batches."""
    budget, steps = STEP_BUDGET_S[size], pick(size, tiny=3, quick=8, full=30)
    return {
        dtype: train_probe(step_config(size, dtype=dtype), budget_s=budget, loss_steps=steps)
        for dtype in ("float32", "bfloat16")
    }


def _mixed_precision_memory_and_speed(pair: dict) -> list[dict]:
    """C04: bf16 compute against float32 in the same step: compiled memory, step time and
    loss agreement."""
    f32, b16 = pair["float32"], pair["bfloat16"]
    m32, m16 = f32["memory"]["total_bytes"], b16["memory"]["total_bytes"]
    recs = [
        record(
            "C04",
            "mixed_precision_memory_ratio",
            "compiled memory of the step, bf16 compute (fp32 weights and AdamW) over float32",
            m16 / m32,
            "×",
            label="derived",
            bytes_bf16=m16,
            bytes_float32=m32,
            compiled_bf16=b16["memory"],
            compiled_float32=f32["memory"],
        ),
        record(
            "C04",
            "mixed_precision_speedup",
            "step time, float32 over bf16 compute (measured here)",
            f32["step"]["median_s"] / b16["step"]["median_s"],
            "×",
            label="derived",
            step_float32=f32["step"],
            step_bf16=b16["step"],
        ),
    ]
    for dtype, p in pair.items():
        recs.append(
            record(
                "C04",
                None,
                f"loss after {len(p['losses'])} steps, {dtype} compute",
                p["losses"][-1],
                "loss",
                role="context",
                series="loss_curve",
                dtype=dtype,
                losses=p["losses"],
            )
        )
    gap = max(abs(a - b) for a, b in zip(f32["losses"], b16["losses"], strict=True))
    recs.append(
        record(
            "C04",
            None,
            "largest |loss float32 − loss bf16| over the same steps",
            gap,
            "loss",
            label="derived",
            role="context",
        )
    )
    return recs


def _throughput(p: dict, peak: float, peak_name: str) -> list[dict]:
    """Context: the step's tokens/s, model FLOP/s and MFU on this backend."""
    cfg = p["cfg"]
    common = {
        "argv": cfg.preset,
        "batch": cfg.batch_size,
        "seq_len": cfg.seq_len,
        "params": p["params"],
        "step": p["step"],
        "flops_per_token": p["flops_per_token"],
        "flops_convention": p["flops_convention"],
    }
    return [
        record(
            "C17",
            None,
            f"training tokens/s, lab model '{cfg.preset}' ({p['params']:,} params)",
            p["tokens_per_s"],
            "tokens/s",
            role="context",
            series="train_throughput",
            mesh=cfg.mesh,
            **common,
        ),
        record(
            "C17",
            None,
            "training model FLOP/s of the step (6·N + attention per token, causal not halved)",
            p["model_flops_per_s"],
            "FLOP/s",
            label="derived",
            role="context",
            **common,
        ),
        record(
            "C17",
            None,
            f"MFU: model FLOP/s over the matmul peak measured here ({peak_name})",
            p["model_flops_per_s"] / peak,
            "×",
            label="derived",
            role="context",
            peak_flops_per_s=peak,
            peak_op=peak_name,
        ),
    ]


def _gpt_training_tokens_per_s(p: dict, mfu: float, size: str, plans: bool) -> list[dict]:
    """C17: GPT-2-small training tokens/s at the model FLOP/s measured here, and on the GPUs
    (measured or predicted)."""
    fpt = gpt2_small_flops_per_token()
    inputs = {
        "model_flops_per_s_here": p["model_flops_per_s"],
        "mfu_here": mfu,
        "gpt2_small_flops_per_token": fpt,
    }
    recs = [
        record(
            "C17",
            "cpu_train_tokens_per_s" if backend() == "cpu" else None,
            "GPT-2-small training tokens/s at the model FLOP/s measured here",
            p["model_flops_per_s"] / fpt,
            "tokens/s",
            label="derived",
            inputs=inputs,
        )
    ]
    if backend() == "gpu":
        recs.append(
            record(
                "C17",
                "gpu_train_tokens_per_s",
                "GPT-2-small training tokens/s at the model FLOP/s measured on this GPU",
                p["model_flops_per_s"] / fpt,
                "tokens/s",
                label="derived",
                inputs=inputs,
            )
        )
    for key, devices, metric in (
        ("rtx-4090", 1, "gpu_train_tokens_per_s"),
        ("h100-sxm", 8, "cluster_train_tokens_per_s"),
    ):
        name = f"{devices} × {specs.SPECS[key].name}"
        pred = predicted_step(size, key, devices) if plans else None
        if pred:  # the step compiled for the GPUs, its model FLOP/s over GPT-2-small's FLOPs
            recs.append(
                record(
                    "C17",
                    metric,
                    f"GPT-2-small training tokens/s on {name}: the model FLOP/s predicted for "
                    f"the lab's step compiled for {pred['target']}",
                    pred["model_flops_per_s"] / fpt,
                    "tokens/s",
                    label="predicted",
                    target=key,
                    devices=devices,
                    inputs={**inputs, "predicted_mfu": pred["mfu"]},
                    model_error=pred["statement"],
                )
            )
            continue
        peak, dtype = accel_peak(key)
        recs.append(
            record(
                "C17",
                metric,
                f"GPT-2-small training tokens/s on {name}: {dtype} peak × MFU measured here",
                devices * peak * mfu / fpt,
                "tokens/s",
                label="predicted",
                target=key,
                devices=devices,
                inputs=inputs,
                model_error=fallback(mfu),
                **spec_inputs(key, f"peak_flops.{dtype}"),
            )
        )
    return recs


def _cpu_probe(size: str, p_here: dict) -> dict:
    """The same step on the host CPU: the process's own probe on CPU, a second one elsewhere."""
    if backend() == "cpu":
        return p_here
    return train_probe(
        step_config(size, dtype="float32"), devices=[cpu_device()], budget_s=STEP_BUDGET_S[size]
    )


def _gpu_over_cpu_training_speed(
    p_here: dict, p_cpu: dict, peak: float, size: str, plans: bool
) -> list[dict]:
    """C02: GPU over CPU training speed of the same step, measured where a GPU is present,
    predicted otherwise: this CPU's measured step time over the step time the step-time model
    predicts for the same step compiled for the GPU (plans=True). `peak`: this CPU's matmul
    peak (mfu_peak), for the peak ratio shown as context."""
    if backend() != "cpu":
        return [
            record(
                "C02",
                "gpu_cpu_train_speedup",
                f"{backend()} over CPU training tokens/s, the same step",
                p_here["tokens_per_s"] / p_cpu["tokens_per_s"],
                "×",
                label="derived",
                inputs={"here": p_here["tokens_per_s"], "cpu": p_cpu["tokens_per_s"]},
            )
        ]
    cfg, cpu_s = p_cpu["cfg"], p_cpu["step"]["median_s"]
    step = f"{cfg.preset}, batch {cfg.batch_size} × {cfg.seq_len}"
    recs = []
    for key, name in SPEEDUP_TARGETS.items():
        pred = predicted_step(size, key) if plans else None
        if pred:
            recs.append(
                record(
                    "C02",
                    "gpu_cpu_train_speedup",
                    f"{name}: this CPU's measured step time ({step}, {cfg.model.dtype}) over "
                    f"the step time predicted for the same step (bf16) compiled for "
                    f"{pred['target']}",
                    cpu_s / pred["seconds"],
                    "×",
                    label="predicted",
                    target=key,
                    inputs={
                        "cpu_step_s": cpu_s,
                        "predicted_step_s": pred["seconds"],
                        "predicted_mfu": pred["mfu"],
                    },
                    model_error=pred["statement"],
                )
            )
        # The rule "datasheet peak × the MFU measured here" over the rate measured here is
        # the peak ratio (the MFU cancels): context, worded as what it is, never a prediction.
        gpu_peak, dtype = accel_peak(key)
        recs.append(
            record(
                "C02",
                "gpu_cpu_train_speedup",  # context: shown beside the part, never a verdict
                f"{name} {dtype} datasheet peak over this CPU's measured {mfu_peak_name(size)} "
                "peak: a ratio of peaks (the speed-up only if both ran the step at the same "
                "MFU), not a prediction of the step",
                gpu_peak / peak,
                "×",
                label="derived",
                role="context",
                target=key,
                inputs={"cpu_matmul_peak": peak, "op": mfu_peak_name(size)},
                **spec_inputs(key, f"peak_flops.{dtype}"),
            )
        )
    return recs


def _gpt3_training_time(p_cpu: dict, mfu: float, size: str, plans: bool) -> list[dict]:
    """C15: GPT-3's training time on this CPU (measured rate) and on an A100 cluster
    (predicted)."""
    flops = cost.gpt3_training_flops(GPT3_PARAMS, GPT3_TOKENS)
    cpu_rate = p_cpu["model_flops_per_s"]
    cores = cores_used()
    peak, dtype = accel_peak("a100-sxm4-80gb")
    pred = predicted_step(size, "a100-sxm4-80gb") if plans else None
    gpu_mfu = pred["mfu"] if pred else mfu
    cluster = A100_CLUSTER * peak * gpu_mfu
    how = (
        f"the MFU predicted for the lab's step compiled for {pred['target']}"
        if pred
        else "the MFU measured here"
    )
    return [
        record(
            "C15",
            None,
            "GPT-3 training FLOPs, 6·N·D (175e9 params × 300e9 tokens)",
            flops,
            "FLOP",
            label="derived",
            role="reference",
        ),
        record(
            "C15",
            "gpt3_cpu_years",
            "GPT-3 FLOPs over the training FLOP/s measured on this CPU",
            flops / cpu_rate / YEAR_S,
            "years",
            label="derived",
            on="cpu",
            inputs={"cpu_model_flops_per_s": cpu_rate, "gpt3_flops": flops},
        ),
        record(
            "C15",
            None,
            f"the same on a {SERVER_CORES}-core server CPU: this CPU's rate × "
            f"{SERVER_CORES}/{cores} cores",
            flops / (cpu_rate * SERVER_CORES / cores) / YEAR_S,
            "years",
            label="predicted",
            role="context",
            on="cpu",
            cores_used=cores,
            model_error="linear scaling with cores, unchecked here (an upper bound on the "
            "rate: the memory bandwidth and the clocks do not grow with the cores)",
        ),
        record(
            "C15",
            None,
            "FLOP/s that 355 years implies (the article's figure, for scale)",
            flops / (355 * YEAR_S),
            "FLOP/s",
            label="derived",
            role="reference",
        ),
        record(
            "C15",
            "gpt3_gpu_days",
            f"GPT-3 on {A100_CLUSTER} A100s ({dtype} peak) at {how}",
            flops / cluster / DAY_S,
            "days",
            label="predicted",
            target="a100-sxm4-80gb",
            inputs={"mfu": gpu_mfu, "gpus": A100_CLUSTER, "gpt3_flops": flops},
            model_error=pred["statement"] if pred else fallback(mfu),
            **spec_inputs("a100-sxm4-80gb", f"peak_flops.{dtype}"),
        ),
    ]


def run(size: str = "quick", plans: bool = False) -> list[dict]:
    """plans=True: the accelerators' figures from the step compiled for them and the
    step-time model (lab.predict); otherwise the fallback rule, each labelled with its error."""
    pair = _precision_pair(size)
    here = pair[compute_dtype()]  # the shared step (common.shared_step): its MFU is the one
    peak = mfu_peak(size)
    mfu = here["model_flops_per_s"] / peak
    p_cpu = _cpu_probe(size, here)
    return (
        _mixed_precision_memory_and_speed(pair)
        + _throughput(here, peak, mfu_peak_name(size))
        + _gpt_training_tokens_per_s(here, mfu, size, plans)
        + _gpu_over_cpu_training_speed(here, p_cpu, peak, size, plans)
        + _gpt3_training_time(p_cpu, mfu, size, plans)
    )

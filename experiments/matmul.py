"""C01, C03, C05: what a matrix multiply costs and how fast each precision runs.

C01: XLA's FLOP count of the 10,000² matmul (compiled, never run: the count does not need
the hardware), the float32 matmul rate of the CPU and, where present, the accelerator.
C03: one device's matmul rate at float32 precision=highest (no TF32), at default precision
(TF32 on Ampere and later) and in bf16/fp16. C05: the bf16 rate against the article's figure
for the GPU present. Without an accelerator the speedup is predicted from the spec table's
peak (an upper bound: no matmul reaches it) over the CPU rate measured here.
"""

import jax
import jax.numpy as jnp

from experiments.common import (
    COMPILED_GPUS,
    REFERENCE_GPUS,
    backend,
    cpu_device,
    matmul_rate,
    pick,
    predicted_gemm,
    record,
)
from lab.measure import cost, specs

CLAIMS = ("C01", "C03", "C05")
MODEL_N = 8192
ARTICLE_N = 10_000  # "Multiplying a 10,000×10,000 matrix"
CPU_N = 4096  # the largest float32 matmul timed on the host CPU (its rate, not the article's n)
# C05's table (seed 003) and seed 002's H100 figure: the article's numbers, held against the
# spec table in reference records (no verdict rests on them).
ARTICLE_FP16_TFLOPS = {"v100-sxm2-32gb": 125, "a100-sxm4-80gb": 312, "h100-sxm": 989, "h200": 989}


def _precisions(be: str) -> list[tuple[str, str | None, str]]:
    """(dtype, precision, label) measured on this backend."""
    out = [
        ("float32", "highest", "float32, precision=highest (no TF32)"),
        ("float32", None, "float32, default precision (TF32 on Ampere+)"),
        ("bfloat16", None, "bfloat16"),
    ]
    if be == "gpu":
        out.append(("float16", None, "float16"))
    return out


def flop_count(n: int) -> tuple[float | None, str | None]:
    """(FLOPs, how they were counted) of an n×n·n×n float32 matmul compiled, not run: XLA's
    cost analysis, or the optimized HLO where the backend's analysis gives none or -1."""
    a = jax.ShapeDtypeStruct((n, n), jnp.float32)
    compiled = jax.jit(jnp.matmul).lower(a, a).compile()
    c = cost.compiled_cost(compiled) or {}
    return c.get("flops"), c.get("source")


def _matmul_flops_and_speedup(n: int, budget_s: float, be: str, plans: bool = False) -> list[dict]:
    """C01: the FLOPs of the 10,000² matmul and the float32 matmul rates; the accelerator
    over the CPU, measured or predicted."""
    recs = []
    counted, source = flop_count(ARTICLE_N)
    recs.append(
        record(
            "C01",
            "matmul_10k_flops",
            f"FLOPs of a {ARTICLE_N:,}² float32 matmul (counted in the compiled program)",
            counted,
            "FLOP",
            label="compiled",
            n=ARTICLE_N,
            method="jax.jit(jnp.matmul).lower(...).compile(), lab.measure.cost.compiled_cost",
            source=source,
        )
    )
    recs.append(
        record(
            "C01",
            None,
            "analytic count 2·n³ for the same matmul",
            cost.matmul_flops(ARTICLE_N, ARTICLE_N, ARTICLE_N),
            "FLOP",
            role="reference",
            label="derived",
            n=ARTICLE_N,
        )
    )
    cpu = matmul_rate(min(n, CPU_N), device=cpu_device(), budget_s=budget_s)
    recs.append(
        record(
            "C01",
            None,
            f"CPU float32 matmul rate, n={cpu['n']}",
            cpu["flops_per_s"],
            "FLOP/s",
            on="cpu",
            role="context",
            **cpu,
        )
    )
    if be != "cpu":
        # JAX's default precision for a float32 matmul is TF32 on NVIDIA GPUs since Ampere
        # and bf16 passes on TPU: the article's "same matmul" is that program; the strict
        # float32 rate (precision=highest) is set beside it, so the speedup's source shows.
        acc = matmul_rate(ARTICLE_N, budget_s=budget_s)
        strict = matmul_rate(ARTICLE_N, precision="highest", budget_s=budget_s)
        for what, rate in (
            ("default precision (TF32 on NVIDIA since Ampere, bf16 passes on TPU)", acc),
            ("precision=highest (strict float32)", strict),
        ):
            recs.append(
                record(
                    "C01",
                    None,
                    f"{be} float32 matmul rate at {what}, n={ARTICLE_N}",
                    rate["flops_per_s"],
                    "FLOP/s",
                    role="context",
                    **rate,
                )
            )
        recs.append(
            record(
                "C01",
                "gpu_cpu_matmul_speedup",
                f"{be} over CPU float32 matmul FLOP/s (both measured here; the accelerator at "
                "JAX's default precision)",
                acc["flops_per_s"] / cpu["flops_per_s"],
                "×",
                label="derived",
                inputs={"accelerator_flops_per_s": acc["flops_per_s"], "cpu": cpu["flops_per_s"]},
            )
        )
        recs.append(
            record(
                "C01",
                None,
                f"{be} over CPU float32 matmul FLOP/s with the accelerator at precision=highest",
                strict["flops_per_s"] / cpu["flops_per_s"],
                "×",
                label="derived",
                role="context",
                inputs={
                    "accelerator_flops_per_s": strict["flops_per_s"],
                    "cpu": cpu["flops_per_s"],
                },
            )
        )
        return recs
    for key, name in REFERENCE_GPUS.items():
        spec = specs.SPECS[key]
        pred = predicted_gemm(key, ARTICLE_N, "float32") if plans else None
        if pred:  # the model of the float32 matmul compiled for the GPU (TF32 at default)
            recs.append(
                record(
                    "C01",
                    "gpu_cpu_matmul_speedup",
                    f"{name}: float32 matmul FLOP/s (n={ARTICLE_N}) predicted for the program "
                    f"compiled for {pred['target']}, over this CPU's measured float32 rate",
                    pred["flops_per_s"] / cpu["flops_per_s"],
                    "×",
                    label="predicted",
                    target=key,
                    inputs={"cpu_flops_per_s": cpu["flops_per_s"], "n": n},
                    model_error=pred["statement"],
                )
            )
            continue
        # A float32 matmul at default precision runs as TF32 where the GPU has TF32 units.
        has_tf32 = spec.peak_flops.get("tf32", 0.0) > spec.peak_flops["float32"]
        dtype = "tf32" if has_tf32 else "float32"
        peak = spec.peak_flops[dtype]
        recs.append(
            record(
                "C01",
                "gpu_cpu_matmul_speedup",
                f"{name} {dtype} datasheet peak over this CPU's measured float32 matmul rate "
                "(upper bound)",
                peak / cpu["flops_per_s"],
                "×",
                label="predicted",
                target=key,
                bound="upper",  # no matmul reaches the peak: decides only below the range
                inputs={"cpu_flops_per_s": cpu["flops_per_s"], "n": n},
                spec=key,
                spec_peak_flops=peak,
                spec_dtype=dtype,
                spec_source=spec.source_of(f"peak_flops.{dtype}"),
                assumption="the GPU runs the matmul at its datasheet peak (real: a fraction)",
                model_error="datasheet peak, an upper bound (no compiled program for it here)",
            )
        )
    return recs


def _matmul_rate_per_precision(n: int, budget_s: float, be: str) -> list[dict]:
    """C03, C05: one device's matmul rate per precision (float32 highest, default, bf16/fp16);
    the half-precision speedup and the bf16 rate against the article's figure."""
    recs, rates = [], {}
    for dtype, precision, label in _precisions(be):
        r = matmul_rate(n, getattr(jnp, dtype), precision, budget_s=budget_s)
        rates[(dtype, precision)] = r["flops_per_s"]
        recs.append(
            record(
                "C03",
                None,
                f"matmul {label}, n={n}",
                r["flops_per_s"],
                "FLOP/s",
                role="context",
                series="matmul_precision",
                dtype=dtype,
                precision=precision or "default",
                **r,
            )
        )
    fp32 = rates[("float32", "highest")]
    half = max(v for (d, _), v in rates.items() if d in ("bfloat16", "float16"))
    tensor = record(
        "C03",
        "tensor_core_speedup",
        f"{be}: best half-precision over float32 precision=highest matmul FLOP/s",
        half / fp32,
        "×",
        label="derived",
        inputs={"half_flops_per_s": half, "float32_highest_flops_per_s": fp32},
    )
    if be == "cpu":  # a CPU has no Tensor Cores: the same ratio, shown as context
        tensor["config"]["role"] = "context"
        tensor["what"] += " (a CPU has no Tensor Cores)"
    recs.append(tensor)
    recs.append(
        record(
            "C05",
            "bf16_matmul_flops",
            f"bfloat16 matmul FLOP/s on {jax.devices()[0].device_kind}, n={n}",
            rates[("bfloat16", None)],
            "FLOP/s",
            role="evidence" if be == "gpu" else "context",
            n=n,
        )
    )
    for key, name in REFERENCE_GPUS.items():  # datasheet ratios the claim is about
        spec = specs.SPECS[key]
        half_peak = max(spec.peak_flops.get(d, 0.0) for d in ("bfloat16", "float16"))
        recs.append(
            record(
                "C03",
                "tensor_core_speedup",  # reference: shown against the range, never a verdict
                f"{name} datasheet: half-precision Tensor Core peak over FP32 peak",
                half_peak / spec.peak_flops["float32"],
                "×",
                label="derived",
                role="reference",
                target=key,
                spec_source=spec.source_of("peak_flops.float32"),
            )
        )
    for key, tflops in ARTICLE_FP16_TFLOPS.items():
        spec = specs.SPECS[key]
        recs.append(
            record(
                "C05",
                None,
                f"{spec.name}: the article's {tflops} TFLOP/s over the spec table's dense fp16",
                tflops * 1e12 / spec.peak_flops["float16"],
                "×",
                label="derived",
                role="reference",
                target=key,
                spec_source=spec.source_of("peak_flops.float16"),
            )
        )
    return recs


def _bf16_matmul_predicted() -> list[dict]:
    """C05: bf16 matmul FLOP/s of each GPU the lab compiles for, predicted by the step-time model
    from the matmul compiled for it (n = MODEL_N: the size the published GEMM figures use)."""
    recs = []
    for key in COMPILED_GPUS:
        pred = predicted_gemm(key, MODEL_N)
        if pred is None:
            continue
        recs.append(
            record(
                "C05",
                "bf16_matmul_flops",
                f"bfloat16 matmul FLOP/s, n={MODEL_N}, compiled for {pred['target']}",
                pred["flops_per_s"],
                "FLOP/s",
                label="predicted",
                target=key,
                n=MODEL_N,
                model_error=pred["statement"],
            )
        )
    return recs


def run(size: str = "quick", plans: bool = False) -> list[dict]:
    """plans=True adds C05's GPUs predicted by the step-time model from compiled matmuls."""
    be = backend()
    # an accelerator's dense peak needs big tiles: at n=1024 an H100's bf16 matmul is a few
    # microseconds, its launch a share of them, and C05's peak would read off for the size
    n = pick(
        size, tiny=128, quick=1024 if be == "cpu" else 4096, full=4096 if be == "cpu" else 8192
    )
    budget = pick(size, tiny=0.02, quick=0.4, full=2.0)
    model = _bf16_matmul_predicted() if plans and be != "gpu" else []
    return (
        _matmul_flops_and_speedup(n, budget, be, plans)
        + _matmul_rate_per_precision(n, budget, be)
        + model
    )

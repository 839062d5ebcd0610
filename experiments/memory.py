"""C09–C12: what a training step needs in memory, and what remat and batch size change.

C09: the calculator (lab.measure.memory) splits the lab's real step into weights, gradients,
optimizer state, activations and workspace; the compiler's buffer assignment of the same step
is the measurement it is held against. C10: the same calculator, so validated, for Llama-2
7B and 70B shapes (Touvron et al. 2023), against an H100's memory from the spec table:
predicted. C11: the step compiled with remat none / full / dots: memory and FLOPs from the
compiler, step time measured. C12: the step over batch sizes: compiled memory and tokens/s.
The levers for fitting bigger models (`fitting`): the 70B plan with a pipeline and the
optimizer state offloaded (C10, calculator), remat=offload (C11, calculator; compiled for an
H100 with plans), the largest batch as accumulated microbatches of the smallest (C12).
"""

import dataclasses
import math

from experiments import gpu_plans
from experiments.common import (
    STEP,
    STEP_BUDGET_S,
    compile_probe,
    describe,
    h100_capacity,
    llama_shape,
    pick,
    record,
    shared_config,
    train_probe,
)
from lab.config import Config, make_config, override
from lab.errors import ConfigError
from lab.measure import memory
from lab.train import census_for

CLAIMS = ("C09", "C10", "C11", "C12")

# Storage bytes per recipe: (weights, compute, gradients, Adam moments, fp32 master copy).
RECIPES = {
    "mixed precision (fp32 weights, bf16 compute, fp32 AdamW)": (4, 2, 4, 4, 0),
    "float32 throughout": (4, 4, 4, 4, 0),
    "bf16 weights and AdamW, fp32 master copy": (2, 2, 2, 2, 4),
    "bf16 weights, gradients and AdamW (no master copy)": (2, 2, 2, 2, 0),
}
PRIMARY = next(iter(RECIPES))
REMATS = ("none", "full", "dots")
SEQ = 2048  # tokens per sequence for the 7B/70B predictions


def _breakdown_record(claim, metric, case, probe) -> dict:
    pred, mem = probe["predicted"], probe["memory"] or {}
    return record(
        claim,
        metric,
        f"compiled memory per device, {case}",
        mem.get("total_bytes"),
        "B",
        label="compiled",
        series="memory_breakdown",
        case=case,
        predicted={
            k: pred[k] for k in ("params", "grads", "optimizer", "activations", "workspace")
        },
        predicted_total=pred["total"],
        compiled=mem,
    )


def _remat_memory_and_time(
    cfg: Config, budget_s: float, remats, timed: bool
) -> tuple[list[dict], float]:
    """C09 and C11 from the step compiled under each remat policy; `timed` adds the measured
    step-time cost of remat=full (context: the claim's 'cost' is the recompute, in FLOPs)."""
    recs, probes = [], {}
    for remat in remats:
        probes[remat] = p = compile_probe(override(cfg, remat=remat))
        recs.append(
            _breakdown_record("C09" if remat == "none" else "C11", None, f"remat={remat}", p)
        )
    validation = []
    for remat, p in probes.items():
        ratio = p["predicted"]["total"] / p["memory"]["total_bytes"]
        validation.append(ratio)
        recs.append(
            record(
                "C09",
                "components_over_compiled",
                f"calculator's weights+grads+optimizer+activations+workspace over the "
                f"compiled step ({describe(p['cfg'])})",
                ratio,
                "×",
                label="derived",
                # the claim's sum is the plain step's; remat policies are shown beside it
                role="evidence" if remat == "none" else "context",
                remat=remat,
                step=describe(p["cfg"]),
                predicted=p["predicted"],
                compiled=p["memory"],
            )
        )
    none, full = probes["none"], probes["full"]
    recs.append(
        record(
            "C11",
            "remat_memory_ratio",
            "compiled memory, remat=full over remat=none",
            full["memory"]["total_bytes"] / none["memory"]["total_bytes"],
            "×",
            label="derived",
            step=describe(cfg),
        )
    )
    recs.append(
        record(
            "C11",
            "remat_flops_ratio",
            "compiled FLOPs, remat=full over remat=none",
            full["cost"]["flops"] / none["cost"]["flops"],
            "×",
            label="derived",
            step=describe(cfg),
        )
    )
    if "dots" in probes:
        recs.append(
            record(
                "C11",
                None,
                "compiled memory, remat=dots over remat=none",
                probes["dots"]["memory"]["total_bytes"] / none["memory"]["total_bytes"],
                "×",
                label="derived",
                role="context",
                step=describe(cfg),
            )
        )
    if timed:
        recs.append(_remat_time(cfg, budget_s))
    # The calculator's worst error on this machine: carried into the C10 predictions.
    return recs, max(abs(math.log(v)) for v in validation)


def _remat_time(cfg: Config, budget_s: float) -> dict:
    times = {
        r: train_probe(override(cfg, remat=r), budget_s=budget_s)["step"] for r in ("none", "full")
    }
    return record(
        "C11",
        None,
        "step time, remat=full over remat=none (measured)",
        times["full"]["median_s"] / times["none"]["median_s"],
        "×",
        label="derived",
        role="context",
        times=times,
    )


@dataclasses.dataclass(frozen=True)
class CalculatorError:
    """The memory calculator's worst ratio to the compiled steps it was checked against in
    this run, either way, and what those were (C09's CPU steps; with plans, the 7B and 70B
    steps compiled for H100s)."""

    log: float
    steps: str

    def __str__(self) -> str:
        return f"memory calculator (within {math.exp(self.log):.2f}× of {self.steps})"


def calculator_error(log_err) -> str:
    """How wrong the memory calculator is, as the prediction's statement."""
    return str(log_err)


def _predict(shape: dict, recipe: str, **kw) -> dict:
    w, c, g, o, master = RECIPES[recipe]
    return memory.predict_training_memory(
        **shape,
        seq_len=SEQ,
        param_bytes=w,
        compute_bytes=c,
        grad_bytes=g,
        opt_state_bytes=o,
        master_bytes=master,
        optimizer="adamw",
        attention="flash",
        **kw,
    )


def _llama_training_memory(log_err: CalculatorError) -> list[dict]:
    """C10: Llama-2 7B and 70B training memory by the calculator, per precision recipe,
    against an H100's memory (predicted)."""
    inputs = {"calculator_max_log_error_here": log_err.log, **h100_capacity()}
    cap = inputs["h100_usable_bytes"]
    recs = []
    for recipe in RECIPES:
        p = _predict(llama_shape("7B"), recipe, batch_size=1)
        recs.append(
            record(
                "C10",
                "train_memory_7b" if recipe == PRIMARY else None,
                f"7B training step, {recipe}, 1 × {SEQ} tokens, flash attention",
                p["total"],
                "B",
                label="predicted",
                model_error=calculator_error(log_err),
                role="evidence" if recipe == PRIMARY else "context",
                target="h100-sxm",
                recipe=recipe,
                breakdown=p,
                inputs=inputs,
            )
        )
    dp = _predict(llama_shape("70B"), PRIMARY, batch_size=1)
    recs.append(
        record(
            "C10",
            "train_memory_70b_dp_over_h100",
            f"70B, whole model on every device ({PRIMARY}), per-device memory over what a step "
            "may hold of one H100",
            dp["total"] / cap,
            "× H100 memory",
            label="predicted",
            model_error=calculator_error(log_err),
            target="h100-sxm",
            breakdown=dp,
            inputs=inputs,
        )
    )
    needed, n = None, 1
    while n <= 4096 and needed is None:
        # remat=full: one 2048-token sequence of 70B keeps ~50 GB of activations otherwise
        p = _predict(llama_shape("70B"), PRIMARY, batch_size=n, fsdp=n, remat="full")
        if p["total"] <= cap:
            needed = n
        n *= 2
    recs.append(
        record(
            "C10",
            "h100s_needed_70b",
            f"70B sharded (FSDP), remat=full, one {SEQ}-token sequence per device: fewest "
            "power-of-two H100s that fit (in JAX's allocator share of each)",
            needed,
            "H100s",
            label="predicted",
            model_error=calculator_error(log_err),
            target="h100-sxm",
            recipe=PRIMARY,
            inputs=inputs,
            per_device_bytes=p["total"] if needed else None,
        )
    )
    return recs


def _batch_memory_and_speed(cfg: Config, batches, budget_s: float) -> list[dict]:
    """C12: compiled memory and training tokens/s over batch sizes; the smallest batch's
    memory and speed over the largest's."""
    recs, rows = [], []
    for b in batches:
        p = train_probe(override(cfg, batch_size=b), budget_s=budget_s)
        rows.append((b, p["memory"]["total_bytes"], p["tokens_per_s"]))
        recs.append(
            record(
                "C12",
                None,
                f"training tokens/s at batch {b}",
                p["tokens_per_s"],
                "tokens/s",
                role="context",
                series="batch_sweep",
                batch=b,
                memory_bytes=p["memory"]["total_bytes"],
                step_time=p["step"],
                step=describe(cfg),
            )
        )
    (b0, m0, t0), (b1, m1, t1) = rows[0], rows[-1]
    recs.append(
        record(
            "C12",
            "small_batch_memory_ratio",
            f"compiled memory at batch {b0} over batch {b1}",
            m0 / m1,
            "×",
            label="derived",
            step=describe(cfg),
        )
    )
    recs.append(
        record(
            "C12",
            "small_batch_throughput_ratio",
            f"tokens/s at batch {b0} over batch {b1}",
            t0 / t1,
            "×",
            label="derived",
            step=describe(cfg),
        )
    )
    return recs


# --- fitting bigger models: the pipeline, gradient accumulation and host offloading, C10-C12


def _fitting_70b(log_err: CalculatorError) -> list[dict]:
    """C10: 70B on H100s with the levers for fitting a bigger model, by the calculator (predicted):
    the 80 layers over 8 pipeline stages (one H100 each, 8 microbatches of one 2048-token
    sequence), then the AdamW state in host memory, then pipeline × FSDP over 16 H100s;
    remat=full throughout."""
    inputs = {"calculator_max_log_error_here": log_err.log, **h100_capacity()}
    cap = inputs["h100_usable_bytes"]
    layouts = (
        ("8 pipeline stages of 10 layers on 8 H100s", dict(stage=8, batch_size=8)),
        ("8 pipeline stages × FSDP over 2 on 16 H100s", dict(stage=8, fsdp=2, batch_size=16)),
    )
    recs = []
    for (where, kw), host in ((lo, h) for lo in layouts for h in (False, True)):
        p = _predict(
            llama_shape("70B"), PRIMARY, remat="full", microbatches=8, offload_optimizer=host, **kw
        )
        text = f"{where}, 8 microbatches" + (", AdamW state in host memory" if host else "")
        recs.append(
            record(
                "C10",
                None,
                f"70B, {text}, remat=full: per-device memory "
                f"({'fits' if p['total'] <= cap else 'does not fit'} one H100's "
                f"{cap / 1e9:.0f} GB a step may hold)",
                p["total"],
                "B",
                label="predicted",
                model_error=calculator_error(log_err),
                role="context",
                target="h100-sxm",
                recipe=PRIMARY,
                host_bytes=p["host"],
                breakdown=p,
                inputs=inputs,
            )
        )
    return recs


def _remat_offload_memory(size: str, plans: bool) -> list[dict]:
    """C11: remat=offload beside remat=full for the shared step: the calculator's device
    activations (the block inputs move to host memory); with `plans`, the step compiled for
    one H100 (host memory is the device's own RAM on CPU: nothing to measure here)."""
    p = compile_probe(shared_config(size))  # the shared step, compiled already by C09
    cfg, mesh = p["cfg"], p["trainer"].mesh
    pred = {
        r: memory.predict_lab_step(
            override(cfg, remat=r),
            sizes=dict(mesh.shape),
            backend=mesh.devices.flat[0].platform,
            census=census_for(override(cfg, remat=r), mesh),
        )
        for r in ("full", "offload")
    }
    recs = [
        record(
            "C11",
            None,
            "calculator: device memory of the shared step, remat=offload over remat=full (the "
            "block inputs in host memory instead)",
            pred["offload"]["total"] / pred["full"]["total"],
            "×",
            label="predicted",
            role="context",
            step=describe(cfg),
            host_bytes=pred["offload"]["host"],
            predicted=pred,
        )
    ]
    return recs + (_remat_offload_plan(size) if plans else [])


def _remat_offload_plan(size: str) -> list[dict]:
    """C11: device memory of the step compiled for one H100, remat=offload over remat=full."""
    keys = {**pick(size, **STEP), "scan_layers": True, "target": "gpu:h100:1", "mesh": "1"}
    try:
        full, off = (gpu_plans.plan({**keys, "remat": r}) for r in ("full", "offload"))
    except ConfigError as e:  # no CUDA plugin or ptxas (the gpu-plan extra)
        return [record("C11", None, f"H100 offload plan not compiled: {e}", None, "")]
    mem_full, mem_off = full["compiled_memory_per_device"], off["compiled_memory_per_device"]
    return [
        record(
            "C11",
            None,
            "compiled for one H100: device memory, remat=offload over remat=full (the block "
            "inputs in host memory instead)",
            mem_off["total_bytes"] / mem_full["total_bytes"],
            "×",
            label="compiled, not run",
            role="context",
            target=gpu_plans.SPEC_KEY,
            host_temp_bytes=mem_off.get("host_temp_bytes"),
            compiled={"full": mem_full, "offload": mem_off},
            offload=off.get("offload"),
        )
    ]


def _accumulated_microbatches(cfg: Config, batches, budget_s: float, timed: bool) -> list[dict]:
    """C12: the largest batch of the sweep run as K microbatches of the smallest (accumulate=K):
    the big batch's update at the small batch's memory; its tokens/s where timed."""
    b0, b1 = batches[0], batches[-1]
    k = b1 // b0
    big, acc, small = (
        compile_probe(override(cfg, batch_size=b, accumulate=a))
        for b, a in ((b1, 1), (b1, k), (b0, 1))
    )
    mem = lambda p: p["memory"]["total_bytes"]  # noqa: E731
    recs = [
        record(
            "C12",
            None,
            f"compiled memory, batch {b1} as {k} accumulated microbatches of {b0} over batch "
            f"{b1} in one",
            mem(acc) / mem(big),
            "×",
            label="derived",
            role="context",
            series="accumulate",
            over_batch_small=mem(acc) / mem(small),
            step=describe(cfg),
        )
    ]
    if timed:
        rate = lambda b, a: train_probe(  # noqa: E731
            override(cfg, batch_size=b, accumulate=a), budget_s=budget_s
        )["tokens_per_s"]
        recs.append(
            record(
                "C12",
                None,
                f"tokens/s, batch {b1} as {k} accumulated microbatches of {b0} over batch {b1} "
                "in one (measured)",
                rate(b1, k) / rate(b1, 1),
                "×",
                label="derived",
                role="context",
                step=describe(cfg),
            )
        )
    return recs


def fitting(size: str, sweep: Config, batches, budget_s: float, log_err, plans: bool):
    """Fitting bigger models, the records: the 70B plan with a pipeline and offloading (C10),
    remat=offload (C11), gradient accumulation (C12)."""
    return (
        _fitting_70b(log_err)
        + _remat_offload_memory(size, plans)
        + _accumulated_microbatches(sweep, batches, budget_s, timed=size != "tiny")
    )


def run(size: str = "quick", *, plans: bool = False) -> list[dict]:
    """`plans`: also the 7B and 70B steps compiled for H100s (experiments/gpu_plans.py)."""
    sweep = make_config(
        **pick(
            size,
            tiny=dict(preset="tiny", seq_len=32),
            quick=dict(preset="tiny", seq_len=128),
            full=dict(preset="small", seq_len=256),
        ),
        data="synthetic",
        attention="naive",
    )
    # tiny: batch 2 is the shared step (cached), so the sweep adds one compile
    batches = pick(size, tiny=(2, 8), quick=(1, 4, 16, 64), full=(1, 4, 16, 64))
    budget = STEP_BUDGET_S[size]
    remats = pick(size, tiny=("none", "full"), quick=REMATS, full=REMATS)
    recs, log_err = _remat_memory_and_time(
        shared_config(size), budget, remats, timed=size != "tiny"
    )
    compiled = gpu_plans.llama_memory_per_h100() if plans else []
    plans_checked = [
        abs(math.log(r["config"]["calculator_over_compiled"]))
        for r in compiled
        if (r.get("config") or {}).get("calculator_over_compiled")
    ]
    cpu = len(remats)
    log_err = CalculatorError(
        max([log_err, *plans_checked]),
        f"the {cpu} CPU step{'s' if cpu != 1 else ''}"
        + (
            f" and {len(plans_checked)} H100 plan{'s' if len(plans_checked) != 1 else ''}"
            if plans_checked
            else ""
        )
        + " compiled in this run",
    )
    recs += (
        _llama_training_memory(log_err) + compiled + _batch_memory_and_speed(sweep, batches, budget)
    )
    return recs + fitting(size, sweep, batches, budget, log_err, plans)

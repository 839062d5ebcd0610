"""C19, C20: what the device says about itself, and TPU against H100.

C20: the device's own report (kind, count, streaming multiprocessors where the GPU backend
exposes `core_count`, memory from the allocator, L2 and shared memory per SM from the CUDA
driver) against the spec table and the articles.
Off a GPU the articles' H100 figures are set beside the spec table as reference (no verdict:
nothing was measured). C19: with libtpu installed, the lab's step is compiled ahead of time
for a TPU v5e chip and for four chips at four times the batch (weak scaling); the step-time
model over each compiled program gives the per-chip throughput and the scaling efficiency,
labelled *predicted* with the model's held-out error (where the model does not apply, the
compiler's own estimate, labelled *compiled, not run*). On a TPU the same ratio is measured.
`python -m experiments.compare` puts several backends' results side by side for the rest of
C19.
"""

import jax

from experiments.common import (
    STEP_BUDGET_S,
    backend,
    predicted_gemm,
    predicted_step,
    record,
    spec_inputs,
    step_config,
    train_probe,
)
from lab.config import override
from lab.measure import cost, cuda, memory, specs
from lab.predict.model import at_roofs

CLAIMS = ("C19", "C20")

HOPPER_FP32_CORES_PER_SM = 128  # NVIDIA H100 whitepaper: 128 FP32 CUDA cores per SM
TPU_TARGET = "tpu:v5e:2x2"
TPU_CHIPS = 4
MATMUL_N = 8192  # the size of the published GEMM figures (lab/predict/published.json)


def _device_report() -> list[dict]:
    """C20: what the device reports about itself (kind, count, memory; SMs and the CUDA cores
    they imply) beside the H100 memory of the spec table."""
    dev = jax.devices()[0]
    recs = [
        record(
            "C20",
            None,
            f"device kind reported: {dev.device_kind}",
            len(jax.devices()),
            "devices",
            role="context",
            device_kind=dev.device_kind,
        ),
    ]
    cap = memory.device_capacity_bytes(dev)
    what, label, extra = "host memory (CPU)", "measured", {}
    if dev.platform != "cpu":
        what = "device memory (allocator limit)"
    if dev.platform == "gpu" and cap:
        # the allocator takes a share of the card (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 unless
        # set): the card's memory is its limit over that share
        share = memory.gpu_allocator_fraction()
        what = f"device memory: the allocator's limit over its share ({share:g} of the card)"
        label, extra = "derived", {"allocator_limit_bytes": cap, "allocator_share": share}
        cap = cap / share
    recs.append(
        record(
            "C20",
            "device_memory" if dev.platform == "gpu" else None,
            what,
            cap,
            "B",
            label=label,
            role="evidence" if dev.platform == "gpu" else "context",
            **extra,
        )
    )
    sms = getattr(dev, "core_count", None)
    if dev.platform == "gpu" and sms:
        recs.append(
            record("C20", None, "streaming multiprocessors reported", sms, "SMs", role="context")
        )
        recs.append(
            record(
                "C20",
                "cuda_cores",
                f"SMs × {HOPPER_FP32_CORES_PER_SM} FP32 cores",
                sms * HOPPER_FP32_CORES_PER_SM,
                "cores",
                label="derived",
            )
        )
    if dev.platform == "gpu":
        recs += _driver_report(dev)
    for key in ("h100-sxm", "h100-nvl"):
        s = specs.SPECS[key]
        recs.append(
            record(
                "C20",
                "device_memory",
                f"{s.name}: memory in the spec table",
                s.memory_bytes,
                "B",
                label="derived",
                role="reference",
                target=key,
                source=s.source_of("memory_bytes"),
            )
        )
    return recs


def _driver_report(dev, lib=None) -> list[dict]:
    """C20: the L2 cache and the shared memory of one SM, as the CUDA driver reports them for
    `dev` (lab.measure.cuda); nothing where it cannot be read."""
    hw = getattr(dev, "local_hardware_id", None)
    attrs = cuda.driver_attributes(dev.id if hw is None else hw, lib=lib)
    # a MIG slice: the driver reports the slice's L2, not the chip's the article speaks of
    mig = "MIG" in str(getattr(dev, "device_kind", ""))
    how = {"role": "context"} if mig else {}
    slice_note = " of this MIG slice, not the whole chip" if mig else ""
    recs = []
    if "shared_memory_per_sm_bytes" in attrs:
        recs.append(
            record(
                "C20",
                "shared_memory_per_sm",
                "shared memory per SM, the most a kernel can have (CUDA driver)",
                attrs["shared_memory_per_sm_bytes"],
                "B",
            )
        )
    if "l2_bytes" in attrs:
        what = f"L2 cache{slice_note} (CUDA driver)"
        recs.append(record("C20", "l2_cache", what, attrs["l2_bytes"], "B", **how))
    return recs


def _aot_step(devices, cfg) -> dict:
    """Compile the lab step for TPU devices that are not here; the compiler's plan."""
    from experiments.common import build_trainer
    from lab import devices as lab_devices
    from lab import summary

    cfg, trainer = build_trainer(cfg, devices=devices)
    compiled = trainer.lower().compile()
    plan = summary.analyse(compiled, cfg, lab_devices.describe_target(devices), trainer)
    return {
        "cfg": cfg,
        "plan": plan,
        "tokens": cfg.batch_size * cfg.seq_len,
        "compiled": compiled,
        "mesh": trainer.mesh,
    }


def _tpu_devices():
    from lab import plans
    from lab.errors import ConfigError

    try:
        return plans.topology_devices(TPU_TARGET)
    except ConfigError:
        return None


def roofline_seconds(compiled, key: str, mesh=None) -> float:
    """A step's time with every op of its compiled program at a spec entry's roofs: max(its
    FLOPs over the datasheet peak of its dtype, its bytes over the HBM bandwidth), summed
    (lab.predict.model.at_roofs: the step-time model with efficiencies 1 and no fixed
    costs, which is what it predicts for a TPU, where nothing calibrates it)."""
    spec = specs.SPECS[key]
    return at_roofs(compiled, spec.peak_flops, spec.memory_bandwidth, mesh)["seconds"]


def _roofline_error() -> str:
    """How wrong the roofline bound is, as far as it was measured: on the TPU it is the
    step-time model, whose held-out error lab/predict/fits.json keeps; on a GPU it is not."""
    from lab.predict.step import fits

    err = (fits().get("tpu") or {}).get("held_out") or {}
    tpu = (
        f"on the TPU, {err['median']:.0%} median, worst {err['worst']:.2f}×, on {err['n']} "
        f"held-out published point{'s' if err['n'] != 1 else ''}"
        if err.get("n")
        else "on the TPU, not measured"
    )
    return (
        f"roofline bound of the compiled step (every op at the datasheet roofs, no "
        f"efficiencies, no fixed costs); its error {tpu}; on the H100, not measured (plans=on "
        "times the H100's own program by the fitted model)"
    )


def _tpu_step_compiled(size: str) -> list[dict]:
    """C19 from the step compiled for one TPU v5e chip and for four (4× batch): its time per
    step on each (the step-time model's, or the compiler's own estimate where the model does
    not apply: `_step_estimate`), and a TPU chip over an H100 by the roofline bound of that
    step."""
    chips = _tpu_devices()
    if not chips:
        return [
            record("C19", None, "libtpu absent: no TPU plan compiled", None, "", role="context")
        ]
    base = step_config(size)
    one = _aot_step(chips[:1], base)
    four = _aot_step(
        chips[:TPU_CHIPS],
        override(base, mesh=str(TPU_CHIPS), batch_size=base.batch_size * TPU_CHIPS),
    )
    bound = {k: roofline_seconds(one["compiled"], k, one["mesh"]) for k in ("tpu-v5e", "h100-sxm")}
    return _tpu_step_records(one, four, bound)


def _step_estimate(*aots: dict) -> tuple[str, dict]:
    """(where the plans' step times come from, as the end of a record's `what`; the record's
    label, model error and each plan's estimate with its error): the step-time model over the
    compiled program or the roofline floor are *predicted*, and `record` appends their error
    to the `what`; the compiler's own estimate is *compiled, not run*. What is known of its
    error (its ratio to the roofline floor changes from one compile to the next) goes in the
    config, one per program the figure is read from, so the record's name stays the same."""
    first = aots[0]
    label = first.get("estimate_label") or "compiled, not run"
    errors = [cost.estimate_with_error(a["estimate_source"], a.get("estimate_error")) for a in aots]
    how = {"label": label, "estimate_error": errors[0] if len(aots) == 1 else errors}
    if label != "predicted":
        return ", by the compiler's step estimate", how
    return "", {**how, "model_error": first.get("estimate_error") or first["estimate_source"]}


def _tpu_step_records(one: dict, four: dict, bound: dict) -> list[dict]:
    """C19's records from the two compiled TPU plans (`_aot_step`) and the step's roofline
    bound on each chip (seconds by spec key)."""
    aot1, aot4 = one["plan"]["aot"], four["plan"]["aot"]
    t1, t4 = aot1["estimated_step_s"], aot4["estimated_step_s"]
    per_chip = one["tokens"] / t1
    by, how = _step_estimate(aot1)
    _, how_both = _step_estimate(aot1, aot4)  # the efficiency is read from both programs
    common = {"target_topology": TPU_TARGET, "estimate_source": aot1["estimate_source"]}
    return [
        record(
            "C19",
            None,
            f"TPU v5e, 1 chip: training tokens/s of the compiled step{by}",
            per_chip,
            "tokens/s",
            role="context",
            target="tpu-v5e",
            step_s=t1,
            memory=one["plan"]["compiled_memory_per_device"],
            **how,
            **common,
        ),
        record(
            "C19",
            "tpu_scaling_efficiency",
            f"TPU v5e: per-chip tokens/s on {TPU_CHIPS} chips (4× batch) over 1 chip, the "
            f"step compiled for each{by}",
            (four["tokens"] / t4 / TPU_CHIPS) / per_chip,
            "×",
            target="tpu-v5e",
            step_s=[t1, t4],
            **how_both,
            **common,
        ),
        record(
            "C19",
            "tpu_over_h100",
            "TPU v5e chip over an H100: the same compiled step with every op at each chip's "
            "datasheet roofs",
            bound["h100-sxm"] / bound["tpu-v5e"],
            "×",
            label="predicted",
            target="tpu-v5e",
            bound_s=bound,
            compiled_cost=one["plan"]["compiled_cost_per_device"],
            model_error=_roofline_error(),
            **spec_inputs("tpu-v5e", "memory_bandwidth"),
            **common,
        ),
    ]


def _tpu_weak_scaling_measured(size: str) -> list[dict]:
    """C19 on a TPU: per-chip throughput on every chip (weak scaling) over one chip's."""
    n = len(jax.devices())
    base = step_config(size)
    one = train_probe(base, devices=jax.devices()[:1], budget_s=STEP_BUDGET_S[size])
    many = train_probe(
        override(base, mesh=str(n), batch_size=base.batch_size * n),
        budget_s=STEP_BUDGET_S[size],
    )
    return [
        record(
            "C19",
            "tpu_scaling_efficiency",
            f"per-chip tokens/s on {n} chips over 1",
            many["tokens_per_s"] / n / one["tokens_per_s"],
            "×",
            label="derived",
            chips=n,
        )
    ]


def _mi300x_over_h100_datasheet() -> list[dict]:
    """C19: MI300X over H100 from the bf16 datasheet peaks (reference, never a verdict)."""
    mi, h = specs.SPECS["mi300x"], specs.SPECS["h100-sxm"]
    return [
        record(
            "C19",
            "mi300x_over_h100",  # reference: shown against the range, never a verdict
            "MI300X over H100, bf16 datasheet peaks (reference, not measured)",
            mi.peak_flops["bfloat16"] / h.peak_flops["bfloat16"],
            "×",
            label="derived",
            role="reference",
            target="mi300x",
            source=mi.source_of("peak_flops.bfloat16"),
        )
    ]


def _tpu_and_mi300x_predicted(size: str) -> list[dict]:
    """C19 by the step-time model (lab.predict): the step compiled for one TPU v5e chip, for
    four (4× batch) and for one H100; the MI300X from the matmul compiled for the H100 timed
    on the MI300X's own spec entry (JAX's ROCm plugin does not compile without an AMD GPU:
    `jax-rocm7-plugin` 0.12.0 stops with 'No AMD GPUs were found' and
    `get_topology_desc(platform="rocm")` is not implemented). Empty where nothing compiles."""
    tpu1, tpu4 = predicted_step(size, "tpu-v5e", 1), predicted_step(size, "tpu-v5e", TPU_CHIPS)
    h100 = predicted_step(size, "h100-sxm", 1)
    recs = []
    if tpu1 and h100:
        recs.append(
            record(
                "C19",
                "tpu_over_h100",
                f"TPU v5e chip over an H100: tokens/s of the same step (bf16) compiled for "
                f"{tpu1['target']} and {h100['target']}",
                tpu1["tokens_per_s"] / h100["tokens_per_s"],
                "×",
                label="predicted",
                target="tpu-v5e",
                tokens_per_s={"tpu-v5e": tpu1["tokens_per_s"], "h100-sxm": h100["tokens_per_s"]},
                model_error=f"{tpu1['statement']} (TPU); {h100['statement']} (GPU)",
            )
        )
    if tpu1 and tpu4:
        recs.append(
            record(
                "C19",
                "tpu_scaling_efficiency",
                f"TPU v5e: per-chip tokens/s on {TPU_CHIPS} chips (4× batch, {tpu4['target']}) "
                "over 1 chip",
                tpu4["tokens_per_s"] / TPU_CHIPS / tpu1["tokens_per_s"],
                "×",
                label="predicted",
                target="tpu-v5e",
                model_error=tpu1["statement"],
            )
        )
    mi = predicted_gemm("h100-sxm", MATMUL_N, spec="mi300x")
    h = predicted_gemm("h100-sxm", MATMUL_N)
    if mi and h:
        recs.append(
            record(
                "C19",
                "mi300x_over_h100",
                f"MI300X over H100: bf16 matmul FLOP/s (n={MATMUL_N}), the H100's compiled "
                "matmul timed on each chip's spec entry",
                mi["flops_per_s"] / h["flops_per_s"],
                "×",
                label="predicted",
                target="mi300x",
                flops_per_s={"mi300x": mi["flops_per_s"], "h100-sxm": h["flops_per_s"]},
                model_error=mi["statement"],
            )
        )
    return recs


def run(size: str = "quick", plans: bool = False) -> list[dict]:
    """plans=True: C19's predictions from the step-time model over compiled programs."""
    if backend() == "tpu":
        tpu_step = _tpu_weak_scaling_measured(size) if len(jax.devices()) > 1 else []
    else:
        tpu_step = (_tpu_and_mi300x_predicted(size) if plans else []) or _tpu_step_compiled(size)
    return _device_report() + tpu_step + _mi300x_over_h100_datasheet()

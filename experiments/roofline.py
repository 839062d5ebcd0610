"""C06, C07: the roofline of the device present, and the bandwidth of its links.

C06: the two roofs are measured (the best FLOP/s of the ops timed, matmuls and the sweep's
own; the best bandwidth), then ops of growing arithmetic intensity (elementwise polynomials,
x·W from matrix-vector to square) are timed under them: where an elementwise op lands against
the compute roof, and where the ridge is. The claim ("today's GPUs … waiting on memory") is
judged on the lab's training step (the shared step, compiled here): each op of the compiled
program at its roof, max(FLOPs / matmul peak, bytes / bandwidth) with the roofs just measured,
and the share of that time spent in ops below the ridge (memory-bound). Measured on an
accelerator, it decides; a CPU's share is context (an upper bound, its caches not counted).
With plans, the same share of the step compiled for an H100, from the step-time model: the
verdict where no accelerator is present.
C07: host→device and device→host copies and, with two or more accelerators, a
device→device copy. On a CPU every one of these is a memcpy in host memory: recorded as
context, no PCIe or NVLink is crossed.
"""

import jax
import jax.numpy as jnp

from experiments.common import (
    backend,
    compile_probe,
    pick,
    predicted_step,
    record,
    shared_config,
)
from lab.measure import ceilings, roofline, specs, timing
from lab.predict.model import at_roofs

CLAIMS = ("C06", "C07")
MiB = 2**20


def device_to_device(nbytes: int, budget_s: float) -> dict | None:
    """Copy from device 0 to device 1 (jax.device_put): NVLink/ICI where the devices have it."""
    devices = jax.devices()
    if len(devices) < 2:
        return None
    xs = [
        (jax.device_put(x, devices[0]),)
        for x in timing.random_inputs(12, [(nbytes // 4,)] * 2, jnp.float32)
    ]
    r = timing.bench(lambda x: jax.device_put(x, devices[1]), rotate=xs, budget_s=budget_s)
    return {"bytes": nbytes, "bytes_per_s": nbytes / r.median_s, **r.as_dict()}


def _roofline_measured(be, size, budget) -> list[dict]:
    """C06: the two roofs measured (matmul peak, copy bandwidth) and ops of growing arithmetic
    intensity timed under them."""
    roof = ceilings.roofline_ceilings(size, budget_s=budget)
    peak, bw, points = roof["peak_flops"], roof["bandwidth"], roof["points"]
    copy = roof["copy"]
    recs = [
        record(
            "C06",
            None,
            f"roof: compute, the best FLOP/s of the ops timed ({roof['peak_name']})",
            peak,
            "FLOP/s",
            label="derived",  # the best of the rates timed below, not a timing of its own
            role="context",
            series="roof",
            roof="peak",
            set_by=roof["peak_op"],  # a matmul or an op of the sweep: compare says which
        ),
        record(
            "C06",
            None,
            f"matmul peak: the best matmul timed ({roof['matmul_name']})",
            roof["matmul_peak"],
            "FLOP/s",
            role="context",
            op=roof["matmul_name"],
        ),
        record(
            "C06",
            None,
            f"roof: memory bandwidth, the best measured ({roof['bandwidth_note']}; copy "
            f"x ← x·s in place, {copy['buffer_bytes'] / MiB:g} MiB × {copy['buffers']} rotated)",
            bw,
            "B/s",
            label="derived",  # as the compute roof: the best bandwidth of the ops timed
            role="context",
            series="roof",
            roof="bandwidth",
            set_by=roof["bandwidth_op"],
            copy_bytes_per_s=copy["bytes_per_s"],
            **{k: v for k, v in copy.items() if k != "bytes_per_s"},
        ),
    ]
    for p, share in roof["above_roof"]:
        recs.append(
            record(
                "C06",
                None,
                f"MEASUREMENT ERROR: roofline {p.name} at {share:.0%} of its roof",
                share,
                "× roof",
                role="context",
                label="derived",
            )
        )
    for p in points:
        recs.append(
            record(
                "C06",
                None,
                f"roofline {p.name}: {roofline.describe(p.name)}, {p.intensity:.3g} FLOP/B",
                p.flops_per_s,
                "FLOP/s",
                role="context",
                series="roofline",
                name=p.name,
                flops=p.flops,
                bytes=p.bytes,
                median_s=p.median_s,
                intensity=p.intensity,
                roof=roofline.attainable(p.intensity, peak, bw),
            )
        )
    poly1 = next(p for p in points if p.name == "poly_1")
    recs.append(
        record(
            "C06",
            None,
            f"elementwise op (poly_1, {poly1.intensity:.2g} FLOP/B) over the compute roof "
            f"({roof['peak_name']})",
            poly1.flops_per_s / peak,
            "× peak",
            label="derived",
            role="context",
            inputs={"poly_1_flops_per_s": poly1.flops_per_s, "peak_flops_per_s": peak},
        )
    )
    recs.append(
        record(
            "C06",
            None,
            f"ridge point: compute roof ({roof['peak_name']}) / memory roof (the best "
            "bandwidth measured)",
            roofline.ridge_point(peak, bw),
            "FLOP/B",
            label="derived",
            role="context",
            inputs={"peak_flops_per_s": peak, "bytes_per_s": bw},
        )
    )
    for key in ("h100-sxm", "tpu-v5e"):
        spec = specs.SPECS[key]
        recs.append(
            record(
                "C06",
                None,
                f"{spec.name}: datasheet ridge (bf16 peak / HBM bandwidth)",
                spec.peak_flops["bfloat16"] / spec.memory_bandwidth,
                "FLOP/B",
                label="derived",
                role="reference",
                target=key,
                spec_source=spec.source_of("memory_bandwidth"),
            )
        )
    return recs + _step_at_roofs(size, roof, be)


# the model's dtype names (lab.predict.model) for the matmuls lab.measure.ceilings times
_PEAK_DTYPES = {"float8_e4m3fn": "float8"}


def _step_at_roofs(size: str, roof: dict, be: str) -> list[dict]:
    """C06's share measured here: the share of the shared training step's time, each op at
    the roofs measured above, that memory-bound ops take. Evidence on an accelerator; on a
    CPU context (the claim is about GPUs, and a CPU's ridge is a few FLOP per byte) and an
    upper bound (its caches serve small ops faster than the copy bandwidth)."""
    peaks: dict[str, float] = {}
    for (dtype, _), m in roof["matmuls"].items():
        name = _PEAK_DTYPES.get(dtype, dtype)
        peaks[name] = max(peaks.get(name, 0.0), m["flops_per_s"])
    try:
        probe = compile_probe(shared_config(size))
    except Exception as e:  # noqa: BLE001 — the roofs and C07 stand without the step
        why = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        return [record("C06", None, f"the training step did not compile here: {why}", None, "")]
    cfg = probe["cfg"]
    split = at_roofs(probe["compiled"], peaks, roof["bandwidth"], probe["trainer"].mesh)
    if split["share"] is None:
        return []
    memory_ops, compute_ops = split["ops"]
    cpu = be == "cpu"
    roofs = (
        "the matmul peaks measured here and the memory roof (the best bandwidth measured, "
        f"set by {roof.get('bandwidth_op') or 'the copy'})"
    ) + (" (memory out of DRAM: caches not counted, so an upper bound)" if cpu else "")
    why = (
        "; a CPU's: context, the claim is about GPUs (this CPU's ridge is a few FLOP/B)"
        if cpu
        else ""
    )
    return [
        record(
            "C06",
            "memory_bound_share",
            f"the training step ({cfg.preset}, batch {cfg.batch_size} × {cfg.seq_len}, "
            f"{cfg.model.dtype}) compiled here, each op at {roofs}: the share of its time in "
            f"memory-bound ops ({memory_ops} ops below the ridge, {compute_ops} above){why}",
            split["share"],
            "× step",
            label="derived",
            role="context" if cpu else "evidence",
            # a CPU's caches: the true share may be lower (decides only below the range)
            **({"bound": "upper"} if cpu else {}),
            compute_s=split["compute_s"],
            memory_s=split["memory_s"],
            peaks=peaks,
            bytes_per_s=roof["bandwidth"],
        )
    ]


def _step_share_predicted(size: str) -> list[dict]:
    """The same share for the step compiled for an H100, timed by the step-time model."""
    pred = predicted_step(size, "h100-sxm")
    if not pred:
        return []
    b = pred["breakdown"]
    busy = b["compute"] + b["memory"] + b["custom kernels"]
    if not busy:
        return []
    return [
        record(
            "C06",
            "memory_bound_share",
            f"the training step compiled for {pred['target']} (bf16): the share of its time "
            "in memory-bound ops",
            b["memory"] / busy,
            "× step",
            label="predicted",
            target="h100-sxm",
            breakdown=b,
            model_error=pred["statement"],
        )
    ]


def _copy_bandwidths(be, sizes, budget) -> list[dict]:
    """C07: host→device, device→host and (with two accelerators) device→device copy bandwidth."""
    recs = []
    memcpy = " (CPU: a memcpy in host memory, no PCIe)" if be == "cpu" else ""
    role = "context" if be == "cpu" else "evidence"
    h2d = ceilings.host_to_device(sizes["transfer"], budget_s=budget)
    d2h = ceilings.device_to_host(sizes["transfer"], budget_s=budget)
    recs.append(
        record(
            "C07",
            "pcie_bandwidth",
            f"host→device copy{memcpy}",
            h2d["bytes_per_s"],
            "B/s",
            role=role,
            **h2d,
        )
    )
    recs.append(
        record(
            "C07",
            None,
            f"device→host copy{memcpy}",
            d2h["bytes_per_s"],
            "B/s",
            role="context",
            **{k: v for k, v in d2h.items() if k != "bytes_per_s"},
        )
    )
    d2d = device_to_device(sizes["transfer"], budget)
    if d2d:
        sim = " (simulated CPU devices: memcpy)" if be == "cpu" else ""
        recs.append(
            record(
                "C07",
                "nvlink_bandwidth",
                f"device 0 → device 1 copy{sim}",
                d2d["bytes_per_s"],
                "B/s",
                role=role,
                **d2d,
            )
        )
        recs.append(
            record(
                "C07",
                "nvlink_over_pcie",
                f"device→device over host→device{sim}",
                d2d["bytes_per_s"] / h2d["bytes_per_s"],
                "×",
                label="derived",
                role=role,
            )
        )
    spec = specs.SPECS["h100-sxm"]
    recs.append(
        record(
            "C07",
            "nvlink_over_pcie",  # reference: shown against the range, never a verdict
            f"{spec.name}: datasheet NVLink over PCIe Gen5 x16 (both directions each)",
            spec.interconnect_bandwidth / spec.host_bandwidth,
            "×",
            label="derived",
            role="reference",
            target="h100-sxm",
            spec_source=spec.source_of("interconnect_bandwidth"),
        )
    )
    return recs


def run(size: str = "quick", plans: bool = False) -> list[dict]:
    """C06 and C07 with the ceilings' own sizes (lab.measure.ceilings.sizes): one
    implementation of every roof for the ledger and lab.tools.ceilings. plans=True adds C06's
    share for the step compiled for an H100 (the step-time model)."""
    be = backend()
    budget = pick(size, tiny=0.01, quick=0.3, full=1.0)
    predicted = _step_share_predicted(size) if plans and be != "gpu" else []
    return (
        _roofline_measured(be, size, budget)
        + predicted
        + _copy_bandwidths(be, ceilings.sizes(be, size), budget)
    )

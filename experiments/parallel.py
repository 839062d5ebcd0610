"""C13, C14: what data parallelism costs in communication, and what sharding the model saves.

C14: the same step compiled on the same mesh under pure data parallelism, FSDP and tensor
parallelism; the compiler's per-device memory for each (on CPU the devices are simulated, but
the buffer assignment is the real one for that mesh); (quick, full) the same with its layers
pipelined over 2 stages, and all four timed. C13: the data-parallel step's gradient
all-reduce is read from the compiled program (lab.parallel.collectives_hlo: bus bytes per
device), its compute from the step's compiled FLOPs; scaled to N devices with the ring
all-reduce rule and timed at a GPU's link speeds, the step becomes communication-bound at some
N: predicted, with the MFU measured here. An all-reduce of the gradients' size is timed on
the devices present, and (quick, full) lab.studies.scaling measures the data-parallel step
over 1…8 devices with its collective/compute split: context (on CPU a memcpy between
simulated devices, not a link).
"""

import dataclasses

import jax

from experiments import gpu_plans
from experiments.common import (
    STEP_BUDGET_S,
    accel_peak,
    compile_probe,
    fallback,
    mfu_here,
    pick,
    predicted_step,
    record,
    spec_inputs,
    step_config,
    train_probe,
)
from lab.parallel import collectives_hlo, pipeline_hlo

CLAIMS = ("C13", "C14")

# An H100 node has 8 GPUs on NVLink; past 8, each GPU reaches the others through its own
# 400 Gb/s InfiniBand NIC (NVIDIA DGX H100 datasheet: 8× ConnectX-7, 400 Gb/s each) =
# 50 GB/s per direction. NVLink 4 is 900 GB/s both directions = 450 GB/s one way.
NODE_GPUS = 8
IB_BYTES_PER_S = 400e9 / 8
IB_SOURCE = "NVIDIA DGX H100 datasheet: 8× ConnectX-7 400 Gb/s InfiniBand, one per GPU"
DEVICE_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
STRATEGIES = {"dp": "data:{n}", "fsdp": "fsdp:{n}", "tp": "data:{d},model:2"}


def _mesh_for(strategy: str, n: int) -> str:
    return STRATEGIES[strategy].format(n=n, d=n // 2)


def _config(size: str, n: int, strategy: str):
    """The shared step with a batch that every strategy's data axis divides, on its mesh."""
    batch = pick(size, tiny=8, quick=32, full=64)
    return step_config(
        size, batch_size=max(batch, n), strategy=strategy, mesh=_mesh_for(strategy, n)
    )


def _strategy_memory(size: str, n: int) -> tuple[list[dict], dict]:
    """C14: the same step compiled under each strategy on n devices: memory per device, and
    the sharded over pure data parallelism's; the dp probe is returned for C13."""
    recs, probes = [], {}
    # tiny (the test suite) leaves out tensor parallelism: context only, one compile less
    for strategy in pick(size, tiny=("dp", "fsdp"), quick=STRATEGIES, full=STRATEGIES):
        p = compile_probe(_config(size, n, strategy))
        probes[strategy] = p
        recs.append(
            record(
                "C14",
                None,
                f"compiled memory per device, {strategy} over {n} devices",
                p["memory"]["total_bytes"],
                "B",
                label="compiled",
                role="context",
                series="strategy_memory",
                strategy=strategy,
                devices=n,
                mesh=_mesh_for(strategy, n),
                compiled=p["memory"],
                predicted_total=p["predicted"]["total"],
            )
        )
    dp = probes["dp"]["memory"]["total_bytes"]
    recs.append(
        record(
            "C14",
            "sharded_over_dp_memory",
            f"per-device memory, FSDP over pure data parallelism, {n} devices",
            probes["fsdp"]["memory"]["total_bytes"] / dp,
            "×",
            label="derived",
            devices=n,
        )
    )
    if "tp" in probes:
        recs.append(
            record(
                "C14",
                None,
                f"per-device memory, tensor parallel (model=2) over data parallel, {n} devices",
                probes["tp"]["memory"]["total_bytes"] / dp,
                "×",
                label="derived",
                role="context",
                devices=n,
            )
        )
    return recs, probes["dp"]


def gradient_allreduce(probe: dict) -> dict:
    """All-reduce traffic of the compiled data-parallel step: buffer and bus bytes per device."""
    ops = collectives_hlo.from_compiled(probe["compiled"], probe["trainer"].mesh)
    rows = [v for (kind, _), v in collectives_hlo.totals(ops).items() if kind == "all-reduce"]
    return {
        "buffer_bytes": sum(r["buffer_bytes"] for r in rows),
        "bus_bytes": sum(r["bus_bytes"] for r in rows),
        "ops": sum(r["ops"] for r in rows),
    }


def link_bytes_per_s(key: str, n: int) -> float:
    """One-way bandwidth per device for an all-reduce over n devices of a spec entry."""
    ici = spec_inputs(key, "interconnect_bandwidth")["interconnect_bandwidth"]
    if key.startswith("tpu"):
        return ici / 2  # ICI is a torus inside the slice: the same links at every size
    return ici / 2 if n <= NODE_GPUS else IB_BYTES_PER_S


def _efficiency(compute_s: float, buffer_bytes: float, key: str) -> list[tuple[int, float]]:
    """(devices, compute / (compute + all-reduce)) with no overlap, weak scaling."""
    out = []
    for n in DEVICE_COUNTS:
        comm_s = collectives_hlo.bus_bytes("all-reduce", buffer_bytes, n) / link_bytes_per_s(key, n)
        out.append((n, compute_s / (compute_s + comm_s)))
    return out


MODEL_GPU_COUNTS = (8, 16, 32)  # H100s the dp step is compiled for (plans=on)


def _fewest_h100s_comm_bound(size: str) -> dict | None:
    """C13: the fewest H100s at which the gradient all-reduce outlasts the rest of the step, from
    the dp step (batch × GPUs) compiled for 8, 16 and 32 H100s and timed by the step-time
    model (every collective against everything else, no overlap counted, as the claim
    reads); None where no program compiles here."""
    found, rows = None, {}
    for devices in MODEL_GPU_COUNTS:
        pred = predicted_step(size, "h100-sxm", devices)
        if pred is None:
            return None
        rest = pred["seconds"] - pred["breakdown"]["exposed communication"]
        rows[devices] = {"collective_s": pred["collective_s"], "rest_s": rest}
        if found is None and pred["collective_s"] > rest:
            found = devices
    return record(
        "C13",
        "dp_comm_bound_devices",
        "fewest H100s at which the gradient all-reduce outlasts the rest of the step: the dp "
        f"step compiled for {', '.join(map(str, MODEL_GPU_COUNTS))} H100s (None: none of them)",
        found,
        "devices",
        label="predicted",
        target="h100-sxm",
        steps=rows,
        model_error=pred["statement"],
    )


def _data_parallel_efficiency(size: str, dp_probe: dict, n: int, plans: bool = False) -> list[dict]:
    """C13: the dp step's gradient all-reduce read from the compiled program, and the
    data-parallel efficiency over N H100s and TPU v5e chips (predicted)."""
    ar = gradient_allreduce(dp_probe)
    mfu = mfu_here(size)
    flops = dp_probe["cost"]["flops"]
    recs = [
        record(
            "C13",
            None,
            f"gradient all-reduce of the compiled dp step over {n} devices: bus bytes per device",
            ar["bus_bytes"],
            "B",
            role="context",
            label="compiled, not run",
            devices=n,
            **ar,
        )
    ]
    buffer = ar["buffer_bytes"]
    for key in ("h100-sxm", "tpu-v5e"):
        peak, dtype = accel_peak(key)
        compute_s = flops / (peak * mfu)
        curve = _efficiency(compute_s, buffer, key)
        inputs = {
            "compiled_flops_per_device": flops,
            "mfu_here": mfu,
            "buffer_bytes": buffer,
            "ib_bytes_per_s": IB_BYTES_PER_S,
            "ib_source": IB_SOURCE,
        }
        for devices, eff in curve:
            recs.append(
                record(
                    "C13",
                    None,
                    f"data-parallel efficiency on {devices} × {key} (the all-reduce after the "
                    "compute, not overlapped; compute at the MFU measured here)",
                    eff,
                    "×",
                    label="predicted",
                    role="context",
                    series="dp_scaling",
                    target=key,
                    devices=devices,
                )
            )
        tokens = dp_probe["tokens_per_step"] / n
        for where, devices in (("NVLink", NODE_GPUS), ("InfiniBand", 2 * NODE_GPUS)):
            comm_s = collectives_hlo.bus_bytes("all-reduce", buffer, devices) / link_bytes_per_s(
                key, devices
            )
            recs.append(
                record(
                    "C13",
                    None,
                    f"{key}, {devices} devices ({where if key == 'h100-sxm' else 'ICI'}): "
                    "tokens per device per step below which the all-reduce outlasts the compute",
                    tokens * comm_s / compute_s,
                    "tokens",
                    label="predicted",
                    role="context",
                    target=key,
                    inputs=inputs,
                )
            )
        if key != "h100-sxm":
            continue
        modelled = _fewest_h100s_comm_bound(size) if plans else None
        if modelled:
            recs.append(modelled)
            continue
        bound = next((d for d, eff in curve if eff < 0.5), None)
        recs.append(
            record(
                "C13",
                "dp_comm_bound_devices",
                "fewest H100s at which the all-reduce outlasts the compute (weak scaling, no "
                "overlap)",
                bound,
                "devices",
                label="predicted",
                target=key,
                compute_s=compute_s,
                inputs=inputs,
                model_error=fallback(mfu),
                **spec_inputs(key, f"peak_flops.{dtype}", "interconnect_bandwidth"),
            )
        )
    return recs + _timed_allreduce(buffer, size)


def _timed_allreduce(buffer_bytes: float, size: str) -> list[dict]:
    """All-reduce of the gradients' size on the devices present, where the lab can time it."""
    from lab.measure import collectives
    from lab.mesh import make_mesh

    devices = jax.devices()
    if len(devices) < 2:
        return []
    mesh = make_mesh(f"data:{len(devices)}", devices)
    nbytes = max(4 * len(devices), int(buffer_bytes) // (4 * len(devices)) * 4 * len(devices))
    pt = collectives.time_one("all-reduce", mesh, "data", nbytes, STEP_BUDGET_S[size])
    sim = " (simulated CPU devices: a memcpy)" if devices[0].platform == "cpu" else ""
    return [
        record(
            "C13",
            None,
            f"all-reduce of {nbytes / 2**20:.1f} MiB over {len(devices)} devices: bus bandwidth"
            + sim,
            pt.busbw,
            "B/s",
            label="derived",  # the measured time's algbw times the all-reduce's 2(W-1)/W
            role="context",
            devices=len(devices),
            median_s=pt.result.median_s,
        )
    ]


def measured_scaling(size: str) -> list[dict]:
    """lab.studies.scaling's data-parallel runs over 1…n devices (step time, collective time
    from HLO bytes over measured bus bandwidth, compute) and its extrapolation, as context:
    on CPU the devices are simulated slices of one host. Not in tiny (the test suite)."""
    from lab.studies import scaling

    counts = tuple(c for c in (1, 2, 4, 8) if c <= len(jax.devices()))
    s = dataclasses.replace(scaling.SIZES[size], device_counts=counts)
    strong = scaling.scaling(s, ("dp",))
    rows = (*strong, *scaling.extrapolate(s, strong))  # the model checked on dp's own step
    recs = [r for row in rows for r in row.records()]
    for r in recs:
        r["config"].update(claim="C13", metric=None, role="context", series="dp_measured")
    return recs


# --- the pipeline beside dp, fsdp and tp on the same devices -------------------------------


def _pp_config(size: str, n: int):
    """The shared step pipelined over 2 stages (its layers split in two), the rest of the
    devices data parallel, 4 microbatches; the batch of `_config`."""
    batch = pick(size, tiny=8, quick=32, full=64)
    mesh = f"data:{n // 2},stage:2"
    return step_config(size, batch_size=max(batch, n), strategy="pp", mesh=mesh, microbatches=4)


def _pipeline_memory_and_strategy_times(size: str, n: int) -> list[dict]:
    """C14 with the pipeline: its per-device memory beside pure data parallelism's (compiled),
    and the step time of dp, fsdp, tp and pp on the same n devices (measured; on CPU the
    devices are simulated slices of one host, so the times rank the programs' work, not links)."""
    pp = compile_probe(_pp_config(size, n))
    dp = compile_probe(_config(size, n, "dp"))
    trainer = pp["trainer"]
    reading = pipeline_hlo.from_trainer(
        collectives_hlo.from_compiled(pp["compiled"], trainer.mesh), trainer
    )
    recs = [
        record(
            "C14",
            None,
            f"compiled memory per device, pp over {n} devices (2 stages)",
            pp["memory"]["total_bytes"],
            "B",
            label="compiled",
            role="context",
            series="strategy_memory",
            strategy="pp",
            devices=n,
            mesh=trainer.cfg.mesh,
            compiled=pp["memory"],
            predicted_total=pp["predicted"]["total"],
            pipeline=reading.as_dict(),
        ),
        record(
            "C14",
            None,
            f"per-device memory, pipeline (2 stages) over pure data parallelism, {n} devices",
            pp["memory"]["total_bytes"] / dp["memory"]["total_bytes"],
            "×",
            label="derived",
            role="context",
            devices=n,
        ),
    ]
    budget = STEP_BUDGET_S[size]
    for strategy in (*STRATEGIES, "pp"):
        cfg = _pp_config(size, n) if strategy == "pp" else _config(size, n, strategy)
        t = train_probe(cfg, budget_s=budget)
        recs.append(
            record(
                "C14",
                None,
                f"step time, {strategy} over {n} devices (measured)",
                t["step"]["median_s"],
                "s",
                role="context",
                series="strategy_step_time",
                strategy=strategy,
                devices=n,
                step=t["step"],
                memory_bytes=t["memory"]["total_bytes"],
            )
        )
    return recs


def run(size: str = "quick", *, plans: bool = False) -> list[dict]:
    """`plans`: also the 70B step compiled for 8 and 16 H100s (experiments/gpu_plans.py)."""
    compiled = gpu_plans.llama70b_memory_per_strategy() if plans else []
    n = len(jax.devices())
    if n < 2:
        return compiled + [
            record(
                "C14", None, "devices present: one, nothing to shard", n, "devices", role="context"
            ),
            record(
                "C13", None, "devices present: one, no collective", n, "devices", role="context"
            ),
        ]
    n = n if n % 2 == 0 else n - 1
    recs, dp = _strategy_memory(size, n)
    # tiny: the test suite's, fast
    recs += [] if size == "tiny" else _pipeline_memory_and_strategy_times(size, n)
    measured = [] if size == "tiny" else measured_scaling(size)
    return recs + compiled + _data_parallel_efficiency(size, dp, n, plans) + measured

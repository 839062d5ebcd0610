"""What `lab.run` prints and saves: the header, the compiled analysis, the final summary.

Every figure here is either measured in this run (step times, compiled memory and FLOPs) or
derived from measured figures plus a spec-table entry whose source is recorded; MFU on CPU
is against the matmul peak measured on this machine, and says so.
"""

import math
import re
import time
from pathlib import Path

import jax
import numpy as np

from lab import plans, rundir
from lab.config import Config, override
from lab.data import packed_text_batch
from lab.devices import DeviceInfo
from lab.errors import ConfigError
from lab.measure import ceilings, cost, memory, specs, toolchain
from lab.measure import records as rec
from lab.measure import run as run_figures
from lab.measure.offload import OffloadCost
from lab.measure.predicted import PredictedStep
from lab.model import count_nonembedding_params, count_params
from lab.parallel import collectives_hlo, explain, pipeline_hlo
from lab.plans import resources
from lab.predict.step import predict_step
from lab.train import census_for

GIB = 2**30


PACKED_SAMPLE = 64  # packed batches read for the keys per query: the mean settles long before


def flops_per_token(cfg: Config, params, steps=None) -> tuple[float, str]:
    """Model FLOPs per token (lab.measure.cost.transformer_flops_per_token) and how they were
    counted: attention only over the (query, key) pairs the mask leaves, per layer its
    window's. Packed text (data=text pack=true): the keys of each query's own document up to
    itself, the mean over the tokens of the run's batches (`steps`, default range(cfg.steps);
    at most PACKED_SAMPLE of them, evenly spaced), from their segment ids on the host."""
    n = count_nonembedding_params(params, cfg.model)
    m = cfg.model
    packed = cfg.pack and cfg.data == "text"
    if packed:
        steps = list(range(cfg.steps) if steps is None else steps)
        if len(steps) > PACKED_SAMPLE:
            steps = [steps[i] for i in np.linspace(0, len(steps) - 1, PACKED_SAMPLE).astype(int)]
        keys = packed_keys_per_layer(cfg, steps)
    else:
        keys = [cost.visible_keys(cfg.seq_len, w) for w in m.layer_windows]
    f = cost.transformer_flops_per_token(
        n, m.n_layers, cfg.seq_len, m.d_model, training=True, keys_per_layer=keys
    )
    label = (
        "6·N (N non-embedding params) + 12·d_model·keys seen per query, summed over layers, "
        "per token: only unmasked pairs ("
    )
    if packed:
        label += (
            f"packed documents: pairs within each query's document only, causal within it, "
            f"{sum(keys) / len(keys):.1f} keys per query per layer on average over the segment "
            f"ids of {len(steps)} of the run's batches"
        )
    else:
        label += "causal ≈ seq/2"
    label += f", a window of {m.window}: ≤ {m.window}" if m.window else ""
    return f, label + ")"


def packed_keys_per_layer(cfg: Config, steps) -> list[float]:
    """Per layer, the keys a query sees on average in the packed batches of `steps` (their
    segment ids, lab.data.packed_text_batch, inputs only: the targets' extra byte dropped),
    within its document and its layer's window (lab.measure.cost.packed_visible_keys); every
    batch has B·seq_len tokens, so the mean of the batches' means is the mean over tokens."""
    windows = set(cfg.model.layer_windows)
    sums = dict.fromkeys(windows, 0.0)
    for step in steps:
        ids_BxL = packed_text_batch(cfg.seed, step, cfg.batch_size, cfg.seq_len)[:, 1, :-1]
        for w in windows:
            sums[w] += cost.packed_visible_keys(ids_BxL, w)
    n = max(len(steps), 1)
    return [sums[w] / n for w in cfg.model.layer_windows]


def analyse(compiled, cfg: Config, info: DeviceInfo, trainer, kernels=()) -> dict:
    """Compiled memory and cost per device, and the model's FLOPs per token; for a plan, the
    fit against the device's memory, the time floor and every GPU kernel's resources."""
    fpt, convention = flops_per_token(cfg, trainer.abstract_state.params)
    n_params = count_params(trainer.abstract_state.params)
    out = {
        "params": n_params,
        "model_flops_per_token": fpt,
        "flops_convention": convention,
        "tokens_per_step": cfg.batch_size * cfg.seq_len,
        "compiled_memory_per_device": memory.compiled_memory(compiled),
        "predicted_memory_per_device": memory.predict_lab_step(
            explain.as_compiled(trainer.cfg, trainer),
            sizes=dict(trainer.mesh.shape),
            backend=trainer.mesh.devices.flat[0].platform,  # the target's, for AOT plans
            census=trainer.census,
        ),
        "compiled_cost_per_device": cost.compiled_cost(compiled),
        "capacity_bytes_per_device": capacity_bytes(info, trainer.mesh.devices.flat[0]),
        "device_kind": info.device_kind,
        "devices": trainer.mesh.size,  # the mesh's, which may be fewer than are present
        "devices_present": info.count,
        "simulated": info.simulated,
        "notes": list(trainer.notes),
        "attention_note": trainer.attention_note,
        **parallelism(cfg, trainer.mesh),
    }
    # Process 0 alone prints and records the prediction. On CPU the model measures this host's
    # matmul peak and copy bandwidth first: every process measuring at once took seconds of
    # each one's start and halved the peak process 0 read (its peers measured beside it).
    lead = jax.process_index() == 0
    predicted = predict_step(compiled, trainer.cfg, info, trainer.mesh) if lead else None
    out["predicted_step"] = predicted.record() if predicted else None
    if trainer.schedule is not None:
        colls = collectives_hlo.from_compiled(compiled, trainer.mesh)
        out["pipeline"] = pipeline_hlo.from_trainer(colls, trainer).as_dict()
    offload = offload_cost(out["compiled_memory_per_device"], info)
    if offload:
        out["offload"] = offload.record()
    if info.aot:
        out["aot"] = _aot_plan(compiled, cfg, info, fpt, trainer.mesh.size, predicted)
        out["aot"]["kernels"] = resources.as_dicts(kernels)
        out["aot"]["toolchain"] = toolchain.probe().record()  # the kernels are ptxas's
        if info.backend == "gpu":  # the capacity a run there has: the allocator's share
            out["aot"]["allocator_share"] = memory.gpu_allocator_fraction()
            # of the total memory the GPU reports, where the lab knows it (else the spec's)
            out["aot"]["reported_bytes"] = plans.gpu.reported_memory(info.device_kind)
        elif memory.compiler_hbm(trainer.mesh.devices.flat[0]):
            out["aot"]["capacity_source"] = "compiler"  # XLA:TPU's own, below the chip's HBM
        out["aot"]["fit"] = fit_advice(trainer, out)
        if run_figures.cannot_run(out["aot"]["fit"]):  # the figures stay, labelled
            out["aot"]["caveat"] = run_figures.CANNOT_RUN
    return out


# How the step is split and fed, as config.json names them: a summary or a record that lacks
# them cannot tell a data-parallel run from an fsdp one
PARALLELISM = ("strategy", "mesh", "accumulate", "microbatches", "pipeline_repeats")


def parallelism(cfg: Config, mesh) -> dict:
    """The resolved split of the step: the strategy's rules, the mesh (each axis and its
    size), the accumulation steps, the pipeline's microbatches (0 without a pipeline) and
    its repeats."""
    return {
        "strategy": cfg.strategy,
        "mesh": {axis: int(n) for axis, n in mesh.shape.items()},
        "accumulate": cfg.accumulate,
        "microbatches": cfg.model.microbatches,
        "pipeline_repeats": cfg.model.pipeline_repeats,
    }


def _changes(cfg: Config, sizes: dict) -> list[tuple[str, dict]]:
    """Single changes that lower the memory per device, smallest first."""
    batch_axes = math.prod(n for a, n in sizes.items() if a != "model")
    out = []
    if cfg.model.remat != "full":
        out.append(("remat=full", {"remat": "full"}))
    for k in (2, 4, 8):
        if cfg.batch_size % k == 0 and (cfg.batch_size // k) % batch_axes == 0:
            out.append((f"batch_size={cfg.batch_size // k}", {"batch_size": cfg.batch_size // k}))
    if cfg.strategy not in ("fsdp", "fsdp+tp"):
        out.append(("strategy=fsdp", {"strategy": "fsdp"}))
    return out


def fit_advice(trainer, analysis: dict) -> str:
    """Whether the compiled step fits the target's memory, by how much, or the smallest single
    change that would: the calculator's figure for each change, scaled by how far the compiled
    figure sits from the calculator's own for this step (labelled predicted)."""
    cfg, need = trainer.cfg, _needed_bytes(analysis)
    cap = analysis["capacity_bytes_per_device"]
    if not (need and cap):
        return "no memory figure"
    if need <= cap:
        return f"fits, {(cap - need) / GIB:.2f} GiB spare"
    sizes = dict(trainer.mesh.shape)
    backend = trainer.mesh.devices.flat[0].platform
    scale = need / analysis["predicted_memory_per_device"]["total"]
    short = f"does NOT fit: {(need - cap) / GIB:.2f} GiB short"
    for text, change in _changes(cfg, sizes):
        try:
            changed = override(cfg, **change)
        except ConfigError:
            continue
        predicted = (
            memory.predict_lab_step(
                changed, sizes=sizes, backend=backend, census=census_for(changed, trainer.mesh)
            )["total"]
            * scale
        )
        if predicted <= cap:
            return f"{short}; {text} would fit ({predicted / GIB:.1f} GiB, predicted)"
    return f"{short}; {_more_devices(cfg)}"


def refused_advice(trainer, refusal: str) -> str:
    """A step the target's compiler would not compile for lack of memory: that, and the
    smallest single change the calculator predicts would fit (labelled predicted)."""
    cfg = trainer.cfg
    sizes = dict(trainer.mesh.shape)
    device = trainer.mesh.devices.flat[0]
    backend = device.platform
    cap = memory.device_capacity_bytes(device) or getattr(
        specs.lookup(device.device_kind), "memory_bytes", None
    )
    short = f"does NOT fit: the compiler refused the step ({refusal})"

    def predict(c) -> float:
        census = census_for(c, trainer.mesh)
        return memory.predict_lab_step(c, sizes=sizes, backend=backend, census=census)["total"]

    # the compiler's own need for this step, where its refusal says it: the calculator's
    # figures are scaled by how far they sit from it, as for a step that compiled (fit_advice)
    scale = 1.0
    if cap and (needs := _REFUSED_NEEDS.search(refusal)) and (now := predict(cfg)) > 0:
        scale = float(needs[1]) * _UNIT[needs[2].upper()] / now
    for text, change in _changes(cfg, sizes) if cap else ():
        try:
            changed = override(cfg, **change)
        except ConfigError:
            continue
        predicted = predict(changed) * scale
        if predicted <= cap:
            return f"{short}; {text} would fit ({predicted / GIB:.1f} GiB, predicted)"
    return f"{short}; {_more_devices(cfg)}"


# XLA's refusal of a step too big for a device: "… needs 17.61G, 15.75G available …"
# (a figure in plain bytes, no unit, is not read: the advice is then the calculator's alone)
_REFUSED_NEEDS = re.compile(r"needs (\d+(?:\.\d+)?)\s*([KMGT])i?B?\b", re.IGNORECASE)
_UNIT = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _more_devices(cfg: Config) -> str:
    """The advice when no single change fits: more devices, sharded where they are not."""
    fsdp = cfg.strategy in ("fsdp", "fsdp+tp")
    return "more devices (a larger target)" + ("" if fsdp else " with strategy=fsdp")


def host_link(info: DeviceInfo) -> tuple[float | None, float | None, str]:
    """(host→device, device→host) bytes/s and where they come from: measured here on a real
    accelerator (lab.measure.ceilings), the spec table's host link for a plan (half of its
    both-directions figure each way), None where neither exists."""
    if not info.aot:
        h2d = ceilings.host_to_device(budget_s=0.5)["bytes_per_s"]
        d2h = ceilings.device_to_host(budget_s=0.5)["bytes_per_s"]
        return h2d, d2h, f"measured here ({info.device_kind}, lab.measure.ceilings)"
    spec = specs.lookup(info.device_kind)
    if spec is None or spec.host_bandwidth is None:
        return None, None, f"no host-link figure for {info.device_kind} in the spec table"
    each = spec.host_bandwidth / 2
    return (
        each,
        each,
        f"spec table: {spec.name} host link, half of {spec.source_of('host_bandwidth')}",
    )


def offload_cost(mem: dict | None, info: DeviceInfo) -> OffloadCost | None:
    """What offloading moves per step and what it would cost at the host link's bandwidth:
    offloaded activations out in the forward and back in the backward (2 × host temp), the
    optimizer state in (host arguments) and out (host outputs). No overlap with compute is
    assumed, so the time is what the step would grow by at most: predicted."""
    if not mem or not (mem.get("host_temp_bytes") or mem.get("host_argument_bytes")):
        return None
    to_device = mem["host_temp_bytes"] + mem["host_argument_bytes"]
    to_host = mem["host_temp_bytes"] + mem["host_output_bytes"]
    h2d, d2h, source = host_link(info)
    seconds = to_device / h2d + to_host / d2h if h2d and d2h else None
    return OffloadCost(
        bytes_to_device=to_device,
        bytes_to_host=to_host,
        host_to_device_bytes_per_s=h2d,
        device_to_host_bytes_per_s=d2h,
        bandwidth_source=source,
        added_step_s=seconds,
    )


def capacity_bytes(info: DeviceInfo, device=None) -> float | None:
    """Memory one device has: the allocator's limit, host RAM on CPU; for a target, what its
    compiler lets a program hold (a TPU's: memory.compiler_hbm) or else the spec (a GPU's:
    the share JAX's allocator takes of it, as a run there would have)."""
    if info.aot:
        known = memory.device_capacity_bytes(device) if device is not None else None
        if known:
            return known
        spec = specs.lookup(info.device_kind)
        if not spec:
            return None
        reported = plans.gpu.reported_memory(info.device_kind)
        return memory.usable_bytes(spec.memory_bytes, info.device_kind, reported)
    return memory.device_capacity_bytes(jax.local_devices()[0])


def _aot_plan(
    compiled,
    cfg: Config,
    info: DeviceInfo,
    fpt: float,
    n_devices: int,
    predicted: PredictedStep | None = None,
) -> dict:
    """What the model predicts for a slice that is not here: compiled, not run.

    Step time: the step-time model over the compiled program (lab/predict), labelled
    predicted with its measured error; where the target has no spec entry, the compiler's own
    estimate floored by the roofline of the model's FLOPs (`plans.step_estimate`).
    `estimate_label` says which: *compiled, not run* only for the compiler's own estimate
    (a compiler produced it), *predicted* for the model's time or the roofline floor, with
    `estimate_error` saying how far such a figure is from a measured one, in words (the
    compiler's estimate: checked against no measurement, its ratio to the roofline floor of
    the same program). `label` stays the plan's: its memory and FLOPs are read from the
    compiled program.
    """
    spec = specs.lookup(info.device_kind)
    peak = specs.peak_flops(info.device_kind, cfg.model.dtype)
    step_flops = fpt * cfg.batch_size * cfg.seq_len
    if predicted:
        est_s = predicted.seconds
        source = f"predicted by the step-time model; {predicted.error}"
        error = f"step-time model of the compiled program; {predicted.error}"
    else:
        e = plans.step_estimate(
            compiled, step_flops / n_devices, spec, peak, device_kind=info.device_kind
        )
        est_s, source, error = e.seconds, e.source, e.error
    mfu = step_flops / (est_s * peak * n_devices) if est_s and peak else None
    return {
        "label": "compiled, not run",
        "estimated_step_s": est_s,
        "estimate_source": source,
        "estimate_label": (
            None
            if est_s is None
            else "compiled, not run"
            if source == cost.COMPILER_ESTIMATE
            else "predicted"
        ),
        "estimate_error": error,
        "peak_flops_per_device": peak,
        "implied_mfu": mfu,
    }


def _needed_bytes(analysis: dict) -> int | None:
    mem = analysis["compiled_memory_per_device"]
    return mem.get("total_bytes") if mem else None


def memory_problem(analysis: dict, info: DeviceInfo) -> str | None:
    """One line if the compiled step cannot fit the device, else None. On CPU the simulated
    devices share one host, whose memory other work holds some of: the step must fit what the
    host has available now (`memory.host_available_bytes`), not its total (the capacity)."""
    need = _needed_bytes(analysis)
    cap = analysis["capacity_bytes_per_device"]
    if not need or not cap or info.aot:  # a plan reports the fit instead of refusing
        return None
    if info.backend == "cpu":
        # the mesh's devices, which may be fewer than are present (the timing tools' one)
        n = analysis.get("devices") or info.local_count
        need_total = need * n
        have = min(cap, memory.host_available_bytes() or cap)
        where = f"the host has {have / GIB:.2f} GiB available now (of {cap / GIB:.2f} GiB)"
        needs = (
            f"{need_total / GIB:.2f} GiB"
            if n == 1
            else f"{need_total / GIB:.2f} GiB over its {n} simulated devices "
            f"({need / GIB:.2f} GiB each)"
        )
    else:
        need_total, have, where = need, cap, f"the device has {cap / GIB:.2f} GiB"
        needs = f"{need / GIB:.2f} GiB per device"
    if need_total <= have:
        return None
    return f"the compiled step needs {needs} but {where}: {TOO_BIG_ADVICE}"


# A step the memory calculator puts at more than this many times the memory there is is
# refused before its compile: the calculator sits within 15% of the compiled step in the
# lab's tests, so no step that fits is refused by it, and a step of terabytes is not compiled
# for a minute (XLA's slow-compile alarms on the terminal) only to be refused after.
PRECHECK_MARGIN = 2.0
TOO_BIG_ADVICE = (
    "try a smaller batch_size, remat=full, or a mesh over more devices with strategy=fsdp"
)


def far_too_big(trainer) -> str | None:
    """Why the step cannot fit, from the memory calculator alone (nothing compiled), where its
    figure is over PRECHECK_MARGIN× the memory there is; None otherwise, and for plans (they
    report the fit). On CPU the simulated devices share the host's available memory
    (`memory.host_available_bytes`); elsewhere each device has its own."""
    device = trainer.mesh.devices.flat[0]
    cpu = device.platform == "cpu"
    capacity = memory.device_capacity_bytes(device)
    if not capacity:
        return None
    have = min(capacity, memory.host_available_bytes() or capacity) if cpu else capacity
    try:
        per_device = memory.predict_lab_step(
            trainer.cfg,
            sizes=dict(trainer.mesh.shape),
            backend=device.platform,
            census=census_for(trainer.cfg, trainer.mesh),
        )["total"]
    except Exception:  # noqa: BLE001 - no calculator figure: the compiled one decides
        return None
    need = per_device * (trainer.mesh.size if cpu else 1)
    if need <= PRECHECK_MARGIN * have:
        return None
    where = "the host has available now" if cpu else "the device has"
    return (
        f"the memory calculator puts the step at {need / GIB:,.1f} GiB, {need / have:,.0f}× "
        f"what {where} ({have / GIB:,.1f} GiB); not compiled"
    )


def _busy_load() -> str:
    """'load 2.2 on 2 cores' when other work shares the CPU (`rec.busy_host`), else ''."""
    busy = rec.busy_host()
    return "" if busy is None else f"load {busy[0]:.1f} on {busy[1]} cores"


def _busy() -> str:
    """A warning when other work shares the CPU: the run and the peak then see different
    machines, and their ratio (CPU MFU) can land anywhere, above 100% included."""
    load = _busy_load()
    return f"; host busy: {load}, CPU figures unreliable" if load else ""


def mesh_peak(cfg: Config, info: DeviceInfo, n_devices: int) -> tuple[float | None, str]:
    """Peak FLOP/s of the devices the mesh uses and where the figure comes from."""
    if info.backend == "cpu":
        peak = ceilings.matmul_peak(cfg.model.dtype)
        return peak, f"measured {cfg.model.dtype} matmul peak of this host (all cores)" + _busy()
    per_device = specs.peak_flops(info.device_kind, cfg.model.dtype)
    if per_device is None:
        return None, f"no spec-table entry for {info.device_kind!r}: MFU unavailable"
    return per_device * n_devices, f"spec-table {cfg.model.dtype} peak × {n_devices} devices"


def run_peak(
    cfg: Config, info: DeviceInfo, n_devices: int, resumed_in: Path | None = None
) -> tuple[float | None, str]:
    """`mesh_peak` for a run: a resumed CPU run on the host that began it keeps the peak its
    summary.json holds, so its MFU curve stays on one scale (a CPU's measured peak moves with
    the host's load; measured again, MFU jumped at the resume with the step time unchanged)."""
    if info.backend == "cpu" and resumed_in is not None:
        import json
        import socket

        try:
            earlier = json.loads((Path(resumed_in) / "summary.json").read_text())
            peak, source = earlier["peak_flops_per_s"], earlier["peak_source"]
            env = earlier["environment"]
            host = env["hostname"], env.get("cpu_count"), env.get("device_kind")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            peak = source = host = None
        here = rec.environment()
        measured = f"measured {cfg.model.dtype} matmul peak of this host"
        if (
            isinstance(peak, int | float)
            and peak > 0
            and isinstance(source, str)
            and source.startswith(measured)
            # the same machine: its name, and its cores and kind where the summary says them
            and host is not None
            and host[0] == socket.gethostname()
            and host[1] in (None, here.get("cpu_count"))
            and host[2] in (None, here.get("device_kind"))
        ):
            kept = " (all cores), measured when the run began and kept across its resumes"
            busy = _busy()
            if "host busy" in source:  # the peak's load and the run's, said once
                load = _busy_load()
                now = f" and now: {load}" if load else ""
                busy = f"; host busy when measured{now}, CPU figures unreliable"
            return float(peak), measured + kept + busy
    return mesh_peak(cfg, info, n_devices)


def summarise_run(
    cfg: Config,
    info: DeviceInfo,
    analysis: dict,
    times,
    losses,
    earlier=None,
    resumed_from=0,
    peak=None,
    profiled=None,
    save_s=(),
    warmup_timed=False,
) -> dict:
    """The run's summary. `losses`: (step, loss) of the steps this process trained;
    `resumed_from`: the checkpoint step this segment started from (0: a fresh run);
    `earlier`: the (step, loss) metrics.jsonl holds from before it, so that the loss row
    covers the run from its first logged step and the segment is named apart; `peak`: the
    (FLOP/s, source) MFU is against (`run_peak`; default `mesh_peak`); `profiled`: the
    (first, last) step traced by profile=true, whose times `times` leaves out; `save_s`: the
    time the loop spent in each checkpoint save, kept out of `times` and reported apart;
    `warmup_timed`: `times` are warm-up steps (a run too short to time any past them)."""
    tokens_per_s = cfg.batch_size * cfg.seq_len / times.median_s
    achieved = analysis["model_flops_per_token"] * tokens_per_s
    peak, peak_source = peak or mesh_peak(cfg, info, analysis["devices"])
    stats = memory.device_memory_stats(jax.local_devices()[0])
    return {
        **analysis,
        "step_time": times.as_dict(),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / analysis["devices"],
        "model_flops_per_s": achieved,
        "peak_flops_per_s": peak,
        "peak_source": peak_source,
        "mfu": achieved / peak if peak else None,
        "predicted_step_time": _predicted_vs_measured(
            analysis.get("predicted_step"), times, _busy_load() if info.backend == "cpu" else ""
        ),
        "memory_stats": stats,
        "loss_first": (earlier or losses)[0][1] if (earlier or losses) else None,
        "loss_last": losses[-1][1] if losses else None,
        "steps_run": len(losses),
        **({"profiled_steps": list(profiled)} if profiled else {}),
        **({"warmup_timed": True} if warmup_timed else {}),
        **({"checkpoint_saves": {"count": len(save_s), "total_s": sum(save_s)}} if save_s else {}),
        **(
            {
                "resumed_from": resumed_from,
                "loss_first_step": (earlier or losses)[0][0] if (earlier or losses) else None,
                "segment_loss_first": losses[0][1] if losses else None,
            }
            if resumed_from
            else {}
        ),
    }


def _predicted_vs_measured(predicted: dict | None, times, busy_load: str = "") -> dict | None:
    """The model's step time beside the measured median: seconds, breakdown, their ratio.
    `busy_load` ('load 2.2 on 2 cores'): other work shared the CPU, so the ceilings the
    prediction reads and the time it is divided by were both measured under a load that
    moves, and the ratio can land far outside the model's quoted error: a caveat says so."""
    if not predicted:
        return None
    caveat = {"caveat": f"host busy: {busy_load}, CPU figures unreliable"} if busy_load else {}
    return {
        "seconds": predicted["seconds"],
        "breakdown": predicted["breakdown"],
        "ratio_to_measured": predicted["seconds"] / times.median_s,
        "error": predicted["error"],
        "label": "predicted",
        **caveat,
    }


WARMUP_CAVEAT = "warm-up steps only: the run was too short to time a step past them"


def run_records(s: dict, run: str) -> list[dict]:
    """The run's headline figures as lab.measure records (versions, device, time stamped),
    so a run folder reads like any other result and merges with the experiments'; each
    record's config says how the step was split (`PARALLELISM`, as the summary holds it)."""
    plan = "aot" in s
    mem = s.get("compiled_memory_per_device")
    out = []
    if mem:
        label = "compiled, not run" if plan else "compiled"  # XLA's buffer assignment
        out.append(
            rec.make_record(
                "compiled memory per device", mem["total_bytes"], "B", label=label, run=run, **mem
            )
        )
    if plan:  # the target's figures, stamped with the target (the host only compiled them)
        a = s["aot"]
        est, tokens = a.get("estimated_step_s"), s.get("tokens_per_step")
        # the compiler's own estimate with its cost model's error, in words
        source = cost.estimate_with_error(a.get("estimate_source"), a.get("estimate_error"))
        how = {"run": run, "model_error": source}
        if a.get("caveat"):  # a step that does not fit the target: its figures say so
            how["caveat"] = a["caveat"]
        if est:
            out.append(rec.make_record("training step time", est, "s", label="predicted", **how))
            if tokens:
                out.append(
                    rec.make_record(
                        "training tokens/s", tokens / est, "tokens/s", label="predicted", **how
                    )
                )
        if a.get("implied_mfu") is not None:
            out.append(
                rec.make_record(
                    "training MFU", a["implied_mfu"], "fraction", label="predicted", **how
                )
            )
        kind = s.get("device_kind") or ""
        target = {
            "backend": "tpu" if kind.startswith("TPU") else "gpu",
            "device_kind": kind,
            "device_count": s.get("devices"),
            "local_device_count": s.get("devices"),  # a plan's devices: one program's
        }
        out = [{**r, "compiled_on": {k: r[k] for k in target}, **target} for r in out]
    # not the steady step: every record derived from the time says so, as the table does
    warm = {"caveat": WARMUP_CAVEAT} if s.get("warmup_timed") else {}
    if s.get("step_time"):
        t = s["step_time"]
        timing = {k: t[k] for k in ("p10_s", "p90_s", "runs", "compile_s")}
        out.append(
            rec.make_record("training step time", t["median_s"], "s", run=run, **timing, **warm)
        )
        out.append(
            rec.make_record("training tokens/s", s["tokens_per_s"], "tokens/s", run=run, **warm)
        )
    if s.get("mfu") is not None:
        out.append(
            rec.make_record(
                "training MFU",
                s["mfu"],
                "fraction",
                label="derived",
                run=run,
                peak_source=s["peak_source"],
                convention=s["flops_convention"],
                **warm,
            )
        )
    split = {k: s[k] for k in PARALLELISM if k in s}  # every record says how the step ran
    return [{**r, "config": {**r["config"], **split}} for r in out]


def write_summary(run_dir: Path, summary: dict) -> None:
    """summary.json (every figure, plus the environment it was measured in) and
    records.jsonl (the headline figures as records)."""
    env = {"environment": rec.environment(), "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    # whole or not at all: a full disk leaves the previous summary, never a torn one
    rundir.write_json(run_dir / "summary.json", {**summary, **env})
    path = run_dir / "records.jsonl"
    path.unlink(missing_ok=True)  # a resumed run rewrites its figures, not appends to them
    rec.write_records(path, run_records(summary, run_dir.name))

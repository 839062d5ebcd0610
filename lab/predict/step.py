"""The predicted time of the lab's training step, for the machine at hand or a planned target.

`lab.run` prints it beside the measured median (on CPU: the model fed with this host's
measured matmul peak and copy bandwidth, the one check of the model every run can make) and,
for `target=tpu:…` / `target=gpu:…`, in place of a measurement: labelled *predicted*, with the
model's error as last measured (`lab/predict/fits.json`: the free parameters, the calibration
set they were fitted on and the error on held-out measurements).
"""

import json
from pathlib import Path

from lab.devices import DeviceInfo
from lab.measure import ceilings, cost, specs
from lab.predict import machines
from lab.predict.model import Machine, predict_compiled

FITS = Path(__file__).with_name("fits.json")


def fits() -> dict:
    """The fitted parameters and measured errors per machine class ('cpu', 'tpu', 'gpu')."""
    try:
        return json.loads(FITS.read_text())
    except (OSError, ValueError):
        return {}


def error_statement(kind: str) -> str:
    """'model error 11% median, worst 1.6×, on 16 held-out points (…)' or why there is none."""
    entry = fits().get(kind) or {}
    err = entry.get("held_out")
    if not err:
        return "model error not measured yet for this machine class"
    return (
        f"model error {err['median']:.0%} median, worst {err['worst']:.2f}×, on {err['n']} "
        f"held-out {err['what']}"
    )


def machine_for(info: DeviceInfo, target: str, mesh_shape: dict, dtype: str) -> Machine | None:
    """The machine the step runs on: a target's spec entry, or this CPU as measured."""
    kind = "tpu" if info.backend == "tpu" else "gpu" if info.backend in ("gpu", "cuda") else "cpu"
    fit = (fits().get(kind) or {}).get("fit")
    if info.aot or info.backend != "cpu":
        spec = specs.lookup(info.device_kind)
        if spec is None:
            return None
        if kind == "tpu":
            topology = target.split(":")[-1] if target else "x".join(["1"] * 2)
            return machines.tpu_machine(spec, topology, mesh_shape, fit)
        return machines.gpu_machine(spec, mesh_shape, fit=fit)
    return cpu_machine_measured(dtype, info.local_count, fit)


def cpu_machine_measured(dtype: str, n_devices: int, fit=None) -> Machine:
    """This host as measured (cached for the process): the matmul peak at `dtype`, the copy
    bandwidth out of memory, and the copy bandwidth of an array that stays in the last-level
    cache."""
    llc = machines.last_level_cache_bytes()
    return machines.cpu_machine(
        {dtype: ceilings.matmul_peak(dtype)},
        ceilings.copy_peak(),
        n_devices,
        fit,
        cache_bytes=llc,
        cache_bytes_per_s=ceilings.copy_peak(llc // 8, cached=True) if llc else 0.0,
    )


def attention_flops_per_device(cfg, n_devices: int) -> float:
    """FLOPs of the attention kernels of one step per device, for a kernel XLA cannot see
    into (a Pallas custom call): forward, backward (2.5×) and remat's second forward, causal
    blocks skipped (lab.measure.cost.attention_flops); a windowed layer's by the share of
    keys its window leaves (lab.measure.cost.visible_keys)."""
    m = cfg.model
    fwd = cost.attention_flops(
        cfg.batch_size, m.n_heads, cfg.seq_len, cfg.seq_len, m.head_dim, causal=True
    )
    causal = cost.visible_keys(cfg.seq_len)
    layers = sum(cost.visible_keys(cfg.seq_len, w) / causal for w in m.layer_windows)
    recompute = 1.0 if m.remat in ("full", "offload") else 0.0
    return fwd * (1.0 + 2.5 + recompute) * layers / max(n_devices, 1)


def predict_step(compiled, cfg, info: DeviceInfo, mesh) -> dict | None:
    """{"seconds", "breakdown", "top_ops", "machine", "label", "error"} for one step, or None
    where the machine is unknown (no spec entry)."""
    machine = machine_for(info, cfg.target, dict(mesh.shape), cfg.model.dtype)
    if machine is None:
        return None
    p = predict_compiled(
        compiled, machine, mesh, custom_flops=attention_flops_per_device(cfg, mesh.size)
    )
    kind = "cpu" if machine.name.startswith("this CPU") else info.backend
    return {
        **p.as_dict(),
        "label": "predicted",
        "error": error_statement("tpu" if kind == "tpu" else "gpu" if kind != "cpu" else "cpu"),
        "machine_source": machine.source,
    }

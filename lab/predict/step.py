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
from lab.measure.predicted import PredictedStep
from lab.predict import machines
from lab.predict.model import Machine, predict_compiled

FITS = Path(__file__).with_name("fits.json")
# Step times measured on accelerators lent to the lab, each beside the model's prediction for
# the same compiled program (`python -m lab.tools.prediction here=true` on the device): one
# JSON Lines file per device kind. Nothing is fitted on them, so they are held-out checks.
MEASURED = Path(__file__).with_name("measured")
STEP_CHECK = "step time, measured and predicted"  # a lab.run step (what device_checks reads)
OP_CHECK = "op time, measured and predicted"  # a single op: kept apart from the steps' error


def fits() -> dict:
    """The fitted parameters and measured errors per machine class ('cpu', 'tpu', 'gpu')."""
    try:
        return json.loads(FITS.read_text())
    except (OSError, ValueError):
        return {}


def slug(device_kind: str) -> str:
    """'NVIDIA H100 80GB HBM3' → 'nvidia-h100-80gb-hbm3' (the file name of its checks)."""
    return "-".join("".join(c if c.isalnum() else " " for c in device_kind.lower()).split())


def device_checks(folder: Path = MEASURED) -> dict[str, dict]:
    """Per device kind: {"n", "median", "worst", "dates", "backend"} of |predicted/measured − 1|
    over the lab.run steps measured on it (records without both figures, and single ops'
    checks, are skipped)."""
    out = {}
    for path in sorted(Path(folder).glob("*.jsonl")):
        ratios, dates, kind, backend = [], set(), None, None
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
                predicted, measured = r["config"].get("predicted_s"), r["value"]
            except (ValueError, KeyError, TypeError):
                continue
            if r.get("what", STEP_CHECK) != STEP_CHECK:
                continue  # a single op's check: not a step
            if predicted and measured:
                ratios.append(predicted / measured)
                dates.add(r.get("timestamp", "")[:10])
                kind, backend = r.get("device_kind", path.stem), r.get("backend")
        if ratios:
            errs = sorted(abs(x - 1) for x in ratios)
            mid = len(errs) // 2
            median = errs[mid] if len(errs) % 2 else (errs[mid - 1] + errs[mid]) / 2
            out[kind] = {
                "n": len(ratios),
                "median": median,
                "worst": max(max(x, 1 / x) for x in ratios),
                "mean_ratio": sum(ratios) / len(ratios),
                "dates": sorted(d for d in dates if d),
                "backend": backend,
            }
    return out


# How a held-out published point's workload reads in the error statement (singular, plural).
_WORKLOADS = {
    "train": ("training step", "training steps"),
    "gemm": ("GEMM", "GEMMs"),
    "all-reduce": ("all-reduce", "all-reduces"),
    "decode": ("decode", "decode"),
    "prefill": ("prefill", "prefill"),
}


def _held_out_rows(kind: str) -> list[dict]:
    """The held-out published points of a machine class ('gpu', 'tpu') as last validated."""
    rows = (fits().get("validation") or {}).get("rows") or []
    return [
        r
        for r in rows
        if r.get("role") == "held-out"
        and r.get("error") is not None
        and str(r.get("hardware", "")).startswith("tpu") == (kind == "tpu")
    ]


def held_out_mix(kind: str) -> str:
    """'1 training step, 7 GEMMs, 4 decode, …': what the held-out published points of a
    machine class are, so their error is not read as a training step's."""
    counts: dict[str, int] = {}
    for r in _held_out_rows(kind):
        counts[r["workload"]] = counts.get(r["workload"], 0) + 1
    parts = []
    for workload, n in sorted(counts.items(), key=lambda kv: (kv[0] != "train", -kv[1], kv[0])):
        one, many = _WORKLOADS.get(workload, (workload, workload))
        parts.append(f"{n} {one if n == 1 else many}")
    return ", ".join(parts)


def _check_text(device: str, c: dict, step_on: str | None) -> str:
    m = c["mean_ratio"]
    lean = ""  # which way the steps' predictions lean, where they lean together
    if m < 0.9 or m > 1.1:
        lean = f", predicted {'faster' if m < 1 else 'slower'} than measured: "
        lean += f"mean predicted/measured {m:.2f}"
    other = "not this chip; " if step_on and not _one_chip(device, step_on) else ""
    fitted = (fits().get("validation") or {}).get("date")
    stale = ""  # each step was predicted when it was measured: a refit since is not checked
    if fitted and c["dates"] and max(c["dates"]) < fitted:
        stale = f"; the fit in use, of {fitted}, is not checked on them"
    return (
        f"{c['median']:.0%} median, worst {c['worst']:.2f}×, on {c['n']} lab.run "
        f"steps measured on an {device} ({other}{', '.join(c['dates'])}, predicted with "
        f"that day's fit{lean}{stale})"
    )


def time_ratio(row: dict) -> float:
    """A published point's predicted/published time: its error is in the publisher's unit,
    and for a rate (TFLOP/s, GB/s, tokens/s) a + is a prediction that runs faster."""
    ratio = row["predicted"] / row["published"]
    return 1 / ratio if is_rate(row) else ratio


def is_rate(row: dict) -> bool:
    """Whether a published point's unit is a rate (TFLOP/s, GB/s, tokens/s, MFU), not a time."""
    unit = str(row.get("unit", ""))
    per_time = "/s" in unit and not unit.startswith(("s/", "ms/", "us/"))  # not a time a step
    return per_time or unit.startswith("MFU")


def _same_chip(hardware: str, device_kind: str) -> bool:
    """Whether a published point's hardware ('h100 × 8', 'tpu-v6e × 256') is the chip a
    device kind ('NVIDIA H100 80GB HBM3', 'TPU v5 lite') names."""
    key = specs.lookup_key(device_kind) or ""
    kind = hardware.split(" × ")[0]
    return bool(key) and (key == kind or key.startswith(kind + "-"))


def _one_chip(a: str, b: str) -> bool:
    """Whether two device kinds name one chip: a plan names its target as lab/plans/gpu.py
    does ('NVIDIA H200 141GB HBM3e'), a measured step its device as the driver said ('NVIDIA
    H200'); the spec table maps both to one entry."""
    key = specs.lookup_key(a)
    return a == b or (key is not None and key == specs.lookup_key(b))


def error_statement(kind: str, step_on: str | None = None) -> str:
    """'model error 11% median, worst 1.6×, on 16 held-out published points (1 training step,
    …)' or why there is none; for a GPU or TPU, also the error on the steps measured on such
    a device, where there are.

    `step_on` (a device kind) says the prediction is of a training step on that chip: the
    statement then leads with the error on training steps (the lab.run steps measured on a
    device, the published training steps held out), names a check made on another chip as
    such, and gives the error over every held-out point (mostly single ops, decode and
    prefill) after it, with what those points are."""
    entry = fits().get(kind) or {}
    err = entry.get("held_out")
    if not err:
        text = "model error not measured yet for this machine class"
    else:
        point = err["what"].removesuffix("s") if err["n"] == 1 else err["what"]
        mix = held_out_mix(kind) if kind != "cpu" else ""
        size = f"{err['median']:.0%}" if err["n"] == 1 else f"{err['median']:.0%} median"
        text = (
            f"model error {size}, worst {err['worst']:.2f}×, on {err['n']} held-out {point}"
            if err["n"] > 1
            else f"model error {size} on 1 held-out {point}"
        ) + (f" ({mix})" if mix else "")
    if kind == "cpu" and err and entry.get("host"):
        from lab.measure.records import cpu_model

        text = text.replace(" on this CPU", "")
        if entry["host"] == cpu_model():
            text += f" on this CPU ({entry['date']})"
        else:  # the fit is another processor's
            text += (
                f" on another CPU ({entry['host']}, {entry['date']}): refit here with "
                "python -m lab.tools.prediction cpu=true"
            )
    uncalibrated = ""
    if entry and entry.get("fit") is None and kind != "cpu":
        # nothing calibrates it: the roofline with efficiencies 1 and no fixed costs
        uncalibrated = (
            f"uncalibrated for {kind.upper()} (no usable calibration point: the roofline, "
            "efficiencies 1, no fixed per-op or per-call cost); "
        )
    if kind not in ("gpu", "tpu"):
        return uncalibrated + text
    checks = {
        device: c
        for device, c in device_checks().items()
        if (c["backend"] == "tpu") == (kind == "tpu")
    }
    steps = [_check_text(device, c, step_on) for device, c in checks.items()]
    if not step_on:
        return uncalibrated + "; ".join([text, *steps])
    trained = [r for r in _held_out_rows(kind) if r["workload"] == "train"]
    if trained:
        errors = []
        for r in trained:
            t = time_ratio(r)
            other = "" if _same_chip(r["hardware"], step_on) else ", not this chip"
            # a point published as a rate: its own error too, as fits.json holds it
            rate = f"{r['unit']} {1 / t - 1:+.0%}; " if is_rate(r) else ""
            errors.append(
                f"{abs(t - 1):.0%} {'shorter' if t < 1 else 'longer'} "
                f"({rate}{r['hardware']}{other})"
            )
        n = len(trained)
        steps.append(
            f"step time predicted {', '.join(errors)} than published on {n} held-out "
            f"published training step{'s' * (n > 1)}"
        )
    if not steps:
        return uncalibrated + text
    lead = "model error on training steps: "
    if checks and not any(_one_chip(device, step_on) for device in checks):
        lead += f"no step measured on an {step_on}; "
    if err and trained and len(trained) == err["n"]:  # the training steps are all it has
        return f"{uncalibrated}{lead}{'; '.join(steps)}"
    return f"{uncalibrated}{lead}{'; '.join(steps)}; over every held-out point: {text}"


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
    llc = ceilings.last_level_cache_bytes()
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


def predict_step(compiled, cfg, info: DeviceInfo, mesh, top: int = 8) -> PredictedStep | None:
    """One step's predicted time, where it goes and its `top` ops, labelled with the model's
    error; None where the machine is unknown (no spec entry)."""
    machine = machine_for(info, cfg.target, dict(mesh.shape), cfg.model.dtype)
    if machine is None:
        return None
    p = predict_compiled(
        compiled, machine, mesh, custom_flops=attention_flops_per_device(cfg, mesh.size)
    )
    kind = "cpu" if machine.name.startswith("this CPU") else info.backend
    vendor = "tpu" if kind == "tpu" else "gpu" if kind != "cpu" else "cpu"
    error = error_statement(vendor, step_on=info.device_kind if vendor != "cpu" else None)
    if kind == "cpu" and getattr(info, "process_count", 1) > 1:
        error += (
            f"; fitted in one process: this run's {info.process_count} processes exchange "
            "their collectives over gloo's TCP, which the model does not time"
        )
    return PredictedStep(
        seconds=p.seconds,
        breakdown=p.breakdown(),
        collective_s=p.collective_s,
        machine=p.machine,
        top_ops=tuple(p.top(top)),
        error=error,
        machine_source=machine.source,
    )

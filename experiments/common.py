"""What every experiment shares: the record shape, sizes, and probes of the lab's real step.

A record for the claims ledger is `lab.measure.records.make_record` with four keys in its
config: `claim` (C01…), `metric` (the `Stated.metric` it answers, or None for context and
plot data), `role` (evidence | context | reference) and, where they differ from the process,
`on` (the backend measured) and `target` (the device a prediction is about). Predictions
name the measured inputs they were derived from in `inputs` and the spec entry in `spec`.
"""

import functools
import math
import os
import sys
import time

import jax
import jax.numpy as jnp

from lab import plans
from lab.config import PRESETS, STATED_PARAMS, Config, make_config, override
from lab.measure import ceilings, cost, memory, records, specs, timing

SIZES = ("tiny", "quick", "full")
# The lab step every training topic times, per size, and the time budget for timing it: one
# config shared by memory, training and parallel, so a process compiles and times it once.
# Naive attention: the same program on every backend (results compare across machines), and
# the one lab.measure.memory's calculator models (C09 holds the calculator against it).
_STEP = dict(data="synthetic", attention="naive")
STEP = {
    "tiny": dict(preset="tiny", batch_size=2, seq_len=32, **_STEP),
    "quick": dict(preset="small", batch_size=8, seq_len=256, **_STEP),
    "full": dict(preset="small", batch_size=16, seq_len=1024, **_STEP),
}
STEP_BUDGET_S = {"tiny": 0.01, "quick": 0.5, "full": 2.0}
YEAR_S = 365.25 * 24 * 3600
DAY_S = 24 * 3600

# The model fields the calculators (lab.measure.memory, lab.measure.cost) take for a shape.
SHAPE_FIELDS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size")

# Accelerators the predictions are made for (spec-table keys), and the articles' names.
REFERENCE_GPUS = {"t4": "T4", "rtx-4090": "RTX 4090", "a100-sxm4-80gb": "A100", "h100-sxm": "H100"}


def record(
    claim: str | None,
    metric: str | None,
    what: str,
    value,
    unit: str,
    *,
    label: str = "measured",
    role: str = "evidence",
    on: str | None = None,
    target: str | None = None,
    **config,
) -> dict:
    """One ledger record (see the module docstring for the keys a verdict reads)."""
    if isinstance(value, bool):
        value = float(value)
    elif value is not None and not isinstance(value, int | float):
        value = float(value)
    cfg = {"claim": claim, "metric": metric, "role": role, **config}
    if label == "predicted" and config.get("model_error"):  # how wrong such a prediction is
        what = f"{what} — predicted by the {config['model_error']}"
    if on:
        cfg["on"] = on
    if target:
        cfg["target"] = target
    return records.make_record(what, value, unit, label=label, **cfg)


def llama_preset(size: str) -> str:
    """Llama-2 "7B" or "70B" → its preset in lab.config.PRESETS."""
    return f"llama2-{size.lower()}"


def llama_shape(size: str) -> dict:
    """Llama-2 `size` ("7B", "70B") as the calculators take it: its preset's model fields
    (lab.config.PRESETS, from the released configs) and the parameter count the paper states
    (lab.config.STATED_PARAMS), which is no config field."""
    preset = llama_preset(size)
    return dict(n_params=STATED_PARAMS[preset], **{k: PRESETS[preset][k] for k in SHAPE_FIELDS})


def backend() -> str:
    return jax.default_backend()


def cores_used() -> int:
    """CPU cores this process may run on (XLA's CPU thread pool is sized to them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_device():
    """The host CPU as a JAX device (present next to any accelerator)."""
    return jax.devices("cpu")[0]


def pick(size: str, **by_size):
    """`pick(size, tiny=1, quick=2, full=3)` with a clear error for a bad size."""
    if size not in SIZES:
        raise ValueError(f"size={size!r}: expected one of {', '.join(SIZES)}")
    return by_size[size]


def matmul_rate(
    n: int, dtype="float32", precision=None, *, device=None, budget_s: float = 0.5
) -> dict:
    """FLOP/s of a jitted n×n matmul on `device` (default: the default device), rotating two
    random input pairs; median of `timing.bench` after compile and warm-up (on an accelerator
    each sample is calls queued back to back, as `lab.measure.ceilings` times)."""
    device = device or jax.devices()[0]
    fn = jax.jit(lambda a, b: jnp.matmul(a, b, precision=precision))
    xs = [jax.device_put(x, device) for x in timing.random_inputs(0, [(n, n)] * 4, dtype)]
    inner = ceilings.queued(device.platform)  # calls queued per sample, as the ceilings time
    result = timing.bench(
        fn, rotate=[xs[:2], xs[2:]], budget_s=budget_s, warmup=1, min_runs=3, inner=inner
    )
    flops = cost.matmul_flops(n, n, n)
    return {"n": n, "flops": flops, "flops_per_s": flops / result.median_s, **result.as_dict()}


@functools.cache
def host_peak(n: int, budget_s: float = 0.5) -> float:
    """Measured float32 matmul FLOP/s of this process's CPU: MFU's 100% on CPU, cached."""
    if backend() == "cpu":
        return ceilings.matmul_peak("float32", n=n, budget_s=budget_s)
    return matmul_rate(n, device=cpu_device(), budget_s=budget_s)["flops_per_s"]


def _mfu_n(size: str) -> int:
    return pick(size, tiny=256, quick=1024, full=2048 if backend() == "cpu" else 8192)


def mfu_peak(size: str) -> float:
    """MFU's 100%: the matmul peak measured in this process, in the step's compute dtype
    (float32 on CPU, bf16 on accelerators), so MFU here never rests on a datasheet."""
    n = _mfu_n(size)
    if backend() == "cpu":
        return host_peak(n)
    return ceilings.matmul_peak("bfloat16", n=n)


def mfu_peak_name(size: str) -> str:
    """Which op `mfu_peak` timed, for a record's words: each of the ledger's peaks is its
    own measurement (op, dtype, size), and a record says which one it divides by."""
    return f"{compute_dtype()} matmul, default precision, n={_mfu_n(size)}"


def compute_dtype() -> str:
    """The backend's compute dtype, as dtype=auto resolves it: float32 on CPU, bfloat16 on
    GPU and TPU."""
    return "float32" if backend() == "cpu" else "bfloat16"


def shared_config(size: str) -> Config:
    """The shared step (STEP) in this backend's compute dtype, named: the config the training
    topic times as its float32 or bf16 step, so every topic that compiles or times the shared
    step here shares one compile and one timing (and one report one MFU measured here)."""
    return step_config(size, dtype=compute_dtype())


def shared_step(size: str) -> dict:
    """The shared step timed (shared_config); cached."""
    return train_probe(shared_config(size), budget_s=STEP_BUDGET_S[size])


def mfu_here(size: str) -> float:
    """Model FLOP/s of the shared step over the matmul peak measured here."""
    return shared_step(size)["model_flops_per_s"] / mfu_peak(size)


def accel_peak(spec_key: str) -> tuple[float, str]:
    """(half-precision dense peak FLOP/s, dtype) of a spec entry: the rate training and
    inference are predicted at (bf16, or fp16 where the device has no bf16 units)."""
    spec = specs.SPECS[spec_key]
    best = max(("bfloat16", "float16"), key=lambda d: spec.peak_flops.get(d, 0.0))
    return spec.peak_flops[best], best


def spec_inputs(spec_key: str, *fields: str) -> dict:
    """The spec-table numbers a prediction used, each with its source."""
    spec = specs.SPECS[spec_key]
    out = {"spec": spec_key, "spec_name": spec.name}
    for f in fields:
        value = spec.numbers().get(f)
        out[f] = value
        out[f"{f} source"] = spec.source_of(f)
    return out


# --- predictions ---------------------------------------------------------------------------


def h100_capacity() -> dict:
    """What a training step on an H100 may hold, by the rule lab.run's plans use: the share
    JAX's allocator takes (XLA_CLIENT_MEM_FRACTION or XLA_PYTHON_CLIENT_MEM_FRACTION, default
    0.75) of the total memory the card reports (84.9e9 bytes, above the datasheet's "80 GB"),
    not the whole card (the CUDA context and the allocator's own use the rest). The records'
    `inputs` carry the figures and the rule."""
    h100 = specs.SPECS["h100-sxm"]
    kind = plans.gpu.GPUS["h100"].device_kind
    reported = plans.gpu.reported_memory(kind)
    usable = memory.usable_bytes(h100.memory_bytes, kind, reported)
    return {
        "h100_memory_bytes": h100.memory_bytes,
        "h100_memory_source": h100.source_of("memory_bytes"),
        "h100_reported_bytes": reported,
        "h100_usable_bytes": usable,
        "h100_usable_rule": f"JAX's allocator share, {usable / reported:.2f} of the memory the "
        "card reports (XLA_CLIENT_MEM_FRACTION), as lab.run target=gpu:h100 judges a fit",
    }


# The GPUs the lab compiles for here (lab/plans/gpu.py): spec key → target kind.
COMPILED_GPUS = {"h100-sxm": "h100", "h200": "h200", "a100-sxm4-80gb": "a100"}
# TPU slices the step is compiled for (libtpu): (spec key, chips) → target.
TPU_TOPOLOGIES = {("tpu-v5e", 1): "tpu:v5e:1x1", ("tpu-v5e", 4): "tpu:v5e:2x2"}


def fallback(mfu: float, workload: str = "train") -> str:
    """The error statement of the old rule (datasheet peak × MFU measured here), measured now
    on the held-out published points of the workload whose MFU it scales ("train" or
    "prefill": a forward pass's MFU is judged against published prefills, not training
    steps; lab.studies.prediction)."""
    from lab.studies import prediction

    return prediction.fallback_statement(mfu, workload)


# What the topic in flight has finished so far, as records (a function the topic sets): a stop
# (Ctrl-C, a scheduler's SIGTERM) keeps them beside the finished topics' (experiments/__main__)
_SO_FAR: list = [None]


def keep_so_far(records_so_far) -> None:
    """The topic in flight says how to read its finished points as records (a function of
    no argument; None: nothing to keep). A stop calls it, on another thread: it must read a
    copy of what it reads."""
    _SO_FAR[0] = records_so_far


# Where the topic in flight is (experiments/__main__ shows it beside the topic's name): a
# compile or a timing of tens of seconds each, a topic being minutes of them
_STEP: list = [None]


def on_step(say) -> None:
    """`say(text)` is called as each step of the topic in flight starts (None: nothing)."""
    _STEP[0] = say


def say_step(text: str) -> None:
    """The topic in flight starts `text` ("compiling small, batch 8 × 256, …")."""
    if _STEP[0] is not None:
        _STEP[0](text)


def records_so_far() -> list[dict]:
    """The records of the points the topic in flight has finished ([] where it keeps none)."""
    fn = _SO_FAR[0]
    return list(fn()) if fn else []


def _plan_failed(point_id: str, e: Exception) -> None:
    """One line on stderr: a plan that failed (not one the compiler refused, which
    predict_with_fit answers with None) leaves its claim on the datasheet's rule, and the user
    who asked for plans should know why."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
    print(f"warning: {point_id} was not predicted ({type(e).__name__}: {first})", file=sys.stderr)


def predicted_step(size: str, spec_key: str, chips: int = 1, **fields) -> dict | None:
    """The shared step (STEP, bf16 compute, batch × chips, data-parallel) compiled for
    `chips` of a GPU or TPU slice the lab compiles for and timed by the step-time model with
    its fitted parameters (lab.predict): {"tokens_per_s", "model_flops_per_s", "mfu",
    "seconds", "breakdown", "collective_s", "statement", "target"}; None where no program
    can be compiled here (no compiler for the chip, the gpu-plan extra absent, the compiler
    refuses it)."""

    kind = COMPILED_GPUS.get(spec_key) or TPU_TOPOLOGIES.get((spec_key, chips))
    if kind is None:
        return None
    keys = {**pick(size, **STEP), "dtype": "bfloat16", **fields}
    keys["batch_size"] = keys["batch_size"] * chips
    if kind.startswith("tpu:"):
        target, hw = kind, spec_key
    else:
        target, hw = (f"gpu:{kind}:{chips}" if chips > 1 else f"gpu:{kind}"), kind
    point = {
        "id": f"ledger-{size}-{hw}x{chips}",
        "workload": "train",
        "hardware": {"kind": hw, "chips": chips},
        "lab_config": {**keys, "target": target, "mesh": str(chips)},
        "figure": {"unit": "tokens/s per chip", "value": 1.0},
    }
    out = _predict(point)  # None: the caller's fallback rule serves
    if out is None:
        return None
    prog, seconds = out["program"], out["seconds"]
    peak, _ = accel_peak(spec_key)
    return {
        "tokens_per_s": prog["tokens"] / seconds,
        "model_flops_per_s": prog["model_flops"] / seconds,
        "mfu": prog["model_flops"] / seconds / (chips * peak),
        "seconds": seconds,
        "breakdown": out["breakdown"],
        "collective_s": out["collective_s"],
        "statement": out["statement"],
        "target": target,
    }


def predicted_gemm(spec_key: str, n: int, dtype: str = "bfloat16", *, spec=None) -> dict | None:
    """An n×n×n matmul compiled for one GPU the lab compiles for (`spec_key`) and timed by
    the step-time model: {"flops_per_s", "seconds", "statement", "target"}. `spec`: predict
    the same program on another chip's spec entry (a chip with no compiler here: MI300X),
    labelled so. None where nothing compiles here."""

    kind = COMPILED_GPUS.get(spec_key)
    if kind is None:
        return None
    point = {
        "id": f"ledger-gemm-{kind}-{dtype}-{n}",
        "workload": "gemm",
        "hardware": {"kind": kind, "chips": 1, **({"spec": spec} if spec else {})},
        "lab_program": {"op": "matmul", "target": f"gpu:{kind}", "dtype": dtype}
        | {"m": n, "n": n, "k": n},
        "figure": {"unit": "TFLOP/s", "value": 1.0},
    }
    out = _predict(point)
    if out is None:
        return None
    statement = out["statement"]
    if spec:
        statement = (
            f"{statement}; the program compiled for the {kind.upper()} (no compiler for "
            f"{specs.SPECS[spec].name} here) timed on its own spec entry"
        )
    return {
        "flops_per_s": out["figure"] * 1e12,
        "seconds": out["seconds"],
        "statement": statement,
        "target": f"gpu:{kind}",
    }


def _predict(point: dict) -> dict | None:
    """The fitted step-time model's prediction of a ledger point (lab.studies.prediction); None
    where nothing compiles or fits, and where the plan fails (said in one line)."""
    from lab.studies import prediction

    try:
        return prediction.predict_with_fit(point)
    except Exception as e:  # noqa: BLE001 — one plan's failure leaves no prediction, said
        _plan_failed(point["id"], e)
        return None


def predicted_decode(spec_key: str, preset: str, chips: int, batch: int, context: int):
    """lab.serve's decode step of `preset` (bf16 weights and KV cache; tensor parallel over
    `chips`): one token for each of `batch` sequences over a cache of `context` slots,
    compiled for a GPU the lab compiles for and timed by the step-time model with its fitted
    parameters, as the published decode points are (lab.studies.prediction). {"tokens_per_s"
    (all chips together), "seconds", "breakdown", "collective_s", "statement" (the model's
    error on the held-out published decode points), "target"}; None where nothing compiles
    here (no gpu-plan extra, the compiler refuses it)."""
    from lab.studies import prediction

    kind = COMPILED_GPUS.get(spec_key)
    if kind is None:
        return None
    target = f"gpu:{kind}:{chips}" if chips > 1 else f"gpu:{kind}"
    lab_config = {
        "module": "lab.serve",
        "model": preset,
        "dtype": "bfloat16",
        "param_dtype": "bfloat16",  # served as the published decode points serve them
        "plan_batch": batch,
        "plan_context": context,
        "target": target,
    }
    if chips > 1:
        lab_config |= {"mesh": f"model:{chips}", "strategy": "tp"}
    point = {
        "id": f"ledger-decode-{preset}-{kind}x{chips}-b{batch}-s{context}",
        "workload": "decode",
        "hardware": {"kind": kind, "chips": chips},
        "lab_config": lab_config,
        "figure": {"unit": "tokens/s", "value": 1.0},
    }
    out = _predict(point)
    if out is None:
        return None
    return {
        "tokens_per_s": out["figure"],
        "seconds": out["seconds"],
        "breakdown": out["breakdown"],
        "collective_s": out["collective_s"],
        "statement": prediction.workload_statement("decode", "gpu"),
        "target": target,
    }


# --- the lab's training step ------------------------------------------------------------


def step_config(size: str, **fields) -> Config:
    """The shared step's config for a size (STEP), `fields` overriding it (typed, checked)."""
    return make_config(**{**pick(size, **STEP), **fields})


def describe(cfg: Config) -> str:
    """The step in a few words, for a record's text: 'small, batch 8 × 256, naive, remat=none'."""
    m = cfg.model
    return (
        f"{cfg.preset}, batch {cfg.batch_size} × {cfg.seq_len}, {m.attention} attention, "
        f"remat={m.remat}, dtype={m.dtype}, mesh={cfg.mesh}"
    )


def build_trainer(cfg: Config, *, devices=None):
    """(resolved cfg, trainer) for `cfg` on `devices` (default: the default backend's)."""
    from lab.mesh import make_mesh
    from lab.train import make_trainer

    devices = list(devices or jax.devices())
    from lab.resolve import defaults

    cfg = defaults(override(cfg, steps=1000, warmup_steps=1))
    trainer = make_trainer(cfg, make_mesh(cfg.mesh, devices))
    return trainer.cfg, trainer


# Several topics look at the same step (memory's remat=none is training's float32 step): one
# compile and one timing per distinct config and device set per process.
_PROBES: dict = {}


def _probe_key(cfg: Config, devices, *extra):
    devices = list(devices or jax.devices())
    return (cfg, tuple(str(d) for d in devices), *extra)


PALM_CONVENTION = (
    "PaLM: 6·N + 12·layers·seq_len·d_model per token, the causal mask's half not taken off, "
    "as published MFUs count it (lab.run counts only the unmasked pairs, so its MFU is lower)"
)


def compile_probe(cfg: Config, *, devices=None) -> dict:
    """Compile the lab's step: compiled memory and cost per device, the calculator's
    prediction for the same step, model FLOPs per token. Nothing runs. Cached per config."""
    key = _probe_key(cfg, devices, "compile")
    if key not in _PROBES:
        say_step(f"compiling {describe(cfg)}")
        _PROBES[key] = _compile_probe(cfg, devices=devices)
    return _PROBES[key]


def _compile_probe(cfg: Config, *, devices=None) -> dict:
    from lab.model import count_nonembedding_params, count_params

    cfg, trainer = build_trainer(cfg, devices=devices)
    t0 = time.perf_counter()
    compiled = trainer.lower().compile()
    compile_s = time.perf_counter() - t0
    params = trainer.abstract_state.params
    m = cfg.model
    n_nonembed = count_nonembedding_params(params, m)
    # the PaLM convention, as the published MFUs the ledger compares with count them
    fpt = cost.transformer_flops_per_token(n_nonembed, m.n_layers, cfg.seq_len, m.d_model)
    return {
        "cfg": cfg,
        "trainer": trainer,
        "compiled": compiled,
        "compile_s": compile_s,
        "memory": memory.compiled_memory(compiled),
        "cost": cost.compiled_cost(compiled),
        "predicted": memory.predict_lab_step(
            cfg,
            sizes=dict(trainer.mesh.shape),
            backend=trainer.mesh.devices.flat[0].platform,
            census=trainer.census,
        ),
        "params": count_params(params),
        "nonembed_params": n_nonembed,
        "flops_per_token": fpt,
        "flops_convention": PALM_CONVENTION,
        "tokens_per_step": cfg.batch_size * cfg.seq_len,
    }


def train_probe(
    cfg: Config,
    *,
    devices=None,
    budget_s: float = 1.0,
    min_runs: int = 3,
    loss_steps: int = 0,
) -> dict:
    """`compile_probe` plus the step run: median step time (timing.bench, blocked on the whole
    new state), tokens/s, model FLOP/s; with `loss_steps`, the losses of that many steps on
    fresh batches first (the same batches for every config: a function of seed and step).
    Cached per config, so a step two topics time is timed once (one asking for losses the
    first did not take gets them added, from the same compiled step; the timing stays)."""
    key = _probe_key(cfg, devices, "train", budget_s, min_runs)
    if key not in _PROBES:
        _PROBES[key] = _train_probe(
            cfg, devices=devices, budget_s=budget_s, min_runs=min_runs, loss_steps=loss_steps
        )
    elif len(_PROBES[key]["losses"]) < loss_steps:
        probe = _PROBES[key]
        _PROBES[key] = {**probe, "losses": _losses(probe, loss_steps)[0]}
    return _PROBES[key]


def _train_probe(cfg: Config, *, devices, budget_s, min_runs, loss_steps) -> dict:
    p = compile_probe(cfg, devices=devices)
    say_step(f"timing {describe(cfg)}")  # once it has compiled (compile_probe says that)
    compiled = p["compiled"]
    losses, state, batch = _losses(p, loss_steps)
    tokens = batch(loss_steps)
    call = timing.threaded(lambda st: compiled(st, tokens)[0], state)
    r = timing.bench(call, budget_s=budget_s, warmup=1, min_runs=min_runs, max_runs=200)
    tokens_per_s = p["tokens_per_step"] / r.median_s
    return {
        **p,
        "step": r.as_dict(),
        "tokens_per_s": tokens_per_s,
        "model_flops_per_s": p["flops_per_token"] * tokens_per_s,
        "losses": losses,
    }


def _losses(p: dict, steps: int) -> tuple[list[float], object, object]:
    """(the losses of the probe's first `steps` steps from its seed's init, the state after
    them, batch(step)): the same batches for every config (a function of seed and step)."""
    from lab.data import host_batch, to_global

    cfg, trainer, compiled = p["cfg"], p["trainer"], p["compiled"]

    def batch(step):
        tokens = host_batch(
            cfg.data, cfg.seed, step, cfg.batch_size, cfg.seq_len, cfg.model.vocab_size
        )
        return to_global(tokens, trainer.batch_sharding)

    state = trainer.init(jax.random.key(cfg.seed))
    losses = []
    for step in range(steps):
        state, metrics = compiled(state, batch(step))
        losses.append(float(metrics["loss"]))
    return losses, state, batch


def forward_probe(model_cfg, *, batch: int, seq_len: int, device=None, budget_s=1.0):
    """Inference: the lab's transformer forward (no grad) on `batch` × `seq_len` tokens.

    Returns seconds per call, requests/s (one request = one sequence), tokens/s and the
    forward's model FLOPs per sequence (2·N + attention, cost.transformer_flops_per_token).
    """
    from lab.config import resolve_dtype
    from lab.model import build, count_nonembedding_params

    device = device or jax.devices()[0]
    m = resolve_dtype(model_cfg, device.platform)
    model = build(m)
    tokens = jax.device_put(
        jax.random.randint(jax.random.key(0), (batch, seq_len), 0, m.vocab_size), device
    )
    key = ("params", m, seq_len, str(device))
    if key not in _PROBES:  # parameters do not depend on the batch: one init per model
        init = jax.jit(model.init)(jax.device_put(jax.random.key(1), device), tokens[:1])
        _PROBES[key] = init["params"]
    params = _PROBES[key]
    say_step(
        f"timing the forward, {m.n_layers} layers, d_model {m.d_model}, batch {batch} × {seq_len}"
    )
    fwd = jax.jit(lambda p, t: model.apply({"params": p}, t))
    r = timing.bench(fwd, params, tokens, budget_s=budget_s, warmup=1, min_runs=3, max_runs=200)
    n = count_nonembedding_params(params, m)
    per_token = cost.transformer_flops_per_token(n, m.n_layers, seq_len, m.d_model, training=False)
    return {
        "batch": batch,
        "seq_len": seq_len,
        "median_s": r.median_s,
        "compile_s": r.compile_s,
        "runs": r.runs,
        "requests_per_s": batch / r.median_s,
        "tokens_per_s": batch * seq_len / r.median_s,
        "flops_per_request": per_token * seq_len,
        "flops_per_s": per_token * seq_len * batch / r.median_s,
        "model": m,
    }


def ratio(a, b) -> float | None:
    if a is None or b is None or b == 0 or not math.isfinite(a) or not math.isfinite(b):
        return None
    return a / b

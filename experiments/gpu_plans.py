"""The Llama-2 7B and 70B training steps compiled for H100s (C10, C14): compiled, not run.

The calculator (lab.measure.memory) answers C10 and C14 on paper; here the lab's real step —
the same model code, sharding rules, AdamW state and Pallas flash kernel a GPU run would use —
is compiled for N abstract H100s by JAX's CUDA plugin (lab/plans, the gpu-plan extra), and the
compiler's per-device bytes (`memory_analysis()`) stand beside the calculator's for the same
step. Nothing runs: every record here is labelled *compiled, not run* and names its target.

The shapes (lab.config's llama2-7b and llama2-70b presets): Llama-2-7B on 1 H100 (batch
1 × 2048, the articles' "~80 GB" case), Llama-2-70B on 8, 16 and 32 H100s under dp, fsdp and
tp (tensor parallel over the 8 GPUs of a host). Layers are stacked with `scan_layers` so a
compile takes about as long for 80 layers as for 2: about 20–40 s each on 2 CPU cores, a few
minutes for the whole set. `python -m experiments plans=on` (or size=full) runs them; the
quick and tiny ledgers do not.
"""

import time

from experiments.common import SHAPE_FIELDS, h100_capacity, llama_preset, record
from lab.config import PRESETS, Config, make_config
from lab.errors import ConfigError

GPU = "h100"
SPEC_KEY = "h100-sxm"
SEQ = 2048
PER_HOST = 8  # GPUs per H100 host: tensor parallelism stays inside one host's NVLink
# Strategy → mesh over n GPUs (named axes, so strategy=fsdp really shards over an fsdp axis)
MESHES = {"dp": "data:{n}", "fsdp": "fsdp:{n}", "tp": "data:{d},model:{t}"}

PARTS = ("params", "grads", "optimizer", "activations", "workspace")  # the calculator's
_PLANS: dict = {}  # one compile per (target, keys) per process: C10 and C14 share some


def llama_keys(size: str, n: int, strategy: str, **fields) -> dict:
    """lab.config keys of the Llama-2 `size` ("7B", "70B") step on n GPUs: its preset, one
    2048-token sequence per GPU, fp32 weights, bf16 compute, AdamW (the mixed-precision
    recipe), stacked layers. The preset's shape fields are written out too, so a record's keys
    (which leave the preset out) name the model whole."""
    t = min(n, PER_HOST)
    preset = llama_preset(size)
    return dict(
        preset=preset,
        **{k: PRESETS[preset][k] for k in SHAPE_FIELDS},
        seq_len=SEQ,
        batch_size=n,
        mesh=MESHES[strategy].format(n=n, d=n // t, t=t),
        strategy=strategy,
        scan_layers=True,
        data="synthetic",
        target=f"gpu:{GPU}:{n}",
        **fields,
    )


def plan(keys: dict) -> dict:
    """The lab's step for `keys` (with a gpu target) compiled for the target's devices: what
    `python -m lab.run` prints for a plan (memory per device and the calculator's beside it,
    the fit, the time floor), without the per-kernel resources. Cached per keys."""
    key = tuple(sorted(keys.items()))
    if key not in _PLANS:
        _PLANS[key] = _plan(make_config(**keys))
    return _PLANS[key]


def _plan(cfg: Config) -> dict:
    from lab import summary
    from lab.session import open_session

    s = open_session(cfg)
    t0 = time.perf_counter()
    compiled = s.trainer.lower().compile()
    compile_s = time.perf_counter() - t0
    out = summary.analyse(compiled, s.cfg, s.info, s.trainer)
    return {**out, "compile_s": compile_s, "cfg": s.cfg}


def _total(p: dict) -> float:
    return p["compiled_memory_per_device"]["total_bytes"]


def _state(p: dict) -> float:
    """The training state per device (params + AdamW moments, the step's donated arguments)."""
    return p["compiled_memory_per_device"]["argument_bytes"]


def _plan_record(claim, metric, what, value, unit, p: dict, keys: dict, **config) -> dict:
    pred = p["predicted_memory_per_device"]
    return record(
        claim,
        metric,
        what,
        value,
        unit,
        label="compiled, not run",
        target=SPEC_KEY,
        keys={k: v for k, v in keys.items() if k != "preset"},
        compiled=p["compiled_memory_per_device"],
        predicted={k: pred[k] for k in PARTS},
        predicted_total=pred["total"],
        calculator_over_compiled=pred["total"] / _total(p),
        state_calculator_over_compiled=(pred["params"] + pred["optimizer"]) / _state(p),
        fit=p["aot"]["fit"],
        estimated_step_s=p["aot"]["estimated_step_s"],
        estimate_source=p["aot"]["estimate_source"],
        compile_s=p["compile_s"],
        **config,
    )


def _skipped(claims, error: str) -> list[dict]:
    return [
        record(c, None, f"H100 plans not compiled: {error}", None, "", role="context")
        for c in claims
    ]


def llama_memory_per_h100() -> list[dict]:
    """C10: 7B on one H100 against '~80 GB'; 70B whole on every GPU against one H100's memory;
    the fewest H100s over which the 70B step, sharded (FSDP) with remat=full, fits."""
    try:
        return _llama_memory_compiled()
    except ConfigError as e:  # no CUDA plugin or ptxas (the gpu-plan extra): say so, go on
        return _skipped(("C10",), str(e))


def _llama_memory_compiled() -> list[dict]:
    """The 7B and 70B steps compiled for H100s, memory per device (llama_memory_per_h100's
    records, which fail with ConfigError where the step cannot be compiled)."""
    cap = h100_capacity()["h100_usable_bytes"]  # lab.run's rule for a fit
    keys = llama_keys("7B", 1, "dp")
    p = plan(keys)
    recs = [
        _plan_record(
            "C10",
            "train_memory_7b",
            f"7B training step compiled for 1 × H100: memory per device (fp32 weights, bf16 "
            f"compute, fp32 AdamW, 1 × {SEQ} tokens, Pallas flash attention)",
            _total(p),
            "B",
            p,
            keys,
        )
    ]
    keys = llama_keys("70B", 8, "dp")
    p = plan(keys)
    recs.append(
        _plan_record(
            "C10",
            "train_memory_70b_dp_over_h100",
            "70B compiled for 8 × H100, whole model on every GPU (dp): memory per device over "
            "what a step may hold of one H100 (JAX's allocator share)",
            _total(p) / cap,
            "× H100 memory",
            p,
            keys,
            inputs=h100_capacity(),
        )
    )
    return recs + _fewest_h100s(cap)


def _fewest_h100s(cap: float) -> list[dict]:
    recs, fits = [], None
    for n in (8, 16, 32):
        keys = llama_keys("70B", n, "fsdp", remat="full")
        p = plan(keys)
        recs.append(
            _plan_record(
                "C10",
                None,
                f"70B compiled for {n} × H100, FSDP, remat=full: memory per device",
                _total(p),
                "B",
                p,
                keys,
                role="context",
                devices=n,
            )
        )
        if _total(p) <= cap:
            fits = (n, p)
            break
    first = recs[0]["config"]
    # Below 8 the training state alone (params + AdamW moments, sharded n ways) outgrows the
    # card: the compiled state at 8, doubled, is what 4 GPUs would each hold before any
    # activation.
    state_at_4 = 2 * first["compiled"]["argument_bytes"]
    n = fits[0] if fits and (fits[0] > 8 or state_at_4 > cap) else None
    recs.append(
        record(
            "C10",
            "h100s_needed_70b",
            f"70B sharded (FSDP), remat=full, one {SEQ}-token sequence per GPU: fewest H100s "
            "the compiled step fits in JAX's allocator share of each (8, 16, 32 compiled; "
            "below 8 the training state alone exceeds it)",
            n,
            "H100s",
            label="compiled, not run",
            target=SPEC_KEY,
            compiled_total_bytes=_total(fits[1]) if fits else None,
            state_bytes_on_4=state_at_4,
            inputs=h100_capacity(),
        )
    )
    return recs


def llama70b_memory_per_strategy(counts=(8, 16)) -> list[dict]:
    """C14: 70B on n H100s under dp, fsdp and tp, the same global batch: the compiler's memory
    per device for each, and FSDP's and TP's over DP's."""
    try:
        return [r for n in counts for r in _strategy_memory_compiled(n)]
    except ConfigError as e:
        return _skipped(("C14",), str(e))


def _strategy_memory_compiled(n: int) -> list[dict]:
    """70B compiled for n H100s under dp, fsdp and tp: memory per device, and FSDP's and TP's
    over DP's."""
    recs, totals = [], {}
    for strategy in MESHES:
        keys = llama_keys("70B", n, strategy)
        p = plan(keys)
        totals[strategy] = _total(p)
        recs.append(
            _plan_record(
                "C14",
                None,
                f"70B compiled for {n} × H100, {strategy} ({keys['mesh']}): memory per device",
                _total(p),
                "B",
                p,
                keys,
                role="context",
                strategy=strategy,
                devices=n,
            )
        )
    for strategy, metric in (("fsdp", "sharded_over_dp_memory"), ("tp", None)):
        recs.append(
            record(
                "C14",
                metric,
                f"70B on {n} × H100: per-device memory, {strategy} over dp (compiled, not run)",
                totals[strategy] / totals["dp"],
                "×",
                label="compiled, not run",
                role="evidence" if metric else "context",
                target=SPEC_KEY,
                devices=n,
                compiled_bytes={s: totals[s] for s in ("dp", strategy)},
            )
        )
    return recs

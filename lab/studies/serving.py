"""Serving the lab's transformer, measured: prefill and decode timed apart, what a decode step
must move, how close it comes to the memory roof, where batching turns it compute-bound, and
what int8 weights and an int8 cache change. `python -m lab.serve` is the command.

The decode step's figures (MaxText's inference microbenchmark, the scaling book's inference
chapter):

    bytes a step must move  = the weights the matmuls read (every parameter but the embedding
                              table, of which a lookup reads B rows) + the cache it reads
    achieved bandwidth      = those bytes / the step's median time
    FLOPs of a step         = B · (2·N + 4·layers·S·d_model)     (N: non-embedding parameters,
                              S: the cache slots attention reads)
    arithmetic intensity    = FLOPs / bytes ≈ B · 2 / bytes per weight while the weights
                              dominate: decode is memory-bound until B reaches
    critical batch B*       = ridge · W / (f − ridge · c)        (W weight bytes, f FLOPs and
                              c cache bytes per sequence; ridge = compute roof / memory roof)

Both roofs are measured here (lab.measure.ceilings: the copy kernel's bandwidth, the matmul
peak at the compute dtype), in the same process, before the sweep.
"""

import dataclasses
import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from lab import checkpoint, data, decode, plans, quant
from lab.config import Config, ModelConfig, override
from lab.errors import ConfigError
from lab.measure import ceilings, cost, memory, records, roofline, specs, timing
from lab.model import build, natural_layers
from lab.names import STAGE
from lab.resolve import Request, resolve
from lab.rundir import STATE_FIELDS, saved_config
from lab.session import Session, session_for
from lab.train import cross_entropy

# ---------------------------------------------------------------------------- weights


def config_of_run(run_dir: Path) -> Config:
    """The Config a run folder was trained with (its config.json)."""
    saved = saved_config(run_dir, asked=f"run={run_dir.name}")
    try:
        model = ModelConfig(**saved["model"])
        rest = {k: v for k, v in saved.items() if k != "model"}
        return dataclasses.replace(Config(model=model), **rest)
    except (KeyError, TypeError) as e:
        raise ConfigError(
            f"run={run_dir.name}: {run_dir / 'config.json'} is damaged ({e})"
        ) from None


def serving_request(run_dir: Path, keys: dict) -> Request:
    """The request that serves a trained run: the run's own fields (config.json) with the
    user's keys over them (a model field that changes the weights' shapes is refused: those
    weights would not load); resolved on this platform like any request."""
    saved = config_of_run(run_dir)
    shape_keys = {k: v for k, v in keys.items() if k in STATE_FIELDS or k in ("preset", "model")}
    if shape_keys:
        changed = override(saved, **shape_keys)
        diffs = [
            f"{k}={getattr(saved.model, k)!r} → {getattr(changed.model, k)!r}"
            for k in STATE_FIELDS
            if getattr(saved.model, k) != getattr(changed.model, k)
        ]
        if diffs:
            raise ConfigError(
                f"run={run_dir.name} holds another model than asked ({', '.join(diffs)}): "
                "leave the model keys out to serve the run's own"
            )
    run_keys = {k: v for k, v in keys.items() if k not in shape_keys}
    # serving needs neither the run's name, steps nor its checkpoint cadence
    over = {**run_keys, "name": "", "resume": False, "overwrite": False, "steps": 0}
    return Request.from_config(saved).with_keys(**over)


def for_decoding(session: Session) -> Session:
    """The session of the decoder (lab.decode.unstack_layers says why it runs unscanned):
    the session's request resolved again for decoding on the same platform, never its
    resolved config edited (a pipeline's scan and stage axis are the trainer's)."""
    if not session.cfg.model.scan_layers:
        return session
    r = session.resolved
    return session_for(resolve(r.request, r.platform, "decode"))


def load_params(session: Session, run_dir: Path | None, seed: int, warn=print):
    """(decoding session, parameters, where they came from): the newest good checkpoint of
    `run_dir`, or random weights of the preset (the model's own initialisation) when there is
    no run; unscanned for decoding (`for_decoding`) and placed on its shardings."""
    decoding = for_decoding(session)
    if run_dir is None:
        state = decoding.trainer.init(jax.random.key(seed))
        return decoding, state.params, f"random weights (seed {seed})"
    params, source = _restore(session, run_dir, warn)
    if decoding is not session:
        stages = dict(session.trainer.mesh.shape).get(STAGE, 1)
        if stages > 1:  # a circular run stores its blocks stage-major: back to layer order
            blocks = natural_layers(session.cfg.model, params["blocks"], stages)
            params = {**params, "blocks": blocks}
        params = decode.unstack_layers(params, session.cfg.model.n_layers)
        params = jax.device_put(params, decoding.trainer.state_shardings.params)
    return decoding, params, source


def _restore(session: Session, run_dir: Path, warn):
    trainer = session.trainer  # serving only reads: a read-only run folder is fine
    with jax.set_mesh(trainer.mesh):
        step, state = checkpoint.restore_latest(
            run_dir, trainer.abstract_state, warn=warn, why=f"run={run_dir.name}"
        )
    if state is None:
        raise ConfigError(
            f"run={run_dir.name}: no checkpoint to serve in {checkpoint.folder(run_dir)} "
            "(train it with checkpoint_every=N, or leave run= out for random weights)"
        )
    return state.params, f"run {run_dir.name}, step {step}"


def param_shardings(shardings, params):
    """Shardings of `params` whose matmul weights may be int8 (quant.Int8Weight): the codes
    take the float weight's sharding; the scales the same, except on their contracted axes
    (size 1), which are never split."""

    def one(sh, p):
        if not isinstance(p, quant.Int8Weight):
            return sh
        spec = tuple(sh.spec) + (None,) * (p.scale.ndim - len(sh.spec))
        kept = [a if n > 1 else None for a, n in zip(spec, p.scale.shape, strict=True)]
        scale_sh = jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(*kept))
        return quant.Int8Weight(sh, scale_sh)

    return jax.tree.map(one, shardings, params, is_leaf=lambda x: isinstance(x, quant.Int8Weight))


# ---------------------------------------------------------------------------- figures


def is_int8(params) -> bool:
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, quant.Int8Weight))
    return any(isinstance(x, quant.Int8Weight) for x in leaves)


def weight_read_bytes(params, model: ModelConfig, batch: int) -> int:
    """Bytes of weights one forward step reads: every leaf but the embedding table, plus the
    B rows a lookup takes from it (a tied table is read whole: it is also the head)."""
    total = quant.weight_bytes(params)
    table = params["embed"]
    if not model.tie_embeddings:
        row = table.size // table.shape[0] * table.dtype.itemsize
        total += -table.size * table.dtype.itemsize + batch * row
    return int(total)


def nonembed_params(model: ModelConfig) -> int:
    embed = model.vocab_size * model.d_model
    return memory.lab_param_count(model) - (0 if model.tie_embeddings else embed)


def step_flops(model: ModelConfig, batch: int, slots: int) -> float:
    """B · (2·N + 4·layers·S·d_model): one token per sequence against S cache slots."""
    return batch * cost.transformer_flops_per_token(
        nonembed_params(model), model.n_layers, slots, model.d_model, training=False
    )


def critical_batch(weight_bytes: float, flops_per_seq: float, cache_per_seq: float, ridge):
    """The batch where a decode step's intensity reaches the ridge, or inf where the cache's
    bytes grow as fast as the FLOPs (attention-dominated: never compute-bound)."""
    denominator = flops_per_seq - ridge * cache_per_seq
    return math.inf if denominator <= 0 else ridge * weight_bytes / denominator


@dataclasses.dataclass(frozen=True)
class Roofs:
    """This device's measured roofs: the best bandwidth measured (the copy kernel's unless a
    decode step moved bytes faster: the ledger's definition, lab.measure.ceilings.roofs) and
    the matmul peak at `dtype`."""

    bandwidth: float
    peak_flops: float
    dtype: str
    copy: dict
    how: str = "the copy kernel (y = x·s)"  # what set the memory roof

    @property
    def ridge(self) -> float:
        return roofline.ridge_point(self.peak_flops, self.bandwidth)


def measure_roofs(dtype: str, *, budget_s: float, size: str = "quick") -> Roofs:
    sz = ceilings.sizes(ceilings.backend(), size)
    copy = ceilings.copy_bandwidth(sz["copy"], budget_s=budget_s)
    peak = ceilings.measure_matmul(dtype, n=sz["mm_n"], budget_s=budget_s)["flops_per_s"]
    return Roofs(copy["bytes_per_s"], peak, dtype, copy)


# ---------------------------------------------------------------------------- timing


def _prompts(vocab: int, batch: int, length: int, seed: int):
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (batch, length)).astype(np.int32)


def make_decoder(
    session: Session, params, *, batch: int, max_len: int, int8_cache: bool, matmul: str = "auto"
):
    t = session.trainer
    shardings = param_shardings(t.state_shardings.params, params)
    return decode.make_decoder(
        t.cfg.model,
        t.mesh,
        t.rules,
        shardings,
        batch=batch,
        max_len=max_len,
        int8_cache=int8_cache,
        matmul=matmul,
    )


def time_prefill(dec, params, prompts, *, budget_s: float) -> timing.BenchResult:
    """Prefill of the whole batch of prompts: a fresh cache each call (lengths reset)."""
    lengths = np.full((prompts.shape[0],), prompts.shape[1], np.int32)
    with jax.set_mesh(dec.mesh):
        call = timing.threaded(
            lambda c: dec.prefill(params, prompts, lengths, c)[1], dec.empty_cache()
        )
        return timing.bench(call, warmup=1, min_runs=3, budget_s=budget_s)


def time_decode(
    dec, params, prompts, *, steps: int, budget_s: float, queued: bool = True
) -> timing.BenchResult:
    """Seconds per decode step after a prefill, one token per sequence written into the cache.

    queued (what a server does): each sample is `steps` steps dispatched back to back and
    blocked once at the end, the cache's lengths then rewound to where the sample began (the
    same slots are written again: the same work, and a cache of prompt + WARM_STEPS + steps
    slots times any number of samples). Not queued: every step blocked on its own, at most
    `steps` of them, which adds the host's wait and the next dispatch to every token."""
    lengths = np.full((prompts.shape[0],), prompts.shape[1], np.int32)
    tokens = prompts[:, -1]
    with jax.set_mesh(dec.mesh):
        _, cache = dec.prefill(params, prompts, lengths, dec.empty_cache())
        if not queued:
            call = timing.threaded(lambda c: dec.step(params, tokens, c)[1], cache)
            return timing.bench(
                call, warmup=2, min_runs=min(5, steps), max_runs=steps, budget_s=budget_s
            )
        t0 = time.perf_counter()
        for _ in range(WARM_STEPS):  # the compile call and warm-up
            cache = dec.step(params, tokens, cache)[1]
        cache = jax.block_until_ready(cache)
        compile_s = time.perf_counter() - t0
        start = np.asarray(cache.lengths)  # a copy: the cache's own buffers are donated
        times_s: list[float] = []
        begun = time.perf_counter()
        while len(times_s) < 3 or time.perf_counter() - begun < budget_s:
            t0 = time.perf_counter()
            for _ in range(steps):
                cache = dec.step(params, tokens, cache)[1]
            cache = jax.block_until_ready(cache)
            times_s.append((time.perf_counter() - t0) / steps)
            cache = cache.replace(lengths=jax.device_put(start, dec.batch_sharding))
    return timing.summarise(times_s, compile_s)


WARM_STEPS = 3  # cache slots the compile call and warm-up of time_decode use


def matmul_candidates(session: Session, params) -> tuple[str, ...]:
    """The ways a decoder can multiply these weights here (lab.decode.MATMULS): XLA's dot,
    its int8 × int8 dot where the weights are int8, the native CPU kernel (threaded, and on
    one thread) on one CPU device where it builds."""
    out = ["xla"]
    if is_int8(params):
        out.append("w8a8")
    if decode.resolve_matmul("auto", session.trainer.mesh) == "native":
        out += ["native", "native1"]
    return tuple(out)


def decode_point(
    session,
    params,
    roofs: Roofs,
    *,
    batch,
    prompt_len,
    steps,
    budget_s,
    int8_cache,
    max_len,
    matmul: str = "auto",
    queued: bool = True,
):
    """One decode batch size: its time, tokens/s, bytes, bandwidth, FLOPs and intensity."""
    model = session.cfg.model
    dec = make_decoder(
        session, params, batch=batch, max_len=max_len, int8_cache=int8_cache, matmul=matmul
    )
    prompts = _prompts(model.vocab_size, batch, prompt_len, seed=batch)
    r = time_decode(dec, params, prompts, steps=steps, budget_s=budget_s, queued=queued)
    # The plain-JAX decode attention reads every slot of the cache; a Pallas kernel stops
    # at each sequence's length (on average halfway through the timed steps).
    impl = session.cfg.model.attention
    reads_all = decode.reads_whole_cache(impl, session.info.backend)
    mid = prompt_len + WARM_STEPS + steps // 2
    cache_read = decode.cache_bytes(dec.abstract_cache, None if reads_all else [mid] * batch)
    weights = weight_read_bytes(params, model, batch)
    moved = weights + cache_read
    slots = max_len if reads_all else mid
    flops = step_flops(model, batch, slots)
    return {
        "batch": batch,
        "int8_weights": is_int8(params),
        "int8_cache": int8_cache,
        "matmul": dec.matmul,
        "median_s": r.median_s,
        "p10_s": r.p10_s,
        "p90_s": r.p90_s,
        "runs": r.runs,
        "compile_s": r.compile_s,
        "tokens_per_s": batch / r.median_s,
        "ms_per_token": 1e3 * r.median_s,
        "weight_bytes": weights,
        "cache_bytes": cache_read,
        "bytes": moved,
        "bytes_per_s": moved / r.median_s,
        "memory_roof_share": moved / r.median_s / roofs.bandwidth,
        "flops": flops,
        "flops_per_s": flops / r.median_s,
        "intensity": flops / moved,
        "slots_read": slots,
        "context": max_len,
    }


def prefill_estimate(model, batch: int, prompt_len: int, peak_flops: float) -> str:
    """A long prompt's prefill can take minutes per run on a CPU (attention grows with the
    square of the prompt): its FLOPs and the seconds one run takes at the measured matmul
    peak (a floor), so a progress bar that stands still for long says why. Empty when short."""
    flops = (
        batch
        * prompt_len
        * cost.transformer_flops_per_token(
            nonembed_params(model), model.n_layers, prompt_len, model.d_model, training=False
        )
    )
    seconds = flops / peak_flops
    if seconds < 10:
        return ""
    return f" ({flops / 1e12:,.1f} TFLOP: at least {seconds / 60:,.1f} min a run at the peak)"


def prefill_point(session, params, *, batch, prompt_len, budget_s):
    model = session.cfg.model
    dec = make_decoder(session, params, batch=batch, max_len=prompt_len, int8_cache=False)
    r = time_prefill(
        dec, params, _prompts(model.vocab_size, batch, prompt_len, 100 + batch), budget_s=budget_s
    )
    tokens = batch * prompt_len
    flops = tokens * cost.transformer_flops_per_token(
        nonembed_params(model), model.n_layers, prompt_len, model.d_model, training=False
    )
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "median_s": r.median_s,
        "p10_s": r.p10_s,
        "p90_s": r.p90_s,
        "runs": r.runs,
        "compile_s": r.compile_s,
        "tokens_per_s": tokens / r.median_s,
        "flops": flops,
        "flops_per_s": flops / r.median_s,
    }


# ---------------------------------------------------------------------------- int8


def corpus_tokens(batch: int, length: int, vocab: int) -> np.ndarray:
    """`batch` windows of the bundled text (bytes) as token ids, the same every call."""
    text = np.frombuffer(data.corpus_bytes(), np.uint8).astype(np.int32) % vocab
    starts = np.linspace(0, len(text) - length - 1, batch).astype(int)
    return np.stack([text[s : s + length + 1] for s in starts])


def int8_error(session, params, params_i8, *, batch: int, prompt_len: int, steps: int) -> dict:
    """What int8 costs in accuracy, on the bundled text: the loss of the full forward pass
    with float and int8 weights, and the logits of prefill + decode steps with int8 weights
    and an int8 cache against float (relative RMS and max |difference|)."""
    model = session.cfg.model
    t = session.trainer
    seqs = corpus_tokens(batch, prompt_len + steps, model.vocab_size)
    net = build(model)

    def loss(p):
        with jax.set_mesh(t.mesh):
            logits = jax.jit(lambda p, x: net.apply({"params": p}, x))(p, seqs[:, :-1])
        return float(cross_entropy(logits, seqs[:, 1:]))

    def decoded(p, int8_cache):
        dec = make_decoder(
            session, p, batch=batch, max_len=prompt_len + steps, int8_cache=int8_cache
        )
        lengths = np.full((batch,), prompt_len, np.int32)
        with jax.set_mesh(t.mesh):
            logits, cache = dec.prefill(p, seqs[:, :prompt_len], lengths, dec.empty_cache())
            out = [np.asarray(logits)]
            for i in range(steps - 1):
                logits, cache = dec.step(p, seqs[:, prompt_len + i], cache)
                out.append(np.asarray(logits))
        return np.stack(out, 1)

    ref = decoded(params, False)
    got = decoded(params_i8, True)
    diff = got - ref
    agree = float(np.mean(np.argmax(got, -1) == np.argmax(ref, -1)))
    return {
        "loss_float": loss(params),
        "loss_int8": loss(params_i8),
        "logits_rel_rms": float(np.sqrt(np.mean(diff**2) / np.mean(ref**2))),
        "logits_max_abs": float(np.abs(diff).max()),
        "logits_scale": float(np.abs(ref).max()),
        "top1_agreement": agree,
        "weight_bytes_float": quant.weight_bytes(params),
        "weight_bytes_int8": quant.weight_bytes(params_i8),
    }


# ---------------------------------------------------------------------------- sample


def sample_text(session, params, *, prompt: str, tokens: int, temperature: float, seed: int):
    """A short continuation of `prompt` by a byte-level model (vocab 256): the text."""
    raw = np.frombuffer(prompt.encode(), np.uint8).astype(np.int32)[None]
    batch = decode.batch_multiple(session.trainer)
    prompts = np.repeat(raw, batch, 0)
    dec = decode.make_decoder(
        session.cfg.model,
        session.trainer.mesh,
        session.trainer.rules,
        session.trainer.state_shardings.params,
        batch=batch,
        max_len=raw.shape[1] + tokens + 1,
        steps=tokens,
        temperature=temperature,
    )
    lengths = np.full((batch,), raw.shape[1], np.int32)
    with jax.set_mesh(dec.mesh):
        logits, cache = dec.prefill(params, prompts, lengths, dec.empty_cache())
        out, _ = dec.generate(params, logits, cache, jax.random.key(seed))
    return bytes(np.asarray(out[0]).astype(np.uint8)).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------- the study


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to measure (lab.serve's options without the presentation)."""

    batches: tuple[int, ...]
    prefill_batches: tuple[int, ...]
    prompt_len: int
    steps: int
    budget_s: float
    int8: bool
    seed: int = 0
    context: int = 0  # cache slots per sequence; 0 = prompt_len + WARM_STEPS + steps

    def slots(self) -> int:
        return self.context or self.prompt_len + WARM_STEPS + self.steps


def check_batches(session: Session, batches) -> None:
    """Every batch size splits over the mesh's batch axes: one line before any compile."""
    n = decode.batch_multiple(session.trainer)
    bad = sorted({b for b in batches if b % n})
    if bad:
        raise ConfigError(
            f"batches {bad} do not split over the mesh's batch axes ({n} devices): use "
            f"multiples of {n}"
        )


def memory_needed(model, plan: Plan) -> dict[str, float]:
    """Bytes the study holds at its peak, by part: the weights, the KV cache of the largest
    decode batch (keys and values of every layer, every slot, in the compute dtype) and the
    prefill's logits of the largest prefill batch ([B, prompt, vocab] float32)."""
    itemsize = jnp.dtype(model.dtype).itemsize
    per_slot = 2 * model.n_layers * model.n_kv_heads * model.head_dim * itemsize
    return {
        "weights": float(nonembed_params(model) + model.vocab_size * model.d_model) * 4,
        "cache": float(per_slot * max(plan.batches) * plan.slots()),
        "prefill logits": 4.0 * max(plan.prefill_batches) * plan.prompt_len * model.vocab_size,
    }


def host_memory_bytes() -> float | None:
    """This machine's physical memory, where the OS says."""
    try:
        return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(session: Session, plan: Plan) -> None:
    """On CPU, a study that cannot fit this machine's memory is one line before anything is
    allocated (a long prompt at a big batch would otherwise swap or run for hours)."""
    total = host_memory_bytes()
    if session.info.backend != "cpu" or not total:
        return
    parts = memory_needed(session.cfg.model, plan)
    need = sum(parts.values())
    if need > 0.8 * total:
        biggest = max(parts, key=parts.get)
        raise ConfigError(
            f"prompt_len={plan.prompt_len}, {plan.slots():,} cache slots, batches up to "
            f"{max(plan.batches)}: needs "
            f"{need / 2**30:,.1f} GiB ({biggest} {parts[biggest] / 2**30:,.1f} GiB), more than "
            f"80% of this machine's {total / 2**30:,.1f} GiB; shorten the prompt or the "
            "batches, or plan it for an accelerator with target="
        )


def measure(session: Session, params, plan: Plan, *, progress=None) -> dict:
    """The whole study: roofs, prefill, decode over the batch sweep (float, then int8 weights
    and cache at the smallest and largest batch), int8 error. `progress(label)` is called
    before each point (a progress bar's advance)."""
    check_batches(session, (*plan.batches, *plan.prefill_batches))
    check_memory(session, plan)
    decode.check_prompts([plan.prompt_len], plan.slots(), WARM_STEPS + plan.steps)
    tick = progress or (lambda label: None)
    model = session.cfg.model
    tick("roofs: copy bandwidth and matmul peak")
    roofs = measure_roofs(model.dtype, budget_s=plan.budget_s)
    out = {"roofs": roofs, "prefill": [], "decode": [], "decode_int8": [], "int8": None}
    for b in plan.prefill_batches:
        tick(f"prefill batch {b}{prefill_estimate(model, b, plan.prompt_len, roofs.peak_flops)}")
        out["prefill"].append(
            prefill_point(
                session, params, batch=b, prompt_len=plan.prompt_len, budget_s=plan.budget_s
            )
        )
    kw = dict(
        prompt_len=plan.prompt_len, steps=plan.steps, budget_s=plan.budget_s, max_len=plan.slots()
    )
    for b in plan.batches:
        tick(f"decode batch {b}")
        out["decode"].append(fastest_point(session, params, roofs, batch=b, int8_cache=False, **kw))
    out["torch"] = torch_peer(session, params, plan, out["decode"])
    if plan.int8:
        params_i8 = jax.jit(quant.quantize_params)(params)
        for b in sorted({min(plan.batches), max(plan.batches)}):
            tick(f"decode batch {b}, int8 weights and cache")
            out["decode_int8"].append(
                fastest_point(session, params_i8, roofs, batch=b, int8_cache=True, **kw)
            )
        tick("int8 error on the bundled text")
        n = decode.batch_multiple(session.trainer)
        out["int8"] = int8_error(
            session, params, params_i8, batch=n, prompt_len=plan.prompt_len, steps=8
        )
    out["roofs"] = roofs = best_roofs(roofs, out["decode"] + out["decode_int8"])
    out["summary"] = summarise(session, out)
    return out


def fastest_point(session, params, roofs: Roofs, **kw) -> dict:
    """decode_point with each of matmul_candidates, the fastest kept; `matmuls` on it holds
    every candidate's tokens/s (the run says which it used and what the others did)."""
    points = [
        decode_point(session, params, roofs, matmul=m, **kw)
        for m in matmul_candidates(session, params)
    ]
    best = max(points, key=lambda p: p["tokens_per_s"])
    return {**best, "matmuls": {p["matmul"]: p["tokens_per_s"] for p in points}}


def torch_peer(session: Session, params, plan: Plan, points: list[dict]) -> list[dict]:
    """The PyTorch decoder of the same shape and weights (lab/studies/torch_decoder.py) timed
    at every decode batch, beside the lab's float points; none where PyTorch is not installed
    or the decoder is not on CPU."""
    from lab.studies import torch_decoder  # beside this study; only serving times the peer

    if not torch_decoder.available() or session.info.backend != "cpu":
        return []
    host = jax.device_get(params)
    rows = []
    for p in points:
        prompts = _prompts(session.cfg.model.vocab_size, p["batch"], plan.prompt_len, p["batch"])
        r = torch_decoder.time_decode(
            session.cfg.model, host, prompts, steps=plan.steps, budget_s=plan.budget_s
        )
        rows.append({**r, "lab_over_torch": p["tokens_per_s"] / r["tokens_per_s"]})
    return rows


def torch_lines(rows: list[dict]) -> list[str]:
    """One line per batch: the PyTorch decoder's tokens/s and lab.serve's over it."""
    return [
        f"batch {r['batch']}: PyTorch {r['torch']} ({r['threads']} threads) "
        f"{r['tokens_per_s']:,.1f} tokens/s; lab.serve {r['lab_over_torch']:.2f}× that"
        for r in rows
    ]


def matmul_lines(points: list[dict]) -> list[str]:
    """One line per decode point: the matmul it kept and every candidate's tokens/s."""
    out = []
    for p in points:
        weights = "int8" if p["int8_weights"] else "float"
        tried = ", ".join(f"{m} {v:,.1f}" for m, v in p.get("matmuls", {}).items())
        out.append(f"batch {p['batch']} {weights}: {p['matmul']} (tokens/s: {tried})")
    return out


def best_roofs(roofs: Roofs, points: list[dict]) -> Roofs:
    """The memory roof as the best bandwidth measured, as the ledger defines it
    (ceilings.memory_roof): a decode step that moved bytes faster than the copy kernel raises
    the roof to its own rate, and every point's share is taken against it, so no point sits
    above its roof."""
    rates: dict[str, float] = {}
    for p in points:  # float and int8 steps share batch sizes: the best rate under each name
        name = f"decode at batch {p['batch']}" + (" (int8)" if p.get("int8_weights") else "")
        rates[name] = max(rates.get(name, 0.0), p["bytes_per_s"])
    bandwidth, how = ceilings.memory_roof(roofs.bandwidth, rates)
    if how is None:
        return roofs
    for p in points:
        p["memory_roof_share"] = p["bytes_per_s"] / bandwidth
    return dataclasses.replace(roofs, bandwidth=bandwidth, how=how)


def summarise(session: Session, out: dict) -> dict:
    """The derived figures: the ridge and critical batch, the best rates, the output/input
    price ratio on this device."""
    roofs: Roofs = out["roofs"]
    rows = out["decode"]
    one = min(rows, key=lambda r: r["batch"])
    per_seq_cache = one["cache_bytes"] / one["batch"]
    per_seq_flops = one["flops"] / one["batch"]
    weights = one["weight_bytes"]
    best_decode = max(rows, key=lambda r: r["tokens_per_s"])
    best_prefill = max(out["prefill"], key=lambda r: r["tokens_per_s"], default=None)
    s = {
        "ridge": roofs.ridge,
        "critical_batch": critical_batch(weights, per_seq_flops, per_seq_cache, roofs.ridge),
        "batch1_roof_share": one["memory_roof_share"],
        "batch1_intensity": one["intensity"],
        "best_decode": best_decode,
    }
    if best_prefill:
        s["best_prefill"] = best_prefill
        # self-hosted price ∝ device time per token: output over input at the best rates
        s["output_input_cost_ratio"] = best_prefill["tokens_per_s"] / best_decode["tokens_per_s"]
        s["output_input_cost_ratio_batch1"] = best_prefill["tokens_per_s"] / one["tokens_per_s"]
    i8 = {r["batch"]: r for r in out["decode_int8"]}
    if i8:
        s["int8_speedup"] = {
            b: r["tokens_per_s"] / next(x for x in rows if x["batch"] == b)["tokens_per_s"]
            for b, r in i8.items()
        }
    return s


# ---------------------------------------------------------------------------- plans


def plan_serving(session: Session, *, batch: int, context: int, int8: bool) -> dict:
    """The decode step compiled for the session's target (compiled, not run): the compiler's
    per-device memory beside the calculator's weights + cache, against the chip's HBM."""
    session = for_decoding(session)
    t = session.trainer
    model = t.cfg.model
    abstract = t.abstract_state.params
    if int8:
        abstract = jax.eval_shape(quant.quantize_params, abstract)
    shardings = param_shardings(t.state_shardings.params, abstract)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    n = decode.batch_multiple(t)
    if batch % n:
        raise ConfigError(f"batch={batch} does not split over the mesh's {n} batch devices")
    dec = decode.make_decoder(
        model, t.mesh, t.rules, shardings, batch=batch, max_len=context, int8_cache=int8
    )
    cache = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        dec.abstract_cache,
        dec.cache_sharding,
    )
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=dec.batch_sharding)
    t0 = time.perf_counter()
    refused = None
    with jax.set_mesh(t.mesh):
        try:
            compiled = dec.step.lower(abstract, tokens, cache).compile()
        except RuntimeError as e:  # a TPU compiler refuses a program its HBM cannot hold
            compiled, refused = None, plans.refusal(e)
            if refused is None:
                raise
    compile_s = time.perf_counter() - t0
    mem = (memory.compiled_memory(compiled) if compiled else None) or {}
    devices = t.mesh.devices.size
    predicted = memory.predict_serving_memory(
        model,
        batch=batch,
        context=context,
        weight_bytes=1 if int8 else jnp.dtype(model.param_dtype).itemsize,
        cache_bytes=1 if int8 else jnp.dtype(model.dtype).itemsize,
        devices=devices,
    )
    kind = t.mesh.devices.flat[0].device_kind
    capacity = memory.device_capacity_bytes(t.mesh.devices.flat[0])
    spec = specs.lookup(kind)
    capacity = capacity or (spec.memory_bytes if spec else None)
    return {
        "target": session.cfg.target,
        "device_kind": kind,
        "devices": devices,
        "batch": batch,
        "context": context,
        "int8": int8,
        "compiled": mem,
        "predicted": predicted,
        "capacity_bytes": capacity,
        "compile_s": compile_s,
        "refused": refused,
    }


# ---------------------------------------------------------------------------- records


def to_records(out: dict, config: dict) -> list[dict]:
    """One lab.measure record per figure of `measure` (series decode_batch / prefill_batch
    for the plots), `config` (model, mesh, options) on every one."""
    roofs: Roofs = out["roofs"]
    s = out["summary"]
    recs = [
        records.make_record("copy bandwidth", roofs.copy["bytes_per_s"], "B/s", **config),
        records.make_record(
            "memory roof", roofs.bandwidth, "B/s", label="derived", note=roofs.how, **config
        ),
        records.make_record(f"matmul peak {roofs.dtype}", roofs.peak_flops, "FLOP/s", **config),
        records.make_record("ridge point", roofs.ridge, "FLOP/B", label="derived", **config),
        records.make_record(
            "decode critical batch",
            None if math.isinf(s["critical_batch"]) else s["critical_batch"],
            "sequences",
            label="derived",
            **{**config, "metric": "decode_critical_batch"},
        ),
    ]
    for r in out["prefill"]:
        recs.append(
            records.make_record(
                f"prefill tokens/s, batch {r['batch']}",
                r["tokens_per_s"],
                "tokens/s",
                series="prefill_batch",
                **{**config, **r},
            )
        )
    for r in out["decode"] + out["decode_int8"]:
        kind = "int8" if r["int8_cache"] else "float"
        recs.append(
            records.make_record(
                f"decode tokens/s, batch {r['batch']}, {kind}",
                r["tokens_per_s"],
                "tokens/s",
                series="decode_batch",
                int8=r["int8_cache"],
                **{**config, **r},
            )
        )
    for r in out.get("torch", []):
        recs.append(
            records.make_record(
                f"PyTorch decoder tokens/s, batch {r['batch']}, float",
                r["tokens_per_s"],
                "tokens/s",
                peer="torch",
                **{**config, **r},
            )
        )
    if "output_input_cost_ratio" in s:
        recs.append(
            records.make_record(
                "output / input token cost (prefill tokens/s over decode tokens/s, best rates)",
                s["output_input_cost_ratio"],
                "×",
                label="derived",
                **config,
            )
        )
    if out["int8"]:
        e = out["int8"]
        for what, value, unit in (
            ("int8 weights: loss change on the bundled text", e["loss_int8"] - e["loss_float"], ""),
            ("int8 weights + cache: decode logits relative RMS error", e["logits_rel_rms"], ""),
            ("int8 weights: bytes saved", e["weight_bytes_float"] - e["weight_bytes_int8"], "B"),
        ):
            recs.append(records.make_record(what, value, unit, label="derived", **{**config, **e}))
    return recs


def plan_records(rows: list[dict], config: dict) -> list[dict]:
    """One record per compiled serving plan: memory per device, compiled, not run, with the
    calculator's figure and the chip's capacity beside it."""
    out = []
    for r in rows:
        kind = "int8" if r["int8"] else "float"
        out.append(
            records.make_record(
                f"decode step memory per device, {kind} weights and cache",
                (r["compiled"] or {}).get("total_bytes"),
                "B",
                label="compiled, not run",
                **{**config, **{k: v for k, v in r.items() if k != "compiled"}},
                compiled_memory=r["compiled"],
            )
        )
    return out

"""The lab's real training step, measured: against a bare step, and over remat × batch.

`compare_with_bare` asks whether the lab's machinery costs anything (`python -m
lab.tools.bench_step`): it builds the lab's step (shardings, logical constraints, donation,
loss scaling hooks) and a bare step written the plain way (`jax.jit` of `model.apply` +
`optax.adamw`, no shardings) for the same model on the same batch, and times them alternately
in one run (lab.measure.timing.compare). Ratio = lab / bare.

`tune` asks which remat policy and batch size give the step its highest MFU (`python -m
lab.tools.tune_step`). Memory decides what can run (remat trades recomputation for
activations, a bigger batch amortises the weights' traffic), so the answer is measured, not
guessed: for every (remat, batch_size) pair it builds lab.run's real sharded step with the
other keys as given, compiles it, refuses it where the compiled memory does not fit the device
(the check lab.run makes before training), times the others (`lab.measure.timing.bench`:
warm-up and compile apart, the donated state threaded through, blocked on every leaf), and
reports tokens/s and MFU in lab.run's convention (model FLOPs per token from 6·N + attention;
the spec-table peak of the devices the mesh uses, or this CPU's measured matmul peak).
"""

import time

import jax
import optax

from lab import summary
from lab.config import make_config
from lab.data import host_batch, to_global
from lab.errors import ConfigError
from lab.measure import records as rec
from lab.measure.timing import Comparison, bench, comparison, threaded
from lab.measure.tuning import StepCandidate, within_noise
from lab.model import build
from lab.report.format import key_args
from lab.resolve import Platform, Request, check_shapes
from lab.session import Session, open_session
from lab.train import cross_entropy, make_optimizer

REMATS = ("none", "dots", "full")
BATCHES = (8, 16, 32)
STEPS = 1000  # the schedule's length: the timed steps sit in its warm-up, as early training does


def bare_step_fn(model, tx):
    """The step a user would write first: no shardings, no constraints, no donation."""

    @jax.jit
    def step(params, opt_state, tokens_BxL1):
        tokens, segments = tokens_BxL1, None
        if tokens_BxL1.ndim == 3:  # packed (pack=true): tokens, segment ids
            tokens, segments = tokens_BxL1[:, 0], tokens_BxL1[:, 1, :-1]

        def loss_fn(p):
            logits = model.apply({"params": p}, tokens[:, :-1], None, segments)
            return cross_entropy(logits, tokens[:, 1:])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def _tokens(s: Session):
    cfg = s.cfg
    batch = host_batch(
        cfg.data, cfg.seed, 0, cfg.batch_size, cfg.seq_len, cfg.model.vocab_size, cfg.pack
    )
    return to_global(batch, s.trainer.batch_sharding)


def _check_room_for_two(analysis: dict, info) -> None:
    """The bare step runs beside the lab's with its own weights and optimizer state: refuse,
    in one line and before either is made, a model the device cannot hold twice."""
    problem = summary.memory_problem(analysis, info)
    if problem:
        raise ConfigError(problem)
    total = (analysis.get("compiled_memory_per_device") or {}).get("total_bytes")
    cap = analysis.get("capacity_bytes_per_device")
    if total and cap and 2 * total > cap:
        raise ConfigError(
            f"the bare step runs beside the lab's, each with its own weights and optimizer "
            f"state: together about {2 * total / 2**30:.2f} GiB, and the device has "
            f"{cap / 2**30:.2f} GiB: try a smaller model or batch_size"
        )


def compare_with_bare(s: Session, budget_s: float = 5.0) -> tuple[Comparison, dict]:
    """Both steps on one batch, timed alternately: bare (the baseline), then lab; with the
    seconds each took to compile ({"bare": s, "lab": s}), both compiled ahead of the timing
    so that no compile sits in a timed call or in another's figure."""
    cfg, trainer = s.cfg, s.trainer
    if too_big := summary.far_too_big(trainer):  # known without a long compile
        raise ConfigError(f"{too_big}: {summary.TOO_BIG_ADVICE}")
    tokens = _tokens(s)
    t0 = time.perf_counter()
    compiled = trainer.lower().compile()
    compile_s = {"lab": time.perf_counter() - t0}
    _check_room_for_two(summary.analyse(compiled, cfg, s.info, trainer), s.info)
    lab_call = threaded(lambda st: compiled(st, tokens)[0], trainer.init(jax.random.key(cfg.seed)))
    params = jax.device_put(trainer.init(jax.random.key(cfg.seed)).params, jax.devices()[0])
    tx = make_optimizer(cfg)  # the same optimizer: only the machinery differs
    opt_state = tx.init(params)
    t0 = time.perf_counter()
    bare = bare_step_fn(build(cfg.model), tx).lower(params, opt_state, tokens).compile()
    compile_s["bare"] = time.perf_counter() - t0
    bare_call = threaded(lambda st: bare(*st, tokens)[:2], (params, opt_state))
    timed = comparison({"bare": bare_call, "lab": lab_call}, baseline="bare", budget_s=budget_s)
    return timed, compile_s


def compare_records(timed: Comparison, compile_s: dict, keys: dict) -> list[dict]:
    """Per step (bare, lab): its median time with its spread and its compile time (measured),
    and the lab's ratio to the bare step (derived from the two medians)."""
    out = []
    for c in timed.contenders:
        config = dict(experiment="bench_step", keys=keys, step=c.name)
        spread = dict(p10_s=c.bench.p10_s, p90_s=c.bench.p90_s, runs=c.bench.runs)
        median = c.bench.median_s
        out.append(rec.make_record("bench_step step time", median, "s", **config, **spread))
        if c.name in compile_s:
            out.append(rec.make_record("bench_step compile time", compile_s[c.name], "s", **config))
        if c.name != timed.baseline:
            out.append(
                rec.make_record(
                    f"bench_step time ratio vs {timed.baseline}",
                    c.ratio,
                    "x",
                    label="derived",
                    baseline_median_s=c.baseline_median_s,
                    **config,
                )
            )
    return out


def measure(keys: dict, remat: str, batch: int, budget_s: float) -> StepCandidate:
    """One candidate: compiled memory, and (if it fits) step time, tokens/s and MFU. One the
    memory calculator puts far beyond the memory there is (`summary.far_too_big`) is skipped
    before its compile."""
    s = open_session(keys={**keys, "remat": remat, "batch_size": batch, "steps": STEPS})
    cfg, info, trainer = s.cfg, s.info, s.trainer
    if too_big := summary.far_too_big(trainer):
        return StepCandidate(remat, batch, skipped=too_big)
    t0 = time.perf_counter()
    compiled = trainer.lower().compile()
    compile_s = time.perf_counter() - t0
    analysis = summary.analyse(compiled, cfg, info, trainer)
    mem = analysis["compiled_memory_per_device"] or {}
    row = dict(remat=remat, batch=batch, compile_s=compile_s, memory_bytes=mem.get("total_bytes"))
    problem = summary.memory_problem(analysis, info)
    if problem:
        return StepCandidate(**row, skipped=problem.split(":")[0])
    tokens = _tokens(s)
    call = threaded(lambda st: compiled(st, tokens)[0], trainer.init(jax.random.key(cfg.seed)))
    timed = bench(call, warmup=2, min_runs=3, budget_s=budget_s)
    peak, source = summary.mesh_peak(cfg, info, analysis["devices"])
    return StepCandidate(
        **row,
        step_s=timed.median_s,
        runs=timed.runs,
        p10_s=timed.p10_s,
        p90_s=timed.p90_s,
        seq_len=cfg.seq_len,
        model_flops_per_token=analysis["model_flops_per_token"],
        peak_flops=peak,
        peak_source=source,
        convention=analysis["flops_convention"],
        device=f"{info.device_kind} × {analysis['devices']}",
    )


def check_tune(keys: dict) -> None:
    """ConfigError, in one line, for keys tune() cannot take: the ones it varies or sets, a
    plan's target, and any key or mesh the step refuses alone; a tool calls it before it
    shows anything, tune() again before it compiles."""
    for key in ("remat", "batch_size", "steps"):
        if key in keys:
            raise ConfigError(f"{key}= is what tune_step varies or sets; use remats=/batches=")
    refuse_plans(keys, "tune_step")
    make_config(**keys)  # each key alone: one line before compiling (rules between keys: per row)
    request = Request.of(**keys)  # how the weights split over the mesh: no batch or policy
    check_shapes(request, Platform.found(request))  # changes it, so once, before any compile


def tune(
    keys: dict, remats=REMATS, batches=BATCHES, budget_s: float = 5.0, log=None, done=None
) -> list[StepCandidate]:
    """Every (remat, batch) measured, in that order; skipped ones say why. `done(candidate)`
    as each is measured (a caller that keeps them on a stop)."""
    check_tune(keys)
    rows, refused = [], set()
    for remat in remats:
        for batch in batches:
            if log:
                log(f"remat={remat} batch_size={batch}")
            try:
                rows.append(measure(keys, remat, batch, budget_s))
            except ConfigError as e:  # e.g. a batch the mesh's data axes do not divide
                rows.append(StepCandidate(remat, batch, skipped=str(e)))
                refused.add(str(e))
            except RuntimeError as e:  # the allocator ran out where the compiled figure fit
                if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                    raise
                rows.append(StepCandidate(remat, batch, skipped="out of memory when run"))
            if done:
                done(rows[-1])
    if len(refused) == 1 and all(r.skipped in refused for r in rows):
        raise ConfigError(refused.pop())  # the keys themselves, not a batch or a policy
    return rows


# lab.run keys of a run's own outputs, which the timing tools would accept and ignore
RUN_OUTPUT_KEYS = ("name", "out_dir", "log_every", "checkpoint_every", "explain", "profile")


def refuse_plans(keys: dict, tool: str) -> None:
    """These tools time steps on the devices here: a plan's devices cannot run one,
    compile_only=true would time nothing, and resume= or overwrite= name a run folder they
    never keep."""
    if keys.get("compile_only"):
        raise ConfigError(f"compile_only=true: {tool} compiles and times; leave it out")
    run_keys = [k for k in ("resume", "overwrite") if keys.get(k)]
    if run_keys:  # it writes no run folder: nothing to resume or clear
        raise ConfigError(
            f"{'=true, '.join(run_keys)}=true: {tool} times steps and keeps no run folder; "
            "leave it out"
        )
    outputs = [k for k in RUN_OUTPUT_KEYS if k in keys]
    if outputs:  # what a run writes or shows: these tools write records, never a run folder
        raise ConfigError(
            f"{', '.join(key_args({k: keys[k] for k in outputs}))}: {tool} times steps and "
            "keeps no run folder, metrics, checkpoints, trace or explain table; leave "
            f"{'them' if len(outputs) > 1 else 'it'} out, or use python -m lab.run"
        )
    if keys.get("target"):
        raise ConfigError(
            f"target={keys['target']}: {tool} times steps on this machine's devices; for "
            f"hardware that is not here, python -m lab.run target={keys['target']} compiles "
            "the step and prints its plan"
        )


def best(rows: list[StepCandidate]) -> StepCandidate | None:
    """The candidate that ran with the most tokens/s; None when none ran."""
    ran = [r for r in rows if r.ran]
    return max(ran, key=lambda r: r.tokens_per_s) if ran else None


def as_good(rows: list[StepCandidate], top: StepCandidate | None) -> list[StepCandidate]:
    """Every other candidate whose p10–p90 range of tokens/s overlaps the best's: within the
    run's noise, as good as `top`; by median tokens/s, highest first; empty when every other
    is apart from it (or none ran)."""
    if top is None or not top.p10_s or not top.p90_s:
        return []
    timed = [r for r in rows if r.ran and r.p10_s and r.p90_s and r is not top]
    spans = [_tokens_span(r) for r in (top, *timed)]
    tied = [timed[i - 1] for i in within_noise(spans, 0)]
    return sorted(tied, key=lambda r: r.tokens_per_s, reverse=True)


def best_record(top: StepCandidate, tied: list[StepCandidate], keys: dict) -> dict:
    """The search's choice (derived from the candidates' measured times): the best's tokens/s,
    its remat and batch, and `within_noise_of`: every candidate as good within the run's noise
    (`as_good`), empty where none is."""
    return rec.make_record(
        "tune_step best tokens/s",
        top.tokens_per_s,
        "tokens/s",
        label="derived",
        experiment="tune_step",
        keys=keys,
        remat=top.remat,
        batch=top.batch,
        within_noise_of=[dict(remat=r.remat, batch=r.batch) for r in tied],
    )


def _tokens_span(r: StepCandidate) -> tuple[float, float]:
    """p10–p90 in tokens/s: the slowest steps give the low end."""
    tokens = r.batch * r.seq_len
    return tokens / r.p90_s, tokens / r.p10_s


def tune_records(rows: list[StepCandidate], keys: dict) -> list[dict]:
    """Per candidate: its tokens/s and MFU, or why it was skipped (the runbook reads these)."""
    out = []
    for r in rows:
        config = dict(experiment="tune_step", keys=keys, remat=r.remat, batch=r.batch)
        if not r.ran:
            out.append(rec.make_record("tune_step skipped", r.skipped, "reason", **config))
            continue
        extra = dict(step_s=r.step_s, runs=r.runs, memory_bytes=r.memory_bytes)
        extra |= dict(p10_s=r.p10_s, p90_s=r.p90_s)
        out.append(
            rec.make_record("training tokens/s", r.tokens_per_s, "tokens/s", **config, **extra)
        )
        if r.mfu is not None:
            out.append(
                rec.make_record(
                    "training MFU",
                    r.mfu,
                    "fraction",
                    label="derived",
                    peak_source=r.peak_source,
                    peak_flops=r.peak_flops,  # MFU = tokens/s × FLOPs per token / peak
                    model_flops_per_token=r.model_flops_per_token,
                    convention=r.convention,
                    **config,
                )
            )
    return out

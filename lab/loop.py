"""The training loop: compile apart, check memory first, train with a progress bar, summarise.

Step time is the interval between successive completed steps (each blocked on its loss),
while the next batch is built on the host during the device's work; the median excludes
the first steps, and compile time is reported on its own.
"""

import contextlib
import dataclasses
import json
import math
import signal
import sys
import time
from pathlib import Path

import jax

from lab import checkpoint, plans, rundir, summary
from lab.config import Config
from lab.data import host_batch, to_global
from lab.devices import agreed_stop
from lab.errors import RunError
from lab.measure.records import writable_dir
from lab.measure.timing import summarise
from lab.report import progress, tables
from lab.session import Session

WARMUP_STEPS = 2  # excluded from the step-time median (allocation, first transfers)
PROFILE_STEPS = 4  # profile=true traces this many steps after warm-up (steps 4-7 of a fresh run)


def _non_finite(**values) -> str | None:
    """'loss is nan' / 'gradient norm is inf' / 'weights are inf' for the first non-finite."""
    words = {"loss": "loss is", "grad_norm": "gradient norm is", "param_norm": "weights are"}
    for key, value in values.items():
        if not math.isfinite(value):
            return f"{words[key]} {value}"
    return None


class _Stop:
    """Turns SIGINT/SIGTERM into a flag the loop checks between steps (state stays valid)."""

    def __init__(self):
        self.signal = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, _frame):
        self.signal = signal.Signals(signum).name
        signal.signal(signum, self._old.get(signum, signal.SIG_DFL))  # a second one is final

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _batch(cfg: Config, trainer, step: int):
    tokens = host_batch(cfg.data, cfg.seed, step, cfg.batch_size, cfg.seq_len, cfg.model.vocab_size)
    return to_global(tokens, trainer.batch_sharding)


@dataclasses.dataclass
class History:
    losses: list = dataclasses.field(default_factory=list)  # (step, loss)
    step_s: list = dataclasses.field(default_factory=list)


class _Tracer:
    """A jax.profiler trace that is always closed, even when the run ends (NaN, signal, fewer
    steps than the window) before the last traced step."""

    def __init__(self, path: Path):
        self.path, self.active = path, False

    def start(self):
        jax.profiler.start_trace(str(self.path))
        self.active = True

    def stop(self):
        if self.active:
            jax.profiler.stop_trace()
            self.active = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _train(cfg, trainer, compiled, state, start, mngr, metrics_f, console, hist):
    tokens_per_step = cfg.batch_size * cfg.seq_len
    batch = _batch(cfg, trainer, start)
    tracer = _Tracer(Path(cfg.out_dir) / cfg.name / "profile")
    with _Stop() as stop, progress.training(console) as bar, tracer:
        task = bar.add_task("train", total=cfg.steps, completed=start, loss=math.nan, tps=0.0)
        last = time.perf_counter()
        for step in range(start, cfg.steps):
            if cfg.profile and step == start + WARMUP_STEPS + 1:
                tracer.start()
            state, metrics = compiled(state, batch)
            if step + 1 < cfg.steps:
                batch = _batch(cfg, trainer, step + 1)  # host work overlaps the device's
            loss = float(metrics["loss"])  # blocks on this step
            now = time.perf_counter()
            hist.step_s.append(now - last)
            last = now
            if step == start + WARMUP_STEPS + PROFILE_STEPS:
                tracer.stop()
            grad_norm = float(metrics["grad_norm"])
            param_norm = float(metrics["param_norm"])
            bad = _non_finite(loss=loss, grad_norm=grad_norm, param_norm=param_norm)
            if bad:
                # Checked before this step's state can be saved: a non-finite gradient has
                # already poisoned the update even where the loss itself is still finite, and
                # a finite gradient times a huge learning rate can still overflow the weights.
                kept = f"; last good checkpoint kept in {mngr.directory}" if mngr else ""
                raise RunError(f"{bad} at step {step + 1}: training stopped{kept}")
            hist.losses.append((step + 1, loss))
            bar.update(task, completed=step + 1, loss=loss, tps=tokens_per_step / hist.step_s[-1])
            if metrics_f and ((step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps):
                rec = {
                    "step": step + 1,
                    "loss": loss,
                    "grad_norm": grad_norm,
                    "step_s": hist.step_s[-1],
                    "tokens_per_s": tokens_per_step / hist.step_s[-1],
                }
                metrics_f.write(json.dumps(rec) + "\n")
                metrics_f.flush()
            if mngr and cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                checkpoint.save(mngr, step + 1, state)
            if agreed_stop(stop, step + 1):  # the same step on every process
                if mngr:
                    checkpoint.save(mngr, step + 1, state, wait=True)  # a no-op if just saved
                    console.print(f"{stop.signal}: checkpoint saved at step {step + 1}")
                return state, stop.signal
    return state, None


def _restore(cfg: Config, trainer, run_dir: Path, is_main: bool, console):
    """(state, step): the newest good checkpoint of a resumed run, or a fresh state."""
    if cfg.resume:
        warn = lambda msg: print(msg, file=sys.stderr) if is_main else None
        step, state = checkpoint.restore_latest(run_dir, trainer.abstract_state, warn=warn)
        if step is not None:
            rundir.check_steps(step, cfg.steps)
            console.print(f"resumed from checkpoint at step {step}")
            return state, step
        console.print("no good checkpoint in the run folder: starting from step 0")
    return trainer.init(jax.random.key(cfg.seed)), 0


def _open_run_dir(cfg: Config, is_main: bool) -> Path:
    """The run folder, checked before anything compiles: writable, and on resume holding a
    run of the same model (ConfigError, one line)."""
    run_dir = Path(cfg.out_dir) / cfg.name
    writable_dir(cfg.out_dir)
    if cfg.resume:
        rundir.check_same_state(rundir.saved_config(run_dir), dataclasses.asdict(cfg))
    if is_main:
        writable_dir(run_dir)
        if cfg.checkpoint_every or cfg.resume:
            checkpoint.check_folder(run_dir)
    return run_dir


def _analyse(cfg, info, trainer, console):
    """Compile, explain, analyse; refuse a step the device cannot hold. (analysis, compiled,
    compile_s). A plan's compile also reads every GPU kernel's resources (lab/plans)."""
    t0 = time.perf_counter()
    if info.aot:
        try:
            compiled, kernels = plans.compile_plan(trainer.lower, list(trainer.mesh.devices.flat))
        except RuntimeError as e:  # XLA:TPU refuses a step its HBM cannot hold
            refused = plans.refusal(e)
            if refused is None:
                raise
            raise RunError(
                f"target={cfg.target}: {summary.refused_advice(trainer, refused)}"
            ) from None
    else:
        compiled, kernels = trainer.lower().compile(), []
    compile_s = time.perf_counter() - t0
    if cfg.explain:
        from lab.parallel import explain

        ex = explain.explain(trainer, compiled)
        console.print(tables.explain_memory(ex))
        console.print(tables.explain_collectives(ex))
        if ex.pipeline:
            console.print(tables.explain_pipeline(ex.pipeline.as_dict()))
    analysis = summary.analyse(compiled, cfg, info, trainer, kernels)
    problem = summary.memory_problem(analysis, info)
    if problem:
        raise RunError(problem)
    return analysis, compiled, compile_s


def run_training(session: Session) -> int:
    cfg, info, trainer = session.cfg, session.info, session.trainer
    is_main = info.process_index == 0
    run_dir = _open_run_dir(cfg, is_main)
    lock = checkpoint.Lock(run_dir) if is_main else contextlib.nullcontext()
    with lock:
        if is_main:
            rundir.quiet_libraries(run_dir)
        return _run(cfg, info, trainer, run_dir, is_main)


def _run(cfg, info, trainer, run_dir: Path, is_main: bool) -> int:
    console = progress.console(quiet=not is_main)
    n_params = sum(x.size for x in jax.tree.leaves(trainer.abstract_state.params))
    console.print(
        tables.run_header(
            cfg, info, n_params, dict(trainer.mesh.shape), attention_note=trainer.attention_note
        )
    )
    state, start = (
        (None, 0) if cfg.compile_only else _restore(cfg, trainer, run_dir, is_main, console)
    )
    if is_main:
        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    analysis, compiled, compile_s = _analyse(cfg, info, trainer, console)
    if cfg.compile_only:
        console.print(tables.analysis(analysis, compile_s))
        if analysis.get("aot", {}).get("kernels"):
            title = f"GPU kernels of one step ({info.device_kind}): compiled, not run"
            aot = analysis["aot"]
            console.print(tables.kernels(aot["kernels"], title, aot.get("toolchain")))
        if is_main:
            summary.write_summary(run_dir, {"compile_s": compile_s, **analysis})
        return 0
    mngr = checkpoint.manager(run_dir) if (cfg.checkpoint_every or cfg.resume) else None
    hist = History()
    if is_main:
        rundir.keep_metrics_before(run_dir, start)
    metrics = open(run_dir / "metrics.jsonl", "a") if is_main else contextlib.nullcontext()
    with metrics as metrics_f:
        try:
            state, stopped = _train(
                cfg, trainer, compiled, state, start, mngr, metrics_f, console, hist
            )
        finally:
            if mngr:
                mngr.wait_until_finished()
    times = summarise(hist.step_s[WARMUP_STEPS:] or hist.step_s or [math.nan], compile_s)
    result = summary.summarise_run(cfg, info, analysis, times, hist.losses)
    console.print(tables.run_summary(result))
    if is_main:
        summary.write_summary(run_dir, result)
        console.print(f"run folder: {run_dir}")
    return {None: 0, "SIGINT": 130, "SIGTERM": 143}[stopped]

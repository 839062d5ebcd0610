"""The training loop: compile apart, check memory first, train with a progress bar, summarise.

Step time is the interval between successive completed steps (each blocked on its loss),
while the next batch is built on the host during the device's work; the median excludes
the first steps, and compile time is reported on its own.
"""

import dataclasses
import json
import math
import signal
import time
from pathlib import Path

import jax
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from lab import checkpoint, summary
from lab.config import Config
from lab.data import host_batch, to_global
from lab.devices import DeviceInfo
from lab.errors import RunError
from lab.measure.timing import summarise

WARMUP_STEPS = 2  # excluded from the step-time median (allocation, first transfers)
PROFILE_STEPS = 4  # profile=true traces this many steps after warm-up (steps 4-7 of a fresh run)


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


def _initial_state(cfg: Config, trainer, mngr, console):
    if cfg.resume and mngr is not None:
        step, state = checkpoint.restore_latest(mngr, trainer.abstract_state)
        if step is not None:
            console.print(f"resumed from checkpoint at step {step}")
            return state, step
        console.print("no complete checkpoint found: starting from step 0")
    return trainer.init(jax.random.key(cfg.seed)), 0


@dataclasses.dataclass
class History:
    losses: list = dataclasses.field(default_factory=list)  # (step, loss)
    step_s: list = dataclasses.field(default_factory=list)


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("step {task.completed:>5}/{task.total}"),
        BarColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[tps]:,.0f} tok/s"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
        disable=not console.is_terminal,
    )


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
    with _Stop() as stop, _progress(console) as progress, tracer:
        task = progress.add_task("train", total=cfg.steps, completed=start, loss=math.nan, tps=0.0)
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
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                # Checked before this step's state can be saved: a non-finite gradient has
                # already poisoned the update even where the loss itself is still finite.
                kept = f"; last good checkpoint kept in {mngr.directory}" if mngr else ""
                what = (
                    f"loss is {loss}"
                    if not math.isfinite(loss)
                    else f"gradient norm is {grad_norm}"
                )
                raise RunError(f"{what} at step {step + 1}: training stopped{kept}")
            hist.losses.append((step + 1, loss))
            progress.update(
                task, completed=step + 1, loss=loss, tps=tokens_per_step / hist.step_s[-1]
            )
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
            if stop.signal:
                if mngr:
                    checkpoint.save(mngr, step + 1, state, wait=True)
                    console.print(f"{stop.signal}: checkpoint saved at step {step + 1}")
                return state, stop.signal
    return state, None


def _keep_metrics_before(path: Path, start: int) -> None:
    """Drop logged steps past `start` (a resume repeats them from its checkpoint; a fresh
    run starts the file anew), so every step appears once in metrics.jsonl."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True) if start else []
    kept = [x for x in lines if x.strip() and json.loads(x).get("step", 0) <= start]
    path.write_text("".join(kept))


def run_training(cfg: Config, info: DeviceInfo, trainer) -> int:
    is_main = info.process_index == 0
    console = Console(stderr=False, quiet=not is_main)
    run_dir = Path(cfg.out_dir) / cfg.name
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    console.print(summary.header(cfg, info, trainer))
    t0 = time.perf_counter()
    compiled = trainer.lower().compile()
    compile_s = time.perf_counter() - t0
    if cfg.explain:
        from lab.parallel import explain

        explain.render(explain.explain(cfg, trainer, compiled), console)
    analysis = summary.analyse(compiled, cfg, info, trainer)
    problem = summary.memory_problem(analysis, info)
    if problem:
        raise RunError(problem)
    if cfg.compile_only:
        console.print(summary.analysis_table(analysis, compile_s))
        if is_main:
            summary.write_summary(run_dir, {"compile_s": compile_s, **analysis})
        return 0
    mngr = checkpoint.manager(run_dir) if (cfg.checkpoint_every or cfg.resume) else None
    state, start = _initial_state(cfg, trainer, mngr, console)
    hist = History()
    if is_main:
        _keep_metrics_before(run_dir / "metrics.jsonl", start)
    with open(run_dir / "metrics.jsonl", "a") if is_main else _null() as metrics_f:
        try:
            state, stopped = _train(
                cfg, trainer, compiled, state, start, mngr, metrics_f, console, hist
            )
        finally:
            if mngr:
                mngr.wait_until_finished()
    times = summarise(hist.step_s[WARMUP_STEPS:] or hist.step_s or [math.nan], compile_s)
    result = summary.summarise_run(cfg, info, analysis, times, hist.losses)
    console.print(summary.summary_table(result))
    if is_main:
        summary.write_summary(run_dir, result)
        console.print(f"run folder: {run_dir}")
    return {None: 0, "SIGINT": 130, "SIGTERM": 143}[stopped]


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False

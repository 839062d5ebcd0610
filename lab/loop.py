"""The training loop: compile apart, check memory first, train with a progress bar, summarise.

Step time is the interval between successive completed steps (each blocked on its loss),
while the next batch is built on the host during the device's work; the median excludes
the first steps, and compile time is reported on its own.

Every way out of the loop ends the same way: the summary is written, the checkpoint in flight
is finished (under the signal handler, so a signal during the last save is a request to stop,
not a kill), and one line says why the run stopped and what the folder keeps, read from the
folder itself. A write that fails (a full disk) stops the run the same way, in one line.

Each logged step's record goes to metrics.jsonl and, as TensorBoard scalars, to the run's
event file (lab/tensorboard.py), both from process 0 only.
"""

import contextlib
import dataclasses
import difflib
import errno
import json
import math
import os
import shlex
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from lab import checkpoint, plans, rundir, startup, summary, tensorboard
from lab.checkpoint import LAYOUT
from lab.config import BACKEND_KEYS, KEYS, WARMUP_STEPS, Config, profile_window
from lab.data import host_batch, to_global
from lab.devices import (
    JOIN_FILE,
    PARENT_DEATH_SIGNAL,
    agreed_folder,
    agreed_stop,
    check_joined,
    leave_now,
    left_loop,
    on_peer_lost,
    peer_gone,
)
from lab.errors import ConfigError, RunError
from lab.measure import memory
from lab.measure.gpu_kernels import Kernel
from lab.measure.records import writable_dir
from lab.measure.run import RunSummary, StepAnalysis
from lab.measure.timing import summarise
from lab.measure.toolchain import Toolchain
from lab.mesh import split_words
from lab.names import STAGE
from lab.report import progress, tables
from lab.resolve import Request
from lab.session import Session
from lab.train import (
    block_order,
    config_layout,
    lr_schedule,
    restore_in_layout,
    saved_block_order,
)

# a line that names the user's folders: printed as it is (a path's [brackets] are not markup)
PLAIN = {"markup": False, "highlight": False, "soft_wrap": True}


def _non_finite(**values) -> str | None:
    """'loss is nan' / 'gradient norm is inf' / 'weights are inf' for the first non-finite."""
    words = {"loss": "loss is", "grad_norm": "gradient norm is", "param_norm": "weights are"}
    for key, value in values.items():
        if not math.isfinite(value):
            return f"{words[key]} {value}"
    return None


class _Stop:
    """Turns SIGINT/SIGTERM into a flag the loop checks between steps (state stays valid).

    A second signal is final: `final(name)` says in one line what is left unfinished, and the
    process exits at once (130/143) without waiting for a save in flight."""

    def __init__(self, final=None):
        self.signal = None  # the signal to stop on (this process's own, or its peers')
        self.final = final
        self._received = 0  # signals this process got
        self._old = {}
        self._once = threading.Lock()  # the second signal ends the process once

    def __enter__(self):
        # start-up's watcher must not act on a signal this handler takes (lab/startup.py)
        self._paused = startup.watch_paused()
        self._paused.__enter__()
        handlers = {signal.SIGINT: self._handle, signal.SIGTERM: self._handle}
        handlers[signal.Signals[PARENT_DEATH_SIGNAL]] = self._parent_died
        for sig, handler in handlers.items():
            try:
                self._old[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread: leave signals alone
                pass
        # a second signal during a step: the handler runs once for both after the step's
        # native call returns, so a thread counts them as they come
        self._second = startup.second_signal((signal.SIGINT, signal.SIGTERM), self._heard_twice)
        self._second.__enter__()
        return self

    def _parent_died(self, _signum, _frame):
        """The launcher of this process died (lab.tools.launch asks the kernel for this
        signal then): stop as on a first SIGTERM. The kernel may send it several times, once
        per launcher thread as they exit, so it never counts as a second signal."""
        if self._received == 0:
            self._received = 1
            self.signal = self.signal or "SIGTERM"

    def _handle(self, signum, _frame):
        self._received += 1
        if self._received == 1:
            self.signal = self.signal or signal.Signals(signum).name
            return
        self._exit_now(signum)

    def _heard_twice(self, signum: int) -> None:
        """The signal-counting thread heard a second signal: it is the loop's to act on only
        while the loop's handler is installed (not in the moment start-up's is put back, which
        takes it itself), and the main thread's own handler takes it within milliseconds
        unless the main thread is inside a step's native call: then this thread ends it."""
        if signal.getsignal(signum) != self._handle:
            return
        deadline = time.monotonic() + startup.MAIN_TAKES_S
        while time.monotonic() < deadline:
            if self._received >= 2:  # the main thread's handler has it
                return
            time.sleep(0.01)
        self._exit_now(signum, from_thread=True)

    def _exit_now(self, signum: int, from_thread: bool = False) -> None:
        """The second signal: say what is left unfinished and exit, at once. Once: where the
        main thread's handler and the counting thread both come, the thread leaves it to the
        one that came first, and the handler waits for the other's line (bounded: a line that
        never comes must not keep the process)."""
        if not self._once.acquire(timeout=0 if from_thread else 30):
            if from_thread:
                return
            os._exit(128 + signum)
        with contextlib.suppress(Exception):  # exiting is what was asked, whatever happens
            if self.final:
                self.final(signal.Signals(signum).name)
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(128 + signum)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._second.__exit__(None, None, None)
        self._paused.__exit__(None, None, None)  # after the start-up handlers are back


def _batch(cfg: Config, trainer, step: int):
    tokens = host_batch(
        cfg.data, cfg.seed, step, cfg.batch_size, cfg.seq_len, cfg.model.vocab_size, cfg.pack
    )
    return to_global(tokens, trainer.batch_sharding)


@dataclasses.dataclass
class History:
    losses: list = dataclasses.field(default_factory=list)  # (step, loss)
    step_s: list = dataclasses.field(default_factory=list)  # the steps not profiled
    step: int = 0  # the last step trained whole (finite, its metrics written)
    profiled: tuple | None = None  # (first, last) step read under the profiler: not in step_s
    save_s: list = dataclasses.field(default_factory=list)  # each checkpoint save's own time


def _memory_now() -> dict:
    """Memory in use after a step: the device allocator's counters where it keeps them (GPU,
    TPU), else the process's resident memory (CPU devices live in the host's memory)."""
    stats = memory.device_memory_stats(jax.local_devices()[0]) or {}
    if "bytes_in_use" in stats:
        rec = {"device_bytes_in_use": stats["bytes_in_use"]}
        if "peak_bytes_in_use" in stats:
            rec["device_peak_bytes_in_use"] = stats["peak_bytes_in_use"]
        return rec
    return {"host_rss_bytes": memory.process_rss_bytes()}


@dataclasses.dataclass
class _Records:
    """Each logged step's record (process 0): to metrics.jsonl, then to the TensorBoard event
    file. Beside the step's loss, gradient norm, time and tokens/s: the learning rate its
    update used, its MFU (the summary's model FLOPs and peak) and the memory in use after it;
    in metrics.jsonl also how the step was split (strategy, mesh, accumulate, microbatches,
    pipeline_repeats)."""

    log: rundir.MetricsLog
    events: tensorboard.EventFile
    lr: "_Rates"  # the optimizer's schedule by update count
    tokens_per_step: int
    flops_per_token: float
    peak_flops_per_s: float | None  # None: no peak known for the device, no MFU
    # how the step was split (summary.PARALLELISM), on every line: a run resumed in another
    # layout has lines of each in one file
    split: dict = dataclasses.field(default_factory=dict)

    def write(self, step: int, loss: float, grad_norm: float, step_s: float) -> None:
        tokens_per_s = self.tokens_per_step / step_s
        rec = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "step_s": step_s,
            "tokens_per_s": tokens_per_s,
            "learning_rate": self.lr(step - 1),  # update `step` uses count step - 1
        }
        if self.peak_flops_per_s:
            rec["mfu"] = self.flops_per_token * tokens_per_s / self.peak_flops_per_s
        rec.update(_memory_now(), wall_time=time.time())
        self.log.write({**rec, **self.split})
        self.events.write(rec)


class _Rates:
    """The schedule's learning rate by update count, computed a block of counts at a time as
    the run reaches them (one call per block, not per logged step; never the whole run's
    steps at once, which a large steps= could not hold). The block is one compiled program,
    compiled with the run's first block (`first`: the count of its first update) before the
    loop starts: host work inside the loop lands in a step's time, and the schedule's eager
    operations took 0.3-0.8 s at the first record; a later block is one call to it."""

    BLOCK = 4096

    def __init__(self, schedule, first: int = 0):
        block = lambda start: schedule(start + jnp.arange(self.BLOCK))  # noqa: E731
        self.compiled, self.block, self.values = jax.jit(block), -1, None
        self(first)

    def __call__(self, count: int) -> float:
        block = count // self.BLOCK
        if block != self.block:
            self.values = np.asarray(self.compiled(block * self.BLOCK))
            self.block = block
        return float(self.values[count % self.BLOCK])


def _records(
    cfg, analysis, events: tensorboard.EventFile, log, peak: float | None, start: int = 0
) -> _Records:
    """The records' writer: metrics.jsonl's `log` and this run's event file (`start`: the
    step the run starts after, so the schedule's first block is ready before the loop)."""
    return _Records(
        log,
        events,
        _Rates(lr_schedule(cfg), start),
        cfg.batch_size * cfg.seq_len,
        analysis["model_flops_per_token"],
        peak,
        {k: analysis[k] for k in summary.PARALLELISM if k in analysis},
    )


def profile_dir(run_dir: Path) -> Path:
    """Where profile=true writes its trace: run_dir/profile, and one folder a process in a
    run of several (the profiler names a trace by host and second: processes on one host
    would write over each other's)."""
    path = run_dir / "profile"
    return path / f"process-{jax.process_index()}" if jax.process_count() > 1 else path


class _Tracer:
    """A jax.profiler trace that is always closed, even when the run ends (NaN, signal)
    before the last traced step; once closed, one line says which steps it holds, where it
    is and how to open it."""

    def __init__(self, path: Path, console, window: tuple[int, int]):
        self.path, self.console, self.window, self.active = path, console, window, False
        self.read = None  # the last step read while tracing

    def start(self):
        jax.profiler.start_trace(str(self.path))
        self.active = True

    def stop(self):
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            self.console.print(self.words(), **PLAIN)

    def words(self) -> str:
        first, last = self.window
        if self.read is None:
            steps = f"the run stopped before step {first} finished; what ran of it is traced"
        elif self.read < last:
            upto = f"step {first}" if self.read == first else f"steps {first}-{self.read}"
            steps = f"{upto} traced (the run stopped before step {last})"
        else:
            steps = f"steps {first}-{last} traced"
        return (
            f"profile: {steps} in {self.path} (their times are left out of the step-time "
            f"figures); open it with tensorboard --logdir {self.path} (Profile tab, "
            "tensorboard-plugin-profile) or load its *.trace.json.gz in https://ui.perfetto.dev"
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _train(
    cfg, trainer, compiled, state, start, saver, records, console, hist, stop, changed=""
) -> str | None:
    """Train to cfg.steps; None when it got there, else why it stopped: a signal's name, or
    'loss is nan at step N: training stopped'. `changed`: the keys a resume changed (named if
    the first step after it is not finite). A write that fails (metrics: OSError,
    checkpoint: checkpoint.SaveError) is raised. hist.step is the last step trained.

    Each step's metrics are read one step late: step n + 1 is dispatched before the host
    waits for step n, so the host's work between steps (the next batch, the records, the
    progress bar, the stop check) overlaps the device's instead of leaving it idle. A step
    whose state is kept (a checkpoint, the agreed stop) is read before the next is
    dispatched: its metrics are checked before the state is saved, and the next step would
    donate the state's buffers. Such a step and the one before it are then read together
    (`_Reader.read_both`), as is the last step, unless the one before is a warm-up step; a
    step the agreed stop keeps is read alone (the stop is known only once the step before it
    is read, which the processes' agreement needs), so its time may read short."""
    batch = _batch(cfg, trainer, start)
    tracer = _Tracer(profile_dir(Path(cfg.out_dir) / cfg.name), console, profile_window(start))
    with progress.training(console) as bar, tracer:
        reader = _Reader(cfg, bar, tracer, records, hist, start, changed)
        pending = None  # the step dispatched but not read yet: (step, metrics)
        for step in range(start + 1, cfg.steps + 1):  # the step's number once it has run
            reader.before(step)
            with reader.annotated(step):  # a traced step is marked as one in the profile
                state, metrics = compiled(state, batch)  # queued: the device runs it from here
            if step < cfg.steps:
                batch = _batch(cfg, trainer, step)  # host work overlaps the device's
            # every checkpoint_every steps, and the last: a finished run keeps its end
            every = cfg.checkpoint_every
            save = saver and every and (step % every == 0 or step == cfg.steps)
            kept = save or reader.wait_at(step)  # known before the step before is read
            # read with the step before it, unless that one is a warm-up step (the summary
            # leaves those out by position: their time must stay theirs)
            paired = pending and pending[0] > start + WARMUP_STEPS
            if paired and (kept or step == cfg.steps):
                bad = reader.read_both(pending, (step, metrics))  # this step is read now too
                pending = None
                if bad:
                    return bad  # checked before this step's state can be saved
            else:
                if pending:
                    bad = reader.read(*pending)  # the step before: done, or nearly
                    if bad:
                        return bad
                pending = (step, metrics)
            # Asked only now, after the step before is read: that read proves every peer has
            # queued this step's predecessor, and so that none is more than two steps ahead of
            # the step a signalled process posts (asked before it, a peer could be three).
            stopping = agreed_stop(stop, step, ahead=2)  # the same step on every process
            if kept or stopping:
                if pending:
                    bad = reader.read(*pending)
                    pending = None
                    if bad:
                        return bad  # checked before this step's state can be saved
                if save:
                    reader.timed_save(saver, step, state)
                if stopping:
                    if saver:  # a no-op if just saved; awaited by the caller
                        reader.timed_save(saver, step, state)
                    return stop.signal
        if pending:
            return reader.read(*pending)
    return None


class _Reader:
    """Reads a finished step's metrics on the host: its time, the non-finite check, the
    progress bar, the records, hist.step; and the profiler's window around the steps."""

    def __init__(
        self, cfg, bar, tracer: _Tracer, records, hist: History, start: int, changed: str = ""
    ):
        self.cfg, self.bar, self.tracer, self.records, self.hist = cfg, bar, tracer, records, hist
        self.tokens_per_step = cfg.batch_size * cfg.seq_len
        self.resumed_from = start  # the checkpoint step a resume restored (0: a fresh run)
        self.changed = changed  # 'lr 0.003 → 0.01': the keys that resume changed ('' none)
        # profile=true traces steps first..last (numbered from 1); the steps at the window's
        # edges are read before the next is queued, so that it holds those steps only
        self.first, self.last = profile_window(start)
        self.task = bar.add_task("train", total=cfg.steps, completed=start)
        self.clock = time.perf_counter()

    def before(self, step: int) -> None:
        if self.cfg.profile and step == self.first:
            self.tracer.start()

    def annotated(self, step: int):
        """Around a traced step's dispatch: a step marker (`train`, its number) for the
        profile's viewers, which split the trace into steps by it."""
        if self.cfg.profile and self.first <= step <= self.last:
            return jax.profiler.StepTraceAnnotation("train", step_num=step)
        return contextlib.nullcontext()

    def wait_at(self, step: int) -> bool:
        """Must `step` be read before the next is queued? The profiler's window's edges."""
        return self.cfg.profile and step in (self.first - 1, self.last)

    def timed_save(self, saver, step: int, state) -> None:
        """Saves `step`, its time counted apart (hist.save_s), never in the next step's."""
        t0 = time.perf_counter()
        try:
            saved = saver.save(step, state)
        finally:
            self.clock = time.perf_counter()  # the next step's time starts after the save
        if saved:  # (False: the step was saved already)
            self.hist.save_s.append(self.clock - t0)

    def read_both(self, before: tuple, this: tuple) -> str | None:
        """Reads two steps back to back (`before` queued ahead of `this`), each timed as half
        of the time from the last step read to the later one's end. Timed apart, the later
        one's time would be wrong: the host learns that a step has finished only once a
        thread of the runtime can say so, and on a CPU whose threads are all running the next
        step that is when the next step has finished too (its time read as ~0, the one before
        it as two steps')."""
        start = self.clock
        jax.block_until_ready((before[1], this[1]))  # both steps' metrics
        half = (time.perf_counter() - start) / 2
        return self.read(*before, step_s=half) or self.read(*this, step_s=half)

    def read(self, step: int, metrics, step_s: float | None = None) -> str | None:
        """Waits for `step`'s metrics; None, or the line that stops training there.
        `step_s`: its time where the caller measured it (`read_both`)."""
        hist = self.hist
        loss = float(metrics["loss"])  # blocks until this step has run
        if step_s is None:
            now = time.perf_counter()
            step_s = now - self.clock  # between successive finished steps
            self.clock = now
        else:
            self.clock += step_s  # the host's work after it counts in the next step's time
        if self.cfg.profile and self.first <= step <= self.last:
            # traced: slower (the profiler's own work), so kept out of the step-time figures
            hist.profiled = (self.first, step)
            self.tracer.read = step
        else:
            hist.step_s.append(step_s)
        if step == self.last:
            self.tracer.stop()
            self.clock = time.perf_counter()  # the trace's writing is not the next step's time
        grad_norm = float(metrics["grad_norm"])
        param_norm = float(metrics["param_norm"])
        bad = _non_finite(loss=loss, grad_norm=grad_norm, param_norm=param_norm)
        if bad:
            # Checked before this step's state can be saved: a non-finite gradient has
            # already poisoned the update even where the loss itself is still finite, and
            # a finite gradient times a huge learning rate can still overflow the weights.
            if self.resumed_from and step == self.resumed_from + 1:
                # a step saved before checksums were kept (or damaged in memory before its
                # save) restores finite and poisons the first update; every resume repeats it
                cause = (
                    f", unless this resume's change ({self.changed}) is the cause"
                    if self.changed
                    else ""
                )
                return (
                    f"{bad} at step {step}, the first after resuming from checkpoint step "
                    f"{self.resumed_from}: training stopped. That checkpoint may be "
                    f"damaged{cause}"
                )
            return f"{bad} at step {step}: training stopped"
        hist.losses.append((step, loss))
        tps = self.tokens_per_step / step_s
        logged = step % self.cfg.log_every == 0 or step == self.cfg.steps
        self.bar.step(self.task, step, loss, tps, step_s, logged=logged)
        if self.records and logged:
            try:
                self.records.write(step, loss, grad_norm, step_s)
            except OSError:
                if self.records.log.last_step == step:  # only the event file failed: the
                    hist.step = step  # step is whole in metrics.jsonl, as the last line says
                raise
        hist.step = step
        return None


def _kept(cfg: Config, run_dir: Path, log, saver=None) -> str:
    """What the run folder keeps, read from the folder (never assumed): the newest complete
    checkpoint, and the last step in metrics.jsonl. With the run's `saver`, checkpoints it
    saved that are no longer there are said to be gone, not 'none saved yet'."""
    steps = checkpoint.saved_steps(run_dir)
    started = [s for s in (saver.started if saver else []) if s != saver.pending]
    if steps:
        ckpt = f"checkpoint step {steps[-1]} in {checkpoint.folder(run_dir)}"
    elif started:
        n = len(started)
        ckpt = (
            f"no checkpoint: the {n} this run saved (the last at step {started[-1]}) are gone "
            f"from {checkpoint.folder(run_dir)}"
            if n > 1
            else f"no checkpoint: the one this run saved (step {started[-1]}) is gone from "
            f"{checkpoint.folder(run_dir)}"
        )
    elif cfg.checkpoint_every:
        ckpt = "no checkpoint (none saved yet)"
    else:
        ckpt = "no checkpoint (checkpoint_every=0)"
    if log is None:
        return f"kept: {ckpt}"
    last = log.last_step
    if last is None:
        records, _ = rundir.read_metrics(run_dir / "metrics.jsonl")
        last = max((r["step"] for r in records), default=None)
    metrics = f"metrics.jsonl to step {last}" if last is not None else "no metrics"
    if log.gaps:  # a damaged file's lost records: not a whole record to that step
        metrics += f" (without steps {log.gaps}, lost from a damaged or deleted file)"
    return f"kept in {run_dir}: {ckpt}; {metrics}"


# A write refused for these reasons is the folder's doing (a file where a folder should be, or
# the reverse; no permission; a read-only file system): the request names an unusable folder,
# a mistake the user corrects (exit 2). Any other (a full disk, an I/O error) is the machine's.
_FOLDER_ERRNOS = (errno.EISDIR, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS, errno.EEXIST)


def _start_failure(e: OSError, run_dir: Path) -> Exception:
    """The error for a run folder that could not be written before any step ran: ConfigError
    (exit 2) where the folder is unusable as it is, RunError (exit 1) otherwise."""
    text = f"{_write_failure(e, run_dir)}: nothing was run"
    return ConfigError(text) if e.errno in _FOLDER_ERRNOS else RunError(text)


def _write_failure(e: Exception, run_dir: Path) -> str:
    """'metrics.jsonl could not be written (No space left on device)' for a failed write."""
    if isinstance(e, checkpoint.SaveError):
        return str(e)
    name = Path(e.filename).name if getattr(e, "filename", None) else "a file"
    return f"{name} could not be written in {run_dir} ({checkpoint.failure_reason(e)})"


# Keys a resume gives anew each time (the invocation's own, which config.json does not pass on,
# and steps): not changes to the run
_RESUME_KEYS = (*rundir.INVOCATION_KEYS, "steps")


def _changed_on_resume(run_dir: Path, cfg: Config) -> str:
    """'lr 0.003 → 0.01, seed 0 → 3': the resolved keys this resume runs with that differ from
    those config.json kept (they are saved as this run's from here on)."""
    try:
        saved = rundir.saved_config(run_dir)
    except ConfigError:
        return ""
    now = _compared_keys(cfg)
    before = {k: v for k, v in saved.items() if k not in ("model", "request", "block_order")}
    before |= saved.get("model") or {}
    if before.get("loss_scale") == 0.0:  # auto, as config.json kept it before it kept the value
        before["loss_scale"] = 2.0**15 if before.get("dtype") == "float16" else 1.0
    return ", ".join(
        f"{k} {before[k]!r} → {now[k]!r}"
        for k in now
        if k in before and k not in _RESUME_KEYS and before[k] != now[k]
    )


def _unknown_on_resume(run_dir: Path) -> str:
    """'stpes=5 (did you mean steps?)': keys of the request config.json kept that this lab
    does not know (a hand edit, or a version of the lab with other keys), which the resume
    runs without; empty where there are none."""
    try:
        asked = rundir.saved_config(run_dir).get("request")
    except ConfigError:
        return ""
    if not isinstance(asked, dict):
        return ""
    out = []
    for key, value in asked.items():
        if key not in KEYS:
            close = difflib.get_close_matches(str(key), KEYS, n=1)
            out.append(f"{key}={value!r}" + (f" (did you mean {close[0]}?)" if close else ""))
    return ", ".join(out)


def _schedule_note(run_dir: Path, cfg: Config, step: int) -> str:
    """Where a resume's steps= moves the learning rate's cosine (it decays over the run's
    steps): 'steps 500 → 170: the learning rate's decay now ends at step 170 (step 167: lr
    2.35e-03 → 3.04e-04)', the rate the run as saved would have taken against this one's
    (inside the warm-up, the same: no rates); empty where steps= is the run's own."""
    try:
        saved = rundir.saved_config(run_dir)
    except ConfigError:
        return ""
    before = saved.get("steps")
    if not isinstance(before, int) or before == cfg.steps:
        return ""
    kept = {k: saved[k] for k in ("lr", "warmup_steps", "min_lr_ratio") if k in saved}
    try:
        was = float(lr_schedule(dataclasses.replace(cfg, **kept, steps=before))(step))
    except (TypeError, ValueError):  # a damaged field: the rates are not said
        was = None
    now = float(lr_schedule(cfg)(step))
    note = f"steps {before} → {cfg.steps}: the learning rate's decay now ends at step {cfg.steps}"
    if was is not None and abs(now - was) > 1e-3 * max(abs(was), 1e-12):
        note += f" (step {step + 1}: lr {was:.3g} → {now:.3g})"
    return note


def _restore(cfg: Config, trainer, run_dir: Path, is_main: bool, console):
    """(state, step, changed): the newest good checkpoint of a resumed run, or a fresh state
    (step 0); `changed` is 'lr 0.003 → 0.01' for the keys a resume changed, else ''."""
    if cfg.resume:
        # the warnings wait for the outcome: a resume that restores a step prints each damaged
        # step it moved aside; one that restores none says so in its one line
        held: list[str] = []
        warn = held.append if is_main else (lambda msg: None)
        moved: list[int] = []
        # the first process moves damaged steps aside for all: two moving the same folder
        # would race, and the one that lost would stop the job
        try:
            step, state, layout = restore_in_layout(
                run_dir,
                trainer,
                _saved_or_empty(run_dir),
                warn=warn,
                moved=moved,
                read_only=not is_main,
            )
            if step is not None:
                _check_resumed_at(cfg, step)
        except ConfigError as e:  # refused: its one line also says which steps were moved
            note = _moved_aside(run_dir, moved) if is_main else ""
            if not note:
                raise
            raise ConfigError(f"{e} (before it, {note})") from None
        except BaseException:  # a signal, a library's error: what changed is said first
            for line in held:
                print(line, file=sys.stderr)
            raise
        if step is not None:
            for line in held:
                print(line, file=sys.stderr)
            console.print(f"resumed from checkpoint at step {step}")
            if layout != trainer.layout:  # the same weights, stored as this run stores them
                console.print(
                    f"  layers: saved {layout.describe()}, moved to this run's "
                    f"({trainer.layout.describe()})",
                    soft_wrap=True,
                )
            if is_main and (unknown := _unknown_on_resume(run_dir)):
                print(
                    f"warning: {run_dir / 'config.json'} asks for {unknown}, not a key of "
                    "this lab: the run goes on without it, and its config.json no longer "
                    "keeps it",
                    file=sys.stderr,
                )
            changed = _changed_on_resume(run_dir, cfg)
            if changed:  # what goes on differently from here, said once
                console.print(
                    f"  changed from the run's keys: {changed}", markup=False, soft_wrap=True
                )
            if note := _schedule_note(run_dir, cfg, step):
                console.print(f"  {note}", markup=False, soft_wrap=True)
            return state, step, changed
        # nothing to resume: starting again would put the run's metrics aside as superseded
        # under the name of a resume; the user says so with overwrite=true instead
        if moved:
            steps = ", ".join(str(s) for s in sorted(moved))
            newest = max(moved)
            why = next((h for h in held if f"step {newest} is damaged (" in h), "")
            why = why.partition(" is damaged (")[2].rpartition("); moved to ")[0]
            why = f"; step {newest}: {why[:200]}" if why else ""
            raise ConfigError(
                f"resume=true: no checkpoint of {run_dir} restores (step{'s' * (len(moved) > 1)} "
                f"{steps} damaged, moved to checkpoints-damaged/{why}): overwrite=true starts "
                "the run again"
            )
        raise _nothing_to_resume(run_dir)
    return trainer.init(jax.random.key(cfg.seed)), 0, ""


def _moved_aside(run_dir: Path, steps: list[int]) -> str:
    """'steps 4, 6 moved to checkpoints-damaged/ as damaged': those of `steps` that a resume
    did move out of checkpoints/ (a step that could not be moved is still there); ''."""
    gone = sorted(s for s in steps if not (checkpoint.folder(run_dir) / str(s)).exists())
    if not gone:
        return ""
    which = ", ".join(map(str, gone))
    return f"step{'s' * (len(gone) > 1)} {which} moved to checkpoints-damaged/ as damaged"


def _saved_or_empty(run_dir: Path) -> dict:
    """The run's config.json (checked before the run began), or {} where it is gone."""
    try:
        return rundir.saved_config(run_dir)
    except ConfigError:
        return {}


def _nothing_to_resume(run_dir: Path) -> ConfigError:
    every = _saved_or_empty(run_dir).get("checkpoint_every")  # how the run was saving
    folder = checkpoint.folder(run_dir)
    if every and not folder.exists():
        why = f"its {folder.name}/ folder is missing, though the run saved every {every} steps"
    elif every and (damaged := checkpoint.damaged_steps(run_dir)):
        why = (
            f"none in {folder.name}/; {checkpoint.damaged_folder(run_dir).name}/ keeps "
            f"{', '.join(damaged)}, set aside by an earlier resume"
        )
    elif every:
        why = f"none in {folder.name}/: the run stopped before its first, or they were removed"
    elif every == 0:
        why = "checkpoint_every=0"
    else:  # config.json does not say
        why = "checkpoint_every=0, or the run stopped before its first"
    return ConfigError(
        f"resume=true: {run_dir} holds no checkpoint ({why}): overwrite=true starts it again"
    )


def _check_same_block_order(saved: dict, cfg: Config, stages: int, run_dir=None) -> None:
    """A run goes on in another layout (each checkpoint step records its own, and config.json
    keeps the layout of the steps saved before steps did: lab.train.config_layout). One case
    is left that nothing can read: a folder from before config.json kept its block order,
    whose mesh's stage axis was -1, holding stacked steps without a record of their own;
    reading them in another order than saved would run every layer's weights in another
    layer's place, silently. Refused; resuming with the saved mesh= reads them."""
    was = saved_block_order(saved)
    now = block_order(stages, cfg.model.pipeline_repeats)
    if was == now or config_layout(saved) is not None:
        return
    if run_dir is None or _older_steps(run_dir, stacked_only=True):
        raise ConfigError(
            f"resume=true: the checkpoint holds its layers {was} and this run would read them "
            f"{now}, and its steps were saved before checkpoints kept their layout; resume "
            "with the saved mesh= and pipeline_repeats= or choose a new name="
        )


def _older_steps(run_dir: Path, stacked_only: bool = False) -> list[int]:
    """The saved steps that keep no layout of their own (saved before steps kept one), only
    the stacked ones with `stacked_only` (each layer its own is read by its names alone)."""
    out = []
    for step in checkpoint.saved_steps(run_dir):
        step_dir = checkpoint.folder(run_dir) / str(step)
        try:
            if checkpoint.step_record(step_dir, LAYOUT) is not None:
                continue
        except checkpoint.StepDamaged:  # damaged: a restore sets it aside
            continue
        names = checkpoint.saved_names(step_dir) if stacked_only else None
        if not stacked_only or names is None or any("blocks" in n for n in names):
            out.append(step)
    return out


def _open_run_dir(cfg: Config, is_main: bool, stages: int = 1) -> Path:
    """The run folder, checked before anything compiles: writable, and on resume holding a
    run of the same model (ConfigError, one line)."""
    run_dir = Path(cfg.out_dir) / cfg.name
    writable_dir(cfg.out_dir)
    if cfg.resume:  # resolve refused resume with compile_only
        saved = rundir.saved_config(run_dir)
        rundir.check_same_state(saved, dataclasses.asdict(cfg))
        _check_same_block_order(saved, cfg, stages, run_dir)
    if is_main:
        writable_dir(run_dir)
        if cfg.checkpoint_every or cfg.resume:
            checkpoint.check_folder(run_dir)
        if cfg.resume:  # refused before the compile, and before a resume writes anything
            try:
                tensorboard.check_folder(run_dir)
            except OSError as e:
                raise _start_failure(e, run_dir) from None
    return run_dir


def _analyse(cfg, info, trainer, console):
    """Compile, explain, analyse; refuse a step the device cannot hold. (analysis, compiled,
    compile_s). A plan's compile also reads every GPU kernel's resources (lab/plans)."""
    where = f" for {cfg.target} (compiled, not run)" if info.aot else ""
    with progress.working(console, f"compiling the step{where} …"):
        return _compile_and_analyse(cfg, info, trainer, console)


def _compile_and_analyse(cfg, info, trainer, console):
    t0 = time.perf_counter()
    if info.aot:
        try:
            compiled, kernels = plans.compile_plan(trainer.lower, list(trainer.mesh.devices.flat))
        except RuntimeError as e:  # XLA:TPU refuses a step its HBM cannot hold
            refused = plans.refusal(e)
            if refused is None:
                raise
            # a config the target cannot hold, as a mesh that does not fit: exit 2, one line
            raise ConfigError(
                f"target={cfg.target}: {summary.refused_advice(trainer, refused)}"
            ) from None
    else:
        if too_big := summary.far_too_big(trainer):  # known without a long compile
            raise ConfigError(f"{too_big}: {summary.TOO_BIG_ADVICE}")
        compiled, kernels = trainer.lower().compile(), []
    compile_s = time.perf_counter() - t0
    if cfg.explain:
        from lab.parallel import explain

        ex = explain.explain(trainer, compiled)
        console.print(tables.explain_memory(ex.memory))
        console.print(tables.explain_collectives(ex))
        if ex.pipeline:
            console.print(tables.explain_pipeline(ex.pipeline))
    analysis = summary.analyse(compiled, cfg, info, trainer, kernels)
    problem = summary.memory_problem(analysis, info)
    if problem:  # known before any step: a config the device cannot hold, as a plan's refusal
        raise ConfigError(problem)
    return analysis, compiled, compile_s


def check_trains(cfg: Config) -> None:
    """ConfigError for a training run that would train nothing (checked by lab.run's loop,
    and by a launcher before it starts processes that would each refuse it alike). Not a rule
    of lab.resolve: serving and studies open sessions with steps=0 and never train them."""
    if cfg.steps == 0 and not cfg.compile_only:
        raise ConfigError(
            "steps=0 trains nothing: give steps >= 1 (compile_only=true compiles the step "
            "without training)"
        )


def run_training(session: Session) -> int:
    cfg, info, trainer = session.cfg, session.info, session.trainer
    check_trains(cfg)
    if not cfg.compile_only:  # every process alike: one's refusal is each one's
        tensorboard.check_installed()
    is_main = info.process_index == 0
    request = session.resolved.request if session.resolved else Request.from_config(cfg)
    created = []  # the folder, where this process made it
    with contextlib.ExitStack() as held:
        stages = dict(trainer.mesh.shape).get(STAGE, 1)
        cfg, run_dir = _claim_folder(
            cfg, is_main, held, named=bool(request.get("name")), stages=stages, created=created
        )
        refused_resume(cfg, run_dir)  # before the header and the compile
        started = lambda: None  # noqa: E731
        if is_main:  # the libraries' lines (orbax's on a resume) wait until the run starts
            started = rundir.quiet_libraries(run_dir, held=True)
            startup.note(  # a resume may set damaged steps or torn lines aside: kept there
                f"before training: {run_dir} keeps the earlier run; the same command resumes it"
                if cfg.resume
                else f"before training: nothing was written in {run_dir} but lab.log"
            )
        else:
            rundir.quiet_libraries_here()
        before = _listing(run_dir)
        try:
            return _run(cfg, info, trainer, run_dir, is_main, request, started)
        except ConfigError:
            # refused before it started: the held lines were about a run that never ran,
            # unless the refusal came after the folder changed (damaged steps moved aside)
            if _listing(run_dir) != before:
                started()
            elif run_dir in created and info.process_count == 1:
                _drop_refused(run_dir)  # "before anything is written": not even the folder
            raise
        except BaseException:
            started()  # a failure: the libraries' lines may say why
            raise


def _listing(run_dir: Path) -> list:
    """The run folder's entries and their times (lab.log aside): what a refusal may have
    changed."""
    try:
        return sorted(
            (p.name, p.stat().st_mtime_ns) for p in Path(run_dir).iterdir() if p.name != "lab.log"
        )
    except OSError:
        return []


def _drop_refused(folder: Path) -> None:
    """Remove a folder this run made, refused before it started (a step that cannot fit, say),
    where it holds nothing but the lock and an empty lab.log: a retry leaves no trail of empty
    run folders. The lock's file may go while it is held: the lock is on the open file."""
    with contextlib.suppress(OSError):
        names = {p.name for p in folder.iterdir()}
        log = folder / "lab.log"
        if names <= {".lock", JOIN_FILE, "lab.log"} and (
            not log.exists() or not log.stat().st_size
        ):
            for name in names:
                (folder / name).unlink(missing_ok=True)
            folder.rmdir()


def _claim_folder(
    cfg: Config,
    is_main: bool,
    held: contextlib.ExitStack,
    *,
    named: bool,
    stages: int = 1,
    created: list | None = None,
):
    """(cfg, run folder), the folder's lock held in `held` (process 0). A name the user gave
    is theirs: a folder in use or holding an earlier run is refused in one line. A name
    lab.run chose is never another run's: runs started in the same second take -2, -3, …
    With several processes, all take process 0's folder, and one's refusal is every
    process's (devices.agreed_folder)."""

    def follow(name: str, token: str | None = None):
        cfg_here = dataclasses.replace(cfg, name=name)
        otherwise = "" if cfg.resume else ", or give checkpoint_every=0"
        check_joined(Path(cfg_here.out_dir) / name, token, otherwise)
        return cfg_here, _open_run_dir(cfg_here, False, stages)

    timeout_s = max(cfg.coordinator_timeout, 120)
    # the folders process 0 made: a peer's refusal leaves none of them behind
    created = [] if created is None else created
    try:
        return agreed_folder(
            lambda: _claim_here(cfg, is_main, held, named=named, stages=stages, created=created),
            follow,
            timeout_s,
            keys=_compared_keys(cfg),
            # checkpoints are written (and a resume read) by every process into the one folder
            shared=bool(cfg.checkpoint_every or cfg.resume) and not cfg.compile_only,
        )
    except ConfigError:
        for folder in created:
            _drop_bare(folder)
        held.close()
        raise


# Keys each process may hold its own value of: its id, the name process 0 chooses for all, how
# it reaches the coordinator and how long it waits, and the path it sees the run folders at
# (one shared mount may have other names on other hosts)
PER_PROCESS_KEYS = ("process_id", "name", "coordinator", "coordinator_timeout", "out_dir")


def _compared_keys(cfg: Config) -> dict:
    """The resolved keys every process of a run must share, flat (the model's beside the run's),
    as JSON values."""
    import json

    flat = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "model"}
    flat |= dataclasses.asdict(cfg.model)
    return {
        k: json.loads(json.dumps(v, default=str))
        for k, v in flat.items()
        if k not in PER_PROCESS_KEYS
    }


def _drop_bare(folder: Path) -> None:
    """Remove a folder this process made that holds nothing but its lock (kept otherwise)."""
    with contextlib.suppress(OSError):
        if {p.name for p in folder.iterdir()} <= {".lock", JOIN_FILE}:
            (folder / ".lock").unlink(missing_ok=True)
            (folder / JOIN_FILE).unlink(missing_ok=True)
            folder.rmdir()


def _claim_here(
    cfg: Config, is_main: bool, held: contextlib.ExitStack, *, named: bool, stages, created=None
):
    base = cfg.name
    for n in range(2, 1002):
        if created is not None and is_main:  # made here, by this process, or not recorded
            writable_dir(cfg.out_dir)
            with contextlib.suppress(FileExistsError):
                (Path(cfg.out_dir) / cfg.name).mkdir()
                created.append(Path(cfg.out_dir) / cfg.name)
        if not is_main:
            return cfg, _open_run_dir(cfg, is_main, stages)
        try:
            # the lock first where it can be taken: a folder whose run is still starting (no
            # config.json yet) is in use, not a folder with no run to resume
            here = Path(cfg.out_dir) / cfg.name
            locked = here.is_dir() and os.access(here, os.W_OK | os.X_OK)
            if locked:
                held.enter_context(checkpoint.Lock(here))
            run_dir = _open_run_dir(cfg, is_main, stages)
            if not locked:
                held.enter_context(checkpoint.Lock(run_dir))
            if not named or not (cfg.resume or cfg.overwrite):
                # under the lock: no run can start in between
                rundir.check_fresh(run_dir, compile_only=cfg.compile_only)
            return cfg, run_dir
        except ConfigError:
            if named:
                raise
            held.close()  # the lock, if it was taken: the folder is another run's
            cfg = dataclasses.replace(cfg, name=f"{base}-{n}")
    raise ConfigError(f"{Path(cfg.out_dir) / base}-…: a thousand runs of that name; give name=")


def _clear_earlier(cfg: Config, run_dir: Path, console) -> None:
    """overwrite=true, once the step has compiled and fits (never for a run that is refused):
    the earlier run is cleared."""
    if cfg.overwrite and rundir.clear(run_dir):
        console.print(
            f"overwrite=true: cleared the earlier run from {run_dir}", markup=False, soft_wrap=True
        )


def _write_config(cfg: Config, run_dir: Path, request: Request, stages: int) -> None:
    """This run's config.json, the last write of its start (a start refused before it leaves
    the keys a later resume takes as they were): the resolved config, and under `request` the
    keys it was asked with (what a resume takes again: Request.resumed)."""
    try:
        asked = rundir.asked_keys(request.dict())
        # and the values the backend's defaults gave (a resume elsewhere keeps them)
        asked |= {k: getattr(cfg, k) for k in BACKEND_KEYS if k not in asked}
        order = block_order(stages, cfg.model.pipeline_repeats)
        kept = {**dataclasses.asdict(cfg), "request": asked, "block_order": order}
        older = _older_steps_layout(cfg, run_dir)
        if older is not None:  # steps that keep no layout of their own: theirs, kept here
            kept["older_steps_layout"] = older.record()
        rundir.write_json(run_dir / "config.json", kept)
    except OSError as e:
        raise _start_failure(e, run_dir) from None


def _older_steps_layout(cfg: Config, run_dir: Path):
    """For a resume whose folder holds steps saved before steps kept their layout: their
    layout, read from the config.json this start replaces (lab.train.config_layout), or
    None."""
    if not cfg.resume or not _older_steps(run_dir):
        return None
    try:
        return config_layout(rundir.saved_config(run_dir))
    except ConfigError:
        return None


def refused_resume(cfg: Config, run_dir: Path) -> None:
    """ConfigError for a resume refused by what the folder holds, where its checkpoint steps
    alone decide it, before the header and the compile: no checkpoint, or one that every step
    saved would refuse (_check_resumed_at). A restore may pass over a damaged newest step to
    an older one, so a refusal that depends on the step is checked again once it is known."""
    if not cfg.resume or cfg.compile_only:
        return
    saved = checkpoint.saved_steps(run_dir)
    if not saved:
        raise _nothing_to_resume(run_dir)
    try:
        _check_resumed_at(cfg, saved[0])
    except ConfigError:  # refused from the oldest step, so from every newer one too:
        _check_resumed_at(cfg, saved[-1])  # said for the step a restore takes first
        raise


def _check_resumed_at(cfg: Config, step: int) -> None:
    """ConfigError where a resume from checkpoint `step` cannot run what was asked: steps=
    not past it, or profile=true whose window lies past steps=."""
    rundir.check_steps(step, cfg.steps)
    first, last = profile_window(step)
    if cfg.profile and cfg.steps < last:
        raise ConfigError(
            f"profile=true traces steps {first}-{last} after resuming from checkpoint step "
            f"{step} (after the warm-up), and steps={cfg.steps} ends before them: give "
            f"steps >= {last}"
        )


def _run(cfg, info, trainer, run_dir: Path, is_main: bool, request: Request, started) -> int:
    """The run in its claimed folder; `started()` once it starts (config.json written): the
    libraries' lines held until then go to lab.log."""
    console = progress.console(quiet=not is_main)
    n_params = sum(x.size for x in jax.tree.leaves(trainer.abstract_state.params))
    console.print(
        tables.run_header(
            cfg,
            info,
            n_params,
            dict(trainer.mesh.shape),
            attention_note=trainer.attention_note,
            offloaded=trainer.resolved is None or trainer.resolved.offload_optimizer,
            split=split_words(cfg.strategy, dict(trainer.mesh.shape)),
        ),
        soft_wrap=not console.is_terminal,  # a log's line stays whole (the launcher's [pN])
    )
    for note in trainer.notes:  # what the compiled program does not do that was asked for
        console.print(f"  note      [yellow]{note}", soft_wrap=not console.is_terminal)
    # the compiled step's memory is checked before the state is made: a model the host cannot
    # hold is refused in one line, not killed by the kernel while its weights are drawn
    analysis, compiled, compile_s = _analyse(cfg, info, trainer, console)
    state, start, changed = (
        (None, 0, "") if cfg.compile_only else _restore(cfg, trainer, run_dir, is_main, console)
    )
    stages = dict(trainer.mesh.shape).get(STAGE, 1)

    def begin():  # config.json last: a start refused before it keeps the keys as they were
        _write_config(cfg, run_dir, request, stages)
        started()
        ckpt = f" and checkpoint step {start}" if start else ""
        startup.note(f"before training: {run_dir} keeps this run's config.json{ckpt}")

    if is_main:
        _clear_earlier(cfg, run_dir, console)
    if cfg.compile_only:
        if is_main:
            begin()
        console.print(tables.analysis(StepAnalysis.from_record(analysis), compile_s))
        if analysis.get("aot", {}).get("kernels"):
            title = f"GPU kernels of one step ({info.device_kind}): compiled, not run"
            aot = analysis["aot"]  # as summary.json holds it: read back into the types
            kernels = [Kernel.from_record(k) for k in aot["kernels"]]
            tc = Toolchain.from_record(aot["toolchain"]) if aot.get("toolchain") else None
            console.print(tables.kernels(kernels, title, tc))
        if is_main:
            _write_summary(run_dir, {"compile_s": compile_s, **analysis})
        return 0
    gaps, events = "", None
    if is_main:
        try:
            # the new event file first: a folder it cannot be written in is refused before
            # metrics.jsonl moves a line
            metrics, _ = rundir.read_metrics(run_dir / "metrics.jsonl")
            events = tensorboard.start(run_dir, [r for r in metrics if r["step"] <= start], start)
            torn, missing = rundir.keep_metrics_before(run_dir, start, cfg.log_every)
        except OSError as e:
            raise _start_failure(e, run_dir) from None
        if start and not (run_dir / "metrics.jsonl").exists():  # deleted: said, not passed over
            gaps = rundir.step_ranges(range(1, start + 1))  # and in the last line's 'kept'
            console.print(
                f"metrics.jsonl: none in {run_dir}; the records of steps 1-{start} are missing "
                f"(this run logs from step {start + 1})",
                **PLAIN,
            )
        if torn:
            gaps = rundir.step_ranges(missing)
            records = (
                f"the record of step {gaps} is"
                if len(missing) == 1
                else f"the records of steps {gaps} are"
            )
            lost = f"{records} missing" if missing else "no record is missing"
            lines = f"{torn} lines that are" if torn > 1 else "a line that is"
            aside = run_dir / "metrics-torn.jsonl"
            console.print(
                f"metrics.jsonl: {lines} not a whole record (torn mid-write) set aside in "
                f"{aside}; {lost}",
                **PLAIN,
            )
    # one peak for the run's MFU, its records' and its summary's (a resume keeps the first's)
    # (process 0's alone: the others write no records or summary, and N processes of one host
    # measuring the peak at once would each see 1/N of it)
    peak = (
        summary.run_peak(cfg, info, analysis["devices"], run_dir if start else None)
        if is_main
        else (None, "")
    )
    try:
        mngr = checkpoint.manager(run_dir) if (cfg.checkpoint_every or cfg.resume) else None
        log = rundir.MetricsLog(run_dir / "metrics.jsonl") if is_main else None
        if log:
            log.gaps = gaps
        records = _records(cfg, analysis, events, log, peak[0], start) if is_main else None
    except OSError as e:
        raise _start_failure(e, run_dir) from None
    if is_main:
        begin()
    saver = checkpoint.Saver(mngr, trainer.layout.record()) if mngr else None
    on_peer_lost(lambda: _kept(cfg, run_dir, log, saver) if is_main else "")
    hist = History(step=start)
    end = _End(
        cfg,
        info,
        analysis,
        compile_s,
        run_dir,
        is_main,
        console,
        hist,
        saver,
        log,
        start=start,
        peak=peak,
    )
    events = records.events if records else contextlib.nullcontext()

    def after() -> str:  # a signal once the loop has left: its handler was the startup's again
        return f"after training: {_kept(cfg, run_dir, log, saver)}"

    with _Stop(final=end.final) as stop, log or contextlib.nullcontext(), events:
        try:
            end.why = _train(
                cfg, trainer, compiled, state, start, saver, records, console, hist, stop, changed
            )
        except (OSError, checkpoint.SaveError) as e:
            end.failed = _write_failure(e, run_dir)
        except BaseException as e:  # a fault of the lab's own: its traceback, after the save
            left_loop()  # in flight; a collective that failed with a peer gone: one line
            startup.note(after)
            if why := peer_gone(e):
                leave_now(why)
            end.finish_saves()
            raise
        left_loop()
        startup.note(after)
        end.write_summary()
        end.finish_saves()
        return end.report(stop.signal)


def _summary_whole(run_dir: Path, result: dict) -> None:
    """summary.json and records.jsonl, each replaced whole or not at all: written in a staging
    folder named like the run (the records carry its name), then renamed into the run folder.
    OSError for the caller; a full disk leaves the earlier files, never torn ones."""
    staging = run_dir / ".summary-staging" / run_dir.name
    try:
        staging.mkdir(parents=True, exist_ok=True)
        summary.write_summary(staging, result)
        for name in ("records.jsonl", "summary.json"):  # summary.json last: it says done
            if (staging / name).exists():
                (staging / name).replace(run_dir / name)
            else:  # as write_summary itself leaves it: a run's figures, not an earlier run's
                (run_dir / name).unlink(missing_ok=True)
    finally:
        shutil.rmtree(staging.parent, ignore_errors=True)


def _keep_superseded_summary(run_dir: Path) -> None:
    """The summary.json and records.jsonl in `run_dir` (an earlier segment's, which a resume's
    summary replaces), if any, as one line of
    summaries-superseded.jsonl (`summary`: summary.json's table, or its text where it is not
    JSON; `records`: records.jsonl's lines, each a table or the text of a line that is not).
    The line has no `what`: readers of records (the runbook) pass it over."""
    old = run_dir / "summary.json"
    if not old.exists():
        return
    text = old.read_text(errors="replace")
    try:
        earlier = json.loads(text)
    except ValueError:
        earlier = text
    lines = []
    records = run_dir / "records.jsonl"
    if records.exists():
        for line in records.read_text(errors="replace").splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                lines.append(line)
    kept = {"superseded": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "summary": earlier}
    keep = rundir.WholeAppends(run_dir / "summaries-superseded.jsonl")
    try:
        keep.append((json.dumps({**kept, "records": lines}) + "\n").encode())
    finally:
        keep.close()


def _write_summary(run_dir: Path, result: dict) -> None:
    try:
        _summary_whole(run_dir, result)
    except OSError as e:
        raise RunError(_write_failure(e, run_dir)) from None


_DEFAULT_OUT_DIR = {f.name: f.default for f in dataclasses.fields(Config)}["out_dir"]


@dataclasses.dataclass
class _End:
    """How a run that entered the loop ends: its summary, its last save, one line."""

    cfg: Config
    info: object
    analysis: dict
    compile_s: float
    run_dir: Path
    is_main: bool
    console: object
    hist: History
    saver: checkpoint.Saver | None
    log: rundir.MetricsLog | None
    why: str | None = None  # a signal's name, or a non-finite value's line
    failed: str | None = None  # the first write that failed
    summary_written: bool = False
    earlier_kept: bool = False  # the summary the run folder held before this process's, kept
    start: int = 0  # the checkpoint step a resumed run started from
    peak: tuple | None = None  # (FLOP/s, source) of the run's MFU (summary.run_peak)

    def _result(self) -> dict:
        hist = self.hist
        # a run of WARMUP_STEPS steps or fewer has only warm-up steps to time: their times
        # stand in, and the summary says so beside every figure derived from them
        steady = hist.step_s[WARMUP_STEPS:]
        times = summarise(steady or hist.step_s or [math.nan], self.compile_s)
        return summary.summarise_run(
            self.cfg,
            self.info,
            self.analysis,
            times,
            hist.losses,
            self._earlier_losses(),
            resumed_from=self.start,
            peak=self.peak,
            profiled=hist.profiled,
            save_s=hist.save_s,
            warmup_timed=not steady and bool(hist.step_s),
        )

    def _earlier_losses(self) -> list:
        """(step, loss) metrics.jsonl keeps from before this process's first step (a resume's
        earlier segments); [] for a fresh run or an unreadable file."""
        first = self.hist.losses[0][0] if self.hist.losses else None
        if not self.is_main or first is None or first <= 1:
            return []
        try:
            records, _ = rundir.read_metrics(self.run_dir / "metrics.jsonl")
        except (OSError, ValueError):
            return []
        return sorted(
            (r["step"], r["loss"])
            for r in records
            if isinstance(r.get("step"), int) and r["step"] < first and "loss" in r
        )

    def write_summary(self, *, show: bool = True) -> None:
        result = self._result()
        if show:
            self.console.print(tables.run_summary(RunSummary.from_record(result)))
        if self.is_main:
            try:
                if not self.earlier_kept:  # once: a retry must not keep this run's own
                    _keep_superseded_summary(self.run_dir)
                    self.earlier_kept = True
                _summary_whole(self.run_dir, result)
                self.summary_written = True
            except OSError as e:
                self.failed = self.failed or _write_failure(e, self.run_dir)

    def finish_saves(self) -> None:
        if self.saver:
            try:
                self.saver.finish()
            except checkpoint.SaveError as e:
                self.failed = self.failed or str(e)

    def report(self, signal_name: str | None) -> int:
        kept = _kept(self.cfg, self.run_dir, self.log, self.saver)
        step = self.hist.step
        if self.failed:
            ended = "ended" if step == self.cfg.steps else "stopped"
            if why := peer_gone(self.failed):  # a save's collective: one line, no exit barrier
                what = self.failed.split(" (", 1)[0]  # checkpoint step N could not be saved in …
                leave_now(f"{why}; {what}; training {ended} at step {step}")
            raise RunError(f"{self.failed}: training {ended} at step {step}; {kept}")
        if self.why and not self.why.startswith("SIG"):  # a non-finite loss or norm
            raise RunError(f"{self.why}; {kept}{self.go_on_after_nan()}")
        if signal_name:
            saved = checkpoint.saved_steps(self.run_dir)
            if self.saver and saved and saved[-1] == step:
                self.console.print(
                    f"{signal_name}: checkpoint saved at step {step} — {kept}", **PLAIN
                )
            else:
                self.console.print(f"{signal_name}: stopped at step {step}; {kept}", **PLAIN)
        if self.is_main:
            self.console.print(f"run folder: {self.run_dir}", **PLAIN)
            if not signal_name:  # the last line of a finished run too: what the folder keeps
                self.console.print(f"finished at step {step}; {kept}", **PLAIN)
            else:  # the last line of a stopped run: how to go on
                self.console.print(self.go_on(), markup=False, highlight=False, soft_wrap=True)
        return {None: 0, "SIGINT": 130, "SIGTERM": 143}[signal_name]

    def go_on_after_nan(self) -> str:
        """ "; to go on from checkpoint step N …": the command that resumes a run stopped by a
        non-finite loss or norm with half its learning rate (a resume as it was would repeat
        the same steps to the same overflow; a resume may change lr=); "" where there is no
        checkpoint, or where the first step after a resume failed (that line names the
        checkpoint as the suspect)."""
        saved = checkpoint.saved_steps(self.run_dir)
        if "the first after resuming" in (self.why or ""):  # the checkpoint is the suspect
            step = int(self.why.split("resuming from checkpoint step ")[1].split(":")[0])
            if any(s < step for s in saved):
                return (
                    f" (to resume from the one before, move checkpoints/{step} out of the run "
                    "folder)"
                )
            return f" (checkpoint {step} is the run's oldest: none before it to resume from)"
        if not saved:
            return ""
        line = self.go_on(extra=(f"lr={self.cfg.lr / 2:g}",))
        return "; " + line.replace("to resume from", "to go on with half the learning rate from", 1)

    def go_on(self, extra: tuple[str, ...] = ()) -> str:
        """How a stopped run goes on, read from the folder: the command that resumes it from
        its newest checkpoint (resume=true takes the keys config.json keeps, so the folder's
        name= and out_dir= are all it needs, with any `extra` keys that change on the way),
        or why there is nothing to resume."""
        saved = checkpoint.saved_steps(self.run_dir)
        if not saved:
            every = self.cfg.checkpoint_every
            why = f"none saved yet, every {every} steps" if every else "checkpoint_every=0"
            return (
                f"nothing to resume: no checkpoint ({why}); a run started again with "
                "checkpoint_every=N keeps one every N steps"
            )
        keys = [f"name={self.cfg.name}"]
        if self.cfg.out_dir != _DEFAULT_OUT_DIR:
            keys.append(f"out_dir={self.cfg.out_dir}")
        keys += ["resume=true", *extra]
        further = ""
        if saved[-1] >= self.cfg.steps:  # at its end: a resume needs steps= past it
            keys.append("steps=N")
            further = f" (N > {self.cfg.steps}: the run reached its steps={self.cfg.steps})"
        if self.info.process_count > 1:  # how the processes start is never inherited
            return (
                f"to resume from checkpoint step {saved[-1]}: start the same processes again "
                f"(lab.tools.launch, srun, or lab.run on each machine) with "
                f"{shlex.join(keys)}{further}"
            )
        command = shlex.join(["python", "-m", "lab.run", *keys])
        return f"to resume from checkpoint step {saved[-1]}: {command}{further}"

    def final(self, signal_name: str) -> None:
        """A second signal: one line on what is left unfinished, before the process exits."""
        pending = self.saver.pending if self.saver else None
        if pending in checkpoint.saved_steps(self.run_dir):
            pending = None  # it completed before the signal: the kept list names it
        left = (
            f"checkpoint step {pending} was not finished (its temporary folder is removed at "
            "the next start); "
            if pending is not None
            else ""
        )
        if self.is_main and not self.summary_written:
            self.write_summary(show=False)  # the figures of the steps run, in milliseconds
        kept = _kept(self.cfg, self.run_dir, self.log, self.saver)
        go_on = f"; {self.go_on()}" if self.is_main else ""
        print(f"{signal_name} again: exiting at once; {left}{kept}{go_on}", file=sys.stderr)

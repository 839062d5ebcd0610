"""Progress bars and the console every command prints through (rich)."""

import contextlib
import datetime
import errno
import math
import os
import sys
import threading
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from lab.report.format import duration

# the output cannot take more: its reader went away (a pipe, a socket), its terminal hung up
# (EIO), or the file or disk it goes to is full (ENOSPC, EDQUOT, EFBIG)
_LOST = (errno.EPIPE, errno.ECONNRESET, errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class _Unread:
    """A text stream that goes quiet, instead of raising, once nobody reads it or it can take
    no more: a run whose launcher (or terminal, or `| head`) went away, or whose log's disk
    filled up, must still finish its step and save its checkpoint, and an error raised from a
    print would lose both."""

    def __init__(self, stream):
        self._stream, self._gone = stream, False

    def _lost(self) -> None:
        self._gone = True
        try:  # the runtime's own C++ logging writes to the descriptor, not through Python
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
        except (OSError, ValueError):
            pass

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except OSError as e:
                if e.errno not in _LOST:
                    raise
                self._lost()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except OSError as e:
                if e.errno not in _LOST:
                    raise
                self._lost()

    def isatty(self) -> bool:
        return not self._gone and self._stream.isatty()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def survive_lost_output() -> None:
    """Keep stdout and stderr writable for the whole process even after their reader is gone
    (called first by the long-running commands)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Unread):
            setattr(sys, name, _Unread(stream))


def wrapped_like(old, stream):
    """`stream` as `old` is kept: quiet once nobody reads it where `old` was made so
    (survive_lost_output), else as it is."""
    return _Unread(stream) if isinstance(old, _Unread) else stream


def console(*, quiet: bool = False, width: int | None = None) -> Console:
    """The terminal: `quiet` for the processes of a multi-host run other than the first. Output
    that is not a terminal (a log, a pipe) gets 120 columns: tables stay readable."""
    width = width or (None if sys.stdout.isatty() else 120)
    # emoji=False: ':b:' in a user's path is not an emoji (name=a:b printed a🅱)
    return Console(quiet=quiet, width=width, emoji=False)


class _Known(ProgressColumn):
    """A field of the task in `words` ("loss {}"), shown as "–" until it is known (None, or
    NaN): a bar that has not read a step yet has no loss to show."""

    def __init__(self, name: str, words: str, spec: str):
        super().__init__()
        self.name, self.words, self.spec = name, words, spec

    def render(self, task) -> Text:
        value = task.fields.get(self.name)
        known = value is not None and not (isinstance(value, float) and math.isnan(value))
        return Text(self.words.format(format(value, self.spec) if known else "–"))


def _clock(seconds: float | None) -> str:
    """Seconds as h:mm:ss (the bar's own form), "–" where not known."""
    if seconds is None or not math.isfinite(seconds):
        return "–"
    return str(datetime.timedelta(seconds=round(max(seconds, 0.0))))


def step_line(step, total, loss, tokens_per_s, step_s, elapsed_s, left_s) -> str:
    """One step as a plain line (what the bar shows): 'step 20/300  loss 5.1234  29,047
    tok/s  8.81 ms/step  elapsed 0:00:01  left 0:00:25'."""
    return (
        f"step {step}/{total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  "
        f"{duration(step_s)}/step  elapsed {_clock(elapsed_s)}  left {_clock(left_s)}"
    )


class _Training(Progress):
    """The training bar. Where the output is not a terminal (a log, a pipe, a batch job's
    file: no live bar), each logged step is one plain line instead, flushed as it is printed,
    so a log of a long run shows it is alive and where it is."""

    def add_task(self, description, *, total, completed=0, **fields):
        task = super().add_task(
            description, total=total, completed=completed, loss=None, tps=None, **fields
        )
        self._lab_from = getattr(self, "_lab_from", {}) | {task: completed}
        return task

    def step(self, task_id, step: int, loss: float, tps: float, step_s: float, *, logged: bool):
        """Step `step` is read: the bar moves; off a terminal, a line where `logged`. The
        time left is the time per step so far this run (its checkpoint saves included)."""
        self.update(task_id, completed=step, loss=loss, tps=tps)
        if not logged or self.console.is_terminal:
            return
        task = self._tasks[task_id]
        elapsed = task.elapsed or 0.0
        done = step - self._lab_from[task_id]
        left = elapsed / done * (task.total - step) if done > 0 else None
        line = step_line(step, int(task.total), loss, tps, step_s, elapsed, left)
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)


def training(con: Console) -> _Training:
    """step n/N, the bar, the loss, tokens/s and the time left (fields: loss, tps; each "–"
    until the first step is read); off a terminal, a line per logged step (`_Training`)."""
    return _Training(
        TextColumn("step {task.completed:>5}/{task.total}"),
        BarColumn(),
        _Known("loss", "loss {}", ".4f"),
        _Known("tps", "{} tok/s", ",.0f"),
        TimeRemainingColumn(),
        console=con,
        transient=False,
        disable=not con.is_terminal,
    )


class _Tasks(Progress):
    """A Progress that, where the output is not a terminal (a log, a pipe: no live bar), prints
    one line as each named step starts, so a long sweep's log says where it is."""

    def update(self, task_id, *, description=None, **kwargs):
        super().update(task_id, description=description, **kwargs)
        if description is None or self.console.is_terminal:
            return
        task = self._tasks[task_id]
        if getattr(task, "_lab_said", None) != description:
            task._lab_said = description
            total = f"/{task.total:g}" if task.total else ""
            self.console.print(
                f"{description} ({task.completed:g}{total} done, {task.elapsed or 0:.0f} s)",
                soft_wrap=True,
            )


@contextlib.contextmanager
def working(con: Console, what: str):
    """Work without steps to count (a few seconds to a minute): a spinner with `what` and the
    time on a terminal; off one, `what` as a line when it starts."""
    if not con.is_terminal:
        con.print(what)
        yield
        return
    t0 = time.perf_counter()
    with con.status(what) as status:
        stop = threading.Event()

        def tick():  # the elapsed seconds beside the spinner
            while not stop.wait(1.0):
                status.update(f"{what} ({time.perf_counter() - t0:.0f} s)")

        clock = threading.Thread(target=tick, daemon=True)
        clock.start()
        try:
            yield
        finally:
            stop.set()


def label(text: str, width: int = 60) -> str:
    """`text` for a bar's description, at most `width` characters: cut after the last whole
    word ("measure model=small mesh=2x2x2 …"), never inside a key's value."""
    if len(text) <= width:
        return text
    head = text[: width - 2]
    return head.rsplit(" ", 1)[0] + " …" if " " in head else text[: width - 1] + "…"


def tasks(con: Console) -> Progress:
    """A named task out of several, with elapsed time (the ledger's modules, a sweep's points);
    off a terminal, a line as each starts."""
    return _Tasks(
        TextColumn("{task.description:<28}"),
        BarColumn(),
        MofNCompleteColumn(),  # "3/?" where the count is not known ahead
        TimeElapsedColumn(),
        console=con,
    )


@contextlib.contextmanager
def counted(con: Console, what: str, total: int):
    """`tasks` over `total` steps, yielding `tick(label)` to call as each step starts (the ones
    before it are then done): the label, n/N and the time elapsed; off a terminal, a line
    per step ("L=S=512 causal=yes fwd (3/8 done, 12 s)")."""
    with tasks(con) as bar:
        task = bar.add_task(what, total=total)
        started = []

        def tick(label: str) -> None:
            bar.update(task, description=label, completed=len(started))
            started.append(label)

        yield tick
        bar.update(task, completed=total)


def lines(con: Console):
    """A function that prints one plain line of progress (no markup, no source location, not
    cut at the console's width): for steps a caller cannot count ahead."""

    def say(text: str) -> None:
        con.print(text, markup=False, highlight=False, soft_wrap=True)

    return say

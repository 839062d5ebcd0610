"""Progress bars and the console every command prints through (rich)."""

import contextlib
import os
import sys
import threading
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class _Unread:
    """A text stream that goes quiet, instead of raising, once nobody reads it: a run whose
    launcher (or terminal, or `| head`) went away must still finish its step and save its
    checkpoint, and an error raised from a print would lose both."""

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
            except (BrokenPipeError, ConnectionResetError):
                self._lost()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except (BrokenPipeError, ConnectionResetError):
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


def console(*, quiet: bool = False, width: int | None = None) -> Console:
    """The terminal: `quiet` for the processes of a multi-host run other than the first. Output
    that is not a terminal (a log, a pipe) gets 120 columns: tables stay readable."""
    width = width or (None if sys.stdout.isatty() else 120)
    return Console(quiet=quiet, width=width)


def training(con: Console) -> Progress:
    """step n/N, the bar, the loss, tokens/s and the time left (fields: loss, tps)."""
    return Progress(
        TextColumn("step {task.completed:>5}/{task.total}"),
        BarColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[tps]:,.0f} tok/s"),
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
    per step ("L=S=512 causal=True fwd (3/8 done, 12 s)")."""
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

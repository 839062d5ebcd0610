"""Progress bars and the console every command prints through (rich)."""

import sys

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


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


def tasks(con: Console) -> Progress:
    """A named task out of several, with elapsed time (the ledger's modules, a sweep's points)."""
    return Progress(
        TextColumn("{task.description:<28}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=con,
    )

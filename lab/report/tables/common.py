"""Helpers the table modules share: the GiB constant and a byte count in MiB or n/a."""

from lab.report.format import mib

GIB = 2**30


def _mem(n) -> str:
    return "n/a" if n is None else f"{mib(n)} MiB"

"""The claims ledger's experiments: one module per topic, each answering some claim ids.

Every module declares `CLAIMS = ("C01", ...)` and `run(size) -> list[record]` with size
`tiny` (the test suite), `quick` (the default on CPU: the whole set well under 15 minutes on
two cores) or `full`; the modules in PLANNED also take `plans` (what is compiled for hardware
that is not here: C10, C14 from the compiler for H100s, and the programs behind the predicted
GPU and TPU figures). `python -m experiments` runs them and writes a results folder.
"""

import importlib
import re

from lab.config import did_you_mean
from lab.report.claims import BY_ID

MODULES = (
    "matmul",
    "roofline",
    "attention",
    "memory",
    "parallel",
    "training",
    "inference",
    "hardware",
    "prediction",
)

# Modules whose run() also takes `plans`: the 7B/70B steps compiled for H100s (gpu_plans.py)
# and the programs the step-time model predicts GPUs from (lab.predict), slow enough
# (minutes) to stay out of the tiny and quick ledgers unless asked for.
PLANNED = (
    "roofline",
    "memory",
    "parallel",
    "inference",
    "training",
    "matmul",
    "hardware",
    "prediction",
)


def plan_kwargs(name: str, plans: str, size: str) -> dict:
    """`run()`'s extra keywords for module `name`: plans=on|off, or auto (on with size=full)."""
    if name not in PLANNED:
        return {}
    return {"plans": plans == "on" or (plans == "auto" and size == "full")}


def load(name: str):
    return importlib.import_module(f"experiments.{name}")


def parse_only(text: str | None) -> tuple[str, ...] | None:
    """'C03,c8,C03' → ('C03', 'C08'): each id once, in the order given, the number's zero
    optional; unknown ids are an error naming the known ones (and the close match)."""
    if not text:
        return None
    ids = []
    for x in (x.strip().upper() for x in text.split(",")):
        m = re.fullmatch(r"C?0*(\d{1,2})", x)
        x = f"C{int(m.group(1)):02d}" if m else x
        if x and x not in ids:
            ids.append(x)
    bad = [x for x in ids if x not in BY_ID]
    if bad:
        hint = did_you_mean(bad[0], BY_ID)
        raise ValueError(
            f"only={text!r}: unknown claim id{'s' if len(bad) > 1 else ''} "
            f"{', '.join(bad)}{hint}; known: {', '.join(BY_ID)}"
        )
    return tuple(ids)


def select(only: tuple[str, ...] | None) -> list[str]:
    """Module names whose claims meet `only` (all when None), in report order. Read from the
    claims table, so choosing costs no imports (each module pulls in JAX pieces of its own)."""
    wanted = {BY_ID[i].topic for i in only} if only else set(MODULES)
    return [m for m in MODULES if m in wanted]

"""Verdicts from records alone: each stated range of a claim against the records that answer it.

A record answers a stated part when its `config` names the claim (`claim`) and the part
(`metric`). What it can decide depends on how it was obtained:

  label measured / compiled / derived  on a backend it is about     → holds | off
  label predicted / compiled, not run                              → predicted (in range or not)
  anything else (another backend, `role` context/reference, no value) → n/a here

A record whose config says its value is a bound (`bound`: "upper", the true value is at most
it; "lower", at least) decides only where the bound does: an upper bound below the range is
off, one inside a range with a floor decides nothing (the true value may lie under the floor),
and such a record is shown as context.

The claim's verdict is `off` if any measured part is off, `holds` if measured parts exist
and all hold, else `predicted` if some part has a prediction, else `n/a here`. A claim with no
record at all gets no verdict (`no record`): nothing here can produce one from constants.
"""

import dataclasses
import math
from collections.abc import Sequence

from lab.report.claims import CLAIMS, Claim, Stated

HOLDS, OFF, PREDICTED, NA, MISSING = "holds", "off", "predicted", "n/a here", "no record"
STATUSES = (HOLDS, OFF, PREDICTED, NA, MISSING)
EVIDENCE_LABELS = ("measured", "compiled", "derived")
PREDICTION_LABELS = ("predicted", "compiled, not run")


@dataclasses.dataclass(frozen=True)
class Reading:
    """One record held against its range."""

    index: int  # position of the record in the list judged
    record: dict
    lo: float | None
    hi: float | None
    in_range: bool
    factor: float | None  # how many times outside the range (None when inside)
    direction: str  # "", "above" or "below"


@dataclasses.dataclass(frozen=True)
class Check:
    """One stated part of a claim, judged."""

    stated: Stated
    status: str  # one of STATUSES
    readings: tuple[Reading, ...]  # the records that decided it (evidence or predictions)
    context: tuple[int, ...]  # indices of records shown but unable to decide it


@dataclasses.dataclass(frozen=True)
class Verdict:
    claim: Claim
    status: str
    checks: tuple[Check, ...]
    records: tuple[int, ...]  # every record of this claim (indices into the list judged)


def backend_of(record: dict) -> str:
    """Where the figure was measured: config.on (a CPU measured from a GPU process), else the
    process's backend."""
    return record.get("config", {}).get("on") or record.get("backend", "")


def target_of(record: dict) -> str:
    """The device a figure is about: config.target (predictions), else the device measured."""
    return record.get("config", {}).get("target") or record.get("device_kind", "")


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def within(value: float, lo: float | None, hi: float | None, strict: bool) -> bool:
    above_lo = lo is None or (value > lo if strict else value >= lo)
    below_hi = hi is None or (value < hi if strict else value <= hi)
    return above_lo and below_hi


def outside(value: float, lo, hi, strict: bool) -> tuple[float | None, str]:
    """(factor, direction) of a value outside [lo, hi]; (None, '') inside."""
    if within(value, lo, hi, strict):
        return None, ""
    if hi is not None and value >= hi:
        return (value / hi if hi > 0 else math.inf), "above"
    return (lo / value if value > 0 else math.inf), "below"


def decides(value: float, lo, hi, bound: str | None) -> bool:
    """Whether a value that is an upper or lower `bound` of the true one settles the range:
    the whole of what the true value may be lies inside it, or the whole outside."""
    if bound == "upper":  # true value in (-inf, value]
        return (lo is not None and value < lo) or (lo is None and (hi is None or value <= hi))
    if bound == "lower":  # true value in [value, inf)
        return (hi is not None and value > hi) or (hi is None and (lo is None or value >= lo))
    return True


def _reading(index: int, record: dict, bounds, strict: bool) -> Reading:
    value = _number(record["value"])
    lo, hi = bounds
    factor, direction = outside(value, lo, hi, strict)
    return Reading(index, record, lo, hi, factor is None, factor, direction)


def judge_stated(stated: Stated, indexed: Sequence[tuple[int, dict]]) -> Check:
    """Judge one stated part from the (index, record) pairs carrying its metric."""
    evidence, predictions, context = [], [], []
    for i, r in indexed:
        cfg = r.get("config", {})
        bounds = stated.range_for(target_of(r))
        value = _number(r.get("value"))
        usable = (
            value is not None
            and cfg.get("role", "evidence") == "evidence"
            and bounds is not None
            and decides(value, *bounds, cfg.get("bound"))
        )
        if usable and r.get("label") in EVIDENCE_LABELS and backend_of(r) in stated.backends:
            evidence.append(_reading(i, r, bounds, stated.strict))
        elif usable and r.get("label") in PREDICTION_LABELS:
            predictions.append(_reading(i, r, bounds, stated.strict))
        else:
            context.append(i)
    if evidence:
        status = HOLDS if all(x.in_range for x in evidence) else OFF
        return Check(
            stated, status, tuple(evidence), tuple(context + [x.index for x in predictions])
        )
    if predictions:
        return Check(stated, PREDICTED, tuple(predictions), tuple(context))
    return Check(stated, NA if indexed else MISSING, (), tuple(context))


def unjudged_parts(v: Verdict) -> str:
    """Where a claim holds on some of its stated parts and others could not be judged here
    (n/a on this backend, only predicted, no record): "2 of 3 parts; flash ÷ naive speed n/a
    here" (each part by its name),
    so that "holds" is never read as every part measured; "" where every part was judged."""
    if v.status != HOLDS:
        return ""
    rest = [c for c in v.checks if c.status != HOLDS]
    if not rest:
        return ""
    left = ", ".join(f"{c.stated.name or c.stated.metric} {c.status}" for c in rest)
    return f"{len(v.checks) - len(rest)} of {len(v.checks)} parts; {left}"


def judge(claim: Claim, records: Sequence[dict]) -> Verdict:
    """The verdict on one claim from the records (any order, any backends, merged or not)."""
    mine = [(i, r) for i, r in enumerate(records) if r.get("config", {}).get("claim") == claim.id]
    checks = tuple(
        judge_stated(s, [(i, r) for i, r in mine if r["config"].get("metric") == s.metric])
        for s in claim.stated
    )
    # a part that only another backend can test reads n/a where the claim's records are all
    # from backends it does not take (an H100's L2 on a CPU), not "no record"
    present = {backend_of(r) for _, r in mine}
    checks = tuple(
        dataclasses.replace(c, status=NA)
        if c.status == MISSING and present and not present & set(c.stated.backends)
        else c
        for c in checks
    )
    statuses = {c.status for c in checks}
    if not mine:
        status = MISSING
    elif OFF in statuses:
        status = OFF
    elif HOLDS in statuses:
        status = HOLDS
    elif PREDICTED in statuses:
        status = PREDICTED
    else:
        status = NA
    return Verdict(claim, status, checks, tuple(i for i, _ in mine))


def judge_all(records: Sequence[dict], claims: Sequence[Claim] = CLAIMS) -> list[Verdict]:
    return [judge(c, records) for c in claims]

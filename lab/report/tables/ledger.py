"""The claims ledger's verdicts in the terminal."""

from rich.table import Table

from lab.report.verdict import (
    EVIDENCE_LABELS,
    OFF,
    PREDICTED,
    PREDICTION_LABELS,
    unjudged_parts,
)


def off_by(v) -> str:
    """How far the furthest measurement of an `off` claim, or the furthest prediction of a
    `predicted` one, lies outside its range, as REPORT.md says it: "×16 above"; empty for any
    other verdict, and for a prediction inside its range."""
    labels = {OFF: EVIDENCE_LABELS, PREDICTED: PREDICTION_LABELS}.get(v.status)
    if labels is None:
        return ""
    out = [
        x
        for c in v.checks
        if c.status == v.status
        for x in c.readings
        if x.factor is not None and x.record.get("label") in labels
    ]
    if not out:
        return ""
    worst = max(out, key=lambda x: x.factor)
    return f"×{worst.factor:,.3g} {worst.direction}"


def verdicts(
    vs, caution: str = "", *, judged: bool = True, tiny_only: frozenset = frozenset()
) -> Table:
    """The claims ledger's verdicts for the terminal; `caution` under them. Where the verdicts
    judge nothing (`judged=False`: a tiny size's check that the studies run) the title says so
    and no verdict is coloured as a pass or a failure; a claim in `tiny_only` (a comparison's
    claim that only tiny-size folders decide) says *size tiny only* and is not coloured
    either. An `off` says by how much; a claim that holds on some of its parts names the parts
    not judged here."""
    colours = {"holds": "green", "off": "red", "predicted": "yellow"} if judged else {}
    title = "claims ledger" if judged else "claims ledger: a smoke test, no claim judged"
    t = Table(title=title, caption=caution or None)
    # a smoke test's reading is no verdict: its column says so beside the title
    for col in ("id", "claim", "verdict" if judged else "read at size tiny (no verdict)"):
        t.add_column(col)
    for v in vs:
        tiny = v.claim.id in tiny_only
        colour = "dim" if tiny else colours.get(v.status, "dim")
        text = v.claim.text if len(v.claim.text) < 70 else v.claim.text[:67] + "…"
        part = unjudged_parts(v)  # holds on the parts judged: the rest said
        off = off_by(v) if judged else ""  # a smoke test's distances judge nothing either
        notes = [n for n in (off, part, "size tiny only" if tiny else "") if n]
        part = f" [dim]({'; '.join(notes)})[/dim]" if notes else ""
        t.add_row(v.claim.id, text, f"[{colour}]{v.status}[/{colour}]{part}")
    return t

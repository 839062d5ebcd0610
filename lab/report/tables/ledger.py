"""The claims ledger's verdicts in the terminal."""

from rich.table import Table

from lab.report.verdict import unjudged_parts


def verdicts(vs, caution: str = "", *, judged: bool = True) -> Table:
    """The claims ledger's verdicts for the terminal; `caution` under them. Where the verdicts
    judge nothing (`judged=False`: a tiny size's check that the studies run) the title says so
    and no verdict is coloured as a pass or a failure. A claim that holds on some of its parts
    names the parts not judged here."""
    colours = {"holds": "green", "off": "red", "predicted": "yellow"} if judged else {}
    title = "claims ledger" if judged else "claims ledger: a smoke test, no claim judged"
    t = Table(title=title, caption=caution or None)
    for col in ("id", "claim", "verdict"):
        t.add_column(col)
    for v in vs:
        colour = colours.get(v.status, "dim")
        text = v.claim.text if len(v.claim.text) < 70 else v.claim.text[:67] + "…"
        part = unjudged_parts(v)  # holds on the parts judged: the rest said
        part = f" [dim]({part})[/dim]" if part else ""
        t.add_row(v.claim.id, text, f"[{colour}]{v.status}[/{colour}]{part}")
    return t

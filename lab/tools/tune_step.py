"""`python -m lab.tools.tune_step model=1b remats=none,full batches=4,8,16`: which remat policy
and batch size give lab.run's step its highest MFU on this device?

For every (remat, batch_size) it compiles lab.run's real sharded step with the other keys as
given, refuses what does not fit the device's memory, times the rest, and prints tokens/s and
MFU (lab.run's convention), the winner and the `python -m lab.run` command that trains with it;
records go to out_dir. Takes the keys of lab.run that shape the step but remat, batch_size and
steps (those of a run's outputs, such as name= or profile=, are refused). See
lab/studies/step.py.
"""

import dataclasses
import functools
import sys

from lab import startup
from lab.config import cli, field
from lab.errors import ConfigError
from lab.measure import records as rec
from lab.names import REMATS
from lab.report import progress, tables
from lab.report.format import NOISE, key_args
from lab.studies import step


@dataclasses.dataclass(frozen=True)
class Options:
    remats: tuple = field(step.REMATS, "remat policies to try", kind="names", choices=REMATS)
    batches: tuple = field(step.BATCHES, "batch sizes to try", kind="ints", min=1)
    budget: float = field(5.0, "seconds of timed steps per candidate", min=0.01)
    out_dir: str = field("results", "folder for the records", kind="path")


def run(o: Options, keys: dict) -> int:
    rec.writable_dir(o.out_dir)  # refused before the work; the stem names the backend, and
    # asking for it starts JAX: it waits for the first session to size the (simulated) devices
    stem = functools.cache(lambda: rec.output_stem(o.out_dir, "tune_step"))
    con = progress.console(width=150)
    step.check_tune(keys)  # a key it cannot take: one line, before the host's load and the bar
    if busy := rec.busy_note():
        con.print(f"[yellow]{busy}")
    pending = []  # the candidates measured and not yet written

    def write(taken) -> None:
        path = rec.write_records(stem().with_suffix(".jsonl"), step.tune_records(taken, keys))
        startup.note(f"the candidates measured so far are in {path}")

    flush = startup.keep_on_stop(pending, write)
    with progress.counted(con, "remat × batch", len(o.remats) * len(o.batches)) as tick:
        rows = step.tune(keys, o.remats, o.batches, o.budget, log=tick, done=pending.append)
    top = step.best(rows)
    title = "remat × batch" + (f" · {top.device} · MFU: {top.convention}" if top else "")
    tied = step.as_good(rows, top)
    con.print(tables.tune_step(rows, top, title, tied))
    if top is not None and top.peak_flops:
        con.print(f"MFU against {top.peak_flops / 1e9:,.1f} GFLOP/s: {top.peak_source}")
    flush()
    if top is not None:
        rec.write_records(stem().with_suffix(".jsonl"), step.best_record(top, tied, keys))
    con.print(f"records → {stem().with_suffix('.jsonl')}", markup=False, soft_wrap=True)
    if top is None:
        # as lab.run's step that does not fit: the request, not the run, is at fault (exit 2)
        raise ConfigError("no candidate fits this device: try more devices or a smaller model")
    best = key_args({**keys, "remat": top.remat, "batch_size": top.batch})
    con.print(f"best: python -m lab.run {' '.join(best)}", soft_wrap=True)
    if tied:  # the medians name one; the spread says the others may be as good
        con.print(noise_line(tied), soft_wrap=True)
    return 0


def noise_line(tied: list) -> str:
    """The closing line for the candidates as good as the best within the run's noise: each
    one named (with their count where more than one)."""
    names = [f"remat={r.remat} batch_size={r.batch}" for r in tied]
    if len(names) == 1:
        who, other = f"{names[0]} is as good", "the other"
    else:
        who, other = f"{len(names)} others are as good ({', '.join(names)})", "any of them"
    return (
        f"within this run's noise ({NOISE}): {who}; the best is named for its higher median, "
        f"and a rerun may name {other}"
    )


def main(argv=None) -> int:
    return cli(
        Options, run, prog="python -m lab.tools.tune_step", doc=__doc__, argv=argv, run_keys=True
    )


if __name__ == "__main__":
    from lab.report.progress import survive_lost_output

    survive_lost_output()  # a reader gone (| head) loses no records or report
    sys.exit(main())

"""`python -m lab.tools.bench_step model=small`: does the lab's machinery cost anything?

The lab's real training step (shardings, logical constraints, donation) against a bare
flax+optax step for the same model on the same batch, timed alternately in one run; ratio =
lab / bare; each step's compile time is printed apart (both are compiled before the timing).
Records go to out_dir. Takes the keys of lab.run that shape the step; those of a run's outputs
(name, log_every, checkpoint_every, explain, profile, resume, overwrite) are refused, as it
keeps no run folder. See lab/studies/step.py.
"""

import dataclasses
import sys

from lab.config import cli, field
from lab.errors import ConfigError
from lab.measure import records as rec
from lab.report import progress, tables
from lab.report.format import duration
from lab.session import open_session
from lab.studies import step


@dataclasses.dataclass(frozen=True)
class Options:
    budget: float = field(5.0, "seconds of alternated timed steps", min=0.01)
    out_dir: str = field("results", "folder for the records", kind="path")


def run(o: Options, keys: dict) -> int:
    step.refuse_plans(keys, "bench_step")
    if "steps" in keys:
        raise ConfigError(
            f"steps= is set by bench_step (a {step.STEPS}-step schedule); leave it out"
        )
    s = open_session(keys={**keys, "steps": step.STEPS})
    if s.trainer.mesh.size > 1:
        raise ConfigError(
            f"mesh={s.cfg.mesh}: bench_step compares one device's steps (the bare step has no "
            f"mesh); the lab's step over {s.trainer.mesh.size} devices is lab.run's to time"
        )
    rec.writable_dir(o.out_dir)  # refused before the compiles
    if busy := rec.busy_note():
        progress.console().print(f"[yellow]{busy}")
    what = f"compiling both steps, then timing them alternately for {o.budget:g} s"
    con = progress.console()
    with progress.working(con, what):
        results, compile_s = step.compare_with_bare(s, budget_s=o.budget)
    title = f"{s.info.header()}; model={s.cfg.preset}, batch {s.cfg.batch_size}×{s.cfg.seq_len}"
    con.print(tables.step_compare(results, title))
    compiled = ", ".join(f"{k} {duration(v)}" for k, v in compile_s.items())
    con.print(f"compile time (not in the times above): {compiled}")
    stem = rec.output_stem(o.out_dir, "bench_step")
    path = rec.write_records(
        stem.with_suffix(".jsonl"), step.compare_records(results, compile_s, keys)
    )
    con.print(f"records → {path}", markup=False, soft_wrap=True)
    return 0


def main(argv=None) -> int:
    return cli(
        Options, run, prog="python -m lab.tools.bench_step", doc=__doc__, argv=argv, run_keys=True
    )


if __name__ == "__main__":
    from lab.report.progress import survive_lost_output

    survive_lost_output()  # a reader gone (| head) loses no records or report
    sys.exit(main())

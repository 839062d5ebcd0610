"""`python -m lab.tools.prediction`: how wrong the step-time model is, on published figures.

Compiles every published point of lab/predict/published.json for its target ahead of time
(cached under cache_dir, each point compiled once: the first run takes tens of minutes on a
2-core machine, where ten points took ten minutes, maxtext-v5e-64b alone 121 s and
maxtext-v6e-llama2-70b about 133 s; later runs read the cache), fits the model's
free parameters on the named calibration points only and prints one row per point: source,
hardware, published, predicted, error, calibration or held-out (dropped points with their
reason). The last line is the held-out error. With every point (no only=), the fit and its
held-out error are written to lab/predict/fits.json, which lab.run prints beside each
prediction.

cpu=true checks the model on this CPU (lab.run configurations timed here, the CPU's free
parameters fitted on the first three; the step times go to out_dir= as records). here=true,
on a GPU, first times single ops (matrix products at the published points' shapes in each
dtype, a copy), then lab.run configurations that fill the chip, and predicts each from its
own compiled program with the published fit: nothing is fitted on them, every row is held
out, and the rows join lab/predict/measured/ (the steps' error is what lab.run prints beside
every GPU prediction). loo=true fits once per calibration point, on the others, and prints
each one's error: a change to the model's form is judged by that, not by the held-out points.

Each program is cached as it is compiled: a stop (Ctrl-C, SIGTERM) keeps those compiled so far,
and takes effect once the compile in progress returns (a large one: a minute or two).
"""

import dataclasses
import os
import sys
import time

import jax

from lab import devices, startup
from lab.config import cli, field, given_options, typed_as
from lab.errors import ConfigError
from lab.measure import records
from lab.measure.fitted import Fit, fits_of
from lab.predict import machines, step
from lab.report import plots, progress, tables
from lab.studies import prediction


@dataclasses.dataclass(frozen=True)
class Options:
    KEY_ALIASES = {"results": "out_dir"}  # its name before it matched the other tools'
    only: tuple = field((), "point ids to predict (default: every point)", kind="names")
    cache_dir: str = field(
        "results/prediction-cache", "compiled programs of the points, reused", kind="path"
    )
    save: bool = field(
        True,
        "write the fit and its held-out error to lab/predict/fits.json; with here=true, add "
        "the measured steps to lab/predict/measured/ (the device checks lab.run cites)",
    )
    cpu: bool = field(
        False, "instead: the self-check on this CPU (lab.run configurations, measured here)"
    )
    here: bool = field(
        False,
        "instead: the model against the accelerator at hand (a GPU: lab.run configurations "
        "timed here, predicted from their compiled programs with the published fit)",
    )
    configs: tuple = field(
        (), "here=true: only these configurations, by number from 1 (default: all)", kind="ints"
    )
    ops: bool = field(
        True,
        "here=true: first time single ops (matrix products in bf16/fp16/fp8/f32 at the "
        "published points' shapes, a 1 GiB copy; about a minute) against their predictions, "
        "each op's error taken against its time with calls queued back to back",
    )
    budget: float = field(
        2.0, "cpu=true / here=true: seconds of timed steps per configuration", min=0.1
    )
    stop_after: float = field(
        0.0,
        "here=true: start no op or configuration after this many seconds (a lease's end; "
        "what finished is printed and kept), 0: no limit",
        min=0.0,
    )
    out_dir: str = field("results", "folder for the records and the PNG", kind="path")
    loo: bool = field(
        False,
        "instead: each calibration point predicted with the parameters fitted on the other "
        "calibration points (one fit per point; seconds from the cache), the way to judge a "
        "change to the model's form without looking at the held-out points",
    )


def _check_modes(o: Options) -> None:
    """One mode at a time, and no key that the chosen mode would ignore (one line, exit 2):
    every refusal comes before the folders are made."""
    modes = [m for m in ("cpu", "here", "loo") if getattr(o, m)]
    if len(modes) > 1:
        raise ConfigError(f"{'=true and '.join(modes)}=true: choose one of them")
    mode = modes[0] if modes else None
    default, typed = Options(), given_options(o)

    def asked(k: str) -> bool:  # typed (even at its default), or changed in code
        return k in typed if typed is not None else getattr(o, k) != getattr(default, k)

    only_here = [k for k in ("configs", "ops", "stop_after") if asked(k)]
    if only_here and mode != "here":
        raise ConfigError(f"{only_here[0]}= is for here=true (the accelerator at hand)")
    if asked("budget") and mode not in ("cpu", "here"):
        raise ConfigError("budget= times steps: it is for cpu=true or here=true")
    if o.only and mode in ("cpu", "here"):
        raise ConfigError(f"only= picks published points; {mode}=true runs its own configurations")
    if asked("cache_dir") and mode in ("cpu", "here"):
        raise ConfigError(
            f"cache_dir= holds the published points' programs; {mode}=true compiles its own "
            "configurations and keeps none"
        )
    if asked("out_dir") and mode == "loo":
        raise ConfigError(
            f"{typed_as(o, 'out_dir')}= is where records go; loo=true prints its table only"
        )
    if o.only and mode == "loo":
        raise ConfigError(
            "loo=true fits on every calibration point but the one left out; only= cannot "
            "pick points for it"
        )
    if o.only and o.save and asked("save") and mode is None:
        raise ConfigError(
            "save=true writes a fit of every calibration point; only= predicts with the saved "
            "fit and writes none: leave out save=, or only= to refit and save"
        )
    prediction.load_points(tuple(o.only))  # an unknown id, before any folder is made
    if mode != "cpu" and mode != "here":  # the published points' programs are cached there
        records.writable_dir(o.cache_dir)
    if mode in (None, "cpu"):
        records.writable_dir(o.out_dir)


def _saved_fits() -> dict:
    """The parameters of the last run over every point (lab/predict/fits.json), per vendor."""
    saved = {v: (step.fits().get(v) or {}).get("fit") for v in ("tpu", "gpu")}
    return {v: f for v, f in saved.items() if f}  # none: the roofline's own (as a full run)


def run(o: Options) -> int:
    _check_modes(o)
    con = progress.console()
    if o.cpu:
        return _cpu(o, con)
    if o.here:
        return _here(o, con)
    if o.loo:
        return _loo(o, con)
    points = prediction.load_points(tuple(o.only))
    _note_cache(o)
    with progress.tasks(con) as bar:
        task = bar.add_task("prediction", total=prediction.ticks(points, refit=not o.only))
        summary = prediction.run(
            points,
            o.cache_dir,
            progress=(tick := _ticker(bar, task)),
            write_fits=o.save,
            # a few points would fit the free parameters on the calibration points among
            # them (none, or one for five parameters): the saved fit of every point instead
            fits=_saved_fits() if o.only else None,
        )
        tick.done()
    if o.only:
        con.print(
            "only=: predicted with the saved fit (lab/predict/fits.json, fitted on every "
            "calibration point), not refitted on the points chosen"
        )
    shown = tuple(sorted({prediction.vendor(p) for p in points}))  # the fits these points use
    con.print(tables.prediction_rows(summary.rows, fits_of(summary.fits), shown))
    if not o.only:  # only= predicts with the saved fit: judged when it was fitted
        _edges(con, summary.fits)
    # the files are named for the hardware the points are on, not this host's backend
    targets = "+".join(shown)
    stem = records.output_stem(o.out_dir, "prediction", backend=targets or None)
    recs = prediction.to_records(summary)
    if recs:
        con.print(
            f"records → {records.write_records(stem.with_suffix('.jsonl'), recs)}", soft_wrap=True
        )
    else:  # every point dropped: no file (an empty one would be removed at exit)
        con.print("records: none (no point was predicted)")
    png = plots.prediction(summary.rows, stem.with_suffix(".png"), prediction.log_error(summary))
    if png:
        con.print(f"plot    → {png}", markup=False)
    cal = summary.calibration
    if cal.get("n"):
        con.print(
            f"calibration: {cal['n']} point{'s' if cal['n'] != 1 else ''}, median |error| "
            f"{cal['median']:.0%}, "
            f"worst {cal['worst']:.2f}×"
        )
    con.print(prediction.log_error(summary))
    failed = prediction.failed_here(summary)
    if failed and o.save and not o.only:
        con.print(
            f"[yellow]fit not saved: {len(failed)} point{'s' if len(failed) != 1 else ''} "
            f"could not be compiled here (the first, {failed[0].id}: {failed[0].note}); "
            "lab/predict/fits.json is kept as it was"
        )
    return 0


def _note_cache(o: Options) -> None:
    """A stop keeps every program compiled so far: each is cached as it is compiled."""
    startup.note(f"the programs compiled so far are kept in {o.cache_dir} for the next run")


def _ticker(bar, task):
    """The study's `progress`, called as each step starts: the steps before it are done (a
    step counted when it begins read "1/10 done" before anything ran)."""
    started: list[str] = []

    def tick(label: str) -> None:
        bar.update(task, description=progress.label(label), completed=len(started))
        started.append(label)

    # the last step has ended: the total becomes the steps taken (an estimate, as for
    # leave-one-out, counts the fits of points this host refused to compile)
    tick.done = lambda: bar.update(task, completed=len(started), total=len(started))
    return tick


def _loo(o: Options, con) -> int:
    _note_cache(o)
    with progress.tasks(con) as bar:
        task = bar.add_task("leave-one-out", total=prediction.leave_one_out_ticks())
        ratios = prediction.leave_one_out(
            o.cache_dir,
            progress=(tick := _ticker(bar, task)),
        )
        tick.done()
    for pid, ratio in ratios:
        con.print(f"{pid:44s} predicted / published time {ratio:.3f} ({ratio - 1:+.0%})")
    con.print(prediction.leave_one_out_line(ratios))
    return 0


def _edges(con, fits: dict, params=machines.FIT_PARAMS) -> None:
    """A line for each fitted parameter the fit pushed to the end of its range."""
    for vendor, fitted in fits.items():
        edges = machines.at_edge(fitted or {}, params)
        if edges:
            con.print(
                f"[yellow]{vendor} fit at the edge of its range: {'; '.join(edges)}. The model "
                "cannot reach these points within it: its error above is the measure of that"
            )


def _cpu(o: Options, con) -> int:
    # the configurations' meshes need up to 8 simulated CPU devices, set before JAX starts
    devices.prepare("8", cpu_devices=8)
    n = len(prediction.CPU_CONFIGS)
    busy = records.busy_note("the step times and fitted overheads", "the fitted efficiencies")
    if busy:
        con.print(f"[yellow]{busy}")
    with progress.tasks(con) as bar, records.OtherWork() as others:
        task = bar.add_task("cpu self-check", total=n)
        rows, fit = prediction.cpu_check(
            budget_s=o.budget,
            progress=(tick := _ticker(bar, task)),
        )
        tick.done()
    if others.busy and not busy:  # work that started after the check above
        busy = (
            f"other work took {others.share:.0%} of the host's {os.cpu_count()} cores while "
            "the self-check ran: its step times and fitted overheads may have come out high "
            "and noisy"
        )
        con.print(f"[yellow]{busy}")
    con.print(tables.prediction_cpu_rows(rows, Fit.from_record(fit)))
    path = records.output_stem(o.out_dir, "prediction-cpu").with_suffix(".jsonl")
    con.print(
        f"records → {records.write_records(path, prediction.cpu_records(rows, fit))}",
        soft_wrap=True,
    )
    _edges(con, {"cpu": fit}, prediction.CPU_FIT_PARAMS)
    if o.save and busy:  # lab.run quotes this fit: a loaded host's would mislead every run
        con.print(
            "fit not saved: the host was busy while it was measured; run it again on a quiet "
            "host to save it"
        )
    elif o.save:
        con.print(f"fit → {prediction.save_cpu_fit(rows, fit)}", markup=False)
    con.print(prediction.cpu_error_line(rows))
    return 0


def _here(o: Options, con) -> int:
    info = devices.describe()
    if info.backend == "cpu":
        raise ConfigError("here=true measures an accelerator; on this CPU, cpu=true is the check")
    configs = prediction.GPU_CONFIGS
    if o.configs:
        bad = [i for i in o.configs if not 1 <= i <= len(configs)]
        if bad:
            raise ConfigError(
                f"configs={bad[0]}: there are {len(configs)} configurations (1-based)"
            )
        configs = tuple(configs[i - 1] for i in o.configs)
    path = records.output_stem(o.out_dir, "prediction-here").with_suffix(".jsonl")
    deadline = time.monotonic() + o.stop_after if o.stop_after else None

    def writer(what: str, store: str):
        def write(r) -> None:  # each row as soon as it is known: a run cut short keeps them
            extra = {"pipelined_s": r.pipelined_s} if r.pipelined_s else {}
            rec = records.make_record(
                what,
                r.measured_s,
                "s",
                label="measured",
                predicted_s=r.predicted_s,
                breakdown=r.breakdown,
                top_ops=list(r.top_ops),
                config=r.config,
                device_kind=info.device_kind,
                jax=jax.__version__,
                failed=r.error_text or None,
                **extra,
            )
            records.write_records(path, rec)
            startup.note(f"the rows measured so far are in {path}")
            if o.save and r.error is not None:  # the lab's store of device checks (held out)
                records.write_records(step.MEASURED / f"{store}.jsonl", rec)
            queued = f", {r.pipelined_s * 1e3:.3f} ms queued" if r.pipelined_s else ""
            if r.measured_s is None:
                con.print(f"{r.config}: no figures ({r.error_text})")
            elif r.error is None:
                con.print(
                    f"{r.config}: measured {r.measured_s * 1e3:.3f} ms{queued} ({r.error_text})"
                )
            else:
                con.print(
                    f"{r.config}: measured {r.measured_s * 1e3:.3f} ms{queued}, predicted "
                    f"{r.predicted_s * 1e3:.3f} ms ({r.error:+.0%})"
                )

        return write

    slug = step.slug(info.device_kind)
    op_rows = []
    with progress.tasks(con) as bar:
        if o.ops:
            task = bar.add_task("ops", total=len(prediction.GPU_OPS))
            op_rows = prediction.here_ops(
                prediction.GPU_OPS,
                budget_s=min(o.budget, 0.5),
                progress=(tick := _ticker(bar, task)),
                on_row=writer(step.OP_CHECK, f"{slug}-ops"),
                deadline=deadline,
            )
            tick.done()
        task = bar.add_task("here", total=len(configs))
        rows = prediction.here_check(
            configs,
            budget_s=o.budget,
            progress=(tick := _ticker(bar, task)),
            on_row=writer(step.STEP_CHECK, slug),
            deadline=deadline,
        )
        tick.done()
    if op_rows:
        con.print(tables.prediction_here_rows(op_rows, info.device_kind, ops=True))
    con.print(tables.prediction_here_rows(rows, info.device_kind))
    con.print(f"records → {path}", markup=False, soft_wrap=True)
    left = (len(prediction.GPU_OPS) - len(op_rows) if o.ops else 0) + len(configs) - len(rows)
    if left:
        con.print(f"stopped after {o.stop_after:g} s (stop_after): {left} not measured")
    if op_rows:
        con.print(prediction.here_error_line(op_rows, info.device_kind, "ops"))
    con.print(prediction.here_error_line(rows, info.device_kind))
    return 0


def main(argv=None) -> int:
    return cli(Options, run, prog="python -m lab.tools.prediction", doc=__doc__, argv=argv)


if __name__ == "__main__":
    from lab.report.progress import survive_lost_output

    survive_lost_output()  # a reader gone (| head) loses no records or report
    sys.exit(main())

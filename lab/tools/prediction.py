"""`python -m lab.tools.prediction`: how wrong the step-time model is, on published figures.

Compiles every published point of lab/predict/published.json for its target ahead of time
(cached under cache_dir: the first run takes minutes, later ones seconds), fits the model's
free parameters on the named calibration points only and prints one row per point: source,
hardware, published, predicted, error, calibration or held-out (dropped points with their
reason). The last line is the held-out error. With every point (no only=), the fit and its
held-out error are written to lab/predict/fits.json, which lab.run prints beside each
prediction.
"""

import dataclasses
import sys

from lab import devices
from lab.config import cli, field
from lab.measure import records
from lab.report import plots, progress, tables
from lab.studies import prediction


@dataclasses.dataclass(frozen=True)
class Options:
    only: tuple = field((), "point ids to predict (default: every point)", kind="names")
    cache_dir: str = field(
        "results/prediction-cache", "compiled programs of the points, reused", kind="path"
    )
    save: bool = field(True, "write the fit and its held-out error to lab/predict/fits.json")
    cpu: bool = field(
        False, "instead: the self-check on this CPU (lab.run configurations, measured here)"
    )
    budget: float = field(2.0, "cpu=true: seconds of timed steps per configuration", min=0.1)
    results: str = field("results", "folder for the records and the PNG", kind="path")


def run(o: Options) -> int:
    con = progress.console()
    if o.cpu:
        return _cpu(o, con)
    points = prediction.load_points(tuple(o.only))
    with progress.tasks(con) as bar:
        task = bar.add_task("prediction", total=len(points) + 2)
        summary = prediction.run(
            points,
            o.cache_dir,
            progress=lambda label: bar.update(task, description=label[:40], advance=1),
            write_fits=o.save,
        )
    con.print(tables.prediction_rows(summary.rows, summary.fits))
    stem = records.output_stem(o.results, "prediction")
    recs = prediction.to_records(summary)
    con.print(f"records → {records.write_records(stem.with_suffix('.jsonl'), recs)}")
    png = plots.prediction(summary.rows, stem.with_suffix(".png"), prediction.log_error(summary))
    if png:
        con.print(f"plot    → {png}")
    cal = summary.calibration
    if cal.get("n"):
        con.print(
            f"calibration: {cal['n']} points, median |error| {cal['median']:.0%}, "
            f"worst {cal['worst']:.2f}×"
        )
    con.print(prediction.log_error(summary))
    return 0


def _cpu(o: Options, con) -> int:
    # the configurations' meshes need up to 8 simulated CPU devices, set before JAX starts
    devices.prepare("8", cpu_devices=8)
    n = len(prediction.CPU_CONFIGS)
    with progress.tasks(con) as bar:
        task = bar.add_task("cpu self-check", total=n)
        rows, fit = prediction.cpu_check(
            budget_s=o.budget,
            progress=lambda label: bar.update(task, description=label[:40], advance=1),
        )
    con.print(tables.prediction_cpu_rows(rows, fit))
    if o.save:
        con.print(f"fit → {prediction.save_cpu_fit(rows, fit)}")
    con.print(prediction.cpu_error_line(rows))
    return 0


def main(argv=None) -> int:
    return cli(Options, run, prog="python -m lab.tools.prediction", doc=__doc__, argv=argv)


if __name__ == "__main__":
    sys.exit(main())

"""The ledger's prediction section: how wrong the step-time model is, on published figures.

Every GPU and TPU verdict of this ledger is *predicted* off those chips, so the model's error
is part of every such verdict. This module puts the validation table in the report (one record
per published point: published, predicted, error, calibration / held-out / dropped and why),
with the held-out error, and the error of the fallback rule (datasheet peak × the MFU measured
here) on the same held-out training points, measured now. The log-log plot of predicted against
published with the ±15% band is drawn from these records (lab/report/plots.py).

The table is the one `python -m lab.tools.prediction` last saved (lab/predict/fits.json, its
date and jax version recorded beside it); with plans=on (or size=full) the validation set is
compiled here (cached in cache_dir=, <out_dir>/prediction-cache by default, each point
compiled once: tens of minutes cold on a 2-core machine, seconds warm) and predicted afresh.
"""

from experiments.common import mfu_here, record
from lab.studies import prediction

CLAIMS = ()


def _rows(plans: bool) -> tuple[list, dict, str]:
    """(rows, held-out stats, where they come from)."""
    if plans:
        s = prediction.run(prediction.load_points(), prediction.CACHE_DIR)
        return list(s.rows), s.held_out["all"], "compiled and predicted in this run"
    from lab.predict.step import fits

    v = fits().get("validation") or {}
    where = (
        f"as last measured by `{v.get('source', 'python -m lab.tools.prediction')}` on "
        f"{v.get('date', '?')}, jax {v.get('jax', '?')}"
    )
    return prediction.saved_rows(), (v.get("held_out") or {}).get("all") or {"n": 0}, where


def run(size: str = "quick", plans: bool = False) -> list[dict]:
    rows, held, where = _rows(plans)
    recs = [
        record(
            None,
            None,
            f"{r.id} ({r.publisher}, {r.hardware}, {r.workload})",
            r.predicted,
            r.unit,
            label="predicted",
            role="context",
            series="prediction_point",
            point=r.id,
            publisher=r.publisher,
            hardware=r.hardware,
            workload=r.workload,
            published=r.published,
            error=r.error,
            fit_role=r.role,
            note=r.note,
            source=where,
        )
        for r in rows
    ]
    if held.get("n"):
        recs.append(
            record(
                None,
                None,
                "step-time model: median |predicted / published − 1| on the held-out points",
                held["median"],
                "fraction",
                label="derived",
                role="context",
                series="prediction_error",
                points=held["n"],
                worst_ratio=held["worst"],
                source=where,
            )
        )
    mfu = mfu_here(size)
    ids = {r.id for r in rows if r.role == "held-out" and r.workload == "train"}
    fb = prediction.fallback_error(mfu, ids)
    if fb["n"]:
        recs.append(
            record(
                None,
                None,
                "fallback rule (datasheet peak × the MFU measured here): median |error| on the "
                "same held-out training points",
                fb["median"],
                "fraction",
                label="derived",
                role="context",
                series="prediction_fallback_error",
                points=fb["n"],
                worst_ratio=fb["worst"],
                mfu_here=mfu,
            )
        )
    return recs

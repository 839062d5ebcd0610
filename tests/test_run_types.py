"""The types lab.run's and the prediction tool's renderers take: read from the JSON the lab
keeps (summary.json, fits.json) and given back key for key."""

import io

from lab.measure.fitted import Fit, fits_of
from lab.measure.run import RunSummary, StepAnalysis
from lab.predict.step import fits
from lab.report.tables import prediction_cpu_rows, run_summary
from lab.report.tables.run import analysis

SUMMARY = {
    "compiled_memory_per_device": {"total_bytes": 2**20, "host_temp_bytes": 0},
    "predicted_memory_per_device": {
        **{k: 1024 for k in ("params", "grads", "optimizer", "activations", "workspace")},
        "total": 5120,
    },
    "compiled_cost_per_device": {"flops": 1e9, "bytes accessed": 1e6, "loops": [["body", 4]]},
    "model_flops_per_token": 7.9e5,
    "flops_convention": "6·N",
    "tokens_per_step": 2048,
    "notes": ["a note"],
    "capacity_bytes_per_device": None,
    "predicted_step": None,
    "step_time": {"median_s": 0.1, "p10_s": 0.09, "p90_s": 0.12, "runs": 3, "compile_s": 2.0},
    "tokens_per_s": 20480.0,
    "tokens_per_s_per_device": 20480.0,
    "mfu": 0.4,
    "peak_source": "measured",
    "predicted_step_time": None,
    "memory_stats": None,
    "loss_first": 6.4,
    "loss_last": 6.3,
}


def test_a_run_summary_reads_summary_json_and_gives_it_back():
    s = RunSummary.from_record(SUMMARY)
    assert s.record() == SUMMARY and s.step_time.runs == 3 and s.peak_bytes_in_use is None
    a = s.analysis
    assert a.compiled_total_bytes == 2**20 and a.compiled_cost.loop_trips == (4,)
    assert a.predicted_memory.parts[0] == ("params", 1024) and a.plan is None
    assert StepAnalysis.from_record(a.record()) == a
    assert a.record().items() <= SUMMARY.items()
    assert run_summary(s).row_count == 8  # the note among them


def test_the_fits_read_and_given_back():
    stored = {v: e["fit"] for v, e in fits().items() if isinstance(e, dict) and e.get("fit")}
    assert stored and all(f.record() == stored[v] for v, f in fits_of(stored).items())
    cpu = {"compute_efficiency": 0.3, "memory_efficiency": 0.7, "op_overhead_s": 3e-6}
    fit = Fit.from_record(cpu)
    assert fit.record() == cpu and fit.link_latency_s is None
    assert "compute 0.30 of the" in prediction_cpu_rows([], fit).caption


PREDICTED = {  # the step-time model's record (lab.measure.predicted.PredictedStep)
    "seconds": 0.2,
    "breakdown": {"compute": 0.2},
    "collective_s": 0.0,
    "machine": "cpu",
    "top_ops": [],
    "error": "worst 1.34×",
    "machine_source": "measured",
    "label": "predicted",
}


def _text(table) -> str:
    from rich.console import Console

    con = Console(width=400, record=True)
    con.print(table)
    return con.export_text()


def test_a_time_from_too_few_steps_is_not_called_a_median_nor_are_its_derived_figures():
    one = {**SUMMARY, "step_time": {**SUMMARY["step_time"], "runs": 1}}
    one["predicted_step_time"] = {"seconds": 0.2, "ratio_to_measured": 2.0, "error": "e"}
    one["predicted_step"] = PREDICTED
    text = _text(run_summary(RunSummary.from_record(one)))
    assert "1 steps" not in text and "step time (median)" not in text and "p10" not in text
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if "│" in line}
    for row in ("step time", "predicted step time", "tokens/s", "MFU"):
        assert "one step timed: not a median" in rows[row], rows[row]
    two = {**SUMMARY, "step_time": {**SUMMARY["step_time"], "runs": 2}}
    text = _text(run_summary(RunSummary.from_record(two)))
    assert "2 steps timed: too few for a median" in text and "p10" not in text
    text = _text(run_summary(RunSummary.from_record(SUMMARY)))  # 3: a median
    assert "step time (median)" in text and "3 steps)" in text and "not a median" not in text
    # a run too short to time a step past its warm-up: said on every figure of the time
    warm = {**two, "warmup_timed": True}
    text = _text(run_summary(RunSummary.from_record(warm)))
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if "│" in line}
    for row in ("step time", "tokens/s", "MFU"):
        assert "2 warm-up steps timed: not the steady step" in rows[row], rows[row]


def test_the_predicted_time_on_a_busy_host_carries_the_caveat():
    from lab.summary import _predicted_vs_measured

    class Times:
        median_s = 0.1

    predicted = {"seconds": 0.2, "breakdown": {"compute": 0.2}, "error": "worst 1.34×"}
    assert "caveat" not in _predicted_vs_measured(predicted, Times)
    p = _predicted_vs_measured(predicted, Times, "load 2.2 on 2 cores")
    assert p["caveat"] == "host busy: load 2.2 on 2 cores, CPU figures unreliable"
    s = {**SUMMARY, "predicted_step_time": p, "predicted_step": PREDICTED}
    row = [
        x for x in _text(run_summary(RunSummary.from_record(s))).splitlines() if "predicted" in x
    ]
    assert (
        row[0]
        .rstrip(" │")
        .endswith("worst 1.34×; host busy: load 2.2 on 2 cores, CPU figures unreliable)")
    )


def test_a_plan_table_says_its_step_time_is_predicted():
    """A plan's memory and FLOPs are the compiler's (compiled, not run); its step time from the
    step-time model is a prediction, and the label row says so."""
    import rich.console

    aot = {
        "fit": "fits (1.0 of 16 GiB)",
        "estimated_step_s": 0.01,
        "estimate_source": "predicted by the step-time model; model error 25% median",
        "implied_mfu": 0.5,
        "label": "compiled, not run",
    }

    def label_row(**extra) -> str:
        a = StepAnalysis.from_record({**SUMMARY, "aot": {**aot, **extra}})
        console = rich.console.Console(record=True, width=200, file=io.StringIO())
        console.print(analysis(a, 1.0))
        return next(
            x for x in console.export_text().splitlines() if x.strip("│ ").startswith("label")
        )

    assert "compiled, not run; step time predicted" in label_row(estimate_label="predicted")
    assert "step time" not in label_row(estimate_label="compiled, not run")
    assert "step time" not in label_row()  # a summary.json written before the key

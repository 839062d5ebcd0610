"""The step-time model in the claims ledger: the prediction section (its table, plot and
error lines from the saved validation), every predicted figure carrying its error, the
fallback rule's error on the same held-out points, and programs predicted on another chip's
spec entry (MI300X from the H100's matmul)."""

import functools
import types

import pytest

from experiments import common
from experiments import prediction as section
from lab.measure import specs
from lab.measure.run import PlanFigures
from lab.predict.step import fits
from lab.report import markdown, plots, tables
from lab.studies import prediction


def test_fallback_error_is_the_rule_held_against_published_mfu():
    """The old rule predicts every training point at the MFU measured here: known answers on
    a point whose published MFU is 0.41 (Megatron 1.7B on H100s)."""
    ids = {"megatron-h100-1.7b"}
    assert prediction.published_mfu(prediction.load_points(ids)[0]) == pytest.approx(0.41)
    exact = prediction.fallback_error(0.41, ids)
    assert exact["n"] == 1 and exact["median"] == pytest.approx(0.0)
    double = prediction.fallback_error(0.82, ids)
    assert double["median"] == pytest.approx(1.0) and double["worst"] == pytest.approx(2.0)
    assert prediction.fallback_statement(0.82).startswith("fallback rule (datasheet peak")


def test_one_held_out_point_is_its_error_not_a_median_and_a_worst(monkeypatch):
    one = {"n": 1, "median": 0.26, "worst": 1.26}
    monkeypatch.setattr(prediction, "fallback_error", lambda mfu, workload="train": one)
    said = prediction.fallback_statement(0.3)
    assert said.endswith("its error 26% on 1 held-out published training point"), said


def test_a_forward_pass_mfu_is_judged_against_published_prefills():
    """Inference predictions scale a forward pass's MFU: the fallback rule's error for them is
    measured on prefill points, whose MFU is the forward's FLOPs over the time to first token.
    Llama-2 7B, 2,048 tokens on one A100 in 133 ms: 2·(6.74e9 − 32000·4096) + 4·32·2048·4096
    FLOPs a token, over 0.133 s × 312 TFLOP/s."""
    ids = {"trtllm-a100-llama7b-prefill-2048"}
    (point,) = prediction.load_points(tuple(ids))
    per_token = 2 * (6.74e9 - 32000 * 4096) + 4 * 32 * 2048 * 4096
    want = 2048 * per_token / (0.133 * 312e12)
    assert prediction.published_mfu(point) == pytest.approx(want)
    e = prediction.fallback_error(want / 2, ids, workload="prefill")
    assert e["n"] == 1 and e["median"] == pytest.approx(0.5) and e["worst"] == pytest.approx(2)
    # the training rule does not count it, nor the prefill rule a training point
    assert prediction.fallback_error(want, ids)["n"] == 0
    assert prediction.fallback_error(0.41, {"megatron-h100-1.7b"}, workload="prefill")["n"] == 0
    said = prediction.fallback_statement(0.3, "prefill")
    assert "published prefill point" in said and "training" not in said


def test_published_mfu_from_tflops_per_chip_uses_the_chip_peak():
    point = next(p for p in prediction.load_points() if p["id"] == "maxtext-a3-h100x8-llama2-7b")
    peak = specs.SPECS["h100-sxm"].peak_flops["bfloat16"]
    assert prediction.published_mfu(point) == pytest.approx(492e12 / peak)


def test_serving_figures_follow_the_unit():
    """Decode: sequences / step time (per chip where the unit says so); prefill in ms is the
    time itself, and its 'measured seconds' is the figure / 1000, not its inverse."""
    pr = object.__new__(prediction.Predictor)
    pr.prog = {"batch": 60}
    pr.point = {
        "workload": "decode",
        "hardware": {"kind": "a100", "chips": 2},
        "figure": {"unit": "tokens/s per chip (output tokens)", "value": 1000.0},
    }
    assert pr.figure(0.03) == pytest.approx(1000.0)
    assert pr.measured_seconds() == pytest.approx(0.03)
    pr.point = {**pr.point, "workload": "prefill"}
    pr.point["figure"] = {"unit": "ms (time to first token)", "value": 133.0}
    assert pr.figure(0.1) == pytest.approx(100.0) and pr.measured_seconds() == 0.133


def test_a_predicted_record_carries_its_error():
    r = common.record("C02", "m", "x over y", 2.0, "×", label="predicted", model_error="rule E")
    assert r["what"] == "x over y — predicted by the rule E"
    assert r["config"]["model_error"] == "rule E"
    assert common.record("C02", "m", "x", 2.0, "×", label="derived")["what"] == "x"


def test_the_ledger_section_renders_the_saved_validation(tmp_path, monkeypatch):
    """Records from lab/predict/fits.json (no compile): one per point, the held-out error read
    from the file, the fallback rule's error on the same held-out training points; the report
    section has the table and the log-log plot."""
    monkeypatch.setattr(section, "mfu_here", lambda size: 0.3)
    saved = fits()["validation"]
    recs = section.run("tiny")
    for r in recs:
        r["config"]["module"] = "prediction"
    points = plots.series(recs, "prediction_point")
    assert len(points) == len(saved["rows"])
    (held,) = plots.series(recs, "prediction_error")
    assert held["value"] == saved["held_out"]["all"]["median"]
    (fb,) = plots.series(recs, "prediction_fallback_error")
    ids = {r["id"] for r in saved["rows"] if r["role"] == "held-out" and r["workload"] == "train"}
    assert fb["value"] == prediction.fallback_error(0.3, ids)["median"]
    lines = tables.prediction_markdown(recs)
    assert sum(line.startswith("| ") for line in lines) == len(points) + 1
    report = markdown.write_report(tmp_path, records=recs, only=())
    text = report["path"].read_text()
    assert "## Prediction" in text and "(prediction.png)" in text
    assert (tmp_path / "prediction.png").stat().st_size > 1000


def test_a_chip_without_a_compiler_is_predicted_on_its_own_spec(tmp_path, monkeypatch):
    """MI300X: the H100's compiled bf16 matmul timed on the MI300X's spec entry. A large
    matmul is compute-bound: each time is its FLOPs at the fitted share of the chip's bf16 peak
    (or the fitted launch cost if that were longer), plus the fitted cost of a call
    (hand-computed here)."""
    pytest.importorskip("jax_plugins.xla_cuda13", reason="the gpu-plan extra compiles for H100")
    cached = functools.partial(prediction.predict_with_fit, cache_dir=tmp_path)
    monkeypatch.setattr(prediction, "predict_with_fit", cached)
    n = 4096
    mi = common.predicted_gemm("h100-sxm", n, spec="mi300x")
    h = common.predicted_gemm("h100-sxm", n)
    fit = fits()["gpu"]["fit"]

    def hand(key):
        peak = specs.SPECS[key].peak_flops["bfloat16"] * fit["compute_efficiency"]
        launch = max(2 * n**3 / peak, fit["op_overhead_s"])  # a launch overlaps the work
        return launch + fit.get("call_overhead_s", 0.0)

    assert mi["seconds"] == pytest.approx(hand("mi300x"), rel=0.01)
    assert h["seconds"] == pytest.approx(hand("h100-sxm"), rel=0.01)
    assert "MI300X" in mi["statement"] and "model error" in mi["statement"]


def test_a_memory_refusal_names_the_remat_policy_the_lab_lacks():
    point = next(p for p in prediction.load_points() if p["id"] == "maxtext-v5p-32b")
    why = prediction.why_refused(point, "needs 122.45G, 95.74G available")
    assert why.startswith("needs 122.45G") and "remat_policy=minimal" in why
    assert "remat=dots" in why and "dropped, not bent" in why
    assert prediction.why_refused(point, "tile too large") == "tile too large"


def test_a_merge_shows_each_prediction_once_and_names_those_that_differ(monkeypatch):
    """The model predicts from compiled programs, not from the machine that ran it: two
    folders with the same predictions draw and list them once (a merge listed every point once
    per folder and drew each folder's over the last); a folder whose prediction of a point
    differs gets its own panel and its row names it, as does a fallback error of its own."""
    monkeypatch.setattr(section, "mfu_here", lambda size: 0.3)
    recs = section.run("tiny")
    for r in recs:
        r["config"]["module"] = "prediction"
    points = plots.series(recs, "prediction_point")

    def folder(name, mfu_scale=1.0, shift=None):
        out = []
        for r in recs:
            r = {**r, "config": dict(r["config"]), "machine": name}
            if r["config"]["series"] == "prediction_fallback_error":
                r["value"] *= mfu_scale
            if shift and r["config"].get("point") == shift and r["value"]:
                r["value"] *= 1.5
            out.append(r)
        return out

    same = folder("cpu · a") + folder("cpu · b")
    lines = tables.prediction_markdown(same)
    assert sum(line.startswith("| ") for line in lines) == len(points) + 1
    assert not any(" · cpu · " in line for line in lines)
    kept = []
    monkeypatch.setattr(plots, "_save", lambda fig, path, **kw: kept.append(fig) or path)
    plots.prediction_records(same, "unused.png")
    assert len(kept[-1].axes) == 1 and "the same in 2 folders" in kept[-1].axes[0].get_title()

    moved = next(r["config"]["point"] for r in points if r["value"])
    differ = folder("cpu · a") + folder("cpu · b", mfu_scale=2.0, shift=moved)
    lines = tables.prediction_markdown(differ)
    assert sum(line.startswith("| ") for line in lines) == len(points) + 2
    assert sum(line.startswith(f"| {moved} · cpu · ") for line in lines) == 2
    fallback = [line for line in lines if line.startswith("- fallback rule")]
    assert len(fallback) == 2 and all(" · cpu · " in line for line in fallback)
    plots.prediction_records(differ, "unused.png")
    assert [ax.get_title().rsplit(" · ", 1)[-1] for ax in kept[-1].axes if ax.get_title()] == [
        "a",
        "b",
    ]


def test_a_merged_panel_takes_no_other_folders_error(monkeypatch):
    """A folder without an error record of its own is titled plainly in a merge, not with
    another folder's held-out error."""
    monkeypatch.setattr(section, "mfu_here", lambda size: 0.3)
    recs = section.run("tiny")
    a = [{**r, "config": dict(r["config"]), "machine": "cpu · a"} for r in recs]
    b = [
        {**r, "config": dict(r["config"]), "machine": "cpu · b"}
        for r in recs
        if r["config"]["series"] == "prediction_point"
    ]
    moved = next(r for r in b if r["value"])
    moved["value"] *= 1.5
    kept = []
    monkeypatch.setattr(plots, "_save", lambda fig, path, **kw: kept.append(fig) or path)
    plots.prediction_records(a + b, "unused.png")
    titles = [ax.get_title() for ax in kept[-1].axes if ax.get_title()]
    assert titles[0].startswith("held-out: ") and titles[0].endswith(" · cpu · a")
    assert titles[1] == "the step-time model against published figures · cpu · b"


def _tpu_plan(seconds: float, tokens: int, **aot) -> dict:
    """A compiled TPU plan as experiments.hardware._aot_step returns it (hand-built)."""
    memory = {"total_bytes": 1e9}
    return {
        "tokens": tokens,
        "plan": {
            "aot": {"estimated_step_s": seconds, **aot},
            "compiled_memory_per_device": memory,
            "compiled_cost_per_device": {"flops": 1e12},
        },
    }


def test_a_tpu_step_time_from_the_step_time_model_is_predicted_with_its_error():
    """C19's TPU throughput and scaling efficiency come from the step-time model applied to
    the compiled program: they are predictions, labelled so and carrying the model's held-out
    error, not the compiler's figures; the compiler's own estimate alone stays compiled."""
    from experiments import hardware

    error = "step-time model of the compiled program; model error 25% median, worst 1.25×"
    aot = dict(estimate_source="predicted by …", estimate_label="predicted", estimate_error=error)
    one, four = _tpu_plan(0.01, 64, **aot), _tpu_plan(0.0105, 256, **aot)
    bound = {"tpu-v5e": 1.0, "h100-sxm": 0.25}
    recs = {
        r["config"]["metric"] or "per_chip": r for r in hardware._tpu_step_records(one, four, bound)
    }
    for key in ("per_chip", "tpu_scaling_efficiency"):
        r = recs[key]
        assert r["label"] == "predicted", r
        assert "compiler" not in r["what"] and r["what"].endswith(f"predicted by the {error}")
    assert recs["tpu_scaling_efficiency"]["value"] == pytest.approx(0.01 / 0.0105)
    # the report shows the error beside the figure and counts it a prediction, not a compile
    from lab.report.claims import BY_ID
    from lab.report.verdict import judge_all

    records = list(recs.values())
    text = markdown.render(records, judge_all(records, [BY_ID["C19"]]), {})
    line = next(x for x in text.splitlines() if "over 1 chip" in x)
    assert "25% median" in line and "*predicted*" in line and "compiled, not run" not in line
    unchecked = "not checked against any TPU measurement: XLA:TPU's own cost model; 1.3× …"
    compiler = dict(
        estimate_source="compiler estimate",
        estimate_label="compiled, not run",
        estimate_error=unchecked,
    )
    one, four = _tpu_plan(0.01, 64, **compiler), _tpu_plan(0.0105, 256, **compiler)
    recs = hardware._tpu_step_records(one, four, bound)
    assert [r["label"] for r in recs[:2]] == ["compiled, not run"] * 2
    assert recs[0]["what"].endswith("compiler's step estimate"), recs[0]["what"]
    # the error (its ratio to the floor changes from compile to compile) is in the config, one
    # per program read: a record's name stays the same from run to run
    assert recs[0]["config"]["estimate_error"] == f"compiler estimate: {unchecked}"
    assert recs[1]["config"]["estimate_error"] == [f"compiler estimate: {unchecked}"] * 2
    other = {**compiler, "estimate_error": unchecked.replace("1.3×", "2.4×")}
    again = hardware._tpu_step_records(
        _tpu_plan(0.01, 64, **other), _tpu_plan(0.0105, 256, **other), bound
    )
    assert [r["what"] for r in again] == [r["what"] for r in recs]


def test_a_plan_says_whether_its_step_time_is_the_model_s_or_the_compiler_s(monkeypatch):
    """summary.json's "aot": the step time of the step-time model is predicted and names its
    error; the compiler's own estimate is compiled, not run; a roofline floor is predicted."""
    from lab import plans, summary
    from lab.config import make_config
    from lab.measure import cost
    from lab.measure.predicted import PredictedStep

    cfg = make_config(preset="tiny", batch_size=2, seq_len=32, dtype="bfloat16")
    info = types.SimpleNamespace(device_kind="TPU v5 lite")
    step = PredictedStep(0.01, {"compute": 0.01}, 0.0, "tpu", (), "model error 25% median", "")
    a = summary._aot_plan(None, cfg, info, 1e6, 1, step)
    assert a["label"] == "compiled, not run"  # the plan's memory and FLOPs
    assert a["estimate_label"] == "predicted" and "25% median" in a["estimate_error"]
    error = "not checked against any TPU measurement: XLA:TPU's own cost model; 1.3× the …"
    compiler = plans.StepEstimate(0.02, "compiler estimate", error, 1.3)
    monkeypatch.setattr(plans, "step_estimate", lambda *a, **k: compiler)
    a = summary._aot_plan(None, cfg, info, 1e6, 1)
    assert a["estimate_label"] == "compiled, not run" and a["estimate_error"] == error
    # the printed plan and the run's records carry the error beside the time
    figures = PlanFigures.from_record({**a, "fit": "fits"})
    assert figures.estimate_how == f"compiler estimate: {error}"
    assert figures.estimate_how == cost.estimate_with_error(cost.COMPILER_ESTIMATE, error)
    recs = summary.run_records({"aot": {**a, "fit": "fits"}, "tokens_per_step": 64}, "r")
    assert [r["what"] for r in recs] == ["training step time", "training tokens/s", "training MFU"]
    assert all(r["config"]["model_error"] == f"compiler estimate: {error}" for r in recs), recs
    floor = "roofline floor (compute-bound): no faster, likely slower"
    at_floor = plans.StepEstimate(0.02, floor, floor)
    monkeypatch.setattr(plans, "step_estimate", lambda *a, **k: at_floor)
    a = summary._aot_plan(None, cfg, info, 1e6, 1)
    assert a["estimate_label"] == "predicted" and a["estimate_error"] == floor
    assert PlanFigures.from_record({**a, "fit": "fits"}).estimate_how == floor


def test_the_compilers_step_estimate_states_its_error(monkeypatch):
    """No TPU measurement checks XLA:TPU's cost model, so its estimate's error is said to be
    unchecked, with its ratio to the roofline floor of the same program where the chip's spec
    gives one; an estimate below the floor gives way to the floor, which is its own error."""
    from lab import plans
    from lab.measure import cost

    spec = types.SimpleNamespace(memory_bandwidth=1e12)
    monkeypatch.setattr(cost, "compiled_cost", lambda c: {"flops": 1e10, "bytes accessed": 1e9})
    monkeypatch.setattr(plans, "estimated_seconds", lambda c: 0.013)  # floor: 1e10/1e12 s
    e = plans.step_estimate(None, 1e9, spec, 1e12, device_kind="TPU v5 lite")
    assert (e.seconds, e.source, e.over_floor) == (0.013, "compiler estimate", pytest.approx(1.3))
    assert e.error == (
        "not checked against any TPU measurement: XLA:TPU's own cost model; "
        "1.3× the roofline floor of the same program"
    )
    e = plans.step_estimate(None, 1e9, None, None, device_kind="TPU v7")
    assert e.source == "compiler estimate" and e.over_floor is None
    assert e.error.endswith("no roofline floor beside it (no spec entry for the chip)"), e.error
    monkeypatch.setattr(cost, "compiled_cost", lambda c: {"flops": 0.0, "bytes accessed": 0.0})
    monkeypatch.setattr(cost.memory, "compiled_memory", lambda c: {})
    e = plans.step_estimate(None, 0.0, spec, 1e12, device_kind="TPU v5 lite")  # a spec, floor 0
    assert e.source == "compiler estimate" and e.over_floor is None
    assert "no spec entry" not in e.error and "counts no FLOPs and no bytes moved" in e.error
    monkeypatch.setattr(cost, "compiled_cost", lambda c: {"flops": 1e10, "bytes accessed": 1e9})
    monkeypatch.setattr(plans, "estimated_seconds", lambda c: 0.005)  # below the floor
    e = plans.step_estimate(None, 1e9, spec, 1e12, device_kind="TPU v5 lite")
    assert e.seconds == pytest.approx(0.01) and e.source.startswith("roofline floor")
    assert e.error == e.source


def _held_out_decode_rows() -> list[dict]:
    rows = (fits().get("validation") or {}).get("rows") or []
    return [
        r
        for r in rows
        if r["role"] == "held-out"
        and r["workload"] == "decode"
        and not r["hardware"].startswith("tpu")
        and r.get("error") is not None
    ]


def test_the_decode_error_is_the_models_on_the_held_out_published_decode_points():
    """A decode figure is as wrong as the model was on decode, not on the mix of GEMMs and
    all-reduces of every held-out point: read from the saved validation."""
    import statistics

    rows = _held_out_decode_rows()
    assert rows, "the saved validation holds out no GPU decode point"
    e = prediction.workload_error("decode", "gpu")
    assert e["n"] == len(rows)
    assert e["median"] == pytest.approx(statistics.median(abs(r["error"]) for r in rows))
    worst = max(max(1 + r["error"], 1 / (1 + r["error"])) for r in rows)
    assert e["worst"] == pytest.approx(worst)
    text = prediction.workload_statement("decode", "gpu")
    assert f"on {len(rows)} held-out published decode points" in text
    assert f"{e['median']:.0%} median" in text
    assert "not measured" in prediction.workload_statement("decode", "tpu")


def test_the_h100_output_token_cost_is_the_decode_steps_not_this_cpus_roof_share(monkeypatch):
    """C18/C21 price an H100's decode step at a server's batch by the step-time model of that
    step compiled for the H100 (as the published decode points are predicted), never from the
    share of the memory roof a CPU reached at batch 1: the share is context, and two shares
    give the same figures."""
    from experiments import inference

    step_s, asked = 0.025, []

    def fake(point, cache_dir=None):
        asked.append(point)
        batch = point["lab_config"]["plan_batch"]
        return {
            "seconds": step_s,
            "breakdown": {},
            "collective_s": 0.0,
            "figure": batch / step_s,
            "statement": "unused",
            "program": {},
        }

    monkeypatch.setattr(prediction, "predict_with_fit", fake)
    low, high = inference._output_token_cost(0.3, 0.05), inference._output_token_cost(0.3, 0.9)
    metrics = ("usd_per_m_output_tokens_7b", "output_input_cost_ratio")
    metrics += ("usd_per_m_output_tokens_70b",)
    assert [r["config"]["metric"] for r in low] == list(metrics)
    assert [r["value"] for r in low] == [r["value"] for r in high]
    h100 = specs.SPECS["h100-sxm"]
    for r in (low[0], low[2]):
        c = r["config"]
        assert r["label"] == "predicted" and c["tokens_per_s"] == pytest.approx(c["batch"] / step_s)
        usd = c["gpus"] * h100.price_usd_per_hour / (c["batch"] / step_s * 3600) * 1e6
        assert r["value"] == pytest.approx(usd)
        assert c["model_error"] == prediction.workload_statement("decode", "gpu")
        assert c["context"]["memory_roof_share_here"] == 0.05
        assert "memory_roof_share" not in c.get("inputs", {})
    assert low[1]["config"]["decode_tokens_per_s"] == low[0]["config"]["tokens_per_s"]
    # the points asked for: lab.serve's decode step at the record's batch, tensor parallel
    seven, seventy = asked[0], asked[1]
    assert seven["workload"] == "decode" and seven["hardware"] == {"kind": "h100", "chips": 1}
    assert seven["lab_config"]["plan_batch"] == low[0]["config"]["batch"]
    assert seven["lab_config"]["plan_context"] == inference.SERVE_CONTEXT
    assert seventy["lab_config"]["target"] == "gpu:h100:2"
    assert seventy["lab_config"]["mesh"] == "model:2"


def test_without_a_compiler_the_output_token_cost_has_no_figure(monkeypatch):
    """No other rule stands in for the decode step's model: a context record says why."""
    from experiments import inference

    monkeypatch.setattr(prediction, "predict_with_fit", lambda point, cache_dir=None: None)
    recs = inference._output_token_cost(0.3, 0.05)
    assert [r["config"]["metric"] for r in recs] == [None, None]
    assert all(r["value"] is None and "not predicted" in r["what"] for r in recs)


@pytest.mark.slow_plan
def test_the_ledgers_decode_step_is_predicted_as_the_published_decode_point(tmp_path, monkeypatch):
    """The ledger's decode prediction is the validation's machinery: the published A100 batch-60
    point's configuration through predicted_decode gives the validation's prediction (bf16
    for the point's fp16: the same bytes and peak). (The H100 7B step the ledger predicts is
    checked on the tiny ledger's own record: tests/test_experiments.py.)"""
    pytest.importorskip("jax_plugins.xla_cuda13", reason="the gpu-plan extra compiles for H100")

    cached = functools.partial(prediction.predict_with_fit, cache_dir=tmp_path)
    monkeypatch.setattr(prediction, "predict_with_fit", cached)
    (point,) = prediction.load_points(("trtllm-a100-llama7b-decode-bs60",))
    (row,) = [r for r in prediction.saved_rows() if r.id == point["id"]]
    lc = point["lab_config"]
    a100 = common.predicted_decode(
        "a100-sxm4-80gb", lc["model"], 1, lc["plan_batch"], lc["plan_context"]
    )
    assert a100["tokens_per_s"] == pytest.approx(row.predicted, rel=0.02)

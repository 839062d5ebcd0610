"""The prediction's validation: published points compiled for their targets and compared in
the publisher's unit, the calibration named by rule, the held-out error computed apart; and
the self-check on this CPU (lab.run prints and saves the prediction beside the measurement)."""

import json
import os
import time
from pathlib import Path

import pytest

from lab.errors import ConfigError
from lab.measure import records
from lab.run import main as train
from lab.studies import prediction
from lab.tools.prediction import main as tool


def test_the_published_points_are_data_with_sources():
    points = prediction.load_points()
    assert len(points) >= 24 and len({p["publisher"] for p in points}) >= 4
    for p in points:
        assert p["quote"].strip() and p["source"].strip(), p["id"]
        assert p["usable"] or p["why_not"], p["id"]
        if (p.get("lab_program") or {}).get("op") == "matmul":  # the bytes it writes
            assert p["lab_program"].get("out_dtype"), p["id"]
    calib = prediction.calibration_ids(points)
    groups = {prediction.model_view(p) for p in points if p["id"] in calib}
    assert len(groups) == len(calib)  # one calibration point per group the model sees alike
    # an H200 and an H100 share their peaks and NVLink: a product or an all-reduce on one is
    # the model's twin of the other's, so one calibrates and the rest are held out
    by_id = {p["id"]: p for p in points}
    twins = ["azure-h100-gemm-fp8-8192", "azure-h200-gemm-fp8-6144x12288x12288"]
    assert prediction.model_view(by_id[twins[0]]) == prediction.model_view(by_id[twins[1]])
    assert not set(twins) <= calib
    copies = ["azure-h100-hbm-copy", "azure-h200-hbm-copy"]  # their bandwidths differ
    assert prediction.model_view(by_id[copies[0]]) != prediction.model_view(by_id[copies[1]])


def test_unknown_points_are_one_line(capsys):
    assert tool(["only=nope", "save=false"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no such point" in err


def test_gpu_op_points_compile_and_predict(tmp_path, capsys):
    """GEMM, copy and all-reduce points compiled for H100 / A100 here: each predicted in its
    own unit, calibration and held-out apart, the last line the held-out error."""
    pytest.importorskip("jax_plugins.xla_cuda13", reason="the gpu-plan extra compiles for H100")
    only = [
        "azure-a100-gemm-fp16-8192",
        "azure-h100-gemm-fp8-8192",
        "azure-h100-hbm-copy",
        "azure-h100x8-allreduce-64m",
        "azure-h100x8-allreduce-1m",
    ]
    argv = [f"only={','.join(only)}", f"cache_dir={tmp_path}", f"out_dir={tmp_path}"]
    assert tool([*argv, "save=false"]) == 0
    # named for the points' hardware, not this host's backend
    assert list(tmp_path.glob("prediction-gpu-*.png"))
    assert list(tmp_path.glob("prediction-gpu-*.jsonl"))
    out = capsys.readouterr().out
    assert "held-out:" in out.splitlines()[-1]
    summary = prediction.run(prediction.load_points(tuple(only)), tmp_path)  # from the cache
    calib = prediction.calibration_ids(prediction.load_points())  # the rule, over the file
    for r in summary.rows:
        assert r.role == ("calibration" if r.id in calib else "held-out"), r
    assert {r.role for r in summary.rows} == {"calibration", "held-out"}
    for r in summary.rows:
        assert r.predicted and 0.2 < r.predicted / r.published < 5, r
    # only= predicts with the saved fit of every point, not one fitted on the few chosen
    assert "only=: predicted with the saved fit" in out
    saved = prediction.run(
        prediction.load_points(tuple(only)), tmp_path, fits={"gpu": _saved_gpu_fit()}
    )
    (path,) = tmp_path.glob("prediction-*.jsonl")
    written = {
        r["config"]["point"]: r["value"]
        for r in records.read_records(path)
        if r["what"] == "predicted published point"
    }
    assert written == pytest.approx({r.id: r.predicted for r in saved.rows if r.predicted})
    refit = {r.id: r.predicted for r in summary.rows}
    assert any(written[i] != pytest.approx(refit[i], rel=1e-3) for i in written)


def _saved_gpu_fit() -> dict:
    from lab.predict import step

    return step.fits()["gpu"]["fit"]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["configs=1"], "configs= is for here=true"),
        (["stop_after=60"], "stop_after= is for here=true"),
        (["cpu=true", "loo=true"], "cpu=true and loo=true: choose one"),
        (["cpu=true", "only=azure-h100-hbm-copy"], "only= picks published points"),
        (["budget=1"], "budget= times steps"),
        (["cpu=true", "cache_dir=/tmp/x"], "cache_dir= holds the published points' programs"),
        (["loo=true", "out_dir=/tmp/x"], "out_dir= is where records go; loo=true"),
        # typed at its default, a key the mode does not read is still refused
        # ... and named as typed: results= is out_dir='s earlier name
        (["loo=true", "results=results"], " results= is where records go; loo=true"),
        (["budget=2.0"], "budget= times steps"),
        (["only=azure-h100-gemm-fp8-819"], "(did you mean azure-h100-gemm-fp8-8192?)"),
    ],
)
def test_keys_the_mode_would_ignore_are_one_line(argv, needle, capsys):
    assert tool([*argv, "save=false"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_save_typed_with_only_is_refused_since_only_writes_no_fit(capsys):
    """only= predicts with the saved fit and writes none: save=true typed beside it (its
    default, left out, is not) would say a fit was kept where none is."""
    assert tool(["only=azure-h100-gemm-fp8-8192", "save=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "only= predicts with the saved fit" in err, err


def test_a_publishers_tflops_turn_into_a_step_with_the_publishers_count():
    """A point whose publisher counted every (query, key) pair is converted with that count;
    the others with the lab's causal one. The all-pairs count is Megatron-LM's formula of the
    time for its 7.1B row (12·L·h²·(1 + 3F/2h + g/a + s/h + V/2Lh) per token, SwiGLU of width
    F), up to the norms' weights."""
    import jax

    from lab.config import make_config
    from lab.measure.cost import transformer_flops_per_token
    from lab.model import build, count_nonembedding_params

    point = next(p for p in prediction.load_points() if p["id"] == "megatron-h100-7.1b")
    assert point["setup"]["attention_flops"].startswith("non-causal")
    keys = ("model", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab_size")
    lab = point["lab_config"]
    cfg = make_config(
        **{k: lab[k] for k in keys}, tie_embeddings=False, seq_len=lab["seq_len"], dtype="float32"
    )
    m = cfg.model
    tokens = jax.ShapeDtypeStruct((1, 8), "int32")
    params = jax.eval_shape(build(m).init, jax.random.key(0), tokens)["params"]
    n = count_nonembedding_params(params, m)
    ours = transformer_flops_per_token(n, m.n_layers, cfg.seq_len, m.d_model)
    h, L, s, V, F = m.d_model, m.n_layers, cfg.seq_len, m.vocab_size, m.d_ff
    megatron = 12 * L * h * h * (1 + 1.5 * F / h + 1 + s / h + V / (2 * L * h))
    assert ours == pytest.approx(megatron, rel=1e-4)

    p = object.__new__(prediction.Predictor)  # the choice alone: no program to parse
    p.prog = {"model_flops": 1.0, "model_flops_all_pairs": 1.075}
    p.point = point
    assert p.model_flops == 1.075
    p.point = {**point, "setup": {}}
    assert p.model_flops == 1.0


def test_an_all_reduce_point_reduces_in_place():
    """nccl-tests reduces the buffer it is given; XLA copies an input it may not overwrite
    first (a read and a write of the whole buffer): the point's program is donated."""
    pytest.importorskip("jax_plugins.xla_cuda13", reason="the gpu-plan extra compiles for H100")
    point = next(p for p in prediction.load_points() if p["id"] == "azure-h100x8-allreduce-1m")
    text = prediction._op_program(point)["hlo"]
    assert "all-reduce" in text and " copy(" not in text, text


@pytest.mark.parametrize(
    "damage",
    [
        '{"hlo": "HloModule cut sh',  # a kill mid-write, before writes were whole
        '{"hlo": 5}',  # valid JSON of another shape: a hand edit, a damaged disk
        "{}",
        "[]",
        "edited",  # a whole entry whose figure was changed after it was written
    ],
)
def test_a_cached_program_cut_short_or_changed_is_compiled_again(tmp_path, monkeypatch, damage):
    """A cache file a kill cut short, or one changed since the compile wrote it, is a miss
    (not a traceback, nor a point dropped for good); a new one is written whole (aside, then
    renamed)."""
    point = next(
        p for p in prediction.load_points() if p["workload"] not in ("train", "decode", "prefill")
    )
    path = tmp_path / f"{point['id']}-{prediction._key(point)}.json"
    if damage == "edited":
        monkeypatch.setattr(
            prediction, "_op_program", lambda p: {"hlo": "HloModule m", "bytes": 1.0}
        )
        prediction.program(point, tmp_path)
        damage = path.read_text().replace('"bytes": 1.0', '"bytes": 2.0')
        assert damage != path.read_text()
    path.write_text(damage)
    calls = []
    monkeypatch.setattr(
        prediction, "_op_program", lambda p: calls.append(p) or {"hlo": "HloModule m", "bytes": 1.0}
    )
    out = prediction.program(point, tmp_path)
    assert calls and out["hlo"] == "HloModule m"
    assert json.loads(path.read_text())["hlo"] == "HloModule m"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left


def test_a_cache_that_cannot_be_written_still_gives_the_program(tmp_path, monkeypatch, capsys):
    """The ledger run from a folder it cannot write: the plan is still compiled and used (it
    was dropped without a word), with one warning that it is not cached."""
    point = next(
        p for p in prediction.load_points() if p["workload"] not in ("train", "decode", "prefill")
    )
    monkeypatch.setattr(prediction, "_op_program", lambda p: {"hlo": "HloModule m", "bytes": 1.0})
    (tmp_path / "file").write_text("")
    for _ in range(2):
        out = prediction.program(point, tmp_path / "file" / "cache")
        assert out["hlo"] == "HloModule m"
    err = capsys.readouterr().err
    assert err.count("warning: compiled programs are not cached in") == 1, err


def test_lab_run_prints_and_saves_the_prediction_beside_the_measurement(tmp_path, capsys):
    """A CPU run: the model fed with this host's measured ceilings predicts the step; the
    summary keeps both. (How close they are is a benchmark: python -m lab.tools.prediction
    cpu=true; here only a gross bound, since CI hosts are noisy.)"""
    argv = ["model=tiny", "steps=8", "mesh=4x2", f"out_dir={tmp_path}", "name=p"]
    assert train(argv) == 0
    assert "predicted step time" in capsys.readouterr().out
    s = json.loads((tmp_path / "p" / "summary.json").read_text())
    p = s["predicted_step_time"]
    assert p["label"] == "predicted" and p["seconds"] > 0
    assert sum(p["breakdown"].values()) == pytest.approx(p["seconds"])
    assert 0.05 < p["ratio_to_measured"] < 20, p


@pytest.mark.once
def test_cpu_check_fits_on_calibration_and_reports_held_out():
    configs = (
        dict(model="tiny", mesh="1"),
        dict(model="tiny", mesh="1", seq_len=256),
        dict(model="tiny", mesh="4x2"),
    )
    rows, fit = prediction.cpu_check(configs, calibration=2, budget_s=0.3)
    assert [r.role for r in rows] == ["calibration", "calibration", "held-out"]
    assert set(fit) >= {"compute_efficiency", "memory_efficiency", "op_overhead_s"}
    assert all(r.predicted_s > 0 and r.measured_s > 0 for r in rows)
    assert "held-out: 1 configurations" in prediction.cpu_error_line(rows)


def test_here_check_predicts_each_step_from_its_own_program_and_keeps_going():
    """The device check's machinery on this CPU: each configuration timed and predicted from
    its compiled program, rows shown as they come, a failing configuration a row with its
    reason (the others still measured)."""
    seen = []
    configs = (dict(model="tiny", mesh="1"), dict(model="tiny", mesh="1", attention="bogus"))
    rows = prediction.here_check(configs, budget_s=0.2, on_row=seen.append)
    assert seen == rows and len(rows) == 2
    good, bad = rows
    assert good.measured_s > 0 and good.predicted_s > 0 and good.error is not None
    assert sum(good.breakdown.values()) == pytest.approx(good.predicted_s)
    assert bad.error is None and "bogus" in bad.error_text
    assert "1 configurations" in prediction.here_error_line(rows, "cpu")


def test_here_ops_time_and_predict_each_op_and_keep_going():
    """The single-op check's machinery on this CPU: a product and a copy timed (blocked and
    queued) and predicted from their own programs; a dtype the device cannot take is a row
    with its reason; nothing starts after the deadline."""
    ops = (
        dict(op="matmul", m=96, n=160, k=64, dtype="float32"),
        dict(op="matmul", m=8, n=8, k=8, dtype="no-such-dtype"),
        dict(op="copy", n=1 << 16, dtype="float32"),
    )
    seen = []
    rows = prediction.here_ops(ops, budget_s=0.05, on_row=seen.append)
    assert seen == rows and [r.config for r in rows] == [
        "matmul 96×160×64 float32",
        "matmul 8×8×8 no-such-dtype",
        "copy 0.00 GB float32",
    ]
    for r in (rows[0], rows[2]):
        assert r.measured_s > 0 and r.pipelined_s > 0 and r.predicted_s > 0
        assert sum(r.breakdown.values()) == pytest.approx(r.predicted_s)
        assert r.top_ops and r.top_ops[0]["flops" if r is rows[0] else "bytes"] > 0
    assert rows[0].top_ops[0]["flops"] == 2 * 96 * 160 * 64
    assert rows[1].error is None and "no-such-dtype" in rows[1].error_text
    assert "2 ops" in prediction.here_error_line(rows, "cpu", "ops")
    late = time.monotonic() - 1
    assert prediction.here_ops(ops, deadline=late) == []
    assert prediction.here_check((dict(model="tiny", mesh="1"),), deadline=late) == []


def test_queued_timing_waits_once_per_run(monkeypatch):
    """bench(inner=N), the ops' queued time: N calls back to back per run, one wait per run
    (after the first call's, which is the compile's)."""
    from lab.measure import timing

    made, waits = [], []
    monkeypatch.setattr(timing.jax, "block_until_ready", lambda r: waits.append(r) or r)
    fn = lambda x: made.append(x) or len(made)  # noqa: E731
    r = timing.bench(fn, 7, warmup=0, min_runs=3, max_runs=3, budget_s=0.0, inner=25)
    assert len(made) == 76 and waits == [1, 26, 51, 76] and r.runs == 3
    with pytest.raises(ValueError, match="inner=0"):
        timing.bench(fn, 7, inner=0)


def test_here_on_a_gpu_writes_ops_and_steps_apart_and_stops_in_time(monkeypatch, tmp_path, capsys):
    """The tool's device check end to end, on this CPU presented as an H100: the ops' rows
    (blocked and queued times, predicted on the H100's spec entry) go to <device>-ops.jsonl,
    the steps' to <device>.jsonl, both tables print; stop_after leaves the rest unmeasured."""
    import dataclasses

    from lab import devices
    from lab.predict import step

    real = devices.describe
    h100 = "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(
        devices, "describe", lambda: dataclasses.replace(real(), backend="gpu", device_kind=h100)
    )
    ops = (
        dict(op="matmul", m=64, n=96, k=32, dtype="float32"),
        dict(op="copy", n=4096, dtype="float32"),
    )
    monkeypatch.setattr(prediction, "GPU_OPS", ops)
    monkeypatch.setattr(prediction, "GPU_CONFIGS", (dict(model="tiny", mesh="1"),))
    monkeypatch.setattr(step, "MEASURED", tmp_path / "measured")
    (tmp_path / "measured").mkdir()
    assert tool(["here=true", "budget=0.1", f"out_dir={tmp_path / 'out'}"]) == 0
    out = capsys.readouterr().out
    assert "single ops on NVIDIA H100" in out and "step-time model on NVIDIA H100" in out
    assert "held-out on NVIDIA H100 80GB HBM3: 2 ops" in out and "1 configurations" in out
    read = lambda f: [json.loads(x) for x in f.read_text().splitlines()]  # noqa: E731
    op_recs = read(tmp_path / "measured" / "nvidia-h100-80gb-hbm3-ops.jsonl")
    step_recs = read(tmp_path / "measured" / "nvidia-h100-80gb-hbm3.jsonl")
    assert [r["what"] for r in op_recs] == [step.OP_CHECK] * 2
    assert all(r["config"]["pipelined_s"] > 0 and r["config"]["predicted_s"] > 0 for r in op_recs)
    assert [r["what"] for r in step_recs] == [step.STEP_CHECK]
    (check,) = step.device_checks(tmp_path / "measured").values()
    assert check["n"] == 1  # the step only: the ops' checks are not a step's error
    (recs,) = (tmp_path / "out").glob("prediction-here-*.jsonl")
    assert len(read(recs)) == 3
    assert tool(["here=true", "save=false", "stop_after=0.000001", f"out_dir={tmp_path}"]) == 0
    assert "3 not measured" in capsys.readouterr().out


def test_device_checks_state_the_error_of_steps_measured_on_a_device(tmp_path):
    from lab.predict import step

    def rec(measured, predicted, kind="NVIDIA H100 80GB HBM3", backend="gpu"):
        cfg = {"predicted_s": predicted, "config": "model=base"}
        return {"value": measured, "config": cfg, "device_kind": kind, "backend": backend,
                "timestamp": "2026-11-27T01:31:18+00:00"}  # fmt: skip

    op = dict(rec(0.1, 0.01), what=step.OP_CHECK)  # a single op's check: not a step
    lines = [rec(0.1, 0.08), rec(0.2, 0.22), rec(0.1, 0.1), rec(None, 0.1), rec(0.3, None), op]
    (tmp_path / "h100.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + "{bad\n")
    (tmp_path / "v5e.jsonl").write_text(json.dumps(rec(1.0, 2.0, "TPU v5 lite", "tpu")) + "\n")
    checks = step.device_checks(tmp_path)
    h100 = checks["NVIDIA H100 80GB HBM3"]
    assert h100["n"] == 3 and h100["dates"] == ["2026-11-27"]
    assert h100["median"] == pytest.approx(0.1) and h100["worst"] == pytest.approx(1.25)
    assert checks["TPU v5 lite"]["worst"] == pytest.approx(2.0)
    assert step.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_gpu_predictions_cite_the_steps_measured_on_a_gpu():
    """The shipped device checks (lab/predict/measured/) reach every GPU prediction's error."""
    from lab.predict import step

    checks = step.device_checks()
    gpu = [k for k, c in checks.items() if c["backend"] == "gpu"]
    assert gpu, "no GPU step measurements shipped in lab/predict/measured/"
    text = step.error_statement("gpu")
    assert f"measured on an {gpu[0]}" in text and "lab.run steps" in text
    assert "measured on" not in step.error_statement("cpu")


def test_leave_one_out_over_chosen_points_is_one_line(capsys):
    assert tool(["loo=true", "only=azure-h100-hbm-copy"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "only=" in err


@pytest.mark.parametrize(
    "argv", [["loo=true", "only=x"], ["only=nope"], ["loo=true", "only=azure-h100-hbm-copy"]]
)
def test_a_refusal_makes_no_folder(argv, tmp_path, monkeypatch, capsys):
    """A mistake is refused before anything is written: not even the default cache folder."""
    monkeypatch.chdir(tmp_path)
    assert tool(argv) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [["only=azure-h100-hbm-copy"], ["loo=true"]])
def test_a_stop_while_compiling_says_the_cache_keeps_the_programs(
    argv, tmp_path, monkeypatch, capsys
):
    """Each program is cached as it is compiled: a signal's line says so, not "nothing was
    written"."""
    from lab import startup

    said = []

    def stopped(*_a, **_k):
        said.append(startup._kept[0])
        raise ConfigError("stopped")

    monkeypatch.setattr(startup, "_kept", ["nothing was written"])
    monkeypatch.setattr(prediction, "run", stopped)
    monkeypatch.setattr(prediction, "leave_one_out", stopped)
    monkeypatch.chdir(tmp_path)
    assert tool([*argv, "save=false"]) == 2
    kept = "the programs compiled so far are kept in results/prediction-cache for the next run"
    assert said == [kept]


@pytest.mark.parametrize("argv", [[], ["only=azure-h100-hbm-copy,azure-h100-gemm-fp8-8192"]])
def test_the_bar_ends_at_its_total_and_cuts_labels_between_words(argv, tmp_path, monkeypatch):
    """The bar counts what run reports (a compile per point, a fit per vendor calibrated, none
    with only=), and a long label is cut after a whole word."""
    from lab.report import progress

    told = {}

    def predictors(points, cache_dir, tick):  # every point "compiled", none usable: no compile
        for p in points:
            if prediction._expressible(p) is None:
                text = f"compile {p['id']} model=small mesh=2x2x2 strategy=fsdp dtype=bfloat16"
                told[p["id"]] = text
                tick(text)
        return {}, {}

    bars, said = [], []

    class Tasks(progress._Tasks):
        def update(self, task_id, *, description=None, **kwargs):
            said.append(description)
            super().update(task_id, description=description, **kwargs)

    def tasks(con):
        bars.append(Tasks(progress.TextColumn("{task.description}"), console=con))
        return bars[-1]

    monkeypatch.setattr(prediction, "_predictors", predictors)
    monkeypatch.setattr(progress, "tasks", tasks)
    assert tool([*argv, "save=false", f"out_dir={tmp_path}", f"cache_dir={tmp_path}/c"]) == 0
    (task,) = bars[0].tasks
    assert task.total == task.completed > 0
    shown = [d for d in said if d and d.startswith("compile")]
    assert shown and all(len(d) <= 60 and d.endswith(" …") for d in shown), shown
    for d in shown:  # whole words: the text goes on with a space where the label stops
        assert told[d.split()[1]].startswith(d[:-2] + " "), d


def test_the_cpu_check_writes_its_step_times_as_records(tmp_path, monkeypatch, capsys):
    """cpu=true measures lab.run steps here: the figures are kept as records, not only shown."""
    fit = {"compute_efficiency": 0.5, "memory_efficiency": 0.5, "op_overhead_s": 1e-5}
    rows = [
        prediction.CpuRow("model=tiny mesh=1", 0.010, 0.011, "calibration"),
        prediction.CpuRow("model=tiny mesh=4x2", 0.020, 0.018, "held-out"),
    ]
    monkeypatch.setattr(prediction, "cpu_check", lambda **_k: (rows, fit))
    # results= is out_dir='s earlier name, still read (commands kept in BENCHMARKS.md use it)
    assert tool(["cpu=true", "save=false", f"results={tmp_path}"]) == 0
    (path,) = tmp_path.glob("prediction-cpu-*.jsonl")
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r["value"], r["label"], r["config"]["role"]) for r in recs] == [
        (0.010, "measured", "calibration"),
        (0.020, "measured", "held-out"),
    ]
    assert recs[1]["config"]["predicted_s"] == 0.018 and recs[1]["config"]["fit"] == fit
    assert f"records → {path}" in capsys.readouterr().out


def test_other_work_that_starts_during_the_cpu_check_keeps_its_fit_unsaved(
    tmp_path, monkeypatch, capsys
):
    """A host quiet at the start but shared while the self-check ran (another process busy
    on the cores) is seen after it: the fit, which lab.run quotes, is not saved."""
    import subprocess
    import sys

    if records._cpu_seconds() is None:
        pytest.skip("/proc/stat: Linux only")
    fit = {"compute_efficiency": 0.5, "memory_efficiency": 0.5, "op_overhead_s": 1e-5}
    rows = [prediction.CpuRow("model=tiny mesh=1", 0.010, 0.011, "calibration")]
    spin = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"
    spinners = []

    def check(**_k):  # other processes (not this one's waited-for children) busy on every core
        n = os.cpu_count() or 1
        spinners.extend(subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n))
        time.sleep(1.5)
        return rows, fit

    saved = []
    monkeypatch.setattr(records, "busy_host", lambda: None)  # quiet when it starts
    monkeypatch.setattr(prediction, "cpu_check", check)
    monkeypatch.setattr(prediction, "save_cpu_fit", lambda *a: saved.append(a) or "fits.json")
    try:
        assert tool(["cpu=true", f"out_dir={tmp_path}"]) == 0
    finally:
        for p in spinners:
            p.wait()
    out = capsys.readouterr().out
    assert "other work took" in out and "while the self-check ran" in out, out
    assert "fit not saved: the host was busy" in out and not saved


def test_here_on_cpu_is_one_line(capsys):
    assert tool(["here=true"]) == 2
    assert "accelerator" in capsys.readouterr().err


def test_a_failure_that_is_not_the_compilers_is_never_cached(tmp_path, monkeypatch):
    """Only the compiler's own refusal of a point is kept in the cache: a failure of the lab
    (an import error, a bug) is shown for this run and tried again next time."""
    point = prediction.load_points(("azure-h100-gemm-fp8-8192",))[0]

    def broken(point):
        raise ImportError("cannot import name 'x'")

    monkeypatch.setattr(prediction, "_op_program", broken)
    with pytest.raises(ImportError):
        prediction.program(point, tmp_path)
    assert not list(tmp_path.iterdir())
    summary = prediction.run([point], tmp_path)
    row = next(r for r in summary.rows if r.id == point["id"])
    assert "not cached" in (row.note or "") and not list(tmp_path.iterdir())


def test_a_program_cached_by_other_lab_code_is_compiled_again(tmp_path, monkeypatch):
    """The cache key holds a hash of the lab code that builds programs: a change to the
    model, its kernels or its sharding never reuses a program the old code compiled (the
    timing model, lab/predict/model.py and machines.py, is left out: refitting keeps the
    cache)."""
    point = prediction.load_points(("azure-h100-gemm-fp8-8192",))[0]
    calls = []
    monkeypatch.setattr(prediction, "_op_program", lambda p: calls.append(p) or {"hlo": "x"})
    prediction.program(point, tmp_path)
    prediction.program(point, tmp_path)  # cached
    assert len(calls) == 1
    monkeypatch.setattr(prediction, "program_source", lambda: "other code")
    prediction.program(point, tmp_path)
    assert len(calls) == 2 and len(list(tmp_path.iterdir())) == 2
    root = Path(prediction.__file__).resolve().parents[1]
    assert all((root / p).exists() for p in prediction._NOT_PROGRAM)  # the left-out code
    assert "predict/step.py" not in prediction._NOT_PROGRAM  # its FLOPs are cached


def test_a_serving_point_whose_batch_does_not_split_is_one_line(tmp_path):
    """A serving point is resolved for decoding its batch as lab.serve resolves it: a batch
    that does not split over the mesh's batch axes is the resolver's one line, not a failed
    assertion inside the decoder."""
    point = {
        "id": "bad-batch",
        "workload": "decode",
        "lab_config": {"module": "lab.serve", "model": "tiny", "mesh": "data:2"},
    }
    point["lab_config"] |= {"plan_batch": 3, "plan_context": 16}
    with pytest.raises(ConfigError) as e:
        prediction.program(point, tmp_path)
    assert len(str(e.value).splitlines()) == 1 and "batches [3]" in str(e.value)
    assert not list(tmp_path.iterdir())  # nothing cached


def test_a_gpu_step_larger_than_the_chip_is_dropped_not_predicted():
    """XLA:GPU compiles a step its HBM cannot hold (it only warns), so the study checks the
    compiled step's bytes against the spec's HBM, as XLA:TPU's refusal does: such a program is
    not the published run (which fitted), and the point is dropped with the reason."""
    point = next(p for p in prediction.load_points() if p["id"] == "megatron-h100-1.7b")
    assert prediction._needs_memory(point)
    assert prediction.too_big(point, {"memory_bytes": 79e9}) is None
    why = prediction.too_big(point, {"memory_bytes": 89.6e9})
    assert why == "the compiled step needs 89.6 GB, 80 GB available"
    assert "dropped, not bent" in prediction.why_refused(point, why)


def test_a_gemm_point_is_written_in_its_benchmarks_output_dtype():
    """Azure's cuBLASLt benchmark writes fp8 products in float16 (accumulated in f32): the lab's
    program for such a point keeps the fp8 operands (timed at the fp8 peak) and writes 2 bytes
    per output element, where the default writes float32's 4."""
    pytest.importorskip("jax_plugins.xla_cuda13", reason="the gpu-plan extra compiles for H100")
    from lab.measure import hlo, specs
    from lab.predict import machines
    from lab.predict.model import predict

    m = n = k = 2048  # compute-bound at the fp8 peak, twice as long at float16's
    prog = dict(op="matmul", m=m, n=n, k=k, dtype="float8_e4m3fn", target="gpu:h100")
    h100 = machines.gpu_machine(specs.lookup("NVIDIA H100 80GB HBM3"), {"data": 1})  # roofline
    for out, size in (("float16", 2), (None, 4)):
        lab_program = {**prog, **({"out_dtype": out} if out else {})}
        program = hlo.parse(prediction._op_program({"id": "t", "lab_program": lab_program})["hlo"])
        (op,) = [o for o in predict(program, h100).ops if o.flops]
        assert op.flops == pytest.approx(2.0 * m * n * k)
        assert op.bytes == pytest.approx(m * k + k * n + size * m * n)
        at_fp8 = max(op.flops / h100.peak("float8"), op.bytes / h100.memory_bandwidth)
        assert op.seconds == pytest.approx(at_fp8), out


def test_a_cache_that_cannot_be_written_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    for argv in ([f"cache_dir={blocker}"], ["loo=true", f"cache_dir={blocker}"]):
        assert tool([*argv, "save=false"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"error: cannot write to '{blocker}': it is not a folder", err


def test_a_fit_is_not_saved_over_points_that_failed_to_compile(tmp_path, monkeypatch):
    """Points whose programs cannot be compiled here leave lab/predict/fits.json as it was:
    a fit of nothing would replace the published points' fit with none."""
    from lab.studies import prediction

    points = prediction.load_points()[:2]
    monkeypatch.setattr(prediction, "load_points", lambda ids=(): points)
    fits = tmp_path / "fits.json"
    fits.write_text('{"gpu": {"fit": {"compute_efficiency": 0.5}}}')
    monkeypatch.setattr(prediction, "FITS", fits)

    def broken(point, cache_dir):  # a compile that fails here (not the compiler's refusal)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prediction, "program", broken)
    summary = prediction.run(points, tmp_path, write_fits=True)
    assert prediction.failed_here(summary)
    assert fits.read_text() == '{"gpu": {"fit": {"compute_efficiency": 0.5}}}'


def test_a_fit_is_not_saved_where_a_compiler_is_missing(tmp_path, monkeypatch):
    """A point refused for want of a compiler here (no gpu-plan extra, no libtpu: a
    ConfigError) keeps the saved fit as well."""
    from lab.errors import ConfigError
    from lab.studies import prediction

    points = prediction.load_points()
    monkeypatch.setattr(prediction, "load_points", lambda ids=(): points)
    fits = tmp_path / "fits.json"
    fits.write_text('{"gpu": {"fit": {"compute_efficiency": 0.5}}}')
    monkeypatch.setattr(prediction, "FITS", fits)

    def no_plugin(point, cache_dir):
        raise ConfigError("target=gpu:h100 needs the gpu-plan extra (jax-cuda13-plugin)")

    monkeypatch.setattr(prediction, "program", no_plugin)
    summary = prediction.run(points, tmp_path / "cache", write_fits=True)
    assert prediction.failed_here(summary)
    assert fits.read_text() == '{"gpu": {"fit": {"compute_efficiency": 0.5}}}'


def test_the_tools_progress_counts_a_step_done_when_it_has_ended():
    """The study calls `progress` as each step starts: "1/10 done" printed before anything
    ran. The steps before the one starting are the ones done, and all of them at the end."""
    from lab.tools.prediction import _ticker

    class Bar:
        def __init__(self):
            self.seen = []

        def update(self, task, *, description=None, completed=None, total=None):
            self.seen.append((description, completed, total))

    bar = Bar()
    tick = _ticker(bar, 0)
    tick("compile a")
    tick("compile b")
    tick.done()  # at the end the total is the steps taken: an estimate may have been above
    assert bar.seen == [("compile a", 0, None), ("compile b", 1, None), (None, 2, 2)]


def test_the_table_gives_the_fits_of_the_points_shown():
    """only= a TPU point: the caption gave the GPU's fit, which predicted nothing shown; it
    gives each shown class's fit, and says a class without a calibration point has none."""
    from rich.console import Console

    from lab.measure.fitted import Fit
    from lab.report import tables

    gpu = Fit(0.53, 0.86, 3.5e-6, 42.2e-6, 4.6e-6)
    row = prediction.Row("p", "MaxText", "tpu-v5e × 16", "train", "s", 1.0, 1.2, "held-out")

    def caption(shown):
        console = Console(width=400, record=True)
        console.print(tables.prediction_rows([row], {"gpu": gpu}, shown))
        return " ".join(console.export_text().split())  # the caption wraps to the table

    said = caption(("tpu",))
    assert "tpu: none (no calibration point: the roofline" in said and "gpu:" not in said
    said = caption(("gpu", "tpu"))
    assert "gpu: compute 0.53, memory 0.86, op 3.5 µs, collective 42.2 µs, call 4.6 µs" in said
    assert "tpu: none" in said

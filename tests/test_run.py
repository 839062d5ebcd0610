"""lab.run end to end on CPU: loss falls, resume is exact, failures are one clear line."""

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from lab import checkpoint, summary, train
from lab.run import main

TINY = ["model=tiny", "batch_size=8", "seq_len=32", "log_every=1"]


def _run(tmp_path, *args) -> int:
    return main([*TINY, f"out_dir={tmp_path}", *args])


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def test_loss_falls_on_text_and_summary_is_written(tmp_path):
    assert _run(tmp_path, "name=fall", "steps=40", "lr=1e-2", "data=text", "warmup_steps=2") == 0
    run_dir = tmp_path / "fall"
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["loss_last"] < s["loss_first"] - 1.0
    assert s["steps_run"] == 40 and s["tokens_per_s"] > 0
    assert s["step_time"]["compile_s"] > 0 and s["mfu"] is not None
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["model"]["dtype"] == "float32" and cfg["data"] == "text"
    assert s["environment"]["jax_version"] and s["environment"]["backend"] == "cpu"
    recs = {r["what"]: r for r in map(json.loads, (run_dir / "records.jsonl").open())}
    assert recs["training tokens/s"]["value"] == pytest.approx(s["tokens_per_s"])
    assert recs["training MFU"]["label"] == "derived" and recs["training MFU"]["jax_version"]
    assert recs["training step time"]["config"]["runs"] == 40 - 2  # warm-up steps apart


def test_resume_reproduces_uninterrupted_losses(tmp_path):
    assert _run(tmp_path, "name=full", "steps=8") == 0
    assert _run(tmp_path, "name=cut", "steps=8", "checkpoint_every=4") == 0
    ckpts = tmp_path / "cut" / "checkpoints"
    shutil.rmtree(ckpts / "8")  # as if the run had died after step 4's checkpoint
    assert _run(tmp_path, "name=cut", "steps=8", "resume=true", "checkpoint_every=4") == 0
    full, cut = _losses(tmp_path / "full"), _losses(tmp_path / "cut")
    steps = [json.loads(x)["step"] for x in (tmp_path / "cut" / "metrics.jsonl").open()]
    assert steps == list(range(1, 9))  # steps 5-8 of the first attempt are not repeated
    for step in range(5, 9):
        assert cut[step] == pytest.approx(full[step], rel=1e-6)


def test_corrupt_checkpoint_is_skipped(tmp_path, capsys):
    assert _run(tmp_path, "name=c", "steps=4", "checkpoint_every=2") == 0
    for f in (tmp_path / "c" / "checkpoints" / "4").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    assert _run(tmp_path, "name=c", "steps=4", "resume=true") == 0
    out = capsys.readouterr()
    assert "checkpoint step 4 is damaged" in out.err and "moved to" in out.err
    assert "resumed from checkpoint at step 2" in out.out


def test_nan_loss_stops_with_the_step(tmp_path, capsys):
    assert _run(tmp_path, "name=nan", "steps=6", "lr=1e30", "grad_clip=0", "warmup_steps=0") == 1
    err = capsys.readouterr().err.strip()
    # lr=1e30 overflows the first update's weights, or the next gradient before its loss:
    # any of them stops the run
    stops = ("error: loss is", "error: gradient norm is", "error: weights are")
    assert err.startswith(stops) and "at step" in err, err
    assert len(err.splitlines()) == 1


def test_non_finite_gradient_stops_before_its_update_is_saved(tmp_path, capsys, monkeypatch):
    """A gradient that overflows poisons the update while the loss is still finite: the run
    must stop at that step, and every checkpoint it left must hold finite numbers only."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from lab import checkpoint, train

    real = train.train_step

    def poisoned(state, tokens, **kw):  # step 3's gradient is inf, its loss stays finite
        new, metrics = real(state, tokens, **kw)
        bad = state.step == 2
        poison = lambda x: jnp.where(bad, jnp.inf, x).astype(x.dtype)
        params = jax.tree.map(poison, new.params)
        grad_norm = jnp.where(bad, jnp.inf, metrics["grad_norm"])
        return new.replace(params=params), {**metrics, "grad_norm": grad_norm}

    monkeypatch.setattr(train, "train_step", poisoned)
    assert _run(tmp_path, "name=inf", "steps=6", "checkpoint_every=1") == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: gradient norm is inf at step 3: training stopped"), err
    # how to go on: the same steps from the same checkpoint overflow again, so half the lr
    assert len(err.splitlines()) == 1, err
    assert err.endswith(
        "; to go on with half the learning rate from checkpoint step 2: python -m lab.run "
        f"name=inf out_dir={tmp_path} resume=true lr=0.0015"
    ), err
    mngr = checkpoint.manager(tmp_path / "inf")
    assert sorted(mngr.all_steps()) == [1, 2]
    for step in mngr.all_steps():
        for leaf in jax.tree.leaves(mngr.restore(step)):
            assert np.isfinite(np.asarray(leaf)).all()


def test_memory_too_big_is_refused_before_training(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(summary.memory, "device_capacity_bytes", lambda device: 1024)
    monkeypatch.setattr(summary, "PRECHECK_MARGIN", 1e30)  # the compiled figure decides here
    assert _run(tmp_path, "name=mem", "steps=3", "mesh=4x2") == 2  # before any step: exit 2
    err = capsys.readouterr().err
    assert "simulated devices" in err and "GiB each) but the host has" in err
    assert "smaller batch_size" in err
    assert not (tmp_path / "mem" / "metrics.jsonl").exists()


def test_a_step_far_beyond_the_memory_is_refused_before_its_compile(tmp_path, capsys, monkeypatch):
    """A step the memory calculator puts at many times the memory there is is refused in one
    line before the compile (a minute of it, for a step of terabytes), with the advice the
    compiled check gives; nothing is written."""
    monkeypatch.setattr(summary.memory, "host_available_bytes", lambda: 2**20)
    monkeypatch.setattr(train.Trainer, "lower", lambda self: pytest.fail("the step was compiled"))
    assert _run(tmp_path, "name=huge", "steps=3") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: the memory calculator puts the step at "), err
    assert "what the host has available now (0.0 GiB); not compiled: try a smaller" in err, err
    assert not (tmp_path / "huge").exists()  # nothing written: not even the folder
    # a folder lab.run names itself is not left behind either (each retry made another)
    assert main([*TINY, f"out_dir={tmp_path / 'auto'}", "steps=3"]) == 2
    assert not (tmp_path / "auto").exists() or not list((tmp_path / "auto").iterdir())


def test_compile_only_prints_analysis(tmp_path, capsys):
    assert _run(tmp_path, "name=co", "compile_only=true", "mesh=4x2") == 0
    out = capsys.readouterr().out
    assert "compiled step" in out and "model FLOPs / token" in out
    s = json.loads((tmp_path / "co" / "summary.json").read_text())
    assert s["compiled_memory_per_device"]["total_bytes"] > 0


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    """Its output a file, as a batch job's: the step lines reach it while the run is live, and
    after the stop the last line is the command that resumes the run (which does)."""
    import os
    import shlex
    import signal
    import subprocess
    import sys
    import time

    cmd = [
        sys.executable,
        "-m",
        "lab.run",
        *TINY,
        f"out_dir={tmp_path}",
        "name=sig",
        "steps=100000",
        "checkpoint_every=100000",
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    log = tmp_path / "out.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while time.time() < deadline and "\nstep 1/100000  loss " not in log.read_text():
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    out = log.read_text()
    assert proc.returncode == 143, err
    assert "Traceback" not in err
    assert "SIGTERM: checkpoint saved at step" in out
    (step,) = checkpoint.saved_steps(tmp_path / "sig")
    last = out.splitlines()[-1]
    resume = f"python -m lab.run name=sig out_dir={shlex.quote(str(tmp_path))} resume=true"
    assert last == f"to resume from checkpoint step {step}: {resume}", last
    args = shlex.split(resume)[3:]
    assert main([*args, f"steps={step + 1}"]) == 0  # the run's own keys, one step further
    assert _losses(tmp_path / "sig").keys() == set(range(1, step + 2))


def test_profile_says_where_its_trace_is_and_keeps_its_steps_out_of_the_timing(tmp_path, capsys):
    assert _run(tmp_path, "name=prof", "steps=10", "profile=true") == 0
    folder = tmp_path / "prof" / "profile"
    out = capsys.readouterr().out
    assert f"profile: steps 4-7 traced in {folder}" in out and "ui.perfetto.dev" in out
    assert "steps 4-7 profiled, left out" in out
    s = json.loads((tmp_path / "prof" / "summary.json").read_text())
    assert s["profiled_steps"] == [4, 7]
    assert s["step_time"]["runs"] == 10 - 4 - 2  # the traced steps and the warm-up apart
    traces = list(folder.rglob("*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0
    # the step under its own name, and each traced step marked as one for the viewers
    (events,) = [json.load(gzip.open(f))["traceEvents"] for f in folder.rglob("*.trace.json.gz")]
    names = {e.get("name") for e in events}
    assert "PjitFunction(jit(train_step))" in names and "PjitFunction(jit(wrapped))" not in names
    marked = [e["args"]["step_num"] for e in events if e.get("name") == "train"]
    assert sorted(marked, key=int) == ["4", "5", "6", "7"]


def test_profile_trace_is_closed_and_named_when_the_run_stops_inside_the_window(
    tmp_path, capsys, monkeypatch
):
    from lab import loop

    reads = iter(range(1, 100))  # one check a step read: the fifth is step 5
    monkeypatch.setattr(
        loop, "_non_finite", lambda **_: "loss is nan" if next(reads) == 5 else None
    )
    assert _run(tmp_path, "name=prof", "steps=10", "profile=true") == 1
    out = capsys.readouterr().out
    assert "profile: steps 4-5 traced (the run stopped before step 7)" in out
    traces = list((tmp_path / "prof" / "profile").rglob("*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["steps=3", "profile=true"],
            "profile=true traces steps 4-7 (after the warm-up), and "
            "steps=3 ends before them: give steps >= 7",
        ),
        (["compile_only=true", "profile=true"], "so profile=true would do nothing"),
        (["compile_only=true", "checkpoint_every=5"], "so checkpoint_every=5 would do nothing"),
    ],
)
def test_a_profile_or_checkpoint_that_cannot_happen_is_refused(tmp_path, capsys, args, needle):
    assert _run(tmp_path, "name=never", *args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
    assert not (tmp_path / "never").exists()


def test_a_resume_whose_profile_window_lies_past_its_steps_is_refused(tmp_path, capsys):
    assert _run(tmp_path, "name=r", "steps=4", "checkpoint_every=4") == 0
    capsys.readouterr()
    assert _run(tmp_path, "name=r", "steps=8", "resume=true", "profile=true") == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == (
        "error: profile=true traces steps 8-11 after resuming from checkpoint step 4 (after "
        "the warm-up), and steps=8 ends before them: give steps >= 11"
    )


def test_each_process_of_a_run_profiles_into_its_own_folder(tmp_path, monkeypatch):
    """The profiler names a trace by host and second: two processes on one host would write
    one file; a run of several gives each process its folder."""
    from lab import loop

    assert loop.profile_dir(tmp_path) == tmp_path / "profile"
    monkeypatch.setattr(loop.jax, "process_count", lambda: 2)
    monkeypatch.setattr(loop.jax, "process_index", lambda: 1)
    assert loop.profile_dir(tmp_path) == tmp_path / "profile" / "process-1"


def test_mfu_peak_counts_the_devices_the_mesh_uses():
    """mesh=2 on an 8-GPU host runs on 2 GPUs: MFU is against their peak, not all eight."""
    from lab.config import parse_args
    from lab.devices import DeviceInfo
    from lab.measure import specs

    kind = "NVIDIA H100 80GB HBM3"
    info = DeviceInfo(
        "gpu", kind, count=8, local_count=8, process_count=1, process_index=0, simulated=False
    )
    peak, source = summary.mesh_peak(parse_args(["dtype=bfloat16"]), info, 2)
    assert peak == 2 * specs.peak_flops(kind, "bfloat16") and "× 2 devices" in source


MASKED = ["data=text", "pack=true", "window=8", "window_pattern=local,global", "softcap=20"]


@pytest.mark.parametrize(
    "mesh, extra",
    [("4x2", []), ("2x2x2", ["scan_layers=true"])],  # scanned: each layer's window switched
    ids=["4x2", "2x2x2-scan"],
)
def test_packed_windowed_softcapped_model_trains_as_naive(tmp_path, mesh, extra):
    """Packed documents, a local/global sliding-window pattern and soft-capped logits at once:
    the loss falls, and the default kernel's losses equal the float32 reference's."""
    args = ["n_layers=2", "steps=4", "lr=1e-2", "warmup_steps=1", f"mesh={mesh}", *MASKED, *extra]
    losses = {}
    for impl in ("auto", "naive"):
        assert _run(tmp_path, *args, f"attention={impl}", f"name={impl}", "dtype=float32") == 0
        losses[impl] = _losses(tmp_path / impl)
    assert losses["auto"][4] < losses["auto"][1] - 1.0, losses["auto"]
    steps = sorted(losses["naive"])
    np.testing.assert_allclose(
        [losses["auto"][s] for s in steps], [losses["naive"][s] for s in steps], atol=1e-5, rtol=0
    )
    s = json.loads((tmp_path / "auto" / "summary.json").read_text())
    assert "only unmasked pairs" in s["flops_convention"]


# --- lab.run's lines take the types; summary.json keeps their records ----------------------


def _reading():
    from lab.measure.pipeline import Direction, PipelineReading

    fwd = Direction(ops=1, executions=3, trip_counts=(3,), bytes_per_device=96)
    return PipelineReading(
        stages=2,
        microbatches=2,
        repeats=1,
        microbatch_bytes=32,
        ticks=3,
        bubble=1 / 3,
        bytes_per_device=96,
        useful_bytes=64,
        forward=fwd,
        backward=fwd,
    )


def test_pipeline_line_reads_the_reading_and_its_record_alike():
    from lab.measure.pipeline import PipelineReading
    from lab.report import tables

    p = _reading()
    back = PipelineReading.from_record(json.loads(json.dumps(p.as_dict())))
    assert back == p and back.as_dict() == p.as_dict()
    line = tables.pipeline_line(p)
    assert line == tables.pipeline_line(back)
    assert line.startswith("0.333 analytic") and "0.333 from the compiled schedule" in line
    assert "(3 ticks; GPipe, P=2 stages, M=2)" in line


def _predicted():
    from lab.measure.predicted import OpTime, PredictedStep

    op = lambda name, s, op_name: OpTime(name, "fusion", "compute", 1, 1.0, 1.0, s, s, op_name)
    return PredictedStep(
        seconds=1.0,
        breakdown={"compute": 0.6, "memory": 0.395, "exposed communication": 0.005},
        collective_s=0.01,
        machine="m",
        top_ops=(op("a", 0.5, "jit(step)/dot_general"), op("b", 0.25, ""), op("c", 0.1, "x")),
        error="within 20%",
        machine_source="spec table",
    )


def test_predicted_step_lines_and_record():
    from lab.measure.predicted import PredictedStep
    from lab.report import tables

    p = _predicted()
    r = p.record()
    assert list(r) == [
        "seconds",
        "breakdown",
        "collective_s",
        "machine",
        "top_ops",
        "label",
        "error",
        "machine_source",
    ]
    assert PredictedStep.from_record(json.loads(json.dumps(r))) == p
    assert tables.breakdown_line(p) == "compute 60%, memory 40%"  # under 1% left out
    assert tables.top_ops_line(p) == (
        "a (dot_general, compute) 50%; b (fusion, compute) 25%; c (x, compute) 10%"
    )
    assert tables.top_ops_line(p, n=1) == "a (dot_general, compute) 50%"


def test_offload_line_reads_the_cost_and_its_record_alike():
    from lab.measure.offload import OffloadCost
    from lab.report import tables

    o = OffloadCost(2 * 2**20, 3 * 2**20, 1e9, 1e9, "spec table", 0.005)
    r = o.record()
    assert list(r)[-2:] == ["added_step_s", "label"] and r["label"] == "predicted"
    assert OffloadCost.from_record(json.loads(json.dumps(r))) == o
    assert tables.offload_line(o).startswith("2.0 MiB in, 3.0 MiB out per step: ≤ ")
    none = OffloadCost(2**20, 2**20, None, None, "no spec entry", None)
    assert tables.offload_line(none).endswith("; no host-link bandwidth (no spec entry)")


def test_a_resumed_cpu_run_keeps_the_peak_its_mfu_began_with(tmp_path, monkeypatch):
    """A CPU's measured peak moves with the host's load: measured again at a resume, the MFU
    curve jumped while the step time did not. The resume keeps the first segment's peak."""
    monkeypatch.setattr(summary.ceilings, "matmul_peak", lambda dtype, **kw: 1e11)
    monkeypatch.setattr(summary, "_busy_load", lambda: "")  # the first segment's host is quiet
    assert _run(tmp_path, "name=p", "steps=4", "checkpoint_every=2") == 0
    monkeypatch.setattr(summary.ceilings, "matmul_peak", lambda dtype, **kw: 3e11)
    busy = "; host busy: load 9.0 on 2 cores, CPU figures unreliable"
    monkeypatch.setattr(summary, "_busy_load", lambda: "load 9.0 on 2 cores")  # the resumed's
    assert _run(tmp_path, "name=p", "steps=6", "resume=true") == 0
    s = json.loads((tmp_path / "p" / "summary.json").read_text())
    assert s["peak_flops_per_s"] == 1e11 and "kept across its resumes" in s["peak_source"]
    assert s["peak_source"].endswith(busy)  # a resumed segment's load is still said
    rows = [json.loads(x) for x in (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()]
    for r in rows:  # every logged MFU against the one peak
        assert r["mfu"] == pytest.approx(
            s["model_flops_per_token"] * r["tokens_per_s"] / 1e11, rel=1e-6
        )


def test_a_kept_peak_measured_on_a_busy_host_says_so_once(tmp_path, monkeypatch):
    """The peak a resume keeps was measured under load, and the host is loaded again: one
    'host busy', with the load now."""
    import socket
    from types import SimpleNamespace

    from lab.measure import records

    env = records.environment()
    source = "measured float32 matmul peak of this host (all cores); host busy: load 3.0 on 2"
    (tmp_path / "summary.json").write_text(
        json.dumps(
            {
                "peak_flops_per_s": 1e11,
                "peak_source": source + " cores, CPU figures unreliable",
                "environment": {**env, "hostname": socket.gethostname()},
            }
        )
    )
    cfg = SimpleNamespace(model=SimpleNamespace(dtype="float32"))
    info = SimpleNamespace(backend="cpu")
    for load, tail in [
        ("load 2.2 on 2 cores", "host busy when measured and now: load 2.2 on 2 cores"),
        ("", "host busy when measured"),
    ]:
        monkeypatch.setattr(summary, "_busy_load", lambda load=load: load)
        peak, said = summary.run_peak(cfg, info, 1, resumed_in=tmp_path)
        assert peak == 1e11 and said.endswith(f"resumes; {tail}, CPU figures unreliable"), said
        assert said.count("host busy") == 1


@pytest.mark.parametrize("kept", ["request", "whole config"])
def test_float16_loss_scale_is_shown_and_stored_resolved(tmp_path, capsys, kept):
    assert _run(tmp_path, "name=h", "steps=2", "dtype=float16", "checkpoint_every=2") == 0
    assert "static loss scale 32768" in capsys.readouterr().out
    path = tmp_path / "h" / "config.json"
    saved = json.loads(path.read_text())
    assert saved["loss_scale"] == 2.0**15  # resolved, as dtype and attention are
    # a folder from before: auto (0.0) stored, and for the oldest no request beside it
    saved["loss_scale"] = 0.0
    if kept == "whole config":
        del saved["request"]
    path.write_text(json.dumps(saved))
    # the run's own keys (model=tiny anew would drop the model fields it was asked with)
    assert main([f"out_dir={tmp_path}", "name=h", "steps=3", "resume=true"]) == 0
    out = capsys.readouterr().out
    assert "static loss scale 32768" in out and "float16" in out
    assert "loss_scale 0.0" not in out  # auto then, auto now: not a change to the run
    assert json.loads(path.read_text())["loss_scale"] == 2.0**15


def test_loss_scale_auto_is_stored_as_the_value_used(tmp_path, capsys):
    assert _run(tmp_path, "name=a", "steps=1", "dtype=float16", "loss_scale=auto") == 0
    assert "static loss scale 32768" in capsys.readouterr().out
    assert json.loads((tmp_path / "a" / "config.json").read_text())["loss_scale"] == 2.0**15


def test_no_loss_scale_is_stored_as_one(tmp_path, capsys):
    assert _run(tmp_path, "name=f", "steps=1") == 0
    out = capsys.readouterr().out
    assert "loss scale" not in out
    assert json.loads((tmp_path / "f" / "config.json").read_text())["loss_scale"] == 1.0
    # one step is a warm-up step: its time is not the steady step's, and every figure says so
    assert "one warm-up step timed: not the steady step" in out
    assert json.loads((tmp_path / "f" / "summary.json").read_text())["warmup_timed"] is True
    records = [
        json.loads(x) for x in (tmp_path / "f" / "records.jsonl").read_text().split("\n") if x
    ]
    timed = [r for r in records if r["what"] in ("training step time", "training tokens/s")]
    assert len(timed) == 2 and all("warm-up steps only" in r["config"]["caveat"] for r in timed), (
        timed
    )


def test_summary_and_records_say_how_the_step_was_split(tmp_path, capsys):
    """A dp run and an fsdp one must be told apart from summary.json, records.jsonl and
    metrics.jsonl alone: the resolved strategy, mesh, accumulation and pipeline keys, as
    config.json names them (on every step's line: a run resumed in another layout has lines
    of both in one file). The header says what is split over which axis."""
    args = ["name=fsdp", "steps=2", "mesh=data:2,fsdp:2", "strategy=fsdp", "accumulate=2"]
    assert _run(tmp_path, *args) == 0
    out = capsys.readouterr().out
    assert "strategy=fsdp: batch over data×fsdp, embed over fsdp)" in out, out
    split = {
        "strategy": "fsdp",
        "mesh": {"data": 2, "stage": 1, "fsdp": 2, "model": 1},
        "accumulate": 2,
        "microbatches": 0,  # no pipeline
        "pipeline_repeats": 1,
    }
    run_dir = tmp_path / "fsdp"
    s = json.loads((run_dir / "summary.json").read_text())
    assert {k: s[k] for k in split} == split
    recs = [json.loads(line) for line in (run_dir / "records.jsonl").open()]
    assert {r["what"] for r in recs} >= {"training step time", "training tokens/s"}
    for r in recs:
        assert {k: r["config"][k] for k in split} == split, r["what"]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [x["step"] for x in lines] == [1, 2]
    for line in lines:
        assert {k: line[k] for k in split} == split, line
    # a pipeline's microbatches as resolved (0 asks one per stage), in a plan's summary too
    pp = ["name=pp", "compile_only=true", "mesh=data:2,stage:2", "strategy=pp"]
    assert _run(tmp_path, *pp, "scan_layers=true", "pipeline_repeats=1") == 0
    s = json.loads((tmp_path / "pp" / "summary.json").read_text())
    assert (s["strategy"], s["mesh"]["stage"], s["microbatches"]) == ("pp", 2, 2)


def test_off_a_terminal_the_header_and_its_notes_are_whole_lines(tmp_path, capsys):
    """A log or the launcher's [pN] prefix reads one line per header row: the rows are not
    cut at the 120 columns a log's tables get."""
    argv = [f"out_dir={tmp_path}", "name=a-rather-long-run-name-" + "x" * 60, "steps=2"]
    assert main([*argv, "model=tiny", "compile_only=true"]) == 0
    lines = capsys.readouterr().out.splitlines()
    note = next(x for x in lines if x.startswith("  note "))
    assert note.endswith("(the warm-up is linear from 0)") and len(note) > 120, note

"""The GPU runbook as one resumable command (lab/tools/runbook.py, lab/studies/runbook.py).

On CPU with tiny budgets: every step runs or is skipped with its reason; a rerun resumes
(finished steps are not run again); a step past its budget is killed and recorded as cut
short; the Markdown rows are written. Fake steps (short `python -c` programs) come in through
the tool's `steps=` seam, and a fake platform through `probe=`, so the tests take seconds.
"""

import json
import os
import signal
import textwrap
import threading
from pathlib import Path

import pytest

from lab.config import exit_code
from lab.errors import Terminated
from lab.report import runbook as rows
from lab.studies import runbook
from lab.studies.runbook import Step
from lab.tools import runbook as tool

CPU = {"backend": "cpu", "device_kind": "cpu", "device_count": 1, "jax_version": "0"}
GPU = {"backend": "gpu", "device_kind": "NVIDIA H100 80GB HBM3", "device_count": 1}

# Writes one record into the step's folder (its first argument), then exits with argv[2].
WRITE = textwrap.dedent(
    """
    import json, pathlib, sys
    r = {"what": "copy bandwidth", "value": 2.5e12, "unit": "B/s", "config": {}}
    (pathlib.Path(sys.argv[1]) / "x.jsonl").write_text(json.dumps(r) + "\\n")
    print("wrote a record"); sys.exit(int(sys.argv[2]))
    """
)


def fake(name, code=0, budget=30.0, **kw):
    return Step(name, f"fake {name}", ("-c", WRITE, "{out}", str(code)), budget, **kw)


def sleeper(name, budget):
    return Step(name, "sleeps", ("-c", "import time; time.sleep(60)"), budget)


def options(tmp_path, **kw):
    kw = {"size": "tiny", **kw}  # the tests' steps are fakes; without a GPU only tiny runs
    return tool.Options(**{"budget": 60.0, "min_step": 0.1, "out_dir": str(tmp_path), **kw})


def state_of(tmp_path):
    return json.loads((tmp_path / "runbook" / runbook.STATE).read_text())["steps"]


def test_the_ledger_steps_share_one_cache_of_compiled_programs(tmp_path):
    """Each ledger group (and each retry) writes its records in a folder of its own, and all
    read one cache of compiled programs under the runbook's folder: cold, the inference
    group's H100 decode compiles alone take minutes of its budget."""
    ledger = [s for s in runbook.plan("tiny") if s.name.startswith("ledger-")]
    assert len(ledger) > 1
    for s in ledger:
        argv = runbook.command(s, tmp_path / "steps" / s.name / "try-1", tmp_path, {"steps": {}})
        assert f"out_dir={tmp_path / 'steps' / s.name / 'try-1'}" in argv, argv
        assert f"cache_dir={tmp_path}/prediction-cache" in argv, argv


def test_plan_in_priority_order_each_step_under_ten_minutes():
    for size in tool.SIZES:
        steps = runbook.plan(size)
        names = [s.name for s in steps]
        assert names[:3] == ["kernels-k64", "kernels-k128", "ceilings"]
        assert names.index("targets-k64") < names.index("mfu-kernel") < names.index("serve")
        assert names.index("serve") < names.index("ledger-compute")
        assert len(set(names)) == len(names)
        assert all(0 < s.budget_s <= runbook.MAX_STEP_S < 600 for s in steps)
        assert all(s.kind in (*rows.HEADLINES, "log") for s in steps)
        # every step's records land in its own folder: lab.serve's go to results= (its
        # out_dir= says where the runs it loads are), every other command's to out_dir=
        for s in steps:
            where = "results={out}" if "lab.serve" in s.args else "out_dir={out}"
            assert where in s.args, (s.name, s.args)


def test_tiny_budget_every_step_runs_or_is_skipped_with_its_reason(tmp_path, capsys):
    """The real tiny plan on CPU with 2 s of budget: GPU steps skipped (why), the first CPU
    step started and cut short by the run's budget, every later one not started (why)."""
    o = options(tmp_path, size="tiny", budget=2.0, min_step=0.5)
    assert tool.run(o, probe=lambda: CPU) == 0
    steps = state_of(tmp_path)
    plan = runbook.plan("tiny")
    assert set(steps) == {s.name for s in plan}
    for s in plan:
        entry = steps[s.name]
        assert entry["status"] in ("done", "skipped", "cut short", "not started"), entry
        if entry["status"] != "done":
            assert entry["reason"], entry
        if s.needs_gpu:
            assert entry["status"] == "skipped" and "needs an NVIDIA GPU" in entry["reason"]
    assert steps["ceilings"]["status"] == "cut short"
    assert "budget=2 ran out" in steps["ceilings"]["reason"]
    assert steps["serve"]["status"] == "not started" and "budget=2" in steps["serve"]["reason"]
    md = (tmp_path / "runbook" / runbook.ROWS).read_text()
    assert "| ceilings | cut short: the run's budget=2 ran out" in md
    assert "| serve | not started: " in md
    assert "s of the run's budget=2 left, less than min_step=0.5" in md
    head = "### GPU runbook rehearsed on cpu × 1 (cpu, no GPU) — `python -m lab.tools.runbook"
    assert f"{head} budget=2 size=tiny min_step=0.5" in md
    assert md in capsys.readouterr().out


def test_rerun_resumes_and_redo_runs_again(tmp_path, capsys):
    steps = [fake("one"), fake("two", code=3), fake("gpu", needs_gpu=True)]
    assert tool.run(options(tmp_path), steps=steps, probe=lambda: CPU) == 1  # a step failed
    first = state_of(tmp_path)
    assert [first[n]["status"] for n in ("one", "two", "gpu")] == ["done", "failed", "skipped"]
    assert first["two"]["reason"] == "exit code 3: wrote a record"
    md = (tmp_path / "runbook" / runbook.ROWS).read_text()
    assert "| one | done |" in md and "copy bandwidth 2.5 TB/s" in md
    assert "steps/one/try-1/x.jsonl" in md
    capsys.readouterr()

    tool.run(options(tmp_path), steps=steps, probe=lambda: CPU)
    again = state_of(tmp_path)
    assert again["one"]["attempt"] == again["two"]["attempt"] == 1  # finished: not rerun
    assert "one: done before" in capsys.readouterr().out

    tool.run(options(tmp_path, redo=("failed",)), steps=steps, probe=lambda: CPU)
    assert state_of(tmp_path)["one"]["attempt"] == 1
    assert state_of(tmp_path)["two"]["attempt"] == 2
    tool.run(options(tmp_path, redo=("one",), steps=("one",)), steps=steps, probe=lambda: CPU)
    assert state_of(tmp_path)["one"]["attempt"] == 2
    md = (tmp_path / "runbook" / runbook.ROWS).read_text()  # a piece keeps the earlier rows
    assert "| one | done |" in md and "| two | failed" in md and "| gpu | skipped" in md


def test_a_runbook_folder_moved_elsewhere_keeps_its_rows(tmp_path, capsys):
    steps = [fake("one")]
    assert tool.run(options(tmp_path / "a"), steps=steps, probe=lambda: CPU) == 0
    assert state_of(tmp_path / "a")["one"]["folder"] == "steps/one/try-1"  # relative, as saved
    (tmp_path / "a").rename(tmp_path / "b")
    capsys.readouterr()
    assert tool.run(options(tmp_path / "b"), steps=steps, probe=lambda: CPU) == 0
    assert "one: done before" in capsys.readouterr().out
    md = (tmp_path / "b" / "runbook" / runbook.ROWS).read_text()
    assert "copy bandwidth 2.5 TB/s" in md and "steps/one/try-1/x.jsonl" in md
    # a state file from before paths were relative: its absolute paths are found here again
    state = json.loads((tmp_path / "b" / "runbook" / runbook.STATE).read_text())
    state["steps"]["one"]["folder"] = str(tmp_path / "a" / "runbook" / "steps" / "one" / "try-1")
    (tmp_path / "b" / "runbook" / runbook.STATE).write_text(json.dumps(state))
    assert tool.run(options(tmp_path / "b"), steps=steps, probe=lambda: CPU) == 0
    assert "copy bandwidth 2.5 TB/s" in (tmp_path / "b" / "runbook" / runbook.ROWS).read_text()
    # copied, the original kept: the copy reads its own files, not the original's
    import shutil

    shutil.copytree(tmp_path / "b", tmp_path / "c")
    old = str(tmp_path / "b" / "runbook" / "steps" / "one" / "try-1")
    assert runbook._here(tmp_path / "c" / "runbook", old) == (
        tmp_path / "c" / "runbook" / "steps" / "one" / "try-1"
    )


def test_size_full_without_a_gpu_is_one_line(tmp_path, capsys):
    o = options(tmp_path / "rb", size="full")
    with pytest.raises(tool.ConfigError, match="size=full is the GPU runbook and this machine"):
        tool.run(o, steps=[fake("one")], probe=lambda: CPU)
    assert not (tmp_path / "rb").exists()  # refused: no folder, no lock, nothing ran
    failed = {"backend": "unknown", "error": "CUDA_ERROR_NO_DEVICE"}
    with pytest.raises(tool.ConfigError, match=r"the platform probe failed \(CUDA_ERROR_NO"):
        tool.run(o, steps=[fake("one")], probe=lambda: failed)
    assert not (tmp_path / "rb").exists()
    assert "note:" not in capsys.readouterr().out  # one line, not a note that contradicts it


def test_a_damaged_state_file_is_kept_aside_not_written_over(tmp_path):
    root = tmp_path / "runbook"
    root.mkdir()
    damaged = (
        b'{"steps": {"one": {"stat',
        b"[1, 2]",
        b"\xff\xfe",
        # JSON of the wrong shape: each was a traceback (AttributeError, TypeError)
        b'{"platform": "gpu", "steps": {}}',
        b'{"steps": {"one": "done"}}',
        b'{"steps": {"one": {"status": "done", "previous": [1]}}}',
        b'{"steps": {"one": {"status": "done", "folder": 3}}}',
    )
    for text in damaged:  # within one second: each kept under a name of its own
        (root / runbook.STATE).write_bytes(text)
        said = []
        assert runbook.load_state(root, CPU, "tiny", say=said.append)["steps"] == {}
        assert "could not be read" in said[0] and "kept as state-damaged-" in said[0]
    kept = sorted(p.read_bytes() for p in root.glob("state-damaged-*.json"))
    assert kept == sorted(damaged)
    # a dry run reads such a file as no outcomes yet: the plan alone, not a traceback
    (root / runbook.STATE).write_bytes(damaged[3])
    assert tool.main(["dry_run=true", f"out_dir={tmp_path}", "steps=ceilings"]) == 0


def test_a_fresh_state_never_reuses_an_earlier_trys_folder(tmp_path):
    """After the state file is damaged (or was another machine's), the steps count from 1
    again: each runs in a folder no earlier try wrote, so its row reads its records alone."""
    assert tool.run(options(tmp_path), steps=[fake("one")], probe=lambda: CPU) == 0
    root = tmp_path / "runbook"
    first = root / "steps" / "one" / "try-1"
    before = (first / "output.log").read_bytes()
    (root / runbook.STATE).write_bytes(b'{"steps": {"one": {"stat')
    (first / runbook.OUTCOME).unlink()  # nothing to recover it from: it runs again
    assert tool.run(options(tmp_path), steps=[fake("one")], probe=lambda: CPU) == 0
    entry = state_of(tmp_path)["one"]
    assert entry["status"] == "done" and entry["folder"] == "steps/one/try-2"
    assert (first / "output.log").read_bytes() == before  # the earlier try's log kept
    assert len(list(first.with_name("try-2").glob("*.jsonl"))) == 1


def test_a_damaged_state_file_gives_back_the_finished_steps_their_folders_keep(tmp_path):
    """Each finished step keeps its outcome in its folder: a state file damaged later is
    rebuilt from them, and those steps are not run again; a step whose kept outcome is
    damaged too, or was another size's, runs again."""
    steps = [fake("one"), fake("two"), fake("three")]
    assert tool.run(options(tmp_path), steps=steps, probe=lambda: CPU) == 0
    root = tmp_path / "runbook"
    before = state_of(tmp_path)
    (root / runbook.STATE).write_bytes(b'{"steps": {"one": {"stat')
    (root / "steps" / "two" / "try-1" / runbook.OUTCOME).write_text('{"step": "two", "ent')
    three = root / "steps" / "three" / "try-1" / runbook.OUTCOME
    three.write_text(three.read_text().replace('"size": "tiny"', '"size": "full"'))
    said = []
    runbook.load_state(root, CPU, "tiny", say=said.append)  # a run refused after this point
    assert "1 finished step recovered from outcome.json in their folders (one)" in said[0]
    assert list(state_of(tmp_path)) == ["one"]  # keeps what was recovered
    assert tool.run(options(tmp_path), steps=steps, probe=lambda: CPU) == 0
    after = state_of(tmp_path)
    assert after["one"] == before["one"]  # recovered whole, not run again
    assert after["two"]["attempt"] == after["three"]["attempt"] == 2


def test_step_past_its_budget_is_killed_and_cut_short_then_rerun(tmp_path):
    steps = [sleeper("slow", budget=0.5), fake("after")]
    assert tool.run(options(tmp_path), steps=steps, probe=lambda: CPU) == 0
    entry = state_of(tmp_path)["slow"]
    assert entry["status"] == "cut short" and entry["reason"] == "past its budget of 0.5 s"
    assert entry["seconds"] < 5
    assert state_of(tmp_path)["after"]["status"] == "done"  # the next step still ran
    tool.run(options(tmp_path), steps=steps, probe=lambda: CPU)
    assert state_of(tmp_path)["slow"]["attempt"] == 2  # not finished: tried again
    assert state_of(tmp_path)["after"]["attempt"] == 1


def test_a_step_left_running_reads_as_cut_short_and_another_machine_starts_afresh(tmp_path):
    root = tmp_path / "runbook"
    root.mkdir()
    state = {"platform": CPU, "size": "full", "steps": {"a": {"status": "running"}}}
    runbook.save_state(root, state)
    loaded = runbook.load_state(root, CPU, "full", say=lambda _: None)
    assert loaded["steps"]["a"]["status"] == "cut short"
    said = []
    assert runbook.load_state(root, GPU, "full", say=said.append)["steps"] == {}
    assert "kept as" in said[0] and not (root / runbook.STATE).exists()
    assert len(list(root.glob("state-cpu-full-*.json"))) == 1


def test_correctness_fails_on_an_error_over_tolerance_or_a_kernel_that_did_not_run(tmp_path):
    def record(impl, what, value, dtype="bfloat16"):
        return {"what": what, "value": value, "unit": "x", "config": {"impl": impl, "dtype": dtype}}

    step = runbook.plan("full")[0]
    good = [record("pallas_mgpu", "attention max error", 4e-3)]
    good += [record("pallas_gpu", "attention max error", 3e-3)]
    for name, recs, want in [
        ("ok", good, None),
        ("over", [*good[:1], record("pallas_gpu", "attention max error", 0.3)], "0.3 > 0.02"),
        ("gone", [*good[1:], record("pallas_mgpu", "attention skipped", "ptxas")], "(ptxas)"),
    ]:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        verdict = runbook.judge(step, {"folder": str(folder)})
        assert verdict is None if want is None else want in verdict[1], (name, verdict)


def test_training_row_puts_the_predicted_floor_beside_the_measured_step(tmp_path):
    summary = {"mfu": 0.5, "step_time": {"median_s": 0.2}, "peak_source": "spec-table peak"}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    recs = [{"what": "training MFU", "value": 0.5, "unit": "fraction", "config": {}}]
    measured, predicted = rows.headline("train", recs, tmp_path)
    assert (
        measured == "MFU 50.0%"
        and predicted == "step ≥ 100.00 ms (model FLOPs at the spec-table peak)"
    )


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path, capsys):
    assert tool.main(["dry_run=true", f"out_dir={tmp_path}", "steps=ceilings,serve"]) == 0
    out = capsys.readouterr().out
    assert "python -m lab.tools.ceilings" in out and "python -m lab.serve" in out
    assert "kernels-k64" not in out and not (tmp_path / "runbook").exists()
    # another size's outcomes are not this plan's (a run would set that state aside)
    (tmp_path / "runbook").mkdir()
    state = {"size": "tiny", "platform": {}, "steps": {"ceilings": {"status": "done"}}}
    (tmp_path / "runbook" / "state.json").write_text(json.dumps(state))
    assert tool.main(["dry_run=true", f"out_dir={tmp_path}", "steps=ceilings"]) == 0
    out = capsys.readouterr().out
    assert "is for size=tiny: a run at size=full starts afresh" in out and "[done]" not in out
    assert tool.main(["dry_run=true", f"out_dir={tmp_path}", "steps=ceilings", "size=tiny"]) == 0
    assert "[done]" in capsys.readouterr().out


def test_the_dry_run_says_which_steps_fit_this_calls_budget(tmp_path, capsys):
    """Each step may take its whole budget: the plan says which steps one call of budget=
    runs, the one it cuts short, and which are left for later calls of the same command."""
    steps = [fake("one", budget=100), fake("two", budget=100), fake("three", budget=100)]
    o = options(tmp_path, budget=150.0, min_step=20.0, dry_run=True)
    assert tool.run(o, steps=steps, gpu=True) == 0
    out = capsys.readouterr().out
    assert (
        " 2. two (100 s · this call, 50 s left)" in out
        and " 3. three (100 s · a later call)" in out
    )
    assert "this call runs steps 1-2 (two starts with 50 s left and is cut short" in out, out
    assert "step 3 (100 s at most) are left for later calls" in out and "budget=360 for all" in out
    (tmp_path / "runbook").mkdir()  # a step finished before takes none of this call's time
    state = {"size": "tiny", "platform": {}, "steps": {"one": {"status": "done"}}}
    (tmp_path / "runbook" / "state.json").write_text(json.dumps(state))
    assert tool.run(o, steps=steps, gpu=True) == 0
    out = capsys.readouterr().out
    assert "this call runs steps 2-3 (three starts with 50 s left" in out, out
    assert "later" not in out
    assert "Off a GPU" not in out  # no step needs one
    steps[1] = fake("two", budget=100, needs_gpu=True)
    assert tool.run(o, steps=steps, gpu=True) == 0
    out = capsys.readouterr().out
    assert "Off a GPU the 1 step marked 'needs a GPU' is skipped, taking none of the" in out
    assert "needs more). Off a GPU" in out  # a sentence of its own
    # a machine without a GPU: the step that needs one is skipped there, and takes no budget
    assert tool.run(o, steps=steps, gpu=False) == 0
    out = capsys.readouterr().out
    assert " 2. two (100 s · needs a GPU · skipped here)" in out, out
    assert "budget=150 s, here (no NVIDIA GPU found), each step taking at most its budget: " in out
    assert "this call runs step 3. " in out and "Off a GPU" not in out, out
    assert "Step 2 needs a GPU: skipped here, taking none of the budget" in out, out
    # all at once: the sum of the steps that run here (and the probe), not the skipped one's
    steps.append(fake("four", budget=100))
    o = options(tmp_path, budget=50.0, min_step=20.0, dry_run=True)  # step 1 is done
    assert tool.run(o, steps=steps, gpu=False) == 0
    out = capsys.readouterr().out
    assert "step 4 (100 s at most) are left for later calls" in out, out
    assert "budget=260 for all at once" in out, out


def test_a_dry_run_on_a_machine_without_a_gpu_says_size_full_is_refused_there(tmp_path, capsys):
    """The full runbook is the GPU's: off one, the dry run says a run would be refused, and
    that size=tiny rehearses it, before the plan a GPU would run."""
    steps = [fake("kernels-k64", budget=300, needs_gpu=True), fake("ceilings", budget=240)]
    o = options(tmp_path, budget=570.0, min_step=20.0, dry_run=True, size="full")
    assert tool.run(o, steps=steps, gpu=False) == 0
    out = capsys.readouterr().out
    assert "no NVIDIA GPU found here: a run at size=full is refused on this machine" in out
    # the plan is the GPU machine's, and its last line says this machine runs none of it
    assert " 1. kernels-k64 (300 s · needs a GPU): " in out and "skipped here" not in out, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("this machine runs none of it (size=full needs an NVIDIA GPU"), last
    assert (
        "it). budget=570 s, on a GPU, each step taking at most its budget: a call on a GPU "
        "machine runs steps 1-2." in last
    ), last
    assert "this call" not in out, out
    assert "Off a GPU" not in out  # off a GPU, size=full runs nothing: no step "skipped" there
    assert tool.run(o, steps=steps, gpu=True) == 0
    out = capsys.readouterr().out
    assert "refused" not in out and "runs none of it" not in out


def test_the_dry_run_calls_the_training_steps_batch_a_placeholder_until_tuned(tmp_path, capsys):
    assert tool.main(["dry_run=true", f"out_dir={tmp_path}", "steps=mfu-kernel"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "remat=full batch_size=8 is a placeholder until the tune-step-* steps finish" in out
    # once a tune-step step has records, the plan shows its pick; the state file keeps the
    # step's folder relative to the runbook's, so it is found from any working directory
    tried = tmp_path / "runbook" / "steps" / "tune-step-dots" / "try-1"
    tried.mkdir(parents=True)
    rec = {"what": "training tokens/s", "value": 9.0, "unit": "tokens/s"}
    (tried / "t.jsonl").write_text(json.dumps({**rec, "config": {"remat": "dots", "batch": 16}}))
    state = {"size": "full", "platform": {}, "steps": {}}
    state["steps"]["tune-step-dots"] = {"status": "done", "folder": "steps/tune-step-dots/try-1"}
    (tmp_path / "runbook" / "state.json").write_text(json.dumps(state))
    assert Path.cwd() != tmp_path / "runbook"
    assert tool.main(["dry_run=true", f"out_dir={tmp_path}", "steps=mfu-kernel"]) == 0
    out = capsys.readouterr().out
    assert "remat=dots batch_size=16" in out and "placeholder" not in out, out


def test_rows_of_a_rehearsal_are_headed_by_the_machine_they_ran_on():
    gpu = {"backend": "gpu", "device_kind": "NVIDIA H100", "device_count": 8}
    head = rows.markdown([], gpu, "cmd", "2026-01-01").splitlines()[0]
    assert head == "### GPU runbook on NVIDIA H100 × 8 — `cmd`"
    head = rows.markdown([], CPU, "cmd", "2026-01-01").splitlines()[0]
    assert head == "### GPU runbook rehearsed on cpu × 1 (cpu, no GPU) — `cmd`"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["budget=0"], "budget='0': must be >= 1.0"),
        (["redo=ceilngs"], "redo='ceilngs': no such step (did you mean ceilings?)"),
        (["steps=serving"], "steps='serving': no such step (did you mean serve?)"),
        (["size=huge"], "size='huge': expected one of full | tiny"),
        # no call of it could ever start a step (a dry run says so too)
        (["min_step=1000", "budget=570", "dry_run=true"], "no step could ever start"),
        (["min_step=570", "budget=570"], "min_step=570 is not below budget=570"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert tool.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_training_step_runs_at_the_best_point_tune_step_found(tmp_path):
    step = next(s for s in runbook.plan("full") if s.name == "mfu-kernel")
    state = {"steps": {}}
    argv = runbook.command(step, tmp_path, tmp_path, state)
    assert "remat=full" in argv and "batch_size=8" in argv  # nothing tuned yet: the fallback
    recs = [
        {"what": "training tokens/s", "value": v, "unit": "tokens/s", "config": c}
        for v, c in [(9.0, {"remat": "dots", "batch": 16}), (7.0, {"remat": "none", "batch": 4})]
    ]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    state["steps"]["tune-step-dots"] = {"status": "done", "folder": str(tmp_path)}
    argv = runbook.command(step, tmp_path, tmp_path, state)
    assert "remat=dots" in argv and "batch_size=16" in argv and "remat=full" not in argv


def test_tune_step_row_names_a_candidate_within_the_bests_noise(tmp_path):
    def rec(remat, tokens_per_s, step_s, p10_s, p90_s):
        config = {"remat": remat, "batch": 2, "step_s": step_s, "p10_s": p10_s, "p90_s": p90_s}
        return {"what": "training tokens/s", "value": tokens_per_s, "unit": "tokens/s",
                "config": config}  # fmt: skip

    recs = [rec("none", 6400.0, 0.010, 0.009, 0.012), rec("full", 5818.0, 0.011, 0.0095, 0.013)]
    measured, _ = rows.headline("tune-step", recs, tmp_path)
    assert measured == (
        "best remat=none batch 2: 6.4 ktokens/s "
        "(the p10–p90 ranges overlap: remat=full batch 2 is as good)"
    ), measured
    recs.append(rec("dots", 6000.0, 0.0107, 0.0095, 0.0125))  # a third within the noise
    assert rows.headline("tune-step", recs, tmp_path)[0] == (
        "best remat=none batch 2: 6.4 ktokens/s (the p10–p90 ranges overlap: 2 others are "
        "as good: remat=dots batch 2, remat=full batch 2)"
    )
    recs = recs[:2]
    recs[1] = rec("full", 4923.0, 0.013, 0.0125, 0.014)  # apart from the best
    assert rows.headline("tune-step", recs, tmp_path)[0] == "best remat=none batch 2: 6.4 ktokens/s"


def test_tune_step_row_reads_the_ties_from_the_best_record_where_it_has_them(tmp_path):
    """tune_step's `tune_step best tokens/s` record names the candidates as good as the best
    (`within_noise_of`): the row takes them from it rather than from the spans, which older
    record files without that field still fall back on (the test above)."""

    def rec(remat, tokens_per_s, step_s, p10_s, p90_s):
        config = {"remat": remat, "batch": 2, "step_s": step_s, "p10_s": p10_s, "p90_s": p90_s}
        return {"what": "training tokens/s", "value": tokens_per_s, "unit": "tokens/s",
                "config": config}  # fmt: skip

    # by the spans, full is apart from the best; the record (the tuner's word) says it is not
    recs = [rec("none", 6400.0, 0.010, 0.009, 0.012), rec("full", 4923.0, 0.013, 0.0125, 0.014)]
    best = {"what": "tune_step best tokens/s", "value": 6400.0, "unit": "tokens/s",
            "config": {"remat": "none", "batch": 2,
                       "within_noise_of": [{"remat": "full", "batch": 2}]}}  # fmt: skip
    assert rows.headline("tune-step", [*recs, best], tmp_path)[0] == (
        "best remat=none batch 2: 6.4 ktokens/s "
        "(the p10–p90 ranges overlap: remat=full batch 2 is as good)"
    )
    best["config"]["within_noise_of"] = []  # the record says none is, though spans might
    recs[1] = rec("full", 5818.0, 0.011, 0.0095, 0.013)
    assert rows.headline("tune-step", [*recs, best], tmp_path)[0] == (
        "best remat=none batch 2: 6.4 ktokens/s"
    )
    del best["config"]["within_noise_of"]  # an older record file: recomputed from the spans
    assert rows.headline("tune-step", [*recs, best], tmp_path)[0].endswith(
        "remat=full batch 2 is as good)"
    )


def test_the_training_steps_row_says_its_pick_crosses_tune_step_processes(tmp_path):
    """The tune-step-* steps time in processes of their own, minutes apart: a pick across
    them is not one run's comparison, and the training step's log line and row say so."""
    for name, value in (("tune-step-none", 7.0), ("tune-step-dots", 9.0)):
        (tmp_path / name).mkdir()
        r = {"what": "training tokens/s", "value": value, "unit": "tokens/s",
             "config": {"remat": name.split("-")[-1], "batch": 4}}  # fmt: skip
        (tmp_path / name / "t.jsonl").write_text(json.dumps(r) + "\n")
    state = {"steps": {n: {"status": "done", "folder": str(tmp_path / n)}
                       for n in ("tune-step-none", "tune-step-dots")}}  # fmt: skip
    note = runbook.tuned_note(state, ("remat=full", "batch_size=8"))
    assert note.startswith("remat=dots batch_size=4: the most tokens/s over 2 tune-step steps")
    assert "each timed in its own process (not one run's peers" in note
    one = {"steps": {"tune-step-none": state["steps"]["tune-step-none"]}}
    assert (
        runbook.tuned_note(one, ()) == "remat=none batch_size=4: tune-step-none's best by tokens/s"
    )
    assert runbook.tuned_note({"steps": {}}, ("remat=full", "batch_size=8")) == (
        "remat=full batch_size=8: a placeholder (no tune-step step has records)"
    )
    train = Step("mfu", "trains", ("-c", WRITE, "{out}", "0", "{tuned}"), 30, kind="",
                 fallback=("remat=full",))  # fmt: skip
    root = tmp_path / "rb"
    root.mkdir()
    said = []
    state = runbook.execute([train], root, CPU, {"steps": dict(state["steps"])},
                            runbook.Request(60, 0, 0.1), say=said.append)  # fmt: skip
    assert any("mfu: remat=dots batch_size=4: the most tokens/s over 2" in x for x in said), said
    (row,) = rows.rows([train], state, lambda f: runbook.read_records(Path(f)), root)
    assert (
        "(at remat=dots batch_size=4: the most tokens/s over 2 tune-step steps" in row["measured"]
    )


def test_bench_step_row_is_read_from_its_records(tmp_path):
    def rec(what, value, unit, step, **spread):
        return {"what": what, "value": value, "unit": unit, "config": {"step": step, **spread}}

    recs = [
        rec("bench_step step time", 0.040, "s", "bare", runs=9, p10_s=0.038, p90_s=0.043),
        rec("bench_step step time", 0.042, "s", "lab", runs=9, p10_s=0.041, p90_s=0.044),
        rec("bench_step time ratio vs bare", 1.05, "x", "lab"),
    ]
    measured, _ = rows.headline("bench-step", recs, tmp_path, "output.log")
    assert measured == (
        "bare 40.00 ms, lab 42.00 ms (9 runs each): ratio 1.050 (medians); "
        "the p10–p90 ranges overlap: the ratios are within this run's noise"
    ), measured
    recs[0]["config"]["p90_s"] = 0.0405  # apart: no noise note
    measured, _ = rows.headline("bench-step", recs, tmp_path, "output.log")
    assert measured.endswith("ratio 1.050 (medians)"), measured


def test_bench_step_row_of_a_folder_without_records_is_read_from_its_log(tmp_path):
    (tmp_path / "output.log").write_text(
        "┃      ┃   median ┃      p10 ┃      p90 ┃ runs ┃ ratio vs bare ┃\n"
        "│ bare │ 43.25 ms │ 36.04 ms │ 47.53 ms │   12 │         1.000 │\n"
        "│  lab │ 42.79 ms │ 38.39 ms │ 51.23 ms │   12 │         0.989 │\n"
    )
    measured, _ = rows.headline("bench-step", [], tmp_path, "output.log")
    assert measured == "bare 43.25 ms, lab 42.79 ms: ratio 0.989 (medians; from its log)"


def test_prediction_row_states_the_model_error_on_the_device_steps(tmp_path):
    def rec(config, measured, predicted):
        c = {"config": config, "predicted_s": predicted}
        return {"what": "step time, measured and predicted", "value": measured, "unit": "s",
                "config": c}  # fmt: skip

    recs = [rec("model=base", 0.1, 0.09), rec("model=1b", 0.4, 0.5), rec("bad", None, None)]
    measured, predicted = rows.headline("prediction", recs, tmp_path)
    assert "model=base 100.00 ms" in measured and "model=1b" in measured
    assert predicted == "model error on 2 steps: median 18%, worst 1.25×"


def test_training_row_prefers_the_step_time_model_to_the_floor(tmp_path):
    summary = {
        "mfu": 0.5,
        "step_time": {"median_s": 0.2},
        "peak_source": "spec-table peak",
        "predicted_step_time": {"seconds": 0.18, "ratio_to_measured": 0.9},
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    _, predicted = rows.headline("train", [], tmp_path)
    assert predicted == "step 180.00 ms (10% below measured; step-time model)"


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(),
    reason="a signal handler needs the main thread",
)
def test_sigterm_stops_the_step_in_flight_keeps_the_state_and_a_rerun_goes_on(tmp_path, capsys):
    """A job scheduler's SIGTERM mid-step: the step is stopped and recorded as cut short, the
    rows are written, and the next run starts that step again and then the rest."""
    steps = [fake("first"), sleeper("slow", budget=30), fake("after")]
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        with pytest.raises(Terminated) as stopped:
            tool.run(options(tmp_path), steps=steps, probe=lambda: CPU)
    finally:
        timer.cancel()
    assert exit_code(lambda: (_ for _ in ()).throw(stopped.value)) == 143  # not Ctrl-C's 130
    err = capsys.readouterr().err.strip()  # one line: where the work is and how to go on
    root = tmp_path / "runbook"
    assert err.startswith(f"SIGTERM: the outcomes so far are saved in {root} (state.json, ")
    assert "BENCHMARKS-rows.md); rerunning the same command (python -m lab.tools.runbook" in err
    assert "resumes, skipping the finished steps" in err and len(err.splitlines()) == 1
    state = state_of(tmp_path)
    assert state["first"]["status"] == "done" and "after" not in state
    assert state["slow"]["status"] == "cut short"
    assert state["slow"]["reason"] == "the runbook was interrupted"
    assert "| slow | cut short" in (tmp_path / "runbook" / runbook.ROWS).read_text()
    fast = [fake("first"), fake("slow"), fake("after")]  # the same names, now quick
    assert tool.run(options(tmp_path), steps=fast, probe=lambda: CPU) == 0
    state = state_of(tmp_path)
    assert state["first"]["attempt"] == 1 and state["slow"]["attempt"] == 2
    assert state["after"]["status"] == "done"


def test_a_step_that_had_exited_0_when_the_runbook_was_stopped_is_done(tmp_path, monkeypatch):
    """The stop came after the step's process had exited 0 (its records written) but before
    the runbook's wait returned: the step is done, not cut short, and a rerun skips it."""
    import subprocess

    real_wait = subprocess.Popen.wait

    def wait_then_stop(self, timeout=None):
        real_wait(self, timeout)  # the step ends on its own ...
        raise Terminated  # ... and the stop lands before the wait returns

    monkeypatch.setattr(subprocess.Popen, "wait", wait_then_stop)
    with pytest.raises(Terminated):
        tool.run(options(tmp_path), steps=[fake("one"), fake("two")], probe=lambda: CPU)
    monkeypatch.undo()
    state = state_of(tmp_path)
    assert state["one"]["status"] == "done" and state["one"]["returncode"] == 0, state
    assert "two" not in state
    assert "| one | done" in (tmp_path / "runbook" / runbook.ROWS).read_text()
    assert tool.run(options(tmp_path), steps=[fake("one"), fake("two")], probe=lambda: CPU) == 0
    state = state_of(tmp_path)
    assert state["one"]["attempt"] == 1 and state["two"]["status"] == "done"


def test_a_redo_cut_short_keeps_the_finished_outcome(tmp_path, capsys):
    """redo= of a finished step that does not finish (past its budget, or the runbook stopped
    mid-step) gives the finished outcome back, with a note of the attempt, not 'cut short'."""
    assert tool.run(options(tmp_path), steps=[fake("one")], probe=lambda: CPU) == 0
    slow = [Step("one", "sleeps", ("-c", "import time; time.sleep(60)"), 0.5)]
    tool.run(options(tmp_path, redo=("one",)), steps=slow, probe=lambda: CPU)
    entry = state_of(tmp_path)["one"]
    assert entry["status"] == "done" and entry["attempt"] == 2, entry
    assert "try-2 (a redo) was cut short: past its budget" in entry["redo_cut_short"]
    assert "the previous outcome stands" in capsys.readouterr().out
    # the runbook itself killed mid-redo: the state still says running, read back as before
    root = tmp_path / "runbook"
    state = json.loads((root / runbook.STATE).read_text())
    previous = dict(state["steps"]["one"])
    state["steps"]["one"] = {"status": "running", "attempt": 3, "previous": previous}
    runbook.save_state(root, state)
    loaded = runbook.load_state(root, CPU, "tiny", say=lambda _: None)["steps"]["one"]
    assert loaded["status"] == "done" and "stopped mid-step" in loaded["redo_cut_short"]


def test_one_runbook_per_folder(tmp_path, capsys):
    from lab import checkpoint

    (tmp_path / "runbook").mkdir()
    with checkpoint.Lock(tmp_path / "runbook"):
        refused = exit_code(
            lambda: tool.run(options(tmp_path), steps=[fake("one")], probe=lambda: CPU)
        )
        assert refused == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "in use by another runbook" in err


def _records_of(tmp_path, step):
    return next((tmp_path / "runbook" / "steps" / step / "try-1").glob("*.jsonl"))


RECORD = {"what": "copy bandwidth", "value": 2.5e12, "unit": "B/s", "config": {}}


@pytest.mark.parametrize(
    "damage",
    [
        b'{"what": "copy bandw\n',  # a line cut short, then more appended after it
        b"\x00\x00\x00\x00\n",  # a block of NULs, as a crash of the machine may leave
        b"not json at all\n",  # a hand edit
    ],
)
def test_a_record_line_damaged_mid_file_is_one_error_naming_it(tmp_path, damage):
    """Only a last line with no newline after it is what a kill leaves; any other line that
    is not JSON is refused, naming the file and the line, not silently dropped from the rows."""
    whole = (json.dumps(RECORD) + "\n").encode()
    (tmp_path / "x.jsonl").write_bytes(whole + damage + whole)
    with pytest.raises(tool.ConfigError, match=r"x\.jsonl, line 2: not a record .*remove the"):
        runbook.read_records(tmp_path, say=pytest.fail)


def test_a_cut_short_last_line_is_passed_over_and_said_once(tmp_path):
    whole = json.dumps(RECORD) + "\n"
    (tmp_path / "x.jsonl").write_text(whole * 2 + whole[:30])
    said = []
    for _ in range(3):  # the rows read the records after every step: one note, not one each
        records = runbook.read_records(tmp_path, say=said.append)
        assert [r["value"] for r in records] == [2.5e12, 2.5e12]
    assert len(said) == 1
    assert "x.jsonl, line 3 is cut short" in said[0] and "the 2 records before it" in said[0]


def test_damaged_records_stop_the_run_before_any_step_with_one_line(tmp_path, capsys):
    """A finished step's records damaged mid-file: exit 2 with one line, before the next step
    takes any of the budget; the state is kept, and once the line is removed the run goes on."""
    assert tool.run(options(tmp_path), steps=[fake("one")], probe=lambda: CPU) == 0
    path = _records_of(tmp_path, "one")
    whole = path.read_bytes()
    path.write_bytes(whole + b"\x00\x00\x00\n" + whole)
    steps = [fake("one"), fake("two")]
    capsys.readouterr()
    assert exit_code(lambda: tool.run(options(tmp_path), steps=steps, probe=lambda: CPU)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}, line 2: not a record" in err
    assert err.rstrip().endswith("; or redo=one runs that step again"), err
    assert "two" not in state_of(tmp_path) and state_of(tmp_path)["one"]["status"] == "done"
    path.write_bytes(whole * 2)  # the line removed
    assert tool.run(options(tmp_path), steps=steps, probe=lambda: CPU) == 0
    assert state_of(tmp_path)["two"]["status"] == "done"
    assert state_of(tmp_path)["one"]["attempt"] == 1  # not run again
    # damaged again: a step this run runs again (redo=) is not held to its old records
    path.write_bytes(whole + b"\x00\x00\x00\n" + whole)
    redo = options(tmp_path, steps=("one",), redo=("one",))
    assert tool.run(redo, steps=steps, probe=lambda: CPU) == 0
    assert state_of(tmp_path)["one"]["attempt"] == 2


def test_a_cut_short_last_record_is_noted_once_and_the_run_goes_on(tmp_path, capsys):
    assert tool.run(options(tmp_path), steps=[fake("one")], probe=lambda: CPU) == 0
    path = _records_of(tmp_path, "one")
    path.write_bytes(path.read_bytes() + b'{"what": "copy bandwidth", "val')
    capsys.readouterr()
    steps = [fake("one"), fake("two")]
    assert tool.run(options(tmp_path), steps=steps, probe=lambda: CPU) == 0
    out = capsys.readouterr().out
    assert out.count("is cut short") == 1 and f"{path}, line 2 is cut short" in out
    assert "the record before it is read" in out
    assert state_of(tmp_path)["two"]["status"] == "done"
    assert path.name in (tmp_path / "runbook" / runbook.ROWS).read_text()  # its whole records

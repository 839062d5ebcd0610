"""lab.tools.tune_step: remat × batch measured on the real step; what does not fit is refused."""

import dataclasses
import json

import pytest

from lab import summary
from lab.studies import step
from lab.tools import tune_step

TINY = ["model=tiny", "seq_len=32"]
KEYS = {"preset": "tiny", "seq_len": 32}


@pytest.mark.once
def test_search_times_every_candidate_and_names_the_best(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = [*TINY, "remats=none,full", "batches=2,4", "budget=0.05"]
    assert tune_step.main(argv) == 0
    out = capsys.readouterr().out
    assert "best: python -m lab.run model=tiny seq_len=32 remat=" in out
    (path,) = (tmp_path / "results").glob("tune_step-*.jsonl")
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    tps = [r for r in recs if r["what"] == "training tokens/s"]
    assert {(r["config"]["remat"], r["config"]["batch"]) for r in tps} == {
        ("none", 2),
        ("none", 4),
        ("full", 2),
        ("full", 4),
    }
    assert all(r["value"] > 0 and r["config"]["runs"] >= 3 for r in tps)
    mfu = [r for r in recs if r["what"] == "training MFU"]
    assert len(mfu) == 4 and all(0 < r["value"] for r in mfu)
    best = max(tps, key=lambda r: r["value"])["config"]
    assert f"remat={best['remat']} batch_size={best['batch']}" in out


def test_what_does_not_fit_is_refused_not_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(summary.memory, "device_capacity_bytes", lambda device: 1024)
    monkeypatch.setattr(summary, "PRECHECK_MARGIN", 1e30)  # the compiled figure decides here
    rows = step.tune(KEYS, ("none",), (2,), 0.05)
    assert rows[0].skipped.startswith("the compiled step needs") and rows[0].step_s is None
    assert rows[0].tokens_per_s is None and rows[0].mfu is None
    assert step.best(rows) is None
    assert tune_step.main([*TINY, "remats=none", "batches=2"]) == 2  # as a step that cannot fit
    assert "no candidate fits this device" in capsys.readouterr().err


def test_a_step_far_beyond_the_memory_is_skipped_before_its_compile(monkeypatch):
    """A candidate the memory calculator puts at many times the memory there is is skipped
    without compiling (a 1b model at 512×4096 spent a minute compiling a step of terabytes
    only to be refused), in words that say so; one that fits is compiled and timed."""
    gib = 2**30
    monkeypatch.setattr(summary.memory, "host_available_bytes", lambda: 3 * gib)
    compiled = []
    real = summary.analyse
    monkeypatch.setattr(summary, "analyse", lambda *a, **k: compiled.append(1) or real(*a, **k))
    monkeypatch.setattr(summary.memory, "device_capacity_bytes", lambda device: 4 * gib)
    (fits,) = step.tune(KEYS, ("none",), (2,), 0.05)
    assert fits.skipped is None and fits.step_s > 0 and compiled == [1]
    monkeypatch.setattr(summary.memory, "host_available_bytes", lambda: 1024)
    (row,) = step.tune(KEYS, ("none",), (2,), 0.05)
    assert compiled == [1], "a step far beyond the memory was compiled"
    assert row.step_s is None and row.compile_s is None
    assert row.skipped.startswith("the memory calculator puts the step at "), row.skipped
    assert "what the host has available now (0.0 GiB); not compiled" in row.skipped, row.skipped


def test_the_records_stem_waits_for_the_first_session(tmp_path, monkeypatch):
    """The stem names the backend, and asking for it starts JAX: asked before the first
    session sizes the simulated devices, it left one CPU device, and mesh=4x2 cpu_devices=8
    was refused as needing 8 devices."""
    from lab.measure import records as rec

    order = []
    real_stem = rec.output_stem
    monkeypatch.setattr(
        rec, "output_stem", lambda *a, **k: order.append("stem") or real_stem(*a, **k)
    )
    monkeypatch.setattr(step, "tune", lambda *a, **k: order.append("tune") or [])
    assert tune_step.main([*TINY, "remats=none", "batches=2", f"out_dir={tmp_path}"]) == 2
    assert order[0] == "tune", order


def test_too_few_devices_are_counted_in_good_grammar():
    from lab.mesh import MeshSpecError, resolve_shape

    with pytest.raises(MeshSpecError, match="needs 8 devices but only 1 is present"):
        resolve_shape("4x2", 1)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["remats=none,sometimes"], "expected one of none | full | dots"),
        (["batches=8,x"], "batches='8,x': 'x' is not an integer"),
        (["batch_size=8"], "use remats=/batches="),
        (["modle=tiny"], "did you mean"),
        (["model=tiny", "target=gpu:h100"], "tune_step times steps on this machine's devices"),
        (["model=tiny", "compile_only=true"], "compile_only=true: tune_step compiles and times"),
        # a key every candidate would refuse is the user's mistake, not "no candidate fits"
        (
            ["model=tiny", "resume=true", "remats=none", "batches=2,4"],
            "resume=true: tune_step times steps and keeps no run folder",
        ),
    ],
)
def test_bad_keys_are_one_line_and_exit_2(argv, needle, capsys):
    assert tune_step.main(argv) == 2
    out, err = capsys.readouterr()
    assert needle in err.strip() and len(err.strip().splitlines()) == 1
    assert "remat × batch" not in out, out  # refused before its progress bar starts


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["mesh=2"], "bench_step compares one device's steps"),
        (["target=gpu:h100"], "bench_step times steps on this machine's devices"),
        (["steps=5"], "steps= is set by bench_step"),
        (["resume=true", "name=zzz"], "resume=true: bench_step times steps and keeps no run"),
        (
            ["profile=true", "checkpoint_every=5"],
            "checkpoint_every=5, profile=true: bench_step times",
        ),
        (["name=x"], "name=x: bench_step times steps and keeps no run folder"),
    ],
)
def test_bench_step_refuses_what_it_cannot_compare_in_one_line(argv, needle, capsys):
    from lab.tools import bench_step

    assert bench_step.main(["model=tiny", "budget=0.05", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_bench_step_refuses_a_step_far_beyond_the_memory_before_its_compile(capsys):
    """Thousands of GiB by the memory calculator: one line before the minute-long compile."""
    from lab.tools import bench_step

    assert bench_step.main(["model=1b", "batch_size=512", "seq_len=4096", "budget=0.05"]) == 2
    err = capsys.readouterr().err.strip()
    assert "; not compiled: try a smaller batch_size" in err and len(err.splitlines()) == 1, err


def test_bench_step_prints_compile_time_apart_and_writes_records(tmp_path, monkeypatch, capsys):
    """Results are data: each step's median with its spread and its compile time, and the
    lab's ratio to the bare step, as records; the compile times printed apart from the table."""
    from lab.measure.timing import BenchResult, Comparison, Contender
    from lab.tools import bench_step

    def timed(median):
        return BenchResult(median, 0.9 * median, 1.1 * median, 7, compile_s=0.01)

    def compare(s, budget_s):
        bare, lab = timed(0.040), timed(0.042)
        contenders = (Contender("bare", bare, 0.040), Contender("lab", lab, 0.040))
        return Comparison("bare", contenders), {"lab": 4.5, "bare": 2.25}

    monkeypatch.setattr(step, "compare_with_bare", compare)
    assert bench_step.main([*TINY, "budget=0.01", f"out_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "compile time (not in the times above): lab 4.50 s, bare 2.25 s" in out
    (path,) = tmp_path.glob("bench_step-*.jsonl")
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    got = {(r["what"], r["config"]["step"]): (r["value"], r["label"]) for r in recs}
    assert got == {
        ("bench_step step time", "bare"): (0.040, "measured"),
        ("bench_step compile time", "bare"): (2.25, "measured"),
        ("bench_step step time", "lab"): (0.042, "measured"),
        ("bench_step compile time", "lab"): (4.5, "measured"),
        ("bench_step time ratio vs bare", "lab"): (pytest.approx(1.05), "derived"),
    }
    assert all(r["config"]["keys"] == KEYS for r in recs)


def test_help(capsys):
    assert tune_step.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "remats=" in out and "batches=" in out and "python -m lab.run --help" in out


def test_progress_counts_candidates_in_plain_lines(tmp_path, monkeypatch, capsys):
    """A line per candidate as it starts, with n/N, and no source location (rich's
    console.log put 'step.py:145' at the right edge of each)."""
    import re

    monkeypatch.chdir(tmp_path)

    def measure(keys, remat, batch, budget_s):  # nothing compiled: only the lines are tested
        return step.StepCandidate(remat, batch, skipped="not measured in this test")

    monkeypatch.setattr(step, "measure", measure)
    assert tune_step.main([*TINY, "remats=none,full", "batches=2,4"]) == 2  # none timed
    out = capsys.readouterr().out
    assert "remat=none batch_size=2 (0/4 done" in out
    assert "remat=full batch_size=4 (3/4 done" in out
    assert not re.search(r"\w+\.py:\d+", out), out


def test_out_of_memory_at_run_time_skips_the_candidate_and_keeps_the_rest(monkeypatch):
    real = step.measure

    def measure(keys, remat, batch, budget_s):
        if batch == 4:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        return real(keys, remat, batch, budget_s)

    monkeypatch.setattr(step, "measure", measure)
    rows = step.tune(KEYS, ("none",), (2, 4), 0.05)
    assert rows[1].skipped == "out of memory when run" and rows[0].ran
    assert rows[0].tokens_per_s == 2 * 32 / rows[0].step_s
    assert step.best(rows) is rows[0]


def _timed(remat, batch, median, p10, p90):
    return step.StepCandidate(
        remat, batch, step_s=median, runs=9, p10_s=p10, p90_s=p90, seq_len=32, device="cpu × 1"
    )


def test_a_best_within_the_noise_of_another_says_so(tmp_path, monkeypatch, capsys):
    """The best is the highest median; where its p10–p90 range of tokens/s overlaps another
    candidate's, that one is as good within the run's noise and the output says so once (two
    identical runs named different bests, with no word of it)."""
    times = {  # none×2 is the best median, full×2's range reaches it; none×4 is far slower
        ("none", 2): (0.010, 0.009, 0.012),
        ("full", 2): (0.011, 0.0095, 0.013),
        ("none", 4): (0.100, 0.099, 0.101),
        ("full", 4): (0.200, 0.199, 0.201),
    }
    monkeypatch.setattr(step, "measure", lambda k, r, b, s: _timed(r, b, *times[(r, b)]))
    argv = [*TINY, "remats=none,full", "batches=2,4", f"out_dir={tmp_path}"]
    assert tune_step.main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "best: python -m lab.run model=tiny seq_len=32 remat=none batch_size=2" in out
    assert (
        "within this run's noise (the p10–p90 ranges overlap): remat=full batch_size=2 is as "
        "good; the best is named for its higher median" in out
    ), out
    assert out.count("as good") == 1, out  # said once: not in the table's caption as well
    rows = [_timed(r, b, *t) for (r, b), t in times.items()]
    assert step.as_good(rows, step.best(rows)) == [rows[1]]
    rows[1] = _timed("full", 2, 0.013, 0.0125, 0.014)  # its fastest slower than the best's slowest
    assert step.as_good(rows, step.best(rows)) == []
    times[("full", 2)] = (0.013, 0.0125, 0.014)
    assert tune_step.main(argv) == 0
    assert "within this run's noise" not in capsys.readouterr().out


def test_every_candidate_within_the_noise_of_the_best_is_named(tmp_path, monkeypatch, capsys):
    """Measured: none/4 best at 28.4k–52.9k tokens/s (p10–p90) and all three others within
    that range, but only the next best was named. Each is named, in the closing line and in
    the best's record, highest median first."""
    seq = 64  # tokens/s = batch × 64 / seconds
    times = {  # none×4 best; the others' ranges all reach into its 28.4k–52.9k
        ("none", 4): (256 / 40e3, 256 / 52.9e3, 256 / 28.4e3),
        ("none", 8): (512 / 38e3, 512 / 50e3, 512 / 27e3),
        ("full", 4): (256 / 30e3, 256 / 45e3, 256 / 20e3),
        ("full", 8): (512 / 35e3, 512 / 48e3, 512 / 25e3),
    }

    def measure(k, r, b, s):
        median, p10, p90 = times[(r, b)]
        return dataclasses.replace(_timed(r, b, median, p10, p90), seq_len=seq)

    monkeypatch.setattr(step, "measure", measure)
    argv = ["model=tiny", f"seq_len={seq}", "remats=none,full", "batches=4,8"]
    assert tune_step.main([*argv, f"out_dir={tmp_path}"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "3 others are as good (remat=none batch_size=8, remat=full batch_size=8, remat=full "
        "batch_size=4); the best is named for its higher median, and a rerun may name any of "
        "them" in out
    ), out
    assert out.count("as good") == 1, out
    (path,) = tmp_path.glob("tune_step-*.jsonl")
    (best,) = [json.loads(x) for x in path.read_text().splitlines() if "best" in x]
    assert best["what"] == "tune_step best tokens/s" and best["label"] == "derived"
    assert (best["config"]["remat"], best["config"]["batch"]) == ("none", 4)
    assert best["value"] == pytest.approx(40e3)
    assert best["config"]["within_noise_of"] == [
        {"remat": "none", "batch": 8},
        {"remat": "full", "batch": 8},
        {"remat": "full", "batch": 4},
    ]


def test_skipped_candidates_reasons_are_notes_below_a_narrow_table():
    """A skipped candidate's reason sat in the right-aligned step column, wrapping a long
    refusal over five lines of a 150-column table: now "skipped [n]" and note n below, one
    note per reason however many candidates it skips."""
    from rich.console import Console

    from lab.report import tables

    why = "remat=offload: " + "the step moves its saved activations to host memory " * 3
    rows = [
        _timed("none", 2, 0.010, 0.009, 0.012),
        step.StepCandidate("offload", 2, skipped=why),
        step.StepCandidate("offload", 4, skipped=why),
        step.StepCandidate("none", 4, skipped="out of memory when run"),
    ]
    con = Console(width=150, record=True)
    con.print(tables.tune_step(rows, rows[0], "remat × batch"))
    lines = con.export_text().splitlines()
    table = [x for x in lines if "│" in x]
    assert max(len(x) for x in table) < 120, "\n".join(lines)  # the console has 150
    assert len([x for x in table if "offload" in x]) == 2  # a row a line: no reason wraps it
    assert sum("skipped [1]" in x for x in table) == 2 and any("skipped [2]" in x for x in table)
    text = " ".join(" ".join(lines).split())
    assert f"[1] skipped: {' '.join(why.split())}" in text, text
    assert "[2] skipped: out of memory when run" in text and "[3]" not in text


def test_weights_the_mesh_cannot_split_are_refused_before_any_candidate(monkeypatch, capsys):
    """mesh=2x4 puts tiny's 2 kv heads over a model axis of 4, whatever the remat or batch:
    every candidate was ticked through to the same error. Refused once, before any compile."""
    measured = []
    monkeypatch.setattr(step, "measure", lambda *a: measured.append(a))
    argv = [*TINY, "mesh=2x4", "remats=none,full", "batches=4,8"]
    assert tune_step.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "does not divide mesh axis model (size 4)" in err and len(err.splitlines()) == 1
    assert not measured

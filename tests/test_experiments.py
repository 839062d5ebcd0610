"""The claims ledger end to end: every experiment in tiny mode, once, in one process-wide
fixture (compiles are the cost: the experiments share one cached step), then the report,
its plots and a cross-backend merge read from that one results folder."""

import json
import shutil
import time
import types

import pytest

import experiments
from experiments import __main__ as cli
from experiments import compare
from lab.measure import records as rec
from lab.report.claims import CLAIMS
from lab.report.verdict import MISSING, judge_all

IDS = [f"C{i:02d}" for i in range(1, 23)]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """`python -m experiments size=tiny` in this process; its folder, records and run.json."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("results")
    out = io.StringIO()
    # in a folder of its own: the ledger writes nothing there (its compiled programs are
    # cached in out_dir's prediction-cache), which the test below holds it to
    here = tmp_path_factory.mktemp("cwd")
    with contextlib.redirect_stdout(out), contextlib.chdir(here):  # stdout not a terminal
        rc = cli.main(["size=tiny", f"out_dir={root}"])
    (folder,) = (d for d in root.iterdir() if d.name != "prediction-cache")
    return {
        "cwd": sorted(p.name for p in here.iterdir()),
        "cache": sorted(p.name for p in (root / "prediction-cache").glob("*")),
        "out": out.getvalue(),
        "rc": rc,
        "dir": folder,
        "records": rec.read_records(folder / "records.jsonl"),
        "run": json.loads((folder / "run.json").read_text()),
    }


@pytest.mark.once
def test_every_module_runs_tiny_and_answers_its_claims(tiny_run):
    assert tiny_run["rc"] == 0, tiny_run["run"]["modules"]
    # a log says where a topic is, not only which topic: each compile and timing as it starts
    out = tiny_run["out"]
    assert "training (C02, C04, C15, C17): compiling tiny, batch 2 × 32" in out, out[:3000]
    assert "inference (" in out and ": timing the forward, " in out, out[:3000]
    modules = tiny_run["run"]["modules"]
    assert list(modules) == list(experiments.MODULES)
    covered = set()
    for name in experiments.MODULES:
        assert modules[name]["error"] is None and modules[name]["records"] > 0, name
        module = experiments.load(name)
        covered |= set(module.CLAIMS)
        claims_seen = {
            r["config"]["claim"] for r in tiny_run["records"] if r["config"]["module"] == name
        } - {None}  # the prediction section's records answer no claim: they qualify them all
        assert claims_seen <= set(module.CLAIMS), (name, claims_seen)
        assert claims_seen == set(module.CLAIMS), (name, claims_seen)
    assert covered == set(IDS)


@pytest.mark.once
def test_the_ledgers_h100_7b_decode_step_runs_in_the_thousands_of_tokens_per_s(tiny_run):
    """C18's 7B figure is lab.serve's decode step compiled for an H100 at the batch a server
    keeps in flight, timed by the step-time model: thousands of tokens/s, not a CPU's."""
    pytest.importorskip("jax_plugins.xla_cuda13", reason="the gpu-plan extra compiles for H100")
    (r,) = [r for r in tiny_run["records"] if r["config"]["metric"] == "usd_per_m_output_tokens_7b"]
    assert r["label"] == "predicted" and r["config"]["gpus"] == 1, r
    assert 1000 < r["config"]["tokens_per_s"] < 10000, r["config"]
    # its compiled programs are kept beside the results (out_dir=), none in the working folder
    assert tiny_run["cache"] and tiny_run["cwd"] == [], tiny_run


@pytest.mark.once
def test_report_table_has_every_claim_and_the_plots(tiny_run):
    text = (tiny_run["dir"] / "REPORT.md").read_text()
    for cid in IDS:
        assert f"| {cid} |" in text
    for png in (
        "roofline.png",
        "matmul.png",
        "attention.png",
        "memory.png",
        "scaling.png",
        "decode.png",
        "prediction.png",
    ):
        assert (tiny_run["dir"] / png).stat().st_size > 1000, png
        assert f"({png})" in text


@pytest.mark.once
def test_every_verdict_rests_on_records(tiny_run):
    records = tiny_run["records"]
    for v in judge_all(records):
        assert v.status != MISSING, v.claim.id
        assert v.records, v.claim.id
        for check in v.checks:
            for reading in check.readings:
                assert records[reading.index]["config"]["claim"] == v.claim.id


@pytest.mark.once
def test_article_arithmetic_error_is_reported_with_its_factor(tiny_run):
    """'100 million operations' against XLA's count of 2·10¹² FLOPs: off by 20,000×."""
    text = (tiny_run["dir"] / "REPORT.md").read_text()
    (c01,) = [r for r in tiny_run["records"] if r["config"]["metric"] == "matmul_10k_flops"]
    assert c01["value"] == pytest.approx(2e12, rel=1e-3)
    assert "×1.6e+04 (above)" in text and "2·n³" in text


def test_cli_rejects_bad_arguments_with_one_line(capsys):
    for argv in (["only=C99"], ["size=huge"], ["colour=red"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error:"), err
    assert cli.main(["sise=tiny"]) == 2
    assert "did you mean size?" in capsys.readouterr().err


def test_a_cache_dir_that_is_a_file_is_refused_before_anything_runs(capsys, tmp_path):
    """cache_dir= is written only when a plan compiles, minutes in: a file there is refused
    at the start, in one line naming the key."""
    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")
    assert cli.main(["only=C09", f"out_dir={tmp_path / 'out'}", f"cache_dir={blocker}"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: cache_dir={blocker}: cannot write to '{blocker}': it is not a folder\n"
    assert not list((tmp_path / "out").glob("*-*"))  # no results folder was begun


def test_plans_on_without_the_gpu_compiler_is_one_line(monkeypatch, capsys, tmp_path):
    """plans=on asks for the GPU plans: without JAX's CUDA plugin it is refused before any
    topic runs, not skipped inside the report."""
    from lab.plans import gpu

    monkeypatch.setattr(gpu, "_pjrt", lambda: None)
    assert cli.main(["plans=on", "only=C10", f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: plans=on compiles GPU plans, and target=gpu:... needs")
    assert err.count("\n") == 1 and not list(tmp_path.iterdir())


def test_only_selects_modules_without_importing_the_rest():
    assert experiments.select(experiments.parse_only("c03,C08")) == ["matmul", "attention"]
    assert experiments.parse_only("C3,c03,8") == ("C03", "C08")  # each once, zero optional
    with pytest.raises(ValueError, match=r"unknown claim id C99 \(did you mean C09 or C19\?\)"):
        experiments.parse_only("C99")
    assert experiments.select(None) == list(experiments.MODULES)
    assert {c.topic for c in CLAIMS} | {"prediction"} == set(experiments.MODULES)


def _relabel(src, dst, backend: str, kind: str):
    shutil.copytree(src, dst)
    rows = rec.read_records(dst / "records.jsonl")
    for r in rows:
        r.update(backend=backend, device_kind=kind)
    (dst / "records.jsonl").unlink()
    rec.write_records(dst / "records.jsonl", rows)
    return dst


def test_a_comparison_that_fails_leaves_no_half_written_folder(tmp_path, monkeypatch, capsys):
    for value, name in enumerate(("a", "b")):
        (tmp_path / name).mkdir()
        r = rec.make_record("x", float(value), "s", claim="C01")
        rec.write_records(tmp_path / name / "records.jsonl", [r])
        (tmp_path / name / "run.json").write_text(json.dumps({"size": "tiny"}))

    def broken(*args, **kwargs):
        raise RuntimeError("a renderer's bug")

    monkeypatch.setattr(compare.markdown, "write_report", broken)
    with pytest.raises(RuntimeError):
        compare.main([f"dirs={tmp_path / 'a'},{tmp_path / 'b'}", f"out_dir={tmp_path / 'cmp'}"])
    assert not list((tmp_path / "cmp").iterdir())
    assert compare.main([f"dirs={tmp_path / 'gone'}"]) == 2
    assert "gone: no such folder" in capsys.readouterr().err


@pytest.mark.once
def test_compare_merges_backends_side_by_side(tiny_run, tmp_path, capsys):
    """A real tiny folder beside two relabelled copies (a TPU and an H100 in name only, to
    exercise the merge): the pair ratios C19 needs appear as derived, multi-backend records."""
    tpu = _relabel(tiny_run["dir"], tmp_path / "tpu", "tpu", "TPU v5 lite")
    h100 = _relabel(tiny_run["dir"], tmp_path / "h100", "gpu", "NVIDIA H100 80GB HBM3")
    # every record the ledger writes is one compare can read (names as text, its claim's unit)
    refused = [(r["what"], why) for r in tiny_run["records"] if (why := compare._finite(r))]
    assert not refused, refused
    argv = [f"dirs={tiny_run['dir']},{tpu},{h100}", f"out_dir={tmp_path / 'cmp'}"]
    assert compare.main(argv) == 0
    (out,) = (tmp_path / "cmp").iterdir()
    text = (out / "REPORT.md").read_text()
    assert "cpu · cpu" in text and "tpu · TPU v5 lite" in text and "H100" in text
    assert f"`{tiny_run['dir']}`" in text and "ran at size `tiny`**" in text  # never unsaid
    merged = rec.read_records(out / "records.jsonl")
    (ratio,) = [
        r
        for r in merged
        if r["config"].get("metric") == "tpu_over_h100" and r["config"].get("on") == "multi"
    ]
    assert ratio["value"] == pytest.approx(1.0) and ratio["label"] == "derived"
    c19 = next(v for v in judge_all(merged) if v.claim.id == "C19")
    tpu_check = next(c for c in c19.checks if c.stated.metric == "tpu_over_h100")
    assert tpu_check.status == "off"  # equal throughput is not 'underperforms'
    assert compare.main([f"dirs={tmp_path / 'nothing-here'}"]) == 2
    assert "two machines, TPU v5 lite × " in text  # a ratio names its machines, not the merger's
    assert "size `None`" not in text and "- merged from" in text
    capsys.readouterr()
    assert compare.main([f"dirs={tpu},{tpu}/", f"out_dir={tmp_path / 'cmp'}"]) == 2
    assert "is the same folder as" in capsys.readouterr().err
    bad = _relabel(tiny_run["dir"], tmp_path / "bad", "cpu", "cpu")
    with (bad / "records.jsonl").open("a") as f:
        f.write('{"what": "cut sh')
    assert compare.main([f"dirs={tpu},{bad}", f"out_dir={tmp_path / 'cmp'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "records.jsonl, line " in err and "cut short" in err
    # two machines' records in one folder (a file appended to another's): its column would
    # carry the first record's name alone
    two = _relabel(tiny_run["dir"], tmp_path / "two", "cpu", "cpu")
    other = {**rec.read_records(two / "records.jsonl")[0], "backend": "tpu"}
    other["device_kind"] = "TPU v5 lite"
    rec.write_records(two / "records.jsonl", [other])
    assert compare.main([f"dirs={tpu},{two}", f"out_dir={tmp_path / 'cmp'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "records of 2 machines (cpu · cpu; tpu · TPU v5 lite)" in err
    run = tmp_path / "a-run"  # what lab.run writes: refused, not compared as a ledger
    run.mkdir()
    for name in ("config.json", "metrics.jsonl", "records.jsonl"):
        (run / name).write_text("{}\n")
    assert compare.main([f"dirs={tpu},{run}", f"out_dir={tmp_path / 'cmp'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a lab.run folder" in err, err


@pytest.mark.once
def test_roofline_points_lie_under_their_roofs(tiny_run):
    """One implementation of the ceilings (lab.measure.ceilings) for the ledger and the tool:
    the roofs are the best rates measured, so no point sits above min(peak, I × bandwidth)."""
    points = [r for r in tiny_run["records"] if r["config"].get("series") == "roofline"]
    roofs = {
        r["config"]["roof"]: r["value"]
        for r in tiny_run["records"]
        if r["config"].get("series") == "roof"
    }
    assert len(points) >= 6 and set(roofs) == {"peak", "bandwidth"}
    for p in points:
        c = p["config"]
        attainable = min(roofs["peak"], c["intensity"] * roofs["bandwidth"])
        assert c["roof"] == pytest.approx(attainable)
        assert p["value"] <= 1.1 * attainable, c["name"]
        # the report names each op in words, not by the sweep's internal name alone
        assert ("polynomial of each element" in p["what"]) != ("matmul x[" in p["what"]), p
    assert not [r for r in tiny_run["records"] if r["what"].startswith("MEASUREMENT ERROR")]


def test_h100_plans_are_opt_in_shaped_like_llama_and_say_why_when_they_cannot_run(monkeypatch):
    """The 7B/70B H100 plans (C10, C14) run only with plans=on or size=full; their configs are
    the Llama-2 shapes on the named meshes; without the CUDA plugin they leave one context
    record saying so instead of failing the topic. (The compiles themselves take minutes: run
    `python -m experiments only=C10,C14 plans=on`.)"""
    from experiments import gpu_plans, plan_kwargs
    from lab.config import STATED_PARAMS, make_config
    from lab.measure.memory import lab_param_count
    from lab.plans import gpu

    assert plan_kwargs("memory", "auto", "quick") == {"plans": False}
    assert plan_kwargs("memory", "auto", "full") == {"plans": True}
    assert plan_kwargs("parallel", "on", "tiny") == {"plans": True}
    assert plan_kwargs("parallel", "off", "full") == {"plans": False}
    assert plan_kwargs("attention", "on", "full") == {}
    for name in ("7B", "70B"):
        cfg = make_config(**gpu_plans.llama_keys(name, 16, "tp"))
        assert cfg.mesh == "data:2,model:8" and cfg.target == "gpu:h100:16", name
        assert cfg.batch_size == 16 and cfg.seq_len == 2048 and cfg.model.scan_layers
        assert abs(lab_param_count(cfg.model) / STATED_PARAMS[cfg.preset] - 1) < 1e-3, name
    monkeypatch.setattr(gpu, "_pjrt", lambda: None)
    for recs, claim in (
        (gpu_plans.llama_memory_per_h100(), "C10"),
        (gpu_plans.llama70b_memory_per_strategy(), "C14"),
    ):
        (r,) = recs
        assert r["config"]["claim"] == claim and r["config"]["role"] == "context"
        assert "pip install -e '.[gpu-plan]'" in r["what"] and r["value"] is None


def test_c01_on_an_accelerator_sets_the_strict_float32_speedup_beside_the_default(monkeypatch):
    """On an accelerator the float32 matmul at JAX's default precision (TF32 on NVIDIA) is
    the claim's figure; the same matmul at precision=highest is set beside it, and the CPU
    rate's label names the size it was measured at. The accelerator here is this CPU."""
    from experiments import matmul

    monkeypatch.setattr(matmul, "ARTICLE_N", 96)
    monkeypatch.setattr(matmul, "CPU_N", 128)
    recs = matmul._matmul_flops_and_speedup(256, 0.0, "gpu")
    by_what = {r["what"]: r for r in recs}
    assert "CPU float32 matmul rate, n=128" in by_what  # the size it ran at, not n=256
    strict = [r for w, r in by_what.items() if "precision=highest" in w]
    assert {r["unit"] for r in strict} == {"FLOP/s", "×"}
    speedups = [r for r in recs if r["config"]["metric"] == "gpu_cpu_matmul_speedup"]
    assert len(speedups) == 1 and "default precision" in speedups[0]["what"]
    assert all(r["value"] > 0 for r in recs if r["unit"] in ("FLOP/s", "×"))
    assert (
        by_what[f"FLOPs of a {96:,}² float32 matmul (counted in the compiled program)"]["value"]
        == 2 * 96**3
    )


_STOPPED_RUN = """
import os, signal, sys, time, types
import experiments
from experiments import __main__ as cli
from experiments.common import record

def finished(size, **_):
    return [record("C06", "ridge_point", "ridge point", 150.0, "FLOP/B", label="derived")]

def stopped(size, **_):
    if sys.argv[2:] == ["points"]:  # two points finished before the stop
        from experiments.common import keep_so_far
        done = [record("C06", None, f"point {i}", 1.0 + i, "s", role="context") for i in (1, 2)]
        keep_so_far(lambda: list(done))
    elif len(sys.argv) > 2:  # a native library takes SIGTERM over (as Mosaic GPU's absl does)
        import ctypes
        ctypes.CDLL(None).signal(int(signal.SIGTERM), ctypes.c_void_p(0))  # SIG_DFL: killed
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)  # as `timeout` or a scheduler would, mid-topic
    time.sleep(60)
    return []

mods = {"roofline": finished, "memory": stopped, "training": finished}
experiments.select = lambda only: list(mods)
experiments.load = lambda name: types.SimpleNamespace(CLAIMS=("C06",), run=mods[name])
sys.exit(cli.main(["size=tiny", "out_dir=" + sys.argv[1]]))
"""


@pytest.mark.parametrize("how", ["native", "plain", "points"])
def test_a_stopped_ledger_keeps_the_finished_topics_and_writes_their_report(tmp_path, how):
    """SIGTERM while a topic runs: one line naming it, exit 143 at once, and REPORT.md from
    the records the finished topics wrote, the topic in flight marked as cut short; also
    after a native library replaced the process's SIGTERM handler during the topic; a topic
    that keeps its finished points (the attention sweep) has them written, marked."""
    import subprocess
    import sys

    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", _STOPPED_RUN, str(tmp_path), *([how] if how != "plain" else [])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 143, p.stderr
    assert time.perf_counter() - t0 < 60  # not after the topic's sleep
    line = p.stderr.strip().splitlines()
    assert len(line) == 1 and line[0].startswith("SIGTERM: stopped during memory;"), p.stderr
    (folder,) = tmp_path.iterdir()
    records = rec.read_records(folder / "records.jsonl")
    report = (folder / "REPORT.md").read_text()
    assert "`memory`" in report and "**cut short** by SIGTERM" in report  # said once
    assert "**failed**" not in report and "cut short: cut short" not in report
    assert "`training`: not run (the run was stopped before it)" in report
    verdicts = json.loads((folder / "run.json").read_text())["verdicts"]  # as REPORT.md says
    training = [c.id for c in CLAIMS if c.topic == "training"]
    assert training and all(verdicts[i] == "not run" for i in training), verdicts
    if how == "points":
        kept = [r for r in records if r["config"].get("cut_short")]
        assert [r["value"] for r in kept] == [2.0, 3.0]
        assert {r["config"]["module"] for r in kept} == {"memory"}
        assert {r["config"]["size"] for r in kept} == {"tiny"}
        assert "the 2 records of its finished points kept" in report
    else:
        assert len(records) == 1  # roofline's; training never ran


_STOPPED_WHILE_WRITING = """
import os, signal, sys, time, types
import experiments
from experiments import __main__ as cli
from experiments.common import record
from lab.report import markdown

def finished(size, **_):
    return [record("C06", "ridge_point", "ridge point", 150.0, "FLOP/B", label="derived")]

write, calls = markdown.write_report, []

def slow_write(*args, **kwargs):  # the stop comes while the last topic's report is written
    calls.append(1)
    if len(calls) == 1:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
    else:  # the stop's own writing is slow (a full ledger's plots): the process waits for it
        time.sleep(1.5)
    return write(*args, **kwargs)

markdown.write_report = slow_write
experiments.select = lambda only: ["roofline"]
experiments.load = lambda name: types.SimpleNamespace(CLAIMS=("C06",), run=finished)
sys.exit(cli.main(["size=tiny", "out_dir=" + sys.argv[1]]))
"""


def test_a_ledger_stopped_while_its_report_is_written_still_has_the_report(tmp_path):
    """SIGTERM after the last topic, while REPORT.md is being written: the stop waits for the
    report, writes it again whole and exits 143 with its one line; the folder keeps REPORT.md
    and run.json, which `experiments.compare` needs."""
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-c", _STOPPED_WHILE_WRITING, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 143, p.stderr
    line = p.stderr.strip().splitlines()
    assert len(line) == 1 and line[0].startswith("SIGTERM: stopped;"), p.stderr
    assert "REPORT.md" in line[0]
    (folder,) = tmp_path.iterdir()
    assert "`roofline`" in (folder / "REPORT.md").read_text()
    assert json.loads((folder / "run.json").read_text())["verdicts"]
    assert len(rec.read_records(folder / "records.jsonl")) == 1


def test_compare_derives_no_cross_machine_ratio_from_different_steps():
    """Folders run at different sizes time different steps: their tokens/s are shown with the
    step beside them, and no GPU-over-CPU ratio is derived from them (it would compare a
    16 × 1024 step with an 8 × 256 one)."""

    def folder(backend, kind, batch, seq, tokens_per_s):
        r = rec.make_record(
            "training tokens/s", tokens_per_s, "tokens/s", claim="C17", metric=None,
            role="context", series="train_throughput", params=3213568, batch=batch, seq_len=seq,
        )  # fmt: skip
        r["backend"], r["device_kind"] = backend, kind
        return {"dir": kind, "records": [r], "name": f"{backend} · {kind}"}

    cpu = folder("cpu", "cpu", 8, 256, 2.95e3)
    gpu = folder("gpu", "NVIDIA H200", 16, 1024, 1.39e6)
    assert compare.derived([cpu, gpu]) == []
    (line,) = compare.unmatched_steps([cpu, gpu])
    assert "8 × 256 against 16 × 1024" in line
    assert "(16 × 1024)" in "\n".join(compare.side_by_side([cpu, gpu]))
    same = folder("gpu", "NVIDIA H200", 8, 256, 1.0e6)
    (ratio,) = compare.derived([cpu, same])
    assert ratio["config"]["metric"] == "gpu_cpu_train_speedup"
    assert ratio["value"] == pytest.approx(1.0e6 / 2.95e3)
    assert compare.unmatched_steps([cpu, same]) == []


def test_step_at_roofs_times_each_op_at_its_roof():
    """C06's share: a product above the ridge is compute-bound and an elementwise pass below it
    is memory-bound, each timed as max(FLOPs / peak, bytes / bandwidth) from the compiled
    program's own counts; the share moves with the roofs, as a ridge does."""
    import jax
    import jax.numpy as jnp

    from lab.predict.model import at_roofs

    n = 256
    x = jnp.asarray(jax.random.normal(jax.random.key(0), (n, n)), jnp.float32)
    matmul = jax.jit(lambda a, b: a @ b).lower(x, x).compile()
    peak, bw = 1e11, 1e10  # a ridge of 10 FLOP/B; the product's intensity is n / 6 ≈ 43
    split = at_roofs(matmul, {"float32": peak}, bw)
    assert split["ops"] == (0, 1) and split["share"] == 0.0
    assert split["compute_s"] == pytest.approx(2 * n**3 / peak, rel=1e-6)

    scale = jax.jit(lambda a: a * 3.0).lower(x).compile()
    split = at_roofs(scale, {"float32": peak}, bw)
    assert split["ops"] == (1, 0) and split["share"] == 1.0
    assert split["memory_s"] == pytest.approx(2 * n * n * 4 / bw, rel=1e-6)

    # the same product below a ridge of 100 FLOP/B is memory-bound
    assert at_roofs(matmul, {"float32": 1e12}, bw)["ops"] == (1, 0)


@pytest.mark.once
def test_c06_is_judged_on_the_compiled_steps_share(tiny_run):
    """C06's verdict rests on the training step's memory-bound share on an accelerator; this
    CPU's share, the ridge and the elementwise rate are context."""
    records = tiny_run["records"]
    (c06,) = [v for v in judge_all(records) if v.claim.id == "C06"]
    (check,) = c06.checks
    assert check.stated.metric == "memory_bound_share"
    (i,) = [
        i
        for i in c06.records
        if records[i]["config"].get("metric") == "memory_bound_share"
        and records[i]["label"] == "derived"
    ]
    r = records[i]
    # 1.0 where every op's intensity falls below this host's measured ridge (a loaded host's
    # bandwidth reads low): a share, whatever the host
    assert 0.0 < r["value"] <= 1.0 and r["config"]["bound"] == "upper"
    c = r["config"]
    assert r["value"] == pytest.approx(c["memory_s"] / (c["memory_s"] + c["compute_s"]))
    # the claim is about GPUs: a CPU's share (an upper bound, its caches) is context
    assert c["role"] == "context" and check.status == "n/a here" and i in check.context


class _FakeDriver:
    """libcuda as ctypes sees it: the attribute values of an H100 SXM, and one call refused."""

    VALUES = {38: 50 * 2**20, 81: 228 * 1024, 16: 132}

    def __init__(self, refuse=()):
        self.refuse, self.asked = set(refuse), []

    def cuInit(self, flags):
        return 0

    def cuDeviceGet(self, ref, ordinal):
        ref._obj.value = ordinal
        return 0

    def cuDeviceGetAttribute(self, ref, attr, dev):
        self.asked.append((attr, dev.value))
        if attr in self.refuse:
            return 1
        ref._obj.value = self.VALUES[attr]
        return 0


def test_c20_reads_l2_and_shared_memory_from_the_driver_and_judges_them():
    """C20 on a GPU: the driver's L2 and shared memory per SM become records for the device
    JAX numbers (its local hardware id), judged against 40–50 MB and 96 KB; an H100 holds on
    the L2 and is off on the shared memory (228 KB). Without a driver: no record."""
    import types

    from experiments.hardware import _driver_report
    from lab.measure import cuda
    from lab.report.verdict import judge

    lib = _FakeDriver()
    dev = types.SimpleNamespace(id=3, local_hardware_id=1)
    recs = _driver_report(dev, lib=lib)
    assert {a for a, _ in lib.asked} == set(cuda.ATTRIBUTES.values())
    assert {d for _, d in lib.asked} == {1}
    by_metric = {r["config"]["metric"]: r for r in recs}
    assert by_metric["l2_cache"]["value"] == 50 * 2**20
    assert by_metric["shared_memory_per_sm"]["value"] == 228 * 1024
    for r in recs:
        r["backend"], r["device_kind"] = "gpu", "NVIDIA H100 80GB HBM3"
    (c20,) = [c for c in CLAIMS if c.id == "C20"]
    checks = {c.stated.metric: c.status for c in judge(c20, recs).checks}
    assert checks["l2_cache"] == "holds" and checks["shared_memory_per_sm"] == "off"

    refused = _driver_report(dev, lib=_FakeDriver(refuse={81}))
    assert [r["config"]["metric"] for r in refused] == ["l2_cache"]
    # a MIG slice reports its own L2: context, named so, never the chip's verdict
    mig = types.SimpleNamespace(id=0, local_hardware_id=0, device_kind="H100 MIG 1g.10gb")
    (l2,) = [r for r in _driver_report(mig, lib=_FakeDriver()) if "L2" in r["what"]]
    assert l2["config"]["role"] == "context" and "of this MIG slice" in l2["what"]
    assert cuda.driver_attributes(0, lib=types.SimpleNamespace()) == {}  # no such symbols


def test_a_step_two_topics_time_is_timed_once_and_losses_are_added(monkeypatch):
    """The parallel topic times the shared step without losses, the training topic asks for
    its losses: one timing (two had given the same step two MFUs in one report, 19.3% and
    21.3%), and the losses are those of a probe that took them first."""
    from experiments import common

    monkeypatch.setattr(common, "_PROBES", {})
    cfg = common.step_config("tiny")
    timed = []
    real = common.timing.bench
    monkeypatch.setattr(common.timing, "bench", lambda *a, **k: timed.append(1) or real(*a, **k))
    first = common.train_probe(cfg, budget_s=0.01)
    assert first["losses"] == [] and len(timed) == 1
    again = common.train_probe(cfg, budget_s=0.01, loss_steps=3)
    assert len(timed) == 1 and again["step"] == first["step"] and len(again["losses"]) == 3
    monkeypatch.setattr(common, "_PROBES", {})
    fresh = common.train_probe(cfg, budget_s=0.01, loss_steps=3)
    assert fresh["losses"] == again["losses"]


def _ledger(folder, backend, kind, records):
    """A results folder as python -m experiments writes it, of synthetic records."""
    folder.mkdir(parents=True)
    for r in records:
        r.update(backend=backend, device_kind=kind)
    rec.write_records(folder / "records.jsonl", records)
    (folder / "run.json").write_text(json.dumps({"size": "tiny"}))
    return folder


def test_compare_names_each_records_machine_for_the_plots_and_the_verdicts(tmp_path):
    """Two CPU folders of one size: every merged record names its column (the folder's name
    tells them apart), the batch plot draws a line per folder named so (one line zigzagged
    over both), and the verdict table says whose each value is."""
    from lab.report import plots

    def records(scale):
        share = rec.make_record(  # a part a CPU decides (C06's share is context on one)
            "memory with remat over without", 0.9 * scale, "×",
            claim="C11", metric="remat_memory_ratio", role="evidence",
        )  # fmt: skip
        sweep = [
            rec.make_record(
                f"tokens/s at batch {b}",
                1e3 * b * scale,
                "tokens/s",
                claim="C12",
                metric=None,
                role="context",
                series="batch_sweep",
                batch=b,
                memory_bytes=2**20 * b,
            )  # fmt: skip
            for b in (2, 8)
        ]
        return [share, *sweep]

    a = _ledger(tmp_path / "run1", "cpu", "cpu", records(1.0))
    b = _ledger(tmp_path / "run2", "cpu", "cpu", records(0.5))
    result = compare.merge([a, b], tmp_path / "cmp")
    merged = rec.read_records(result["dir"] / "records.jsonl")
    assert {r["machine"] for r in merged} == {"cpu · cpu · tiny · run1", "cpu · cpu · tiny · run2"}
    kept = []
    saved = plots._save
    try:
        plots._save = lambda fig, path, **kw: kept.append(fig) or path
        plots.batch_sweep(merged, tmp_path / "batch.png")
    finally:
        plots._save = saved
    lines = kept[0].axes[0].get_lines()
    assert [(line.get_label(), list(line.get_xdata())) for line in lines] == [
        ("tokens/s · cpu · cpu · tiny · run1", [2, 8]),
        ("tokens/s · cpu · cpu · tiny · run2", [2, 8]),
    ]
    text = result["path"].read_text()
    remat = "remat ÷ plain memory"
    assert (
        f"| {remat}: 0.9× (cpu · cpu · tiny · run1); {remat}: 0.45× (cpu · cpu · tiny · run2) |"
        in text
    )


def test_the_side_by_side_rows_line_up_one_quantity_measured_beside_measured():
    """The classifier row is the best batch measured (it showed the CPU's predicted 16-core
    extrapolation, 42.3k against 5.29k measured), the prediction has its own row that says
    so, and a roof names the op that set it (a polynomial on one machine, a matmul on the
    other, in a row called "matmul peak"); records written before `set_by` are read from
    their words."""

    def folder(name, best_rps, peak_what, set_by=None, roof_label="measured"):
        rows = [
            rec.make_record(
                f"classifier requests/s at batch {b}",
                rps,
                "req/s",
                claim="C16",
                metric=None,
                role="context",
                series="inference_batch",
                batch=b,
                seq_len=32,
            )  # fmt: skip
            for b, rps in ((1, best_rps / 2), (4, best_rps))
        ]
        rows.append(
            rec.make_record(
                "best requests/s (batch 4) × 16/2 cores",
                best_rps * 8,
                "req/s",
                label="predicted",
                claim="C16",
                metric="cpu16_rps",
                role="evidence",
            )  # fmt: skip
        )
        extra = {"set_by": set_by} if set_by else {}
        rows.append(
            rec.make_record(
                peak_what,
                6.7e10,
                "FLOP/s",
                label=roof_label,
                claim="C06",
                metric=None,
                role="context",
                series="roof",
                roof="peak",
                **extra,
            )  # fmt: skip
        )
        rows.append(
            rec.make_record(
                "roof: memory bandwidth, the best measured (poly_1, which moved bytes faster "
                "(the copy figure is 38% below it: a noisy host?); copy x ← x·s in place)",
                3.1e10,
                "B/s",
                label=roof_label,
                claim="C06",
                metric=None,
                role="context",
                series="roof",
                roof="bandwidth",
                copy_bytes_per_s=1.95e10,
            )  # fmt: skip
        )
        return {"dir": name, "records": rows, "name": name}

    old = folder(
        "run1", 5.29e3,
        "roof: matmul peak (the sweep's poly_64, faster than the float32 precision=default, "
        "n=128 matmul)",
    )  # fmt: skip
    # the newer run labels its roofs derived (the best of the rates timed), as the lab now does
    new = folder("run2", 2.7e3, "roof: matmul peak (float32 precision=highest, n=128)",
                 set_by="matmul float32 precision=highest, n=128",
                 roof_label="derived")  # fmt: skip
    table = {line.split(" | ")[0].lstrip("| "): line for line in compare.side_by_side([old, new])}
    assert table["classifier requests/s (best batch measured)"].endswith(
        "| 5.29 kreq/s *measured* (batch 4) | 2.7 kreq/s *measured* (batch 4) |"
    )
    assert table["classifier requests/s, a 16-core CPU (predicted from the best batch)"].endswith(
        "| 42.3 kreq/s *predicted* | 21.6 kreq/s *predicted* |"
    )
    assert not any("predicted" in line for name, line in table.items() if "predicted" not in name)
    assert table["compute roof (fastest op measured)"].endswith(
        "| 67 GFLOP/s *measured* (set by poly_64) "
        "| 67 GFLOP/s *derived* (set by matmul float32 precision=highest, n=128) |"
    )
    assert table["memory roof (fastest op measured)"].count("(set by poly_1)") == 2
    # the copy kernel's own figure is timed, whatever the roof record it rides on says
    assert table["copy bandwidth (x ← x·s)"].endswith("| 19.5 GB/s *measured* " * 2 + "|")


def test_c01_datasheet_peak_ratios_are_upper_bounds(monkeypatch):
    """The words say '(upper bound)' and the records say so too (`bound`), so a ratio above
    the range decides nothing and one below it decides: no 'outside … (above)' on a bound."""
    from experiments import matmul

    monkeypatch.setattr(matmul, "ARTICLE_N", 96)
    monkeypatch.setattr(matmul, "CPU_N", 128)
    recs = matmul._matmul_flops_and_speedup(128, 0.0, "cpu")
    peaks = [r for r in recs if "datasheet peak" in r["what"]]
    assert len(peaks) == len(matmul.REFERENCE_GPUS)
    assert all("(upper bound)" in r["what"] and r["config"]["bound"] == "upper" for r in peaks)
    (v,) = judge_all(recs, [c for c in CLAIMS if c.id == "C01"])
    assert all(x.direction != "above" for x in v.checks[1].readings)


def _cpu_probe_like(step_s: float, peak_mfu: float = 0.5):
    from experiments.common import step_config

    cfg = step_config("tiny")
    tokens = cfg.batch_size * cfg.seq_len
    return {
        "cfg": cfg,
        "step": {"median_s": step_s},
        "tokens_per_s": tokens / step_s,
        "model_flops_per_s": peak_mfu * 1e11,
    }


def test_c02_prediction_is_the_same_steps_time_not_a_peak_ratio(monkeypatch):
    """C02 on a CPU: this CPU's measured step time over the step time the step-time model
    predicts for the same step compiled for an H100, labelled predicted with the model's
    error; the datasheet-peak ratio (the MFU cancels in it) is context, named as a ratio of
    peaks, and without plans nothing predicts the speed-up."""
    from experiments import training

    monkeypatch.setattr(training, "backend", lambda: "cpu")
    calls = []

    def fake_predicted_step(size, key, chips=1, **_):
        calls.append(key)
        if key != "h100-sxm":
            return None
        return {
            "seconds": 0.004,
            "mfu": 0.3,
            "statement": "step-time model (±20%)",
            "target": "gpu:h100",
            "tokens_per_s": 1.0,
        }

    monkeypatch.setattr(training, "predicted_step", fake_predicted_step)
    p_cpu = _cpu_probe_like(2.0)
    peak = 8e10
    recs = training._gpu_over_cpu_training_speed(p_cpu, p_cpu, peak, "tiny", plans=True)
    (pred,) = [r for r in recs if r["label"] == "predicted"]
    assert pred["config"]["metric"] == "gpu_cpu_train_speedup"
    assert pred["label"] == "predicted" and pred["config"]["target"] == "h100-sxm"
    assert pred["value"] == pytest.approx(2.0 / 0.004)
    assert pred["config"]["model_error"] == "step-time model (±20%)"
    assert "step time" in pred["what"] and "step-time model (±20%)" in pred["what"]
    ratios = [r for r in recs if r["config"]["role"] == "context"]
    assert {r["config"]["target"] for r in ratios} == set(training.SPEEDUP_TARGETS)
    h100 = next(r for r in ratios if r["config"]["target"] == "h100-sxm")
    assert h100["value"] == pytest.approx(training.accel_peak("h100-sxm")[0] / peak)
    assert "ratio of peaks" in h100["what"] and "float32 matmul" in h100["what"]
    without = training._gpu_over_cpu_training_speed(p_cpu, p_cpu, peak, "tiny", plans=False)
    assert {r["config"]["role"] for r in without} == {"context"}
    assert not [r for r in without if r["label"] == "predicted"]
    (v,) = judge_all(without, [c for c in CLAIMS if c.id == "C02"])
    assert v.status == "n/a here" and len(v.checks[0].context) == len(without)


def test_c06_names_the_compute_roof_by_the_op_that_set_it(monkeypatch):
    """An elementwise op of the sweep can run faster than the matmul timed: the roof is then
    worded as the best FLOP/s of the ops timed (naming that op), the matmul peak is its own
    record, and the ridge says it is the compute roof over the memory roof."""
    from experiments import roofline as exp_roofline
    from lab.measure import ceilings
    from lab.measure.roofline import Point

    points = [Point("poly_1", 2e6, 8e6, 1e-3), Point("poly_64", 1.3e8, 8e6, 1e-3)]
    fake = {
        "peak_flops": 1.3e11,
        "bandwidth": 3e10,
        "points": points,
        "copy": {"bytes_per_s": 3e10, "buffer_bytes": 2**20, "buffers": 4},
        "bandwidth_note": "the copy kernel's (x ← x·s)",
        "above_roof": [],
        "peak_op": "poly_64",
        "bandwidth_op": "copy",
        "peak_name": "the sweep's poly_64, faster than the float32 matmul, "
        "precision=default, n=1024",
        "matmul_peak": 6.7e10,
        "matmul_name": "float32 matmul, precision=default, n=1024",
    }
    monkeypatch.setattr(ceilings, "roofline_ceilings", lambda *a, **k: fake)
    monkeypatch.setattr(exp_roofline, "_step_at_roofs", lambda *a: [])
    recs = exp_roofline._roofline_measured("cpu", "tiny", 0.0)
    assert not [r for r in recs if "matmul peak (the sweep" in r["what"]]
    (roof,) = [r for r in recs if r["config"].get("roof") == "peak"]
    assert roof["what"].startswith("roof: compute, the best FLOP/s of the ops timed")
    assert "poly_64" in roof["what"] and roof["value"] == 1.3e11
    # both roofs are the best of the rates timed, as lab.tools.ceilings labels them
    (bw,) = [r for r in recs if r["config"].get("roof") == "bandwidth"]
    assert roof["label"] == bw["label"] == "derived"
    (mm,) = [r for r in recs if r["what"].startswith("matmul peak:")]
    assert mm["value"] == 6.7e10 and "n=1024" in mm["what"] and mm["label"] == "measured"
    (ridge,) = [r for r in recs if r["what"].startswith("ridge point")]
    assert "compute roof" in ridge["what"] and "matmul peak" not in ridge["what"]


def test_c06_share_on_a_cpu_is_context_and_on_an_accelerator_evidence(monkeypatch):
    """The share measured here: a CPU's is context (an upper bound: its caches), an
    accelerator's is evidence that decides."""
    from experiments import roofline as exp_roofline

    split = {"share": 0.06, "ops": (600, 100), "compute_s": 0.94, "memory_s": 0.06}
    monkeypatch.setattr(exp_roofline, "at_roofs", lambda *a, **k: split)
    probe = {
        "cfg": exp_roofline.shared_config("tiny"),
        "compiled": None,
        "trainer": types.SimpleNamespace(mesh=None),
    }
    monkeypatch.setattr(exp_roofline, "compile_probe", lambda cfg: probe)
    roof = {"matmuls": {("float32", "default"): {"flops_per_s": 6.7e10}}, "bandwidth": 3e10}
    (cpu,) = exp_roofline._step_at_roofs("tiny", roof, "cpu")
    assert cpu["config"]["role"] == "context" and cpu["config"]["bound"] == "upper"
    assert "context, the claim is about GPUs" in cpu["what"]
    (gpu,) = exp_roofline._step_at_roofs("tiny", roof, "gpu")
    assert gpu["config"]["role"] == "evidence" and "bound" not in gpu["config"]
    gpu["backend"] = "gpu"
    (v,) = judge_all([cpu, gpu], [c for c in CLAIMS if c.id == "C06"])
    assert v.status == "off" and [x.record for x in v.checks[0].readings] == [gpu]


def test_the_ledgers_peaks_say_which_op_and_size_they_are():
    """Five CPU 'peaks' in one report are five measurements: each record names its op."""
    from experiments import training
    from experiments.common import mfu_peak_name

    assert mfu_peak_name("quick") == "float32 matmul, default precision, n=1024"
    p = {**_cpu_probe_like(1.0), "params": 1, "flops_per_token": 1.0, "flops_convention": ""}
    (mfu,) = [
        r
        for r in training._throughput(p, 8e10, "float32 matmul, default precision, n=1024")
        if r["what"].startswith("MFU")
    ]
    assert "(float32 matmul, default precision, n=1024)" in mfu["what"]


def test_the_serving_peak_says_which_matmul_it_is():
    """C21's compute roof (the serving study's) names its matmul's size, beside the others."""
    from lab.measure.serving import Roofs

    roofs = Roofs(1e10, 1e11, "float32", {"bytes_per_s": 1e10}, peak_n=1024)
    assert roofs.peak_name == "float32 matmul, n=1024"


def test_c21_flags_a_copy_bandwidth_that_moved_during_the_sweep():
    """As lab.serve calls it out: a copy bandwidth that moved more than 15% between before
    and after the serving sweep (44.9 against 22.6 GB/s) leaves a caution in the ledger."""
    from experiments import inference
    from lab.measure.serving import NOISY_ROOF, Roofs

    def roofs(before, after):
        return Roofs(
            before, 1e11, "float32", {"bytes_per_s": before}, copy_after={"bytes_per_s": after}
        )

    (flag,) = inference._noisy_roof(roofs(44.9e9, 22.6e9))
    assert flag["what"].startswith("CAUTION: the copy bandwidth fell 50%")  # 44.9 → 22.6
    assert "44.9 GB/s before, 22.6 after" in flag["what"]
    assert flag["config"]["claim"] == "C21" and flag["config"]["role"] == "context"
    assert flag["value"] == pytest.approx(22.6 / 44.9)
    assert inference._noisy_roof(roofs(44.9e9, 44.9e9 * (1 + NOISY_ROOF / 2))) == []
    assert inference._noisy_roof(Roofs(1e10, 1e11, "float32", {"bytes_per_s": 1e10})) == []


def test_the_shared_step_is_the_step_training_times_in_the_backends_dtype(monkeypatch):
    """The prediction topic's 'MFU measured here' (the shared step) and the training topic's
    (its float32 step on CPU) are one compiled and timed step: one report, one MFU."""
    from experiments import common, training

    asked = []
    monkeypatch.setattr(common, "train_probe", lambda cfg, **k: asked.append((cfg, k)) or {})
    monkeypatch.setattr(training, "train_probe", lambda cfg, **k: asked.append((cfg, k)) or {})
    common.shared_step("tiny")
    training._precision_pair("tiny")
    shared, (cfg, k) = asked[0], asked[1 + ["float32", "bfloat16"].index(common.compute_dtype())]
    assert shared[0] == cfg and shared[1]["budget_s"] == k["budget_s"]  # one cache key
    assert common.compute_dtype() == "float32"  # on CPU (auto's dtype, named)


def test_a_runs_own_report_says_why_a_claim_has_no_record():
    """A stopped run's REPORT.md: a claim whose topic was never reached reads "not run", one
    whose topic was cut short "cut short", as compare's column on that folder does, instead
    of "no record"."""
    from lab.report import markdown

    by_topic = {}
    for c in CLAIMS:
        by_topic.setdefault(c.topic, c)
    (cut, done, never) = list(by_topic.values())[:3]
    meta = {
        "size": "quick",
        "topics": [cut.topic, done.topic, never.topic],
        "modules": {
            cut.topic: {"wall_s": 1.0, "records": 0, "error": "cut short by SIGTERM: no records"},
            done.topic: {"wall_s": 1.0, "records": 0, "error": None},
        },
    }
    verdicts = judge_all([], [cut, done, never])
    rows = "\n".join(markdown.verdict_rows(verdicts, [], meta))
    assert f"| {cut.id} |" in rows and "**cut short**" in rows
    assert "**not run**" in rows and f"**{MISSING}**" in rows  # the finished topic's own
    text = markdown.render([], verdicts, {}, meta)
    assert f"`{never.topic}`: not run (the run was stopped before it)" in text
    # each claim's own section says the same as its row
    assert f"### {cut.id} — cut short" in text and f"### {never.id} — not run" in text
    assert f"### {done.id} — {MISSING}" in text


def test_the_classifier_records_name_the_model_they_timed():
    """size=tiny times the tiny preset, not BERT-base: its records say which it timed."""
    from experiments import inference

    rows = [
        dict(batch=b, requests_per_s=10.0 * b, seq_len=32, median_s=0.1, flops_per_request=1e6)
        | {"classifier": "the tiny preset: 2 layers, d_model 64, 32 tokens"}
        for b in (1, 4)
    ]
    recs = inference._classifier_requests_per_s(rows, 0.3)
    named = [r["what"] for r in recs if r["config"].get("series") == "inference_batch"]
    assert named == [
        f"classifier requests/s at batch {b} (the tiny preset: 2 layers, d_model 64, 32 tokens)"
        for b in (1, 4)
    ]
    (best,) = [r for r in recs if r["config"].get("metric") == "cpu16_rps"]
    assert "(batch 4, the tiny preset" in best["what"]


def test_each_record_says_the_size_it_was_measured_at(tmp_path, monkeypatch):
    """Only run.json said a run's size: a folder read without it (or with another run's)
    passed a tiny run's figures as a real run's. Each record now carries it."""
    import types

    import experiments
    from experiments.common import record

    def topic(size, **_):
        return [record("C06", "ridge_point", "ridge point", 150.0, "FLOP/B", label="derived")]

    monkeypatch.setattr(experiments, "select", lambda only: ["roofline"])
    topics = types.SimpleNamespace(CLAIMS=("C06",), run=topic)
    monkeypatch.setattr(experiments, "load", lambda name: topics)
    assert cli.main(["size=tiny", f"out_dir={tmp_path}"]) == 0
    (folder,) = tmp_path.iterdir()
    (r,) = rec.read_records(folder / "records.jsonl")
    assert r["config"]["size"] == "tiny" and r["config"]["module"] == "roofline"


def test_the_inference_topic_says_its_h100_compiles_before_they_start(monkeypatch):
    """The Llama-2 decode steps compiled for H100s take tens of seconds and time nothing here:
    the progress line moves on to them, instead of sitting on the last timing's words."""
    from experiments import common, inference

    said, order = [], []
    monkeypatch.setattr(common, "_STEP", [said.append])
    decode = type("Row", (), {"batch": 1, "memory_roof_share": 0.5})()
    monkeypatch.setattr(inference, "_sweep", lambda size: [{"flops_per_s": 1.0}])
    monkeypatch.setattr(inference, "mfu_peak", lambda size: 2.0)
    study = type("Study", (), {"decode": [decode]})()
    monkeypatch.setattr(inference, "_serving_study", lambda size: (study, "tiny", "random"))
    for name in ("_classifier_requests_per_s", "_input_token_cost", "_serving_records"):
        monkeypatch.setattr(inference, name, lambda *a: [])
    monkeypatch.setattr(inference, "_serving_memory_70b", lambda: [])

    def output_cost(*a):
        order.append(list(said))
        return []

    monkeypatch.setattr(inference, "_output_token_cost", output_cost)
    assert inference.run("tiny", plans=False) == []
    assert order == [
        ["Llama-2 7B and 70B decode steps compiled for H100s, for the step-time model"]
    ]

"""lab.serve end to end on CPU (tiny shapes: the numbers only exercise the code; the
benchmark is in BENCHMARKS.md): random weights and a trained run, the records and the PNG,
the derived figures against their definitions, a plan compiled for H100 and a TPU slice, and
bad input as one line with exit code 2."""

import functools
import importlib.util
import json
import logging
import math

import pytest

from lab.run import main as train
from lab.serve import main as serve

FAST = [
    "model=tiny",
    "prompt_len=8",
    "decode_steps=4",
    "prefill_batches=1",
    "budget=0.01",
]


def _records(folder):
    (path,) = folder.glob("serve-*.jsonl")
    return [json.loads(line) for line in path.open()]


@pytest.mark.once
def test_random_weights_sweep_records_and_plot(tmp_path, capsys):
    assert serve([*FAST, "batches=2", f"results={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "random weights" in out and "critical batch" in out and "int8" in out
    assert "matmul  batch 2 float:" in out and "matmul  batch 2 int8:" in out
    assert "matmul  xla: XLA's dot" in out  # each candidate named once, under the points
    recs = _records(tmp_path)
    peers = [r for r in recs if r["config"].get("peer") == "torch"]
    assert len(peers) == (1 if importlib.util.find_spec("torch") else 0)
    assert list(tmp_path.glob("serve-*.png"))
    decode = [r for r in recs if r["config"].get("series") == "decode_batch"]
    assert {(r["config"]["batch"], r["config"]["int8"]) for r in decode} == {(2, False), (2, True)}
    for r in decode:
        c = r["config"]
        # the figures are what their definitions say, from the measured time
        assert r["value"] == pytest.approx(c["batch"] / c["median_s"])
        assert c["bytes"] == c["weight_bytes"] + c["cache_bytes"] > 0
        assert c["intensity"] == pytest.approx(c["flops"] / c["bytes"])
        # every way to multiply the weights was timed and the fastest kept, by name
        assert c["matmul"] in c["matmuls"] and "xla" in c["matmuls"]
        assert r["value"] == pytest.approx(max(c["matmuls"].values()))
        assert ("w8a8" in c["matmuls"]) == c["int8_weights"]
    f32, i8 = (next(r for r in decode if r["config"]["int8"] == q) for q in (False, True))
    # int8 weights: a quarter of the float32 bytes, plus one f32 scale per output channel
    assert i8["config"]["weight_bytes"] < 0.4 * f32["config"]["weight_bytes"]
    errs = {r["config"]["matmul"]: r for r in recs if "relative RMS" in r["what"]}
    assert set(errs) == set(i8["config"]["matmuls"])  # every int8 matmul timed, named
    assert all(0 < r["value"] < 5e-2 and r["what"].endswith(m) for m, r in errs.items())
    assert "int8 weights, w8a8 matmul (int8 activations too" in " ".join(out.split())
    crit = next(r for r in recs if r["config"].get("metric") == "decode_critical_batch")
    assert crit["value"] is None or crit["value"] > 0
    assert (crit["value"] is None) == (crit["config"]["sensitivity"] is None)
    # the bandwidths are measured before the sweep and again after it; the roof is the best
    by_what = {r["what"]: r["value"] for r in recs}
    for what in ("copy bandwidth", "read bandwidth"):
        assert by_what[what] > 0 and by_what[f"{what} after the sweep"] > 0
    copies = (by_what["copy bandwidth"], by_what["copy bandwidth after the sweep"])
    assert by_what["memory roof"] >= max(copies)
    assert "copy before / after the sweep" in out


@pytest.mark.once
def test_a_trained_text_run_is_served_with_a_sample(tmp_path, capsys):
    args = ["model=tiny", "batch_size=8", "seq_len=32", "data=text", f"out_dir={tmp_path}"]
    assert train([*args, "name=t", "steps=4", "checkpoint_every=4"]) == 0
    capsys.readouterr()
    keys = [f"out_dir={tmp_path}", f"results={tmp_path}", "run=t", "sample=12", "int8=false"]
    assert serve([*FAST[1:], "batches=1", "plot=false", *keys]) == 0
    out = capsys.readouterr().out
    assert "run t, step 4" in out and "sample" in out
    assert "prompt:" in out and "generated:" in out  # told apart without colour
    # a prompt is text, never markup; bytes that are not UTF-8 (argv's surrogates) are bytes
    prompt = "a[/b]c[bold red]d\udcff"
    assert serve([*FAST[1:], "batches=1", "plot=false", *keys, f"prompt={prompt}"]) == 0
    assert "a[/b]c[bold red]d\ufffd" in capsys.readouterr().out
    # the prompt is shown as the generated text is: an ESC would drive the terminal
    assert serve([*FAST[1:], "batches=1", "plot=false", *keys, "prompt=a\x1b[31mRED"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "a\\x1b[31mRED" in out
    # the same run asked for another shape: refused before anything loads
    assert serve([*keys, "d_model=128"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds another model" in err and "d_model" in err


@pytest.mark.parametrize(
    "args, words",
    [
        (["run=nowhere"], "no run folder"),
        (["context=10"], "decode_steps=4 and 3 warm-up steps need"),
        (["mesh=2", "batches=1,2"], "serving batches [1] (of batches= and prefill_batches="),
        (["batches=1,x"], "'x' is not an integer"),
        (["bacthes=1"], "did you mean batches"),
        (["batch=1"], "(did you mean batches?)"),  # not plan_batch, nor the refused batch_size
        (["target=gpu:h100:1", "plan_context=2147483648"], "plan_context='2147483648': must be"),
        (["target=gpu:h100:1", "plan_batch=3000000000"], "plan_batch='3000000000': must be"),
        (["run=../elsewhere"], "one folder name under out_dir"),
        (["run=a/b"], "one folder name under out_dir"),
        (["context=20000000", "batches=64"], "GiB available; give a smaller context="),
        (["batches=1,1"], "batches=1,1: 1 is given twice"),
        (["batches=1,,2"], "an empty item between commas"),
        (["sample=100000"], "sample='100000': must be <= 4096"),
        (["steps=100"], "steps=100: lab.serve trains nothing"),
        (["seed=99999999999999999999"], "must be <= 4294967295"),
        (["name=demo", "lr=1"], "lr=1.0, name=demo: lab.serve trains nothing"),
        (["name=demo"], "served with run=NAME"),
        (["seq_len=64"], "the lengths served are prompt_len= and context="),
        ([f"prompt={'é' * 2100}"], "prompt= is 4,200 bytes: at most 4096"),
        # FAST's prompt_len=, decode_steps=, budget=, prefill_batches= are the sweep's
        (["target=gpu:h100:1"], "budget=0.01: target= compiles one decode step"),
        (["plan_batch=3"], "plan_batch=3: only a plan for an accelerator (target=) reads"),
        # typed at its default it is still asked for, and still read by nothing
        (["plan_context=4096"], "plan_context=4096: only a plan for an accelerator"),
        (["target=gpu:h100:1", "plot=false"], "plot=false: target= compiles one decode step"),
        (["target=gpu:h100:1", "seed=3"], "seed=3: target= compiles one decode step"),
        # out_dir= is where run= is read from: without run= it says where records go instead
        (["out_dir=elsewhere"], "out_dir=elsewhere: lab.serve reads out_dir= only to find"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, args, words):
    results = tmp_path / "results"  # made for the command: a refusal leaves none behind
    runs = [f"out_dir={tmp_path}"] if any(a.startswith("run=") for a in args) else []
    assert serve([*FAST, f"results={results}", *runs, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not results.exists()
    logging.getLogger("absl").warning("after")  # its lab.log's folder is gone: dropped


def test_a_cache_too_short_is_refused_before_anything_loads(tmp_path, capsys):
    """The sweep's batches and cache are read from the options alone: refused before the
    session starts, so no header comes before the line."""
    assert serve([*FAST, f"results={tmp_path / 'r'}", "context=10"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "need" in err and "cache slots" in err, (out, err)


def test_the_header_names_the_decode_attention_kernel(tmp_path, capsys):
    """The header names the prefill attention and, on its own line, the decode attention
    kernel: with a soft-cap on CPU that is the plain-JAX reference, and the line says why;
    a mesh over fewer devices than there are says how many it uses.
    (A context too large for memory stops the run right after the header.)"""
    from lab.kernels import cpu_gemv

    fast = [a for a in FAST if not a.startswith("prefill_batches=")]  # 1 splits over no mesh
    args = [*fast, "softcap=30", "context=20000000", "batches=64", "mesh=2", "prefill_batches=2"]
    assert serve([*args, f"results={tmp_path}"]) == 2
    out = capsys.readouterr().out
    assert out.count("decode    attention ") == 1
    words = " ".join(out.split())  # the console wraps a long line at its width
    assert "cpu × 8 (simulated CPU devices)" in words and "mesh=2 (2 of 8 devices)" in words
    if cpu_gemv.available():
        assert (
            "decode attention reference (plain JAX: reads every cache slot) instead of cpu: "
            "the cpu kernel has no soft-cap (softcap=30)"
        ) in words


def _plan_tools_missing(target: str) -> str | None:
    if target.startswith("gpu"):
        from lab.plans import gpu

        if gpu._pjrt() is None or gpu.ptxas() is None:
            return "the CUDA plugin or ptxas is missing: pip install -e '.[gpu-plan]'"
        return None
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return "libtpu not installed: pip install -e '.[tpu]'"
    return None


@pytest.mark.parametrize(
    "target, mesh", [("gpu:h100:1", "1"), ("tpu:v5e:2x2", "1x4"), ("tpu:v5e:2x2", "4x1")]
)
def test_serving_plan_compiles_for_a_target(target, mesh, tmp_path, capsys):
    """The decode step (float and int8 weights and cache) compiled for H100 and for a TPU
    slice (kv heads over `model`; or sequences over `data`, each chip with all the weights):
    the compiler's memory per device beside the calculator's."""
    missing = _plan_tools_missing(target)
    if missing:
        pytest.skip(missing)
    args = ["model=small", "scan_layers=true", f"target={target}", f"mesh={mesh}"]
    assert serve([*args, "plan_batch=8", "plan_context=512", f"results={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "compiled, not run" in out and "int8" in out and "yes" in out
    # the compiled total split like for like: what the calculator counts, and temporaries
    words = " ".join(out.split())  # the caption wraps at the table's width
    assert "args (weights + cache: what the calculator counts) and temp" in words, out
    usable = "what XLA:TPU lets a program hold" if target.startswith("tpu") else "JAX's allocator"
    assert "usable: " in words and usable in words, out  # where the usable column comes from
    (path,) = tmp_path.glob("serve-plan-*.jsonl")
    plans = {r["config"]["int8"]: r for r in map(json.loads, path.open())}
    for r in plans.values():
        c = r["config"]
        assert r["label"] == "compiled, not run" and c["compiled_memory"]["argument_bytes"] > 0
        # the calculator's weights + cache against what the compiled step takes as arguments
        got = c["compiled_memory"]["argument_bytes"]
        assert abs(c["predicted"]["total"] - got) / got < 0.15, (c["predicted"], got)
    # int8 weights (f32 here) and cache (bf16): under half the bytes the step takes in (the
    # total also holds temporaries: on TPU the int8 weights' conversion to bf16 shows there)
    args = {q: r["config"]["compiled_memory"]["argument_bytes"] for q, r in plans.items()}
    assert args[True] < 0.5 * args[False], args


def test_calculator_kv_cache_bytes_are_the_cache_arrays():
    """2 · layers · kv heads · head_dim · context · batch · bytes (+ int8's per-token scales)
    equals the bytes of the cache lab.decode allocates, float and int8."""
    from lab import decode
    from lab.config import make_config
    from lab.measure import memory

    m = make_config(preset="small", n_kv_heads=2, scan_layers=True, dtype="bfloat16").model
    for int8 in (False, True):
        cache = decode.cache_shapes(m, batch=3, max_len=40, int8=int8)
        predicted = memory.kv_cache_bytes(
            n_layers=m.n_layers,
            n_kv_heads=m.n_kv_heads,
            head_dim=m.head_dim,
            context=40,
            batch=3,
            bytes_per_value=1 if int8 else 2,
            int8_scales=int8,
        )
        assert predicted == decode.cache_bytes(cache)


@pytest.mark.parametrize("where", ["file", "file/sub", "/dev/full"])
def test_an_unwritable_results_folder_is_refused_before_measuring(tmp_path, capsys, where):
    """A file, a path under a file, a device: named as not a folder, never 'File exists'."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    results = where if where.startswith("/") else tmp_path / where
    assert serve([*FAST, "batches=1", f"results={results}"]) == 2
    err = capsys.readouterr()
    assert len(err.err.strip().splitlines()) == 1 and "cannot write" in err.err
    assert "is not a folder" in err.err and "File exists" not in err.err, err.err
    assert "weights" not in err.out  # refused before any weights were made


def test_the_memory_roof_is_the_best_bandwidth_measured():
    """As in the ledger: a decode step faster than the copy kernel raises the roof, so no
    point sits above it; otherwise the copy kernel's figure stands."""
    from lab.measure.serving import DecodePoint, Roofs
    from lab.measure.timing import BenchResult
    from lab.studies.serving.roofs import against, best_roofs

    def point(batch, bytes_per_s, int8=False):
        """A decode step that moved 1 GB per second's `bytes_per_s` (a 1e9-byte step)."""
        bench = BenchResult(1e9 / bytes_per_s, 0.0, 0.0, 3, 0.0)
        return DecodePoint(batch, int8, int8, "xla", bench, int(1e9), 0, 1.0, 1, 1, 10e9)

    roofs = Roofs(bandwidth=10e9, peak_flops=1e11, dtype="float32", copy={"bytes_per_s": 10e9})
    slow = [point(1, 8e9)]
    assert slow[0].memory_roof_share == pytest.approx(0.8)
    assert best_roofs(roofs, slow) is roofs
    points = [point(1, 24.7e9), point(8, 12e9)]
    assert points[0].memory_roof_share == pytest.approx(2.47)
    raised = best_roofs(roofs, points)
    assert raised.bandwidth == pytest.approx(24.7e9) and "batch 1" in raised.how
    points = against(points, raised)
    assert max(p.memory_roof_share for p in points) == pytest.approx(1.0)
    assert points[1].memory_roof_share == pytest.approx(12 / 24.7)
    # an int8 step at the same batch, slower, after it: the float step's rate still sets it
    both = [points[0], point(1, 20e9, int8=True)]
    assert best_roofs(roofs, both).bandwidth == pytest.approx(24.7e9)


def test_the_bandwidths_measured_after_the_sweep_raise_the_roof_and_say_how_far_they_moved(
    monkeypatch,
):
    """A shared host's bandwidth moves during a run: the copy and the read stream measured
    again after the sweep, the memory roof the better copy, the read stream the better read,
    and the summary says how far the copy moved when it moved by more than 15%."""
    from rich.console import Console

    from lab.measure import ceilings
    from lab.measure.serving import DecodePoint, Roofs
    from lab.measure.timing import BenchResult
    from lab.report import tables
    from lab.studies.serving import roofs as serving_roofs
    from lab.studies.serving.study import summarise

    before = Roofs(
        bandwidth=40e9,
        peak_flops=1e12,
        dtype="float32",
        copy={"bytes_per_s": 40e9},
        read={"bytes_per_s": 30e9},
    )
    assert before.copy_moved is None and before.best_read == 30e9
    step = DecodePoint(  # a 1e9-byte step in 0.04 s: 25 GB/s
        1, False, False, "xla", BenchResult(0.04, 0, 0, 3, 0), int(1e9), 0, 1e9, 1, 1, 40e9
    )
    for copy_after, read_after, note in (
        (60e9, 35e9, "50%"),
        (42e9, 29e9, None),
        (30e9, 35e9, "33%"),
    ):
        monkeypatch.setattr(
            ceilings, "copy_bandwidth", lambda *a, v=copy_after, **k: {"bytes_per_s": v}
        )
        monkeypatch.setattr(
            ceilings, "read_bandwidth", lambda *a, v=read_after, **k: {"bytes_per_s": v}
        )
        after = serving_roofs.measure_again(before, budget_s=0.01)
        assert after.bandwidth == max(40e9, copy_after)
        assert ("after the sweep" in after.how) == (copy_after > 40e9)
        assert after.best_read == max(30e9, read_after)
        assert after.copy_moved == pytest.approx(max(copy_after, 40e9) / min(copy_after, 40e9) - 1)
        (point,) = serving_roofs.against([step], after)
        assert point.memory_roof_share == pytest.approx(25e9 / after.bandwidth)
        con = Console(width=300, record=True)
        con.print(tables.serving_summary(summarise(after, [], [point], []), after))
        text = con.export_text()
        assert f"40.00 / {copy_after / 1e9:.2f} GB/s" in text, text
        if note:
            assert f"moved {note} during the run" in text, text
        else:
            assert "during the run" not in text, text
        share = f"reads at {25e9 / after.best_read:.0%} of it"
        assert share in text, text


def test_the_summary_names_the_smallest_batch_it_measured():
    """A mesh that splits the batch over two devices decodes batch 2 at the smallest: the
    summary's row says batch 2, not batch 1, and states the bound either way."""
    from rich.console import Console

    from lab.measure.serving import DecodePoint, PrefillPoint, Roofs
    from lab.measure.timing import BenchResult
    from lab.report import tables
    from lab.studies.serving.study import summarise

    def decoded(batch, flops):  # a 1e9-byte step in 0.1 s
        return DecodePoint(
            batch, False, False, "xla", BenchResult(0.1, 0, 0, 3, 0), int(1e9), 0, flops, 1, 1, 10e9
        )

    roofs = Roofs(bandwidth=10e9, peak_flops=1e11, dtype="float32", copy={"bytes_per_s": 10e9})
    prefill = [PrefillPoint(2, 8, BenchResult(0.01, 0, 0, 3, 0), 1e9)]
    for flops, bound in ((1e9, "memory-bound"), (1e11, "compute-bound")):
        s = summarise(roofs, prefill, [decoded(2, flops), decoded(4, flops)], [])
        con = Console(width=200, record=True)
        con.print(tables.serving_summary(s, roofs))
        text = con.export_text()
        assert "batch 2 " in text and "batch 1 " not in text and bound in text, text
        assert "of the memory roof" in text and "against decode at batch 2" in text, text


def test_a_damaged_run_is_a_few_lines_not_a_flood(tmp_path):
    """Every checkpoint of the run damaged: the libraries' logging goes to lab.log in the
    results folder, the terminal gets a warning per damaged step and one error line, which
    says they could not be read (not that the run was never checkpointed). Serving only
    reads: the damaged steps stay where they are, for the run's own resume to set aside."""
    import subprocess
    import sys

    args = ["model=tiny", "batch_size=8", "seq_len=32", f"out_dir={tmp_path}"]
    assert train([*args, "name=t", "steps=4", "checkpoint_every=2"]) == 0
    for f in (tmp_path / "t" / "checkpoints").rglob("*"):
        if f.is_file() and f.stat().st_size > 100:
            f.write_bytes(b"\xd4\xc0 not a checkpoint" * 3)
    keys = [f"out_dir={tmp_path}", f"results={tmp_path / 'res'}", "run=t", "plot=false"]
    p = subprocess.run(
        [sys.executable, "-m", "lab.serve", *FAST[1:], "batches=1", *keys],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    text = p.stdout + p.stderr
    assert "Traceback" not in text and len(text.splitlines()) <= 10, text[-3000:]
    last = p.stderr.strip().splitlines()[-1]  # it was checkpointed: never "train it with ..."
    assert (
        last == "error: run=t: its 2 damaged steps (2, 4) could not be read; none is left to serve"
    )
    # each damaged step's line is a warning, on stderr with the error (stdout is the report)
    assert "damaged" not in p.stdout, p.stdout
    assert sum("checkpoint step" in line for line in p.stderr.splitlines()) == 2, p.stderr
    assert not (tmp_path / "t" / "checkpoints-damaged").exists()
    assert sorted(p.name for p in (tmp_path / "t" / "checkpoints").iterdir()) == ["2", "4"]


def test_a_damaged_config_names_run_not_resume(tmp_path, capsys):
    """Serving reads a run's config.json: its refusal names run=, the key the user gave."""
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "config.json").write_text('{"broken')
    assert serve([*FAST, "run=c", f"out_dir={tmp_path}", f"results={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: run=c:") and "damaged" in err
    assert "resume" not in err
    # what to do names lab.run's keys as lab.run's: typed to lab.serve they are refused
    assert err.endswith(f"(python -m lab.run name=c out_dir={tmp_path} overwrite=true …)"), err
    (tmp_path / "f").write_text("a file")
    assert serve([*FAST, "run=f", f"out_dir={tmp_path}", f"results={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: run=f: {tmp_path / 'f'} is a file, not a run folder"
    (tmp_path / "demo").mkdir()  # a name mistyped: the close folder under out_dir is named
    assert serve([*FAST, "run=dem", f"out_dir={tmp_path}", f"results={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"no run folder {tmp_path / 'dem'} (did you mean demo?)" in err, err


STRATEGIES = {
    "dp": {"mesh": "data:2"},
    "fsdp": {"mesh": "fsdp:2"},
    "tp": {"mesh": "model:2"},
    "fsdp+tp": {"mesh": "fsdp:2,model:2"},
    "pp": {"mesh": "stage:2"},
    "pp+fsdp": {"mesh": "stage:2,fsdp:2"},
    "pp+tp": {"mesh": "stage:2,model:2"},
    "circular": {"mesh": "stage:2", "n_layers": 4, "pipeline_repeats": 2, "microbatches": 2},
}


def _saved_run(run_dir, keys, steps=(1,)):
    """(the session, its parameters on the host) of a run folder as lab.run leaves it
    (config.json, a checkpoint of each of `steps`), its state random and placed on the
    trained shardings."""
    import dataclasses

    import jax
    import numpy as np

    from lab import checkpoint, rundir
    from lab.resolve import Request
    from lab.session import open_session

    s = open_session(request=Request.of(**keys))
    rng = np.random.default_rng(1)

    def leaf(a):
        x = rng.standard_normal(a.shape) * 0.1 if a.dtype.kind == "f" else np.ones(a.shape)
        return jax.device_put(x.astype(a.dtype), a.sharding)

    state = jax.tree.map(leaf, s.trainer.abstract_state)
    run_dir.mkdir()
    rundir.write_json(run_dir / "config.json", dataclasses.asdict(s.cfg))
    saver = checkpoint.Saver(checkpoint.manager(run_dir))
    for step in steps:
        saver.save(step, state)
        saver.finish()
    return s, jax.device_get(state.params)


@functools.cache
def _plain_forward(model_cfg):
    """The model on one device, compiled once per shape: the reference."""
    import jax

    from lab.model import build

    return jax.jit(lambda params, tokens: build(model_cfg).apply({"params": params}, tokens))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_run_of_every_strategy_is_served(strategy, tmp_path):
    """lab.serve's steps for a run trained with each strategy: its request resolved again for
    decoding (unscanned, no pipeline: a stage's devices join the batch's), the checkpoint
    restored as trained and loaded into the decoder, whose prefill matches the plain model
    on one device."""
    import jax
    import numpy as np

    from lab import decode, serve
    from lab.model import natural_layers
    from lab.studies.serving import weights

    keys = {"preset": "tiny", "batch_size": 8, "seq_len": 16, "attention": "naive"}
    trained, saved = _saved_run(tmp_path / "r", {**keys, **STRATEGIES[strategy]})
    assert trained.cfg.strategy == strategy.replace("circular", "pp")
    o = serve.Options(run="r", batches=(4,), prefill_batches=(4,))
    s, run_dir = serve._session(o, {"out_dir": str(tmp_path)})
    decoding = weights.for_decoding(s, (4,))
    s, params, source = weights.load_params(s, run_dir, 0, decoding=decoding)
    assert source == "run r, step 1" and not s.cfg.model.scan_layers
    assert s.cfg.strategy in ("dp", "fsdp", "tp", "fsdp+tp")
    stages = dict(trained.trainer.mesh.shape).get("stage", 1)
    if stages > 1:  # circular runs store their blocks stage-major
        saved = {**saved, "blocks": natural_layers(trained.cfg.model, saved["blocks"], stages)}
    expected = decode.unstack_layers(saved, trained.cfg.model.n_layers)  # layer i = block_i
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), expected)
    t = s.trainer
    dec = decode.make_decoder(
        s.cfg.model, t.mesh, t.rules, t.state_shardings.params, batch=4, max_len=8
    )
    prompts = np.random.default_rng(0).integers(0, 256, (4, 6), dtype=np.int32)
    with jax.set_mesh(dec.mesh):
        logits, _ = dec.prefill(params, prompts, np.full((4,), 6, np.int32), dec.empty_cache())
    full = _plain_forward(s.cfg.model)(jax.device_get(params), prompts)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full[:, -1]), rtol=1e-5, atol=1e-5)


@pytest.fixture
def three_devices(monkeypatch):
    """This machine seen as three CPU devices (the tests' JAX has started with eight, whose
    divisors all divide lab.run's default batch_size=16)."""
    import dataclasses

    import jax

    from lab import devices, resolve

    info = dataclasses.replace(devices.describe(), count=3, local_count=3)
    three = resolve.Platform.of(info, jax.devices()[:3])
    monkeypatch.setattr(resolve.Platform, "found", classmethod(lambda cls, request: three))


def test_random_weights_are_served_on_a_mesh_that_does_not_divide_the_training_batch(
    three_devices,
):
    """A decoder splits its own batches, never lab.run's default batch_size=16: three devices
    serve batches of three."""
    from lab import serve
    from lab.studies.serving import weights

    o = serve.Options(batches=(3,), prefill_batches=(3,))
    s, run_dir = serve._session(o, {"preset": "tiny", "mesh": "3"})
    s, params, source = weights.load_params(s, run_dir, 0)
    assert source == "random weights (seed 0)" and s.trainer.mesh.size == 3


def test_a_trained_run_is_served_on_a_mesh_that_does_not_divide_its_batch(
    tmp_path, capsys, three_devices
):
    """A run trained with batch_size=8 served on three devices: the batches served split,
    its training batch plays no part; a batch that does not split is refused in one line
    that names the serving batches, never a training key lab.serve refuses."""
    from lab import serve
    from lab.studies.serving import weights

    keys = {"preset": "tiny", "batch_size": 8, "seq_len": 16, "attention": "naive"}
    _, saved = _saved_run(tmp_path / "r", keys)
    o = serve.Options(run="r", batches=(3,), prefill_batches=(3,))
    s, run_dir = serve._session(o, {"out_dir": str(tmp_path), "mesh": "3"})
    decoding = weights.for_decoding(s, (3,))
    s, params, source = weights.load_params(s, run_dir, 0, decoding=decoding)
    assert source == "run r, step 1" and s.trainer.mesh.size == 3
    args = [*FAST, "run=r", "mesh=3", "batches=2", f"out_dir={tmp_path}", f"results={tmp_path}"]
    assert serve.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "serving batches [1, 2]" in err, err
    assert "batch_size" not in err, err


def test_a_served_run_reads_its_weights_alone(tmp_path):
    """Serving restores the parameters only: a step whose optimizer moment is damaged is
    still the newest weights (the moments never decode, and are not held), while a step whose
    weights are damaged is skipped with its line and the step before it served."""
    import jax
    import numpy as np

    from lab import checkpoint, decode, serve
    from lab.studies.serving import weights

    keys = {"preset": "tiny", "batch_size": 8, "seq_len": 16, "attention": "naive"}
    trained, saved = _saved_run(tmp_path / "r", keys, steps=(1, 2))
    s_model = trained.cfg.model
    sums = checkpoint.folder(tmp_path / "r") / "2" / checkpoint.SUMS / "metadata"
    good = json.loads(sums.read_text())

    def served(changed_key):
        bad = {**good, changed_key: [good[changed_key][0] ^ 1, good[changed_key][1]]}
        sums.write_text(json.dumps(bad))
        said = []
        o = serve.Options(run="r", batches=(1,), prefill_batches=(1,))
        s, run_dir = serve._session(o, {"out_dir": str(tmp_path)})
        s, params, source = weights.load_params(s, run_dir, 0, warn=said.append)
        return params, source, said

    moment = next(k for k in good if k.startswith("opt_state.") and ".nu." in k)
    params, source, said = served(moment)
    assert source == "run r, step 2" and said == []
    expected = decode.unstack_layers(saved, s_model.n_layers)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), expected)
    weight = next(k for k in good if k.startswith("params."))
    params, source, said = served(weight)
    assert source == "run r, step 1", source
    assert len(said) == 1 and said[0].startswith("checkpoint step 2 is damaged (params."), said


def test_a_long_prefill_says_how_long_a_run_takes_at_least():
    """A 100,000-token prompt on the tiny model is minutes a run on a CPU: the progress label
    says so (FLOPs and a floor at the measured peak) instead of standing still unexplained."""
    from lab.config import make_config
    from lab.studies.serving.points import prefill_estimate

    model = make_config(model="tiny").model
    assert prefill_estimate(model, 1, 128, peak_flops=50e9) == ""
    long = prefill_estimate(model, 1, 100_000, peak_flops=50e9)
    flops = float(long.split("(")[1].split()[0].replace(",", "")) * 1e12
    minutes = float(long.split("at least ")[1].split()[0].replace(",", ""))
    assert flops > 1e12 and minutes == pytest.approx(flops / 50e9 / 60, rel=0.05), long


def test_many_decode_steps_say_how_long_a_batch_takes_at_least():
    """decode_steps=100000 is minutes per batch size (three calls of that many steps, for each
    way of multiplying): the progress label says so, from the weights a step reads at the
    memory roof, instead of standing still unexplained."""
    import dataclasses

    from lab.measure.serving import Roofs
    from lab.session import open_session
    from lab.studies.serving import points, weights

    s = open_session(keys={"preset": "tiny", "steps": 0}, purpose="decode", batches=(1,))
    s, params, _ = weights.load_params(s, None, 0, decoding=weights.for_decoding(s, (1,)))
    roofs = Roofs(bandwidth=1e9, peak_flops=1e10, dtype="float32", copy={})
    assert points.decode_estimate(s, params, roofs, 1, 32) == ""
    long = points.decode_estimate(s, params, roofs, 1, 10_000_000)
    ways = len(points.matmul_candidates(s, params))
    step_s = points.weight_read_bytes(params, s.cfg.model, 1) / 1e9
    minutes = float(long.split("at least ")[1].split()[0].replace(",", ""))
    assert long.startswith(" (3 calls of 10,000,000 steps"), long
    assert minutes == pytest.approx(ways * (3 + 3e7) * step_s / 60, rel=0.01), long
    assert (f" × {ways} ways to multiply:" in long) == (ways > 1), long
    # one step a call: the warm-up's three steps are half of what is timed, and counted
    slow = Roofs(bandwidth=step_s * 1e9 / 100, peak_flops=1e10, dtype="float32", copy={})
    one = points.decode_estimate(s, params, slow, 1, 1)  # 100 s a step
    minutes = float(one.split("at least ")[1].split()[0].replace(",", ""))
    assert minutes == pytest.approx(ways * 6 * 100 / 60, rel=0.01), one
    assert points.decode_estimate(s, params, dataclasses.replace(slow, bandwidth=0.0), 1, 1) == ""


def test_the_int8_error_of_a_prompt_longer_than_the_text_uses_the_whole_text(monkeypatch):
    """The int8 error is measured on windows of the bundled text; a longer prompt is cut to
    the text (and says so) rather than ending a whole study in an error."""
    import jax

    from lab import data, quant
    from lab.resolve import Request
    from lab.session import open_session
    from lab.studies.serving.int8 import int8_error

    text = data.corpus_bytes()[:300]
    monkeypatch.setattr(data, "corpus_bytes", lambda: text)
    s = open_session(request=Request.of(preset="tiny", batch_size=2, seq_len=16))
    params = s.trainer.init(jax.random.key(0)).params
    e = int8_error(s, params, quant.quantize_params(params), prompt_len=1000, steps=4)
    assert e.prompt_len == 300 - 4 - 1 and e.windows == 1  # one window holds the text
    (m,) = e.matmuls
    assert m.loss_change_se is None  # no spread from one window
    assert 0 < m.logits_rel_rms < 5e-2 and abs(e.loss_change(m.matmul)) < 0.1


def test_the_int8_error_is_stated_for_each_matmul_whose_speed_is_shown():
    """A speed row that keeps w8a8 sits beside w8a8's error, not weight-only's: the error is
    measured for every matmul timed, each named, and W8A8's (activations quantized too) is
    not weight-only's. The top-1 agreement says how many tokens it rests on."""
    import jax
    from rich.console import Console

    from lab import quant
    from lab.measure.serving import DecodePoint
    from lab.measure.timing import BenchResult
    from lab.report import tables
    from lab.resolve import Request
    from lab.session import open_session
    from lab.studies.serving.int8 import int8_error

    s = open_session(request=Request.of(preset="tiny", batch_size=1, seq_len=16))
    params = s.trainer.init(jax.random.key(0)).params
    params_i8 = quant.quantize_params(params)
    e = int8_error(s, params, params_i8, prompt_len=8, steps=6, matmuls=("xla", "w8a8"))
    assert [m.matmul for m in e.matmuls] == ["xla", "w8a8"]
    xla, w8a8 = e.matmuls
    assert xla.positions == w8a8.positions == 8 * 6 and 0 <= w8a8.top1_same <= 8 * 6
    assert 0 < xla.logits_rel_rms < 5e-2 and 0 < w8a8.logits_rel_rms < 5e-2
    assert w8a8.logits_rel_rms != pytest.approx(xla.logits_rel_rms, rel=0.05)
    assert w8a8.loss_int8 != xla.loss_int8
    kept = DecodePoint(8, True, True, "w8a8", BenchResult(0.1, 0, 0, 3, 0), 1, 0, 1.0, 1, 1, 1e9)
    con = Console(width=400, record=True)
    con.print(tables.serving_int8(e, [(8, 1.5)], [kept]))
    text = con.export_text()
    for m in e.matmuls:
        assert f"{m.logits_rel_rms:.2e}" in text, text
        assert f"same top-1 token {m.top1_same} of 48 (" in text, text
    assert "w8a8 matmul (int8 activations too; kept at batch 8)" in text, text
    assert "xla matmul (weight-only)" in text, text


def test_the_int8_error_rests_on_windows_spread_over_the_text_each_program_compiled_once(
    caplog,
):
    """The int8 error is measured on 8 windows spread from the text's start to its end (not
    one window at byte 0: a loss change of 1e-4 on one passage cannot be told from noise),
    the table says how many windows and tokens, and the loss change carries its standard
    error over the windows. The full forward pass is compiled once per distinct program:
    native1 leaves the forward's many rows to XLA's dot, so its loss is xla's program and
    figure, not a third compile."""
    import jax
    from rich.console import Console

    from lab import data, quant
    from lab.kernels import cpu_gemv
    from lab.report import tables
    from lab.resolve import Request
    from lab.session import open_session
    from lab.studies.serving import int8

    text_len = len(data.corpus_bytes())
    assert int8.error_windows(1, 14, text_len) == 8
    assert int8.error_windows(3, 14, text_len) == 9  # a multiple of the devices
    assert int8.error_windows(1, text_len // 2, text_len) == 2  # as many as the text holds
    starts = int8.corpus_tokens(8, 13, 256)[:, 0]
    text = data.corpus_bytes()
    assert starts[-1] == text[text_len - 14] and starts[0] == text[0]  # the end is read too
    s = open_session(request=Request.of(preset="tiny", batch_size=1, seq_len=16))
    params = s.trainer.init(jax.random.key(0)).params
    params_i8 = quant.quantize_params(params)
    matmuls = ("xla", "native1") if cpu_gemv.available() else ("xla",)
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        e = int8.int8_error(s, params, params_i8, prompt_len=8, steps=4, matmuls=matmuls)
    forwards = [r for r in caplog.records if "compilation of jit(losses)" in r.getMessage()]
    assert len(forwards) == 2, [r.getMessage() for r in forwards]  # float, int8 weight-only
    assert e.windows == 8 and all(m.positions == 8 * 4 for m in e.matmuls)
    assert len({m.loss_int8 for m in e.matmuls}) == 1
    xla = e.matmuls[0]
    assert xla.loss_change_se is not None and 0 < xla.loss_change_se < 0.05
    con = Console(width=400, record=True)
    con.print(tables.serving_int8(e, []))
    out = con.export_text()
    assert "8 windows of 12 tokens spread over it, 88 tokens predicted" in out, out
    assert f"± {xla.loss_change_se:.4f} s.e. over windows" in out, out


def test_a_step_near_neither_roof_is_overhead_bound():
    """The bound column names a roof only where the step reaches a fair share of one: under
    10% of both it is overhead, whatever side of the ridge its FLOPs per byte fall."""
    from rich.console import Console

    from lab.measure.serving import DecodePoint, Roofs
    from lab.measure.timing import BenchResult
    from lab.report import tables
    from lab.studies.serving.study import summarise

    def step(seconds, flops):  # a 1e9-byte step against a 10 GB/s roof
        bench = BenchResult(seconds, 0, 0, 3, 0)
        return DecodePoint(1, True, True, "xla", bench, int(1e9), 0, flops, 1, 1, 10e9)

    roofs = Roofs(bandwidth=10e9, peak_flops=1e11, dtype="float32", copy={"bytes_per_s": 10e9})
    # ridge 10 FLOP/B; 20 FLOP/B at 1% of the memory roof is 2% of the compute roof
    slow = step(10.0, 2e10)
    assert slow.memory_roof_share == pytest.approx(0.01)
    assert slow.bound(roofs.peak_flops) == "overhead"
    assert step(1.0, 2e10).bound(roofs.peak_flops) == "compute"  # 20% of the compute roof
    assert step(0.5, 1e9).bound(roofs.peak_flops) == "memory"  # 20% of the memory roof
    con = Console(width=300, record=True)
    con.print(tables.serving_decode([slow], "decode", peak_flops=roofs.peak_flops))
    con.print(tables.serving_summary(summarise(roofs, [], [slow], []), roofs))
    text = con.export_text()
    assert "overhead" in text and "compute" not in text.split("what decoding")[0], text
    assert "overhead-bound (under 10% of both roofs)" in text, text


def test_the_decode_kernel_line_names_float16_not_a_blockwise_never_asked():
    """dtype=float16 on CPU fills attention=blockwise (cpu_flash takes no float16): the
    decode line's reason is float16, which auto would also fall back for."""
    import dataclasses

    from lab import decode
    from lab.config import make_config
    from lab.kernels import cpu_gemv

    if not cpu_gemv.available():
        pytest.skip("the C++ decode kernel is not built here")
    model = dataclasses.replace(make_config(model="tiny").model, dtype="float32")
    half = dataclasses.replace(model, dtype="float16", attention="blockwise")
    line = decode.decode_kernel_line(half, "cpu")
    assert line.startswith("reference") and "float16" in line and "blockwise" not in line, line
    # asked in float32, blockwise is the reason
    asked = decode.decode_kernel_line(dataclasses.replace(model, attention="blockwise"), "cpu")
    assert "attention=blockwise decodes with the reference" in asked, asked


def test_a_critical_batch_near_the_cache_intensity_is_printed_as_an_estimate():
    """B* = ridge·W / (f − ridge·c) moves by f / (f − ridge·c) % per 1% of the ridge: near 1
    where the weights dominate (printed as measured), many times that where f/c is close to
    the ridge (a tiny model's cache): then rounded, with the reason."""
    from types import SimpleNamespace

    from lab.measure import cost
    from lab.report.tables.serving import critical_batch_text

    W, f, c = 4.5e8, 2.2e8, 1.9e7  # a base-sized decode: weights, FLOPs and cache per sequence
    for ridge in (3.7, 10.0):
        k = cost.critical_batch_sensitivity(f, c, ridge)
        up, down = (cost.critical_batch(W, f, c, ridge * (1 + e)) for e in (1e-6, -1e-6))
        assert math.isclose(k, (math.log(up) - math.log(down)) / 2e-6, rel_tol=1e-4)
    assert cost.critical_batch_sensitivity(f, c, f / c) == math.inf

    def text(W, f, c, ridge):
        return critical_batch_text(
            SimpleNamespace(
                critical_batch=cost.critical_batch(W, f, c, ridge),
                critical_batch_sensitivity=cost.critical_batch_sensitivity(f, c, ridge),
                cache_intensity=f / c,
                ridge=ridge,
            )
        )

    assert text(W, f, c, 3.7) == f"{cost.critical_batch(W, f, c, 3.7):,.1f}"
    rough = text(1.6e8, 3.9e6, 1e6, 3.5)  # f/c 3.9 FLOP/B against a ridge of 3.5: k = 9.75
    assert rough.startswith(
        "~1,400, not well determined: decode's intensity can only approach 3.90 FLOP/B"
    )
    assert rough.endswith("11% above the ridge, so 1% in either roof moves it 10%"), rough
    assert text(1.6e8, 3.9e6, 1e6, 4.0).startswith("never")


def test_the_sample_keys_given_without_a_sample_are_named():
    """sample=, prompt= and temperature= make nothing without a trained byte-level text run
    (or with sample=0): the note names those given on the command line (or set in code);
    sample= at its default, not typed, is not named."""
    from lab.config import parse_with_run_keys
    from lab.serve import Options, _unused_sample_keys

    def note(args, trained_text=False):
        o, _ = parse_with_run_keys(Options, [*args, "model=tiny"])
        return _unused_sample_keys(o, trained_text)

    why = "no sample is generated (the weights are not a byte-level text run's)"
    assert note(["sample=10"]) == f"{why}: sample= unused"
    assert note(["sample=200"]) == f"{why}: sample= unused"  # typed at its default: asked
    assert note(["prompt=hi", "temperature=0.5"]) == f"{why}: prompt= and temperature= unused"
    assert note([]) is None and note(["sample=10"], trained_text=True) is None
    assert (
        note(["sample=0", "prompt=hi"], True) == "no sample is generated (sample=0): prompt= unused"
    )
    assert _unused_sample_keys(Options(sample=10), False) == f"{why}: sample= unused"  # in code
    assert _unused_sample_keys(Options(), False) is None


def test_without_pytorch_the_peer_line_says_how_to_get_it(monkeypatch):
    """No PyTorch: one line says the peer is skipped and names the extra that installs it."""
    from types import SimpleNamespace

    from rich.console import Console

    from lab.config import make_config
    from lab.serve import _peer_note_line
    from lab.studies import torch_decoder
    from lab.studies.serving.study import peer_skipped

    s = SimpleNamespace(
        info=SimpleNamespace(backend="cpu"), cfg=make_config(model="tiny", dtype="float32")
    )
    monkeypatch.setattr(torch_decoder, "available", lambda: False)
    con = Console(width=200, record=True)
    con.print(_peer_note_line(peer_skipped(s), timed=False))
    text = con.export_text()  # as printed: the extra's brackets are text, not markup
    assert "PyTorch is not installed" in text and "pip install -e '.[peers]'" in text, text
    monkeypatch.setattr(torch_decoder, "available", lambda: True)
    assert peer_skipped(s) is None
    # a model the peer does not compute is skipped with its reason, float16 among them
    half = SimpleNamespace(info=s.info, cfg=make_config(model="tiny", dtype="float16"))
    assert "not float16" in peer_skipped(half), peer_skipped(half)


def test_a_signal_to_serve_is_one_line_and_its_exit_code(tmp_path):
    """lab.serve has no training loop: SIGTERM while it imports, compiles or measures is one
    line and exit 143, never a traceback or the default action (as lab.run before its loop)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    results = tmp_path / "new"  # made by the command: stopped before it wrote, not left
    cmd = [sys.executable, "-m", "lab.serve", *FAST, f"results={results}", "plot=false"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(2.0)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, (out[-2000:], err[-2000:])
    assert err.startswith("SIGTERM: exiting; ") and err.count("\n") == 1, err
    if "nothing was written" in err:
        assert not results.exists(), list(results.iterdir())


@pytest.mark.once  # a whole sweep, stopped: the sweep's JAX-facing code runs on both legs elsewhere
def test_a_stopped_sweep_keeps_the_points_it_measured(tmp_path):
    """SIGTERM once the second decode batch has started: the roof and the points measured
    before it are written (marked partial), and the exit line says where."""
    import os
    import signal
    import subprocess
    import sys

    from lab.measure.records import read_records

    argv = [*FAST, "batches=1,2", f"results={tmp_path}", "plot=false"]
    cmd = [sys.executable, "-m", "lab.serve", *argv]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # off a terminal, each step of the sweep is a line as it starts
        if line.startswith("decode batch 2"):
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, (out[-2000:], err[-2000:])
    assert "points measured so far are in" in err and err.count("\n") == 1, err
    (path,) = tmp_path.glob("serve-*.jsonl")
    recs = read_records(path)
    assert all(r["config"]["partial"] for r in recs)
    whats = [r["what"] for r in recs]
    assert "copy bandwidth" in whats and "decode tokens/s, batch 1, float" in whats


def test_a_sample_prints_no_control_characters():
    """Generated bytes reach the terminal escaped: an ESC or ^U from a model would otherwise
    drive the terminal; newlines, tabs and other letters stay."""
    from lab.studies.serving.sample import printable

    assert printable("ab\x15c\x1b[31m\nd\teé\x7f") == "ab\\x15c\\x1b[31m\nd\teé\\x7f"
    assert printable("a\u2028b\u202ec") == "a\\u2028b\\u202ec"  # never read as \\x20 + "28"


def test_a_trained_run_is_served_on_its_tensor_parallel_axis_alone():
    """Unless mesh= is given, a run is served without the axes that split its batch (a
    decode of batch 1 splits over none), keeping its tensor-parallel axis; a pipeline's run
    keeps its own mesh; a plan for a target uses all of the target's devices."""
    from lab.config import make_config
    from lab.studies.serving.weights import _serving_mesh

    tp = make_config(model="tiny", mesh="4x2", strategy="tp")
    assert _serving_mesh(tp) == {"mesh": "model:2", "strategy": "tp"}
    assert _serving_mesh(make_config(model="tiny", mesh="8", strategy="dp")) == {
        "mesh": "1",
        "strategy": "dp",
    }
    assert _serving_mesh(make_config(model="tiny", mesh="2x4", strategy="fsdp")) == {
        "mesh": "1",
        "strategy": "dp",
    }
    pp = make_config(model="tiny", mesh="data:2,stage:4", strategy="pp", microbatches=2)
    assert _serving_mesh(pp) == {}
    # a plan for a target runs one program over all its devices: the rest split the batch
    assert _serving_mesh(tp, target=True) == {"mesh": "data:-1,model:2", "strategy": "tp"}
    dp = make_config(model="tiny", mesh="8", strategy="dp")
    assert _serving_mesh(dp, target=True) == {"mesh": "-1", "strategy": "dp"}
    assert _serving_mesh(pp, target=True) == {}


@pytest.mark.once  # a whole sweep with a peer: its JAX-facing code runs on both legs elsewhere
def test_a_failing_peer_keeps_the_measured_figures_and_says_where_it_stopped(monkeypatch):
    """The PyTorch peer is a comparison: where it fails, the lab's points, records and the
    rest of the study are kept, its note says at which batch and why, and the progress bar
    counts each of its batches (study.ticks)."""
    from lab.session import open_session
    from lab.studies import torch_decoder
    from lab.studies.serving import records as serving_records
    from lab.studies.serving import study, weights

    monkeypatch.setattr(torch_decoder, "available", lambda: True)

    def broken(cfg, params, prompts, *, steps, budget_s):  # times batch 1, fails at batch 2
        if prompts.shape[0] == 2:
            raise KeyError("float16")
        by = {1: 1.0}
        return dict(
            batch=1,
            median_s=1.0,
            tokens_per_s=1.0,
            threads=1,
            torch="x",
            steps=steps,
            tokens_per_s_by_threads=by,
        )

    monkeypatch.setattr(torch_decoder, "time_decode", broken)
    keys = {"preset": "tiny", "steps": 0, "dtype": "float32"}
    s = open_session(keys=keys, purpose="decode", batches=(1, 2))
    plan = study.Plan((1, 2), (1,), 8, 2, 0.01, False)
    s, params, _ = weights.load_params(s, None, 0, decoding=weights.for_decoding(s, (1, 2)))
    labels = []
    out = study.measure(s, params, plan, progress=labels.append)
    assert [p.batch for p in out.decode] == [1, 2] and out.prefill
    assert [p.batch for p in out.torch] == [1]
    assert "failed at batch 2" in out.peer_note and "KeyError" in out.peer_note, out.peer_note
    # the records of the batch it timed say where it stopped, as the terminal did
    (peer,) = [r for r in serving_records.to_records(out, {}) if r["config"].get("peer")]
    assert peer["config"]["peer_note"] == out.peer_note
    assert {"PyTorch peer batch 1", "PyTorch peer batch 2"} <= set(labels), labels
    with_peer = study.ticks(s, plan)
    monkeypatch.setattr(torch_decoder, "available", lambda: False)
    assert with_peer == study.ticks(s, plan) + 2


@pytest.mark.parametrize(
    "preset,batch,prompt_len,decoding",
    [("tiny", 512, 128, False), ("small", 16, 256, False), ("tiny", 64, 128, True)],
)
def test_the_memory_estimate_holds_the_compiled_prefill(preset, batch, prompt_len, decoding):
    """cost.serving_peak_bytes comes within a factor 1.5 of XLA's buffer assignment for the
    prefill the study runs, compiled on abstract arguments (nothing is allocated): a prefill
    point's (weights, its own cache, logits, temporaries), and a decode point's prefill into
    the decode cache of 1,024 slots (weights, that cache, logits, temporaries)."""
    import jax
    import jax.numpy as jnp

    from lab import decode
    from lab.measure import memory
    from lab.session import open_session
    from lab.studies.serving.study import Plan, memory_needed

    s = open_session(keys={"preset": preset, "steps": 0}, purpose="decode", batches=(batch,))
    t = s.trainer
    plan = (
        Plan((batch,), (1,), prompt_len, 1, 0.01, False, context=1024)
        if decoding
        else Plan((1,), (batch,), prompt_len, 1, 0.01, False)
    )
    slots = plan.slots() if decoding else prompt_len
    shardings = decode.param_shardings(t.state_shardings.params, t.abstract_state.params)
    dec = decode.make_decoder(s.cfg.model, t.mesh, t.rules, shardings, batch=batch, max_len=slots)
    shaped = lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)  # noqa: E731
    params = jax.tree.map(shaped, t.abstract_state.params, shardings)
    cache = jax.tree.map(shaped, dec.abstract_cache, dec.cache_sharding)
    prompts = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    with jax.set_mesh(t.mesh):
        compiled = dec.prefill.lower(params, prompts, lengths, cache).compile()
    got = memory.compiled_memory(compiled)["total_bytes"] * t.mesh.devices.size
    parts = memory_needed(s.cfg.model, plan)
    assert ("cache" in parts) == decoding, parts  # the phase that holds the study's peak
    want = sum(parts.values())
    assert got / 1.5 < want < 1.5 * got, (got, parts)
    key = "cache" if decoding else "prefill cache"
    assert parts[key] == decode.cache_bytes(dec.abstract_cache)


def test_a_prefill_too_big_for_this_machine_is_refused_before_measuring(monkeypatch, capsys):
    """prefill_batches=100000 at model=tiny (~40 GiB: the prefill's cache and temporaries)
    where 32 GiB of a 1 TiB machine are available is one line and exit 2, naming
    prefill_batches= and the memory available (not the machine's total)."""
    from lab.measure import memory
    from lab.studies.serving import weights

    def never(*a, **k):  # an estimate that lets it through would make ~40 GiB here
        raise AssertionError("the weights were loaded: the memory check let it through")

    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 1024.0 * 2**30)
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 32.0 * 2**30)
    monkeypatch.setattr(weights, "load_params", never)
    assert serve(["model=tiny", "prefill_batches=100000", "int8=false", "plot=false"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "prefill_batches up to 100000" in err, err
    assert "32.0 GiB available" in err, err


def test_a_cpu_trained_run_is_planned_for_an_accelerator_from_the_keys_it_was_asked(
    tmp_path, capsys
):
    """run=NAME target=...: the request is the keys config.json kept (what the user gave),
    less those that only train, never the config this CPU resolved (attention=cpu_flash has
    no kernel on a GPU; checkpoint_every= would do nothing in a plan); an older folder that
    kept no request gives its config's fields less those resolved from `auto`."""
    from lab.studies.serving import weights

    args = ["model=tiny", "batch_size=8", "seq_len=32", f"out_dir={tmp_path}", "name=t"]
    assert train([*args, "steps=2", "checkpoint_every=2", "n_kv_heads=2"]) == 0
    capsys.readouterr()
    run_dir = tmp_path / "t"
    for older in (False, True):
        if older:  # a folder written before config.json kept its request
            saved = json.loads((run_dir / "config.json").read_text())
            assert saved["model"]["attention"] == "cpu_flash"  # what this CPU resolved
            del saved["request"]
            (run_dir / "config.json").write_text(json.dumps(saved))
        keys = weights.serving_request(run_dir, {"target": "gpu:h100:1"}).dict()
        assert "checkpoint_every" not in keys and "attention" not in keys, keys
        assert keys["n_kv_heads"] == 2 and keys["target"] == "gpu:h100:1", keys
    missing = _plan_tools_missing("gpu:h100:1")
    if missing:
        pytest.skip(missing)
    serve_args = [f"out_dir={tmp_path}", "run=t", "target=gpu:h100:1", "int8=false"]
    assert serve([*serve_args, f"results={tmp_path}"]) == 0, capsys.readouterr()
    assert "compiled, not run" in capsys.readouterr().out


def test_a_plan_for_a_target_splits_the_served_batch_not_a_training_batch(tmp_path, capsys):
    """A plan for six H100s (six divides neither lab.run's batch_size=16 nor a GPU's
    default 32), of a trained run and of random weights, neither with a mesh= (the target's
    six devices): plan_batch=6 compiles, no training batch is split; plan_batch=8 is one line
    naming plan_batch=, never batch_size."""
    missing = _plan_tools_missing("gpu:h100:6")
    if missing:
        pytest.skip(missing)
    _saved_run(tmp_path / "r", {"preset": "tiny", "batch_size": 16, "seq_len": 16})
    plan = ["target=gpu:h100:6", "plan_context=64", "int8=false", f"results={tmp_path}"]
    for model in ([f"out_dir={tmp_path}", "run=r"], ["model=tiny"]):
        assert serve([*model, *plan, "plan_batch=6"]) == 0, capsys.readouterr()
        assert "compiled, not run" in capsys.readouterr().out
        assert serve([*model, *plan, "plan_batch=8"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert "serving batches [8] (of plan_batch=) do not split" in err, err
        assert "batch_size" not in err, err


def test_a_plans_batch_that_does_not_split_names_plan_batch(tmp_path, capsys):
    missing = _plan_tools_missing("tpu:v5e:2x2")
    if missing:
        pytest.skip(missing)
    args = ["model=tiny", "target=tpu:v5e:2x2", "mesh=4x1", "plan_batch=3", "int8=false"]
    assert serve([*args, f"results={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "serving batches [3] (of plan_batch=) do not split" in err, err


def test_a_run_whose_config_breaks_a_rule_is_named(tmp_path, capsys):
    """A config.json whose fields break a rule (n_heads that do not divide d_model) is one
    line naming the run and its config.json, not the user's keys."""
    folder = tmp_path / "d"
    folder.mkdir()
    saved = {"model": {"d_model": 3, "n_heads": 4}, "request": {"preset": "tiny"}}
    (folder / "config.json").write_text(json.dumps(saved))
    assert serve([*FAST[1:], "run=d", f"out_dir={tmp_path}", f"results={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: run=d: "), err
    assert "must divide d_model=3" in err and str(folder / "config.json") in err, err


def test_records_name_the_model_served_and_keys_that_change_a_runs_math(tmp_path):
    """A model changed from its preset (d_model=32) is named in the records' config, not read
    as the preset; serving a run with other rope_theta/window/softcap than it trained with is
    allowed, said and recorded; how a model runs (kernel, dtype) is not a change."""
    from lab.config import make_config, model_changes
    from lab.studies.serving import weights

    assert model_changes(make_config(preset="tiny")) == {}
    changed = make_config(preset="tiny", d_model=32, window=4, attention="naive", dtype="float32")
    assert model_changes(changed) == {"d_model": 32, "window": 4}
    _saved_run(tmp_path / "r", {"preset": "tiny", "batch_size": 8, "seq_len": 16})
    assert weights.changed_from_run(tmp_path / "r", {"attention": "naive"}) == []
    assert weights.changed_from_run(tmp_path / "r", {"rope_theta": 2.0, "softcap": 0.5}) == [
        "rope_theta 10000.0 → 2.0",
        "softcap 0.0 → 0.5",
    ]

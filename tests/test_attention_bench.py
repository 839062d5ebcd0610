"""lab.tools.attention_bench end to end on CPU (tiny lengths): the table, records with ratios
against the baseline asked for; a bad option is one line naming the key the user gave."""

import json

import pytest

from lab.studies import attention as study
from lab.tools.attention_bench import main

FAST = ["seqs=64", "causal=yes", "modes=fwd", "budget=0.01", "plot=false"]


def test_a_size_too_large_names_the_keys_the_user_gave(tmp_path, capsys):
    """head_dim alone sets the size here: the line names it (and the default seqs it multiplies),
    not a seqs= the user never typed."""
    assert main(["head_dim=1000000", f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: head_dim=1000000 seqs="), err
    assert err.endswith("choose a smaller head_dim= or seqs=") and len(err.splitlines()) == 1


def test_the_sweep_writes_ratios_against_the_baseline(tmp_path, capsys):
    argv = [*FAST, "impls=naive,blockwise", "baseline=naive", f"out_dir={tmp_path}"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "blockwise" in out and "is measured too" not in out  # the baseline was asked for
    assert main([*FAST, "impls=blockwise", "baseline=naive", f"out_dir={tmp_path}"]) == 0
    assert "baseline=naive is measured too (the ratios' reference)" in capsys.readouterr().out
    recs = [json.loads(x) for f in tmp_path.glob("*.jsonl") for x in f.open()]
    ratios = [r for r in recs if r["what"].endswith("naive") and r["unit"] == "x"]
    assert {r["config"]["impl"] for r in ratios} >= {"blockwise"}
    assert all(r["value"] > 0 for r in ratios)


def test_progress_counts_points_in_plain_lines(tmp_path, capsys):
    """A line per point as it starts, with n/N as collectives and scaling print, and no source
    location (rich's console.log put 'attention.py:523' at the right edge of each)."""
    import re

    argv = [*FAST[1:], "seqs=64,128", "impls=naive", "baseline=naive", f"out_dir={tmp_path}"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "L=S=64 causal=yes fwd (0/2 done" in out and "L=S=128 causal=yes fwd (1/2" in out
    assert not re.search(r"\w+\.py:\d+", out), out
    # what the samples may take, said before they start
    # one impl: no other to alternate with, so no pause before its samples
    assert "2 points × 1 impl × budget=0.01 s: about " in out and "of timed samples" in out, out


def test_a_budget_of_years_says_so_before_it_starts():
    from lab.tools.attention_bench import _WALL_PER_BUDGET, _wall_estimate

    quick = (1e-3, 1e11)  # (the samples' floor in seconds, the peak): under the budget's figure
    line = _wall_estimate(24, 5, 1e9, "cpu", quick)
    per = f"(×{_WALL_PER_BUDGET}: on CPU each sample waits first)"
    assert line.startswith(f"24 points × 5 impls × budget=1e+09 s {per}"), line
    hours = 24 * 5 * 1e9 * _WALL_PER_BUDGET / 3600
    assert f"about {hours:,.1f} h of timed samples (more where" in line, line
    assert _wall_estimate(1, 2, 2.0, "gpu", quick).startswith(
        "1 point × 2 impls × budget=2 s: about"
    )
    assert "×" not in _wall_estimate(3, 1, 2.0, "cpu", quick).split("budget")[1]
    slow = (7200.0, 1e11)  # two hours for each impl: said, as each impl's, whatever the budget
    assert "at least 2.0 h of timed samples for each impl that runs: three calls" in (
        _wall_estimate(3, 2, 2.0, "cpu", slow)
    )


def test_short_lengths_measure_no_peak_for_the_floor(monkeypatch):
    """The matmul peak (about a second) is measured only where the samples' FLOPs could
    outlast the budget on this device: at quick=true's lengths and budget (8 points, 0.2 s
    each, ×11 on CPU) they cannot, even at 1e10 FLOP/s."""
    from lab.measure import ceilings

    monkeypatch.setattr(ceilings, "matmul_peak", lambda *a, **k: pytest.fail("measured"))
    shape = study.Shape(1, 2, 1, 64, "float32")
    floor = study.samples_floor_s(
        study.default_seqs("cpu", quick=True), (True, False), study.MODES, shape,
        study.Masking(), "float32", 8 * 0.2 * 11,
    )  # fmt: skip
    assert floor == (0.0, None)


def test_a_length_whose_calls_take_long_says_so_before_it_starts(tmp_path, capsys, monkeypatch):
    """budget= bounds the samples, not the three each impl takes at least: at L = 131,072 one
    causal forward call (B1 H2 K64, the defaults) is 2.2e12 FLOPs, tens of seconds on a CPU,
    and the line said "about 10 ms". It now says the least those take at this device's
    measured matmul peak (the sweep itself is not run here)."""
    monkeypatch.setattr(study, "sweep", lambda *a, **k: [])
    argv = ["seqs=131072", "causal=yes", "modes=fwd", "budget=0.01", "impls=blockwise"]
    assert main([*argv, "baseline=blockwise", f"out_dir={tmp_path}"]) == 2  # nothing measured
    out = " ".join(capsys.readouterr().out.split())
    assert "1 point × 1 impl × budget=0.01 s: at least " in out, out
    least = out.split("at least ")[1].split(" of timed samples")[0]
    flops = 3 * 4.0 * 2 * 64 * (131072 * 131073 / 2)  # three causal calls, B1 H2 K64
    peak = float(out.split("matmul peak (")[1].split(" TFLOP/s")[0]) * 1e12
    value, unit = least.split()
    seconds = float(value.replace(",", "")) * {"s": 1, "min": 60, "h": 3600}[unit]
    assert seconds == pytest.approx(flops / peak, rel=0.01), (least, peak)


def test_a_sweep_where_nothing_ran_keeps_its_reasons_and_exits_2(tmp_path, capsys, monkeypatch):
    """Every impl skipped (here none fits the memory left): the table and the skip records
    stay, and the command says in one line that nothing was measured, exit 2 — not 0."""
    monkeypatch.setattr(study, "_free_bytes", lambda: 1)
    argv = [*FAST[1:], "seqs=64", "impls=naive", "baseline=naive", f"out_dir={tmp_path}"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "no impl asked for ran" in out, out
    assert err.strip() == (
        "error: nothing was measured: each impl asked for was skipped (see its row)"
    ), err
    recs = [json.loads(x) for f in tmp_path.glob("*.jsonl") for x in f.open()]
    reasons = [r["value"] for r in recs if r["unit"] == "reason"]
    assert reasons and all("needs" in why for why in reasons), recs
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize(
    "args, needle",
    [
        (["baseline=xlaa"], "baseline=xlaa: not an implementation that runs compiled here"),
        (["impls=blockwize"], "impls=blockwize: not an implementation that runs compiled here"),
        (["impls=cpu_flsh"], "(did you mean cpu_flash?)"),
        (["heads=3", "kv_heads=2"], "heads=3 must be a multiple of kv_heads=2"),
        (["batch=100000000"], "seqs=64 batch=100000000: the inputs and gradients would take"),
        # a sample of 10^8 calls would never end: refused, not run
        # (with a batch too big to hold, so that without the bound it is refused, not run)
        (["inner=100000000", "batch=100000000"], "inner='100000000': must be <= 10000"),
        # a window whose keys int32 cannot count: the key's bound, not every impl skipped
        (["window=99999999999"], "window='99999999999': must be <= 2147483648"),
        # a peer that exists but is not here (its library, or a GPU) says why
        (["impls=jax_pallas_mgpu"], "impls=jax_pallas_mgpu: it compiles only for a GPU; choose"),
        (["impls=pallas"], "impls=pallas: it runs on GPU or TPU only; choose from"),
        # several mistakes: each named with its own reason
        (["impls=blockwize,pallas"], "impls=blockwize,pallas: blockwize: not an implementation"),
    ],
)
def test_bad_input_is_one_line_naming_the_key(tmp_path, capsys, args, needle):
    assert main([*FAST, *args, f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_missing_library_peer_is_named_with_the_way_to_install_it(monkeypatch):
    """torch_sdpa and tokamax run where their libraries are installed: asked for elsewhere,
    the refusal says so and names the extra, not "not an implementation"; PyTorch installed
    but not for this backend is said as that."""
    import importlib.util

    monkeypatch.setattr(study, "default_impls", lambda backend=None: ("naive", "xla"))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        study.importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("torch", "tokamax") else real(name, *a),
    )
    for name, lib in (("torch_sdpa", "PyTorch"), ("tokamax", "tokamax")):
        with pytest.raises(ValueError, match=rf"impls={name}: {lib} is not installed here"):
            study.check_impls([name], "cpu")
    monkeypatch.setattr(study.importlib.util, "find_spec", lambda name, *a: object())
    with pytest.raises(ValueError, match="the PyTorch installed here does not run on tpu"):
        study.check_impls(["torch_sdpa"], "tpu")


def test_an_explicit_budget_wins_over_quick(tmp_path, monkeypatch):
    """quick=true sets a short budget; budget= given beside it is the user's and is kept."""
    seen = []

    def fake_sweep(*args, budget_s, **kwargs):
        seen.append(budget_s)
        raise SystemExit(0)

    monkeypatch.setattr(study, "sweep", fake_sweep)
    for args, want in ((["quick=true"], 0.2), (["quick=true", "budget=0.01"], 0.01)):
        with pytest.raises(SystemExit):
            main([*args, "impls=naive", "baseline=naive", f"out_dir={tmp_path}"])
        assert seen[-1] == want


def test_a_native_kernels_memory_says_what_it_leaves_out(tmp_path, capsys):
    """XLA's buffer assignment cannot see an FFI kernel's own scratch: cpu_flash's peak temp
    memory is labelled as XLA's part only, in the table, a line under it and the records."""
    from lab.kernels.attention import cpu_flash

    if not cpu_flash.available():
        pytest.skip("the native CPU kernel is not built here")
    argv = [*FAST, "impls=cpu_flash,naive", "baseline=naive", f"out_dir={tmp_path}"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "kernel's own" in out and "XLA's temporaries only" in out
    recs = [json.loads(x) for f in tmp_path.glob("*.jsonl") for x in f.open()]
    mem = {r["config"]["impl"]: r for r in recs if r["what"] == "attention peak temp memory"}
    assert mem["cpu_flash"]["config"]["excludes"] and "excludes" not in mem["naive"]["config"]
    assert {r["label"] for r in mem.values()} == {"compiled"}


def test_the_budget_help_states_the_wall_time_it_costs(capsys, monkeypatch):
    """budget= counts timed samples only; on CPU each ~2 ms sample waits 20 ms untimed first,
    so the help says a point costs up to about 11x budget per implementation; and the timing
    loop counts each wait as slept, so an oversleeping host does not eat the budget."""
    import types

    from lab.measure import timing
    from lab.studies import attention as study
    from lab.tools import attention_bench

    factor = attention_bench._WALL_PER_BUDGET
    assert factor == 11
    assert main(["--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"waits {study.CPU_SETTLE_S * 1e3:g} ms untimed first" in help_text
    assert f"up to about {factor}x budget per implementation" in help_text

    # A clock the test moves, so the bookkeeping is checked exactly, whatever the host's load
    # (a busy-waited sample that the host paused overran the budget: too few samples)
    clock, samples = [0.0], []

    def sample():  # one 2 ms sample, as `inner` sizes them
        samples.append(1)
        clock[0] += study.SAMPLE_S
        return 0

    def sleep(s):  # a loaded host oversleeps each settle (here by 30 ms, made so)
        clock[0] += s + 0.03

    fake = types.SimpleNamespace(perf_counter=lambda: clock[0], sleep=sleep)
    monkeypatch.setattr(timing, "time", fake)
    budget = 0.05
    timing.comparison(
        {"a": sample, "b": sample},
        baseline="a",
        warmup=0,
        min_runs=1,
        budget_s=budget,
        settle_s=study.CPU_SETTLE_S,
    )
    # the oversleep is not timed, so the budget buys its samples (counting the settle as
    # 20 ms left about 3 of the 50)
    assert len(samples) >= 0.9 * 2 * budget / study.SAMPLE_S, len(samples)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["window=-1"], "window='-1': must be >= 0"),
        (["docs=-2"], "docs='-2': must be >= 0"),
        (["softcap=-1"], "softcap='-1': must be >= 0"),
        (["softcap=nan"], "softcap='nan': expected a finite number"),
        (["docs=48"], "docs=48 does not divide seqs=64"),
        (["window=16", "causal=no"], "window=16 is a causal mask"),
        (["docs=32", "causal=both"], "docs=32 is a causal mask"),
    ],
)
def test_a_bad_mask_is_one_line_and_nothing_runs(tmp_path, capsys, args, needle):
    causal = [] if any(a.startswith("causal=") for a in args) else ["causal=yes"]
    base = ["seqs=64", "modes=fwd", "budget=0.01", "plot=false", "impls=naive", "baseline=naive"]
    assert main([*base, *causal, *args, f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not list(tmp_path.iterdir())


def test_a_masked_sweep_says_its_mask_and_checks_against_the_same_one(tmp_path, capsys):
    """window, docs and softcap reach every impl through the dispatch; xla, which takes no
    segment ids nor soft-cap, is left out with the reason; the title and every record's config
    say the mask; the float64 check used it (a reference without it is far off); TFLOP/s
    counts only the pairs the window and documents leave."""
    from lab.studies import attention as study

    mask = ["window=16", "docs=32", "softcap=30"]
    argv = [*FAST, "impls=naive,blockwise,xla", "baseline=naive", *mask, f"out_dir={tmp_path}"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "window 16 · docs of 32 · softcap 30" in out
    assert " × 2 impls × " in out  # the estimate counts only the impls that are timed
    recs = [json.loads(x) for f in tmp_path.glob("*.jsonl") for x in f.open()]
    assert recs and all(
        (r["config"]["window"], r["config"]["docs"], r["config"]["softcap"]) == (16, 32, 30.0)
        for r in recs
    )
    skipped = {r["config"]["impl"]: r["value"] for r in recs if r["what"] == "attention skipped"}
    assert skipped == {"xla": "does not take segment ids (packed sequences) nor logit soft-capping"}
    errors = {r["config"]["impl"]: r["value"] for r in recs if r["what"] == "attention max error"}
    assert set(errors) == {"naive", "blockwise"} and max(errors.values()) < 1e-5, errors
    flops = {r["config"]["flops"] for r in recs if r["what"] == "attention TFLOP/s"}
    pairs = 2 * (16 * 17 / 2 + 16 * 16)  # two documents of 32: 16 rows ramp up, 16 see 16 keys
    assert flops == {4.0 * 1 * 2 * 64 * pairs}, flops
    assert study.Masking(window=16, docs=32).pairs(64) == pairs


def test_the_float64_check_of_a_window_point_uses_the_window():
    """The checked rows (the last ones) against all keys, with the window: a windowed output
    agrees with it, and not with the unmasked causal reference (so a check that forgot the
    mask would fail loudly rather than pass)."""
    import jax

    from lab.kernels.attention import attention
    from lab.studies import attention as study

    shape = study.Shape(head_dim=32)
    q, k, v, do = shape.arrays(256)
    masking = study.Masking(window=32)
    out = jax.jit(lambda q, k, v: attention(q, k, v, impl="blockwise", **masking.kwargs(1, 256)))(
        q, k, v
    )
    rows, want = study.reference_rows(q, k, v, do, causal=True, mode="fwd", masking=masking)
    assert study.max_error(out, rows, want) < 1e-5
    rows, plain = study.reference_rows(q, k, v, do, causal=True, mode="fwd")
    assert study.max_error(out, rows, plain) > 0.1


def test_a_peer_is_refused_a_mask_it_is_never_given():
    """The library peers and torch_sdpa get only q, k, v and causal: any window, documents
    or soft-cap leaves them out of the point with the reason, never silently unmasked."""
    from lab.studies import attention as study

    assert study.Masking().refusal("torch_sdpa") is None
    assert study.Masking(softcap=5.0).refusal("torch_sdpa") == "does not take logit soft-capping"
    assert study.Masking(window=8).refusal("xla") is None  # jax.nn takes a local window
    assert study.Masking(window=8).refusal("cpu_flash") is None

"""The block-size search (lab/studies/tune.py), run through the Pallas interpreter.

On CPU the times mean nothing; what is tested is the machinery a GPU run relies on: every
candidate checked against the reference, refused ones recorded and never chosen, scores from
the timed ratios, the winner written as data and read back by the kernel. With the gpu-plan
extra, the static pass is tested for real: candidates compiled for an H100 (deviceless, through
JAX's CUDA plugin and ptxas) and dropped before timing when the compiler says they spill or
overflow shared memory.
"""

import dataclasses
import json

import pytest

from lab.kernels.attention import pallas_gpu
from lab.studies import tune
from lab.tools import attention_tune

SEARCH = tune.Search(
    head_dim=16,
    seqs=(40,),
    causal=(True,),
    batch=1,
    heads=2,
    kv_heads=1,
    dtype="float32",
    interpret=True,
)


def test_interpret_search_chooses_writes_and_the_kernel_reads_it(tmp_path):
    best, records, summary = tune.search_block_sizes(SEARCH, budget_s=0.01)
    assert [s.stage for s in summary.stages] == ["fwd", "bwd", "variant"]
    assert summary.baseline == "xla"
    ratios = [r for r in records if r["what"] == "tune time ratio vs baseline"]
    assert len(ratios) == summary.candidates == 6  # one case each
    assert all(r["value"] > 0 and r["config"]["interpret"] for r in ratios)
    final = summary.stages[-1]
    assert best == summary.best == final.candidates[final.best] == final.chosen
    assert summary.best_score == final.scores[final.best] == min(final.scores)

    path = tune.write_entry("Test GPU 80GB", SEARCH, best, summary, folder=tmp_path)
    assert path.name == "test-gpu-80gb.json"
    entry = json.loads(path.read_text())
    assert entry["search"]["16"]["baseline"] == "xla" and entry["search"]["16"]["candidates"] == 6
    table = pallas_gpu.load_tuned(tmp_path)
    assert table == {"Test GPU 80GB": {16: best}}


def test_the_search_says_each_case_in_a_plain_line(tmp_path, capsys):
    """Each case of each stage is a line as it starts, without a source location (rich's
    console.log put 'tune.py:305' at the right edge of each)."""
    import re

    assert attention_tune.main(["interpret=true", "budget=0.01", f"out_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "fwd: 2 candidates, L=S=40 causal=yes fwd" in out
    assert not re.search(r"\w+\.py:\d+", out), out


def test_block_sizes_for_takes_the_nearest_searched_head_dim(monkeypatch):
    a, b = pallas_gpu.BlockSizes(block_q=32), pallas_gpu.BlockSizes(block_q=128)
    monkeypatch.setattr(pallas_gpu, "TUNED", {"GPU": {64: a, 128: b}})
    assert pallas_gpu.block_sizes_for("GPU", 64) == a
    assert pallas_gpu.block_sizes_for("GPU", 256) == b
    assert pallas_gpu.block_sizes_for("GPU", 32) == a
    assert pallas_gpu.block_sizes_for("other", 64) == pallas_gpu.BLOCK_SIZES["default"]


def test_a_wrong_candidate_is_recorded_and_never_chosen(monkeypatch):
    real = tune._kernel_program

    def program(bs, causal, mode, interpret):
        fn = real(bs, causal, mode, interpret)
        if bs.block_q != 32:
            return fn
        return lambda *args: jax_tree_scale(fn(*args), 1.5)  # a broken kernel: 50% off

    monkeypatch.setattr(tune, "_kernel_program", program)
    candidates = [
        dataclasses.replace(pallas_gpu.BlockSizes(), **o) for o in tune.INTERPRET_SPACE["fwd"]
    ]
    timing = dict(budget_s=0.01, min_runs=1, warmup=0)
    records, stage = tune.run_stage("fwd", candidates, SEARCH, "fwd", "xla", timing)
    assert stage.chosen.block_q == 16 and stage.scores[1] == float("inf")
    rejected = [r for r in records if r["what"] == "tune rejected"]
    assert len(rejected) == 1 and rejected[0]["value"].startswith("max error")


def jax_tree_scale(tree, factor):
    import jax

    return jax.tree.map(lambda x: x * factor, tree)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["interpret=true", "write=true"], "interpret-mode times measure nothing"),
        ([], "compiles only on a GPU"),
        (
            ["interpret=true", "head_dims=44"],
            "takes no head_dim 44 (it takes",
        ),  # not a multiple of 8
        (["interpret=true", "heads=3", "kv_heads=2"], "not a multiple"),
        (["interpret=ture"], "expected a boolean"),
        (["head_dim=64"], "did you mean head_dims?"),
        (["static_only=true", "static=tpu:v5e:2x2"], "expected auto, off or gpu:KIND[:N]"),
        (["static_only=true", "static=gpu:h999:1"], "static='gpu:h999:1': unknown GPU"),
        (["static_only=true", "static=off"], "needs a GPU or static=gpu:KIND"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(argv, needle, capsys):
    assert attention_tune.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_the_mosaic_kernel_is_tuned_for_hopper_targets_only(capsys):
    """LLVM aborts the process compiling the Mosaic GPU kernel for an A100: refused first."""
    pytest.importorskip("jax_plugins.xla_cuda13", reason="the gpu-plan extra compiles for GPUs")
    argv = ["static_only=true", "static=gpu:a100", "kernel=pallas_mgpu", "space=quick"]
    assert attention_tune.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "kernel=pallas_mgpu is written for Hopper" in err and len(err.splitlines()) == 1


def test_a_search_with_no_working_candidate_is_one_line(monkeypatch, capsys, tmp_path):
    def broken(*_a, **_k):
        raise RuntimeError("no candidate compiled and matched the reference")

    monkeypatch.setattr(tune, "search_block_sizes", broken)
    assert attention_tune.main(["interpret=true", f"out_dir={tmp_path}"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: head_dim 16: no candidate compiled and matched the reference"


def test_a_search_too_large_for_the_host_is_refused_before_it_starts(monkeypatch, capsys, tmp_path):
    """interpret=true holds the inputs, gradients and float64 reference in the host's memory:
    a length that cannot fit is one line and exit 2, before any search allocates a byte."""

    def started(*_a, **_k):
        raise AssertionError("a search started")

    monkeypatch.setattr(tune, "search_block_sizes", started)
    argv = ["interpret=true", "seqs=100000000", "space=quick", f"out_dir={tmp_path}"]
    assert attention_tune.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: seqs=100000000: the inputs, gradients and baseline would"), err
    assert "choose a smaller seqs=" in err and len(err.splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_the_memory_check_counts_the_baseline_scores_against_the_memory_available(
    monkeypatch, capsys, tmp_path
):
    """The check holds the xla baseline's L×L scores (what made a search that passed it run
    out of memory) against the host's available memory, not its total, and names a length
    that fits; that length's estimate fits and the next one's does not."""
    from lab.measure import memory

    def started(*_a, **_k):
        raise AssertionError("a search started")

    monkeypatch.setattr(tune, "search_block_sizes", started)
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 64 * 2**30)  # a big host...
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 2 * 2**30)  # ...mostly taken
    search = dataclasses.replace(SEARCH, seqs=(16384,))
    # the inputs alone are a few MiB; the baseline's scores are many B·H·L² float32 arrays
    assert search.shape.held_bytes(16384) < 2**26
    assert search.held_bytes(16384) >= 10 * 2 * 16384**2 * 4  # 10.3 measured on jax 0.10
    argv = ["interpret=true", "seqs=16384", "space=quick", f"out_dir={tmp_path}"]
    assert attention_tune.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    need = search.held_bytes(16384) / 2**30
    assert f"would take {need:,.1f} GiB, and the host has 2.0 GiB available" in err, err
    fits = int(err.split("(seqs=")[1].split(" fits)")[0])
    limit = 0.8 * 2 * 2**30
    assert search.held_bytes(fits) <= limit < search.held_bytes(fits + 1)
    assert not list(tmp_path.iterdir())


def test_available_memory_is_read_from_meminfo(monkeypatch, tmp_path):
    from lab.measure import memory

    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       25165824 kB\nMemAvailable:    1048576 kB\n")
    real_open = open
    monkeypatch.setattr(
        "builtins.open", lambda f, *a, **k: real_open(info if f == "/proc/meminfo" else f, *a, **k)
    )
    assert memory.host_available_bytes() == 2**30
    info.write_text("MemTotal:       25165824 kB\n")  # an OS that does not say: the total
    assert memory.host_available_bytes() == memory.host_memory_bytes()


def _gpu_plans_missing() -> bool:
    from lab.plans import gpu

    return gpu._pjrt() is None or gpu.ptxas() is None


@pytest.mark.skipif(_gpu_plans_missing(), reason="needs the gpu-plan extra (CUDA plugin, ptxas)")
def test_static_pass_drops_spills_and_smem_overflows_before_timing(monkeypatch):
    """static=gpu:h100:1: every candidate is compiled for sm_90a first; the one that spills
    registers and the one whose pipeline overflows shared memory are dropped with the
    compiler's figures, and only the one that fits reaches the timed stage."""
    search = dataclasses.replace(
        SEARCH, head_dim=128, seqs=(256,), dtype="bfloat16", static="gpu:h100:1"
    )
    candidates = [
        dataclasses.replace(pallas_gpu.BlockSizes(), **o)
        for o in (
            dict(block_q=64, block_k=64, num_warps=4, num_stages=2),  # fits
            dict(block_q=128, block_k=64, num_warps=4, num_stages=2),  # 4 warps, 128 rows: spills
            dict(block_q=128, block_k=128, num_warps=8, num_stages=4),  # 4 K/V stages > 227 KiB
        )
    ]
    real, timed = tune._kernel_program, []

    def program(bs, causal, mode, interpret):
        if interpret:  # the timed stage's program (the static pass compiles interpret=False)
            timed.append(candidates.index(bs))
        return real(bs, causal, mode, interpret)

    monkeypatch.setattr(tune, "_kernel_program", program)
    # the timed stage's compile-and-check is where timing starts: stop there
    monkeypatch.setattr(tune, "_compile_checked", lambda *a: (None, "not timed in this test"))
    timing = dict(budget_s=0.01, min_runs=1, warmup=0)
    records, stage = tune.run_stage("fwd", candidates, search, "fwd", "xla", timing)

    assert timed == [0]  # the dropped ones never reach the timed stage
    assert stage.scores[1] == stage.scores[2] == float("inf")
    cands = [dataclasses.asdict(c) for c in candidates]
    kernels = {}  # candidate → its kernel's figures, as the compiler reported them
    for r in records:
        if r["what"] == "tune kernel registers":
            assert r["label"] == "compiled, not run" and r["config"]["target"] == "gpu:h100:1"
            kernels[cands.index(r["config"]["candidate"])] = {
                "registers": r["value"],
                **r["config"],
            }
    assert kernels[0]["spill_bytes"] == 0 and 0 < kernels[0]["registers"] <= 255
    assert kernels[0]["smem"] <= 232448 and kernels[0]["blocks_per_sm"] >= 1
    assert kernels[1]["spill_bytes"] > 0 and kernels[1]["registers"] == 255
    assert 2 not in kernels  # Triton refused to build it: no kernel to read
    static = {  # the static pass's rejections (the timed stage's carry the shape: seq)
        cands.index(r["config"]["candidate"]): r["value"]
        for r in records
        if r["what"] == "tune rejected" and "seq" not in r["config"]
    }
    assert sorted(static) == [1, 2], static
    assert static[1].startswith("spills ") and "flash_attention_fwd" in static[1]
    assert "Shared memory size limit exceeded" in static[2]


def test_static_pass_rows_and_records_come_from_its_kernels():
    """A StaticPass renders each candidate's worst kernel and its verdict, and writes one
    record per kernel with the fields the tuner's records have always had."""
    from rich.console import Console

    from lab.measure.tuning import KernelUse, StaticCandidate, StaticPass
    from lab.report import tables

    a, b = pallas_gpu.BlockSizes(block_q=64), pallas_gpu.BlockSizes(block_q=128)
    fits = KernelUse(True, "fwd", 146, 0, 40960, 2)
    spills = KernelUse(True, "fwd", 255, 96, 49152, 1)
    c = pallas_gpu.BlockSizes(block_q=256)
    refused = "does not compile for gpu:h100:1: smem_bytes=265328 > max_smem_bytes=232448"
    p = StaticPass(
        "gpu:h100:1",
        "fwd",
        (
            StaticCandidate(a, (fits,)),
            StaticCandidate(b, (fits, spills), "spills 96 B in fwd"),
            StaticCandidate(c, (), refused),  # the compiler refused it: no kernel, no figures
        ),
    )
    assert p.dropped == {1: "spills 96 B in fwd", 2: refused}
    assert (p.candidates[1].max_registers, p.candidates[1].spill_bytes) == (255, 96)
    recs = p.records()
    assert [r["value"] for r in recs] == [146, 146, 255, "spills 96 B in fwd", refused]
    # every dropped candidate is in the records with why, the refused one included
    for r, cand in zip(recs[3:], (b, c), strict=True):
        assert r["what"] == "tune rejected" and r["label"] == "compiled, not run"
        assert r["config"] == {
            "candidate": dataclasses.asdict(cand),
            "mode": "fwd",
            "target": "gpu:h100:1",
        }
    assert recs[2]["config"] == {
        "candidate": dataclasses.asdict(b),
        "causal": True,
        "mode": "fwd",
        "kernel": "fwd",
        "spill_bytes": 96,
        "smem": 49152,
        "blocks_per_sm": 1,
        "target": "gpu:h100:1",
    }
    con = Console(width=200, record=True)
    con.print(tables.static_pass(p, "fwd K=64"))
    text = con.export_text()
    assert "no: spills 96 B in fwd" in text and "48.0 KiB" in text and "block_q" in text
    (row,) = [line for line in text.splitlines() if line.lstrip("│ ").startswith("256 ")]
    cells = [x.strip() for x in row.split("│")[1:-1]]
    assert cells[1:4] == ["–", "–", "–"], cells  # registers, spills, smem: not zeros


def test_static_only_says_each_drop_once_counts_candidates_and_records_them(
    monkeypatch, capsys, tmp_path
):
    """static_only=true: a progress line per candidate with its n/N over every pass, each drop
    said once (in its table, not also as a log line), every dropped candidate in the records."""
    from lab.measure.tuning import StaticCandidate, StaticPass

    said = "does not compile for gpu:h100:1: smem_bytes=265328 > max_smem_bytes=232448"

    def static_filter(candidates, search, mode, log=None, progress=None):
        out = []
        for i, bs in enumerate(candidates):
            if progress:
                progress(f"candidate {i + 1}/{len(candidates)}")
            out.append(StaticCandidate(bs, (), said if i == 0 else None))
            if log and i == 0:
                log(f"static pass: candidate {i} dropped: {said}")
        return StaticPass(search.static, mode, tuple(out))

    monkeypatch.setattr(attention_tune, "_static", lambda o: "gpu:h100:1")
    monkeypatch.setattr(tune, "static_filter", static_filter)
    argv = ["static_only=true", "space=quick", "head_dims=64", f"out_dir={tmp_path}"]
    assert attention_tune.main(argv) == 0
    out = capsys.readouterr().out
    n = sum(len(v) for k, v in tune.spaces("pallas_gpu", "quick", False).items() if k != "variant")
    assert "fwd K=64 candidate 1/" in out and f"(0/{n} done" in out
    assert out.count("smem_bytes=265328") == 2, out  # once per pass: its table's row
    (path,) = tmp_path.glob("tune-static-*.jsonl")
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    rejected = [r for r in recs if r["what"] == "tune rejected"]
    assert [r["config"]["stage"] for r in rejected] == ["fwd", "bwd"]
    assert all(r["value"] == said for r in rejected)


def _stage(spans, scores=(1.0, 1.02, 1.5)):
    from lab.measure.tuning import Stage

    cands = tuple(pallas_gpu.BlockSizes(block_q=q) for q in (16, 32, 64))
    return Stage("fwd", "fwd", cands, scores, 0, spans)


def test_a_best_within_noise_of_the_runner_up_says_so_in_table_and_record(tmp_path):
    """Synthetic timings: the lowest median wins either way, but where its p10–p90 span
    overlaps the runner-up's, the table, the caption and the stage's record say so."""
    from rich.console import Console

    from lab.report import tables

    tied = _stage(((0.9, 1.1), (1.0, 1.2), (1.4, 1.6)))
    assert tied.within_noise_of == [1]
    console = Console(width=200, record=True)
    console.print(tables.tune_stage(tied, "xla"))
    text = console.export_text()
    assert "← chosen (within noise of block_q=32)" in text, text
    assert "the p10–p90 ranges overlap" in text and "0.900x–1.100x" in text, text
    assert "a rerun may name either" in " ".join(text.split()), text
    r = tied.record(baseline="xla")
    assert r["label"] == "derived" and r["value"] == 1.0
    assert [c["block_q"] for c in r["config"]["within_noise_of"]] == [32]
    assert r["config"]["candidate"]["block_q"] == 16

    clear = _stage(((0.9, 0.95), (1.0, 1.2), (1.4, 1.6)))
    assert clear.within_noise_of == [] and clear.record()["config"]["within_noise_of"] == []
    console = Console(width=200, record=True)
    console.print(tables.tune_stage(clear, "xla"))
    assert "within noise" not in console.export_text()
    # a rejected candidate is no rival: the next finite score is
    assert _stage(((0.9, 1.1), None, (1.0, 1.2)), (1.0, float("inf"), 1.1)).within_noise_of == [2]


def test_every_candidate_within_noise_of_the_chosen_is_named_not_only_the_runner_up():
    """The runner-up (1.2) is apart from the chosen, but the third (1.3, a wide span) overlaps
    it: the stage names the third, and where both overlap, both with their count."""
    from rich.console import Console

    from lab.report import tables

    third = _stage(((0.9, 1.1), (1.15, 1.25), (1.0, 1.6)), (1.0, 1.2, 1.3))
    assert third.within_noise_of == [2]
    assert [c["block_q"] for c in third.record()["config"]["within_noise_of"]] == [64]

    both = _stage(((0.9, 1.1), (1.05, 1.25), (1.0, 1.6)), (1.0, 1.2, 1.3))
    assert both.within_noise_of == [1, 2]
    assert [c["block_q"] for c in both.record()["config"]["within_noise_of"]] == [32, 64]
    console = Console(width=240, record=True)
    console.print(tables.tune_stage(both, "xla"))
    text = console.export_text()
    assert "within noise of 2 others (block_q=32, block_q=64)" in text, text
    assert "a rerun may name any of them" in " ".join(text.split()), text
    assert tables.tied_text(both, both.within_noise_of) == "2 others (block_q=32, block_q=64)"


def test_one_overlap_helper_names_the_ties_of_both_tuners():
    from lab.measure.tuning import within_noise

    assert within_noise([(0.9, 1.1), (1.15, 1.25), (1.0, 1.6), None], 0) == [2]
    assert within_noise([(1.0, 2.0), (2.0, 3.0)], 0) == [1]  # a shared end is a shared point
    assert within_noise([None, (1.0, 2.0)], 0) == []


def test_a_stage_records_its_choice_from_the_timed_spans():
    candidates = [
        dataclasses.replace(pallas_gpu.BlockSizes(), **o) for o in tune.INTERPRET_SPACE["fwd"]
    ]
    timing = dict(budget_s=0.01, min_runs=3, warmup=0)
    records, stage = tune.run_stage("fwd", candidates, SEARCH, "fwd", "xla", timing)
    (choice,) = [r for r in records if r["what"] == "tune stage best score"]
    assert choice["value"] == stage.best_score and "within_noise_of" in choice["config"]
    lo, hi = stage.spans[stage.best]
    assert 0 < lo <= hi and choice["config"]["span"] == [lo, hi]


def test_the_closing_line_names_every_stages_ties_not_only_the_last(tmp_path, monkeypatch, capsys):
    """The chosen tiles rest on each stage's choice: where the forward stage's choice was
    within noise of another, the closing line says so, with the stage, beside the last's."""
    from lab.measure.tuning import Stage, TileSearch

    fwd = _stage(((0.9, 1.1), (1.0, 1.2), (1.4, 1.6)))  # ties block_q=32
    bwd = Stage("bwd", "bwd", fwd.candidates, (1.0, 1.5, 1.6), 0, ((0.9, 1.0), (1.4, 1.6), None))
    last = Stage("variant", "variant", fwd.candidates, (1.0, 1.02, 1.5), 0, fwd.spans)
    summary = TileSearch("xla", (fwd, bwd, last))
    monkeypatch.setattr(tune, "search_block_sizes", lambda *a, **k: (last.chosen, [], summary))
    argv = ["interpret=true", "seqs=64", "space=quick", f"out_dir={tmp_path}", "write=false"]
    assert attention_tune.main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "within noise of fwd: block_q=32; variant: block_q=32" in out, out
    assert "bwd:" not in out.split("within noise of")[-1], out

"""lab.tools.attention_bench end to end on CPU (tiny lengths): the table, records with ratios
against the baseline asked for; a bad option is one line naming the key the user gave."""

import json

import pytest

from lab.tools.attention_bench import main

FAST = ["seqs=64", "causal=yes", "modes=fwd", "budget=0.01", "plot=false"]


def test_the_sweep_writes_ratios_against_the_baseline(tmp_path, capsys):
    argv = [*FAST, "impls=naive,blockwise", "baseline=naive", f"out_dir={tmp_path}"]
    assert main(argv) == 0
    assert "blockwise" in capsys.readouterr().out
    recs = [json.loads(x) for f in tmp_path.glob("*.jsonl") for x in f.open()]
    ratios = [r for r in recs if r["what"].endswith("naive") and r["unit"] == "x"]
    assert {r["config"]["impl"] for r in ratios} >= {"blockwise"}
    assert all(r["value"] > 0 for r in ratios)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["baseline=xlaa"], "baseline=xlaa: not an implementation that runs compiled here"),
        (["impls=blockwize"], "impls=blockwize: not an implementation that runs compiled here"),
        (["impls=cpu_flsh"], "(did you mean cpu_flash?)"),
        (["heads=3", "kv_heads=2"], "heads=3 must be a multiple of kv_heads=2"),
        (["batch=100000000"], "seqs=64: the inputs and gradients would take"),
    ],
)
def test_bad_input_is_one_line_naming_the_key(tmp_path, capsys, args, needle):
    assert main([*FAST, *args, f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not list(tmp_path.iterdir())  # nothing written


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

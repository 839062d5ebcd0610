"""The GPU-speed targets' judge (lab/studies/targets.py), on records built the way the
attention sweep builds them: which reference, which speed, which verdict."""

import pytest

from lab.measure.attention import Measured
from lab.measure.timing import BenchResult
from lab.report import markdown
from lab.studies import attention as bench
from lab.studies import targets
from lab.tools import attention_targets

SHAPE = bench.Shape(batch=2, heads=32, kv_heads=32, head_dim=128, dtype="bfloat16")


def _records(times_s: dict, mode="fwd", seq=4096, causal=True, skipped=None):
    out = []
    for impl, t in times_s.items():
        row = Measured(impl, 1.0, None, None, BenchResult(t, t, t, 5, 1.0), inner=1, max_error=1e-3)
        out += bench._records(row, SHAPE, seq, causal, mode, "cudnn")
    for impl, why in (skipped or {}).items():
        row = Measured(impl, 0, memory=None, skipped=why)
        out += bench._records(row, SHAPE, seq, causal, mode, "cudnn")
    return out


def test_met_when_faster_than_cudnn_and_ahead_of_the_peers():
    recs = _records({"pallas_gpu": 1.0, "cudnn": 1.1, "xla": 3.0, "jax_pallas_triton": 2.0})
    (v,) = targets.judge(recs, 128)
    assert v.reference == "cudnn" and v.speed == pytest.approx(1.1)
    assert v.met and v.ahead_of == ("jax_pallas_triton", "xla") and v.note == ""


def test_backward_target_is_0_8_and_a_slower_peer_fails_it():
    recs = _records(
        {"pallas_gpu": 1.2, "cudnn": 1.0, "xla": 3.0, "jax_pallas_triton": 1.1}, mode="fwd+bwd"
    )
    (v,) = targets.judge(recs, 128)
    assert v.speed == pytest.approx(1 / 1.2) and v.speed >= 0.8
    assert not v.met and v.note == "behind jax_pallas_triton"


def test_without_cudnn_the_faster_fallback_is_the_reference():
    recs = _records(
        {"pallas_gpu": 1.0, "torch_sdpa": 0.9, "jax_pallas_mgpu": 0.8, "xla": 2.0},
        skipped={"cudnn": "does not compile here: no cuDNN"},
    )
    (v,) = targets.judge(recs, 128)
    assert v.reference == "jax_pallas_mgpu" and v.speed == pytest.approx(0.8)
    assert not v.met and "jax_pallas_triton did not run" in v.note
    md = markdown.targets_block(
        [v],
        {"device_kind": "H100", "device_count": 1, "jax_version": "x", "jaxlib_version": "y"},
        "python -m lab.tools.attention_targets",
        "2026-11-23",
    )
    assert "**0 of 1 points meet their target.**" in md and "| 128 | 4096 | yes | fwd |" in md


def test_a_kernel_that_did_not_run_fails_with_the_reason():
    recs = _records({"cudnn": 1.0}, skipped={"pallas_gpu": "needs 9.0 GiB > 50% of 10.0 free"})
    (v,) = targets.judge(recs, 64)
    assert not v.met and v.note == "pallas_gpu did not run: needs 9.0 GiB > 50% of 10.0 free"


def test_on_cpu_the_command_says_it_needs_a_gpu(capsys):
    assert attention_targets.main([]) == 2
    assert "compare compiled GPU kernels" in capsys.readouterr().err

"""The CUDA toolchain the GPU kernels are compiled with (lab/measure/toolchain.py): its version
is read once, pallas_mgpu's causal mask is refused (explicit) or passed over (auto/pallas) on
the ptxas releases known to miscompile it, and every record, plan and kernel table names it.

The version probe is faked (monkeypatch): no GPU and no second CUDA toolchain are needed.
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import pytest
from rich.console import Console

from lab.kernels import attention as dispatch
from lab.kernels.attention import choose, choose_noted, pallas_mgpu
from lab.measure import records, toolchain
from lab.measure.attention import PlanPoint
from lab.measure.gpu_kernels import Kernel
from lab.plans import gpu as gpus
from lab.report import tables

H100 = "NVIDIA H100 80GB HBM3"
needs_plugin = pytest.mark.skipif(
    gpus._pjrt() is None or gpus.ptxas() is None,
    reason="the CUDA plugin or ptxas is missing: pip install -e '.[gpu-plan]'",
)

# ptxas builds as NVIDIA ships them (ptxas --version; the nvcc wheels carry the same numbers)
OK = ["12.6.85", "12.7.99", "12.9.86", "13.0.48", "13.5.37"]  # 12.9.86: CUDA 12.9.1
BAD = ["12.8.61", "12.8.93", "12.9.41"]  # CUDA 12.8.0, 12.8.1, 12.9.0


def fake(ptxas=None, runtime=None) -> toolchain.Toolchain:
    plugin = "jax-cuda12-plugin 0.10.2"
    return toolchain.Toolchain(ptxas, "/fake/bin/ptxas" if ptxas else None, runtime, plugin)


@pytest.fixture
def use(monkeypatch):
    """use(tc): the lab sees `tc` as this process's toolchain; records are stamped afresh."""

    def _use(tc):
        monkeypatch.setattr(toolchain, "probe", lambda: tc)
        records.environment.cache_clear()

    yield _use
    records.environment.cache_clear()


@pytest.fixture
def hopper(monkeypatch):
    """The dispatch builds for an H100 (a plan's target) with no cuDNN, as a plan does."""
    monkeypatch.setattr(dispatch, "device_kind", lambda: H100)
    monkeypatch.setattr(dispatch, "_cudnn_here", lambda: False)


def _qkv(head_dim=64, dtype=jnp.bfloat16):
    q = jax.ShapeDtypeStruct((1, 256, 4, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((1, 256, 2, head_dim), dtype)
    return q, kv, kv


# ------------------------------------------------------------------------------ versions


def test_ptxas_version_is_read_from_its_banner():
    banner = (
        "ptxas: NVIDIA (R) Ptx optimizing assembler\n"
        "Cuda compilation tools, release 12.9, V12.9.86\n"
        "Build cuda_12.9.r12.9/compiler.36037853_0"
    )
    assert toolchain.parse_ptxas_version(banner) == "12.9.86"
    assert toolchain.parse_ptxas_version("no banner") is None


@pytest.mark.parametrize(
    "build, release",
    [
        ("12.7.99", (12, 7, 0)),
        ("12.8.61", (12, 8, 0)),
        ("12.8.93", (12, 8, 1)),
        ("12.9.41", (12, 9, 0)),
        ("12.9.86", (12, 9, 1)),
        ("13.0.48", (13, 0, 0)),
    ],
)
def test_a_ptxas_build_maps_to_its_cuda_release(build, release):
    assert toolchain.release_of_ptxas(build) == release


@pytest.mark.parametrize("version", OK + BAD)
def test_the_known_bad_range_is_cuda_12_8_0_up_to_12_9_1(version):
    assert toolchain.miscompiles_causal_wgmma(fake(version)) == (version in BAD)


@pytest.mark.parametrize("runtime, bad", [("12.7", False), ("12.8", True), ("12.9", True)])
def test_without_ptxas_the_cuda_runtime_decides_as_jax_does(runtime, bad):
    """The runtime reports no update: 12.9 counts as 12.9.0 (JAX refuses 12090 < 12091)."""
    tc = fake(runtime=runtime)
    assert toolchain.miscompiles_causal_wgmma(tc) == bad
    assert "CUDA runtime" in tc.compiler
    assert not toolchain.miscompiles_causal_wgmma(fake())  # nothing to compile with


def test_this_machine_reports_what_it_has():
    tc = toolchain.probe()
    if gpus.ptxas() is not None:
        assert tc.ptxas and tc.ptxas_path == gpus.ptxas() and tc.release[0] >= 11


# ------------------------------------------------------------------------------ the guard


@pytest.mark.parametrize("version", OK + BAD)
def test_an_explicit_pallas_mgpu_is_refused_in_the_range(use, hopper, version):
    use(fake(version))
    if version not in BAD:
        assert choose("pallas_mgpu", *_qkv(), causal=True, backend="gpu") == "pallas_mgpu"
        return
    with pytest.raises(ValueError) as e:
        choose("pallas_mgpu", *_qkv(), causal=True, backend="gpu")
    msg = str(e.value)
    assert len(msg.splitlines()) == 1
    assert f"ptxas {version}" in msg and "pallas_gpu" in msg and ">= 12.9.1" in msg


@pytest.mark.parametrize("version", BAD)
def test_without_the_causal_mask_it_compiles_in_the_range(use, hopper, version):
    use(fake(version))
    assert choose("pallas_mgpu", *_qkv(), causal=False, backend="gpu") == "pallas_mgpu"
    assert choose_noted("auto", *_qkv(), causal=False, backend="gpu") == ("pallas_mgpu", None)


@pytest.mark.parametrize("nvjitlink", OK + BAD)
def test_nvjitlink_in_the_range_is_refused_whatever_ptxas_says(use, hopper, nvjitlink):
    """XLA (and Mosaic GPU through it) assembles with libnvJitLink before the ptxas binary
    where the library loads: its release counts as much as ptxas's."""
    use(dataclasses.replace(fake("12.9.86"), nvjitlink=nvjitlink))
    if nvjitlink not in BAD:
        assert choose("pallas_mgpu", *_qkv(), causal=True, backend="gpu") == "pallas_mgpu"
        return
    with pytest.raises(ValueError, match=rf"nvJitLink {nvjitlink}") as e:
        choose("pallas_mgpu", *_qkv(), causal=True, backend="gpu")
    assert "ptxas 12.9.86" not in str(e.value) and len(str(e.value).splitlines()) == 1
    chosen, note = choose_noted("auto", *_qkv(), causal=True, backend="gpu")
    assert chosen == "pallas_gpu" and f"nvJitLink {nvjitlink}" in note


def test_keys_padded_to_a_tile_are_masked_too(use, hopper):
    """Without causal masking, keys that do not fill whole tiles still take the masked path:
    refused in the range, accepted outside it."""
    q = jax.ShapeDtypeStruct((1, 200, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 200, 2, 64), jnp.bfloat16)
    use(fake("12.8.61"))
    with pytest.raises(ValueError, match="keys padded to a whole tile"):
        choose("pallas_mgpu", q, kv, kv, causal=False, backend="gpu")
    fn = functools.partial(pallas_mgpu.flash_attention_mgpu, causal=False)
    with pytest.raises(ValueError, match="keys padded"):
        jax.eval_shape(fn, q, kv, kv)
    use(fake("12.9.86"))
    assert choose("pallas_mgpu", q, kv, kv, causal=False, backend="gpu") == "pallas_mgpu"


@pytest.mark.parametrize("impl", ["auto", "pallas"])
@pytest.mark.parametrize("version", ["12.7.99", "12.8.61", "12.9.41", "12.9.86", "13.0.48"])
def test_auto_and_pallas_fall_back_and_say_why(use, hopper, impl, version):
    use(fake(version))
    chosen, note = choose_noted(impl, *_qkv(), causal=True, backend="gpu")
    if version not in BAD:
        assert (chosen, note) == ("pallas_mgpu", None)
        return
    assert chosen == "pallas_gpu"  # Triton: no wgmma, safe on every release
    assert note.startswith("pallas_gpu instead of pallas_mgpu:") and f"ptxas {version}" in note
    assert ">= 12.9.1" in note and len(note.splitlines()) == 1


def test_an_input_the_kernel_does_not_take_is_no_news(use, hopper):
    """float32 never goes to pallas_mgpu: no note, whatever the toolchain."""
    use(fake("12.8.61"))
    assert choose_noted("auto", *_qkv(dtype=jnp.float32), backend="gpu") == ("pallas_gpu", None)


def test_cudnn_first_passes_over_nothing(use, monkeypatch):
    use(fake("12.8.61"))
    monkeypatch.setattr(dispatch, "device_kind", lambda: H100)
    monkeypatch.setattr(dispatch, "_cudnn_here", lambda: True)
    assert choose_noted("auto", *_qkv(), causal=True, backend="gpu") == ("cudnn", None)


def test_the_kernel_itself_refuses_when_called_directly(use):
    """attention_tune and benchmarks call flash_attention_mgpu without the dispatch: it checks
    too, before tracing anything, so no miscompiled kernel reaches a GPU."""
    use(fake("12.8.93"))
    fn = functools.partial(pallas_mgpu.flash_attention_mgpu, causal=True)
    with pytest.raises(ValueError, match=r"ptxas 12\.8\.93 \(CUDA 12\.8\.1\)"):
        jax.eval_shape(fn, *_qkv())


@pytest.mark.skipif(not pallas_mgpu.interpretable(), reason="interpreted from jax 0.11")
def test_the_interpreter_runs_no_ptxas_and_is_not_refused(use):
    use(fake("12.8.61"))
    assert choose("pallas_mgpu", *_qkv(), causal=True, interpret=True) == "pallas_mgpu"


# ------------------------------------------------------------------------------ commands


@needs_plugin
def test_lab_run_refuses_it_in_one_line_with_exit_2(use, tmp_path, capsys):
    from lab.run import main

    use(fake("12.8.61"))
    argv = ["target=gpu:h100", "model=tiny", "n_heads=1", "n_kv_heads=1"]
    assert main([*argv, "attention=pallas_mgpu", f"out_dir={tmp_path}", "name=x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ptxas 12.8.61" in err and "12.9.1" in err


@needs_plugin
def test_attention_plan_refuses_it_in_one_line_with_exit_2(use, tmp_path, capsys):
    from lab.tools.attention_plan import main

    use(fake("12.9.41"))
    argv = ["target=gpu:h100", "impl=pallas_mgpu", "seq=256", "head_dim=64", "data=1"]
    assert main([*argv, f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ptxas 12.9.41 (CUDA 12.9.0)" in err


@needs_plugin
def test_a_training_plan_falls_back_and_its_header_says_so(use):
    """attention=auto on an H100 target with a bad ptxas: the trainer is built (nothing is
    compiled) with pallas_gpu, and the header prints why."""
    from lab.session import open_session

    use(fake("12.8.61"))
    keys = dict(target="gpu:h100", model="tiny", n_heads=1, n_kv_heads=1, name="x")
    s = open_session(keys=keys)
    assert s.cfg.model.attention == "pallas_gpu"
    assert "instead of pallas_mgpu" in s.trainer.attention_note
    header = tables.run_header(s.cfg, s.info, 1, {}, attention_note=s.trainer.attention_note)
    assert "attention=pallas_gpu" in header and "ptxas 12.8.61" in header
    use(fake("12.9.86"))
    s = open_session(keys=keys)
    assert s.cfg.model.attention == "pallas_mgpu"
    assert "instead of pallas_mgpu" not in (s.trainer.attention_note or "")  # no fallback


@needs_plugin
def test_an_attention_plan_names_its_choice_and_reason(use):
    """The plan's rows (and records) carry the kernel the dispatch chose for the target and
    why, without compiling (lab.studies.plan._chosen)."""
    from lab import plans
    from lab.studies import plan

    use(fake("12.8.61"))
    plans.prepare_host("gpu:h100")
    mesh = plan.mesh_for(plans.topology_devices("gpu:h100"), 1)
    chosen, note = plan._chosen("pallas", *_qkv()[:2], True, mesh)
    assert chosen == "pallas_gpu" and "ptxas 12.8.61" in note
    row = PlanPoint(
        mode="fwd", seq=None, head_dim=None, device_kind=H100, devices=1, compile_s=0.0,
        memory={"total_bytes": 1}, hbm_bytes=None, compiled_flops=None, compiled_flops_note="",
        analytic_flops_per_device=1.0, estimated_s=None, estimate_source="", peak_flops=None,
        impl=chosen, attention_note=note,
    )  # fmt: skip
    recs = plan.to_records([row], {"target": "gpu:h100", "impl": "pallas"})
    assert recs  # the memory, the analytic FLOPs: each carries the choice
    for r in recs:
        assert r["config"]["chosen_impl"] == "pallas_gpu"
        assert "ptxas" in r["config"]["attention_note"] and r["ptxas_version"] == "12.8.61"


# ------------------------------------------------------------------------------ records


def test_every_record_names_its_toolchain(use):
    use(fake("12.9.86", "12.9"))
    r = records.make_record("x", 1.0, "s")
    assert r["ptxas_version"] == "12.9.86" and r["cuda_runtime_version"] == "12.9"
    assert r["cuda_plugin_version"] == "jax-cuda12-plugin 0.10.2"
    json.dumps(r)  # plain JSON
    use(dataclasses.replace(fake("12.9.86"), nvjitlink="12.8.93"))
    assert records.make_record("x", 1.0, "s")["nvjitlink_version"] == "12.8.93"
    assert "nvJitLink 12.8.93" in tables.toolchain_line(toolchain.probe())


def test_a_kernel_table_is_captioned_with_its_ptxas():
    kernel = Kernel(
        name="flash_attention_fwd",
        launches=1,
        grid=(2, 2, 8),
        threads=256,
        registers=128,
        spill_store_bytes=0,
        spill_load_bytes=0,
        stack_bytes=0,
        static_smem=0,
        dynamic_smem=32768,
        blocks_per_sm=2,
        limiter="regs",
        occupancy=0.25,
    )
    point = PlanPoint(
        mode="fwd+bwd", seq=256, head_dim=64, device_kind=H100, devices=1, compile_s=0.0,
        memory=None, hbm_bytes=None, compiled_flops=None, compiled_flops_note="",
        analytic_flops_per_device=1.0, estimated_s=None, estimate_source="", peak_flops=None,
        impl="pallas_mgpu", attention_note=None, kernels=(kernel,),
    )  # fmt: skip
    tc = fake("13.0.48", "13.0")
    con = Console(width=200, record=True)
    con.print(tables.kernels([kernel], "kernels", tc))
    con.print(tables.kernel_grid([point], "g", tc))
    out = con.export_text()
    assert (
        out.count("compiled by ptxas 13.0.48 · jax-cuda12-plugin 0.10.2 · CUDA runtime 13.0") == 2
    )
    assert "L=256 K=64 fwd" in out and "32.0 KiB" in out


def test_a_kernel_and_a_toolchain_read_back_from_their_records():
    """summary.json holds kernels and the toolchain as records; lab.run reads them back into
    the types its tables take, the same figures."""
    k = Kernel("k", 2, (1, 2, 3), 128, 64, 4, 8, 16, 1024, 2048, 3, "regs", 0.5, ("C7515",))
    r = json.loads(json.dumps(k.record()))
    assert r["smem"] == 3072 and r["spill_bytes"] == 12
    assert Kernel.from_record(r) == k
    tc = fake("13.0.48", "13.0")
    assert toolchain.Toolchain.from_record(tc.record()) == dataclasses.replace(tc, ptxas_path=None)


# A real plan names its toolchain in summary.json, the environment and the kernel table's
# caption: checked on the H200 and A100 plans of tests/test_gpu_plans.py
# (test_the_other_shipped_gpus_compile_a_step), which compile a step for that anyway.


def test_the_tuners_static_pass_is_captioned_with_its_compiler():
    from lab.measure.tuning import StaticPass

    tc = toolchain.Toolchain("13.5.37", None, None, "jax-cuda13-plugin 0.10.2")
    t = tables.static_pass(StaticPass("gpu:h100:1", "fwd", ()), "fwd K=64", tc)
    assert t.caption == "compiled by ptxas 13.5.37 · jax-cuda13-plugin 0.10.2"


def test_auto_says_why_an_accelerator_falls_back_to_blockwise():
    """`auto` on a TPU prefers pallas_tpu; a head_dim it does not take falls back to the
    portable kernel with one line saying why, not silently. A shape it takes has no note."""
    chosen, note = choose_noted("auto", *_qkv(head_dim=32), causal=True, backend="tpu")
    assert chosen == "blockwise"
    assert note == (
        "blockwise instead of pallas_tpu, which does not take this input (q/k head_dim 32: "
        "pallas_tpu supports q/k head_dim in (64, 128, 256) (dtypes float32, bfloat16))"
    )
    assert choose_noted("auto", *_qkv(head_dim=64), causal=True, backend="tpu") == (
        "pallas_tpu",
        None,
    )

"""The Pallas TPU flash kernel, forward and backward, compiled through Mosaic for real TPU
topologies ahead of time on this CPU machine (needs libtpu; nothing runs, it only compiles).
The GPU kernels are compiled for H100 in tests/test_gpu_plans.py.

Under a multi-device mesh a Mosaic kernel has to sit inside `shard_map`: XLA cannot partition
a custom call, so each device gets its own (batch, head) shard and runs the kernel on it.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from lab import plans
from lab.kernels.attention import pallas_tpu

SPEC = PartitionSpec("data", None, "model", None)  # batch over data, heads over model


def _mesh(target: str):
    plans.prepare_host(target)
    devices = plans.topology_devices(target)
    return jax.sharding.Mesh(np.array(devices).reshape(2, -1), ("data", "model"))


def _sharded_attention(mesh, causal: bool):
    kernel = functools.partial(pallas_tpu.flash_attention_tpu, causal=causal)
    # check_vma=False: pallas_call's out_shape carries no varying-mesh-axes type, and the
    # kernel is per-shard anyway (each output shard depends only on its own inputs).
    return jax.shard_map(kernel, mesh=mesh, in_specs=(SPEC,) * 3, out_specs=SPEC, check_vma=False)


def _abstract(mesh, shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, SPEC))


@pytest.mark.parametrize(
    "target, causal, dtype, head_dim, seq",
    [
        ("tpu:v5e:2x2", True, jnp.bfloat16, 128, 384),
        ("tpu:v4:2x2x1", False, jnp.float32, 64, 300),  # 300: padded to whole key blocks
    ],
)
def test_forward_and_backward_compile_through_mosaic(target, causal, dtype, head_dim, seq):
    pytest.importorskip("libtpu", reason="libtpu not installed: pip install -e '.[tpu]'")
    mesh = _mesh(target)
    attn = _sharded_attention(mesh, causal)
    kv_heads = mesh.shape["model"]  # one kv head and its 2 query heads per device
    q = _abstract(mesh, (2, seq, 2 * kv_heads, head_dim), dtype)
    kv = _abstract(mesh, (2, seq, kv_heads, head_dim), dtype)

    def loss(q, k, v):
        return attn(q, k, v).astype(jnp.float32).sum()

    fwd = jax.jit(attn).lower(q, kv, kv)
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv)
    for lowered, names in (
        (fwd, ["flash_attention_fwd"]),
        (bwd, ["flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"]),
    ):
        text = lowered.as_text()
        assert all(name in text for name in names), names  # the Mosaic custom calls are there
        compiled = lowered.compile()
        assert compiled.memory_analysis() is not None


def test_kernel_plan_command(tmp_path, capsys):
    """python -m lab.tools.attention_plan: memory, FLOPs and a time floor for a slice."""
    pytest.importorskip("libtpu", reason="libtpu not installed: pip install -e '.[tpu]'")
    from lab.studies import plan
    from lab.tools import attention_plan

    argv = ["target=tpu:v5e:2x2", "seq=1024", "heads=4", "kv_heads=2", f"out_dir={tmp_path}"]
    assert attention_plan.main(argv) == 0
    out = capsys.readouterr().out
    assert "fwd+bwd" in out
    (path,) = tmp_path.glob("attention-plan-*.jsonl")
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(recs) == 12
    labels = {r["what"]: r["label"] for r in recs}
    assert labels == {  # the time is a model of the compiled program: predicted, as lab.run's
        "attention plan memory per device": "compiled, not run",
        "attention plan FLOPs per device": "compiled, not run",
        "attention plan analytic FLOPs per device": "derived",
        "attention plan step time": "predicted",
        "attention plan TFLOP/s": "predicted",
        "attention plan share of peak": "predicted",
    }
    flops = [r for r in recs if r["what"] == "attention plan FLOPs per device"]
    assert len(flops) == 2 and all(r["config"]["flops_source"] for r in flops)
    times = [r for r in recs if r["what"] == "attention plan step time"]
    sources = {r["config"]["source"].split(" (")[0] for r in times}
    assert sources <= {"compiler estimate", "roofline floor"}, sources
    # each source is said once under the table, the rows naming it by number
    said = list(dict.fromkeys(r["config"]["source"] for r in times))
    for i, text in enumerate(said, 1):
        assert f"({i}) {text.split(':')[0]}" in out.replace("\n", " "), out
        assert out.count(text.split(":")[0]) == 1, out
    for r in recs:  # a floor is a lower bound, the rates it implies upper bounds
        floor = r["config"]["source"].startswith("roofline floor") if "source" in r["config"] else 0
        want = {"attention plan step time": "lower"}.get(r["what"], "upper")
        assert r["config"].get("bound") == (want if floor else None), r
    rows = plan.plan(
        "tpu:v5e:2x2",
        batch=4,
        heads=4,
        kv_heads=2,
        seq=1024,
        head_dim=128,
        dtype="bfloat16",
        causal=True,
        data=2,
    )
    fwd, both = rows
    assert 0 < fwd.memory_bytes < fwd.hbm_bytes
    assert both.analytic_flops_per_device == pytest.approx(3.5 * fwd.analytic_flops_per_device)
    assert both.estimated_s > fwd.estimated_s > 0
    assert fwd.peak_share <= 1.0 and both.peak_share <= 1.0  # the floor holds
    assert attention_plan.main(["target=tpu:v5e:2x2", "kv_heads=3", "heads=6"]) == 2
    assert "kv heads over model" in capsys.readouterr().err


def test_masked_kernels_compile_through_mosaic():
    """With a Mask (a causal window and packed-document segment ids, per sequence): the block
    map scalar-prefetched into SMEM, the segment ids as (rows, 1) and (1, keys) VMEM blocks,
    forward and backward compiled for a v5e chip."""
    pytest.importorskip("libtpu", reason="libtpu not installed: pip install -e '.[tpu]'")
    from lab.kernels.attention.common import Mask

    plans.prepare_host("tpu:v5e:2x2")
    devices = plans.topology_devices("tpu:v5e:2x2")
    mesh = jax.sharding.Mesh(np.array(devices[:1]), ("data",))
    sh = NamedSharding(mesh, PartitionSpec())
    B, L, H, K = 2, 512, 2, 128
    q = jax.ShapeDtypeStruct((B, L, H, K), jnp.bfloat16, sharding=sh)
    seg = jax.ShapeDtypeStruct((B, L), jnp.int32, sharding=sh)

    def loss(q, k, v, seg):
        mask = Mask.make(causal=True, window=(127, 0), q_segment_ids=seg, kv_segment_ids=seg)
        o = pallas_tpu.flash_attention_tpu(q, k, v, causal=True, mask=mask)
        return o.astype(jnp.float32).sum()

    with jax.sharding.set_mesh(mesh):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q, seg)
    text = lowered.as_text()
    assert all(
        n in text for n in ("flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv")
    )
    assert lowered.compile().memory_analysis() is not None


@pytest.mark.slow_plan
def test_plan_flops_fall_with_a_window_and_packed_documents_on_tpu():
    """The TPU plan at S = 8,192: a window of 1,024 and 8 packed documents of 1,024 against
    causal. The window's fall is in the compiled count itself (Mosaic keeps the kernels'
    cost estimates); the documents' compiled count is only the causal band's (segment ids
    are data when traced), so their fall is the block map's count of the ids, labelled."""
    pytest.importorskip("libtpu", reason="libtpu not installed: pip install -e '.[tpu]'")
    from lab.studies import plan

    rows = plan.grid(
        "tpu:v5e:2x2", seqs=(8192,), head_dims=(128,), masks=plan.masks_of(True, (1024,), (1024,)),
        batch=2, heads=2, kv_heads=2, dtype="bfloat16", causal=True, data=2,
    )  # fmt: skip
    by = {(r.mask, r.mode): r for r in rows}
    for mode in ("fwd", "fwd+bwd"):
        causal, window, docs = (by[m, mode] for m in ("causal", "window 1,024", "docs of 1,024"))
        assert causal.estimate_compiled and window.estimate_compiled
        assert causal.compiled_flops / window.compiled_flops >= 3.0
        assert causal.flops_source.startswith("compiled") and window.flops == window.compiled_flops
        assert docs.flops_source.startswith("block map of the segment ids")
        assert docs.compiled_flops >= 0.99 * causal.compiled_flops  # the upper bound
        assert causal.flops / docs.flops >= 3.0


def test_a_plan_of_packed_documents_floors_its_time_on_work_it_cannot_avoid():
    """The documents' compiled cost is the causal band's (segment ids are data when traced):
    an upper bound of their work. Their time floor must come from a lower bound — the mask's
    analytic FLOPs and the bytes read and written once — or its ≥ and the ≤ of its rates
    could be false: at most that roofline, and well under the causal plan's."""
    pytest.importorskip("libtpu", reason="libtpu not installed: pip install -e '.[tpu]'")
    from lab.measure import specs
    from lab.studies import plan

    rows = plan.grid(
        "tpu:v5e:2x2", seqs=(2048,), head_dims=(128,), masks=plan.masks_of(True, (), (256,)),
        batch=2, heads=2, kv_heads=2, dtype="bfloat16", causal=True, data=2,
    )  # fmt: skip
    by = {(r.mask, r.mode): r for r in rows}
    spec = specs.lookup(rows[0].device_kind)
    for mode in ("fwd", "fwd+bwd"):
        causal, docs = by["causal", mode], by["docs of 256", mode]
        assert docs.compiled_flops >= 0.99 * causal.compiled_flops  # the upper bound
        assert docs.estimate_is_a_floor and "upper bound" in docs.estimate_source
        moved = docs.memory["argument_bytes"] + docs.memory["output_bytes"]
        least = max(docs.analytic_flops_per_device / docs.peak_flops, moved / spec.memory_bandwidth)
        assert docs.estimated_s == pytest.approx(least)
        assert docs.estimated_s < causal.estimated_s / 2
        assert docs.peak_share <= 1.0


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            ["impl=pallas_gpu"],
            "no compiled kernel on backend 'tpu': choose one of pallas, pallas_tpu",
        ),
        (["batch=3"], "batch must split over data"),
        (["head_dim=12"], "q/k head_dim 12"),
        # a window or documents beside a full plain mask: their "× fewer" would count the
        # causal saving as theirs
        (["causal=false", "window=128"], "window=128 is a causal mask"),
        (["causal=false", "window=64", "docs=128"], "window=64 docs=128 are causal masks"),
    ],
)
def test_a_plan_it_cannot_make_is_one_line_before_any_progress(argv, needle, capsys):
    pytest.importorskip("libtpu")
    from lab.tools import attention_plan

    assert attention_plan.main(["seq=256", *argv]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and needle in out.err, out
    assert "interpret" not in out.err  # the dispatch's advice for running here, not a plan's


def test_the_hopper_kernel_asked_of_an_a100_plan_says_why(capsys):
    """pallas_mgpu compiles for Hopper only: a plan for an A100 names the GPU and lists the
    kernels its compiler takes, in one line."""
    from lab.plans import gpu as gpus

    if gpus._pjrt() is None or gpus.ptxas() is None:
        pytest.skip("the CUDA plugin or ptxas is missing: pip install -e '.[gpu-plan]'")
    from lab.tools import attention_plan

    assert attention_plan.main(["seq=256", "impl=pallas_mgpu", "target=gpu:a100:1"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "choose one of pallas, pallas_gpu (pallas_mgpu needs a Hopper" in err
    )

"""GPU plans from this CPU machine (needs the gpu-plan extra: JAX's CUDA plugin and ptxas):
the real training step compiled for 1 and 8 H100s, every Pallas attention kernel compiled for
sm_90a with its registers, spills and shared memory read back from the compiler, the memory
calculator against the GPU compiler, and bad input as one line. Nothing runs on a GPU.
"""

import json

import pytest

from lab.plans import gpu as gpus
from lab.plans import resources
from lab.run import main

needs_plugin = pytest.mark.skipif(
    gpus._pjrt() is None or gpus.ptxas() is None,
    reason="the CUDA plugin or ptxas is missing: pip install -e '.[gpu-plan]'",
)
MARGIN = 0.15  # the calculator's margin against memory_analysis (tests/test_memory.py)


@needs_plugin
@pytest.mark.parametrize("n, mesh, strategy", [(1, "1", "dp"), (8, "8", "fsdp")])
def test_training_step_compiles_for_h100s(tmp_path, capsys, n, mesh, strategy):
    argv = [
        f"target=gpu:h100:{n}",
        f"mesh={mesh}",
        f"strategy={strategy}",
        "model=small",
        "batch_size=16",
        "seq_len=256",
        f"out_dir={tmp_path}",
        "name=plan",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "compiled, not run" in out and "GPU kernels of one step" in out
    s = json.loads((tmp_path / "plan" / "summary.json").read_text())
    assert s["device_kind"] == "NVIDIA H100 80GB HBM3" and s["devices"] == n
    plan = s["aot"]
    assert plan["fit"].startswith("fits") and 0 < plan["implied_mfu"] <= 1
    assert plan["estimate_source"].startswith("roofline floor")  # no cost analysis on GPU
    kernels = plan["kernels"]
    assert any("flash_attention" in k["name"] for k in kernels)  # attention=auto: pallas_gpu
    for k in kernels:
        assert k["registers"] > 0 and k["threads"] > 0 and k["blocks_per_sm"] >= 1, k
        assert k["smem"] <= gpus.GPUS["h100"].smem_per_block
    # the calculator against the GPU compiler: the training state (params + AdamW moments)
    state = s["compiled_memory_per_device"]["argument_bytes"]
    pred = s["predicted_memory_per_device"]
    assert abs(pred["params"] + pred["optimizer"] - state) / state < MARGIN, (pred, state)


@needs_plugin
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_kernels_spill_nothing_on_h100(head_dim, causal):
    """The default block sizes of pallas_gpu, forward and backward (fwd, dq, dkv kernels),
    compiled for sm_90a: zero spill bytes, shared memory within one SM's limit."""
    from lab.studies import plan

    rows = plan.plan(
        "gpu:h100:1",
        batch=1,
        heads=4,
        kv_heads=2,
        seq=1024,
        head_dim=head_dim,
        dtype="bfloat16",
        causal=causal,
        data=1,
    )
    names = {k["name"].split("_kernel")[0] for r in rows for k in r["kernels"]}
    assert {"flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"} <= names, names
    for r in rows:
        for k in r["kernels"]:
            if not k["name"].startswith("flash_attention"):
                continue
            assert k["spill_bytes"] == 0, k
            assert 0 < k["smem"] <= gpus.GPUS["h100"].smem_per_block, k
            assert k["registers"] <= 255 and k["blocks_per_sm"] >= 1, k


def test_ptxas_log_is_read():
    log = """ptxas info    : Compiling entry function 'k1' for 'sm_90a'
ptxas info    : Function properties for k1
    8 bytes stack frame, 196 bytes spill stores, 196 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem, 560 bytes cmem[0]"""
    got = resources.parse_ptxas(log)["k1"]
    assert got == dict(
        registers=255, stack_bytes=8, spill_store_bytes=196, spill_load_bytes=196, static_smem=1024
    )
    blocks, limiter, occ = resources.occupancy("h100", threads=256, registers=255, smem=1024)
    assert (blocks, limiter) == (1, "regs") and occ == pytest.approx(8 / 64)
    assert resources.occupancy("h100", threads=128, registers=64, smem=300_000)[0] == 0


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["target=gpu:b300"], "unknown GPU 'b300'; the lab describes h100, h200, a100"),
        (["target=gpu:h100:12"], "12 GPUs span hosts of 8; give a multiple of 8"),
        (["target=gpu:h100:0"], "must be a positive number of GPUs"),
        (["target=gpu"], "expected gpu:KIND[:N]"),
    ],
)
def test_bad_gpu_targets_are_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("missing", ["_pjrt", "ptxas"])
def test_a_missing_plugin_or_ptxas_names_the_package(missing, monkeypatch, capsys):
    monkeypatch.setattr(gpus, missing, lambda: None)
    assert main(["target=gpu:h100:8", "mesh=8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install -e '.[gpu-plan]'" in err and len(err.splitlines()) == 1


@needs_plugin
@pytest.mark.parametrize(
    "causal, dtype, seq, split",
    [
        (True, "bfloat16", 300, True),  # 300: padded to whole blocks inside the kernel
        (False, "bfloat16", 256, False),
        (True, "float16", 256, False),
        (False, "float16", 256, True),
    ],
)
def test_both_mask_variants_compile_for_h100(causal, dtype, seq, split):
    """The variants the tuner chooses between (split_mask on and off), bf16 and f16, forward
    and backward, compiled through Triton for sm_90a: three kernels, none spilling. (float32
    compiles too, but its tiles are twice the bytes: these defaults spill there, and f32
    attention on a GPU is cuDNN's or the tuner's business, not the default's.)"""
    import functools

    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from lab import plans
    from lab.kernels.attention import pallas_gpu

    devices = plans.topology_devices("gpu:h100:1")
    mesh = jax.sharding.Mesh(devices, ("data",))
    sh = NamedSharding(mesh, P())
    q = jax.ShapeDtypeStruct((1, seq, 4, 128), dtype, sharding=sh)
    kv = jax.ShapeDtypeStruct((1, seq, 2, 128), dtype, sharding=sh)
    bs = pallas_gpu.BlockSizes(split_mask=split)
    attn = functools.partial(pallas_gpu.flash_attention_gpu, causal=causal, block_sizes=bs)
    grads = jax.grad(lambda *a: attn(*a).astype("float32").sum(), argnums=(0, 1, 2))

    def lower():
        with jax.sharding.set_mesh(mesh):
            return jax.jit(grads).lower(q, kv, kv)

    _, kernels = plans.compile_plan(lower, devices)
    flash = [k for k in kernels if k.name.startswith("flash_attention")]
    assert len(flash) == 3 and not any(k.spill_bytes for k in flash), flash

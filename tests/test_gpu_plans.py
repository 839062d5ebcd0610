"""GPU plans from this CPU machine (needs the gpu-plan extra: JAX's CUDA plugin and ptxas):
the real training step compiled for 1 and 8 H100s, every Pallas attention kernel compiled for
sm_90a with its registers, spills and shared memory read back from the compiler, the memory
calculator against the GPU compiler, and bad input as one line. Nothing runs on a GPU.
"""

import json
import subprocess
import sys

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
@pytest.mark.parametrize(
    "n, mesh, strategy",
    [
        (1, "1", "dp"),
        # the weights over the mesh's fsdp axis (mesh=8 strategy=fsdp is the same mesh)
        (8, "fsdp:8", "fsdp"),
        # heads, MLP and vocabulary over model=4, batch over data=2; the third configuration
        # of the calculator check runs once per CI (the two above prove 1 and 8 on both legs)
        pytest.param(8, "2x4", "tp", marks=pytest.mark.slow_plan),
    ],
)
def test_training_step_compiles_for_h100s(tmp_path, capsys, n, mesh, strategy):
    argv = [
        f"target=gpu:h100:{n}",
        f"mesh={mesh}",
        f"strategy={strategy}",
        "model=small",
        "n_layers=2",  # two layers hold every rule the four would; half the compile
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
    assert plan["estimate_source"].startswith("predicted by the step-time model")
    kernels = plan["kernels"]
    assert any("flash_attention" in k["name"] for k in kernels)  # attention=auto: pallas_mgpu
    for k in kernels:
        assert k["registers"] > 0 and k["threads"] > 0 and k["blocks_per_sm"] >= 1, k
        if "flash_attention" in k["name"]:  # the lab's own kernels spill nothing
            assert k["spill_store_bytes"] == 0 and k["spill_load_bytes"] == 0, k
        assert k["smem"] <= gpus.GPUS["h100"].smem_per_block
    # the calculator against the GPU compiler: the training state (params + AdamW moments)
    state = s["compiled_memory_per_device"]["argument_bytes"]
    pred = s["predicted_memory_per_device"]
    ratio = (pred["params"] + pred["optimizer"]) / state
    print(f"mesh={mesh} {strategy}: training state, calculator / compiler = {ratio:.4f}")
    assert abs(ratio - 1) < MARGIN, (pred, state)


@needs_plugin
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_kernels_spill_nothing_on_h100(head_dim, causal):
    """The default block sizes of pallas_gpu, forward and backward (fwd, dq, dkv kernels),
    compiled for sm_90a: zero spill bytes, shared memory within one SM's limit. (On an H100
    `pallas` is the Mosaic kernel, tests/test_pallas_mgpu.py; the Triton one is named.)"""
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
        impl="pallas_gpu",
    )
    names = {k.name.split("_kernel")[0] for r in rows for k in r.kernels}
    assert {"flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"} <= names, names
    for r in rows:
        for k in r.kernels:
            if not k.name.startswith("flash_attention"):
                continue
            assert k.spill_bytes == 0, k
            assert 0 < k.smem <= gpus.GPUS["h100"].smem_per_block, k
            assert k.registers <= 255 and k.blocks_per_sm >= 1, k


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


# A thunk sequence as XLA:GPU dumps it (a scanned layer loop with a nested loop, as the dump
# of `model=small scan_layers=true` has them), with its metadata and optimized HLO.
_SEQUENCE = """\
000: kCustomKernel [source | next=001 (1)] loop_broadcast_fusion grid: [8, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
001: kWhile        [prev=000 (1)  | next=009 (1) ]
condition:
    002: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    003: kCustomKernel [source | next=004 (1)] flash_attention_fwd grid: [2, 8, 8] threads: [256, 1, 1]  shared_memory: 32768 bytes
    004: kAsyncStart   [prev=003 (1)  | sink         ] stream=computation_stream[1], async_id=4
        005: kDynamicSliceFusion [source | sink] params=1, results=1
    006: kWhile        [source | sink]
    condition:
        007: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        008: kCustomKernel [source | sink] input_reduce_fusion grid: [4, 1, 1] threads: [256, 1, 1]  shared_memory: 0 bytes
009: kCustomKernel [prev=001 (1) | sink] flash_attention_fwd grid: [2, 8, 8] threads: [256, 1, 1]  shared_memory: 32768 bytes
"""  # noqa: E501 (the dump's lines, as XLA writes them)
_METADATA = "".join(
    f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{name}"\n'
    f'    thunk_id: {i}\n  }}\n  thunk_kind: "kWhile"\n}}\n'
    for name, i in (("while.2", 1), ("while.7", 6))
)
_HLO = """\
ENTRY %main (p: s32[]) -> s32[] {
  %p = s32[] parameter(0)
  %while.2 = (s32[]) while(%p), condition=%c2, body=%b2, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %while.7 = (s32[]) while(%p), condition=%c7, body=%b7, backend_config={"known_trip_count":{"n":"3"}}
}
"""  # noqa: E501


def test_launches_are_counted_per_call_with_the_trips_of_their_loops():
    """A kernel in a loop body launches once per trip (a condition once more), nested loops
    multiply: a scanned model's layer kernels count once per layer, as unrolled ones do."""
    trips = resources.while_thunk_trips(_METADATA, _HLO)
    assert trips == {1: 4, 6: 3}
    got = [(m["name"], n, unknown) for m, n, unknown in resources.thunk_launches(_SEQUENCE, trips)]
    assert got == [
        ("loop_broadcast_fusion", 1, False),
        ("loop_compare_fusion", 5, False),  # 4 trips, the condition checked 5 times
        ("flash_attention_fwd", 4, False),
        ("loop_compare_fusion", 4 * 4, False),
        ("input_reduce_fusion", 4 * 3, False),
        ("flash_attention_fwd", 1, False),  # after the loop: once
    ]
    # a loop whose trip count the program does not state: counted once, flagged a lower bound
    unknown = resources.thunk_launches(_SEQUENCE, {1: None, 6: 3})
    assert [(n, u) for _, n, u in unknown][2:5] == [(1, True), (4, True), (3, True)]


@needs_plugin
@pytest.mark.slow_plan
def test_scanned_and_unrolled_layers_launch_the_same_kernels_per_step(tmp_path, capsys):
    """The kernel table counts launches per step: the attention kernels of a scanned model
    launch once per layer, as the unrolled model's do (the loop body is dumped once)."""
    launches = {}
    for scan in ("false", "true"):
        argv = ["target=gpu:h100:1", "model=small", "n_layers=2", "batch_size=8", "seq_len=256"]
        assert main([*argv, f"scan_layers={scan}", f"out_dir={tmp_path}", f"name={scan}"]) == 0
        capsys.readouterr()
        s = json.loads((tmp_path / scan / "summary.json").read_text())
        kernels = s["aot"]["kernels"]
        launches[scan] = {k["name"]: k["launches"] for k in kernels if "flash" in k["name"]}
        launches[scan]["xla"] = sum(k["launches"] for k in kernels if "flash" not in k["name"])
    flash = {"flash_attention_fwd": 2, "flash_attention_dq": 2, "flash_attention_dkv": 2}
    for scan in ("false", "true"):  # 2 layers: one launch of each per layer
        assert {k: v for k, v in launches[scan].items() if k != "xla"} == flash, launches
    # the scan adds its own kernels (the loop's condition, slicing the stacked weights)
    assert launches["true"]["xla"] >= launches["false"]["xla"], launches


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


@needs_plugin
def test_a_mesh_too_big_names_the_target_not_devices_present(capsys):
    # the target's GPUs are what the plan is compiled for, not hardware that is here
    assert main(["target=gpu:h100:8", "mesh=16"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: mesh=16 needs 16 devices but the target gpu:h100:8 has 8"


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
        # the other variants once per CI: test_attention_kernels_spill_nothing_on_h100 covers
        # bf16, causal and not, D 64 and 128 on both legs
        pytest.param(False, "bfloat16", 256, False, marks=pytest.mark.slow_plan),
        pytest.param(True, "float16", 256, False, marks=pytest.mark.slow_plan),
        pytest.param(False, "float16", 256, True, marks=pytest.mark.slow_plan),
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


@needs_plugin
def test_triton_deprecation_is_not_explained_where_python_hides_it(capsys):
    """A plain `python -m lab…` ignores a library's DeprecationWarning: JAX's would not have
    been shown there, so the lab's line is not printed either (it was, on every GPU plan);
    `-W default` (or pytest) shows it, and there the line stands in for it."""
    import warnings

    from lab.kernels import triton_deprecation as td

    for shown, filters, module in (
        (False, "ignore", ""),  # Python's default for a library's DeprecationWarning
        (True, "default", ""),
        (True, "default", "jax._src.pallas"),  # -W default::DeprecationWarning:jax._src.pallas
        (False, "default", "numpy"),  # shown for another library's only
    ):
        td.explain.cache_clear()
        with warnings.catch_warnings():
            warnings.resetwarnings()
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.filterwarnings(filters, category=DeprecationWarning, module=module)
            td.silence()  # the lab's own filter, set on import
            assert td._would_be_shown() is shown
            td.explain()
        said = "deprecates Pallas's Triton" in capsys.readouterr().err
        assert said == (shown and td.deprecated_here())
    td.explain.cache_clear()


def test_triton_deprecation_is_one_line_not_a_warning_per_kernel(capsys):
    """jax >= 0.11 warns at every Triton kernel's lowering (three per fwd+bwd); the lab's
    filter (set on import) silences exactly that warning and the lab prints one line instead,
    once per process. On jax 0.10 there is nothing to explain."""
    import functools
    import warnings

    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from lab import plans
    from lab.kernels import triton_deprecation as td
    from lab.kernels.attention import pallas_gpu

    devices = plans.topology_devices("gpu:h100:1")
    mesh = jax.sharding.Mesh(devices, ("data",))
    sh = NamedSharding(mesh, P())
    q = jax.ShapeDtypeStruct((1, 128, 4, 64), "bfloat16", sharding=sh)
    kv = jax.ShapeDtypeStruct((1, 128, 2, 64), "bfloat16", sharding=sh)

    def lower(causal):  # fwd + bwd: the fwd, dq and dkv Triton kernels
        attn = functools.partial(pallas_gpu.flash_attention_gpu, causal=causal)
        grads = jax.grad(lambda *a: attn(*a).astype("float32").sum(), argnums=(0, 1, 2))
        with jax.sharding.set_mesh(mesh):
            jax.jit(grads).lower(q, kv, kv)

    td.explain.cache_clear()  # a process's first Triton kernel, whatever ran before
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning shown, as pytest and -W default do
        lower(causal=True)  # without the lab's filter: jax's own warnings
        jax_warned = sum(td.JAX_TEXT in str(w.message) for w in caught)
        td.silence()  # the filter the lab sets on import
        lower(causal=False)
        silenced = sum(td.JAX_TEXT in str(w.message) for w in caught) - jax_warned
    notes = [x for x in capsys.readouterr().err.splitlines() if "deprecates Pallas's Triton" in x]
    if td.deprecated_here():
        assert jax_warned >= 3 and silenced == 0, (jax_warned, silenced)
        assert len(notes) == 1 and notes[0].startswith(f"note: jax {jax.__version__}")
    else:
        assert jax_warned == 0 and notes == []


@needs_plugin
@pytest.mark.parametrize(
    "gpu, kind",
    [
        ("h200", "NVIDIA H200 141GB HBM3e"),
        pytest.param("a100", "NVIDIA A100-SXM4-80GB", marks=pytest.mark.slow_plan),
    ],
)
def test_the_other_shipped_gpus_compile_a_step(tmp_path, capsys, gpu, kind):
    """H200 (sm_90a, 141 GB) and A100 (sm_80: no Hopper kernel, the Triton one) from their
    target descriptions: the tiny step compiles and is judged against each card's own HBM.
    The plan names the toolchain that compiled its kernels: in the kernels' section of
    summary.json, in the environment every run records, and in the kernel table's caption."""
    from lab.measure import toolchain

    argv = [f"target=gpu:{gpu}:1", "model=tiny", f"out_dir={tmp_path}", "name=plan"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "compiled, not run" in out
    s = json.loads((tmp_path / "plan" / "summary.json").read_text())
    assert s["device_kind"] == kind and s["aot"]["fit"].startswith("fits")
    assert s["aot"]["kernels"] and all(k["registers"] > 0 for k in s["aot"]["kernels"])
    tc = toolchain.probe().record()
    assert f"compiled by ptxas {tc['ptxas_version']}" in out
    assert s["aot"]["toolchain"] == tc
    assert s["environment"]["ptxas_version"] == tc["ptxas_version"]


@needs_plugin
@pytest.mark.slow_plan
def test_attention_plan_compiles_a_grid_for_h100(tmp_path, capsys):
    """`lab.tools.attention_plan target=gpu:h100 seq=256,300 head_dim=64`: every point of the
    grid compiled (fwd and fwd+bwd), one kernel table naming each point's kernels, records per
    point with its L and K."""
    from lab.tools import attention_plan

    argv = ["target=gpu:h100", "seq=256,300", "head_dim=64", "batch=1", "heads=2"]
    argv += ["kv_heads=1", "data=1", f"out_dir={tmp_path}"]
    assert attention_plan.main(argv) == 0
    out = capsys.readouterr().out
    assert "L=256 K=64" in out and "L=300 K=64" in out and "compiled, not run" in out
    recs = [json.loads(x) for x in next(tmp_path.glob("attention-plan-*.jsonl")).open()]
    seen = {(r["config"]["seq"], r["config"]["mode"]) for r in recs}
    assert seen == {(s, m) for s in (256, 300) for m in ("fwd", "fwd+bwd")}
    regs = [r for r in recs if r["what"] == "attention plan kernel registers"]
    assert regs and all(r["value"] > 0 and "smem" in r["config"]["kernel"] for r in regs)
    assert all(r["config"]["toolchain"] for r in regs)  # the compiler the figures are from


@needs_plugin
@pytest.mark.slow_plan
def test_masked_triton_kernels_compile_for_h100_without_spills():
    """pallas_gpu with a Mask (causal window, segment ids, key lengths: the block map and the
    arrays as kernel inputs, a cond per visited tile), forward and backward for sm_90a: three
    kernels, no spill."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from lab import plans
    from lab.kernels.attention import pallas_gpu
    from lab.kernels.attention.common import Mask

    devices = plans.topology_devices("gpu:h100:1")
    mesh = jax.sharding.Mesh(devices, ("data",))
    sh = NamedSharding(mesh, P())
    B, L, H, K = 2, 512, 4, 128
    q = jax.ShapeDtypeStruct((B, L, H, K), "bfloat16", sharding=sh)
    kv = jax.ShapeDtypeStruct((B, L, 2, K), "bfloat16", sharding=sh)
    seg = jax.ShapeDtypeStruct((B, L), jnp.int32, sharding=sh)

    def loss(q, k, v, seg):
        mask = Mask.make(
            causal=True,
            window=(127, 0),
            q_segment_ids=seg,
            kv_segment_ids=seg,
            kv_lengths=seg[:, 0],
        )
        o = pallas_gpu.flash_attention_gpu(q, k, v, causal=True, mask=mask)
        return o.astype(jnp.float32).sum()

    def lower():
        with jax.sharding.set_mesh(mesh):
            return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg)

    _, kernels = plans.compile_plan(lower, devices)
    flash = [k for k in kernels if k.name.startswith("flash_attention")]
    assert len(flash) == 3 and not any(k.spill_bytes for k in flash), flash


@needs_plugin
@pytest.mark.slow_plan
def test_plan_flops_fall_with_a_window_and_packed_documents_on_h100():
    """The H100 plan at S = 8,192: a window of 1,024 and 8 packed documents of 1,024 give at
    least 3x fewer FLOPs than causal. Every call runs the kernel the dispatch picks for an
    H100 (Mosaic GPU, which takes every mask): its cost estimate reaches the compiled count
    from jax 0.11 (the HLO walk reads it); where a lowering drops it (0.10; Triton) the FLOPs
    are the block map's count, labelled as such, never a silent 0. Packed documents' compiled
    count is only the causal band's (the ids are data when traced): their figure is the
    block map of the ids, labelled."""
    from lab.studies import plan

    rows = plan.grid(
        "gpu:h100", seqs=(8192,), head_dims=(128,), masks=plan.masks_of(True, (1024,), (1024,)),
        batch=1, heads=2, kv_heads=1, dtype="bfloat16", causal=True, data=1,
    )  # fmt: skip
    by = {(r.mask, r.mode): r for r in rows}
    for mode in ("fwd", "fwd+bwd"):
        causal, window, docs = (by[m, mode] for m in ("causal", "window 1,024", "docs of 1,024"))
        for r in (causal, window, docs):
            assert r.flops and r.kernel_flops, r
            if not r.estimate_compiled:  # never a silent 0: the block map's count, labelled
                assert r.flops == r.kernel_flops and "drops the cost estimate" in r.flops_source
        assert causal.flops / window.flops >= 3.0
        assert causal.flops / docs.flops >= 3.0


@needs_plugin
def test_a_batch_1_decode_product_compiles_to_a_gemm_not_a_product_in_memory():
    """XLA:GPU strength-reduces a one-row product to a multiply that writes the whole C × N
    product to memory before a reduction; decoding on GPU pads it to two rows (quant.Matmuls
    .min_rows), which compiles to a GEMM that reads the weight once."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from lab import plans, quant

    devices = plans.topology_devices("gpu:h100:1")
    sh = NamedSharding(jax.sharding.Mesh(devices, ("data",)), P())
    x = jax.ShapeDtypeStruct((1, 1, 4096), jnp.bfloat16, sharding=sh)
    w = jax.ShapeDtypeStruct((4096, 1376), jnp.bfloat16, sharding=sh)

    def product_in_memory(min_rows: int) -> bool:
        def f(x, w):
            with quant.using(quant.Matmuls(min_rows=min_rows)):
                return quant.matmul("btd,df->btf", x, w, jnp.bfloat16)

        text = jax.jit(f).lower(x, w).compile().as_text()
        lines = text.splitlines()
        return any("[4096,1376]" in x and "multiply" in x and "fusion(" in x for x in lines)

    assert product_in_memory(1)  # what XLA does alone: if this fails, the padding may go
    assert not product_in_memory(2)


def _plan_memory(tmp_path, capsys, target: str, *keys: str) -> tuple[dict, float]:
    """(the calculator's parts, the compiled total) of the small model's step planned for
    `target` on one device, with `keys`."""
    if target.startswith("tpu"):
        pytest.importorskip("libtpu", reason="libtpu not installed: pip install -e '.[tpu]'")
    argv = [f"target={target}", "mesh=1", "model=small", *keys]
    assert main([*argv, f"out_dir={tmp_path}", "name=plan"]) == 0
    capsys.readouterr()
    s = json.loads((tmp_path / "plan" / "summary.json").read_text())
    return s["predicted_memory_per_device"], s["compiled_memory_per_device"]["total_bytes"]


@needs_plugin
@pytest.mark.slow_plan
@pytest.mark.parametrize("target", ["gpu:h100", "tpu:v5e:1x1"])
def test_the_calculator_holds_naive_attention_against_the_accelerator_compilers(
    tmp_path, capsys, target
):
    """Naive attention's L×S softmax, most of this step's memory: XLA:GPU keeps two float32
    score buffers a block and XLA:TPU one (`naive_score_bytes`), where XLA:CPU keeps three and
    a cast. The calculator's total against each compiler's memory analysis of the whole step,
    within 25% (it was 2–3× over when it predicted every backend as the CPU)."""
    pred, compiled = _plan_memory(
        tmp_path, capsys, target, "n_layers=2", "batch_size=8", "seq_len=1024", "attention=naive"
    )
    assert pred["activations"] > compiled / 2  # the scores dominate: the term is what is tested
    assert abs(pred["total"] / compiled - 1) < 0.25, (pred, compiled)


@needs_plugin
@pytest.mark.slow_plan
@pytest.mark.parametrize("target", ["gpu:h100", "tpu:v5e:1x1"])
def test_the_calculator_holds_scanned_layers_against_the_accelerator_compilers(
    tmp_path, capsys, target
):
    """Scanned layers keep every residual their jaxpr names (lab.model.layer_census), which
    the unrolled formula misses: it read 0.62× of this H100 step. XLA:GPU holds one layer
    more for the backward, XLA:TPU does not."""
    keys = ("d_model=512", "n_heads=4", "n_kv_heads=4", "n_layers=4", "batch_size=8")
    pred, compiled = _plan_memory(
        tmp_path, capsys, target, *keys, "seq_len=512", "scan_layers=true"
    )
    assert abs(pred["total"] / compiled - 1) < 0.1, (pred, compiled)


@pytest.mark.once
@needs_plugin
def test_a_plan_that_does_not_fit_labels_its_throughput_as_unrunnable(
    tmp_path, capsys, monkeypatch
):
    """A step the target cannot hold keeps its predicted time, tokens/s and MFU (what it would
    do with the memory it needs), each labelled as a step that cannot run there as configured:
    in the table, summary.json and records.jsonl. The tiny step judged against a millionth of
    an H100 (XLA_PYTHON_CLIENT_MEM_FRACTION) does not fit."""
    from lab.measure.records import read_records
    from lab.measure.run import CANNOT_RUN

    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.000001")
    argv = ["target=gpu:h100:1", "model=tiny", f"out_dir={tmp_path}", "name=plan"]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())  # the table's wrapped cells, one line
    assert "does NOT fit" in out
    for row in ("predicted tokens/s", "implied MFU"):
        after = out.split(f"│ {row}")[1].split("│ label")[0]
        assert " ".join(CANNOT_RUN.split()[:4]) in after, (row, after)
    s = json.loads((tmp_path / "plan" / "summary.json").read_text())
    assert s["aot"]["fit"].startswith("does NOT fit") and s["aot"]["caveat"] == CANNOT_RUN
    assert s["aot"]["implied_mfu"] > 0  # kept, labelled
    recs = {r["what"]: r for r in read_records(tmp_path / "plan" / "records.jsonl")}
    for what in ("training step time", "training tokens/s", "training MFU"):
        assert recs[what]["config"]["caveat"] == CANNOT_RUN, what


def test_a_gpu_plan_fits_the_share_of_memory_jax_allocates(monkeypatch):
    """JAX's allocator takes 75% of the total memory a GPU reports (84.9e9 bytes for an H100's
    "80 GB", not the datasheet's 80e9) unless XLA_CLIENT_MEM_FRACTION or its older name
    XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise: a plan judges its fit against what a run
    there could allocate. A TPU's HBM is its own."""
    import types

    from lab import summary
    from lab.measure import specs

    h100 = gpus.GPUS["h100"].memory_reported
    assert h100 > specs.lookup("NVIDIA H100 80GB HBM3").memory_bytes
    info = types.SimpleNamespace(aot=True, backend="gpu", device_kind="NVIDIA H100 80GB HBM3")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    assert summary.capacity_bytes(info) == pytest.approx(0.75 * h100)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert summary.capacity_bytes(info) == pytest.approx(0.9 * h100)
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.5")  # the newer name wins
    assert summary.capacity_bytes(info) == pytest.approx(0.5 * h100)
    other = types.SimpleNamespace(aot=True, backend="gpu", device_kind="NVIDIA L4")
    if specs.lookup("NVIDIA L4"):  # a GPU the plans do not describe: the spec's figure
        assert summary.capacity_bytes(other) == pytest.approx(
            0.5 * specs.lookup("NVIDIA L4").memory_bytes
        )
    tpu = types.SimpleNamespace(aot=True, backend="tpu", device_kind="TPU v5 lite")
    assert summary.capacity_bytes(tpu) == specs.lookup("TPU v5 lite").memory_bytes


def test_the_sass_scratch_mosaic_leaves_is_removed_and_nothing_else(tmp_path):
    """Mosaic's SASS dump (on whenever MOSAIC_GPU_DUMP_TO is set) leaves a mosaic-gpu-XXXXXX
    folder holding kernel.bin per kernel: those that appear during the compile go; a folder
    there before, or one holding anything else, stays."""
    from lab.plans import resources

    old = tmp_path / "mosaic-gpu-old000"
    old.mkdir()
    (old / "kernel.bin").write_bytes(b"\0")
    with resources._sass_scratch_removed(str(tmp_path)):
        for name in ("mosaic-gpu-aaaaaa", "mosaic-gpu-bbbbbb"):
            (tmp_path / name).mkdir()
            (tmp_path / name / "kernel.bin").write_bytes(b"\0")
        (tmp_path / "mosaic-gpu-cccccc").mkdir()
        (tmp_path / "mosaic-gpu-cccccc" / "notes.txt").write_text("a user's")
        (tmp_path / "other").mkdir()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["mosaic-gpu-cccccc", "mosaic-gpu-old000", "other"], left


def _lowered_module(grid: tuple, threads: int, smem: int) -> str:
    """The module Mosaic dumps before layout inference, reduced to its launch."""
    consts = sorted({*grid, threads, 1})
    lines = [f"    %c{c} = arith.constant {c} : index" for c in consts]
    lines.append(f"    %c{smem}_i32 = arith.constant {smem} : i32")
    g = ", ".join(f"%a{i} = %c{x}" for i, x in enumerate(grid))
    lines.append(
        f"    %t = gpu.launch async [%0] blocks(%b0, %b1, %b2) in ({g}) threads(%t0, %t1, %t2)"
        f" in (%a3 = %c{threads}, %a4 = %c1, %a5 = %c1) dynamic_shared_memory_size"
        f" %c{smem}_i32 {{"
    )
    return "module {\n" + "\n".join(lines) + "\n}\n"


def _printed_kernel(name: str, registers: int, spills: int, threads: int = 384) -> str:
    """One Mosaic kernel as Mosaic prints it with MOSAIC_GPU_DUMP_PTX and _PTXAS and no dump
    folder: the PTX, then ptxas's log on it."""
    entry = f"{name}_mosaic_gpu_kernel"
    return (
        "//\n// Generated by LLVM NVPTX Back-End\n//\n\n.version 9.0\n.target sm_90a\n"
        f".visible .entry {entry}(\n\t.param .u64 p0\n)\n.maxntid {threads}, 1, 1\n"
        "{\n\tret;\n}\n\n"
        f"ptxas info    : Compiling entry function '{entry}' for 'sm_90a'\n"
        f"ptxas info    : Function properties for {entry}\n"
        f"    0 bytes stack frame, {spills} bytes spill stores, {spills} bytes spill loads\n"
        f"ptxas info    : Used {registers} registers, used 16 barriers, 1 bytes smem\n\n"
    )


def test_mosaic_kernels_compiled_by_xla_are_read_from_what_mosaic_printed(tmp_path):
    """Newer JAX compiles Mosaic kernels in XLA's compile, where the lab turns on only the PTX
    and ptxas dumps (printed to stdout): each printed kernel gets its registers and spills from
    its own ptxas log, and its grid, threads and shared memory from the module its lowering
    dumped, matched by name; two kernels of one name take the launch whose threads their PTX
    has, and otherwise their launches in lowering order (the dump's count, 2 before 12). A
    module lowered again but not compiled again (Mosaic keeps what it compiled) is the kernel
    read the first time."""
    for name, launch in (
        ("fa_fwd_2", ((1, 8, 8), 384, 199760)),
        ("fa_fwd_12", ((2, 4, 16), 256, 100000)),
        ("fa_bwd_3", ((4, 1, 1), 128, 1000)),
        ("fa_bwd_21", ((8, 1, 1), 128, 2000)),
    ):
        (tmp_path / f"{name}.before_layout_inference.txt").write_text(_lowered_module(*launch))
    (tmp_path / "fa_fwd_2.resources.txt").write_text("Resources(smem_scratch_bytes=199680)")
    (tmp_path / "fa_dq_1.resources.txt").write_text("Resources(smem_scratch_bytes=149504, x=0)")
    printed = (
        "a line some other native code printed\n"
        + _printed_kernel("fa_fwd", 90, 0, threads=256)  # the 256-thread launch, not the first
        + _printed_kernel("fa_dq", 200, 24)
        + _printed_kernel("fa_fwd", 168, 0)
        + _printed_kernel("fa_bwd", 100, 0, threads=128)
        + _printed_kernel("fa_bwd", 101, 0, threads=128)
    )
    got = [
        (k.name, k.grid, k.threads, k.dynamic_smem, k.registers, k.spill_bytes)
        for k in resources.mosaic_kernels(str(tmp_path), "h100", printed)
    ]
    assert got == [
        ("fa_fwd_mosaic_gpu_kernel", (2, 4, 16), 256, 100000, 90, 0),
        # no module with a launch: threads from the PTX, shared memory from resources.txt
        ("fa_dq_mosaic_gpu_kernel", None, 384, 149504, 200, 48),
        ("fa_fwd_mosaic_gpu_kernel", (1, 8, 8), 384, 199760, 168, 0),
        ("fa_bwd_mosaic_gpu_kernel", (4, 1, 1), 128, 1000, 100, 0),  # count 3 before 21
        ("fa_bwd_mosaic_gpu_kernel", (8, 1, 1), 128, 2000, 101, 0),
    ]
    # Mosaic compiles a kernel once per process: lowered again and not printed, each module
    # is the kernel read before (one without its module dumped cannot be told apart)
    again = resources.mosaic_kernels(str(tmp_path), "h100", "")
    assert [(k.grid, k.registers) for k in again] == [
        ((1, 8, 8), 168),
        ((2, 4, 16), 90),
        ((4, 1, 1), 100),
        ((8, 1, 1), 101),
    ]
    assert resources.mosaic_kernels(str(tmp_path / "nothing"), "h100", "") == []
    assert resources.lowering_dumped(str(tmp_path))
    assert not resources.lowering_dumped(str(tmp_path / "nothing"))


def _mosaic_call(op_name: str, kernel_hash: str) -> str:
    """A Mosaic GPU custom call as XLA dumps it after optimizations (jaxlib before 0.11.1)."""
    return (
        f"  %mpmd_map.1 = (bf16[8,256,4,128]{{3,2,1,0}}) custom-call(%p0), "
        f'custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI, '
        f'metadata={{op_name="{op_name}" stack_frame_id=1}}, '
        f'backend_config={{kernel_hash = "{kernel_hash}", module = "ML\\EFR"}}\n'
    )


def test_a_mosaic_kernel_an_earlier_plan_compiled_is_read_by_its_kernel_hash(tmp_path, monkeypatch):
    """jaxlib before 0.11.1 dumps a Mosaic kernel only as it compiles it, once a process: a
    later program calling the same kernels (the kernel hashes of its custom calls; two of one
    name, as a local and a global layer's, together) lists the kernels read the first time.
    The name is the op_name's last part, out of the transforms' wrappers."""
    monkeypatch.setattr(resources, "_MOSAIC_BY_HASH", {})
    xla, dump = tmp_path / "xla", tmp_path / "mosaic"
    xla.mkdir()
    dump.mkdir()
    scope = "jit(train_step)/jvp(Transformer)/block_0/attn/jit(flash_attention_mgpu)"
    (xla / "module_0001.jit_train_step.sm_9.0a_gpu_after_optimizations.txt").write_text(
        "HloModule jit_train_step\n"
        + _mosaic_call(f"{scope}/fa_fwd/mpmd_map", "\\B8>\\06")
        + _mosaic_call(f"{scope}/fa_fwd/mpmd_map", "\\B8>\\06")  # the next layer's call
        + _mosaic_call(f"{scope}/fa_dq/mpmd_map", "\\01\\22q")  # a quote, escaped
        + _mosaic_call(f"{scope}/fa_dq/mpmd_map", "\\02\\\\q")  # a backslash, escaped
        + _mosaic_call("transpose(jvp(fa_dkv))/mpmd_map", "\\FE")
    )
    calls = resources.mosaic_calls(str(xla))
    assert {n: len(h) for n, h in calls.items()} == {"fa_fwd": 1, "fa_dq": 2, "fa_dkv": 1}
    for count, (name, registers) in enumerate((("fa_fwd", 90), ("fa_dq", 100), ("fa_dq", 101))):
        text = _printed_kernel(name, registers, 0)
        (dump / f"{name}_{count}.ptxas").write_text(text)
        (dump / f"{name}_{count}.ptx").write_text(text)
    (dump / "fa_dkv_3.ptxas").write_text(_printed_kernel("fa_dkv", 120, 0))
    (dump / "fa_dkv_3.ptx").write_text(_printed_kernel("fa_dkv", 120, 0))
    first = [(k.name, k.registers) for k in resources.mosaic_kernels(str(dump), "h100", "", calls)]
    assert sorted(first) == [
        ("fa_dkv_mosaic_gpu_kernel", 120),
        ("fa_dq_mosaic_gpu_kernel", 100),
        ("fa_dq_mosaic_gpu_kernel", 101),
        ("fa_fwd_mosaic_gpu_kernel", 90),
    ]
    (tmp_path / "nothing").mkdir()
    again = resources.mosaic_kernels(str(tmp_path / "nothing"), "h100", "", calls)
    assert sorted((k.name, k.registers) for k in again) == sorted(first)
    other = {"fa_fwd": ["\\00"]}  # a kernel no program of this process compiled
    assert resources.mosaic_kernels(str(tmp_path / "nothing"), "h100", "", other) == []
    # a kernel whose PTX was not dumped has no thread count: its occupancy is unknown, not 0/0
    assert resources.occupancy("h100", threads=0, registers=90, smem=0) == (
        0,
        "threads unknown",
        0.0,
    )


def test_native_stdout_is_read_and_python_output_still_reaches_the_terminal(tmp_path):
    """Mosaic's dumps go to file descriptor 1: during the compile that is read, while what
    Python prints (a progress bar, a line) still reaches the real stdout, as does what C stdio
    held from before the block. A failure in the block puts descriptor 1 and sys.stdout back."""
    script = tmp_path / "s.py"
    script.write_text(
        "import ctypes, os, sys\n"
        "from lab.plans import resources\n"
        "print('before', flush=True)\n"
        "libc = ctypes.CDLL(None)\n"
        "libc.printf(b'held by C stdio\\n')  # buffered: stdout is a pipe\n"
        "with resources._native_stdout() as text:\n"
        "    os.write(1, b'native dump\\n')\n"
        "    print('from python')\n"
        "print('after', repr(text[0]))\n"
        "try:\n"
        "    with resources._native_stdout() as text:\n"
        "        os.write(1, b'lost with the failure\\n')\n"
        "        raise RuntimeError('compile failed')\n"
        "except RuntimeError:\n"
        "    pass\n"
        "print('stdout is back', sys.stdout is sys.__stdout__, flush=True)\n"
        "os.write(1, b'fd 1 is back\\n')\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "before",
        "held by C stdio",
        "from python",
        "after 'native dump\\n'",
        "stdout is back True",
        "fd 1 is back",
    ], done.stdout

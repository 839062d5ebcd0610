"""The Mosaic GPU (Hopper) flash kernel, lab/kernels/attention/pallas_mgpu.py.

1. In JAX's GPU interpreter on CPU (jax >= 0.11; the 3.12 leg), against the float64 reference:
   forward output and dQ, dK, dV, with the race detector on. The interpreter runs each CTA's
   three warpgroups (two compute, one TMA producer) as concurrent threads and checks every
   shared-memory access against the barriers; a test plants a race to show it is looking.
   Axes: causal × GQA ratio (1, 2, 4) × dtype (bf16, f16) × head_dim (64, 128) at lengths that
   are multiples of no tile: 130 (with 64-row tiles and two compute warpgroups, two CTAs whose
   last query tile is pure padding, skipped; three key blocks, the last with 62 padded keys;
   unmasked whole blocks before the causal diagonal; for dK/dV a CTA whose second key tile is
   pure padding), and 40 queries against 200 keys (the bottom-right causal mask). The cases are
   a pairwise-covering set: every pair of two axes' levels appears at least once, in 6 of the
   24 combinations of the full product (each takes seconds in the interpreter). Dropped: the
   18 others, e.g. causal-r1-f16-K128, each of whose pairs runs in another case. One case also
   runs one compute warpgroup with three stages of 128-key tiles (one in the backward).
2. Compiled deviceless for sm_90a (both legs, needs the gpu-plan extra): forward and backward,
   zero spill bytes and shared memory within an H100 block's limit, read from Mosaic's own
   ptxas run and launch (lab/plans/resources.py). Two of the four (head_dim × dtype × causal)
   pairwise points run on both legs, the other two once (slow_plan), one of them as the
   training-step plan of 8 H100s (`lab.run target=gpu:h100:8 mesh=4x2 attention=pallas`).
   Masks and sinks: every mask feature with sinks through the dispatch, races checked (each
   mask kind alone: tests/test_pallas_features.py); one compile per feature set, no spill.
3. The model trains with attention=pallas_mgpu in the interpreter with blockwise's losses.
4. Dispatch: on Hopper (a real device kind or a target's) `pallas` and `auto` pick it where it
   takes the input; pallas_gpu elsewhere. The tuner's static pass drops a candidate that
   overflows shared memory. Bad input is one ValueError naming the constraint.
"""

import dataclasses
import functools
import itertools
import types
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab.kernels.attention import attention, choose, pallas_mgpu
from lab.kernels.attention.reference import attention_reference
from lab.plans import gpu as gpus

# max |kernel - f64 reference| / max |reference|, per input dtype. The kernels accumulate every
# product in f32; the error is the rounding of the 16-bit operands of the second matmuls (P for
# O and dV, dS for dQ and dK, P again inside dS for dK) and of the outputs, each at most half an
# ulp relative to the largest entry it touches: u = 2^-8 for bf16 (3.9e-3), 2^-11 for f16
# (4.9e-4). Three such roundings on one path bound it near 1.5u; measured over the full product
# in scratch (jax 0.12.0.1): bf16 up to 6.0e-3 (1.5u, a dQ), f16 up to 6.5e-4 (1.3u). The table
# allows about 5u, so a real bug (a wrong mask, a lost tile: errors of order 1) cannot hide.
TOL = {"bfloat16": 2e-2, "float16": 2.5e-3}
SEQ = 130
TILES = pallas_mgpu.BlockSizes(block_k=64)  # 64-row key tiles in the forward: 3 blocks at 130
H100 = gpus.GPUS["h100"]

needs_interpreter = pytest.mark.skipif(
    not pallas_mgpu.interpretable(),
    reason="jax < 0.11: the GPU interpreter has no rule for layout_cast or plgpu.load and "
    "cannot read a transposed smem ref as a wgmma operand",
)
needs_plugin = pytest.mark.skipif(
    gpus._pjrt() is None or gpus.ptxas() is None,
    reason="the CUDA plugin or ptxas is missing: pip install -e '.[gpu-plan]'",
)
# LLVM at -O0 for the interpreter's callback program: compiles faster, same arithmetic.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@dataclasses.dataclass(frozen=True)
class Case:
    causal: bool
    ratio: int  # query heads per kv head
    dtype: str
    head_dim: int
    L: int = SEQ
    S: int = SEQ
    block_sizes: pallas_mgpu.BlockSizes = TILES

    @property
    def heads(self) -> tuple[int, int]:
        """(H, G): two kv heads at ratio 2 (the h // R mapping over several kv heads), one at
        ratios 1 and 4. Ratio 1 runs one head: the interpreter's time goes per head, and its
        kv head is h // 1 by the same index code that r2's two kv heads check."""
        H = 1 if self.ratio == 1 else 4
        return H, H // self.ratio

    def __str__(self):
        mask = "causal" if self.causal else "full"
        tiles = "" if self.block_sizes == TILES else "-w1-3stages-bwd1stage"
        return f"{mask}-r{self.ratio}-{self.dtype}-L{self.L}-S{self.S}-K{self.head_dim}{tiles}"


# Pairwise covering: per ratio, two complementary (causal, dtype, head_dim) rows; across ratios
# every (causal, dtype), (causal, head_dim) and (dtype, head_dim) pair occurs. Two rows also
# carry a variant: queries shorter than keys (the bottom-right causal mask, 40 and 200: neither
# a tile multiple), and one compute warpgroup with three stages of 128-key tiles in the
# forward and one in the backward kernels (their own depth).
PAIRWISE = [
    Case(True, 1, "bfloat16", 64, L=40, S=200),
    Case(False, 1, "float16", 128),
    Case(True, 2, "float16", 128),
    Case(False, 2, "bfloat16", 64),
    Case(True, 4, "bfloat16", 128),
    Case(
        False,
        4,
        "float16",
        64,
        block_sizes=pallas_mgpu.BlockSizes(compute_wgs=1, max_stages=3, max_stages_bwd=1),
    ),  # fmt: skip
]


# The rest of the product causal × ratio × dtype × head_dim (18 cases of 4-9 s, length 130: not
# a tile multiple), beyond the pairwise cases CI runs: LAB_EXHAUSTIVE=1 runs them.
_COVERED = {(c.causal, c.ratio, c.dtype, c.head_dim) for c in PAIRWISE}
PRODUCT = [
    pytest.param(Case(*key), marks=pytest.mark.exhaustive)
    for key in itertools.product((True, False), (1, 2, 4), ("bfloat16", "float16"), (64, 128))
    if key not in _COVERED
]


def random_qkv(seed: int, L: int, S: int, H: int, G: int, K: int, dtype):
    """Fresh normal q, k, v and output cotangent (never zeros)."""
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = [(1, L, H, K), (1, S, G, K), (1, S, G, K), (1, L, H, K)]
    return [
        jax.random.normal(k, s, jnp.float32).astype(dtype)
        for k, s in zip(keys, shapes, strict=True)
    ]


def interpreted(q, k, v, do, *, causal: bool, block_sizes=TILES):
    """Output and q/k/v gradients through the dispatch in the GPU interpreter, races checked."""
    params = pallas_mgpu.interpret_params(detect_races=True)

    def both(q, k, v, do):
        fn = functools.partial(
            attention, causal=causal, impl="pallas_mgpu", block_sizes=block_sizes, interpret=params
        )
        o, vjp = jax.vjp(fn, q, k, v)
        return (o, *vjp(do))

    return jax.jit(both).lower(q, k, v, do).compile(compiler_options=FAST_COMPILE)(q, k, v, do)


@functools.partial(jax.jit, static_argnames="causal")
def _reference_jit(q, k, v, do, causal: bool):
    o, vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, causal=causal), q, k, v)
    return (o, *vjp(do))


def reference_f64(q, k, v, do, causal: bool):
    """The same quantities in float64 from the same (rounded) inputs."""
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, do)]
        return [np.asarray(x) for x in _reference_jit(*args, causal=causal)]


def max_errors(got, want) -> dict[str, float]:
    return {
        name: float(np.abs(np.asarray(g, np.float64) - w).max() / np.abs(w).max())
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True)
    }


def races_found() -> bool:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    return bool(interpret_pallas_call.get_races().races_found)


@pytest.fixture
def fresh_interpreter():
    """The interpreter keeps its race record (and, after an error, its state) per process."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    interpret_pallas_call.reset_gpu_interpret_mode_state()
    yield
    interpret_pallas_call.reset_gpu_interpret_mode_state()


# ---------------------------------------------------------------------------- interpreter


@needs_interpreter
@pytest.mark.parametrize("case", PAIRWISE + PRODUCT, ids=str)
def test_matches_float64_reference_without_races(case: Case, fresh_interpreter):
    seed = zlib.crc32(str(case).encode())  # fresh per case, reproducible
    q, k, v, do = random_qkv(seed, case.L, case.S, *case.heads, case.head_dim, case.dtype)
    got = interpreted(q, k, v, do, causal=case.causal, block_sizes=case.block_sizes)
    assert not races_found()
    for name, g in zip(("out", "dq", "dk", "dv"), got, strict=True):
        assert g.dtype == jnp.dtype(case.dtype), (name, g.dtype)
        assert g.shape == (q if name in ("out", "dq") else k).shape, (name, g.shape)
    errors = max_errors(got, reference_f64(q, k, v, do, case.causal))
    assert max(errors.values()) < TOL[case.dtype], errors


@needs_interpreter
def test_the_race_detector_sees_this_kernel(fresh_interpreter):
    """Drop the fence between the forward's output stores and its TMA store to global memory:
    the interpreter must report the race (so 'no race' above means something)."""
    source = Path(pallas_mgpu.__file__).read_text()
    fence = (
        "            plgpu.commit_smem()\n"
        "            plgpu.copy_smem_to_gmem(o_tile, o_ref.at[b, rows, h])\n"
    )
    assert source.count(fence) == 1
    mutant = types.ModuleType("pallas_mgpu_mutant")
    mutant.__file__ = pallas_mgpu.__file__  # its tuned/ folder
    code = source.replace(fence, fence.split("\n", 1)[1])
    exec(compile(code, "pallas_mgpu_mutant.py", "exec"), mutant.__dict__)
    q, k, v, _ = random_qkv(3, 64, 64, 2, 1, 64, "bfloat16")
    params = mutant.interpret_params(detect_races=True, on_race="warn")
    out = mutant.flash_attention_mgpu(q, k, v, causal=False, interpret=params)
    jax.block_until_ready(out)
    assert races_found()


@needs_interpreter
def test_masks_and_sinks_through_the_dispatch_without_races(fresh_interpreter):
    """Every mask feature at once with sinks, through `attention` in the GPU interpreter with
    the race detector on (the segment ids ride the TMA barriers of Q and K): packed
    documents, per-sequence lengths, a window open on both sides, causal, GQA, two
    sequences; output and the four gradients against float64. Two query heads on one kv head
    (GQA): the interpreter's time goes per head, and the h // R map over several kv heads is
    the same index code as the unmasked r2 case's (test_matches_float64_reference_...)."""
    B, L, H, G, K = 2, 150, 2, 1, 64
    keys = jax.random.split(jax.random.key(11), 5)
    q, k, v, do = (
        jax.random.normal(key, (B, L, n, K), jnp.float32).astype(jnp.bfloat16)
        for key, n in zip(keys, (H, G, G, H), strict=False)
    )
    sinks = jax.random.normal(keys[4], (H,)) * 2
    seg = jnp.asarray(np.array([[0] * 70 + [1] * 80, [3] * 20 + [4] * 130]))
    mask = dict(
        window=(40, 8), q_segment_ids=seg, q_lengths=jnp.array([150, 90]),
        kv_lengths=jnp.array([140, 150]),
    )  # fmt: skip
    params = pallas_mgpu.interpret_params(detect_races=True)

    def run(fn, q, k, v, sinks, do):
        o, vjp = jax.vjp(fn, q, k, v, sinks)
        return (o, *vjp(do))

    attn = functools.partial(attention, causal=True, impl="pallas_mgpu", interpret=params, **mask)
    fn = lambda q, k, v, s: attn(q, k, v, sinks=s)  # noqa: E731
    args = (q, k, v, sinks, do)
    got = jax.jit(functools.partial(run, fn)).lower(*args).compile(FAST_COMPILE)(*args)
    assert not races_found()
    with jax.enable_x64(True):
        f64 = [jnp.asarray(np.asarray(x, np.float64)) for x in args]
        ref = functools.partial(attention, causal=True, impl="naive", **mask)
        want = run(lambda q, k, v, s: ref(q, k, v, sinks=s), *f64)
    errors = {}
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want, strict=True):
        w = np.asarray(w)
        errors[name] = float(np.abs(np.asarray(g, np.float64) - w).max() / np.abs(w).max())
    assert max(errors.values()) < TOL["bfloat16"], errors


@needs_interpreter
def test_under_x64_the_interpreted_kernel_is_refused_in_one_line_not_left_to_stall():
    """With jax_enable_x64 on, JAX's GPU interpreter stalled on this kernel with segment ids
    and failed to lower it with one kv head: a clear error naming the way out instead; with
    x64 off around the call, the same call and its gradient run."""
    q = jax.random.normal(jax.random.key(5), (1, 48, 2, 64), jnp.float32).astype(jnp.bfloat16)
    k = q[:, :, :1]
    seg = jnp.asarray(np.repeat([[0, 1, 2, 3]], 12, axis=1))
    attn = functools.partial(attention, causal=True, impl="pallas_mgpu", interpret=True)
    with jax.enable_x64(True):
        with pytest.raises(ValueError, match=r"with jax.enable_x64\(False\)"):
            attn(q, k, k, q_segment_ids=seg)
        # a NumPy False is no interpreter: not this refusal (on CPU, no compiled kernel)
        with pytest.raises(ValueError) as e:
            attention(q, k, k, impl="pallas_mgpu", interpret=np.False_)
        assert "enable_x64" not in str(e.value)
        with jax.enable_x64(False):
            grad = jax.grad(lambda q: attn(q, k, k, q_segment_ids=seg).astype(float).sum())(q)
    assert grad.shape == q.shape and bool(jnp.isfinite(grad.astype(jnp.float32)).all())


def _train_losses(attention_impl: str, steps: int = 3) -> list[float]:
    """A tiny model (one layer, head_dim 64, 2 query heads per kv head, bf16), a few steps."""
    from few_steps import train_steps

    from lab.config import parse_args

    argv = ["model=tiny", "d_model=128", "n_heads=2", "n_kv_heads=1", "n_layers=1"]
    argv += ["dtype=bfloat16", "batch_size=2", "seq_len=70", "mesh=1"]
    losses, trainer, _ = train_steps(parse_args([*argv, f"attention={attention_impl}"]), steps)
    assert trainer.cfg.model.attention == attention_impl
    return losses


@needs_interpreter
def test_model_trains_with_it_in_the_interpreter_like_blockwise(monkeypatch):
    """attention=pallas_mgpu through the model and the dispatch, the kernels interpreted (a
    model never asks for the interpreter, so the test passes interpret=True in), follows
    blockwise's losses to bf16's tolerance over 3 steps of a 70-token (padded) sequence."""
    from lab import model, resolve
    from lab.kernels import attention as dispatch

    want = _train_losses("blockwise")
    calls = []
    real = pallas_mgpu.flash_attention_mgpu
    monkeypatch.setattr(
        pallas_mgpu, "flash_attention_mgpu", lambda *a, **kw: calls.append(kw) or real(*a, **kw)
    )
    monkeypatch.setattr(
        resolve, "choose_noted", functools.partial(dispatch.choose_noted, interpret=True)
    )

    def interpreted(*a, **kw):  # the Pallas kernels only: the config's checks trace the model too
        if kw.get("impl") in ("pallas", "pallas_mgpu", "pallas_gpu"):
            kw["interpret"] = True
        return dispatch.attention(*a, **kw)

    monkeypatch.setattr(model, "attention", interpreted)
    got = _train_losses("pallas_mgpu")
    assert calls and calls[0]["interpret"] is True
    np.testing.assert_allclose(got, want, rtol=TOL["bfloat16"])
    assert got[-1] < got[0]  # it trains


# ---------------------------------------------------------------------------- dispatch


@pytest.mark.parametrize(
    "impl, dtype, head_dim, kind, want",
    [
        ("pallas", "bfloat16", 64, "NVIDIA H100 80GB HBM3", "pallas_mgpu"),
        ("auto", "float16", 128, "NVIDIA H200 141GB HBM3e", "pallas_mgpu"),
        ("pallas", "float32", 64, "NVIDIA H100 80GB HBM3", "pallas_gpu"),  # wgmma: 16-bit
        ("pallas", "bfloat16", 32, "NVIDIA H100 80GB HBM3", "pallas_gpu"),  # head_dim 64/128
        ("pallas", "bfloat16", 64, "NVIDIA A100-SXM4-80GB", "pallas_gpu"),  # no TMA, no wgmma
        ("auto", "bfloat16", 64, "NVIDIA A100-SXM4-80GB", "pallas_gpu"),
    ],
)
def test_hopper_picks_the_mosaic_kernel_where_it_takes_the_input(
    monkeypatch, impl, dtype, head_dim, kind, want
):
    from lab.kernels import attention as dispatch

    monkeypatch.setattr(dispatch, "device_kind", lambda: kind)
    monkeypatch.setattr(dispatch, "_cudnn_here", lambda: False)  # a plan without cuDNN
    q = jax.ShapeDtypeStruct((1, 130, 4, head_dim), jnp.dtype(dtype))
    kv = jax.ShapeDtypeStruct((1, 130, 2, head_dim), jnp.dtype(dtype))
    assert choose(impl, q, kv, kv, causal=True, backend="gpu") == want
    assert ("pallas_mgpu" in dispatch.available_impls("gpu")) == ("H100" in kind or "H200" in kind)


def test_without_mosaic_gpu_hopper_keeps_the_triton_kernel(monkeypatch):
    from lab.kernels import attention as dispatch

    monkeypatch.setattr(dispatch, "device_kind", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(pallas_mgpu, "usable", lambda: False)
    q = jax.ShapeDtypeStruct((1, 64, 4, 64), jnp.bfloat16)
    assert choose("pallas", q, q, q, causal=True, backend="gpu") == "pallas_gpu"
    with pytest.raises(ValueError, match="pallas_mgpu needs a Hopper GPU"):
        choose("pallas_mgpu", q, q, q, causal=True, backend="gpu")


def test_on_cpu_it_runs_only_interpreted_and_only_from_jax_0_11():
    q = jax.ShapeDtypeStruct((1, 64, 4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="impl='pallas_mgpu' has no compiled kernel on backend"):
        choose("pallas_mgpu", q, q, q, causal=True, backend="cpu")
    if pallas_mgpu.interpretable():
        assert choose("pallas_mgpu", q, q, q, causal=True, interpret=True) == "pallas_mgpu"
    else:
        with pytest.raises(ValueError, match="interpreted on CPU only from jax 0.11"):
            choose("pallas_mgpu", q, q, q, causal=True, interpret=True, backend="cpu")


def _qkv(H=4, G=2, K=64, L=32, S=32, dtype="bfloat16"):
    return random_qkv(0, L, S, H, G, K, dtype)[:3]


@pytest.mark.parametrize(
    "args, causal, needle",
    [
        (_qkv(dtype="float32"), True, "pallas_mgpu' supports dtypes bfloat16, float16"),
        (_qkv(K=96), True, "pallas_mgpu supports q/k head_dim in (64, 128"),
        (_qkv(H=3, G=2), True, "query heads must be a multiple of kv heads"),
    ],
)
def test_bad_input_names_the_constraint(args, causal, needle):
    with pytest.raises(ValueError, match="shape=|dtype=|head_dim ") as info:
        pallas_mgpu.flash_attention_mgpu(*args, causal=causal)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"block_q": 32}, "block_q=32: must be a multiple of 64"),
        ({"block_k": 96}, "block_k=96: must be a multiple of 64"),
        ({"block_k_dq": 320}, "block_k_dq=320: must be a multiple of 64 and <= 256"),
        ({"compute_wgs": 3}, "compute_wgs=3: must be 1 or 2"),
        ({"max_stages": 0}, "max_stages=0: must be an int in 1..4"),
        ({"max_stages_bwd": 5}, "max_stages_bwd=5: must be an int in 1..4"),
    ],
)
def test_block_sizes_validate_themselves(kwargs, needle):
    with pytest.raises(ValueError) as info:
        pallas_mgpu.BlockSizes(**kwargs)
    assert needle in str(info.value)


def test_targets_judge_both_lab_kernels():
    """With pallas_mgpu in the run (Hopper), each lab kernel gets its own verdict per point."""
    from lab.measure.attention import Measured
    from lab.measure.timing import BenchResult
    from lab.studies import attention as bench
    from lab.studies import targets

    shape = bench.Shape(batch=2, heads=32, kv_heads=32, head_dim=128, dtype="bfloat16")
    recs = []
    for impl, t in {"pallas_mgpu": 0.9, "pallas_gpu": 1.2, "cudnn": 1.0, "xla": 3.0}.items():
        bench_t = BenchResult(t, t, t, 5, 1.0)
        row = Measured(impl, 1.0, None, None, bench_t, inner=1, max_error=1e-3)
        recs += bench._records(row, shape, 4096, True, "fwd", "cudnn")
    mgpu, triton = targets.judge(recs, 128)
    assert (mgpu.kernel, triton.kernel) == ("pallas_mgpu", "pallas_gpu")
    assert mgpu.speed == pytest.approx(1 / 0.9) and triton.speed == pytest.approx(1 / 1.2)


def test_tokamax_peer_matches_the_reference_where_installed():
    """The bench's tokamax peer (tokamax.dot_product_attention, its own kernel choice: XLA on
    this CPU) on every backend where tokamax is installed: same answers as float64, timed."""
    pytest.importorskip("tokamax", reason="tokamax not installed: pip install -e '.[peers]'")
    from lab.studies import attention as bench

    assert "tokamax" in bench.default_impls()
    shape = bench.Shape(1, 4, 2, 32)
    records = bench.sweep(
        (96,), causal=(True,), impls=("xla", "tokamax"), shape=shape, budget_s=0.01
    )
    rows = {(r.impl, r.mode): r for r in bench.rows_of(records)}
    assert len(rows) == 4
    for key, r in rows.items():
        assert r.max_error < 1e-5 and r.time_s > 0, key


# ---------------------------------------------------------------------------- sm_90a compile


def _h100_kernels(fn, *shapes):
    """The Mosaic kernels of jit(fn) compiled for an abstract H100 (lab/plans), by kernel."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from lab import plans

    devices = plans.topology_devices("gpu:h100:1")
    mesh = jax.sharding.Mesh(devices, ("data",))
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P())) for s, d in shapes]

    def lower():
        with jax.sharding.set_mesh(mesh):
            return jax.jit(fn).lower(*args)

    _, kernels = plans.compile_plan(lower, devices)
    return {k.name.removesuffix("_mosaic_gpu_kernel"): k for k in kernels if "mgpu" in k.name}


def _assert_fits_h100(kernels: dict, names=("fwd", "dq", "dkv"), warpgroups: int = 2) -> None:
    """Each kernel: no spill byte, no stack, `warpgroups` compute warpgroups and a producer,
    shared memory within the opt-in limit of one H100 block, registers within 255, one
    resident CTA per SM."""
    assert set(kernels) == {f"flash_attention_mgpu_{k}" for k in names}, sorted(kernels)
    for name, k in kernels.items():
        assert k.spill_bytes == 0 and k.stack_bytes == 0, (name, k)
        assert k.threads == (warpgroups + 1) * 128, (name, k)
        assert 0 < k.smem <= H100.smem_per_block, (name, k)
        assert 0 < k.registers <= 255 and k.blocks_per_sm >= 1, (name, k)


COMPILE_CASES = [
    pytest.param(128, "bfloat16", True, 2, id="K128-bf16-causal-gqa4"),
    pytest.param(64, "float16", False, 2, id="K64-f16-full-gqa4"),
    # one kv head per query head (MHA, as Llama-2 7B): at head_dim 128 the dK/dV kernel
    # spilled 12 B on jax 0.12 until its per-warpgroup tiles were indexed inside the loop
    pytest.param(128, "bfloat16", False, 8, id="K128-bf16-full-mha"),
    pytest.param(128, "bfloat16", True, 8, id="K128-bf16-causal-mha"),
    pytest.param(64, "bfloat16", True, 8, id="K64-bf16-causal-mha"),
    pytest.param(64, "bfloat16", False, 8, id="K64-bf16-full-mha"),
    pytest.param(128, "float16", False, 2, id="K128-f16-full-gqa4", marks=pytest.mark.slow_plan),
]


@needs_plugin
@pytest.mark.parametrize("head_dim, dtype, causal, kv_heads", COMPILE_CASES)
def test_forward_and_backward_compile_for_h100_without_spills(head_dim, dtype, causal, kv_heads):
    """jit(grad) through the dispatch (`impl=pallas` under an H100's mesh is this kernel),
    compiled with no GPU: the forward, dQ and dK/dV kernels as ptxas and the launch report
    them. Length 1000 (not a tile multiple), 8 query heads over 2 kv heads (GQA) or 8 (MHA)."""
    attn = functools.partial(attention, causal=causal, impl="pallas")
    grad = jax.grad(lambda *a: attn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    L, H, G = 1000, 8, kv_heads
    q, kv = ((1, L, H, head_dim), dtype), ((1, L, G, head_dim), dtype)
    _assert_fits_h100(_h100_kernels(grad, q, kv, kv))


@needs_plugin
def test_a_second_plan_of_the_same_program_reads_the_same_launches():
    """Mosaic compiles a kernel once a process, and jax reuses a lowering made earlier in it:
    a second plan of the same program must read the same grid, threads and shared memory as
    the first, not none (newer JAX dumps each kernel's launch as it lowers, jaxlib before
    0.11.1 only as it compiles the kernel)."""
    attn = functools.partial(attention, causal=True, impl="pallas")
    q = ((1, 256, 2, 64), "bfloat16")
    first = _h100_kernels(attn, q, q, q)
    second = _h100_kernels(attn, q, q, q)
    assert set(first) == {"flash_attention_mgpu_fwd"}, sorted(first)
    k = first["flash_attention_mgpu_fwd"]
    assert k.grid and k.dynamic_smem > 0 and k.threads == 3 * 128, k
    assert second == first


# Soft-capping (a tanh and its 1 - t² in both backward kernels), a value head dim unlike the
# query/key one, and the log-sum-exp output with its cotangent, through the kernel's own entry.
OPTION_CASES = [
    pytest.param(128, 128, "bfloat16", True, 30.0, 8, id="K128-bf16-causal-mha-softcap"),
    pytest.param(
        64, 128, "float16", False, None, 2, id="K64-V128-f16-full-gqa4", marks=pytest.mark.slow_plan
    ),
    pytest.param(
        128,
        64,
        "bfloat16",
        True,
        30.0,
        2,
        id="K128-V64-bf16-causal-gqa4-softcap",
        marks=pytest.mark.slow_plan,
    ),
]


@needs_plugin
@pytest.mark.parametrize("head_dim, value_dim, dtype, causal, softcap, kv_heads", OPTION_CASES)
def test_options_compile_for_h100_without_spills(
    head_dim, value_dim, dtype, causal, softcap, kv_heads
):
    attn = functools.partial(
        pallas_mgpu.flash_attention_mgpu, causal=causal, softcap=softcap, return_lse=True
    )

    def loss(*args):
        o, lse = attn(*args)
        return o.astype(jnp.float32).sum() + lse.sum()

    grad = jax.grad(loss, argnums=(0, 1, 2))
    L, H, G = 1000, 8, kv_heads
    q, k = ((1, L, H, head_dim), dtype), ((1, L, G, head_dim), dtype)
    _assert_fits_h100(_h100_kernels(grad, q, k, ((1, L, G, value_dim), dtype)))


# Masks (common.Mask) and sinks through the dispatch: the block ranges read from global memory,
# the lengths as scalars, the segment ids by TMA beside Q and K. Head dim 128 (the tightest
# registers), MHA where the dK/dV kernel is tightest.
MASK_COMPILE_CASES = [
    pytest.param(("sinks", "empty_rows"), 2, id="sinks-causal-more-queries-gqa4"),
    pytest.param(("window", "lengths"), 8, id="window-lengths-mha"),
    # a window alone and segment ids alone: the forward spilled 16 B (its stream's first block
    # held across setmaxnreg; with lengths as well it happened not to)
    pytest.param(("window",), 8, id="window-mha"),
    pytest.param(("segments",), 8, id="segments-causal-mha"),
    # segment ids with a window: the forward's key tiles drop to 64 rows (plan_for)
    pytest.param(("segments", "window", "lengths"), 8, id="segments-window-lengths-mha"),
]


def _mask_arrays(features, B: int, H: int, L: int, S: int) -> dict:
    """The features' array arguments of `attention`, as (shape, dtype)."""
    out = {}
    if "lengths" in features:
        out |= {"q_lengths": ((B,), "int32"), "kv_lengths": ((B,), "int32")}
    if "segments" in features:
        out |= {"q_segment_ids": ((B, L), "int32"), "kv_segment_ids": ((B, S), "int32")}
    if "sinks" in features:
        out["sinks"] = ((H,), "float32")
    return out


@needs_plugin
@pytest.mark.parametrize("features, kv_heads", MASK_COMPILE_CASES)
def test_masks_and_sinks_compile_for_h100_without_spills(features, kv_heads):
    """Forward and backward through the dispatch, causal, head dim 128, bf16, the features'
    arrays inputs of the jitted gradient (per-sequence block maps; a window of 256 keys):
    no spill in any of the three kernels. 1000 keys (with empty rows: 1200 queries)."""
    B, H, K, S = 2, 8, 128, 1000
    L = S + 200 if "empty_rows" in features else S
    arrays = _mask_arrays(features, B, H, L, S)
    window = (255, 0) if "window" in features else None

    def loss(q, k, v, *xs):
        extra = dict(zip(arrays, xs, strict=True))
        o = attention(q, k, v, causal=True, impl="pallas", window=window, **extra)
        return o.astype(jnp.float32).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2))
    q, kv = ((B, L, H, K), "bfloat16"), ((B, S, kv_heads, K), "bfloat16")
    _assert_fits_h100(_h100_kernels(grad, q, kv, kv, *arrays.values()))


@needs_plugin
@pytest.mark.parametrize(
    "dtype, causal, softcap, value_dim",
    [
        ("bfloat16", True, None, 256),
        pytest.param("float16", False, 30.0, 64, marks=pytest.mark.slow_plan),
    ],
)
def test_head_dim_256_compiles_for_h100_without_spills(dtype, causal, softcap, value_dim):
    """Head dim 256 on its default tiles (one compute warpgroup): the forward and dQ kernels
    as launches of 128 output columns, dK and dV as one launch each where both are 256 wide;
    every launch spills nothing and fits shared memory (compiled for sm_90a, no GPU)."""
    attn = functools.partial(pallas_mgpu.flash_attention_mgpu, causal=causal, softcap=softcap)
    grad = jax.grad(lambda *a: attn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    L, H, G, K = 1000, 8, 2, 256
    q, k, v = ((1, L, H, K), dtype), ((1, L, G, K), dtype), ((1, L, G, value_dim), dtype)

    def names(kernel, width):
        parts = pallas_mgpu.column_parts(width)
        return [kernel if len(parts) == 1 else f"{kernel}_cols{c}" for c, _ in parts]

    launches = pallas_mgpu.dkv_launches(K, value_dim)
    want = names("fwd", value_dim) + names("dq", K)
    want += ["dkv"] if len(launches) == 1 else [p for (p,) in launches]
    _assert_fits_h100(_h100_kernels(grad, q, k, v), names=want, warpgroups=1)


@needs_plugin
@pytest.mark.slow_plan
def test_training_plan_on_h100_lists_the_mosaic_kernels(tmp_path, capsys):
    """`lab.run target=gpu:h100:8 mesh=4x2 attention=pallas` (head_dim 64, bf16 on a GPU,
    causal): the dispatch picks pallas_mgpu for the target and runs it per shard (shard_map:
    batch over data, heads over model); the plan's kernel table shows its three kernels with
    the compiler's figures (compiled, not run)."""
    import json

    from lab.run import main

    argv = ["target=gpu:h100:8", "mesh=4x2", "model=tiny", "d_model=256", "n_heads=4"]
    argv += ["n_kv_heads=2", "seq_len=256", "batch_size=8", "attention=pallas"]
    assert main([*argv, f"out_dir={tmp_path}", "name=p"]) == 0
    out = capsys.readouterr().out
    assert "attention=pallas_mgpu" in out and "flash_attention_mgpu_dkv" in out
    s = json.loads((tmp_path / "p" / "summary.json").read_text())
    assert s["devices"] == 8
    kernels = {
        k["name"].removesuffix("_mosaic_gpu_kernel"): types.SimpleNamespace(**k)
        for k in s["aot"]["kernels"]
        if "mgpu" in k["name"]
    }
    _assert_fits_h100(kernels)
    # Mosaic's launches are not in XLA's thunk sequence: not counted, and not written as 0
    assert all(k.launches is None for k in kernels.values()), kernels


@needs_plugin
def test_tuner_static_pass_judges_a_backward_depth_on_the_backward_kernels():
    """The backward stage's depth is the dQ and dK/dV kernels' own (`max_stages_bwd`): three
    slots of 64-row tiles fit them at head_dim 128 while the forward keeps its two slots of
    128-key tiles. With one count for all three kernels, the candidate made the forward take
    three slots too (265,328 B of shared memory > 232,448) and was dropped for the forward's
    sake, a kernel the backward stage does not tune."""
    from lab.studies import tune

    search = tune.Search(
        head_dim=128, seqs=(512,), causal=(True,), batch=1, heads=2, kv_heads=1,
        static="gpu:h100:1", kernel="pallas_mgpu",
    )  # fmt: skip
    base = tune.default_block_sizes("pallas_mgpu", 128)
    deeper = dataclasses.replace(base, **tune._mgpu_bwd(64, 3))
    assert (deeper.max_stages, deeper.bwd_stages) == (2, 3)
    static = tune.static_filter([deeper], search, "fwd+bwd")
    assert not static.dropped, static.dropped
    kernels = [r for r in static.records() if r["what"] == "tune kernel registers"]
    names = {r["config"]["kernel"] for r in kernels if "mgpu" in r["config"]["kernel"]}
    assert any("fwd" in n for n in names) and len(names) >= 3, names  # dQ and dK/dV compiled


@needs_plugin
def test_tuner_static_pass_drops_what_overflows_shared_memory():
    """The tuner's static pass on the Mosaic kernel (forward, head_dim 128, compiled for an
    H100): two stages of 128-key tiles fit, a third overflows the 227 KiB a block can have
    (Mosaic refuses it at compile time) and is dropped before anything is timed. (512 keys:
    the kernel never allocates more slots than key blocks.)"""
    from lab.studies import tune

    search = tune.Search(
        head_dim=128, seqs=(512,), causal=(True,), batch=1, heads=2, kv_heads=1,
        static="gpu:h100:1", kernel="pallas_mgpu",
    )  # fmt: skip
    base = tune.default_block_sizes("pallas_mgpu", 128)
    candidates = [base, dataclasses.replace(base, max_stages=3)]
    static = tune.static_filter(candidates, search, "fwd")
    dropped, records = static.dropped, static.records()
    assert list(dropped) == [1] and "exceeds available shared memory" in dropped[1], dropped
    (rejected,) = [r for r in records if r["what"] == "tune rejected"]
    assert rejected["value"] == dropped[1]  # the refused candidate is in the records too
    kernels = [r for r in records if r["what"] == "tune kernel registers"]
    (kept,) = [r for r in kernels if "mgpu" in r["config"]["kernel"]]
    assert kept["config"]["kernel"].startswith("flash_attention_mgpu_fwd")
    assert kept["config"]["spill_bytes"] == 0 and kept["label"] == "compiled, not run"

"""Each strategy's compiled step holds the expected collectives, on the expected mesh axes,
with bytes within 10% of the analytic figure; per-device weights shrink under fsdp and tp."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from lab.config import parse_args
from lab.measure.memory import MemorySplit
from lab.mesh import make_mesh
from lab.model import count_params
from lab.parallel import collectives_hlo, explain
from lab.train import make_trainer

BASE = ["model=tiny", "batch_size=8", "seq_len=32", "dtype=float32", "attention=naive"]


@functools.cache
def _explained(mesh: str, strategy: str, *extra: str):
    cfg = parse_args([*BASE, f"mesh={mesh}", f"strategy={strategy}", *extra])
    trainer = make_trainer(cfg, make_mesh(cfg.mesh))
    return trainer, explain.explain(trainer)


def _row(ex, role):
    return next(r for r in ex.rows if r.role == role)


def _kinds(row) -> set:
    return {(kind, axes) for kind, axes, _, _ in row.measured}


def test_dp_all_reduces_the_gradients_once():
    _, ex = _explained("8", "dp")
    grads = _row(ex, "grad reduction")
    assert _kinds(grads) == {("all-reduce", ("data",))} and grads.measured_ops == 1
    assert grads.ratio == pytest.approx(1.0, abs=0.1)
    assert {r.role for r in ex.rows} == {"grad reduction"}  # nothing else moves


def test_cp_attentions_key_value_traffic_is_not_gradient_reduction():
    """Under cp the keys' and values' gradients are summed back over the sequence's shards
    (blockwise) inside attention: their own row, not the weights' gradient reduction (they
    were counted there, 2.003 MiB against the weights' 1.253)."""
    keys = [a for a in BASE if not a.startswith("attention=")]
    cfg = parse_args([*keys, "mesh=2x4", "strategy=cp", "attention=blockwise"])
    ex = explain.explain(make_trainer(cfg, make_mesh(cfg.mesh)))
    kv = _row(ex, "context-parallel keys/values")
    # (the keys' and values' all-gathers too: named by JAX 0.10, unnamed by JAX 0.12)
    assert ("all-reduce", ("model",)) in _kinds(kv) and {a for _, a in _kinds(kv)} == {("model",)}
    grads = _row(ex, "grad reduction")
    assert grads.measured_ops == 2  # one over model, one over data: the weights' only
    # XLA reduces over the two axes in turn: the note says so, and its figure is the bytes
    # (2·V·(2-1)/2 + 2·V·(4-1)/4 against 2·V·(8-1)/8 for one reduction: 1.43×)
    e = grads.expected
    assert "in turn" in e.formula and grads.measured_bus_bytes == pytest.approx(e.high, rel=0.01)
    assert e.high / e.bus_bytes == pytest.approx((1 / 2 + 3 / 4) / (7 / 8), rel=0.01)
    # the analytic: K and V gathered forward and again backward, dK and dV all-reduced
    assert kv.expected is not None and kv.ratio == pytest.approx(1.0, abs=0.05), kv


KV = "context-parallel keys/values"


@pytest.mark.parametrize(
    "attention, remat",
    [("ring", "none"), ("ring", "full"), ("ring", "dots"), ("blockwise", "full")]
    + [("blockwise", "dots")],
)
def test_cp_ring_passes_keys_and_values_as_the_analytic_says(attention, remat):
    """attention=ring: K and V passed round the ring forward, their gradients back, (W-1)
    passes each per layer; under remat (no policy saves a permute) the forward's again; and
    without a ring, K and V gathered (a third time under remat) and dK, dV summed back. One
    case each: a compile apiece, spread over the workers, the oldest leg running the first."""
    keys = [a for a in BASE if not a.startswith("attention=")]
    extra = [f"attention={attention}", f"remat={remat}"]
    cfg = parse_args([*keys, "mesh=2x4", "strategy=cp", *extra])
    kv = _row(explain.explain(make_trainer(cfg, make_mesh(cfg.mesh))), KV)
    if attention == "ring":
        assert _kinds(kv) == {("collective-permute", ("model",))}, kv
    assert kv.ratio == pytest.approx(1.0, abs=0.05), (extra, kv)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_fsdp_gathers_weights_and_reduces_gradients(remat):
    _, ex = _explained("1x8x1", "fsdp", f"remat={remat}")
    gather = _row(ex, "param all-gather")
    assert _kinds(gather) == {("all-gather", ("fsdp",))}
    assert gather.ratio == pytest.approx(1.0, abs=0.1)
    if remat == "full":  # the backward re-gathers the rematerialised blocks' weights
        assert gather.measured_bus_bytes > 1.5 * gather.expected.low
    grads = _row(ex, "grad reduction")
    # CPU XLA has no reduce-scatter pass: the gradient reduce-scatter is an all-reduce + slice
    assert _kinds(grads) <= {("all-reduce", ("fsdp",)), ("reduce-scatter", ("fsdp",))}
    assert grads.ratio == pytest.approx(1.0, abs=0.1)


def test_tp_all_reduces_activations_over_model_and_gradients_over_data():
    _, ex = _explained("4x2", "tp")
    act = _row(ex, "activation all-reduce")
    assert _kinds(act) == {("all-reduce", ("model",))}
    assert act.ratio == pytest.approx(1.0, abs=0.1)
    grads = _row(ex, "grad reduction")
    assert _kinds(grads) == {("all-reduce", ("data",))}
    assert grads.ratio == pytest.approx(1.0, abs=0.1)


def test_fsdp_tp_uses_every_axis_for_its_own_role():
    _, ex = _explained("2x2x2", "fsdp+tp")
    assert _row(ex, "activation all-reduce").ratio == pytest.approx(1.0, abs=0.1)
    assert _row(ex, "grad reduction").ratio == pytest.approx(1.0, abs=0.1)
    gather = _row(ex, "param all-gather")
    assert _kinds(gather) == {("all-gather", ("fsdp",))}
    # XLA chooses per weight whether to keep the gathered copy for the backward: at least
    # the forward's gathers, at most the forward twice over
    assert 0.99 * gather.expected.low <= gather.measured_bus_bytes <= 2 * gather.expected.low
    assert all(r.role != "other" or r.measured_bus_bytes < 1024 for r in ex.rows)


def test_per_device_parameter_bytes_shrink_under_fsdp_and_tp():
    dp, ex_dp = _explained("8", "dp")
    fsdp, ex_fsdp = _explained("1x8x1", "fsdp", "remat=none")
    tp, ex_tp = _explained("4x2", "tp")
    total = 4 * count_params(dp.abstract_state.params)
    norms = 4 * 64 * 5  # RMSNorm scales stay replicated
    assert ex_dp.memory.params == total
    assert ex_fsdp.memory.params == (total - norms) / 8 + norms
    assert ex_tp.memory.params == (total - norms) / 2 + norms
    # the compiler agrees: its argument buffers (params + Adam moments) shrink the same way
    arg = lambda ex: ex.memory.compiled["argument_bytes"]
    assert arg(ex_fsdp) < arg(ex_dp) / 6 and arg(ex_tp) < arg(ex_dp) / 1.8


def test_explain_table_renders():
    from rich.console import Console

    from lab.report import tables

    _, ex = _explained("4x2", "tp")
    console = Console(record=True, width=160)
    console.print(tables.explain_memory(ex.memory))
    console.print(tables.explain_collectives(ex))
    text = console.export_text()
    assert "activation all-reduce" in text and "all-reduce @ model" in text
    assert ex.as_dict()["collectives"][0]["expected"]["kind"]
    assert "temporaries" in text and "from shardings (exact)" in text
    assert MemorySplit.from_record(json.loads(json.dumps(ex.as_dict()["memory"]))) == ex.memory


def test_hlo_reader_on_hand_written_collectives():
    mesh = make_mesh("2x2x2")
    n = 16 * 8 * 4  # f32[16, 8] per device

    def f(x):
        a = jax.lax.psum(x, "fsdp")
        b = jax.lax.all_gather(x, "model", tiled=True)
        c = jax.lax.psum_scatter(x, ("data", "model"), tiled=True)
        d = jax.lax.all_to_all(x, "data", 0, 0, tiled=True)
        e = jax.lax.ppermute(x, "model", [(0, 1), (1, 0)])
        return a.sum() + b.sum() + c.sum() + d.sum() + e.sum()

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    got = collectives_hlo.from_compiled(g.lower(jnp.ones((16, 8))).compile(), mesh)
    by_kind = {c.kind: c for c in got}
    assert by_kind["all-reduce"].axes == ("fsdp",)
    assert by_kind["all-reduce"].bus_bytes == 2 * n * 1 / 2
    assert by_kind["all-gather"].axes == ("model",) and by_kind["all-gather"].buffer_bytes == 2 * n
    assert by_kind["reduce-scatter"].axes == ("data", "model")
    assert by_kind["reduce-scatter"].buffer_bytes == n and by_kind["reduce-scatter"].group_size == 4
    assert by_kind["all-to-all"].axes == ("data",) and by_kind["all-to-all"].bus_bytes == n / 2
    assert by_kind["collective-permute"].axes == ("model",)
    assert by_kind["collective-permute"].bus_bytes == n


@pytest.mark.parametrize(
    "result, bus",
    [
        ("(f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[])", 512),  # XLA:TPU: context scalars
        # XLA:GPU: K and V in one permute, ((k, v), (k', v')): both count
        ("((f32[8,16]{1,0}, f32[8,16]{1,0}), (f32[8,16]{1,0}, f32[8,16]{1,0}))", 1024),
        ("(f32[8,16]{1,0}, f32[8,16]{1,0})", 512),
    ],
)
def test_an_async_permute_counts_every_operand_and_no_context_scalar(result, bus):
    line = (
        f"  %cp = {result} collective-permute-start(%x), "
        'source_target_pairs={{0,1},{1,0}}, metadata={op_name="ppermute"}'
    )
    (c,) = collectives_hlo.parse(f"ENTRY %main () -> f32[] {{\n{line}\n}}", {"model": 2})
    assert c.kind == "collective-permute" and c.bus_bytes == bus, c


@pytest.mark.parametrize(
    "text, groups, axis",
    [
        ("replica_groups={{0,1},{2,3}}, x", [[0, 1], [2, 3]], "model"),
        ("replica_groups=[2,2]<=[4], x", [[0, 1], [2, 3]], "model"),
        ("replica_groups=[2,2]<=[2,2]T(1,0), x", [[0, 2], [1, 3]], "data"),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_0'}, x", [[0, 2], [1, 3]], "data"),
        (
            "replica_groups=mesh['axis_0'=2,'axis_1'=2], device_ids=([2,2]T(1,0)) {'axis_1'}, x",
            [[0, 2], [1, 3]],
            "data",
        ),
    ],
)
def test_replica_group_spellings(text, groups, axis):
    """Row-major device ids on a data×model mesh: neighbours differ in `model`."""
    assert collectives_hlo.replica_groups(text, 4) == groups
    assert collectives_hlo.axes_of(groups, {"data": 2, "model": 2}) == (axis,)


def test_loop_bodies_count_once_per_trip():
    _, ex = _explained("1x8x1", "fsdp", "scan_layers=true")
    gathers = [c for c in ex.collectives if c.kind == "all-gather"]
    assert any(c.count == 2 for c in gathers)  # inside the scanned 2-layer body
    assert _row(ex, "param all-gather").ratio == pytest.approx(1.0, abs=0.1)


def test_explain_from_the_command_line(tmp_path, capsys):
    """lab.run explain=true: the memory and collectives tables, before (here instead of)
    training."""
    from lab.run import main

    argv = [
        "mesh=2x2x2",
        "strategy=fsdp+tp",
        "explain=true",
        "compile_only=true",
        "batch_size=8",
        "seq_len=32",
        f"out_dir={tmp_path}",
        "name=x",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for needle in (
        "memory per device",
        "collectives per step",
        "grad reduction",
        "param all-gather",
        "activation",
    ):
        assert needle in out, needle


@pytest.mark.parametrize(
    "mesh, strategy, extra",
    [
        ("data:2,stage:4", "pp", ("microbatches=4", "n_layers=4")),
        ("4x2", "tp", ("accumulate=4", "batch_size=64")),
        ("2x4", "fsdp", ()),
    ],
)
def test_the_gradient_formula_printed_gives_the_figure_beside_it(mesh, strategy, extra):
    """The formula is the arithmetic of the analytic column: its terms, evaluated (each amount
    to two decimals in its unit), sum to it (it once read G and W of the whole mesh, 0.54 MiB
    against 0.41)."""
    import re

    base = [a for a in BASE if not a.startswith("batch_size=")] + ["batch_size=32"]
    keys = {k.split("=")[0]: k for k in [*base, *extra]}  # extra over the base
    cfg = parse_args([*keys.values(), f"mesh={mesh}", f"strategy={strategy}"])
    ex = explain.explain(make_trainer(cfg, make_mesh(cfg.mesh)))
    e = _row(ex, "grad reduction").expected
    text = e.formula.replace("·", "*").replace(" MiB", "").replace(" KiB", "/1024")
    text = re.sub(r" B\b", "/1048576", text)  # each amount in the unit that shows it, as MiB
    terms = re.findall(r"(?:\d+\*)?\(?[\d.]+(?:/\d+)*\)?\*\(\d+-1\)/\d+", text)
    assert terms, e.formula
    total = sum(eval(t) for t in terms)  # noqa: S307 — the lab's own arithmetic
    mib = 2**20
    assert total * mib == pytest.approx(e.bus_bytes, abs=0.01 * mib * len(terms)), e.formula


def test_a_formulas_small_groups_show_their_size():
    """A group of norm scales is a few KiB: in MiB to two decimals it printed as 0.00."""
    assert explain._reduction_term("ar", 3 * 1024, 8, 1) == "2·3.0 KiB·(8-1)/8"
    assert explain._reduction_term("ar", 512, 2, 1) == "2·512 B·(2-1)/2"
    assert explain._reduction_term("ar", 3 * 2**20, 4, 1) == "2·3.00 MiB·(4-1)/4"


def test_a_row_names_the_type_its_collectives_carry_where_the_figure_assumes_another():
    """XLA:CPU runs a bfloat16 all-reduce in float32 (2× the bytes); XLA:TPU sums float32
    weights' gradients in bfloat16 (½×): the row says which type the compiled op carried."""
    line = "  %ar = (f32[8,16]{1,0}, u32[]) all-reduce-start(%x), replica_groups={{0,1}}"
    (c,) = collectives_hlo.parse(f"ENTRY %main () -> f32[] {{\n{line}\n}}", {"model": 2})
    assert c.dtypes == ("f32",)  # the context scalar left out
    e = explain.Expected("activation all-reduce", "all-reduce", ("model",), 1, 1, 1, "", "bf16")
    row = explain.Row("activation all-reduce", e, 2, 1, (), dtypes=("f32",))
    assert "carry f32; the figure assumes bf16" in row.dtype_note
    softmax = dataclasses.replace(e, other_dtypes=("f32",))
    assert explain.Row("a", softmax, 1, 1, (), dtypes=("bf16", "f32")).dtype_note == ""
    assert explain.Row("a", e, 1, 1, (), dtypes=("bf16",)).dtype_note == ""

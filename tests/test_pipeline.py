"""Pipeline parallelism (lab/kernels/pipeline.py) equals the unpipelined computation, forward and
gradient, float32 within 1e-5: a toy layer over several stage and microbatch counts, the lab's
transformer under the pp rule tables (with data parallelism, fsdp and tp inside the stages,
GPipe and circular), the sharded train step; what the compiled program sends (CPU, and ahead
of time for a TPU slice and H100s); bad input as one line."""

import dataclasses
import functools
import json

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from few_steps import train_steps
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console

from lab.config import parse_args
from lab.data import host_batch, to_global
from lab.kernels.pipeline import (
    Schedule,
    from_microbatches,
    from_stage_major_order,
    pipeline_apply,
    scan_layers,
    stage_major,
    to_microbatches,
    to_stage_major_order,
)
from lab.measure.pipeline import Direction, PipelineReading
from lab.measure.timing import random_inputs
from lab.mesh import make_mesh, rules_for
from lab.model import build, natural_layers
from lab.parallel import collectives_hlo, explain, pipeline_hlo
from lab.report import tables
from lab.run import main
from lab.train import cross_entropy, make_trainer

# float32: the same sums over a few hundred terms in another order (microbatches, stages)
TOL = dict(rtol=1e-5, atol=1e-5)


def _close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)


# --- the schedule on paper ----------------------------------------------------------------


@pytest.mark.parametrize("S, M, R", [(4, 4, 1), (2, 3, 1), (4, 4, 2), (2, 5, 3)])
def test_schedule_table_counts_the_bubble(S, M, R):
    s = Schedule(S, M, R)
    table = s.table()
    assert len(table) == s.ticks == R * M + S - 1
    for stage in range(S):  # every stage works on each (repeat, microbatch) once, in order
        work = [row[stage] for row in table if row[stage] is not None]
        assert work == [(r, m) for r in range(R) for m in range(M)]
    idle = sum(row[stage] is None for row in table for stage in range(S))
    assert idle / (len(table) * S) == pytest.approx(s.bubble) == (S - 1) / (R * M + S - 1)
    assert s.permute_bytes(10)["useful"] == M * (R * S - 1) * 10


def test_stage_major_is_the_circular_layer_order():
    layers = jnp.arange(8)
    assert stage_major(layers, 2, 1).tolist() == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    # 2 repeats of 2 stages, chunks of 2 layers: stage 0 holds layers 0,1 and 4,5
    assert stage_major(layers, 2, 2).tolist() == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert to_stage_major_order(layers, 2, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    for S, R in ((2, 2), (2, 1), (4, 2)):  # and back: serving reads layer order
        stored = to_stage_major_order(layers, S, R)
        assert from_stage_major_order(stored, S, R).tolist() == layers.tolist()


@pytest.mark.parametrize("M, groups", [(4, (1, 2)), (8, (4, 2)), (4, (4, 1))])
def test_microbatches_keep_every_devices_rows(M, groups):
    x = jnp.arange(32)
    mb = to_microbatches(x, M, groups)
    assert from_microbatches(mb, groups).tolist() == x.tolist()
    S, G = groups  # block (s, g) of the batch: microbatches of stage s, rows of device g
    blocks = x.reshape(S * G, -1)
    for s in range(S):
        for g in range(G):
            mine = mb.reshape(S, M // S, G, -1)[s, :, g].ravel()
            assert sorted(mine.tolist()) == blocks[s * G + g].tolist()


# --- a toy layer: pipeline_apply against the plain scan ----------------------------------


def _toy_layer(p, x_BxLxD):
    return x_BxLxD + jnp.tanh(x_BxLxD @ p["w"] + p["b"])


@pytest.mark.parametrize(
    "shape, M, R, io, vma",
    [
        ((2, 4), 4, 1, "replicated", True),  # data:2, stage:4
        ((2, 4), 8, 1, "stage", True),  # input gathered to stage 0, output scattered
        ((1, 8), 3, 1, "replicated", True),  # 8 stages, M not a multiple of them
        ((4, 2), 2, 1, "stage", False),  # check_vma off (the lab's kernels need it)
        ((2, 2), 3, 2, "replicated", True),  # circular, M > P: the ring's buffer waits
    ],
)
def test_pipeline_apply_equals_unpipelined(shape, M, R, io, vma):
    data, S = shape
    mesh = Mesh(np.array(jax.devices()[: data * S]).reshape(shape), ("data", "stage"))
    n_layers, D = 2 * S * R, 8
    w, b, x, weights = random_inputs(
        S * 10 + M, [(n_layers, D, D), (n_layers, D), (M * data * 2, 3, D), (M * data * 2, 3, D)]
    )
    params = jax.device_put({"w": w * D**-0.5, "b": b * 0.1}, NamedSharding(mesh, P("stage")))
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    stage_fn = scan_layers(_toy_layer)
    piped = functools.partial(
        pipeline_apply,
        stage_fn,
        mesh=mesh,
        microbatches=M,
        repeats=R,
        batch_axes=("data",),
        io=io,
        check_vma=vma,
    )

    def loss_and_grads(fn):
        return jax.jit(jax.value_and_grad(lambda p, x: jnp.mean(fn(p, x) * weights), (0, 1)))

    with jax.set_mesh(mesh):
        got = loss_and_grads(piped)(params, x)
    _close(got, loss_and_grads(stage_fn)(params, x))


def test_circular_with_stage_major_storage_sends_no_reshuffle():
    """Stored stage-major, the circular schedule's parameters need no all-to-all per step,
    and the result is the same model (its layers in natural order)."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "stage"))
    S, R, M, D = 4, 2, 4, 8
    w, b, x = random_inputs(7, [(S * R, D, D), (S * R, D), (16, 3, D)])
    params = {"w": w * D**-0.5, "b": b * 0.1}
    stored = jax.device_put(to_stage_major_order(params, S, R), NamedSharding(mesh, P("stage")))
    fn = scan_layers(_toy_layer)
    piped = functools.partial(
        pipeline_apply,
        fn,
        mesh=mesh,
        microbatches=M,
        repeats=R,
        batch_axes=("data",),
        layer_order="stage_major",
    )
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        grad = jax.jit(jax.grad(lambda p, x: jnp.mean(piped(p, x) ** 2)))
        kinds = {
            c.kind for c in collectives_hlo.from_compiled(grad.lower(stored, x).compile(), mesh)
        }
        got = jax.jit(piped)(stored, x)
    _close(got, fn(params, x))
    assert "all-to-all" not in kinds and "collective-permute" in kinds


def test_pipeline_apply_rejects_bad_shapes():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "stage"))
    fn = scan_layers(_toy_layer)
    p = {"w": jnp.ones((8, 4, 4)), "b": jnp.ones((8, 4))}
    x = jnp.ones((8, 2, 4))
    with pytest.raises(ValueError, match="microbatches=3"):
        pipeline_apply(fn, p, x, mesh=mesh, microbatches=3)
    with pytest.raises(ValueError, match="must be >= stages=4"):
        pipeline_apply(fn, p, x, mesh=mesh, microbatches=2, repeats=2)
    with pytest.raises(ValueError, match="do not divide into stages=4"):
        pipeline_apply(fn, {"w": jnp.ones((6, 4, 4))}, x, mesh=mesh, microbatches=4)


# --- the lab's transformer -------------------------------------------------------------

BASE = ["model=tiny", "n_layers=4", "scan_layers=true", "dtype=float32", "attention=naive"]


@pytest.fixture(scope="module")
def reference():
    """The unpipelined scanned model on one device: params, tokens, loss and gradients."""
    cfg = parse_args([*BASE, "batch_size=16", "seq_len=16"])
    model = build(cfg.model)
    tokens = jax.random.randint(jax.random.key(1), (16, 17), 0, 256)
    params = nn.meta.unbox(model.init(jax.random.key(0), tokens[:, :-1])["params"])
    return cfg, params, tokens, jax.jit(jax.value_and_grad(_loss(model)))(params, tokens)


def _loss(model):
    def f(params, tokens):
        return cross_entropy(model.apply({"params": params}, tokens[:, :-1]), tokens[:, 1:])

    return f


@pytest.mark.parametrize(
    "mesh_spec, strategy, M, R, extra",
    [
        ("data:2,stage:4", "pp", 4, 1, {}),  # M % P == 0: the batch split over stages outside
        ("stage:2,fsdp:2,data:2", "pp+fsdp", 2, 1, {}),
        ("stage:2,model:2,data:2", "pp+tp", 2, 1, {"remat": "full"}),
        # circular (2 stages x 2 repeats x 1 layer) with the blockwise kernel: check_vma off
        ("data:4,stage:2", "pp", 2, 2, {"attention": "blockwise"}),
    ],
)
def test_model_pipeline_equals_unpipelined(reference, mesh_spec, strategy, M, R, extra):
    cfg, params, tokens, (loss0, grads0) = reference
    mc = dataclasses.replace(cfg.model, microbatches=M, pipeline_repeats=R, **extra)
    model, rules = build(mc), rules_for(strategy)
    mesh = make_mesh(mesh_spec)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract = jax.eval_shape(lambda k: model.init(k, tokens[:, :-1]), jax.random.key(0))
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
        stored = params
        if R > 1:  # circular runs store their blocks stage-major (lab.model.layer_order)
            S = mesh.shape["stage"]
            stored = {**params, "blocks": to_stage_major_order(params["blocks"], S, R)}
        placed = jax.device_put(stored, shardings["params"])
        assert placed["blocks"]["attn"]["wq"].sharding.spec[0] == "stage"
        compiled = jax.jit(jax.value_and_grad(_loss(model))).lower(placed, tokens).compile()
        loss, grads = compiled(placed, tokens)
    if R > 1:
        grads = {**grads, "blocks": natural_layers(mc, grads["blocks"], mesh.shape["stage"])}
        kinds = {c.kind for c in collectives_hlo.from_compiled(compiled, mesh)}
        assert "all-to-all" not in kinds, kinds  # no reshuffle of the weights per step
    _close((loss, grads), (loss0, grads0))
    if strategy == "pp+fsdp":
        _gathers_each_stage_weight_once(compiled, mesh, placed["blocks"])


def _gathers_each_stage_weight_once(compiled, mesh, blocks):
    """Each block weight split over fsdp is all-gathered once per step inside the pipeline and
    its gradient reduce-scattered once; no fsdp collective runs inside the tick loop."""
    split = [w for w in jax.tree.leaves(blocks) if "fsdp" in w.sharding.spec]
    colls = collectives_hlo.from_compiled(compiled, mesh)
    fsdp = [c for c in colls if "fsdp" in c.axes]
    weights = pipeline_hlo.stage_weight_collectives(colls)
    assert len(split) == 7  # wq, wk, wv, wo and the MLP's three: split along embed
    for kind in ("gather", "scatter"):
        assert len(weights[kind]) == len(split) and {c.count for c in weights[kind]} == {1}
    assert {c.count for c in fsdp} == {1}, [(c.kind, c.count, c.op_name) for c in fsdp]
    # every fsdp all-gather of the step: the stages' weights once, the tied embedding table
    # (split along embed too) once for its lookup and once for the head
    gathers = sum(c.count for c in fsdp if c.kind == "all-gather")
    assert gathers == len(split) + 2


def test_train_step_pp_matches_one_device():
    """One AdamW step of the pipelined step (data:2, stage:4, M=4) equals one device's; the
    parameters and their Adam moments live 1/S per stage device; the compiled program's stage
    permutes are one per tick forward and backward, in loops of ticks = M + P - 1 trips, each
    one microbatch's activations; no weight is saved once per tick."""
    tokens = host_batch("text", 0, 0, 16, 16, 256)
    out = {}
    for mesh in ("1", "data:2,stage:4"):
        cfg = parse_args([*BASE, "batch_size=16", "seq_len=16", "microbatches=4", f"mesh={mesh}"])
        cfg = dataclasses.replace(cfg, strategy="pp")  # on one device: the same model unpiped
        trainer = make_trainer(cfg, make_mesh(cfg.mesh))
        compiled = trainer.lower().compile()
        state, metrics = compiled(
            trainer.init(jax.random.key(0)), to_global(tokens, trainer.batch_sharding)
        )
        out[mesh] = (float(metrics["loss"]), state.params)
    np.testing.assert_allclose(out["data:2,stage:4"][0], out["1"][0], rtol=1e-5)
    _close(out["data:2,stage:4"][1], out["1"][1])
    assert trainer.schedule == Schedule(4, 4)
    wq = trainer.abstract_state.params["blocks"]["attn"]["wq"]
    mu = trainer.abstract_state.opt_state[1][0].mu["blocks"]["attn"]["wq"]
    assert wq.sharding.spec[0] == mu.sharding.spec[0] == "stage"
    for leaf in jax.tree.leaves(trainer.abstract_state.params["blocks"]):
        assert leaf.sharding.shard_shape(leaf.shape)[0] == leaf.shape[0] // 4
    r = pipeline_hlo.from_trainer(collectives_hlo.from_compiled(compiled, trainer.mesh), trainer)
    a = (16 // 4 // 2) * 16 * 64 * 4  # rows per device x L x D x f32
    assert r.microbatch_bytes == a and r.ticks == r.compiled_ticks == 7
    for d in (r.forward, r.backward):
        assert d.trip_counts == (7,) and d.bytes_per_device == 7 * a == r.bytes_per_device
    assert r.compiled_bubble == pytest.approx(r.bubble) == pytest.approx(3 / 7)
    # the weights are kept once for the backward, not once per tick: no [ticks, layers, D, F]
    assert "[7,1,64,192]" not in compiled.as_text()


def test_explain_counts_the_pp_fsdp_stage_weight_collectives():
    """explain=true's reading of a pp+fsdp step (4 layers, 5 ticks): the 7 block weights
    gathered once per step (not 7 per layer per tick: 70), their gradients reduce-scattered
    once, bytes as the analytic figure."""
    argv = [*BASE, "batch_size=16", "seq_len=16", "microbatches=4"]
    cfg = parse_args([*argv, "mesh=stage:2,fsdp:2,data:2", "strategy=pp+fsdp"])
    trainer = make_trainer(cfg, make_mesh(cfg.mesh))
    ex = explain.explain(trainer)
    r = ex.pipeline
    assert r.ticks == r.compiled_ticks == 5 and r.weights_split == 7
    for d in (r.weight_gathers, r.weight_scatters):
        assert d.ops == d.executions == 7 and d.trip_counts == (1,)
    rows = {row.role: row for row in ex.rows}
    for role in ("stage weight gather", "stage weight grad reduce-scatter"):
        assert rows[role].measured_ops == 7 and rows[role].ratio == pytest.approx(1.0, abs=0.01)
    assert "7 ops once per step" in rows["stage weight gather"].expected.formula
    con = Console(width=200, record=True)
    con.print(tables.explain_pipeline(r))  # the renderer takes the reading itself
    text = con.export_text()
    assert "ticks (forward permutes a run)" in text and f"{r.microbatch_bytes:,} B" in text


def test_explain_reads_the_tick_loop_inside_gradient_accumulation():
    """pp with accumulate=2: the tick loops (3 trips) sit inside the accumulation loop (2 trips).
    The ticks and the bubble are one run of the schedule's (3, 1/3), not the product's (6, 2/3);
    the permutes run and send K·ticks·a a step, as the analytic figure."""
    argv = [*BASE, "batch_size=8", "seq_len=16", "microbatches=2", "accumulate=2"]
    cfg = parse_args([*argv, "mesh=data:2,stage:2"])
    trainer = make_trainer(cfg, make_mesh(cfg.mesh))
    ex = explain.explain(trainer)
    r = ex.pipeline
    assert r.accumulate == 2 and r.ticks == r.compiled_ticks == 3
    assert r.compiled_bubble == pytest.approx(r.bubble) == pytest.approx(1 / 3)
    for d in (r.forward, r.backward):
        assert d.loop_trips == (3,) and d.executions == 6
        assert d.bytes_per_device == 2 * 3 * r.microbatch_bytes == r.bytes_per_device
    row = {row.role: row for row in ex.rows}["stage permute"]
    assert row.ratio == pytest.approx(1.0)
    again = PipelineReading.from_record(json.loads(json.dumps(r.as_dict())))
    assert again.compiled_ticks == 3  # read back from a summary.json
    # K runs that are not alike (executions not a multiple of K): the tick loop's own trips
    uneven = dataclasses.replace(r, forward=dataclasses.replace(r.forward, executions=7))
    assert uneven.compiled_ticks == 3


@pytest.mark.parametrize(
    "accumulate, trip_counts, loop_trips", [(1, (1, 6), (1, 6)), (2, (2, 12), (2, 6))]
)
def test_a_tick_peeled_out_of_the_loop_is_still_a_tick(accumulate, trip_counts, loop_trips):
    """XLA:TPU under remat=offload peels the first tick of a GPipe schedule (P=4, M=4: 7
    ticks) out of its loop: one stage permute before a loop of 6 trips, which sits inside the
    accumulation loop when there is one (the permutes' trip counts as
    `lab.run target=tpu:v5e:2x4 mesh=data:2,stage:4 strategy=pp n_layers=4 remat=offload`
    compiles them, with and without accumulate=2). The ticks are the permutes' executions
    per run, 7, and the bubble 3/7 (the loop's trips alone read 6 ticks and a bubble of 1/3)."""
    d = Direction(
        ops=2,
        executions=sum(trip_counts),
        trip_counts=trip_counts,
        bytes_per_device=7 * accumulate * 1024,
        loop_trips=loop_trips,
    )
    r = PipelineReading(
        stages=4, microbatches=4, repeats=1, microbatch_bytes=1024, ticks=7, bubble=3 / 7,
        bytes_per_device=7 * accumulate * 1024, useful_bytes=4 * 3 * accumulate * 1024,
        forward=d, backward=d, accumulate=accumulate,
    )  # fmt: skip
    assert r.compiled_ticks == 7 and r.compiled_bubble == pytest.approx(3 / 7)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["mesh=data:2,stage:4", "n_layers=6"], "n_layers=6 does not divide into stage=4"),
        (["mesh=data:2,stage:4", "n_layers=4", "microbatches=3"], "microbatches=3 must divide"),
        (["mesh=data:2,stage:4", "n_layers=4", "strategy=dp"], "strategy=dp does not use it"),
        (["mesh=4x2", "microbatches=2"], "microbatches=2 feeds a pipeline"),
        (["mesh=data:2,stage:4", "n_layers=4", "scan_layers=false"], "cannot apply; drop it"),
        (
            ["mesh=stage:4,data:2", "n_layers=8", "microbatches=2", "pipeline_repeats=2"],
            "needs microbatches >= stage=4",
        ),
    ],
)
def test_bad_pipeline_input_is_one_line(argv, needle, capsys):
    assert main([*argv, "steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and len(err.splitlines()) == 1


# --- ahead of time: a TPU slice and H100s --------------------------------------------------


def _plan(tmp_path, capsys, target, mesh, extra=()):
    argv = [
        "model=small",  # d_model 256, 4 layers: one per stage; TPU tiles pad tiny arrays
        f"target={target}",
        f"mesh={mesh}",
        "batch_size=16",
        "seq_len=128",
        "microbatches=4",
        "explain=true",
        f"out_dir={tmp_path}",
        "name=plan",
        *extra,
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "compiled, not run" in out and "stage-to-stage traffic" in out
    return json.loads((tmp_path / "plan" / "summary.json").read_text())


@pytest.mark.slow_plan
def test_tpu_plan_splits_the_layers_over_stages(tmp_path, capsys):
    """v5e 2x4 ahead of time (libtpu): every device holds 1/S of the block parameters, and the
    compiled loops run ticks = 7 with one bf16 microbatch per permute (the TPU trip count is
    read from the loop condition, the permute's size without XLA:TPU's context scalars)."""
    pytest.importorskip("libtpu")
    s = _plan(tmp_path, capsys, "tpu:v5e:2x4", "data:2,stage:4")
    p = s["pipeline"]
    assert p["compiled_ticks"] == p["ticks"] == 7
    assert p["forward"]["bytes_per_device"] == p["bytes_per_device"] == 7 * 2 * 128 * 256 * 2
    pred = s["predicted_memory_per_device"]  # the calculator's state: 1/S of the model's
    state = s["compiled_memory_per_device"]["argument_bytes"]
    assert abs(pred["params"] + pred["optimizer"] - state) / state < 0.15


@pytest.mark.slow_plan
def test_gpu_plan_pipelines_over_h100s(tmp_path, capsys):
    from lab.plans import gpu

    if gpu._pjrt() is None or gpu.ptxas() is None:
        pytest.skip("the CUDA plugin or ptxas is missing: pip install -e '.[gpu-plan]'")
    s = _plan(tmp_path, capsys, "gpu:h100:8", "data:2,stage:4", ["attention=naive"])
    p = s["pipeline"]
    assert p["compiled_ticks"] == p["ticks"] == 7 and p["compiled_bubble"] == pytest.approx(3 / 7)
    assert p["backward"]["bytes_per_device"] == p["bytes_per_device"]


@pytest.mark.once
def test_a_circular_pipeline_starts_from_the_same_model(tmp_path):
    """Same seed, same model: the circular schedule stores its blocks stage-major, and its
    first losses equal a run without a pipeline's (its init was the layer-order init read in
    another order, a different network: 6.2187 against 6.2026 at step 1)."""
    keys = ["model=tiny", "n_layers=4", "steps=2", "seq_len=32", "batch_size=16", "log_every=1"]
    keys += [f"out_dir={tmp_path}"]
    circular = ["mesh=data:2,stage:2", "strategy=pp", "pipeline_repeats=2", "microbatches=2"]
    assert main([*keys, "name=circ", *circular]) == 0
    assert main([*keys, "name=plain", "mesh=1", "scan_layers=true"]) == 0

    def losses(name):
        return [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").open()]

    np.testing.assert_allclose(losses("circ"), losses("plain"), rtol=1e-5)


@pytest.mark.parametrize(
    "keys",
    [
        ["mesh=1", "scan_layers=true"],
        ["mesh=data:2,stage:2", "strategy=pp", "microbatches=2"],
        ["mesh=stage:2", "strategy=pp", "pipeline_repeats=2", "microbatches=2"],
    ],
)
def test_every_layout_starts_from_the_weights_of_the_unscanned_model(keys):
    """Same seed, same model: scanned layers and pipelines (GPipe, circular) start from the
    unscanned model's weights, each layer its own (nn.scan splits the key another way)."""
    from lab.train import make_trainer

    def params(argv):
        cfg = parse_args(["model=tiny", "n_layers=4", "dtype=float32", "seq_len=32", *argv])
        trainer = make_trainer(cfg, make_mesh(cfg.mesh))
        return cfg, jax.device_get(nn.meta.unbox(trainer.init(jax.random.key(3)).params))

    _, plain = params(["mesh=1"])
    cfg, laid = params(keys)
    stages = dict(make_mesh(cfg.mesh).shape).get("stage", 1)
    blocks = natural_layers(cfg.model, laid["blocks"], stages)  # layer order, as stored
    for i in range(4):
        layer = jax.tree.map(lambda x, i=i: x[i], blocks)
        chex.assert_trees_all_equal(layer, plain[f"block_{i}"])
    for name in ("embed", "final_norm"):
        chex.assert_trees_all_equal(laid[name], plain[name])


def _trained(argv, steps=3):
    """Losses and parameters (unscanned names, layer order) after `steps` AdamW steps with a
    strong weight decay and no warm-up, so that a weight decayed in one layout and not in
    another moves the parameters by lr·decay = 1.5e-3 a step."""
    from lab.model import unstack_layers

    keys = ["model=tiny", "n_layers=2", "dtype=float32", "attention=naive", "seq_len=16"]
    keys += ["batch_size=8", "warmup_steps=0", "weight_decay=0.5", *argv]
    losses, trainer, state = train_steps(parse_args(keys), steps)
    params = jax.device_get(nn.meta.unbox(state.params))
    if "blocks" in params:
        stages = dict(trainer.mesh.shape).get("stage", 1)
        params = {**params, "blocks": natural_layers(trainer.cfg.model, params["blocks"], stages)}
        params = unstack_layers(params, 2)
    return losses, params


def test_weight_decay_trains_the_same_model_in_every_layout():
    """A norm's scale is a vector unscanned and a [layers, D] matrix stacked: weight decay
    chosen by a weight's name, not its rank, keeps every layout's training the same."""
    plain = _trained(["mesh=1"])
    for argv in (["mesh=1", "scan_layers=true"], ["mesh=stage:2", "strategy=pp", "microbatches=2"]):
        losses, params = _trained(argv)
        np.testing.assert_allclose(losses, plain[0], rtol=2e-6)
        # Adam divides by the root of the squared gradient: an entry whose gradient is near
        # zero moves by an amount that rounding (another sum order) can change by ~1e-5; a
        # norm scale decayed in one layout only is 1.5e-3 off after one step
        for g, w in zip(jax.tree.leaves(params), jax.tree.leaves(plain[1]), strict=True):
            np.testing.assert_allclose(g, w, atol=5e-5)

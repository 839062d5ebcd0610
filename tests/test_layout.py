"""A run goes on in another layout: each layer its own, scanned, a GPipe pipeline or a circular
one (stage-major). Every checkpoint step records how its state stores the layers; a restore
into a trainer of another layout moves the saved weights and optimizer slots into its own,
values unchanged."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from lab import checkpoint
from lab.config import parse_args
from lab.mesh import make_mesh
from lab.run import main
from lab.train import Layout, make_trainer, relayout, restore_in_layout

UNSCANNED = ["mesh=1"]
SCANNED = ["mesh=1", "scan_layers=true"]
GPIPE = ["mesh=data:2,stage:4", "strategy=pp", "microbatches=4"]
CIRCULAR = ["mesh=data:2,stage:2", "strategy=pp", "pipeline_repeats=2", "microbatches=2"]
CIRCULAR_4 = ["mesh=data:2,stage:4", "strategy=pp", "pipeline_repeats=2", "microbatches=4"]


def _trainer(keys):
    cfg = parse_args(["model=tiny", "n_layers=8", "seq_len=32", "batch_size=8", *keys])
    return make_trainer(cfg, make_mesh(cfg.mesh))


def _random_state(trainer, seed: int):
    """A state of the trainer's shapes, dtypes and shardings holding random values, every
    element its own: a layer or slot moved to the wrong place cannot compare equal. Made
    without compiling the trainer's init or step (most of a case's time, and not what the
    case is about)."""
    rng = np.random.default_rng(seed)

    def leaf(x):
        if jax.numpy.issubdtype(x.dtype, jax.numpy.integer):
            values = rng.integers(0, 2**20, x.shape)
        else:
            values = rng.standard_normal(x.shape)
        return jax.device_put(values.astype(x.dtype), x.sharding)

    return jax.tree.map(leaf, trainer.abstract_state)


@pytest.mark.parametrize(
    "src, dst",
    [
        (UNSCANNED, CIRCULAR),
        (CIRCULAR, SCANNED),
        (GPIPE, UNSCANNED),
        (CIRCULAR, CIRCULAR_4),
    ],
    ids=["unscanned-to-circular", "circular-to-scanned", "gpipe-to-unscanned", "circular-2-to-4"],
)
def test_a_saved_state_moves_into_another_layout_with_its_values_unchanged(tmp_path, src, dst):
    saver_trainer, reader = _trainer(src), _trainer(dst)
    assert saver_trainer.layout != reader.layout
    state = _random_state(saver_trainer, seed=5)
    saver = checkpoint.Saver(checkpoint.manager(tmp_path), saver_trainer.layout.record())
    saver.save(1, state)
    saver.finish()

    step, restored, saved = restore_in_layout(tmp_path, reader, {}, warn=pytest.fail)
    assert step == 1 and saved == saver_trainer.layout
    back = relayout(restored, reader.layout, saved, reader.cfg.model.n_layers)
    got, want = jax.device_get(back), jax.device_get(state)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(g, w)
    # placed as the reader's own state is: its next step takes it as it is
    for r, s in zip(
        jax.tree.leaves(restored), jax.tree.leaves(reader.state_shardings), strict=True
    ):
        assert r.sharding.is_equivalent_to(s, r.ndim)


def test_a_step_saved_before_steps_kept_their_layout_is_read_by_its_arrays_names(tmp_path):
    """Such a step says nothing of its layout: stacked or not is read from its arrays' names,
    the order from config.json."""
    plain, scanned = _trainer(UNSCANNED), _trainer(SCANNED)
    state = _random_state(plain, seed=2)
    saver = checkpoint.Saver(checkpoint.manager(tmp_path))  # as before layouts were kept
    saver.save(1, state)
    saver.finish()
    saved_config = dataclasses.asdict(plain.cfg) | {"block_order": "in layer order"}
    step, restored, saved = restore_in_layout(tmp_path, scanned, saved_config, warn=pytest.fail)
    assert saved == Layout(stacked=False)
    np.testing.assert_array_equal(
        jax.device_get(restored.params["blocks"]["attn"]["wq"][3]),
        jax.device_get(state.params["block_3"]["attn"]["wq"]),
    )


def test_older_steps_are_read_in_the_order_config_json_keeps_for_them(tmp_path):
    """A circular run's step saved before steps kept their layout: its order is config.json's,
    and once a resume in another layout rewrites config.json, the `older_steps_layout` it
    keeps there; read either way, the same weights."""
    from lab.train import block_order

    circ, plain = _trainer(CIRCULAR), _trainer(UNSCANNED)
    state = _random_state(circ, seed=4)
    old = checkpoint.Saver(checkpoint.manager(tmp_path))  # as before layouts were kept
    old.save(2, state)
    old.finish()
    as_saved = dataclasses.asdict(circ.cfg) | {"block_order": block_order(2, 2)}
    rewritten = dataclasses.asdict(plain.cfg) | {
        "block_order": block_order(1, 1),
        "older_steps_layout": circ.layout.record(),
    }
    want = jax.device_get(state)
    for saved_config in (as_saved, rewritten):
        _, restored, saved = restore_in_layout(tmp_path, plain, saved_config, warn=pytest.fail)
        assert saved == circ.layout == Layout(True, 2, 2)
        back = jax.device_get(relayout(restored, plain.layout, saved, 8))
        for g, w in zip(jax.tree.leaves(back), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda r: {**r, "stages": 4}, "its layout record is damaged"),  # checksum
        (lambda r: None, "its layout record (layout/) cannot be read"),  # file gone
        (lambda r: "{not json", "its layout record (layout/) cannot be read"),
        (lambda r: {**r, "stacked": False}, "its layout record is damaged"),
    ],
    ids=["edited", "gone", "torn", "unstacked"],
)
def test_a_damaged_layout_record_sets_the_step_aside(tmp_path, damage, reason):
    """A record edited or damaged into another valid layout would read every layer in
    another's place with the checksums passing: the step is damaged, never read by guess."""
    circ, plain = _trainer(CIRCULAR), _trainer(UNSCANNED)
    saver = checkpoint.Saver(checkpoint.manager(tmp_path), circ.layout.record())
    saver.save(2, circ.init(jax.random.key(0)))
    saver.finish()
    path = checkpoint.folder(tmp_path) / "2" / checkpoint.LAYOUT / "metadata"
    changed = damage(json.loads(path.read_text()))
    if changed is None:
        path.unlink()
    else:
        path.write_text(changed if isinstance(changed, str) else json.dumps(changed))
    said, moved = [], []
    step, state, _ = restore_in_layout(tmp_path, plain, {}, warn=said.append, moved=moved)
    assert step is None and state is None and moved == [2]
    assert reason in said[0], said


def test_layout_records_read_back_and_damaged_ones_are_none():
    for layout in (Layout(False), Layout(True), Layout(True, 4, 2)):
        assert Layout.from_record(json.loads(json.dumps(layout.record()))) == layout
    assert Layout(True, 4, 1) == Layout(True)  # no repeats: layer order on any mesh
    assert Layout(True, 1, 2) == Layout(True)  # one stage: the same
    good = Layout(True, 4, 2).record()
    for bad in (None, [], {**good, "stacked": 1}, {**good, "stages": 0}, {**good, "repeats": "2"}):
        assert Layout.from_record(bad) is None
    assert Layout.from_record({**good, "stages": 2}) is None  # the checksum


@pytest.mark.once
def test_a_run_goes_on_as_a_circular_pipeline_and_back(tmp_path, capsys):
    """lab.run resumed on another layout twice: one device → a circular pipeline → one
    device; the losses follow the uninterrupted run's (the pipeline sums its microbatches in
    another order: 2.5e-5 apart at step 6 when measured)."""
    keys = ["model=tiny", "n_layers=4", "seq_len=16", "log_every=1", "checkpoint_every=2"]
    keys += [f"out_dir={tmp_path}"]
    assert main([*keys, "steps=6", "name=ref"]) == 0
    assert main([*keys, "steps=2", "name=run"]) == 0
    assert main([*keys, "steps=4", "name=run", "resume=true", *CIRCULAR]) == 0
    out = capsys.readouterr().out
    assert "layers: saved each layer its own, moved to this run's (stacked by stage" in out
    assert main([*keys, "steps=6", "name=run", "resume=true", "mesh=1"]) == 0
    assert "layers: saved stacked by stage (stage=2, pipeline_repeats=2), moved" in (
        capsys.readouterr().out
    )

    def losses(name):
        return [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").open()]

    assert len(losses("run")) == 6
    np.testing.assert_allclose(losses("run"), losses("ref"), rtol=1e-4)


@pytest.mark.parametrize(
    "src", [UNSCANNED, SCANNED, CIRCULAR], ids=["unscanned", "scanned", "circ"]
)
def test_the_saved_copy_is_read_as_split_as_the_runs_own_state(src):
    """Read into a pipeline, a step of another layout takes no more of a device than the
    run's own state (the layers were read whole onto every stage: 2x on 2 stages, 3.9x on
    4)."""
    from lab.train import abstract_in

    def per_device(abstract):
        return sum(
            np.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
            for x in jax.tree.leaves(abstract)
        )

    saved, reader = _trainer(src).layout, _trainer(CIRCULAR_4)
    copy = abstract_in(reader.abstract_state, reader.layout, saved, 8)
    assert per_device(copy) <= per_device(reader.abstract_state)

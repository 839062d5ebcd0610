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
from lab.config import make_config, parse_args
from lab.errors import ConfigError
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


def _trained_state(trainer, seed: int):
    """A state after one step on random tokens: Adam's moments differ layer by layer."""
    state = trainer.init(jax.random.key(seed))
    shape = trainer.batch_shape()
    tokens = np.random.default_rng(seed).integers(0, trainer.cfg.model.vocab_size, shape.shape)
    state, _ = trainer.step(state, jax.device_put(tokens.astype(np.int32), shape.sharding))
    return state


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
    state = _trained_state(saver_trainer, seed=5)
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
    state = _trained_state(plain, seed=2)
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


def test_a_changed_block_order_is_refused_only_where_a_step_has_no_layout(tmp_path):
    """config.json alone says how an older step's circular layers are ordered, and the run's
    start rewrites it: a resume that reads them in another order is refused while such a step
    is in the folder; steps that keep their layout move into any order."""
    from lab.loop import _check_same_block_order
    from lab.train import block_order

    circular = dict(mesh="data:2,stage:2", strategy="pp", n_layers=8, pipeline_repeats=2)
    saved = {**dataclasses.asdict(make_config(**circular)), "block_order": block_order(2, 2)}
    plain = make_config(mesh="1", n_layers=8)
    trainer = _trainer(CIRCULAR)
    state = trainer.init(jax.random.key(0))
    old = checkpoint.Saver(checkpoint.manager(tmp_path))
    old.save(2, state)
    old.finish()
    with pytest.raises(ConfigError, match="step 2 was saved before checkpoints kept their layout"):
        _check_same_block_order(saved, plain, 1, tmp_path)
    checkpoint.quarantine(tmp_path, 2, "test", warn=lambda _: None)
    new = checkpoint.Saver(checkpoint.manager(tmp_path), trainer.layout.record())
    new.save(4, state)
    new.finish()
    _check_same_block_order(saved, plain, 1, tmp_path)  # no refusal


def test_layout_records_read_back_and_damaged_ones_are_none():
    for layout in (Layout(False), Layout(True), Layout(True, 4, 2)):
        assert Layout.from_record(json.loads(json.dumps(layout.record()))) == layout
    assert Layout(True, 4, 1) == Layout(True)  # no repeats: layer order on any mesh
    for bad in (
        None,
        [],
        {"stacked": 1},
        {"stacked": True, "stages": 0},
        {"stacked": True, "repeats": "2"},
    ):
        assert Layout.from_record(bad) is None


@pytest.mark.once
def test_a_run_goes_on_as_a_circular_pipeline_and_back(tmp_path, capsys):
    """lab.run resumed on another layout twice: one device → a circular pipeline → one
    device; the losses follow the uninterrupted run's (the pipeline sums its microbatches in
    another order: 2.5e-5 apart at step 6 when measured)."""
    keys = ["model=tiny", "n_layers=4", "seq_len=64", "log_every=1", "checkpoint_every=2"]
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

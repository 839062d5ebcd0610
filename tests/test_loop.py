"""The training loop's hot path (lab/loop.py): each step's metrics are read one step late, so
the host never waits between queuing steps, except where a step's state is kept: a checkpoint
step is read (its metrics checked) before its state is saved and before the next step is
queued; a non-finite step found late still stops the run before any later state is saved."""

import jax
import jax.numpy as jnp
import numpy as np

from lab import checkpoint, loop, train
from lab.run import main

TINY = ["model=tiny", "batch_size=8", "seq_len=32", "log_every=1"]


class _Logged(dict):
    """A step's metrics that note when the loop reads its loss."""

    def __init__(self, metrics, step, events):
        super().__init__(metrics)
        self.step, self.events = step, events

    def __getitem__(self, key):
        if key == "loss":
            self.events.append(("read", self.step))
        return super().__getitem__(key)


def test_each_step_is_read_after_the_next_is_queued(tmp_path, monkeypatch):
    events = []
    real = loop._analyse

    def analyse(*args):
        analysis, compiled, compile_s = real(*args)

        def step(state, batch):
            k = sum(e[0] == "queued" for e in events) + 1
            events.append(("queued", k))
            state, metrics = compiled(state, batch)
            return state, _Logged(metrics, k, events)

        return analysis, step, compile_s

    monkeypatch.setattr(loop, "_analyse", analyse)
    args = [*TINY, f"out_dir={tmp_path}", "name=lag", "steps=6", "checkpoint_every=3"]
    assert main(args) == 0
    q = lambda k: ("queued", k)  # noqa: E731
    r = lambda k: ("read", k)  # noqa: E731
    # step 3 is a checkpoint step: read before its save and before step 4 is queued
    assert events == [q(1), q(2), r(1), q(3), r(2), r(3), q(4), q(5), r(4), q(6), r(5), r(6)]
    assert sorted(checkpoint.manager(tmp_path / "lag").all_steps()) == [3, 6]


def test_a_non_finite_step_read_late_stops_before_the_next_save(tmp_path, capsys, monkeypatch):
    """Step 3's gradient is inf (its loss finite) and it is read only after step 4 is queued;
    step 4 is a checkpoint step: the run stops at step 3, and only step 2's state is kept."""
    real = train.train_step

    def poisoned(state, tokens, **kw):
        new, metrics = real(state, tokens, **kw)
        bad = state.step == 2
        params = jax.tree.map(lambda x: jnp.where(bad, jnp.inf, x).astype(x.dtype), new.params)
        grad_norm = jnp.where(bad, jnp.inf, metrics["grad_norm"])
        return new.replace(params=params), {**metrics, "grad_norm": grad_norm}

    monkeypatch.setattr(train, "train_step", poisoned)
    args = [*TINY, f"out_dir={tmp_path}", "name=inf", "steps=6", "checkpoint_every=2"]
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: gradient norm is inf at step 3: training stopped"), err
    mngr = checkpoint.manager(tmp_path / "inf")
    assert sorted(mngr.all_steps()) == [2]
    for leaf in jax.tree.leaves(mngr.restore(2)):
        assert np.isfinite(np.asarray(leaf)).all()
    steps = [line for line in (tmp_path / "inf" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2  # steps 1 and 2: the non-finite step is not recorded

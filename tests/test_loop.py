"""The training loop's hot path (lab/loop.py): each step's metrics are read one step late, so
the host never waits between queuing steps, except where a step's state is kept: a checkpoint
step is read (its metrics checked) before its state is saved and before the next step is
queued; a non-finite step found late still stops the run before any later state is saved."""

import json
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab import checkpoint, loop, train
from lab.run import main

TINY = ["model=tiny", "batch_size=8", "seq_len=32", "log_every=1"]
# Work made slow to show it is kept out of the step times: ten times a tiny step (~0.1 s), so
# a step on a loaded host is not mistaken for it
SLOW_S = 1.0


class _Logged(dict):
    """A step's metrics that note when the loop reads its loss."""

    def __init__(self, metrics, step, events):
        super().__init__(metrics)
        self.step, self.events = step, events

    def __getitem__(self, key):
        if key == "loss":
            self.events.append(("read", self.step))
        return super().__getitem__(key)


def _logging_steps(monkeypatch, events: list) -> None:
    """The compiled step wrapped: ("queued", n) when step n is called, ("read", n) when the
    loop reads its loss."""
    real = loop._analyse

    def analyse(*args):
        analysis, compiled, compile_s = real(*args)

        def step(state, batch):
            n = sum(e[0] == "queued" for e in events) + 1
            events.append(("queued", n))
            state, metrics = compiled(state, batch)
            return state, _Logged(metrics, n, events)

        return analysis, step, compile_s

    monkeypatch.setattr(loop, "_analyse", analyse)


def test_steps_are_read_late_and_checked_before_their_state_is_saved(tmp_path, capsys, monkeypatch):
    """checkpoint_every=2, and step 3's gradient is inf (its loss finite, its update
    poisoned). Step 1 is read after step 2 is queued; step 2, a checkpoint step, is read and
    saved before step 3 is queued; step 3 is read only after step 4 is queued, and its
    non-finite gradient stops the run there: step 4's state is never saved, only step 2's."""
    real = train.train_step

    def poisoned(state, tokens, **kw):
        new, metrics = real(state, tokens, **kw)
        bad = state.step == 2
        params = jax.tree.map(lambda x: jnp.where(bad, jnp.inf, x).astype(x.dtype), new.params)
        grad_norm = jnp.where(bad, jnp.inf, metrics["grad_norm"])
        return new.replace(params=params), {**metrics, "grad_norm": grad_norm}

    monkeypatch.setattr(train, "train_step", poisoned)
    events = []
    _logging_steps(monkeypatch, events)
    args = [*TINY, f"out_dir={tmp_path}", "name=inf", "steps=6", "checkpoint_every=2"]
    assert main(args) == 1
    q = lambda n: ("queued", n)  # noqa: E731
    r = lambda n: ("read", n)  # noqa: E731
    assert events == [q(1), q(2), r(1), r(2), q(3), q(4), r(3)]
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: gradient norm is inf at step 3: training stopped"), err
    mngr = checkpoint.manager(tmp_path / "inf")
    assert sorted(mngr.all_steps()) == [2]
    for leaf in jax.tree.leaves(mngr.restore(2)):
        assert np.isfinite(np.asarray(leaf)).all()
    metrics = (tmp_path / "inf" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 2  # steps 1 and 2: the non-finite step is not recorded


def test_a_peers_refusal_leaves_no_folder_behind(tmp_path, monkeypatch):
    """Process 0 makes the run folder before its peers say whether they can use it: when one
    refuses, the folder process 0 made (holding nothing but its lock) goes, and a folder
    that was there before stays."""
    import contextlib

    from lab.config import make_config
    from lab.errors import ConfigError

    def refused_by_a_peer(claim, follow, timeout_s, keys=None, shared=False):
        claim()
        raise ConfigError("process 1 of 2 refused the run: cannot write")

    monkeypatch.setattr(loop, "agreed_folder", refused_by_a_peer)
    for name, before in (("new", False), ("old", True)):
        if before:
            (tmp_path / name).mkdir()
        cfg = make_config(model="tiny", out_dir=str(tmp_path), name=name)
        with contextlib.ExitStack() as held, pytest.raises(ConfigError, match="refused"):
            loop._claim_folder(cfg, True, held, named=True)
        assert (tmp_path / name).exists() == before


def test_processes_compare_the_keys_that_decide_the_program_only():
    """How a process reaches the coordinator, how long it waits and the path it sees the run
    folders at may differ by host; what it trains may not."""
    from lab.config import make_config

    a = loop._compared_keys(make_config(model="tiny", coordinator="localhost:1", out_dir="/a"))
    b = loop._compared_keys(
        make_config(model="tiny", coordinator="host0:1", out_dir="/b", coordinator_timeout=90)
    )
    assert a == b
    c = loop._compared_keys(make_config(model="tiny", lr=0.1))
    assert {k for k in a if a[k] != c[k]} == {"lr"}


def _files(folder) -> dict:
    """Every file under `folder` (lab.log and the lock aside) with its bytes."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in ("lab.log", ".lock")
    }


def test_a_refused_resume_leaves_the_folder_as_it_was(tmp_path, capsys):
    """A resume refused because its TensorBoard folder cannot be written changes nothing:
    config.json keeps the run's keys (a later plain resume must not take the refused
    resume's), and metrics.jsonl keeps the steps past the checkpoint it would repeat."""
    base = [*TINY, f"out_dir={tmp_path}", "name=r"]
    assert main([*base, "steps=4", "checkpoint_every=2"]) == 0
    run_dir = tmp_path / "r"
    shutil.rmtree(run_dir / "checkpoints" / "4")  # the resume would repeat steps 3-4
    shutil.rmtree(run_dir / "tensorboard")
    (run_dir / "tensorboard").write_text("")
    before = _files(run_dir)
    capsys.readouterr()
    assert main([*base, "resume=true", "steps=6", "lr=0.01"]) == 2
    err = capsys.readouterr().err
    assert "tensorboard could not be written" in err and "nothing was run" in err, err
    assert _files(run_dir) == before


def test_a_checkpoint_save_is_timed_apart_from_the_steps(tmp_path, monkeypatch):
    """A save (made slow here) is not in the next step's time, in metrics.jsonl or the
    summary's median; the summary counts the saves and their time."""
    real = checkpoint.Saver.save

    def slow(self, step, state):
        time.sleep(SLOW_S)
        return real(self, step, state)

    monkeypatch.setattr(checkpoint.Saver, "save", slow)
    args = [*TINY, f"out_dir={tmp_path}", "name=s", "steps=6", "checkpoint_every=2"]
    assert main(args) == 0
    lines = (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()
    assert max(json.loads(x)["step_s"] for x in lines) < SLOW_S, lines
    done = json.loads((tmp_path / "s" / "summary.json").read_text())
    assert done["checkpoint_saves"]["count"] == 3  # steps 2, 4, 6
    assert done["checkpoint_saves"]["total_s"] >= 3 * SLOW_S
    assert done["step_time"]["median_s"] < SLOW_S


def test_a_folder_whose_run_is_starting_is_in_use_not_missing(tmp_path):
    """A resume into a folder whose run holds its lock but has not written config.json yet
    (it is compiling) is told the folder is in use, not that there is no run to resume."""
    import contextlib

    from lab.config import make_config
    from lab.errors import ConfigError

    (tmp_path / "lk").mkdir()
    cfg = make_config(model="tiny", out_dir=str(tmp_path), name="lk", resume=True)
    with checkpoint.Lock(tmp_path / "lk"), contextlib.ExitStack() as held:
        with pytest.raises(ConfigError, match="is in use by pid"):
            loop._claim_here(cfg, True, held, named=True, stages=1)


def test_a_resume_from_the_command_line_into_a_starting_run_is_told_it_is_in_use(tmp_path, capsys):
    """The same through lab.run's command line, whose resume reads config.json before the
    folder is claimed: it said 'no run named …', though the run was compiling."""
    from lab.run import main

    (tmp_path / "lk").mkdir()
    with checkpoint.Lock(tmp_path / "lk"):
        assert main(["model=tiny", f"out_dir={tmp_path}", "name=lk", "resume=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is in use by pid" in err, err
    assert "no config.json yet" in err and "no run named" not in err, err


def test_the_learning_rate_schedule_is_not_in_the_step_time(tmp_path, monkeypatch):
    """The records' learning rates are computed a block of update counts at a time; the
    block's work (made slow here: each trace or eager call of the schedule sleeps) happens
    before the loop, so no step's time holds it, neither the first record's nor a later
    block's (blocks of 2 counts here: a new one every other step)."""
    real = loop.lr_schedule

    def slow(cfg):
        schedule = real(cfg)

        def rate(count):
            time.sleep(SLOW_S)
            return schedule(count)

        return rate

    monkeypatch.setattr(loop, "lr_schedule", slow)
    monkeypatch.setattr(loop._Rates, "BLOCK", 2)
    args = [*TINY, f"out_dir={tmp_path}", "name=lr", "steps=6"]
    assert main(args) == 0
    records = [json.loads(x) for x in (tmp_path / "lr" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step_s"] for r in records) < SLOW_S, records
    from lab.config import make_config

    schedule = real(make_config(model="tiny", steps=6, batch_size=8, seq_len=32))
    expected = [float(schedule(r["step"] - 1)) for r in records]
    assert [r["learning_rate"] for r in records] == pytest.approx(expected)


def test_off_a_terminal_each_logged_step_is_a_line_with_its_loss(tmp_path, capsys):
    """stdout a file or a pipe (a batch job's log, `| tee`): no live bar, so each logged step
    (every log_every, and the last) is one plain line, without terminal codes."""
    args = [*TINY[:-1], "log_every=3", f"out_dir={tmp_path}", "name=log", "steps=7"]
    assert main(args) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    records = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [3, 6, 7]
    assert len(lines) == 3 and "\x1b" not in out, out
    for line, r in zip(lines, records, strict=True):
        assert line.startswith(f"step {r['step']}/7  loss {r['loss']:.4f}  "), line
        assert " tok/s " in line and "/step  elapsed " in line and "  left " in line, line


def test_two_steps_read_together_share_their_time(monkeypatch):
    """A checkpoint step, the last step and the profile window's edges are read right after
    the step before them. On CPU the host may learn that the first has finished only once the
    second has (the runtime's threads were running it), so timed apart the second read ~0 and
    the first two steps' time: 85 µs against 8 ms steps, and an MFU of 3070 %, were seen.
    Read together, each is half of the time since the last step read."""
    import types

    from lab.config import make_config

    cfg = make_config(model="tiny", batch_size=8, seq_len=32, steps=10, log_every=1)
    bar = types.SimpleNamespace(add_task=lambda *a, **k: 0, step=lambda *a, **k: None)
    hist = loop.History()
    reader = loop._Reader(cfg, bar, None, None, hist, start=0)
    one = {k: jnp.float32(1.0) for k in ("loss", "grad_norm", "param_norm")}
    reader.clock = time.perf_counter() - 0.2  # the last step read 0.2 s ago
    t0 = reader.clock
    assert reader.read_both((4, one), (5, one)) is None
    since = time.perf_counter() - t0  # a host that pauses here makes both steps longer
    a, b = hist.step_s
    assert a == b and 0.1 <= a <= since / 2, (hist.step_s, since)
    assert reader.clock == pytest.approx(t0 + a + b)  # the next step's time starts there
    assert [s for s, _ in hist.losses] == [4, 5] and hist.step == 5


def test_which_steps_are_read_together(tmp_path, monkeypatch):
    """A checkpoint step and the last are read with the step before them, unless that one
    is one of the warm-up steps the summary leaves out (steps 1 and 2: their time stays
    theirs): checkpoints at 3 and 6 of 8 pair (5, 6) and (7, 8), not (2, 3)."""
    pairs = []
    real = loop._Reader.read_both

    def logged(self, before, this):
        pairs.append((before[0], this[0]))
        return real(self, before, this)

    monkeypatch.setattr(loop._Reader, "read_both", logged)
    args = [*TINY, f"out_dir={tmp_path}", "name=p", "steps=8", "checkpoint_every=3"]
    assert main(args) == 0
    assert pairs == [(5, 6), (7, 8)]
    lines = (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(1, 9))  # each read once

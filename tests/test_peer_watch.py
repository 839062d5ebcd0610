"""The lab's own beat between joined processes (lab.devices.PeerWatch): a peer gone quiet, or
a coordinator that stopped answering, ends a process in one line before the runtime's abort;
a peer that ended cleanly does not. A fake key-value store stands in for JAX's."""

import threading
import time

import pytest

from lab import devices


class Store:
    """The runtime client's key-value calls, over one dict shared by every process."""

    def __init__(self):
        self.kv, self.lock, self.down = {}, threading.Lock(), False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
        with self.lock:
            self.kv[key] = value

    def key_value_dir_get(self, prefix):
        if self.down:
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
        with self.lock:
            return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


def _join(pid, n=3):
    return devices._Join(
        where="coordinator=host:1234",
        coordinator="host:1234",
        num_processes=n,
        process_id=pid,
        start_hint="",
        kwargs={},
    )


@pytest.fixture
def ended(monkeypatch):
    """Each watch's end recorded (its line), not the process exited."""
    lines = {}

    def end(self, why):
        lines.setdefault(self.j.process_id, why)
        self.done.set()

    monkeypatch.setattr(devices.PeerWatch, "_end", end)
    return lines


def _watches(store, n=3, lost_s=2.0):
    """Watches judging a peer lost after `lost_s`: long beside the 20 ms beat, so a loaded host
    that pauses a beat thread is not taken for a lost peer."""
    return [
        devices.PeerWatch(store, _join(i, n), lost_s=lost_s, beat_s=0.02).start() for i in range(n)
    ]


def _wait(cond, timeout_s=15.0):
    t0 = time.monotonic()
    while not cond() and time.monotonic() - t0 < timeout_s:
        time.sleep(0.02)
    return cond()


def test_a_silent_peer_ends_the_others_and_is_named(ended):
    store = Store()
    w = _watches(store)
    time.sleep(0.2)
    w[2].done.set()  # process 2 dies: its beat stops, nothing posted
    assert _wait(lambda: len(ended) == 2)
    assert ended[0] == ended[1] == "process 2 has been silent for 2 s"
    assert 2 not in ended


def test_a_peer_that_ended_mid_run_is_lost_and_named_as_ended(ended):
    """A peer that left through Python (a refusal, a failed write) posts "done"; the others,
    still in their loops, would wait for it in their next collective: they end too."""
    store = Store()
    w = _watches(store)
    time.sleep(0.2)
    w[1].stop()
    assert store.kv[f"{devices.ALIVE_KEYS}1"] == "done"
    assert _wait(lambda: len(ended) == 2)
    assert ended[0] == ended[2] == "process 1 ended more than 2 s ago, mid-run"


def test_a_beat_on_its_way_when_the_process_stops_does_not_hide_its_done(ended):
    """The stop posts "done" while the beat thread's count is on its way to the store: the
    count lands after it, and without a second "done" the peers read a count that never moves
    again and name the peer silent (seen under load), not ended."""
    watches = []

    class Racing(Store):
        def key_value_set(self, key, value, allow_overwrite=False):
            if key.endswith("/1") and value != "done" and watches and not watches[1].done.is_set():
                watches[1].stop()  # posts "done" first; this count lands after it
            super().key_value_set(key, value, allow_overwrite)

    store = Racing()
    watches += _watches(store)
    assert _wait(lambda: watches[1].done.is_set())
    assert _wait(lambda: store.kv.get(f"{devices.ALIVE_KEYS}1") == "done")
    assert _wait(lambda: len(ended) == 2)
    assert ended[0] == ended[2] == "process 1 ended more than 2 s ago, mid-run"


def test_after_the_loop_no_peer_is_judged(ended):
    """Every process leaves its loop at the same step; what follows (the last save, a
    summary) may take any time: a peer done first is no loss then."""
    store = Store()
    w = _watches(store, lost_s=1.0)
    time.sleep(0.2)
    for x in w:
        x.idle.set()  # lab.devices.left_loop, for these watches
    w[1].stop()
    time.sleep(3.0)  # three times lost_s
    assert ended == {}
    for x in w:
        x.stop()


def test_a_coordinator_that_stops_answering_ends_every_process(ended):
    store = Store()
    _watches(store, n=2)
    time.sleep(0.2)
    store.down = True
    assert _wait(lambda: len(ended) == 2)
    assert ended[1] == "the coordinator (host:1234, process 0) has not answered for 2 s"


def test_a_peer_never_heard_from_is_named_after_twice_the_wait(ended):
    store = Store()
    lone = devices.PeerWatch(store, _join(0, 2), lost_s=1.0, beat_s=0.02).start()
    assert _wait(lambda: 0 in ended)
    assert ended[0] == "process 1 has been silent for 1 s"
    assert time.monotonic() - lone.started >= 2.0


def test_the_line_names_the_folder_and_exits_1(monkeypatch, capsys):
    codes = []
    monkeypatch.setattr(devices.os, "_exit", codes.append)
    w = devices.PeerWatch(Store(), _join(1, 2))
    w.kept = lambda: "kept in /r: checkpoint step 4 in /r/checkpoints"
    w._end("process 0 has been silent for 30 s")
    err = capsys.readouterr().err
    assert codes == [1] and err.count("\n") == 1
    assert err.startswith("error: coordinator=host:1234: process 1 of 2 lost its peers")
    assert err.rstrip().endswith(
        "cannot go on alone; kept in /r: checkpoint step 4 in /r/checkpoints"
    )


GLOO_RESET = (
    "UNKNOWN: Gloo all-reduce failed: [external/xla++third_party_ext+gloo/gloo/transport/tcp/"
    "pair.cc:538] Read error [127.0.0.1]:11680: Connection reset by peer"
)


def test_a_collective_that_failed_with_a_peer_gone_is_told_in_a_few_words(monkeypatch):
    """gloo fails a collective at once when a peer's connection drops: the words kept are
    gloo's own, without its source file, the runtime's status code or the message it was
    quoted in; one process, or another error, is not a peer gone."""
    assert devices.peer_gone(GLOO_RESET) is None  # no watch: one process
    monkeypatch.setattr(devices, "_WATCH", [object()])
    said = (
        "a collective failed, Gloo all-reduce failed: Read error [127.0.0.1]:11680: "
        "Connection reset by peer: a peer died, was killed or cannot be reached"
    )
    assert devices.peer_gone(RuntimeError(GLOO_RESET)) == said
    save = f"checkpoint step 20 could not be saved in /r/checkpoints ({GLOO_RESET})"
    assert devices.peer_gone(save) == said
    assert devices.peer_gone("Out of memory allocating 38400000772 bytes") is None
    # a storage write's own words, and a folder named like gloo, are not a peer gone
    for other in (
        "checkpoint step 20 could not be saved in /data/igloo/r/checkpoints (Input/output error)",
        "checkpoint step 5 could not be saved in runs/gloo2/checkpoints (ValueError: exists)",
        "checkpoint step 5 could not be saved in gs://b/r/checkpoints (Connection reset by peer)",
    ):
        assert devices.peer_gone(other) is None, other


def test_leaving_now_is_the_watchs_line_not_the_interpreters_exit(monkeypatch, capsys):
    """At the interpreter's exit JAX's runtime waits for every process in its shutdown
    barrier (30 s for one that is gone) and then aborts this one: leave_now exits at once."""
    codes = []
    monkeypatch.setattr(devices.os, "_exit", codes.append)
    w = devices.PeerWatch(Store(), _join(0, 2))
    w.kept = lambda: "kept in /r: metrics.jsonl to step 12"
    monkeypatch.setattr(devices, "_WATCH", [w])
    devices.leave_now(devices.peer_gone(GLOO_RESET))
    err = capsys.readouterr().err
    assert codes == [1] and err.count("\n") == 1 and w.idle.is_set()
    assert "lost its peers (a collective failed, Gloo all-reduce failed: Read error" in err
    assert err.rstrip().endswith("cannot go on alone; kept in /r: metrics.jsonl to step 12")


@pytest.mark.once
def test_a_process_started_by_hand_whose_peer_is_killed_ends_in_one_line(tmp_path):
    """Two lab.run processes joined by hand (no launcher to clean up): process 1 SIGKILLed
    mid-run. Process 0's next collective fails at once; it ends in the watch's line, exit 1,
    within seconds, not in a traceback and then the runtime's abort after its shutdown
    barrier (exit 134, 40-80 s)."""
    import os
    import signal
    import subprocess
    import sys

    from lab.tools.launch import free_port

    port = free_port()
    keys = [
        f"coordinator=127.0.0.1:{port}", "num_processes=2", "mesh=2x1", "model=tiny",
        "n_layers=1", "batch_size=4", "seq_len=16", "steps=100000", f"out_dir={tmp_path}",
        "name=r", "checkpoint_every=5", "log_every=1",
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "lab.run", *keys, f"process_id={i}"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        metrics = tmp_path / "r" / "metrics.jsonl"
        t0 = time.monotonic()
        while time.monotonic() - t0 < 240 and (
            not metrics.exists() or len(metrics.read_text().splitlines()) < 8
        ):
            assert procs[0].poll() is None, procs[0].communicate()[1][-3000:]
            time.sleep(0.2)
        os.kill(procs[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        _, err = procs[0].communicate(timeout=120)
        took = time.monotonic() - killed
    finally:
        for p in procs:
            p.kill()
            p.wait()
    last = err.strip().splitlines()[-1]
    assert procs[0].returncode == 1, err[-3000:]
    assert last.startswith(f"error: coordinator=127.0.0.1:{port}: process 0 of 2 lost its peers")
    assert "Traceback" not in err and "Check failure" not in err, err[-3000:]
    assert took < 40, took  # the watch's 30 s at most, at once where gloo sees the reset

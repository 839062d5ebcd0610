"""lab.tools.launch: two jax.distributed processes of four simulated devices each train exactly like
one process of eight; bad input and failing processes end with a clear non-zero exit."""

import io
import json
import sys
from pathlib import Path

import pytest

from lab.run import main as run_main
from lab.tools import launch

TINY = ["model=tiny", "n_layers=1", "batch_size=8", "seq_len=16", "log_every=1", "steps=3"]


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").open()]


def test_two_processes_train_like_one(tmp_path, capsys):
    args = [*TINY, "mesh=4x2", f"out_dir={tmp_path}"]
    assert launch.main(["processes=2", "timeout=120", *args, "name=two"]) == 0
    out = capsys.readouterr().out
    assert "[p0]" in out and "2 processes" in out  # the run header counts the hosts
    assert run_main([*args, "name=one"]) == 0
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(two) == 3
    assert two == pytest.approx(one, rel=1e-5)  # gloo may sum in another order


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["processes=3", "mesh=4x2"], "processes=3 does not divide the 8 devices"),
        (["processes=2", "mesh=4x2", "process_id=1"], "process_id: set by lab.tools.launch"),
        (["processes=2", "mesh=4x2", "stepz=3"], "unknown key 'stepz'"),
        (["processes=0", "mesh=4x2"], "must be >= 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    assert launch.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_one_failure_stops_the_others_and_sets_the_exit_code():
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    failer = [sys.executable, "-c", "print('boom'); raise SystemExit(3)"]
    out = io.StringIO()
    assert launch.run([sleeper, failer], timeout_s=30, out=out) == 3
    assert "[p1] boom" in out.getvalue()

"""What the commands set before JAX's backend starts: XLA's own log threshold."""

import os

import pytest

from lab import startup


@pytest.mark.parametrize(
    "argv, preset, want",
    [
        (["mesh=4x2"], None, "1"),  # a run: XLA's informational lines hidden
        (["target=gpu:h100", "model=1b"], None, "3"),  # a plan: its warnings about the target too
        (["target="], None, "1"),  # an empty target is no plan (its key's own check says so)
        (["target=tpu:v5e:2x4"], "0", "0"),  # what the user set is kept
    ],
)
def test_the_native_log_level_follows_the_command(monkeypatch, argv, preset, want):
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    if preset is not None:
        monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", preset)
    startup.native_log_level(argv)
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == want

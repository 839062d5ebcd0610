"""Records carry the environment they were measured in, and append as JSON Lines."""

import json

import jax
import pytest

from lab.measure import records


def test_record_carries_metadata():
    r = records.make_record("matmul", 1.5e11, "FLOP/s", dtype="float32", n=2048)
    assert (r["what"], r["value"], r["unit"], r["label"]) == (
        "matmul",
        1.5e11,
        "FLOP/s",
        "measured",
    )
    assert r["config"] == {"dtype": "float32", "n": 2048}
    assert r["backend"] == jax.default_backend()
    assert r["device_kind"] == jax.devices()[0].device_kind
    assert r["device_count"] == len(jax.devices())
    assert r["jax_version"] == jax.__version__
    for key in ("jaxlib_version", "flax_version", "hostname", "timestamp", "python_version"):
        assert r[key], key
    assert "load_avg_1m" in r
    json.dumps(r)  # serialisable as is


def test_labels_are_checked():
    assert records.make_record("x", 1, "s", label="predicted")["label"] == "predicted"
    with pytest.raises(ValueError, match="label"):
        records.make_record("x", 1, "s", label="guessed")


def test_write_appends_and_reads_back(tmp_path):
    path = tmp_path / "sub" / "r.jsonl"
    records.write_records(path, records.make_record("a", 1, "s"))
    records.write_records(
        path, [records.make_record("b", 2, "s"), records.make_record("c", 3, "s")]
    )
    got = records.read_records(path)
    assert [r["what"] for r in got] == ["a", "b", "c"]
    assert len(path.read_text().splitlines()) == 3

"""The scaling, extrapolation and remat experiments produce labelled records from real compiled
steps (tiny size, dp only: the machinery, not the numbers), tables and a plot."""

import pytest
from rich.console import Console

from lab.measure.scaling import ScalingStudy
from lab.report import plots, tables
from lab.studies import scaling
from lab.tools import scaling as scaling_tool


@pytest.fixture(scope="module")
def calls():
    labels, studies = [], []
    study = scaling.run("tiny", strategies=("dp",), progress=labels.append, done=studies.append)
    return study, labels, studies


@pytest.fixture(scope="module")
def study(calls):
    return calls[0]


def test_every_point_is_announced_and_handed_over_as_it_ends(calls):
    """A stop keeps every finished point, not only finished experiments: `done` gets the
    study after each point, each one row longer than the last."""
    study, labels, studies = calls
    assert len(labels) == scaling.points_planned("tiny", ("dp",)) == len(studies)
    assert labels[0] == "strong scaling: dp on 1 device"
    rows = [
        len(s.strong) + len(s.extrapolated) // len(study.extrapolated) + len(s.remat)
        for s in studies
    ]
    assert rows == list(range(1, len(studies) + 1))
    assert studies[-1] == study


@pytest.fixture(scope="module")
def recs(study):
    return study.records()


def _values(recs, experiment, what):
    return {
        tuple(sorted((k, v) for k, v in r["config"].items() if k in ("devices", "remat"))): r
        for r in recs
        if r["config"].get("experiment") == experiment and r["what"] == what
    }


def test_scaling_records_per_device_count(recs):
    steps = _values(recs, "scaling", "step time")
    assert sorted(k[0][1] for k in steps) == [1, 2]
    assert all(r["value"] > 0 and r["label"] == "measured" for r in steps.values())
    mem = {k[0][1]: r["value"] for k, r in _values(recs, "scaling", "memory per device").items()}
    assert mem[2] < mem[1]  # dp halves the activations per device
    comm = _values(recs, "scaling", "collective time (HLO bytes / measured busbw)")
    assert all(r["label"] == "derived" for r in comm.values())
    assert comm[(("devices", 1),)]["value"] == 0 < comm[(("devices", 2),)]["value"]


def test_extrapolation_is_labelled_and_bounded(recs):
    eff = [r for r in recs if r["config"].get("experiment") == "dp extrapolation"]
    assert {r["config"]["devices"] for r in eff} == set(scaling.EXTRAPOLATE_TO)
    assert all("extrapolated" in r["what"] and r["label"] == "predicted" for r in eff)
    assert all(0 < r["value"] <= 1 for r in eff)
    assert "measured here" in eff[0]["config"]["bandwidth_source"]  # CPU: no spec entry


def test_remat_records_from_the_compiled_step(recs):
    peak = _values(recs, "remat", "peak memory per device")
    assert {dict(k)["remat"] for k in peak} == {"none", "full"}
    temp = {dict(k)["remat"]: r["config"]["temp_bytes"] for k, r in peak.items()}
    assert temp["full"] <= temp["none"]


def test_the_rows_are_their_records(study, recs):
    """Each row's fields are its records' figures; the records read back are the same rows,
    and give back the same records."""
    assert [(p.strategy, p.devices) for p in study.strong] == [("dp", 1), ("dp", 2)]
    one = study.strong[0]
    assert one.step_s == _values(recs, "scaling", "step time")[(("devices", 1),)]["value"]
    assert study.simulated and all(0 < p.efficiency <= 1 for p in study.extrapolated)
    assert [p.remat for p in study.remat] == ["none", "full"]
    again = ScalingStudy.from_records(recs)
    assert again == study and again.records() == recs


def test_tables_and_plot(study, tmp_path):
    console = Console(record=True, width=140)
    for table in tables.scaling(study):
        console.print(table)
    text = console.export_text()
    assert "EXTRAPOLATED" in text and "simulated CPU devices" in text
    assert plots.scaling_study(study, tmp_path / "s.png", "t").stat().st_size > 0


def test_meshes_and_bad_input(capsys):
    assert scaling.mesh_spec("tp", 8) == "data:4,model:2"
    assert scaling.mesh_spec("fsdp", 4) == "fsdp:4"
    assert scaling_tool.main(["strategies=zero3"]) == 2
    assert "zero3" in capsys.readouterr().err
    with pytest.raises(ValueError, match="size='huge'"):
        scaling.run("huge")


def test_one_device_extrapolates_nothing_it_did_not_measure(monkeypatch):
    """With one device no all-reduce is measured: the extrapolation's efficiencies are
    unknown (no 100% from max(compute, NaN)), the records hold no NaN, the table says why."""
    import dataclasses
    import json
    import types

    monkeypatch.setattr(scaling.jax, "device_count", lambda: 1)
    fake = types.SimpleNamespace(step=types.SimpleNamespace(median_s=0.01), grad_bytes=1 << 20)
    monkeypatch.setattr(scaling, "measure_step", lambda *a, **k: fake)
    size = dataclasses.replace(scaling.SIZES["tiny"], device_counts=(1,))
    rows = scaling.extrapolate(size)
    assert rows and all(r.efficiency is None and r.efficiency_overlap is None for r in rows)
    for r in rows:
        for rec in r.records():
            json.loads(json.dumps(rec, allow_nan=False))  # strict JSON: no NaN anywhere
    study = ScalingStudy(extrapolated=rows)
    console = Console(record=True, width=200)
    for t in tables.scaling(study):
        console.print(t)
    assert "not extrapolated (one device: no all-reduce to measure)" in console.export_text()


def test_the_extrapolation_states_its_error_on_the_dp_step_measured_where_it_can(monkeypatch):
    """The model (one device's compute + the ring all-reduce at the measured bandwidth) is
    held against dp's step measured on the devices that bandwidth came from; the table says
    the ratio, and that without such a step its error is unchecked."""
    import dataclasses
    import types

    from lab.measure.scaling import StrongPoint

    monkeypatch.setattr(scaling.jax, "device_count", lambda: 2)
    monkeypatch.setattr(scaling, "make_mesh", lambda *a, **k: None)
    fake = types.SimpleNamespace(step=types.SimpleNamespace(median_s=0.010), grad_bytes=1 << 20)
    monkeypatch.setattr(scaling, "measure_step", lambda *a, **k: fake)
    monkeypatch.setattr(scaling, "dp_bandwidth", lambda *a: (2**30, "measured here"))
    size = dataclasses.replace(scaling.SIZES["tiny"], device_counts=(1, 2))  # batch 8: 4 a device
    dp2 = StrongPoint("dp", 2, "data:2", 0.0125, None, None, None, True)
    fsdp2 = StrongPoint("fsdp", 2, "fsdp:2", 1.0, None, None, None, True)
    rows = scaling.extrapolate(size, (fsdp2, dp2))
    comm = 2 * (1 << 20) * (2 - 1) / 2 / 2**30  # the ring all-reduce of 1 MiB over 2 devices
    want = {"devices": 2, "predicted_s": 0.010 + comm, "measured_s": 0.0125}
    for r in rows:
        assert {k: r.check[k] for k in want} == pytest.approx(want)
        assert r.check["ratio"] == pytest.approx((0.010 + comm) / 0.0125)
        assert all(rec["config"]["check"] == r.check for rec in r.records())
    console = Console(record=True, width=400)
    for t in tables.scaling(ScalingStudy(extrapolated=rows)):
        console.print(t)
    text = " ".join(console.export_text().split())
    assert "the model's error where it can be checked, 2 devices here: a step of 10.98 ms" in text
    assert "12.50 ms measured for dp on 2 devices (×0.88)" in text, text
    # no dp step on those devices: nothing to hold it against, and the table says so
    unchecked = scaling.extrapolate(size, ())
    assert all(r.check is None for r in unchecked)
    console = Console(record=True, width=400)
    for t in tables.scaling(ScalingStudy(extrapolated=unchecked)):
        console.print(t)
    assert "its error is unchecked here" in " ".join(console.export_text().split())


def test_the_size_help_says_what_each_size_runs(capsys):
    """size= named tiny | quick | full and nothing else: the help says what each is for and
    the model, shape, device counts and time each runs, from the sizes themselves."""
    from lab.studies import scaling as study
    from lab.tools import scaling as tool

    assert tool.main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "tiny checks the code path" in text and "full for an accelerator" in text
    for name, size in study.SIZES.items():
        assert f"{name}: {size.summary()}" in text
    assert "quick: the tiny model, batch 16 × seq 64, on 1,2,4,8 devices" in text


def test_device_counts_beyond_the_devices_here_are_named_not_dropped_unseen(monkeypatch):
    monkeypatch.setattr(scaling.jax, "device_count", lambda: 1)
    assert scaling.skipped_counts("tiny") == [
        n for n in scaling.SIZES["tiny"].device_counts if n > 1
    ]
    monkeypatch.setattr(scaling.jax, "device_count", lambda: 64)
    assert scaling.skipped_counts("tiny") == []

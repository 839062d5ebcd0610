"""experiments.compare on hand-built results folders (a run.json and a few records each): whose
each figure is, what is refused and why, and what a folder's column says it did not judge."""

import json
import os

from experiments import compare
from lab.measure import records as rec


def _folder(path, records, *, backend="cpu", kind="cpu", host="vm", jax="0.12.0", run=None):
    """A results folder as python -m experiments writes it: records.jsonl and run.json."""
    path.mkdir(parents=True)
    for r in records:
        r.update(backend=backend, device_kind=kind, device_count=1, hostname=host, jax_version=jax)
    rec.write_records(path / "records.jsonl", records)
    (path / "run.json").write_text(json.dumps({"size": "tiny"} if run is None else run))
    return path


def _error(scale: float = 1.0) -> dict:
    """C08's deciding figure: flash attention's largest error (the lab's measured kind)."""
    return rec.make_record(
        "blockwise: largest error against the float64 reference", 1.09e-6 * scale, "max |Δ|",
        label="derived", claim="C08", metric="flash_max_error", role="evidence",
    )  # fmt: skip


def _time(ms: float) -> dict:
    return rec.make_record(
        "blockwise fwd+bwd, L=256", ms * 1e-3, "s", claim="C08", metric=None, role="context"
    )


def _datasheet() -> dict:
    """A reference figure every folder carries alike (a spec-table ratio, nothing measured)."""
    return rec.make_record(
        "MI300X over H100, bf16 datasheet peaks (reference, not measured)", 1.3212733703890853,
        "×", label="derived", claim="C19", metric="mi300x_over_h100", role="reference",
        target="mi300x",
    )  # fmt: skip


def _train(tokens_per_s: float) -> dict:
    return rec.make_record(
        "training tokens/s", tokens_per_s, "tokens/s", claim="C17", metric=None,
        role="context", series="train_throughput", params=115008, batch=2, seq_len=32,
    )  # fmt: skip


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_folders_of_one_name_get_columns_of_their_own(tmp_path):
    """Two CPU folders both called run (hostA/run, hostB/run) were one column, one colour and
    one series: the path that tells them apart is added, the host where their records name
    different ones, and a name made so is checked again against the others."""
    a = _folder(tmp_path / "hostA" / "run", [_error(), _time(2.4)])
    b = _folder(tmp_path / "hostB" / "run", [_error(1.1), _time(2.3)])
    result = compare.merge([a, b], tmp_path / "cmp")
    names = [f["name"] for f in result["folders"]]
    assert names == ["cpu · cpu · tiny · hostA/run", "cpu · cpu · tiny · hostB/run"]
    merged = rec.read_records(result["dir"] / "records.jsonl")
    assert {r["machine"] for r in merged} == set(names)

    c = _folder(tmp_path / "c" / "run", [_time(2.0)], host="node-1")
    d = _folder(tmp_path / "d" / "run", [_time(2.1)], host="node-2")
    result = compare.merge([c, d], tmp_path / "cmp")
    assert [f["name"] for f in result["folders"]] == [
        "cpu · cpu · tiny · node-1",
        "cpu · cpu · tiny · node-2",
    ]

    def made(name, path):
        return {"name": name, "dir": tmp_path / path, "records": [{"hostname": "vm"}]}

    # "m · run" (from x/run) meets the third folder's own name: told apart again
    folders = [made("m", "x/run"), made("m", "y/z"), made("m · run", "w/q")]
    compare.name_columns(folders)
    assert len({f["name"] for f in folders}) == 3, [f["name"] for f in folders]


def test_the_same_records_twice_are_refused_naming_both_folders(tmp_path, capsys, monkeypatch):
    """A copy of one folder merged as a second machine counted every record twice ("2 of 2"
    predictions that were one); a comparison given beside one of its own inputs did the same,
    and lost its inputs' sizes. Both are refused with one line."""
    a = _folder(tmp_path / "a", [_error(), _time(2.4)])
    b = _folder(tmp_path / "b", [_error(1.1), _time(2.3)])
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("records.jsonl", "run.json"):
        (copy / name).write_bytes((a / name).read_bytes())
    assert compare.main([f"dirs={a},{copy}", f"out_dir={tmp_path / 'out'}"]) == 2
    err = _one_line_error(capsys)
    assert f"{a} and {copy} hold the same records (2 of the 2" in err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())

    assert compare.main([f"dirs={a},{b}", f"out_dir={tmp_path / 'cmp'}"]) == 0
    (made,) = (tmp_path / "cmp").iterdir()
    capsys.readouterr()
    assert compare.main([f"dirs={made},{a}", f"out_dir={tmp_path / 'cmp'}"]) == 2
    err = _one_line_error(capsys)
    assert "a comparison" in err and f"give the folders it merged ({a}, {b})" in err
    # given relative to where it ran, its sources are still named so that they can be found
    monkeypatch.chdir(tmp_path)
    assert compare.main([f"dirs={a.name},{b.name}", "out_dir=cmp2"]) == 0
    (made,) = (tmp_path / "cmp2").iterdir()
    monkeypatch.chdir(a)
    capsys.readouterr()
    assert compare.main([f"dirs={made}", f"out_dir={tmp_path / 'cmp'}"]) == 2
    assert f"give the folders it merged ({a}, {b})" in _one_line_error(capsys)
    bare = tmp_path / "bare"  # a comparison's records without its run.json
    bare.mkdir()
    (bare / "records.jsonl").write_bytes((made / "records.jsonl").read_bytes())
    assert compare.main([f"dirs={bare}", f"out_dir={tmp_path / 'cmp'}"]) == 2
    assert "a comparison's records" in _one_line_error(capsys)


def test_two_runs_that_share_only_computed_figures_are_two_runs(tmp_path):
    """A datasheet ratio is the same record in two runs on one host in one second: that
    alone is no copy, while each folder's timed figures are its own."""
    sheet = _datasheet()  # one record, as two runs in one second write it: no clock race
    a = _folder(tmp_path / "a", [dict(sheet), _time(2.4)])
    b = _folder(tmp_path / "b", [dict(sheet), _time(2.3)])
    assert rec.read_records(a / "records.jsonl")[0] == rec.read_records(b / "records.jsonl")[0]
    assert len(compare.merge([a, b], tmp_path / "cmp")["folders"]) == 2


def test_another_commands_records_and_non_finite_values_are_refused(tmp_path, capsys):
    """A lab tool's records (lab.tools.ceilings': none names a claim) were listed as a
    machine whose every cell was "—"; a NaN was printed as a measured figure."""
    made = rec.make_record("matmul float32", 4e10, "FLOP/s")
    old = {k: v for k, v in made.items() if k != "command"}  # written before records named it
    tool = _folder(tmp_path / "tool", [old] * 3)
    a = _folder(tmp_path / "a", [_error(), _time(2.4)])
    assert compare.main([f"dirs={a},{tool}", f"out_dir={tmp_path / 'cmp'}"]) == 2
    err = _one_line_error(capsys)
    assert "none of its 3 records names a claim: a lab tool's records" in err
    assert "not python -m experiments'" in err
    named = _folder(tmp_path / "named", [{**made, "command": "lab.tools.ceilings"}])
    assert compare.main([f"dirs={a},{named}", f"out_dir={tmp_path / 'cmp'}"]) == 2
    assert "its one record names no claim: lab.tools.ceilings's records, not" in _one_line_error(
        capsys
    )

    mixed = _folder(tmp_path / "mixed", [_time(2.0), rec.make_record("copy", 1e10, "B/s")])
    assert compare.main([f"dirs={a},{mixed}", f"out_dir={tmp_path / 'cmp'}"]) == 2
    assert "records.jsonl, line 2: a record that names no claim" in _one_line_error(capsys)
    # one of the ledger's own records with its claim taken out: not another command's
    unnamed = {**_time(2.0), "command": "experiments"}
    unnamed["config"] = {k: v for k, v in unnamed["config"].items() if k != "claim"}
    edited = _folder(tmp_path / "edited", [_time(2.0), unnamed])
    assert compare.main([f"dirs={a},{edited}", f"out_dir={tmp_path / 'cmp'}"]) == 2
    said = _one_line_error(capsys)
    assert "line 2: a record of python -m experiments that names no claim: edited or" in said

    nan = _folder(tmp_path / "nan", [_time(2.0), _train(float("nan"))])
    assert compare.main([f"dirs={a},{nan}", f"out_dir={tmp_path / 'cmp'}"]) == 2
    assert "records.jsonl, line 2: value is nan, not a finite number" in _one_line_error(capsys)
    inf = _folder(tmp_path / "inf", [_time(float("inf"))])
    assert compare.main([f"dirs={a},{inf}", f"out_dir={tmp_path / 'cmp'}"]) == 2
    assert "line 1: value is inf" in _one_line_error(capsys)


def test_each_figure_names_its_machine_and_a_datasheet_figure_is_shown_once(tmp_path):
    """In the topic sections two folders' figures read alike ("1.09e-06 max |Δ| (*derived*,
    cpu, cpu × 8)" twice): each names its column; a reference figure every folder carries is
    one figure, shown once; the environment says which folder ran which JAX; the ratios
    derived across machines name the columns, not slugs."""
    cpu = _folder(tmp_path / "cpu", [_error(), _time(2.4), _datasheet(), _train(3e4)], jax="0.10.2")
    gpu = _folder(
        tmp_path / "gpu",
        [_error(1.1), _time(0.2), _datasheet(), _train(3e6)],
        backend="gpu",
        kind="NVIDIA H100 80GB HBM3",
        host="gpu-vm",
    )
    result = compare.merge([cpu, gpu], tmp_path / "cmp")
    text = result["path"].read_text()
    c, g = "cpu · cpu · tiny", "gpu · NVIDIA H100 80GB HBM3 · tiny"
    assert f"1.09e-06 max |Δ| ({c}: *derived*, cpu, cpu × 1)" in text
    assert f"1.2e-06 max |Δ| ({g}: *derived*, gpu, NVIDIA H100 80GB HBM3 × 1)" in text
    assert f"2.40 ms ({c}: *measured*, cpu, cpu × 1, context)" in text
    assert text.count("reference, not a verdict: MI300X over H100") == 1
    assert text.count("- MI300X over H100, bf16 datasheet peaks (reference, not measured): ") == 1
    assert f"- {c}: backend cpu, cpu × 1, jax 0.10.2" in text
    assert f"- {g}: backend gpu, NVIDIA H100 80GB HBM3 × 1, jax 0.12.0" in text
    assert f"training tokens/s, {g} over {c} (two machines)" in text
    assert "nvidia-h100" not in text
    assert f"`{cpu}`: {c}, 4 records" in text

    one = _folder(tmp_path / "one", [_time(1.0)])
    text = compare.merge([one], tmp_path / "cmp")["path"].read_text()
    assert f"`{one}`: {c}, 1 record\n" in text


def test_a_column_says_what_its_run_did_not_judge(tmp_path):
    """A bare "no record" said nothing of why: a claim the folder did not select, a topic it
    never reached, one that failed and one cut short by a signal (its own REPORT.md says which)
    each say so; and a folder of only=C02 is judged on C02 alone, as its own report is,
    though its training topic recorded other claims' figures too."""
    cut = _folder(
        tmp_path / "cut",
        [_time(2.0)],
        run={
            "size": "tiny",
            "only": ["C08", "C17"],
            "modules": {
                "attention": {"wall_s": 9, "records": 1, "error": None},
                "training": {"wall_s": 9, "records": 0, "error": "cut short by SIGTERM: none"},
            },
        },
    )
    failed = _folder(
        tmp_path / "failed",
        [_error(), _time(2.4)],
        run={
            "size": "tiny",
            "only": None,
            "modules": {"attention": {"wall_s": 1, "records": 2, "error": "RuntimeError: x"}},
        },
    )
    result = compare.merge([cut, failed], tmp_path / "cmp")
    text = result["path"].read_text()
    grid = text[text.index("## Verdicts per machine") : text.index("# Claims ledger")]
    rows = {
        line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:]
        for line in grid.splitlines()
        if line.startswith("| C")
    }
    assert rows["C17"][:2] == ["cut short", "not run"]
    assert rows["C01"][:2] == ["not selected (only=C08,C17)", "not run"]
    assert rows["C08"][:2] == ["n/a here", "holds (attention failed)"]

    alone = _folder(
        tmp_path / "alone",
        [rec.make_record("step tokens/s", 3e4, "tokens/s", claim=c, metric=None, role="context")
         for c in ("C02", "C04", "C15")],
        run={"size": "tiny", "only": ["C02"], "modules": {"training": {"error": None}}},
    )  # fmt: skip
    verdicts = compare.merge([alone], tmp_path / "cmp")["verdicts"]
    assert [v.claim.id for v in verdicts] == ["C02"]


def test_a_damaged_folder_says_the_way_forward_and_a_link_is_named_as_one(tmp_path, capsys):
    a = _folder(tmp_path / "a", [_error(), _time(2.4)])
    b = _folder(tmp_path / "b", [_error(1.1), _time(2.3), _time(2.5)])
    text = (b / "records.jsonl").read_text()
    (b / "records.jsonl").write_text(text[:-200])
    assert compare.main([f"dirs={a},{b}", f"out_dir={tmp_path / 'cmp'}"]) == 2
    err = _one_line_error(capsys)
    assert "line 3: not JSON (cut short" in err
    assert err.rstrip().endswith("the 2 records before it are whole: remove line 3 to use them")
    link = tmp_path / "link"
    os.symlink(a, link)
    assert compare.main([f"dirs={a},{link}", f"out_dir={tmp_path / 'cmp'}"]) == 2
    err = _one_line_error(capsys)
    assert err == f"error: {link} is the same folder as {a} in dirs=: each folder is merged once\n"


def test_the_closing_line_counts_in_words_that_agree(tmp_path, capsys):
    a = _folder(tmp_path / "a", [_time(1.0)])
    assert compare.main([f"dirs={a}", f"out_dir={tmp_path / 'cmp'}"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("1 record from 1 folder → ")


def test_a_missing_or_damaged_run_json_is_refused_naming_it(tmp_path, capsys):
    """run.json alone says a run's size and the claims it selected (the records carry
    neither): a damaged, missing or mistyped one let a tiny run's verdicts pass as a real
    run's (no "tiny" in the column, no caution) and an only=C03 run be judged on every claim;
    a FIFO named run.json hung the read."""
    a = _folder(tmp_path / "a", [_error(), _time(2.4)])
    run = a / "run.json"
    cases = {
        '{"size": "tiny", "mod': "run.json: not JSON (",
        "[]": "run.json: not a JSON object (a list)",
        "{}": "run.json: no size, not one of tiny, quick, full",
        '{"size": 1}': "run.json: size is 1, not one of tiny, quick, full",
        '{"size": "tiny", "only": "C03"}': 'run.json: only is "C03", not null or a list of',
        '{"size": "tiny", "only": ["C99"]}': 'run.json: only is ["C99"], not null or a list',
        '{"size": "tiny", "modules": []}': "run.json: modules is not an object of topics",
    }
    for text, why in cases.items():
        run.write_text(text)
        assert compare.main([f"dirs={a}", f"out_dir={tmp_path / 'cmp'}"]) == 2, text
        assert why in _one_line_error(capsys), text
    run.unlink()
    assert compare.main([f"dirs={a}", f"out_dir={tmp_path / 'cmp'}"]) == 2
    err = _one_line_error(capsys)
    assert f"{run}: missing" in err and '{"size": "tiny|quick|full", "only": null}' in err
    stamped = _time(2.0)
    stamped["config"]["size"] = "tiny"
    a2 = _folder(tmp_path / "a2", [stamped])
    (a2 / "run.json").write_text('{"size": "quick"}')  # another run's, say
    assert compare.main([f"dirs={a2}", f"out_dir={tmp_path / 'cmp'}"]) == 2
    err = _one_line_error(capsys)
    assert "run.json: size quick, but its records were measured at size tiny" in err
    os.mkfifo(run)  # opened for reading, it would wait for a writer forever
    assert compare.main([f"dirs={a}", f"out_dir={tmp_path / 'cmp'}"]) == 2
    assert f"{run}: not a regular file" in _one_line_error(capsys)
    assert not (tmp_path / "cmp").exists() or not list((tmp_path / "cmp").iterdir())


def test_a_record_of_an_unknown_claim_or_label_is_refused_naming_its_line(tmp_path, capsys):
    """A record of claim C99 was dropped unseen and a made-up label shown as `*guessed*`, as if
    it said how the figure was obtained: each is refused, naming the line and what is known."""
    guessed = {**_time(2.4), "label": "guessed"}
    unknown = _time(2.5)
    unknown["config"]["claim"] = "C99"
    for bad, why in (
        (
            guessed,
            "line 2: label 'guessed' is none of the lab's: 'measured', 'compiled', 'predicted'",
        ),
        (unknown, "line 2: claim 'C99' is none of the ledger's: C01, C02,"),
    ):
        name = bad["config"]["claim"]
        a = _folder(tmp_path / name / bad["label"], [_error(), bad])
        assert compare.main([f"dirs={a}", f"out_dir={tmp_path / 'cmp'}"]) == 2
        err = _one_line_error(capsys)
        assert f"{a / 'records.jsonl'}, {why}" in err, err


def test_a_record_the_ledger_cannot_read_is_refused_naming_its_line(tmp_path, capsys):
    """A name the ledger groups by that is not text stopped compare with a TypeError; a figure
    in another unit than its claim's range was judged in the range's unit; a negative count
    was 'x inf below' its range; an integer past a float's range an OverflowError."""
    listed = _error()
    listed["config"]["claim"] = ["C08"]
    host = _error()
    other_unit = {**_error(), "unit": "furlongs"}
    negative = {**_error(), "value": -5.0}
    huge = {**_error(), "value": 10**400}
    for name, bad, why in (
        ("listed", listed, "config.claim is a list, not a string"),
        ("host", host, "hostname is a list, not a string"),
        ("unit", other_unit, "unit 'furlongs', but flash_max_error of C08 is in 'max |Δ|'"),
        ("negative", negative, "value -5.0 is negative, where flash_max_error (max |Δ|) cannot"),
        ("huge", huge, "not a lab record (value is an integer past the largest number a float"),
    ):
        a = _folder(tmp_path / name, [_time(2.4), bad])
        if name == "host":  # _folder stamps every record's host: damage it after
            lines = (a / "records.jsonl").read_text().splitlines()
            lines[1] = lines[1].replace('"hostname": "vm"', '"hostname": ["vm"]')
            (a / "records.jsonl").write_text("\n".join(lines) + "\n")
        assert compare.main([f"dirs={a}", f"out_dir={tmp_path / 'cmp'}"]) == 2, name
        err = _one_line_error(capsys)
        assert f"{a / 'records.jsonl'}, line 2: {why}" in err, err
    # a fitted exponent may be negative: C08's memory slope below zero is a figure, not damage
    slope = rec.make_record(
        "flash memory exponent", -0.25, "exponent",
        label="derived", claim="C08", metric="flash_memory_exponent", role="evidence",
    )  # fmt: skip
    ok = _folder(tmp_path / "slope", [_error(), slope])
    assert compare.main([f"dirs={ok}", f"out_dir={tmp_path / 'cmp'}"]) == 0


def test_the_printed_table_says_the_host_was_busy_as_the_report_does(tmp_path, capsys):
    """REPORT.md said "Host busy" where the CPU figures were timed beside other work, and
    python -m experiments prints it under its table; compare printed no such caution."""

    def timed(load):
        return [{**_time(2.4), "load_avg_1m": load, "cpu_count": 2}]

    quiet = _folder(tmp_path / "quiet", timed(0.2), run={"size": "quick"})
    assert compare.main([f"dirs={quiet}", f"out_dir={tmp_path / 'cmp'}"]) == 0
    assert "busy" not in capsys.readouterr().out
    busy = _folder(tmp_path / "busy", timed(7.5), run={"size": "quick"})
    assert compare.main([f"dirs={busy}", f"out_dir={tmp_path / 'cmp'}"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the caution is wrapped to the table
    assert "host busy: 1 of 1 CPU measurements were timed while other work shared the host" in out
    assert "(load average up to 7.5 on 2 cores)" in out
    assert "Host busy" in (result := compare.merge([busy], tmp_path / "cmp"))["path"].read_text()
    # a busy tiny run beside a quiet quick one: its records are set aside from every verdict
    # of the claim, so its load casts no doubt on them (printed nor in REPORT.md)
    tiny = _folder(tmp_path / "tiny", [*timed(7.5), _error()], host="other")
    assert compare.main([f"dirs={quiet},{tiny}", f"out_dir={tmp_path / 'cmp'}"]) == 0
    assert "busy" not in capsys.readouterr().out
    result = compare.merge([quiet, tiny], tmp_path / "cmp")
    assert "Host busy" not in result["path"].read_text()
    kept = rec.read_records(result["dir"] / "records.jsonl")  # records.jsonl keeps it whole
    assert any(r.get("load_avg_1m") == 7.5 for r in kept)


def _grid(result) -> dict:
    """The verdict grid of a comparison's REPORT.md: claim id → its cells, merged last."""
    text = result["path"].read_text()
    grid = text[text.index("## Verdicts per machine") : text.index("# Claims ledger")]
    return {
        line.split(" | ")[0].lstrip("| "): [c.strip(" |") for c in line.split(" | ")[1:]]
        for line in grid.splitlines()
        if line.startswith("| C")
    }


def test_merged_judges_a_claim_from_the_folders_that_selected_it(tmp_path):
    """An only=C17 run whose topics recorded C08 as well: its column says "not selected", and
    the merged verdict on C08 read "holds" from that very folder's records; a GPU over CPU
    ratio was derived for C02 from a folder that did not select C02."""
    picked = _folder(
        tmp_path / "picked", [_error(), _train(3e4)], run={"size": "quick", "only": ["C17"]}
    )
    whole = _folder(tmp_path / "whole", [_train(2e4)], run={"size": "quick", "only": None})
    rows = _grid(compare.merge([picked, whole], tmp_path / "cmp"))
    assert rows["C08"] == ["not selected (only=C17)", "no record", "**no record**"]
    merged = rec.read_records(next((tmp_path / "cmp").iterdir()) / "records.jsonl")
    assert sum(r["config"].get("claim") == "C08" for r in merged) == 1  # kept, not judged

    # a ratio across folders judges its claim only from folders that selected it
    gpu = {"name": "gpu", "records": [{**_train(3e6), "backend": "gpu", "device_kind": "H100"}]}
    cpu = {"name": "cpu", "records": [{**_train(3e4), "backend": "cpu", "device_kind": "cpu"}]}
    (ratio,) = compare.derived([cpu, gpu])
    assert ratio["config"]["claim"] == "C02"
    assert compare.derived([{**cpu, "only": ["C17"]}, gpu]) == []


def test_a_tiny_folder_judges_no_claim_a_real_size_folder_has_records_of(tmp_path):
    """A tiny run's figures check that the studies run: beside a quick run's records of the
    same claim they were judged together with them; where only tiny folders have records of a
    claim, the merged cell says so."""
    quick = _folder(tmp_path / "quick", [_error(), _train(3e4)], run={"size": "quick"})
    tiny = _folder(tmp_path / "tiny", [_error(1e3), _train(2e4)], run={"size": "tiny"})
    rows = _grid(compare.merge([quick, tiny], tmp_path / "cmp"))
    verdict = rows["C08"][2].split("**")[1]  # the merged cell: verdict, then unjudged parts
    assert rows["C08"][0] == verdict != rows["C08"][1]  # the quick run's
    assert rows["C08"][2].endswith(
        "(1 of 3 parts; flash ÷ naive speed n/a here, flash memory's growth exponent no record)"
    )
    bare = _folder(tmp_path / "bare", [_train(3e4)], run={"size": "quick"})
    result = compare.merge([bare, tiny], tmp_path / "cmp")
    rows = _grid(result)
    assert rows["C08"][2] == f"**{rows['C08'][1]}** (size tiny only)"
    # the report's verdict table below the grid says it too
    text = result["path"].read_text().split("\n## Verdicts\n", 1)[1]
    (row,) = [line for line in text.splitlines() if line.startswith("| C08 |")]
    assert row.endswith(" (size tiny only) |"), row
    rows = _grid(compare.merge([tiny], tmp_path / "cmp"))  # all tiny: the caution says it
    assert "size tiny only" not in rows["C08"][1]


def test_a_ratio_across_folders_pairs_real_sizes_first_and_sets_tiny_ones_aside():
    """A GPU over CPU training ratio took the first CPU folder given, whatever its size: a
    tiny CPU folder before a quick one lost the quick pair's ratio (different steps), and a
    tiny GPU over tiny CPU ratio decided C02 beside a quick folder's records of it."""

    def folder(name, backend, size, tps, seq_len):
        r = {**_train(tps), "backend": backend, "device_kind": backend.upper()}
        r["config"] = {**r["config"], "seq_len": seq_len}
        return {"name": name, "size": size, "only": None, "records": [r]}

    cpu_tiny = folder("cpu-tiny", "cpu", "tiny", 2e2, 32)
    gpu_tiny = folder("gpu-tiny", "gpu", "tiny", 1e4, 32)
    cpu_quick = folder("cpu-quick", "cpu", "quick", 1e3, 256)
    gpu_quick = folder("gpu-quick", "gpu", "quick", 3e4, 256)
    (ratio,) = compare.derived([cpu_tiny, cpu_quick, gpu_quick])
    assert ratio["value"] == 30.0 and "gpu-quick over cpu-quick" in ratio["what"]
    # a real-size folder holds C02 records: the tiny pair's ratio is set aside
    cpu_quick_c02 = {**cpu_quick, "records": [*cpu_quick["records"], _c02_context()]}
    assert compare.derived([cpu_tiny, gpu_tiny, cpu_quick_c02]) == []
    # tiny folders alone: their ratio stands (the merged cell then says size tiny only)
    (tiny,) = compare.derived([cpu_tiny, gpu_tiny])
    assert tiny["value"] == 50.0


def _c02_context() -> dict:
    r = rec.make_record(
        "datasheet peak over this CPU's peak", 100.0, "×", claim="C02",
        metric="gpu_cpu_train_speedup", role="context", label="derived",
    )  # fmt: skip
    return {**r, "backend": "cpu", "device_kind": "CPU"}


def test_the_side_by_side_table_shows_only_figures_some_folder_holds():
    """Two folders of one claim printed every figure of the table as a row of dashes."""
    a = {"dir": "a", "name": "cpu · cpu · tiny", "records": [_error()]}
    b = {"dir": "b", "name": "cpu · cpu · quick", "records": [_error(2.0)]}
    assert compare.side_by_side([a, b]) == [
        "None of these folders holds a figure of this table (their claims measure others)."
    ]
    speedup = rec.make_record(
        "naive over flash attention time", 3.1, "×", claim="C08", metric="flash_speedup",
        role="evidence",
    )  # fmt: skip
    rows = compare.side_by_side([{**a, "records": [_error(), speedup]}, b])
    assert len(rows) == 3 and rows[2].startswith("| naive over flash attention time | "), rows

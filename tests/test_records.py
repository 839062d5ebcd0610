"""Records carry the environment they were measured in, and append as JSON Lines."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from lab.errors import ConfigError
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


def test_a_cpu_record_says_which_allocator_its_figure_had(monkeypatch):
    """On CPU a figure depends on the allocator (huge pages or the system's): each record
    says which, and the titles of the tools say huge pages where they were."""
    from lab.report import plots

    def environment(tunables: str) -> dict:  # read once per process: read again here
        monkeypatch.setenv("GLIBC_TUNABLES", tunables)
        records.environment.cache_clear()
        return records.environment()

    try:
        env = environment("glibc.malloc.hugetlb=1")
        assert env["allocator"] == ("huge pages" if env["backend"] == "cpu" else None)
        assert plots.host_name({**env, "backend": "cpu", "device_kind": "cpu"}) == (
            "cpu · allocator in huge pages"
        )
        env = environment("")
        assert env["allocator"] == ("system" if env["backend"] == "cpu" else None)
        assert plots.host_name({**env, "backend": "gpu", "device_kind": "H100"}) == "gpu · H100"
    finally:
        monkeypatch.undo()
        records.environment.cache_clear()


def test_labels_are_checked():
    assert records.make_record("x", 1, "s", label="predicted")["label"] == "predicted"
    with pytest.raises(ValueError, match="label") as e:  # each quoted: one has a comma
        records.make_record("x", 1, "s", label="guessed")
    assert "'measured', 'compiled', 'predicted', 'compiled, not run', 'derived'" in str(e.value)


def test_write_appends_and_reads_back(tmp_path):
    path = tmp_path / "sub" / "r.jsonl"
    records.write_records(path, records.make_record("a", 1, "s"))
    records.write_records(
        path, [records.make_record("b", 2, "s"), records.make_record("c", 3, "s")]
    )
    got = records.read_records(path)
    assert [r["what"] for r in got] == ["a", "b", "c"]
    assert len(path.read_text().splitlines()) == 3


def test_a_damaged_records_file_names_its_file_and_line(tmp_path):
    """A line cut short by a kill, bytes that are not text, JSON that is not a record: one
    ValueError naming the file and the line (the commands print it as one line)."""
    path = tmp_path / "records.jsonl"
    good = json.dumps(records.make_record("x", 1.0, "s"))
    cases = {
        good + "\n" + good[:40]: "line 2: not JSON (cut short",
        good + "\n[1, 2]\n": "line 2: not a lab record (a JSON list)",
        '{"value": 1}\n': "line 1: not a lab record (no what, unit",
        good.replace('"value": 1.0', '"value": "lots"'): "(value is a string, not a number)",
        good.replace('"value": 1.0', '"value": true'): "(value is true/false, not a number)",
        good.replace('"config": {', '"config": null, "c": {'): "(config is null, not an object)",
    }
    for text, want in cases.items():
        path.write_text(text)
        with pytest.raises(ValueError, match=re.escape(want)) as e:
            records.read_records(path)
        assert str(path) in str(e.value)
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="not UTF-8 text"):
        records.read_records(path)


def test_a_last_line_cut_short_says_the_records_before_it_can_be_kept(tmp_path):
    """A write stopped mid-line leaves the last line torn: the error says how many whole
    records come before it and that removing that line keeps them (the command still refuses
    the file: skipping a line unasked would drop a figure silently)."""
    path = tmp_path / "records.jsonl"
    good = json.dumps(records.make_record("x", 1.0, "s"))
    path.write_text((good + "\n") * 3 + good[:40])
    with pytest.raises(ValueError) as e:
        records.read_records(path)
    assert "line 4: not JSON (cut short" in str(e.value)
    assert str(e.value).endswith("; the 3 records before it are whole: remove line 4 to use them")
    path.write_text(good + "\n" + good[:40])
    with pytest.raises(ValueError, match="the record before it is whole: remove line 2 to use it"):
        records.read_records(path)
    path.write_text(good[:40])  # nothing before it: nothing to keep, no advice
    with pytest.raises(ValueError) as e:
        records.read_records(path)
    assert "remove" not in str(e.value)


def test_a_reader_can_refuse_well_formed_records_by_line(tmp_path):
    path = tmp_path / "records.jsonl"
    rows = [records.make_record("x", v, "s") for v in (1.0, 2.0)]
    records.write_records(path, rows)
    big = lambda r: "too big" if r["value"] > 1 else None  # noqa: E731
    with pytest.raises(ValueError, match=r"records.jsonl, line 2: too big$"):
        records.read_records(path, check=big)
    assert len(records.read_records(path)) == 2


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path):
    """fresh_dir never hands out a folder that exists: two runs never share one."""
    a, b, c = (records.fresh_dir(tmp_path, "cpu-cpu-20261129-101043") for _ in range(3))
    assert [p.name for p in (a, b, c)] == [
        "cpu-cpu-20261129-101043",
        "cpu-cpu-20261129-101043-2",
        "cpu-cpu-20261129-101043-3",
    ]
    with pytest.raises(ConfigError, match="empty folder name"):
        records.writable_dir("")


def test_output_stems_are_reserved_and_an_unused_reservation_is_dropped(tmp_path):
    """Two commands started in the same second never share a stem: output_stem creates the
    stem's .jsonl exclusively. One that wrote nothing leaves no empty file behind."""
    import datetime
    import subprocess
    import sys
    from unittest import mock

    frozen = datetime.datetime(2026, 11, 29, 10, 10, 43)
    with mock.patch.object(records.datetime, "datetime", wraps=datetime.datetime) as dt:
        dt.now.return_value = frozen
        stems = [records.output_stem(tmp_path, "bench") for _ in range(3)]
    base = f"bench-{jax.default_backend()}-20261129-101043"
    assert [s.name for s in stems] == [base, f"{base}-2", f"{base}-3"]
    assert all(s.with_suffix(".jsonl").exists() for s in stems)

    code = (
        "import sys; from lab.measure import records; "
        "a = records.output_stem(sys.argv[1], 'unused'); "
        "b = records.output_stem(sys.argv[1], 'used'); "
        "records.write_records(b.with_suffix('.jsonl'), records.make_record("
        "'x', 1.0, 's', label='measured'))"
    )
    out = tmp_path / "child"
    subprocess.run([sys.executable, "-c", code, str(out)], check=True, env=_cpu_env())
    left = sorted(p.name.split("-")[0] for p in out.iterdir())
    assert left == ["used"]


def _cpu_env():
    import os

    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def test_a_signal_after_a_commands_records_are_written_says_where(tmp_path, monkeypatch):
    """Once a command's reserved records file holds records, a signal's line says where they
    are (it said 'nothing was written' while a tool drew its plot)."""
    from lab import startup

    monkeypatch.setattr(startup, "_kept", ["nothing was written"])
    stem = records.output_stem(tmp_path, "t")
    records.write_records(tmp_path / "other.jsonl", {"what": "x"})  # not a reserved file
    assert startup._kept[0] == "nothing was written"
    path = records.write_records(stem.with_suffix(".jsonl"), {"what": "x"})
    assert startup._kept[0] == f"the records written so far are in {path}"


def test_a_skipped_points_reason_is_a_record(tmp_path):
    """The lab writes why a point was skipped as the value of a record of unit 'reason'."""
    path = tmp_path / "records.jsonl"
    records.write_records(path, records.make_record("tune_step skipped", "out of memory", "reason"))
    assert records.read_records(path)[0]["value"] == "out of memory"
    path.write_text(
        json.dumps({**records.make_record("skipped", "-", "reason"), "value": 3}) + "\n"
    )
    with pytest.raises(ValueError, match="value is a number, not a reason's text"):
        records.read_records(path)


def test_a_system_folder_that_takes_no_files_is_named_so():
    from lab.errors import ConfigError

    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    with pytest.raises(ConfigError, match="it takes no new files"):
        records.writable_dir("/proc/self")
    with pytest.raises(ConfigError, match="'/proc' takes no new files"):
        records.writable_dir("/proc/lab-results")


def test_a_folder_name_longer_than_the_file_system_takes_is_one_line(tmp_path):
    """out_dir= with a 300-byte name: Python 3.11's exists() raises ENAMETOOLONG itself."""
    from lab.errors import ConfigError

    with pytest.raises(ConfigError, match="File name too long"):
        records.writable_dir(tmp_path / ("x" * 300) / "results")


def test_numpy_and_jax_numbers_are_written_as_numbers(tmp_path):
    """A value or a config entry that is a NumPy or JAX number (or a 0-d array) is stored as
    the Python number, and a dtype by its name, so the file reads back; JSON would otherwise
    get their text ("1.5", "<class 'jax.numpy.float32'>"), which no reader takes."""
    import jax.numpy as jnp
    import numpy as np

    path = tmp_path / "r.jsonl"
    values = [np.float32(1.5), jnp.float32(1.5), np.int64(3), jnp.asarray(2.5), np.array(7)]
    values.append(jnp.asarray(1.5, jnp.bfloat16))  # an ml_dtypes float: no np.floating
    config = dict(dtype=jnp.float32, kind=np.dtype("int8"), bf=jnp.bfloat16, n=np.int32(4))
    for v in values:
        records.write_records(path, records.make_record("x", v, "s", **config))
    got = records.read_records(path)
    assert [r["value"] for r in got] == [1.5, 1.5, 3, 2.5, 7, 1.5]
    assert all(type(r["value"]) in (int, float) for r in got)
    assert got[0]["config"] == {"dtype": "float32", "kind": "int8", "bf": "bfloat16", "n": 4}
    # a hand-built record goes through the writer's hook alike
    records.write_records(path, {**got[0], "value": np.float32(0.25), "config": {"d": np.float16}})
    assert records.read_records(path)[-1]["value"] == 0.25
    assert records.read_records(path)[-1]["config"] == {"d": "float16"}


@pytest.mark.parametrize("value", ["1.5", [1.0], True, np.bool_(True), np.arange(3), 1 + 2j])
def test_a_value_that_is_not_a_number_is_refused_when_made(value):
    with pytest.raises(ValueError, match=r"^record 'x': value=.* is not a number"):
        records.make_record("x", value, "s")


def test_a_reason_is_text():
    assert records.make_record("x", "no kernel", "reason")["value"] == "no kernel"
    with pytest.raises(ValueError, match="reason must be text"):
        records.make_record("x", 1.0, "reason")


def test_a_busy_host_note_says_times_come_out_high_and_rates_low(monkeypatch):
    """Other work on the host takes cores from what is timed: its times grow and the rates
    computed from them shrink; a quiet host gets no note."""
    monkeypatch.setattr(records.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(records, "_load_avg", lambda: 1.4)
    note = records.busy_note()
    assert note == (
        "host load average 1.4 on 2 cores: other work shares them, so times will come out "
        "high and rates low, both noisy"
    )
    assert "the ceilings (peaks) low" in records.busy_note("times", "the ceilings (peaks)")
    monkeypatch.setattr(records, "_load_avg", lambda: 0.5)
    assert records.busy_note() == ""


def test_the_busy_count_takes_times_and_rates_not_amounts():
    """A device count or a host's memory is measured but not timed: a busy host leaves it as
    it is, so "2 of 2 CPU measurements were timed while other work shared the host" over two
    such records was a caution about nothing timed."""

    def made(value, unit, load):
        r = records.make_record("x", value, unit)
        return {**r, "backend": "cpu", "load_avg_1m": load, "cpu_count": 2}

    amounts = [made(8, "devices", 3.0), made(2**34, "B", 3.0), made(2.5, "loss", 3.0)]
    amounts += [made("no kernel here", "reason", 3.0), made(None, "s", 3.0)]  # nothing timed
    assert records.busy_records(amounts) == (0, 0, 0.0, 0)
    timed = [made(0.2, "s", 3.0), made(1e9, "FLOP/s", 0.5)]
    assert records.busy_records(amounts + timed) == (1, 2, 3.0, 2)


def test_a_record_names_the_command_that_wrote_it(tmp_path):
    """`python -m lab.tools.ceilings` writes records that say lab.tools.ceilings wrote them,
    so a reader handed the wrong file can say whose it is."""
    script = (
        "import json, sys; from lab.measure import records as r; "
        "json.dump(r.make_record('x', 1.0, 's'), sys.stdout)"
    )
    pkg = tmp_path / "writer"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{Path(records.__file__).parents[2]}"}
    out = subprocess.run(
        [sys.executable, "-m", "writer"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["command"] == "writer"


def test_a_full_disk_leaves_no_half_written_record_and_is_one_line(tmp_path):
    """A write the file system cuts short part way (here RLIMIT_FSIZE: room for half of the
    next records, EFBIG after): the lines written before stay whole, the torn one is taken
    back, and the error is a RunError (one line, exit 1), not an OSError traceback. In a
    process of its own: the limit is the whole process's."""
    import subprocess
    import sys

    path = tmp_path / "r.jsonl"
    code = f"""
import os, resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error from write(), not a killed process
from lab.errors import RunError
from lab.measure import records
path = {str(path)!r}
records.write_records(path, records.make_record("kept", 1.0, "s"))
room = os.path.getsize(path) + 100
resource.setrlimit(resource.RLIMIT_FSIZE, (room, room))
try:
    records.write_records(path, [records.make_record(f"lost {{i}}", 1.0, "s") for i in range(3)])
except RunError as e:
    print(e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "cannot write records to" in out.stdout and "File too large" in out.stdout, out
    assert "(3 records not written, the earlier ones kept)" in out.stdout, out.stdout
    (line,) = path.read_text().splitlines()  # the first record, whole; nothing after it
    assert json.loads(line)["what"] == "kept"


def test_output_that_can_take_no_more_goes_quiet_and_other_errors_still_raise():
    """A terminal that hung up (EIO) or a log on a full disk (ENOSPC) is a lost reader, as a
    closed pipe is: the command goes on writing its records; any other error is raised."""
    import errno

    from lab.report import progress

    class Stream:
        def __init__(self, code):
            self.code, self.fileno = code, lambda: -1

        def write(self, text):
            raise OSError(self.code, os.strerror(self.code))

        def flush(self):
            raise OSError(self.code, os.strerror(self.code))

        def isatty(self):
            return True

    for code in (errno.EPIPE, errno.EIO, errno.ENOSPC):
        out = progress._Unread(Stream(code))
        assert out.write("step 1\n") == 7 and not out.isatty()
        out.flush()  # quiet from now on
    with pytest.raises(OSError, match="Bad file descriptor"):
        progress._Unread(Stream(errno.EBADF)).write("x")


def test_a_plot_the_disk_cannot_take_is_one_line_and_leaves_no_half_png(tmp_path, monkeypatch):
    import errno

    from lab.errors import RunError
    from lab.report import plots

    fig = plots._plt().figure()

    def full(path, **kw):
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fig, "savefig", full)
    with pytest.raises(RunError, match=r"cannot write the plot .*p\.png: No space left on device"):
        plots._save(fig, tmp_path / "p.png")
    assert not (tmp_path / "p.png").exists()


def test_a_folder_that_is_a_link_to_nothing_is_named_as_such(tmp_path):
    """A run name that was a dangling link said only "File exists"."""
    from lab.errors import ConfigError
    from lab.measure.records import writable_dir

    (tmp_path / "link").symlink_to(tmp_path / "gone")
    for folder, what in (
        (tmp_path / "link", "it"),
        (tmp_path / "link" / "x", f"'{tmp_path}/link'"),
    ):
        with pytest.raises(ConfigError) as e:
            writable_dir(folder)
        said = f"cannot write to '{folder}': {what} is a link to '{tmp_path}/gone', which does not"
        assert str(e.value).startswith(said), e.value
    assert writable_dir(tmp_path / "new") == tmp_path / "new"

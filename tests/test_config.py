"""Config parsing: typed values, presets, and one clear line for every mistake."""

import pytest

from lab.config import PRESETS, ConfigError, help_text, parse_args
from lab.run import main


def test_presets_and_overrides():
    cfg = parse_args(
        [
            "model=small",
            "n_layers=3",
            "lr=1e-3",
            "tie_embeddings=false",
            "dtype=bf16",
            "mesh=4x2",
            "strategy=fsdp+tp",
            "remat=dots",
        ]
    )
    assert cfg.preset == "small"
    assert cfg.model.d_model == PRESETS["small"]["d_model"]
    assert cfg.model.n_layers == 3 and cfg.lr == 1e-3
    assert cfg.model.tie_embeddings is False
    assert cfg.model.dtype == "bfloat16" and cfg.model.remat == "dots"
    assert cfg.mesh == "4x2" and cfg.strategy == "fsdp+tp"


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_is_valid(name):
    cfg = parse_args([f"model={name}"])
    assert cfg.model.d_model % cfg.model.n_heads == 0


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["modle=tiny"], "unknown key 'modle' (did you mean model?)"),
        (["setps=3"], "did you mean steps?"),
        (["batch_size=3000000000"], "batch_size='3000000000': must be <= 1048576"),
        (["STEPS=3"], "unknown key 'STEPS' (did you mean steps?)"),
        (["mesh="], "mesh=: no mesh given; e.g. mesh=4x2"),
        (["strategy=dpp"], "(did you mean dp or pp?)"),
        (["steps=ten"], "steps='ten': expected an integer"),
        (["model=tny"], "model='tny': expected one of tiny"),  # the key as typed, not preset=
        (["lr=fast"], "lr='fast': expected a number"),
        (["steps=-1"], "steps='-1': must be >= 0"),
        (["seed=4294967296"], "seed='4294967296': must be <= 4294967295"),
        # the kernels count a window's keys in int32: a bigger one was the kernel's traceback
        (["window=2147483649"], "window='2147483649': must be <= 2147483648"),
        (
            ["dtype=int7"],
            "dtype='int7': expected one of float32 (f32), bfloat16 (bf16), float16 (f16)",
        ),
        (["remat=some"], "remat='some': expected one of none | full | dots"),
        (["resume=maybe"], "resume='maybe': expected a boolean"),
        (["mesh=4y2"], "mesh='4y2'"),
        (["mesh=data:2,pipe:2"], "unknown axis 'pipe'"),
        (["mesh=data:2,stag:2"], "unknown axis 'stag' (did you mean stage?)"),
        (["mesh=-1x-1"], "at most one axis may be -1"),
        (["mesh=data:2,model"], "axis 'model' has no size: name each axis with its size"),
        (["mesh=data:2,"], "an empty axis"),
        (["steps"], "arguments are key=value"),
        (["name=a\nb"], "name='a\\nb': a run name has no control characters"),
        ([f"name={'x' * 300}"], "300 bytes, longer than the 255 a folder name may have"),
        (["steps=1", "steps=2"], "steps is given more than once"),
    ],
)
def test_errors_are_one_line(argv, needle):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["modle=tiny"], "did you mean model?"),
        (["mesh=16"], "mesh=16 needs 16 devices but only 8 are present"),
        (["mesh=3"], "does not divide the 8 present"),
        (["mesh=3", "cpu_devices=8", "batch_size=3"], "give cpu_devices= a multiple of 3"),
        (["mesh=4x2", "batch_size=6"], "batch_size=6 does not split over the 4 devices"),
        (["mesh=1x8", "n_heads=4", "n_kv_heads=4"], "does not divide mesh axis model (size 8)"),
        (["resume=true"], "resume=true needs the run's name=NAME"),
    ],
)
def test_cli_exit_code_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err
    assert len(err.splitlines()) == 1


def test_help_lists_every_key(capsys):
    """Every field of both dataclasses, with its meaning (the dataclass is the only source)."""
    import dataclasses

    from lab.config import Config, ModelConfig

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    fields = [f for cls in (Config, ModelConfig) for f in dataclasses.fields(cls)]
    keys = ["model" if f.name == "preset" else f.name for f in fields if f.name != "model"]
    assert len(keys) > 30
    lines = out.splitlines()
    for key in keys:
        i = next((i for i, x in enumerate(lines) if x.startswith(f"  {key} ")), None)
        assert i is not None, f"--help does not list {key}"
        # a name or default wider than its column has its meaning on the next line
        words = lines[i].split(maxsplit=2)
        if len(words) == 2 and lines[i + 1].startswith(" " * 20):
            words.append(lines[i + 1].strip())
        assert len(words) == 3, f"--help gives {key} no default or meaning"
    assert help_text() in out


def test_help_shows_defaults_as_typed_in_aligned_columns():
    """Defaults read as a user types them (false, 1.0, fwd,fwd+bwd; not 'False' quoted as
    Python's repr), and every meaning starts in one column: a default or a name wider than
    its column puts the meaning on the next line (it pushed that one line's meaning right)."""
    import dataclasses

    from lab.config import field, options_help

    @dataclasses.dataclass(frozen=True)
    class Options:
        quick: bool = field(False, "seqs 256,512")
        budget: float = field(1.0, "seconds")
        modes: tuple = field(("fwd", "fwd+bwd"), "fwd and/or fwd+bwd", kind="names")
        strategies: tuple = field(("dp", "fsdp", "tp", "fsdp+tp"), "to scale", kind="names")
        impls: tuple = field((), "default: all", kind="names")
        a_key_longer_than_its_column: int = field(60, "seconds to wait")

    text = options_help(Options, "prog", "doc")
    lines = text.splitlines()[text.splitlines().index("keys:") + 1 :]
    assert lines[0].split() == ["quick", "false", "seqs", "256,512"]
    assert lines[1].split()[:2] == ["budget", "1.0"] and lines[2].split()[1] == "fwd,fwd+bwd"
    assert lines[3].split() == ["strategies", "dp,fsdp,tp,fsdp+tp"]  # too wide: meaning below
    assert lines[5].split()[1] == '""'  # an empty default is not a blank column
    assert lines[6].split() == ["a_key_longer_than_its_column", "60"]
    column = lines[0].index("seqs")
    for line, meaning in zip(
        (lines[0], lines[1], lines[2], lines[4], lines[5], lines[7]),
        ("seqs", "seconds", "fwd and/or", "to scale", "default: all", "seconds to wait"),
        strict=True,
    ):
        assert line.index(meaning) == column, (line, meaning)
    assert "'" not in text


def test_help_widens_its_name_column_for_a_name_a_little_too_wide():
    """lab.run's `coordinator_timeout` (one character past the column) keeps its meaning on
    its own line; both of lab.run's tables keep one column for the meanings."""
    lines = help_text().splitlines()
    line = next(x for x in lines if x.startswith("  coordinator_timeout "))
    assert line.split(maxsplit=2)[1:] == [
        "60",
        "seconds to wait for the coordinator and every process to join",
    ]
    column = line.index("seconds")
    for key in ("steps", "d_model"):
        row = next(x for x in lines if x.startswith(f"  {key} "))
        assert len(row) - len(row.split(maxsplit=2)[2]) == column, row


@pytest.mark.parametrize(
    "keys", [["cpu_devices=100000"], ["mesh=data:100000"], ["mesh=1024", "batch_size=1024"]]
)
def test_simulated_device_counts_are_bounded(keys, capsys):
    """A device count no CPU can simulate is one line, before any device is created."""
    from lab.run import main

    assert main(keys) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "simulated CPU devices" in err, err
    assert "more than the 256 whose collectives XLA:CPU runs reliably" in err, err


def test_a_list_value_given_twice_and_a_key_given_twice_are_named_as_typed():
    from lab.config import parse_options
    from lab.tools import scaling as scaling_tool
    from lab.tools import tune_step

    with pytest.raises(ConfigError, match=r"strategies=dp,dp: dp is given twice"):
        parse_options(scaling_tool.Options, ["strategies=dp,dp"])
    with pytest.raises(ConfigError, match=r"batches=4, 4: 4 is given twice"):
        parse_options(tune_step.Options, ["batches=4, 4"])
    with pytest.raises(ConfigError, match=r"^model is given more than once$"):
        parse_args(["model=tiny", "model=small"])


def test_an_empty_list_is_its_default_where_the_default_is_empty_and_refused_elsewhere():
    """only= (what --help shows as its default) means every claim; an empty list where the
    default names values (batches=) is still a mistake, said in one line."""
    from experiments.__main__ import Options as Ledger
    from lab.config import parse_options
    from lab.tools import tune_step

    assert parse_options(Ledger, ["only="]).only == ()
    assert parse_options(Ledger, ["only= "]).only == ()
    with pytest.raises(ConfigError, match=r"batches='': expected a comma-separated list"):
        parse_options(tune_step.Options, ["batches="])


def test_a_key_typed_under_its_older_name_is_named_so():
    """An options class's KEY_ALIASES are older names still read: a bad value, and a refusal
    of the key, name it as the user typed it."""
    import dataclasses

    from lab.config import field, parse_options, typed_as

    @dataclasses.dataclass(frozen=True)
    class Options:
        KEY_ALIASES = {"steps_old": "steps"}
        steps: int = field(3, "how many", min=1)

    with pytest.raises(ConfigError, match=r"^steps_old=.0.: must be >= 1$"):
        parse_options(Options, ["steps_old=0"])
    o = parse_options(Options, ["steps_old=5"])
    assert o.steps == 5 and typed_as(o, "steps") == "steps_old"
    assert typed_as(parse_options(Options, ["steps=5"]), "steps") == "steps"
    assert typed_as(Options(), "steps") == "steps"


def test_attention_plan_reads_the_benchs_names_and_its_help_says_so():
    """The attention bench takes seqs= and head_dims=; the plan of the same kernels reads
    them too (its own seq= and head_dim= stay), and its --help lists them."""
    from lab.config import options_help, parse_options
    from lab.tools import attention_plan

    o = parse_options(attention_plan.Options, ["seqs=256,512", "head_dims=64"])
    assert (o.seq, o.head_dim) == ((256, 512), (64,))
    with pytest.raises(ConfigError, match=r"^seqs='256,x': 'x' is not an integer$"):
        parse_options(attention_plan.Options, ["seqs=256,x"])
    text = options_help(attention_plan.Options, "attention_plan", "doc")
    assert text.splitlines()[-1] == "also read: seqs= for seq=, head_dims= for head_dim="


def test_loss_scale_takes_the_word_auto(capsys):
    """--help and the README say auto, so `loss_scale=auto` is what a user types: it means
    what 0 means (resolved from the dtype), and a word that is neither is one line."""
    assert parse_args(["loss_scale=auto"]).loss_scale == 0.0
    assert parse_args(["loss_scale=AUTO"]).loss_scale == 0.0
    assert parse_args(["loss_scale=0"]).loss_scale == 0.0
    assert parse_args(["loss_scale=128"]).loss_scale == 128.0
    line = next(x for x in help_text().splitlines() if x.startswith("  loss_scale "))
    assert line.split()[1] == "auto" and "auto (or 0)" in line
    assert main(["loss_scale=often", "steps=1"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: loss_scale='often': expected a number or auto"


@pytest.mark.parametrize(
    "keys, needle",
    [
        (dict(steps="3"), "steps='3': expected an integer"),
        (dict(batch_size=True), "batch_size=True: expected an integer"),
        (dict(seq_len=3.5), "seq_len=3.5: expected an integer"),
        (dict(n_layers="two"), "n_layers='two': expected an integer"),
        (dict(lr="1e-3"), "lr='1e-3': expected a number"),
        (dict(loss_scale="big"), "loss_scale='big': expected a number or auto"),
        (dict(tie_embeddings=1), "tie_embeddings=1: expected a boolean"),
        (
            dict(dtype="bfloat61"),
            "dtype='bfloat61': expected one of float32 (f32), bfloat16 (bf16)",
        ),
        (dict(mesh=4), "mesh=4: expected a string"),
        (dict(mesh="4y2"), "mesh='4y2': "),
        (dict(model="tinny"), "model='tinny': expected one of tiny | small"),
        (dict(steps=-1, lr="x"), "steps=-1: must be >= 0\nlr='x': expected a number"),
    ],
)
def test_values_from_python_are_checked_at_the_call(keys, needle):
    """make_config, override and Request.of check a typed value's type as well as its range
    and choices, naming the key (as given: model=, not preset=); a wrong type would otherwise
    fail deep inside a session, or (batch_size=True) train on a batch of one."""
    from lab.config import make_config, override
    from lab.resolve import Request

    calls = (
        lambda: make_config(**keys),
        lambda: override(make_config(), **keys),
        lambda: Request.of(**keys),
    )
    for call in calls:
        with pytest.raises(ConfigError) as e:
            call()
        assert needle in str(e.value)
    if "model" in keys:
        assert "(did you mean tiny?)" in str(e.value)


def test_values_from_python_are_kept_as_parsed_ones_are():
    """An int stands for a float, a dtype's short name for its full one, auto for its number,
    a NumPy integer for an int, a path object for its text."""
    from pathlib import Path

    import numpy as np

    from lab.config import make_config

    cfg = make_config(lr=1, dtype="BF16", loss_scale="auto", steps=np.int64(3), out_dir=Path("r"))
    assert cfg.lr == 1 and cfg.model.dtype == "bfloat16" and cfg.loss_scale == 0.0
    assert type(cfg.steps) is int and cfg.steps == 3 and cfg.out_dir == "r"


def test_a_part_of_a_name_suggests_the_name_that_holds_it():
    """modes=bwd: fwd+bwd holds it, though fwd looks more alike letter by letter."""
    from lab.config import did_you_mean

    assert did_you_mean("bwd", ["fwd", "fwd+bwd"]) == " (did you mean fwd+bwd?)"
    assert did_you_mean("fdw", ["fwd", "fwd+bwd"]) == " (did you mean fwd?)"
    assert did_you_mean("zzz", ["fwd", "fwd+bwd"]) == ""
    # among options holding the word, the likeness still decides; one letter is no part
    assert did_you_mean("layers", ["n_layers", "scan_layers"]) == " (did you mean n_layers?)"
    assert did_you_mean("n", ["n_layers", "n_heads"]) == ""
    # the plural (or singular) of the word before the options that hold it whole
    serve = ["batches", "batch_size", "plan_batch", "prefill_batches"]
    assert did_you_mean("batch", serve) == " (did you mean batches?)"
    assert did_you_mean("dir", ["dirs", "out_dir"]) == " (did you mean dirs?)"
    assert did_you_mean("heads", ["head", "head_dim"]) == " (did you mean head?)"
    # the name metrics.jsonl and TensorBoard give a key's value leads to the key
    assert did_you_mean("learning_rate", ["lr", "steps"]) == " (did you mean lr?)"
    assert did_you_mean("learning_rate", ["steps"]) == ""


def test_a_path_given_with_a_quoted_tilde_is_under_the_home(monkeypatch, tmp_path):
    """out_dir='~/x' reaches the command unexpanded by the shell: it made a folder named ~
    in the working directory."""
    from lab.config import parse_args

    monkeypatch.setenv("HOME", str(tmp_path))
    assert parse_args(["out_dir=~/runs"]).out_dir == str(tmp_path / "runs")
    assert parse_args(["out_dir=a~b"]).out_dir == "a~b"

"""Request → Platform → resolve → Resolved: every rule in one list, each broken from the
command line (one line, exit 2), all broken rules reported together; the backend's defaults
before the rules; a GPU plan's choices from the target's capabilities."""

import dataclasses
import importlib
import os
import subprocess
import sys

import pytest

from lab import config, devices, plans, resolve
from lab.config import ConfigError
from lab.resolve import RULES, Platform, Request
from lab.run import main


def _recording(monkeypatch) -> list:
    """Which rules broke during the next command."""
    fired = []

    def wrap(rule):
        def check(d):
            line = rule.check(d)
            if line:
                fired.append(rule.name)
            return line

        return dataclasses.replace(rule, check=check)

    monkeypatch.setattr(resolve, "RULES", tuple(wrap(r) for r in RULES))
    return fired


def _gpu_plans_here() -> bool:
    from lab.plans import gpu

    return gpu._pjrt() is not None and gpu.ptxas() is not None


def _needs_gpu_plans(argv=("target=gpu",)):
    if any(a.startswith("target=gpu") for a in argv) and not _gpu_plans_here():
        pytest.skip("the CUDA plugin or ptxas is missing: pip install -e '.[gpu-plan]'")


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_every_rule_breaks_from_the_command_line(rule, monkeypatch, capsys, tmp_path):
    _needs_gpu_plans(rule.example)
    if rule.processes > 1:
        return _breaks_in_joined_processes(rule, tmp_path)
    monkeypatch.chdir(tmp_path)  # lab.serve's results folder, should it get that far
    fired = _recording(monkeypatch)
    command = importlib.import_module(rule.command)
    assert command.main(list(rule.example)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # a rule of stage "request" is asked before joining, then again with the others
    assert list(dict.fromkeys(fired)) == [rule.name], (fired, err)
    assert len(err) == 1 and err[0].startswith("error: "), err


def _breaks_in_joined_processes(rule, tmp_path):
    """A rule of joined processes: its example started as that many real processes, each
    refuses in one line, exit 2, before compiling anything."""
    from lab.tools.launch import free_port

    port = free_port()
    keys = [*rule.example, "model=tiny", "seq_len=16", "batch_size=8", "steps=1"]
    keys += [f"out_dir={tmp_path}", f"coordinator=localhost:{port}", "coordinator_timeout=60"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", rule.command, *keys, f"process_id={i}"],
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(rule.processes)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    errs = [err for _, err in outs]
    assert [p.returncode for p in procs] == [2] * rule.processes, errs
    for out, err in outs:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), err
        assert "step" not in out, out  # nothing trained


def test_three_broken_rules_are_three_lines(capsys):
    argv = ["n_heads=4", "n_kv_heads=3", "accumulate=3", "attention=ring"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err), err
    for needle in ("n_kv_heads=3 must divide", "accumulate=3 must divide", "attention=ring"):
        assert sum(needle in line for line in err) == 1, err


def test_rules_broken_in_every_phase_are_reported_together(capsys):
    """A rule checked before any process joins (resume), one of the first pass (accumulate),
    one on the built mesh (the weights' split) and the attention choice: one line each, none
    raised before the others are checked."""
    argv = ["resume=true", "accumulate=3", "n_heads=4", "n_kv_heads=3"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err), err
    for needle in ("resume=true needs", "accumulate=3 must divide", "n_kv_heads=3 must divide"):
        assert sum(needle in line for line in err) == 1, err
    argv = ["resume=true", "mesh=1x8", "n_heads=4", "n_kv_heads=4", "softcap=30", "attention=xla"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3, err
    for needle in ("resume=true needs", "does not divide mesh axis model", "attention=xla: "):
        assert sum(needle in line for line in err) == 1, err


def test_a_request_that_cannot_join_is_checked_on_this_process_alone(capsys):
    """num_processes=2 without a coordinator joins nothing; the other rules are checked on
    this process's devices counted as the two processes' would be (mesh=8 fits, no line)."""
    assert main(["num_processes=2", "mesh=8", "strategy=tp", "accumulate=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    assert "needs coordinator=" in err[0] and "accumulate=3 must divide" in err[1], err


def test_a_bare_device_count_follows_the_strategy_in_resolve():
    """The default is resolve's: make_config keeps the user's word, resolve names the axis."""
    from lab.config import make_config

    assert make_config(mesh="8", strategy="fsdp").mesh == "8"
    r = resolve.resolve(Request.of(mesh="8", strategy="fsdp"), _cpu_platform(), "train")
    assert r.cfg.mesh == "fsdp:8" and r.mesh_shape["fsdp"] == 8
    r = resolve.resolve(Request.of(mesh="8", strategy="dp"), _cpu_platform(), "train")
    assert r.cfg.mesh == "8" and r.mesh_shape["data"] == 8


def test_every_bad_value_is_a_line(capsys):
    assert main(["steps=ten", "lr=fast", "n_heads=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "steps='ten'" in err[0] and "lr='fast'" in err[1], err


def test_the_rules_have_unique_names_and_examples():
    assert len({r.name for r in RULES}) == len(RULES)
    assert all(r.example for r in RULES)


def _cpu_platform():
    return Platform.of(devices.describe(), __import__("jax").devices())


def _gpu_target(target="gpu:h100:1"):
    _needs_gpu_plans()
    devs = plans.topology_devices(target)
    return Platform.of(devices.describe_target(devs), devs, target=target)


def test_rules_see_the_backends_defaults():
    """accumulate=32 divides a GPU run's batch of 32 (refused only against CPU's 16); the run
    is named from the preset that trains, not the CPU's."""
    request = Request.of(accumulate=32)
    with pytest.raises(ConfigError, match="must divide batch_size=16"):
        resolve.resolve(request, _cpu_platform(), "train")
    r = resolve.resolve(request, _gpu_target(), "plan")
    assert r.cfg.batch_size == 32 and r.cfg.accumulate == 32 and r.cfg.preset == "base"
    assert r.cfg.name.startswith("base-") and r.cfg.compile_only
    c, m = r.cfg, r.cfg.model
    assert "auto" not in (c.strategy, c.data, m.dtype, m.attention)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.cfg = c


def test_a_gpu_plan_chooses_attention_by_the_targets_capabilities():
    platform = _gpu_target()
    assert platform.cudnn  # an H100 with jax[cuda] runs cuDNN whatever this host has
    r = resolve.resolve(Request.of(), platform, "plan")
    if platform.cudnn_here:
        assert r.cfg.model.attention == "cudnn"
    else:
        assert r.attention_note.startswith("cuDNN would run here")
        assert f"compiled with {r.cfg.model.attention}" in r.attention_note


def test_the_attention_choice_takes_the_models_masks():
    """A window, soft-capping and packed documents: auto picks a kernel that takes them all
    (cuDNN takes no soft-cap or segments, so a GPU plan does not claim it would run), a kernel
    named that lacks one is one line."""
    from lab.kernels.attention import supported_features

    masks = dict(window=64, softcap=30.0, data="text", pack=True)
    for platform, purpose in ((_cpu_platform(), "train"), (_gpu_target(), "plan")):
        r = resolve.resolve(Request.of(**masks), platform, purpose)
        need = {"window", "softcap", "segments"}
        assert need <= supported_features(r.cfg.model.attention), r.cfg.model.attention
        assert not (r.attention_note or "").startswith("cuDNN would run")
    with pytest.raises(ConfigError, match="attention=xla: .*soft-capping"):
        resolve.resolve(Request.of(softcap=30.0, attention="xla"), _cpu_platform(), "train")


def test_offloading_is_one_rule_on_every_platform():
    """CPU has no host memory apart from its device memory: refused; a GPU target has it
    (remat=offload compiles there), and a plan whose abstract devices list no host memory
    kind says that the optimizer state is compiled in device memory."""
    for keys in ({"offload_optimizer": True}, {"remat": "offload"}):
        with pytest.raises(ConfigError, match="no separate host memory"):
            resolve.resolve(Request.of(**keys), _cpu_platform(), "train")
    platform = _gpu_target()
    assert platform.host_memory
    r = resolve.resolve(Request.of(remat="offload", offload_optimizer=True), platform, "plan")
    assert r.cfg.model.remat == "offload"
    assert r.offload_optimizer == platform.host_memory_here
    assert bool(r.notes) != platform.host_memory_here


def test_a_derived_request_is_resolved_again():
    """Decoding a pipelined run: its own request resolved for decoding (no scan, no stage
    axis: the stage's devices join the batch's), never the trained config edited."""
    request = Request.of(mesh="stage:2", n_layers=4)
    trained = resolve.resolve(request, _cpu_platform(), "train")
    assert trained.cfg.strategy == "pp" and trained.cfg.model.scan_layers
    decoding = resolve.resolve(trained.request, trained.platform, "decode")
    assert decoding.cfg.strategy == "dp" and not decoding.cfg.model.scan_layers
    assert decoding.mesh_shape["stage"] == 1 and decoding.mesh_shape["data"] == 2
    assert trained.cfg.model.scan_layers  # untouched


def test_context_parallelism_never_hands_a_split_sequence_to_a_whole_sequence_kernel():
    """strategy=cp splits the sequence over the model axis: auto takes blockwise (which XLA
    partitions) and says why; a kernel of whole sequences named explicitly is one line."""
    from lab.kernels.attention import cpu_flash

    r = resolve.resolve(Request.of(strategy="cp", mesh="2"), _cpu_platform(), "train")
    assert r.cfg.model.attention == "blockwise"
    assert "strategy=cp splits the sequence" in r.attention_note
    if cpu_flash.available():
        with pytest.raises(ConfigError, match="attention=cpu_flash: strategy=cp splits"):
            resolve.resolve(
                Request.of(strategy="cp", mesh="2", attention="cpu_flash"), _cpu_platform(), "train"
            )


def test_a_warm_up_longer_than_the_run_is_noted_with_the_rate_it_reaches():
    from lab.config import parse_keys
    from lab.session import open_session

    s = open_session(keys=parse_keys(["model=tiny", "warmup_steps=50", "steps=10"]))
    (note,) = [n for n in s.trainer.notes if n.startswith("warmup_steps=50")]
    assert "only reaches 0.00054, 18% of lr=0.003" in note  # the 10th update's: 0.003 · 9/50


def test_a_default_run_name_is_folder_safe():
    """A named mesh's ':' and ',' stay out of the default name: a ':' breaks scp and rsync
    (host:path) and TensorBoard's name:folder lists."""
    r = resolve.resolve(
        Request.of(mesh="data:2,fsdp:-1", strategy="fsdp"), _cpu_platform(), "train"
    )
    assert r.cfg.name.startswith("tiny-data2_fsdp-1-"), r.cfg.name
    assert not set(r.cfg.name) & set(":,/ ")
    config.check_name(r.cfg.name)


def test_a_key_a_resume_took_from_the_run_is_named_as_the_runs_own():
    r = dataclasses.replace(Request.of(microbatches=4, steps=10), inherited=("microbatches",))
    e = r.blame(ConfigError("microbatches=4 feeds a pipeline: it needs strategy=pp"))
    assert str(e).endswith(
        "(microbatches=4: the run's own, from its config.json; give it anew to change it)"
    )
    assert str(r.blame(ConfigError("steps=10 is too few"))) == "steps=10 is too few"
    two = r.blame(ConfigError("microbatches=4 is odd\nsteps=10 is too few"))
    assert str(two).splitlines()[0].endswith("give it anew to change it)")


def test_a_pipeline_a_resume_took_says_whose_and_how_to_turn_it_off():
    """A circular pipeline's run resumed on one device: both pipeline keys are the run's own,
    and each line names its value (so it is blamed as the run's) and the one that runs without
    a pipeline."""
    r = dataclasses.replace(
        Request.of(microbatches=2, pipeline_repeats=2, mesh="1"),
        inherited=("microbatches", "pipeline_repeats"),
    )
    with pytest.raises(ConfigError) as e:
        try:
            resolve.resolve(r, _cpu_platform(), "train")
        except ConfigError as err:
            raise r.blame(err) from None
    lines = str(e.value).splitlines()
    assert len(lines) == 2, lines
    assert "microbatches=0 runs without one" in lines[0], lines
    assert "pipeline_repeats=1 runs without one" in lines[1], lines
    assert all(line.endswith("give it anew to change it)") for line in lines), lines


@pytest.mark.parametrize(
    "argv, needle",
    [
        # two tensors (wk and wo) break the same split: one line, the first named
        (["mesh=1x8", "n_heads=4", "n_kv_heads=2"], "more weights break a split"),
        # an unused stage axis: the pipeline rule speaks, not also the strategy's axes
        (["mesh=data:2,stage:4", "strategy=tp"], "strategy=pp, pp+fsdp or pp+tp"),
        (["mesh=data:2,stage:2", "strategy=pp+tp", "n_layers=4"], "over the model axis"),
        # a misspelt word of the cycle is named with the close one
        (["window=8", "window_pattern=local,glob"], "('glob': did you mean global?)"),
    ],
)
def test_one_broken_requirement_is_one_line(argv, needle, capsys):
    assert main(["compile_only=true", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_a_pipeline_refuses_scan_layers_false_only_where_it_was_asked():
    """A pipeline's stages hold slices of the stacked layers: scan_layers=false typed with one
    is one line; left unset (or a resume's, or a field of a config built in code, whose
    default cannot be told from a choice) the strategy stacks them, and the header says so."""
    from lab.report.tables.run import _fitting_header

    platform, pipe = _cpu_platform(), dict(mesh="stage:2", n_layers=4)
    with pytest.raises(ConfigError, match="scan_layers=false cannot apply; drop it"):
        resolve.resolve(Request.of(**pipe, scan_layers=False), platform, "train")
    resumed = dataclasses.replace(Request.of(**pipe, scan_layers=False), inherited=("scan_layers",))
    in_code = Request.from_config(config.parse_args(["mesh=stage:2", "n_layers=4"]))
    for request in (Request.of(**pipe), resumed, in_code):
        r = resolve.resolve(request, platform, "train")
        assert r.cfg.model.scan_layers
    assert "pipeline of 2 microbatches (GPipe), layers stacked" in _fitting_header(r.cfg)[0]
    one = dataclasses.replace(r.cfg, model=dataclasses.replace(r.cfg.model, microbatches=1))
    assert "pipeline of 1 microbatch (GPipe)" in _fitting_header(one)[0]


def test_a_callers_mesh_is_the_one_named_and_a_purpose_is_checked():
    """A mesh built in code is the run's mesh: a rule's line names it, not the config's unused
    mesh=1; a purpose outside train, decode and plan is a ValueError that lists them."""
    from lab.mesh import make_mesh

    platform = Platform.of_mesh(make_mesh("4x2"))
    with pytest.raises(ConfigError, match=r"batch_size=3 .*\(strategy=tp, mesh=data:4,model:2\)"):
        resolve.resolve(Request.of(batch_size=3), platform, "train")
    with pytest.raises(ValueError, match="purpose='training': expected one of train, decode, plan"):
        resolve.resolve(Request.of(), platform, "training")


def test_cpu_devices_after_jax_started_say_so_instead_of_suggesting_them():
    """JAX reads its CPU device count once, when its backends start: a count asked for later
    is refused in a line that says so (not silently ignored), and a mesh past the devices
    present says why cpu_devices= would not help."""
    import jax

    n = len(jax.devices())  # the backends have started (the conftest's count)
    started = f"JAX has already started with {n} CPU devices: cpu_devices must be set before"
    with pytest.raises(ConfigError, match=f"^cpu_devices={n + 1}: {started}"):
        devices.prepare("1", cpu_devices=n + 1)
    assert devices.prepare("1", cpu_devices=n)  # the count it has: nothing to say
    request = Request.of(mesh=str(2 * n))
    with pytest.raises(ConfigError, match=f"needs {2 * n} devices but only {n} .*; {started}"):
        resolve.resolve(request, Platform.found(request), "train")


def test_a_mesh_the_processes_cannot_share_evenly_says_so_not_to_simulate_more():
    """Over 2 processes each simulates cpu_devices // 2 devices: mesh=3x1 gets 2, and more
    cpu_devices= cannot help while the count is odd."""
    info = devices.DeviceInfo("cpu", "cpu", 2, 1, 2, 0, True)
    platform = Platform("cpu", "cpu", 2, info=info)
    with pytest.raises(ConfigError) as e:
        resolve.resolve(Request.of(mesh="3x1"), platform, "train")
    line = str(e.value)
    assert "3 devices cannot be split evenly over 2 processes" in line, line
    assert "simulates more" not in line, line

"""Request → Platform → resolve → Resolved: every default and every rule of a run, once.

`Request` is what the user said: the keys given, each typed and checked alone (type, range,
choices), no defaults applied. `Platform` is what it will run on, found once: the backend,
device kind and count (a target's, for a plan), and what that hardware can do (host memory
apart from device memory, cuDNN's fused attention) beside what this host can compile.
`resolve(request, platform, purpose)` (purpose: train, decode, plan, or restore: a trainer's
layout to read a run's checkpoints into, nothing stepped) applies the backend's
defaults, fills every `auto` (dtype, data, strategy, the mesh's -1, attention, microbatches,
scan_layers, the optimizer's offload), checks every rule that ties fields together from the
one list `RULES` (all broken rules reported together, one line each: exit 2) and names the
run. `Resolved` is frozen and has no `auto` left: the mesh, trainer and decoder builders take
it and trust it. A derived config (serving a trained run, its decoder) is resolved again
from a request, never made by editing a resolved one.
"""

import contextlib
import dataclasses
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import use_abstract_mesh

from lab import data, devices, plans, rundir
from lab.config import (
    KEYS,
    MODEL_FIELDS,
    PRESETS,
    RUN_FIELDS,
    Config,
    ModelConfig,
    check_keys,
    check_name,
    check_value,
    did_you_mean,
    make_config,
    parse_keys,
    profile_window,
    resolve_dtype,
    stamped_name,
)
from lab.devices import DeviceInfo
from lab.errors import ConfigError
from lab.kernels.attention import choose_noted, supported_features
from lab.mesh import (
    AXES,
    STRATEGY_AXES,
    MeshSpecError,
    auto_strategy,
    cpu_devices_for,
    make_mesh,
    parse_mesh_spec,
    resolve_shape,
    strategy_mesh,
)
from lab.mesh import RULES as MESH_RULES
from lab.names import BATCH, DATA, HOST_MEMORY, PIPELINE_STRATEGIES, SEQ, STAGE

PURPOSES = ("train", "decode", "plan", "restore")

# What the decoder runs for a pipelined run: no pipeline (one token per step), the rules
# that split each stage's weights kept, the stage axis's devices added to the batch's.
UNPIPELINED = {"pp": "dp", "pp+fsdp": "fsdp", "pp+tp": "tp"}


# ------------------------------------------------------------------------ the request


@dataclasses.dataclass(frozen=True)
class Request:
    """The user's keys (run and model fields, `preset` for the model's), each checked alone;
    nothing filled in."""

    keys: tuple[tuple[str, Any], ...] = ()
    inherited: tuple[str, ...] = ()  # keys a resume took from the run's config.json
    # every field of a Config built in code (from_config): its defaults cannot be told from
    # the keys its author chose, so none of them is taken as asked for explicitly
    in_code: bool = False

    @classmethod
    def of(cls, **keys) -> "Request":
        """From typed keyword arguments (`model=` is `preset=`), each checked as parsed ones
        are (lab.config.check_value: its type, range, choices; a ConfigError names the key)."""
        return cls(tuple(check_keys(KEYS, keys).items()))

    @classmethod
    def parse(cls, argv: list[str]) -> "Request":
        """From `key=value` arguments (lab.config's grammar)."""
        return cls(tuple(parse_keys(argv).items()))

    @classmethod
    def from_config(cls, cfg: Config) -> "Request":
        """Every field of `cfg` as a key: a config built in code, asked for as it is."""
        keys = {k: getattr(cfg, k) for k in RUN_FIELDS}
        keys.update({k: getattr(cfg.model, k) for k in MODEL_FIELDS})
        return cls(tuple(keys.items()), in_code=True)

    def asked(self, key: str) -> bool:
        """Whether the user gave `key` in this invocation (not a resume's config.json, not a
        field of a config built in code)."""
        return not self.in_code and key in self.dict() and key not in self.inherited

    def dict(self) -> dict:
        return dict(self.keys)

    def get(self, key: str, default=None):
        return self.dict().get(key, default)

    def with_keys(self, **keys) -> "Request":
        """A new request: these keys over this one's (checked as any are)."""
        return Request.of(**{**self.dict(), **keys})

    def resumed(self) -> "Request":
        """resume=true continues the run in the folder as it was asked for: the keys its
        config.json keeps (`request`: the ones the user gave, the invocation's own left out;
        a folder written before it kept them gives every field of its config) with this
        request's keys over them (steps= to go further, checkpoint_every= to save more
        often). Without it a resume that gives only name= and resume=true would take the
        defaults, and a run started with checkpoint_every=50 would go on without saving.
        This request as it is where it does not resume; ConfigError (one line) where the
        folder holds no run to resume or its config.json is damaged."""
        given = self.dict()
        if not (given.get("resume") and given.get("name")):
            return self  # resume without a name is refused by its rule
        if any(given.get(k) for k in ("overwrite", "compile_only", "target")):
            return self  # a resume that also clears the folder or plans: refused by its rule
        check_name(given["name"])  # never a config.json outside out_dir
        run_dir = Path(given.get("out_dir") or RUN_FIELDS["out_dir"][0].default) / given["name"]
        saved = rundir.saved_config(run_dir)
        path = run_dir / "config.json"
        if saved.get("compile_only") or saved.get("target"):
            what = f"target={saved['target']}" if saved.get("target") else "compile_only=true"
            raise ConfigError(
                f"resume=true: {run_dir} holds a plan ({what}: compiled, not run), which has "
                "no checkpoint to resume; start a run under another name="
            )
        asked = saved.get("request", None)
        if asked is None:  # written before config.json kept the request: its whole config
            asked = {**saved, **saved["model"]}
        elif not isinstance(asked, dict):
            raise ConfigError(
                f"resume=true: {path} is damaged (its request is not a table)" + rundir.DAMAGED_NEXT
            )
        known = {k: v for k, v in asked.items() if k in RUN_FIELDS or k in MODEL_FIELDS}
        if "preset" in given:  # the model asked now, not the fields of the one saved
            known = {k: v for k, v in known.items() if k not in MODEL_FIELDS}
        try:
            shape = {k: saved["model"][k] for k in rundir.STATE_FIELDS if k in saved["model"]}
            for key, value in {**known, **shape}.items():
                _check_type(key, value)
            inherited = Request.of(**rundir.asked_keys(known))
        except ConfigError as e:
            why = f"resume=true: {path} is damaged ({e})"
            raise ConfigError(why + rundir.DAMAGED_NEXT) from None
        # a changed shape first: no other change makes the checkpoints load (a rule the new
        # shape breaks would be named first, and mending it only leads to this refusal)
        model = dict(saved["model"])
        if "preset" in given:  # the preset's fields, then those typed
            model |= dataclasses.asdict(ModelConfig(**PRESETS[given["preset"]]))
        model |= {k: given[k] for k in rundir.STATE_FIELDS if k in given}
        grad_clip = given.get("grad_clip", saved.get("grad_clip", 0))
        rundir.check_same_state(saved, {"model": model, "grad_clip": grad_clip})
        out = inherited.with_keys(**given)
        return dataclasses.replace(
            out, inherited=tuple(k for k in inherited.dict() if k not in given)
        )

    def blame(self, e: ConfigError) -> ConfigError:
        """`e` with the keys it names that a resume took from the run's config.json said to
        be the run's own (on the line that names them): the user did not type them, and may
        give them anew."""
        keys, lines, changed = self.dict(), str(e).splitlines(), False
        for i, line in enumerate(lines):
            named = [f"{k}={keys[k]}" for k in self.inherited if re.search(rf"\b{k}=", line)]
            if named:
                lines[i] += (
                    f" ({', '.join(named)}: the run's own, from its config.json; give it anew "
                    "to change it)"
                )
                changed = True
        return ConfigError("\n".join(lines)) if changed else e


def _check_type(key: str, value) -> None:
    """A value read back from a file has the field's own type (JSON keeps int, float, bool
    and str apart; an int stands for a float) and what parsing the key would check."""
    check_value(*KEYS[key], value)


# ------------------------------------------------------------------------ the platform


def _backend(device) -> str:
    return {"cuda": "gpu", "rocm": "gpu"}.get(device.platform, device.platform)


def _lists_host_memory(device) -> bool:
    """Whether `device` can address a `pinned_host` memory kind in this program."""
    try:
        memories = device.addressable_memories()
    except (NotImplementedError, RuntimeError, AttributeError):
        return False
    return HOST_MEMORY in {m.kind for m in memories}


def _cudnn_library_here() -> bool:
    """Whether this host has the cuDNN library a cuDNN kernel needs to be compiled."""
    if jax.default_backend() == "gpu":
        return True
    import importlib.util

    try:
        return importlib.util.find_spec("nvidia.cudnn") is not None
    except ImportError:
        return False


@dataclasses.dataclass(frozen=True)
class Platform:
    """What a run runs on (or, for a plan, is compiled for), found once."""

    backend: str  # cpu | gpu | tpu
    device_kind: str
    count: int
    aot: bool = False  # a target compiled for ahead of time: nothing runs
    target: str = ""
    # the hardware keeps host memory apart from its device memory (GPU, TPU; a target's too)
    host_memory: bool = False
    # this program's devices list a pinned_host memory kind (a GPU plan's abstract ones do not)
    host_memory_here: bool = False
    cudnn: bool = False  # the hardware runs cuDNN's fused attention (every CUDA GPU)
    cudnn_here: bool = False  # this host can compile it (the cuDNN library is present)
    jax_version: str = jax.__version__
    info: DeviceInfo | None = dataclasses.field(default=None, compare=False, repr=False)
    devices: tuple = dataclasses.field(default=(), compare=False, repr=False)
    mesh: Any = dataclasses.field(default=None, compare=False, repr=False)  # a caller's mesh
    # JAX had started on CPU before the request could size its simulated devices
    cpu_started: bool = dataclasses.field(default=False, compare=False, repr=False)

    @classmethod
    def of(cls, info: DeviceInfo, devs, *, target: str = "", mesh=None) -> "Platform":
        devs = tuple(devs)
        gpu = info.backend == "gpu"
        here = _lists_host_memory(devs[0])
        return cls(
            backend=info.backend,
            device_kind=info.device_kind,
            count=info.count,
            aot=info.aot,
            target=target,
            # a mesh built in code is taken at its devices' word (the library moves the
            # optimizer state into a CPU's pinned_host memory, to test that nothing changes)
            host_memory=info.backend in ("gpu", "tpu") or (mesh is not None and here),
            host_memory_here=here,
            cudnn=gpu,
            cudnn_here=gpu and _cudnn_library_here(),
            info=info,
            devices=devs,
            mesh=mesh,
        )

    @classmethod
    def found(cls, request: Request) -> "Platform":
        """A target's abstract devices (`target=`), or this machine's, prepared for the
        request (jax.distributed joined, simulated CPU devices sized for its mesh).

        A request that breaks a rule of stage "request" (process ids, the coordinator, resume
        and overwrite) joins no process: the platform is this process's alone, counted as the
        joined one would be (its devices times num_processes), and `resolve` reports that rule
        with every other broken one, a line each."""
        keys = {k: f.default for k, (f, _) in RUN_FIELDS.items()} | request.dict()
        if keys["target"]:
            plans.prepare_host(keys["target"])
            devs = plans.topology_devices(keys["target"])
            return cls.of(devices.describe_target(devs), devs, target=keys["target"])
        join = not broken_before_joining(request)
        sized = devices.prepare(
            keys["mesh"],
            cpu_devices=keys["cpu_devices"],
            coordinator=keys["coordinator"],
            num_processes=keys["num_processes"],
            process_id=keys["process_id"],
            coordinator_timeout=keys["coordinator_timeout"],
            join=join,
        )
        info = devices.describe()
        if not join:  # what the joined processes would count together
            info = dataclasses.replace(info, count=info.count * keys["num_processes"])
        return dataclasses.replace(cls.of(info, jax.devices()), cpu_started=not sized)

    @classmethod
    def of_mesh(cls, mesh) -> "Platform":
        """The platform of a mesh a caller built (its shape is then the run's mesh)."""
        devs = tuple(mesh.devices.flat)
        backend = _backend(devs[0])
        aot = backend != jax.default_backend()
        info = DeviceInfo(
            backend=backend,
            device_kind=devs[0].device_kind,
            count=len(devs),
            local_count=len(devs),
            process_count=1 if aot else jax.process_count(),
            process_index=0 if aot else jax.process_index(),
            simulated=backend == "cpu" and len(devs) > 1,
            aot=aot,
        )
        return cls.of(info, devs, mesh=mesh)


# ------------------------------------------------------------------------ the rules


@dataclasses.dataclass
class _Draft:
    """A config on its way to resolved: what the rules read."""

    cfg: Config
    platform: Platform
    purpose: str
    sizes: dict | None = None  # None: the mesh does not fit (the mesh rule says why)
    asked_attention: str = "auto"
    mesh_problem: str | None = None
    mesh: Any = None  # built once the first pass holds (the filled rules read it)
    batches: tuple[int, ...] = ()  # purpose decode: the batch sizes decoders are built for
    abstract_params: Any = None  # the boxed abstract weights, once the weights rule built them
    built_model: Any = None  # the model (its kernel chosen) the weights rule built
    attention_chosen: bool = False  # the attention kernel is the one the builders will take

    @property
    def model(self):
        return self.cfg.model

    @property
    def mesh_text(self) -> str:
        """The mesh the run uses, as a line names it: mesh= as given, or the axes of a mesh a
        caller built (Platform.of_mesh; then the config's own mesh= is not used)."""
        if self.platform.mesh is None or self.sizes is None:
            return self.cfg.mesh
        return mesh_spec(self.sizes)

    @property
    def stages(self) -> int:
        return (self.sizes or {}).get(STAGE, 1)

    @property
    def pipelined(self) -> bool:
        return self.cfg.strategy in PIPELINE_STRATEGIES

    def batch_split(self, without=()) -> int:
        """Devices the batch is split over (the strategy's rules), axes in `without` aside."""
        axes = dict(MESH_RULES.get(self.cfg.strategy, ())).get(BATCH) or ()
        return math.prod((self.sizes or {}).get(a, 1) for a in axes if a not in without)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One requirement that ties fields together. `check` returns the line that says what is
    wrong, or None; `example` is a command line that breaks it (the tests run each);
    `stage` "request" rules hold before any device is touched (joining processes);
    `command` is the module whose command line `example` is (lab.serve for a decoder's);
    `processes`: the example runs as that many joined processes (process_id= and coordinator=
    added for each)."""

    name: str
    check: Callable[[_Draft], str | None]
    example: tuple[str, ...]
    needs_mesh: bool = False
    stage: str = "platform"
    filled: bool = False  # checked on the filled config and its built mesh (a second pass)
    command: str = "lab.run"
    processes: int = 1


def _kv_heads(d: _Draft):
    m = d.model
    if m.n_heads % m.n_kv_heads:
        return f"n_kv_heads={m.n_kv_heads} must divide n_heads={m.n_heads}"


def _heads(d: _Draft):
    m = d.model
    if m.d_model % m.n_heads:
        return f"n_heads={m.n_heads} must divide d_model={m.d_model}"


def _rotary(d: _Draft):
    m = d.model
    if m.d_model % m.n_heads == 0 and m.head_dim % 2:
        return f"head_dim=d_model/n_heads={m.head_dim} must be even for rotary embeddings"


def _text_vocab(d: _Draft):
    if d.cfg.data == "text" and d.model.vocab_size < 256:
        return f"data=text needs vocab_size >= 256 (bytes), got {d.model.vocab_size}"


def _text_length(d: _Draft):
    size = len(data.corpus_bytes())
    if d.cfg.data == "text" and d.purpose != "decode" and d.cfg.seq_len + 1 >= size:
        return (
            f"seq_len={d.cfg.seq_len} is longer than the bundled text ({size} bytes): choose a "
            "shorter seq_len or data=synthetic"
        )


def _window_pattern(d: _Draft):
    m = d.model
    bad = [w for w in m.pattern if w not in ("local", "global")]
    if bad:
        close = did_you_mean(bad[0], ("local", "global"))  # ' (did you mean global?)'
        hint = f" ({bad[0]!r}: {close.strip(' ()')})" if close else ""
        return (
            f"window_pattern={m.window_pattern!r}: expected a comma-separated cycle of local and "
            f"global, e.g. local,global{hint}"
        )


def _pattern_window(d: _Draft):
    m = d.model
    if m.window_pattern and not m.window:
        return f"window_pattern={m.window_pattern!r} needs a window: add window=N (N >= 1)"


def _window_pipeline(d: _Draft):
    """A pipeline stage scans its layers with one body, so every layer must attend alike."""
    if d.pipelined and len(set(d.model.layer_windows)) > 1:
        return (
            f"window_pattern={d.model.window_pattern!r} mixes local and global layers, which a "
            "pipeline stage (one scanned body for all its layers) cannot: use one window for "
            "every layer, or strategy without pp"
        )


def _pack(d: _Draft):
    if d.cfg.pack and d.cfg.data != "text":
        return (
            f"pack=true packs the text corpus's documents: needs data=text, got data={d.cfg.data}"
        )


def _pack_pipeline(d: _Draft):
    if d.cfg.pack and d.pipelined and d.purpose != "decode":
        return (
            "pack=true: a pipeline passes only the residual stream stage to stage, not the "
            "documents' segment ids: train packed documents without strategy=pp*"
        )


def _ring(d: _Draft):
    if d.model.attention == "ring" and d.cfg.strategy != "cp":
        return (
            "attention=ring passes keys/values around the sequence axis: add strategy=cp "
            "(the sequence split over the mesh's model axis, e.g. mesh=2x4)"
        )


def _ring_splits(d: _Draft):
    axes = dict(MESH_RULES.get(d.cfg.strategy, ())).get(SEQ) or ()
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    W = math.prod((d.sizes or {}).get(a, 1) for a in axes)
    if d.model.attention == "ring" and W > 1 and d.cfg.seq_len % W:
        where = " × ".join(f"{a}={(d.sizes or {}).get(a, 1)}" for a in axes)
        return (
            f"attention=ring splits seq_len={d.cfg.seq_len} over {where} devices: choose a "
            f"multiple of {W} (e.g. seq_len={max(W, d.cfg.seq_len // W * W)})"
        )


def _accumulate(d: _Draft):
    if d.cfg.batch_size % d.cfg.accumulate:
        return (
            f"accumulate={d.cfg.accumulate} must divide batch_size={d.cfg.batch_size} "
            "(K microbatches of batch_size/K sequences)"
        )


def _microbatches_need_pipeline(d: _Draft):
    m = d.model
    if m.microbatches and not d.pipelined:
        return (
            f"microbatches={m.microbatches} feeds a pipeline: it needs strategy=pp, pp+fsdp or "
            "pp+tp and a stage axis (e.g. mesh=data:2,stage:4; microbatches=0 runs without one)"
        )


def _repeats_need_pipeline(d: _Draft):
    if d.model.pipeline_repeats > 1 and not d.pipelined:
        return (
            f"pipeline_repeats={d.model.pipeline_repeats} is the circular pipeline: it needs "
            "strategy=pp, pp+fsdp or pp+tp and a stage axis (pipeline_repeats=1 runs without one)"
        )


def _microbatches_divide(d: _Draft):
    rows, M = d.cfg.batch_size // d.cfg.accumulate, d.model.microbatches
    if M and d.cfg.batch_size % d.cfg.accumulate == 0 and rows % M:
        per = f"batch_size/accumulate={rows}" if d.cfg.accumulate > 1 else f"batch_size={rows}"
        return f"microbatches={M} must divide {per}"


def _process_id(d: _Draft):
    if d.cfg.process_id >= d.cfg.num_processes:
        return f"process_id={d.cfg.process_id} must be < num_processes={d.cfg.num_processes}"


def _coordinator(d: _Draft):
    if d.cfg.num_processes > 1 and not d.cfg.coordinator:
        return "num_processes > 1 needs coordinator=host:port"


def _a_device_per_process(d: _Draft):
    # every process has a device at least, so a mesh given in numbers smaller than the
    # processes cannot span them: said before they wait for each other to join (a mesh a
    # caller built is its own, and mesh= is not used)
    if d.cfg.num_processes < 2 or d.platform.mesh is not None:
        return None
    try:
        sizes = parse_mesh_spec(d.cfg.mesh)
    except MeshSpecError:
        return None  # the mesh rule says what is wrong with it
    if -1 in sizes.values() or math.prod(sizes.values()) >= d.cfg.num_processes:
        return None
    used = math.prod(sizes.values())
    return (
        f"mesh={d.cfg.mesh} spans {used} device{'s' * (used > 1)}, fewer than the "
        f"num_processes={d.cfg.num_processes} (each holds one at least): a run over several "
        "processes needs a mesh over all their devices (e.g. mesh=data:-1)"
    )


def _processes_hold_the_mesh(d: _Draft):
    # the mesh takes the devices in order, process 0's first: with fewer than all of them the
    # last processes hold none of it, and a process with no part of a batch cannot build it
    info, p = d.platform.info, d.platform
    processes = info.process_count if info is not None else 1
    if processes < 2 or d.sizes is None or p.aot or p.mesh is not None:
        return None
    used = math.prod(d.sizes.values())
    if used != p.count:
        return (
            f"mesh={d.mesh_text} uses {used} of the {p.count} devices of the {processes} "
            "processes: a run over several processes needs a mesh over all their devices, "
            f"so that each holds its share (e.g. mesh=data:-1, or mesh={p.count})"
        )


def _overwrite_resume(d: _Draft):
    if d.cfg.overwrite and d.cfg.resume:
        return "overwrite=true clears the folder's run and resume=true continues it: choose one"


def _resume_name(d: _Draft):
    if d.cfg.resume and not d.cfg.name:
        return "resume=true needs the run's name=NAME"


def _compile_only_resume(d: _Draft):
    if d.cfg.resume and d.cfg.compile_only:
        what = f"target={d.cfg.target} (a plan)" if d.cfg.target else "compile_only=true"
        return (
            f"{what} writes a config.json and summary.json of its own, which would "
            "replace those of the run it resumes: leave out resume=true and give it another "
            "name="
        )


def _does_nothing(what: str, keys) -> str | None:
    """The line for keys given (`keys`: (text, given) pairs) to a command that `what`."""
    asked = [key for key, given in keys if given]
    if asked:
        them = "it" if len(asked) == 1 else "them"
        return f"{what}, so {', '.join(asked)} would do nothing: leave {them} out"
    return None


def _compile_only_runs_nothing(d: _Draft):
    c = d.cfg
    if c.target or not c.compile_only:
        return None  # a plan: its own rule
    return _does_nothing(
        "compile_only=true compiles the step and trains nothing",
        (
            ("profile=true", c.profile),
            (f"checkpoint_every={c.checkpoint_every}", c.checkpoint_every),
        ),
    )


def _profile_window(d: _Draft):
    c = d.cfg
    if not c.profile or c.compile_only or c.target or c.resume:  # a resume's: lab/loop.py
        return None
    first, last = profile_window(0)
    if c.steps < last:
        return (
            f"profile=true traces steps {first}-{last} (after the warm-up), and steps={c.steps} "
            f"ends before them: give steps >= {last}"
        )


def _plan_runs_nothing(d: _Draft):
    c = d.cfg
    if not c.target:
        return None
    return _does_nothing(
        f"target={c.target} compiles a plan and runs nothing",
        (
            ("profile=true", c.profile),
            (f"checkpoint_every={c.checkpoint_every}", c.checkpoint_every),
            (f"coordinator={c.coordinator}", c.coordinator),
            (f"num_processes={c.num_processes}", c.num_processes > 1),
        ),
    )


def _mesh_fits(d: _Draft):
    if d.sizes is None:
        return d.mesh_problem


def _strategy_axes(d: _Draft):
    """An explicit strategy whose axes all have size 1 would silently run as data parallel."""
    axes = STRATEGY_AXES.get(d.cfg.strategy, ())
    n = math.prod(d.sizes.values())
    if d.stages > 1 and not d.pipelined:
        return None  # the stage axis unused: `_stage_needs_pipeline` says what to do
    if axes and n > 1 and all(d.sizes.get(a, 1) == 1 for a in axes):
        mesh = ",".join(f"{a}:{s}" for a, s in d.sizes.items() if s > 1)
        # a strategy of two axes: an example with both, where the devices split in two
        two = "+" in d.cfg.strategy and len(axes) > 1 and n % 4 == 0
        example = f"{axes[0]}:{n // 2},{axes[1]}:2" if two else ""
        return (
            f"strategy={d.cfg.strategy} splits over the {' or '.join(axes)} axis, which the "
            f"mesh {mesh} does not have: name it (e.g. mesh={example or f'{axes[0]}:{n}'})"
        )


_WITHIN_STAGE = {"pp+fsdp": "fsdp", "pp+tp": "model"}


def _within_stage_axis(d: _Draft):
    """pp+fsdp and pp+tp split each stage over fsdp or model: without that axis they would
    run as plain pp under another name."""
    axis = _WITHIN_STAGE.get(d.cfg.strategy)
    if d.purpose == "decode":  # a decoder of a pipeline's run serves it on its own mesh
        return None
    if axis and d.stages > 1 and d.sizes.get(axis, 1) == 1:
        mesh = ",".join(f"{a}:{s}" for a, s in d.sizes.items() if s > 1)
        # an example on the same devices: an inner axis of 2 taken from the batch's axis, else
        # from the stages where two or more are left (2 divides the weights; 3 seldom does)
        sizes = {a: s for a, s in d.sizes.items() if s > 1}
        if sizes.get(DATA, 1) % 2 == 0:
            sizes |= {DATA: sizes[DATA] // 2, axis: 2}
        elif d.stages % 2 == 0 and d.stages >= 4:
            sizes |= {STAGE: d.stages // 2, axis: 2}
        else:
            sizes = {}
        example = ",".join(f"{a}:{s}" for a, s in sizes.items() if s > 1)
        name_it = f"mesh={example}" if sizes else f"a mesh with both axes, stage:N,{axis}:M"
        return (
            f"strategy={d.cfg.strategy} splits each pipeline stage over the {axis} axis, which "
            f"the mesh {mesh} does not have: name it (e.g. {name_it}) or use strategy=pp"
        )


def _stage_needs_pipeline(d: _Draft):
    if d.stages > 1 and not d.pipelined:
        return (
            f"the mesh has stage={d.stages} but strategy={d.cfg.strategy} does not use it: "
            "use strategy=pp, pp+fsdp or pp+tp (or strategy=auto)"
        )


def _stages_split_layers(d: _Draft):
    R = d.model.pipeline_repeats
    if d.pipelined and d.model.n_layers % (d.stages * R):
        repeats = f" x pipeline_repeats={R}" if R > 1 else ""
        return (
            f"n_layers={d.model.n_layers} does not divide into stage={d.stages} "
            f"stages{repeats}: choose n_layers or the mesh's stage size so that each stage "
            "holds whole layers"
        )


def _circular(d: _Draft):
    R, M = d.model.pipeline_repeats, d.model.microbatches or d.stages
    if d.pipelined and R > 1 and M < d.stages:
        return (
            f"pipeline_repeats={R} (circular) needs microbatches >= stage={d.stages}, got "
            f"microbatches={M}"
        )


def _half_weights(d: _Draft):
    """AdamW's state in float16 cannot train: its eps (1e-8) rounds to 0 there and the first
    update is 0/0 = NaN, whatever the learning rate."""
    if d.model.param_dtype == "float16" and d.purpose == "train":  # a plan (lab.serve's) runs
        # nothing, and a decoder keeps no optimizer state
        return (
            "param_dtype=float16 stores AdamW's moments in float16, where its eps (1e-8) rounds "
            "to 0 and the first update is NaN: store the weights in float32 (param_dtype=float32, "
            "with dtype=float16 to compute in half precision) or bfloat16"
        )


def _offload_host(d: _Draft):
    asked = ["offload_optimizer=true"] if d.cfg.offload_optimizer else []
    asked += ["remat=offload"] if d.model.remat == "offload" else []
    if asked and not d.platform.host_memory:
        # only targets where the option takes effect: a TPU topology's devices list a
        # pinned_host memory kind; a GPU plan's abstract devices list none, so the optimizer
        # state would stay in device memory there (remat=offload's residuals do move on both).
        # a slice runs one program over all its devices: mesh=-1 (libtpu 0.10 refuses v5e:1x1)
        where = (
            "a TPU target, whose devices list a host memory kind: target=tpu:v5e:2x2 mesh=-1 "
            "(a GPU plan's devices list none, so its optimizer state would stay in device "
            "memory)"
            if d.cfg.offload_optimizer
            else "an accelerator with target=tpu:v5e:2x2 mesh=-1 or target=gpu:h100:1"
        )
        return (
            f"{' and '.join(asked)}: the {d.platform.backend} backend has no separate host "
            "memory (its pinned_host memory kind is the same RAM as its device memory), so "
            f"nothing would move; plan it for {where}"
        )


def _offload_pipeline(d: _Draft):
    """XLA:GPU (jax 0.10 and 0.12) fails to compile host-offloaded residuals stacked by two
    nested loops (a stage's layers inside the pipeline's ticks) with an internal layout
    error; one layer per stage, and TPU, compile."""
    m = d.model
    if (
        d.platform.backend == "gpu"
        and m.remat == "offload"
        and d.pipelined
        and d.stages > 1
        and m.n_layers > d.stages * m.pipeline_repeats
    ):
        return (
            f"remat=offload in a pipeline stage of {m.n_layers // d.stages} layers does not "
            "compile for GPU (XLA:GPU's layout assignment fails on host-offloaded residuals of "
            "nested loops): use remat=full, or one layer per stage"
        )


def _batch_splits(d: _Draft):
    n = d.batch_split()
    if d.purpose != "decode" and d.cfg.batch_size % n:
        return (
            f"batch_size={d.cfg.batch_size} does not split over the {n} devices the batch is "
            f"split over (strategy={d.cfg.strategy}, mesh={d.mesh_text}): choose a multiple of {n}"
        )


def _accumulation_splits(d: _Draft):
    n, K = d.batch_split(), d.cfg.accumulate
    rows = d.cfg.batch_size // K
    if d.purpose != "decode" and K > 1 and d.cfg.batch_size % K == 0 and rows % n:
        return (
            f"accumulate={K}: microbatches of batch_size/accumulate={rows} rows do not split "
            f"over the batch's {n} devices: choose a batch_size, accumulate or mesh that divide"
        )


def _pipeline_microbatch_splits(d: _Draft):
    rows = d.cfg.batch_size // d.cfg.accumulate
    M = d.model.microbatches or d.stages
    inner = d.batch_split(without=(STAGE,))
    if d.pipelined and d.purpose != "decode" and rows % M == 0 and (rows // M) % inner:
        return (
            f"pipeline microbatches: {rows} rows / microbatches={M} = {rows // M} rows do not "
            f"split over the {inner} devices of the stage's batch; choose a batch_size, "
            "microbatches or mesh that divide"
        )


def _decode_batches(d: _Draft):
    """Every batch a decoder is built for splits over the decoding mesh's batch axes."""
    n = d.batch_split()
    bad = sorted({b for b in d.batches if b % n})
    if d.purpose == "decode" and bad:
        of = "plan_batch=" if d.cfg.target else "batches= and prefill_batches=, defaults included"
        return (
            f"serving batches {bad} (of {of}) do not split over the mesh's batch axes ({n} "
            f"devices): use multiples of {n}"
        )


def _weights_split(d: _Draft):
    """Every weight splits evenly over the mesh axes its logical axes map to (the strategy's
    rules): one line naming the first weight that does not, and how many more break a split."""
    import flax.linen as nn

    from lab.model import build

    m = d.model
    rules = MESH_RULES[d.cfg.strategy]
    if d.attention_chosen:
        model = d.built_model = build(m)
    else:  # no kernel takes the input (that line is said): the same weights, any kernel
        model = build(dataclasses.replace(m, attention="naive"))
    key = jax.eval_shape(jax.random.key, 0)
    tokens = jax.ShapeDtypeStruct((1, d.cfg.seq_len), jnp.int32)
    # a built mesh, or an abstract one of its sizes (a check before any device is built)
    context = jax.set_mesh if isinstance(d.mesh, jax.sharding.Mesh) else use_abstract_mesh
    with context(d.mesh), nn.logical_axis_rules(rules):
        boxed = jax.eval_shape(model.init, key, tokens)["params"]
    d.abstract_params = boxed  # the trainer's abstract state starts from them: one trace
    specs = nn.logical_to_mesh(nn.get_partition_spec(boxed), rules)
    leaves = jax.tree_util.tree_leaves_with_path(nn.meta.unbox(boxed))
    spec_leaves = jax.tree.leaves(
        specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )
    broken = []
    for (path, leaf), spec in zip(leaves, spec_leaves, strict=True):
        for dim, (size, axes) in enumerate(zip(leaf.shape, tuple(spec), strict=False)):
            names = (axes,) if isinstance(axes, str) else tuple(axes or ())
            n = math.prod(d.sizes.get(a, 1) for a in names)
            if size % n:
                broken.append(
                    f"params{jax.tree_util.keystr(path)}: dimension {dim} (size {size}) does "
                    f"not divide mesh axis {axes} (size {n}); change the mesh, the strategy or "
                    "the model size"
                )
                break  # a weight counts once
    if not broken:
        return None
    first, *more = broken
    if more:  # one line: the first weight, and how many more break a split
        first += f" ({len(more)} more weight{'s' if len(more) > 1 else ''} break a split)"
    return first


RULES: tuple[Rule, ...] = (
    Rule(
        "process id",
        _process_id,
        ("num_processes=2", "process_id=2", "coordinator=localhost:1234", "mesh=data:-1"),
        stage="request",
    ),
    Rule(
        "multi-host needs a coordinator",
        _coordinator,
        ("num_processes=2", "mesh=data:-1"),
        stage="request",
    ),
    Rule(
        "a device for each process",
        _a_device_per_process,
        ("num_processes=2", "coordinator=localhost:1234", "mesh=1"),
        stage="request",
    ),
    Rule(
        "overwrite or resume",
        _overwrite_resume,
        ("name=x", "overwrite=true", "resume=true"),
        stage="request",
    ),
    Rule("resume needs a name", _resume_name, ("resume=true",), stage="request"),
    Rule(
        "a plan resumes nothing",
        _compile_only_resume,
        ("name=x", "resume=true", "compile_only=true"),
        stage="request",
    ),
    Rule(
        "a plan runs nothing",
        _plan_runs_nothing,
        ("target=tpu:v5e:2x2", "mesh=4", "profile=true"),
        stage="request",
    ),
    Rule(
        "compile only runs nothing",
        _compile_only_runs_nothing,
        ("compile_only=true", "profile=true"),
        stage="request",
    ),
    Rule("profile within the run", _profile_window, ("profile=true", "steps=3"), stage="request"),
    Rule("kv heads divide heads", _kv_heads, ("n_heads=4", "n_kv_heads=3")),
    Rule("heads divide d_model", _heads, ("d_model=60", "n_heads=8", "n_kv_heads=4")),
    Rule("even head_dim", _rotary, ("d_model=12", "n_heads=4", "n_kv_heads=2")),
    Rule("text needs bytes", _text_vocab, ("vocab_size=100", "data=text")),
    Rule("text longer than a sequence", _text_length, ("data=text", "seq_len=1000000")),
    Rule("window pattern", _window_pattern, ("window=16", "window_pattern=local,glob")),
    Rule("window pattern needs a window", _pattern_window, ("window_pattern=local,global",)),
    Rule("pack needs text", _pack, ("data=synthetic", "pack=true")),
    Rule("ring needs cp", _ring, ("attention=ring",)),
    Rule("accumulate divides batch", _accumulate, ("batch_size=16", "accumulate=3")),
    Rule("microbatches need a pipeline", _microbatches_need_pipeline, ("microbatches=2",)),
    Rule("repeats need a pipeline", _repeats_need_pipeline, ("pipeline_repeats=2",)),
    Rule(
        "microbatches divide the batch",
        _microbatches_divide,
        ("mesh=stage:2", "batch_size=16", "microbatches=3"),
    ),
    Rule("weights in float16 cannot train", _half_weights, ("param_dtype=float16",)),
    Rule("offload needs host memory", _offload_host, ("offload_optimizer=true",)),
    Rule("mesh fits the devices", _mesh_fits, ("mesh=16",)),
    Rule(
        "every process holds part of the mesh",
        _processes_hold_the_mesh,
        ("num_processes=2", "cpu_devices=4", "mesh=2"),
        processes=2,
    ),
    Rule(
        "strategy has its axes",
        _strategy_axes,
        ("mesh=data:2", "strategy=tp"),
        needs_mesh=True,
    ),
    Rule(
        "a stage has its inner axis",
        _within_stage_axis,
        ("mesh=data:2,stage:2", "strategy=pp+fsdp", "n_layers=4"),
        needs_mesh=True,
    ),
    Rule(
        "stage axis needs a pipeline",
        _stage_needs_pipeline,
        ("mesh=stage:2", "strategy=dp"),
        needs_mesh=True,
    ),
    Rule(
        "one window per pipeline layer",
        _window_pipeline,
        ("mesh=stage:2", "n_layers=4", "window=8", "window_pattern=local,global"),
        needs_mesh=True,
    ),
    Rule(
        "no packed documents in a pipeline",
        _pack_pipeline,
        ("mesh=stage:2", "data=text", "pack=true"),
        needs_mesh=True,
    ),
    Rule(
        "stages split the layers",
        _stages_split_layers,
        ("mesh=stage:2", "n_layers=3"),
        needs_mesh=True,
    ),
    Rule(
        "circular needs microbatches >= stages",
        _circular,
        ("mesh=stage:2", "n_layers=4", "pipeline_repeats=2", "microbatches=1"),
        needs_mesh=True,
    ),
    Rule(
        "no offloaded residuals in GPU pipeline stages",
        _offload_pipeline,
        ("target=gpu:h100:2", "mesh=stage:2", "n_layers=4", "remat=offload", "model=tiny"),
        needs_mesh=True,
    ),
    Rule("batch splits over the mesh", _batch_splits, ("mesh=8", "batch_size=12"), True),
    Rule(
        "ring splits the sequence",
        _ring_splits,
        ("mesh=2x4", "strategy=cp", "attention=ring", "seq_len=30"),
        needs_mesh=True,
    ),
    Rule(
        "accumulation microbatches split over the mesh",
        _accumulation_splits,
        ("mesh=8", "batch_size=16", "accumulate=4"),
        needs_mesh=True,
    ),
    Rule(
        "pipeline microbatches split over the mesh",
        _pipeline_microbatch_splits,
        ("mesh=data:4,stage:2", "batch_size=16", "microbatches=8"),
        needs_mesh=True,
    ),
    Rule(
        "weights split over the mesh",
        _weights_split,
        ("mesh=1x8", "n_heads=4", "n_kv_heads=4"),
        needs_mesh=True,
        filled=True,
    ),
    Rule(
        "decode batches split over the mesh",
        _decode_batches,
        ("model=tiny", "mesh=2", "batches=3", "prefill_batches=2"),
        needs_mesh=True,
        filled=True,
        command="lab.serve",
    ),
)


def _broken(d: _Draft, stage: str | None = None, *, filled: bool = False) -> list[str]:
    out = []
    for rule in RULES:
        if (stage and rule.stage != stage) or rule.filled != filled:
            continue
        if rule.needs_mesh and d.sizes is None:
            continue
        line = rule.check(d)
        if line:
            out.append(line)
    return out


def _raise(lines: list[str]) -> None:
    if lines:
        raise ConfigError("\n".join(dict.fromkeys(lines)))


def broken_before_joining(request: Request) -> list[str]:
    """The lines of the rules of stage "request" that `request` breaks: what must hold before
    any process joins (process ids, the coordinator, resume and overwrite)."""
    cfg = make_config(**request.dict())
    return _broken(_Draft(cfg, Platform("cpu", "", 1), "train"), "request")


def check_on_cpu(request: Request, count: int) -> None:
    """Every rule, for `count` CPU devices, with the filled ones (every weight splits over the
    mesh) traced on an abstract mesh: what a launcher checks before it starts processes that
    would each refuse the same request (all broken rules together, a line each); no device
    is built."""
    draft = _unbuilt(request, Platform("cpu", "cpu", count))
    lines = _broken(draft)
    if not lines and draft.sizes is not None:  # the filled rules read a mesh that fits
        lines = _filled_unbuilt(draft)
    _raise(lines)


def check_shapes(request: Request, platform: Platform) -> None:
    """The filled rules (every weight splits over the mesh), which no batch size or remat
    policy changes, for `request` on `platform`'s device count, traced on an abstract mesh
    (no device is built): a tool that tries many of those refuses the keys once, before it
    compiles any. A mesh that does not fit is left to `resolve`, which says why."""
    draft = _unbuilt(request, platform)
    if draft.sizes is not None:
        _raise(_filled_unbuilt(draft))


def _unbuilt(request: Request, platform: Platform) -> _Draft:
    """The first pass's draft of `request` on `platform`, as `resolve` makes it (defaults,
    the compute dtype, the strategy an `auto` takes from the mesh), without its mesh."""
    cfg = make_config(backend=platform.backend, **request.dict())
    cfg = defaults(_whole_target(cfg, request, platform))
    cfg = dataclasses.replace(cfg, model=resolve_dtype(cfg.model, platform.backend))
    sizes, problem = _sizes(cfg, platform)
    if sizes is not None and cfg.strategy == "auto":
        cfg = dataclasses.replace(cfg, strategy=auto_strategy(sizes))
    return _Draft(cfg, platform, "train", sizes, cfg.model.attention, problem)


def _as_pipelined(cfg: Config, stages: int) -> Config:
    """`cfg` as a pipeline of `stages` runs it: the stages hold slices of the stacked layers
    (scan_layers) and the batch splits into microbatches (one per stage unless asked). One
    helper for `resolve` and the launcher's check (`_filled_unbuilt`), so they cannot differ."""
    microbatches = cfg.model.microbatches or stages
    model = dataclasses.replace(cfg.model, scan_layers=True, microbatches=microbatches)
    return dataclasses.replace(cfg, model=model)


def _filled_unbuilt(d: _Draft) -> list[str]:
    """The filled rules' lines for draft `d` (its mesh fits) on an abstract mesh of its sizes:
    they read only the mesh's axis sizes and the model's shapes, so no device is needed."""
    cfg = _as_pipelined(d.cfg, d.stages) if d.pipelined else d.cfg  # as `resolve` fills it
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    mesh = jax.sharding.AbstractMesh(tuple(d.sizes[a] for a in AXES), AXES, axis_types=auto)
    return _broken(dataclasses.replace(d, cfg=cfg, mesh=mesh), filled=True)


# ------------------------------------------------------------------------ resolve


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A config with every default applied, every `auto` filled and every rule checked, for
    one platform and purpose; the builders take it as it is."""

    cfg: Config
    platform: Platform
    purpose: str
    sizes: tuple[tuple[str, int], ...]  # the mesh: (data, stage, fsdp, model) sizes
    notes: tuple[str, ...] = ()  # what the compiled program does not do that was asked for
    attention_note: str | None = None  # why the attention kernel is not the one preferred
    offload_optimizer: bool = False  # the optimizer state compiled into host memory
    batches: tuple[int, ...] = ()  # purpose decode: the batch sizes decoders are built for
    request: Request = dataclasses.field(default_factory=Request, compare=False)
    mesh: Any = dataclasses.field(default=None, compare=False, repr=False)
    # the model (lab.model.build of cfg.model) and its boxed abstract weights (logical names,
    # shapes) on this mesh, built and traced once by the rule that every weight splits; the
    # trainer takes the model and builds its abstract state from those weights
    abstract_params: Any = dataclasses.field(default=None, compare=False, repr=False)
    model: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        c, m = self.cfg, self.cfg.model
        assert "auto" not in (c.strategy, c.data, m.dtype, m.attention), self.cfg
        assert dict(self.sizes).keys() == set(AXES), self.sizes

    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(self.sizes)


def mesh_spec(sizes: dict[str, int]) -> str:
    """{data: 4, model: 2, ...} → 'data:4,model:2' (axes of size 1 left out)."""
    return ",".join(f"{a}:{n}" for a, n in sizes.items() if n > 1) or "1"


def _sizes(cfg: Config, platform: Platform) -> tuple[dict | None, str | None]:
    if platform.mesh is not None:
        return {a: 1 for a in AXES} | dict(platform.mesh.shape), None
    try:
        sizes = resolve_shape(cfg.mesh, platform.count, platform.target if platform.aot else "")
    except MeshSpecError as e:
        if platform.aot:  # the target names its hardware
            return None, str(e)
        hint = " (on CPU, cpu_devices=N simulates more)" if platform.backend == "cpu" else ""
        if platform.backend == "cpu" and cfg.cpu_devices:  # the count given is the mistake
            with contextlib.suppress(MeshSpecError):
                size = cpu_devices_for(cfg.mesh)
                if size <= cfg.cpu_devices:
                    hint = (
                        f" (on CPU: give cpu_devices= a multiple of {size}, or leave it out "
                        "to simulate the mesh's own count)"
                    )
        n = platform.info.process_count if platform.info is not None else 1
        if platform.backend == "cpu" and n > 1:  # each process simulates wanted // n devices
            with contextlib.suppress(MeshSpecError):
                wanted = cfg.cpu_devices or cpu_devices_for(cfg.mesh)
                if wanted % n:
                    what = f"cpu_devices={wanted}" if cfg.cpu_devices else f"its {wanted} devices"
                    hint = (
                        f" (on CPU each of the {n} processes simulates an equal share: "
                        f"{what} cannot be split evenly over {n} processes; give a mesh whose "
                        f"size {n} divides)"
                    )
        if platform.cpu_started:  # cpu_devices= could not size them: say so, not try it
            hint = f"; {devices.started_line(jax.local_device_count())}"
        return None, f"{e} [{platform.backend}: {platform.device_kind}]{hint}"
    used = math.prod(sizes.values())
    if platform.aot and used != platform.count:  # a plan is for the whole slice
        return None, (
            f"mesh={cfg.mesh} uses {used} of the target's {platform.count} devices: a slice "
            f"runs one program over all of them (e.g. mesh={platform.count} or mesh=-1)"
        )
    return sizes, None


def _build_mesh(sizes: dict, platform: Platform):
    if platform.mesh is not None and dict(platform.mesh.shape) == sizes:
        return platform.mesh
    devs = platform.devices or tuple(jax.devices())
    return make_mesh(mesh_spec(sizes), devs)


def mask_features(d: _Draft) -> frozenset:
    """What the model's attention calls need beyond causal (common.FEATURE_NAMES): a window,
    soft-capping, and segment ids for packed training rows."""
    m, out = d.model, set()
    if any(w is not None for w in m.layer_windows):
        out.add("window")
    if m.softcap:
        out.add("softcap")
    if d.cfg.pack and d.purpose != "decode":
        out.add("segments")
    return frozenset(out)


def _attention(d: _Draft, mesh) -> tuple[str, str | None]:
    """(the kernel compiled, why it is not the one preferred here, or None): the dispatch's
    choice for the platform and shape; on a GPU the target's capabilities decide what would
    run, and a plan says when this host compiles another kernel."""
    m = d.model
    features = mask_features(d)
    if m.attention == "ring":
        missing = features - supported_features("ring")
        if missing:
            raise ValueError(f"impl=ring does not take {', '.join(sorted(missing))}")
        return "ring", None
    dtype = jnp.dtype(m.dtype)
    q = jax.ShapeDtypeStruct((1, d.cfg.seq_len, m.n_heads, m.head_dim), dtype)
    kv = jax.ShapeDtypeStruct((1, d.cfg.seq_len, m.n_kv_heads, m.head_dim), dtype)
    with jax.set_mesh(mesh):  # the target's platform and device kind decide
        impl, note = choose_noted(
            m.attention, q, kv, kv, causal=True, backend=d.platform.backend, features=features
        )
        target = target_note(d.platform, m.attention, impl, q, kv, causal=True, features=features)
    if impl in WHOLE_SEQUENCES and _splits_sequence(d):
        if m.attention != "auto":
            raise ValueError(
                f"strategy=cp splits the sequence over the model axis, and {impl} needs whole "
                "sequences per device: use attention=ring (K/V passed around the devices), or "
                "blockwise, naive or xla (partitioned by XLA)"
            )
        impl = "blockwise"
        note = (
            "strategy=cp splits the sequence: blockwise, which XLA partitions along it "
            "(attention=ring passes K/V around the devices instead)"
        )
    return impl, "; ".join(n for n in (target, note) if n) or None


# Kernels run per device on whole sequences (shard_map over batch and heads), and cuDNN's
# fused attention, whose partitioner refuses a sharded sequence: a split one is not theirs.
WHOLE_SEQUENCES = ("cpu_flash", "pallas_tpu", "pallas_gpu", "pallas_mgpu", "cudnn")


def _splits_sequence(d: _Draft) -> bool:
    """Whether the strategy's rules put the sequence over a mesh axis of more than 1 device."""
    axes = dict(MESH_RULES[d.cfg.strategy]).get(SEQ, ())
    return math.prod(d.sizes.get(a, 1) for a in axes) > 1


def target_note(
    platform: Platform, asked: str, impl: str, q, kv, *, causal: bool, features=frozenset()
):
    """Where `auto` compiled `impl` on this host although the target would run cuDNN's fused
    attention (a GPU runs it; this host lacks the library to compile it): one line that says
    so, else None."""
    if asked != "auto" or impl == "cudnn" or not platform.cudnn or platform.cudnn_here:
        return None
    try:
        choose_noted("cudnn", q, kv, kv, causal=causal, backend="gpu", features=features)
    except ValueError:  # cuDNN does not take this input: the target would not run it either
        return None
    return (
        f"cuDNN would run here ({platform.device_kind}); compiled with {impl}: this host has "
        "no cuDNN library to compile it"
    )


def defaults(cfg: Config) -> Config:
    """The defaults one key takes from another before the platform is known: a bare device
    count follows an explicit strategy's axis (mesh=8 strategy=fsdp is fsdp:8; the rest of
    lab.mesh.strategy_mesh)."""
    return dataclasses.replace(cfg, mesh=strategy_mesh(cfg.mesh, cfg.strategy))


def _whole_target(cfg: Config, request: Request, platform: Platform) -> Config:
    """A plan is one program over every device of its target: where no mesh= was given (by
    the user or a resumed run's config.json; a config built in code names its own), a target
    of several devices takes mesh=-1 (all of them, on the axis mesh=N would take: the batch's,
    or an explicit one-axis strategy's), not the one device that the default mesh=1 names
    and the target would refuse."""
    if platform.aot and platform.count > 1 and "mesh" not in request.dict():
        return dataclasses.replace(cfg, mesh="-1")
    return cfg


def _buildable(sizes: dict | None, platform: Platform) -> bool:
    """Whether the mesh of `sizes` can be built on `platform`'s devices (a platform found
    alone, for a request that breaks a rule before joining, may hold fewer)."""
    if sizes is None:
        return False
    if platform.mesh is not None:
        return True
    return math.prod(sizes.values()) <= len(platform.devices or jax.devices())


def resolve(
    request: Request, platform: Platform, purpose: str = "train", *, batches=()
) -> Resolved:
    """`request` on `platform` for `purpose` (train, decode, plan or restore; `batches`: the batch
    sizes decoders are built for): the backend's defaults applied, every `auto` filled, every
    rule of `RULES` checked (all broken ones raised together as one ConfigError, a line each,
    whichever pass finds them), the run named.

    The rules of stage "request" and the first pass's are checked together; the filled rules
    and the attention choice read the filled config and its built mesh, so they are checked
    once the first pass's rules hold (those of stage "request" aside: they tie no shapes),
    their lines joined to the request's."""
    if purpose not in PURPOSES:
        raise ValueError(f"purpose={purpose!r}: expected one of {', '.join(PURPOSES)}")
    batches = tuple(batches)
    cfg = make_config(backend=platform.backend, **request.dict())
    cfg = defaults(_whole_target(cfg, request, platform))
    model = resolve_dtype(cfg.model, platform.backend)
    fills = {}
    if cfg.data == "auto":
        fills["data"] = "text" if model.vocab_size == 256 else "synthetic"
    if cfg.loss_scale == 0:  # auto: float16 underflows small gradients unless scaled up
        fills["loss_scale"] = 2.0**15 if model.dtype == "float16" else 1.0
    if platform.aot or purpose == "plan":
        fills["compile_only"] = True
    cfg = dataclasses.replace(cfg, model=model, **fills)
    sizes, problem = _sizes(cfg, platform)
    if sizes is not None and cfg.strategy == "auto":
        cfg = dataclasses.replace(cfg, strategy=auto_strategy(sizes))
    if sizes is not None and purpose in ("decode", "restore"):
        cfg = _batch_of_no_step(cfg, sizes)
    draft = _Draft(cfg, platform, purpose, sizes, model.attention, problem, batches=batches)
    early, lines = _broken(draft, "request"), _broken(draft, "platform")
    if draft.pipelined and purpose != "decode" and request.asked("scan_layers"):
        if not cfg.model.scan_layers:  # a pipeline's stages hold slices of the stacked layers
            lines.append(
                f"scan_layers=false: pipelines (strategy={cfg.strategy}) stack the layers, "
                "so scan_layers=false cannot apply; drop it"
            )
    if lines or not _buildable(sizes, platform):
        _raise(early + lines)
    if draft.pipelined and purpose != "decode":
        cfg = _as_pipelined(cfg, draft.stages)
    if purpose == "decode":
        cfg, sizes = _for_decoding(cfg, sizes)
    mesh = _build_mesh(sizes, platform)
    draft = _Draft(cfg, platform, purpose, sizes, draft.asked_attention, mesh=mesh, batches=batches)
    attention_line = None
    try:  # chosen first: the weights rule builds the model the builders then take
        impl, attention_note = _attention(draft, mesh)
        draft.cfg = cfg = dataclasses.replace(
            cfg, model=dataclasses.replace(cfg.model, attention=impl)
        )
        draft.attention_chosen = True
    except ValueError as e:
        attention_line = f"attention={cfg.model.attention}: {e}"
    lines = early + _broken(draft, filled=True)
    _raise(lines + [attention_line] if attention_line else lines)
    notes, offload = (), False
    if cfg.offload_optimizer and purpose != "decode":
        offload = platform.host_memory_here
        if not offload:
            notes = (
                f"offload_optimizer: the {platform.device_kind} devices of this plan list no "
                "host memory kind (the hardware has one), so the optimizer state stays in "
                "device memory in this program",
            )
    if purpose == "train" and 0 < cfg.steps < cfg.warmup_steps:
        top = cfg.lr * (cfg.steps - 1) / cfg.warmup_steps  # the last update's, from 0
        notes += (
            f"warmup_steps={cfg.warmup_steps} > steps={cfg.steps}: the learning rate only "
            f"reaches {top:.3g}, {top / cfg.lr:.0%} of lr={cfg.lr:g} (the warm-up is linear "
            "from 0)",
        )
    if purpose in ("train", "plan") and not cfg.name:
        cfg = dataclasses.replace(cfg, name=stamped_name(cfg.preset, cfg.mesh))
    return Resolved(
        cfg,
        platform,
        purpose,
        tuple(sizes.items()),
        notes=notes,
        attention_note=attention_note,
        offload_optimizer=offload,
        batches=batches,
        request=request,
        mesh=mesh,
        abstract_params=draft.abstract_params,
        model=draft.built_model,
    )


def _batch_of_no_step(cfg: Config, sizes: dict) -> Config:
    """A decoder, or a trainer built only to restore a run's weights, steps no training
    batch: its batch_size (the default, or a training run's) is replaced by one that every
    batch rule splits (a microbatch per stage, a row per device), so that no mesh is refused
    for a batch nothing runs; a decoder's own batches are checked as `batches`."""
    M = cfg.model.microbatches or sizes.get(STAGE, 1)
    return dataclasses.replace(cfg, batch_size=M * math.prod(sizes.values()), accumulate=1)


def _for_decoding(cfg: Config, sizes: dict) -> tuple[Config, dict]:
    """The decoder's config: layers unscanned (one token per step needs no scan; the cache
    is per layer), no pipeline (its stage axis's devices join the batch's)."""
    sizes = dict(sizes)
    strategy = UNPIPELINED.get(cfg.strategy, cfg.strategy)
    if sizes.get(STAGE, 1) > 1:
        sizes[DATA], sizes[STAGE] = sizes[DATA] * sizes[STAGE], 1
    model = dataclasses.replace(cfg.model, scan_layers=False, microbatches=0, pipeline_repeats=1)
    mesh = mesh_spec(sizes) if strategy != cfg.strategy else cfg.mesh
    return dataclasses.replace(cfg, model=model, strategy=strategy, mesh=mesh), sizes

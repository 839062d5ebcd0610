"""Configuration: frozen dataclasses, presets, and the one `key=value` grammar of every command.

Every field carries its meaning in `help` (and its range, choices or kind) in the field's
metadata, so a dataclass is the single source of truth for defaults, types, ranges and
documentation. `Config` (with its `ModelConfig`) is what `python -m lab.run` trains; every
other command declares its own options as a frozen dataclass of the same kind and runs through
`cli`, which gives all of them the same behaviour: `--help` lists every key, a typo gets the
close match, a bad value is one line and exit code 2.

Library code never writes `key=value` strings: it builds configs with `make_config` and
`override` (typed keyword arguments, checked like parsed ones) or `dataclasses.replace`.
"""

import dataclasses
import difflib
import math
import numbers
import os
import re
import sys
import textwrap
import time
import typing
from pathlib import PurePath

from lab import startup
from lab.errors import ConfigError, RunError, Terminated
from lab.mesh import MeshSpecError, parse_mesh_spec
from lab.names import ATTENTION_IMPLS, DTYPES, REMATS, STRATEGIES

# ------------------------------------------------------------------------ fields and values


def field(default, help: str, *, choices=None, min=None, max=None, kind=None, auto=None):
    """A dataclass field with its documentation: `help`, allowed `choices`, a `min`/`max`, a
    `kind` the parser knows (dtype, mesh, ints, names, path), or the number `auto` that the
    word auto stands for in a numeric field (help and docs say auto, so a user types it)."""
    meta = {"help": help, "choices": choices, "min": min, "max": max, "kind": kind}
    if auto is not None:
        meta["auto"] = auto
    return dataclasses.field(default=default, metadata=meta)


def _parse_bool(key: str, raw: str) -> bool:
    low = raw.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{key}={raw!r}: expected a boolean (true/false)")


def _parse_number(key: str, raw: str, cast):
    try:
        value = cast(raw)
    except ValueError:
        what = "an integer" if cast is int else "a number"
        raise ConfigError(f"{key}={raw!r}: expected {what}") from None
    if cast is float and not math.isfinite(value):
        raise ConfigError(f"{key}={raw!r}: expected a finite number")
    return value


def _check_range(key: str, raw, value, meta) -> None:
    if meta.get("min") is not None and value < meta["min"]:
        raise ConfigError(f"{key}={raw!r}: must be >= {meta['min']}")
    if meta.get("max") is not None and value > meta["max"]:
        raise ConfigError(f"{key}={raw!r}: must be <= {meta['max']}")


# keys by the names the lab's own output gives their values (metrics.jsonl, TensorBoard)
_WRITTEN_AS = {"learning_rate": "lr"}


def did_you_mean(word: str, options) -> str:
    """' (did you mean X?)' for the option closest to `word`, case aside (STEPS → steps), or
    ' (did you mean X or Y?)' where two are as close (dpp: dp or pp); '' where none is. An
    option of which `word` is a whole part is close (bwd: fwd+bwd, not fwd); its plural or
    singular is closer still (batch: batches, not plan_batch; dir: dirs, not out_dir)."""
    scored = {}
    w = word.lower()
    options = [str(o) for o in options]  # read once: an iterator is read again below
    if _WRITTEN_AS.get(w) in options:  # the metrics' name for a key: the key
        return f" (did you mean {_WRITTEN_AS[w]}?)"
    for option in options:
        o = option.lower()
        score = difflib.SequenceMatcher(None, w, o).ratio()
        parts = re.split(r"[^a-z0-9]+", o)
        if len(word) >= 2 and w in parts:  # bwd: fwd+bwd holds it
            score = max(score, 0.9 + 0.1 * score)  # the likeness still orders such options
        if len(word) >= 3 and (o in (w + "s", w + "es") or w in (o + "s", o + "es")):
            score = 0.99  # one word in number: before every option that merely holds it
        if score >= 0.6:  # difflib.get_close_matches' own cutoff
            scored[option] = max(score, scored.get(option, 0.0))
    if not scored:
        return ""
    best = max(scored.values())
    tied = sorted(o for o, v in scored.items() if v == best)[:2]
    return f" (did you mean {' or '.join(tied)}?)"


def _check_choice(key: str, raw, value, choices) -> None:
    if choices and value not in choices:
        named = [c for c in map(str, choices) if c]  # "" (the default) has no spelling
        hint = did_you_mean(str(value), named)
        empty = " or nothing (the default)" if len(named) < len(choices) else ""
        raise ConfigError(f"{key}={raw!r}: expected one of {' | '.join(named)}{empty}{hint}")


def _parse_list(key: str, raw: str, meta, cast) -> tuple:
    items = [x.strip() for x in raw.split(",")]
    if not any(items):
        raise ConfigError(f"{key}={raw!r}: expected a comma-separated list")
    if cast is not str and not all(items):  # 1,,2: a value left out, not a list of two
        raise ConfigError(f"{key}={raw!r}: an empty item between commas")
    items = [x for x in items if x]
    values = []
    for item in items:
        try:
            value = _parse_number(key, item, cast) if cast is not str else item
        except ConfigError:
            what = "an integer" if cast is int else "a finite number"
            raise ConfigError(f"{key}={raw!r}: {item!r} is not {what}") from None
        if cast is not str:
            _check_range(key, raw, value, meta)
        _check_choice(key, raw, value, meta.get("choices"))
        if value in values:  # each is a point, a step or a name to measure once
            raise ConfigError(f"{key}={raw}: {item.strip()} is given twice")
        values.append(value)
    return tuple(values)


def parse_value(f: dataclasses.Field, typ, raw: str):
    """The typed value of `raw` for field `f` (its resolved type `typ`), or a ConfigError."""
    key, meta = f.name, f.metadata
    kind = meta.get("kind")
    if kind == "dtype":
        if raw.lower() not in DTYPES and not (raw == "auto" and f.default == "auto"):
            extra = ", auto" if f.default == "auto" else ""
            raise ConfigError(
                f"{key}={raw!r}: expected one of float32 (f32), bfloat16 (bf16), float16 (f16)"
                f"{extra}"
            )
        return DTYPES.get(raw.lower(), raw)
    if kind == "mesh":
        if not raw.strip():
            raise ConfigError(
                f"{key}=: no mesh given; e.g. {key}=4x2, {key}=data:2,model:4 or {key}=1 "
                "(see --help)"
            )
        try:
            parse_mesh_spec(raw)
        except MeshSpecError as e:
            raise ConfigError(f"mesh={raw!r}: {e}") from None
        return raw
    if kind in ("ints", "floats", "names") and not raw.strip() and f.default == ():
        return ()  # only= as --help shows its default: nothing named, so the default (all)
    if kind == "ints":
        return _parse_list(key, raw, meta, int)
    if kind == "floats":
        return _parse_list(key, raw, meta, float)
    if kind == "names":
        return _parse_list(key, raw, meta, str)
    if typ is bool:
        return _parse_bool(key, raw)
    if typ in (int, float):
        if meta.get("auto") is not None and raw.strip().lower() == "auto":
            return meta["auto"]
        try:
            value = _parse_number(key, raw, typ)
        except ConfigError as e:
            if meta.get("auto") is None:
                raise
            raise ConfigError(f"{e} or auto") from None
        _check_range(key, raw, value, meta)
        return value
    _check_choice(key, raw, raw, meta.get("choices"))
    if kind == "path" and "\0" in raw:
        raise ConfigError(f"{key}={raw!r}: not a path")
    if kind == "path":  # a quoted ~ (out_dir='~/x', key=~/x in a script) is the home, as typed
        return os.path.expanduser(raw)
    return raw


_TYPE_WORDS = {
    bool: "a boolean (True or False)",
    int: "an integer",
    float: "a number",
    str: "a string",
}


def _typed(key: str, value, typ):
    """`value` when it has the type `typ` (a bool is not an int; an int stands for a float),
    as a plain Python value (a NumPy integer as an int); else a ConfigError."""
    if typ is bool:
        ok = isinstance(value, bool)
    elif typ is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    elif typ is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    else:
        ok = isinstance(value, typ)
    if not ok:
        raise ConfigError(f"{key}={value!r}: expected {_TYPE_WORDS.get(typ, typ.__name__)}")
    if typ in (int, float) and type(value) not in (int, float):
        return typ(value)
    return value


def check_value(f: dataclasses.Field, typ, value):
    """`value` given by library code for field `f` (its resolved type `typ`), checked as
    `parse_value` checks a parsed one: its type (a string is not parsed into a number: steps=3,
    not "3"), range and choices, and what its kind parses (a dtype's name, a mesh). Returns it
    as the config keeps it: a dtype by its full name (bf16 → bfloat16), a path as a string, the
    word auto of a numeric field as the number it stands for."""
    key, meta = f.name, f.metadata
    kind = meta.get("kind")
    if kind in ("ints", "floats", "names"):
        item = {"ints": int, "floats": float, "names": str}[kind]
        if not isinstance(value, tuple | list):
            raise ConfigError(f"{key}={value!r}: expected a tuple of {_TYPE_WORDS[item]}s")
        values = [_typed(key, v, item) for v in value]
        for v in values:
            if kind != "names":
                _check_range(key, value, v, meta)
            _check_choice(key, value, v, meta.get("choices"))
        if len(set(values)) < len(values):  # each is a point, a step or a name to measure once
            raise ConfigError(f"{key}={value!r}: an item is given twice")
        return tuple(values)
    if typ in (int, float) and meta.get("auto") is not None and isinstance(value, str):
        if value != "auto":
            raise ConfigError(f"{key}={value!r}: expected {_TYPE_WORDS[typ]} or auto")
        return meta["auto"]
    if typ is str and kind == "path" and isinstance(value, os.PathLike):
        value = os.fspath(value)
    value = _typed(key, value, typ)
    if typ is str:  # a dtype, a mesh, a choice: what parsing the key checks
        return parse_value(f, typ, value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value!r}: expected a finite number")
    if typ in (int, float):
        _check_range(key, value, value, meta)
    return value


def check_keys(fields: dict, keys: dict) -> dict:
    """Library code's keyword arguments (`model=` for `preset=`) → {field: value as kept}, each
    checked by `check_value` against `fields` (name → (field, type)); every unknown key and bad
    value is a line of one ConfigError, named as given (model=, not preset=)."""
    out, errors = {}, []
    for given, value in keys.items():
        key = ALIASES.get(given, given)
        if key not in fields:
            errors.append(str(unknown_key(key)))
            continue
        try:
            out[key] = check_value(*fields[key], value)
        except ConfigError as e:
            line = str(e)
            if given != key and line.startswith(f"{key}="):
                line = given + line[len(key) :]
            errors.append(line)
    if errors:
        raise ConfigError("\n".join(errors))
    return out


def fields_of(cls) -> dict[str, tuple[dataclasses.Field, type]]:
    """name → (field, resolved type) of a flat options dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls)}


def _pairs(argv: list[str], known: typing.Collection[str], aliases: dict) -> list[tuple]:
    """`["a=1", "b=x"]` → [("a", "1"), ("b", "x")]; unknown and repeated keys refused."""
    pairs = []
    for arg in argv:
        if "=" not in arg:
            raise ConfigError(f"{arg!r}: arguments are key=value (see --help)")
        key, raw = arg.split("=", 1)
        typed = key.strip()
        key = aliases.get(typed, typed)
        if key not in known:
            hint = did_you_mean(key, [*known, *aliases]) or " (see --help)"
            raise ConfigError(f"unknown key {key!r}{hint}")
        if any(k == key for k, _ in pairs):  # named as typed (model=, not the field preset)
            raise ConfigError(f"{typed} is given more than once")
        pairs.append((key, raw.strip()))
    return pairs


def parse_options(cls, argv: list[str]):
    """`key=value` arguments → an instance of the options dataclass `cls` (its KEY_ALIASES, if
    any: older names of keys, still read)."""
    fields = fields_of(cls)
    aliases = getattr(cls, "KEY_ALIASES", {})
    typed = {aliases.get(t, t): t for t in (a.split("=", 1)[0].strip() for a in argv)}
    kw = {}
    for k, raw in _pairs(argv, fields, aliases):
        try:
            kw[k] = parse_value(*fields[k], raw)
        except ConfigError as e:  # named as typed (results=, not out_dir=)
            line = str(e)
            if typed.get(k, k) != k and line.startswith(f"{k}="):
                raise ConfigError(typed[k] + line[len(k) :]) from None
            raise
    return _given(cls(**kw), kw, {k: t for k, t in typed.items() if t != k})


# ------------------------------------------------------------------------ the run config


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of the decoder-only transformer (lab/model.py)."""

    vocab_size: int = field(256, "vocabulary size (256 = bytes, for data=text)", min=2)
    d_model: int = field(64, "width of the residual stream", min=1)
    n_layers: int = field(2, "number of transformer blocks", min=1)
    n_heads: int = field(4, "query heads per attention layer", min=1)
    n_kv_heads: int = field(2, "key/value heads (grouped-query); must divide n_heads", min=1)
    d_ff: int = field(192, "hidden width of the SwiGLU MLP", min=1)
    tie_embeddings: bool = field(True, "reuse the token embedding as the output head")
    rope_theta: float = field(10000.0, "rotary embedding base", min=1.0)
    param_dtype: str = field("float32", "dtype the parameters are stored in", kind="dtype")
    dtype: str = field(
        "auto", "compute dtype; auto = bfloat16 on GPU/TPU, float32 on CPU", kind="dtype"
    )
    attention: str = field(
        "auto",
        "attention implementation (lab.kernels.attention); ring passes keys/values around "
        "the sequence axis (needs strategy=cp)",
        choices=("auto", *ATTENTION_IMPLS),
    )
    remat: str = field(
        "none",
        "rematerialise each block: none | full | dots (save matmuls) | offload (as full, each "
        "block's input kept in host memory: GPU/TPU)",
        choices=REMATS,
    )
    scan_layers: bool = field(
        False, "stack the blocks with nn.scan (one compiled body); pipelines need it"
    )
    microbatches: int = field(
        0,
        "M: the pipeline's microbatches, passed stage to stage over the mesh's stage axis "
        "(strategy=pp*); bubble (P-1)/(R·M+P-1) for P stages; 0 = one per stage",
        min=0,
    )
    pipeline_repeats: int = field(
        1,
        "R: 1 = GPipe; R > 1 = circular, each stage holds R chunks of layers and a microbatch "
        "goes round the stages R times (needs microbatches >= stages)",
        min=1,
    )

    window: int = field(
        0,
        "sliding-window attention: a local layer's token sees itself and the window-1 tokens "
        "before it (Mistral 4096, Gemma 2 4096); 0 = every layer sees its whole past",
        min=0,
        max=2**31,  # the kernels count its window - 1 keys in int32
    )
    window_pattern: str = field(
        "",
        "which layers are local (windowed) and which global: a comma-separated cycle of "
        "local|global repeated over the layers from the first, e.g. local,global (Gemma 2: "
        "layer 0 local, 1 global, 2 local, ...) or local,local,local,global; empty = every "
        "layer local; needs window > 0",
    )
    softcap: float = field(
        0.0,
        "attention logit soft-cap: scaled scores s -> softcap·tanh(s/softcap) before the "
        "softmax (Gemma 2: 50); 0 = off",
        min=0.0,
    )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def pattern(self) -> tuple[str, ...]:
        """window_pattern's cycle as a tuple of words (("local",) when empty)."""
        words = (
            tuple(w.strip() for w in self.window_pattern.split(",")) if self.window_pattern else ()
        )
        return words or ("local",)

    def layer_window(self, i: int) -> int | None:
        """Layer i's window (tokens it sees, itself included), None for a global layer."""
        if not self.window or self.pattern[i % len(self.pattern)] != "local":
            return None
        return self.window

    @property
    def layer_windows(self) -> tuple:
        return tuple(self.layer_window(i) for i in range(self.n_layers))


PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192),
    "small": dict(vocab_size=256, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=768),
    "base": dict(
        vocab_size=32768,
        d_model=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=12,
        d_ff=2048,
        tie_embeddings=False,
    ),
    "1b": dict(
        vocab_size=32768,
        d_model=2048,
        n_layers=18,
        n_heads=16,
        n_kv_heads=8,
        d_ff=5632,
        tie_embeddings=False,
    ),
    # Llama-2 shapes (Touvron et al. 2023, table 1 and the released configs), for plans of
    # hardware that is not here (target=...): training and serving memory, compiled, not run.
    "llama2-7b": dict(
        vocab_size=32000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        d_ff=11008,
        tie_embeddings=False,
        scan_layers=True,
    ),
    "llama2-70b": dict(
        vocab_size=32000,
        d_model=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        d_ff=28672,
        tie_embeddings=False,
        scan_layers=True,
    ),
}
# The parameter count its paper states, for a preset that reproduces a published model
# (Llama-2: Touvron et al. 2023, table 1). No ModelConfig field, so not in the preset itself
# (a preset is ModelConfig's keyword arguments), but what a claim about the published model is
# sized by; lab.measure.memory.lab_param_count, the lab's own build of the shape, is within 0.1%.
STATED_PARAMS: dict[str, float] = {"llama2-7b": 6.74e9, "llama2-70b": 68.98e9}


@dataclasses.dataclass(frozen=True)
class Config:
    """One run of `python -m lab.run`: the model plus how to train and measure it."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    preset: str = field(
        "tiny", "model preset (model=NAME); model fields override it", choices=tuple(PRESETS)
    )
    mesh: str = field(
        "1",
        "device mesh: 4x2 (data x model), 2x2x2 (data x fsdp x model), "
        "data:2,fsdp:2,model:2, data:2,stage:4 (pipeline stages); -1 fills the rest "
        "(a target= of several devices: -1 where none is given)",
        kind="mesh",
    )
    strategy: str = field(
        "auto",
        "sharding rules: dp | fsdp | tp | fsdp+tp | cp (sequence over model) | pp | pp+fsdp | "
        "pp+tp (layers over stage; scan_layers on); auto from the mesh",
        choices=("auto", *STRATEGIES),
    )
    cpu_devices: int = field(
        0,
        "simulated CPU devices; 0 = as many as the mesh needs (an axis of -1 fills 8, or the "
        "largest multiple of the other axes' product up to 8)",
        min=0,
    )
    batch_size: int = field(
        16,
        "global batch (sequences per step; at most 2^20: past it the compilers' launch grids "
        "overflow)",
        min=1,
        max=2**20,
    )
    accumulate: int = field(
        1,
        "K: gradient accumulation, the batch run as K microbatches of batch_size/K whose "
        "gradients are summed before one update (activation peak / K)",
        min=1,
    )
    offload_optimizer: bool = field(
        False, "keep the AdamW state in host memory (pinned_host), moved in for the update"
    )
    seq_len: int = field(
        128,
        "tokens per sequence (at most 2^20: attention's block map holds (seq_len/128)² tiles)",
        min=2,
        max=2**20,
    )
    steps: int = field(150, "training steps (the step counter is int32)", min=0, max=2**31 - 1)
    lr: float = field(3e-3, "peak learning rate (AdamW)", min=0.0)
    warmup_steps: int = field(20, "linear warm-up steps before the cosine decay", min=0)
    min_lr_ratio: float = field(0.1, "final learning rate as a fraction of lr", min=0.0, max=1.0)
    weight_decay: float = field(0.1, "AdamW decoupled weight decay", min=0.0)
    grad_clip: float = field(1.0, "clip gradients to this global norm; 0 = off", min=0.0)
    loss_scale: float = field(
        0.0,
        "static loss scale for float16; auto (or 0) = 2^15 for fp16, else 1",
        min=0.0,
        auto=0.0,
    )
    data: str = field(
        "auto",
        "synthetic | text (bundled corpus, bytes); auto = text if vocab is 256",
        choices=("auto", "synthetic", "text"),
    )
    pack: bool = field(
        False,
        "data=text: each row runs on through the corpus's documents (its titled sections) from a "
        "random byte, so its first and last are cut; attention stays within a document and "
        "positions restart at each (segment ids); no padding, so every target counts in the loss",
    )
    seed: int = field(
        0,
        "seed for parameters and data: same seed, same run (at most 2^32-1: JAX's keys take "
        "32 bits)",
        min=0,
        max=2**32 - 1,
    )
    name: str = field("", "run name: one folder name under out_dir; empty = model-mesh-time")
    out_dir: str = field("runs", "where run folders are written", kind="path")
    log_every: int = field(10, "steps between metric records", min=1)
    checkpoint_every: int = field(
        0, "steps between checkpoints, and one at the last step; 0 = no checkpoints", min=0
    )
    resume: bool = field(
        False,
        "continue run name=NAME from its newest good checkpoint, with the keys it was started "
        "with (those given now over them)",
    )
    overwrite: bool = field(
        False,
        "clear an earlier run from the folder name=NAME before this one writes there (once this "
        "run's step has compiled and fits); without it a fresh run refuses a used folder",
    )
    compile_only: bool = field(False, "compile the step, print memory and cost, do not train")
    explain: bool = field(
        False, "print per-device memory and the compiled step's collectives vs analytic"
    )
    target: str = field(
        "",
        "compile ahead of time for hardware that is not here (implies compile_only): "
        "tpu:GEN:TOPOLOGY (libtpu), e.g. tpu:v5e:2x4, or gpu:KIND[:N], e.g. gpu:h100:8",
    )
    profile: bool = field(
        False,
        "capture a jax.profiler trace of 4 steps after the warm-up (steps 4-7 of a fresh run) "
        "into the run folder's profile/; their times are left out of the step-time figures",
    )
    coordinator: str = field("", "jax.distributed coordinator host:port (multi-host)")
    coordinator_timeout: int = field(
        60, "seconds to wait for the coordinator and every process to join", min=1
    )
    num_processes: int = field(1, "jax.distributed process count", min=1)
    process_id: int = field(0, "jax.distributed id of this process", min=0)


RUN_FIELDS = {k: v for k, v in fields_of(Config).items() if k != "model"}

WARMUP_STEPS = 2  # a run's first steps, out of the step-time median (allocation, first transfers)
PROFILE_STEPS = 4  # the steps profile=true traces


def profile_window(start: int) -> tuple[int, int]:
    """The first and last step profile=true traces in a run that starts after step `start`
    (0 fresh, else the checkpoint step it resumed from): PROFILE_STEPS steps, two after the
    warm-up (steps 4-7 of a fresh run), so that the trace shows steady steps."""
    first = start + WARMUP_STEPS + 2
    return first, first + PROFILE_STEPS - 1


MODEL_FIELDS = fields_of(ModelConfig)
KEYS = {**RUN_FIELDS, **MODEL_FIELDS}  # every key of a run: name → (field, type)
ALIASES = {"model": "preset"}


def resolve_dtype(model: ModelConfig, platform: str) -> ModelConfig:
    """`dtype=auto` → float32 on CPU (no fast bf16 units), bfloat16 on GPU and TPU."""
    if model.dtype != "auto":
        return model
    return dataclasses.replace(model, dtype="float32" if platform == "cpu" else "bfloat16")


# What a run does when the user names nothing, per backend: a CPU run should finish in about
# a minute and show learning; an accelerator run should be big enough to measure.
BACKEND_DEFAULTS: dict[str, dict] = {
    "cpu": {},
    "gpu": {"preset": "base", "batch_size": 32, "seq_len": 1024, "steps": 100},
    "tpu": {"preset": "base", "batch_size": 32, "seq_len": 1024, "steps": 100},
}
# The keys some backend's defaults set: a run's config.json keeps the values it ran with under
# its request, so a resume on another backend goes on with the same model, batch and length.
BACKEND_KEYS = tuple(sorted({k for over in BACKEND_DEFAULTS.values() for k in over}))


def make_config(*, backend: str = "cpu", **fields) -> Config:
    """A Config from typed keyword arguments: any run or model field, or `preset` (alias
    `model`), each checked alone as `check_value` says (its type, range, choices; a ConfigError
    names the key); keys left out take the backend's defaults, then the dataclasses'. Only
    gpu and tpu have defaults of their own (BACKEND_DEFAULTS); any other backend JAX reports
    (cpu, or a plugin's) starts from the CPU's small run. The rules that tie fields together are
    checked once the platform is known (lab/resolve.py)."""
    kw = {**BACKEND_DEFAULTS.get(backend, {}), **check_keys(KEYS, fields)}
    preset = kw.pop("preset", RUN_FIELDS["preset"][0].default)
    return override(Config(model=ModelConfig(**PRESETS[preset])), preset=preset, **kw)


# model fields that say how the model runs (the kernel, the compute dtype, what is
# recomputed or stacked), not which model it is
HOW_IT_RUNS = ("dtype", "attention", "remat", "scan_layers", "microbatches", "pipeline_repeats")


def model_changes(cfg: Config) -> dict:
    """The model fields of `cfg` that make it another model than its preset ({"d_model": 32}):
    what a record names so that a changed model is not read as the preset. How it runs
    (HOW_IT_RUNS, resolved per backend) is left to the records' own keys."""
    base = ModelConfig(**PRESETS[cfg.preset]) if cfg.preset in PRESETS else ModelConfig()
    return {
        f.name: getattr(cfg.model, f.name)
        for f in dataclasses.fields(ModelConfig)
        if f.name not in HOW_IT_RUNS and getattr(cfg.model, f.name) != getattr(base, f.name)
    }


def override(cfg: Config, **fields) -> Config:
    """`cfg` with run or model fields replaced (typed values, checked as `make_config`'s are);
    `preset=` starts the model from that preset before the other model fields apply."""
    fields = check_keys(KEYS, fields)
    run_kw = {k: v for k, v in fields.items() if k in RUN_FIELDS}
    model_kw = {k: v for k, v in fields.items() if k in MODEL_FIELDS}
    model = cfg.model
    if "preset" in run_kw:
        model = ModelConfig(**PRESETS[run_kw["preset"]])
    model = dataclasses.replace(model, **model_kw)
    cfg = dataclasses.replace(cfg, model=model, **run_kw)
    _check_alone(cfg)
    return cfg


def unknown_key(key: str) -> ConfigError:
    hint = did_you_mean(key, [*RUN_FIELDS, *MODEL_FIELDS, *ALIASES])
    return ConfigError(f"unknown key {key!r}{hint}")


def _parse_key(known: dict, key: str, raw: str):
    """One run key's value; its error names the key as the user writes it (model=, not the
    field it fills, preset=)."""
    try:
        return parse_value(*known[key], raw)
    except ConfigError as e:
        shown = next((a for a, k in ALIASES.items() if k == key), None)
        if shown and str(e).startswith(f"{key}="):
            raise ConfigError(shown + str(e)[len(key) :]) from None
        raise


def parse_keys(argv: list[str]) -> dict:
    """`["model=small", "steps=20"]` → {"preset": "small", "steps": 20}: the keys the user
    gave, typed and checked one by one; every bad value is a line of one ConfigError."""
    known = KEYS
    keys, errors = {}, []
    for k, raw in _pairs(argv, known, ALIASES):
        try:
            keys[k] = _parse_key(known, k, raw)
        except ConfigError as e:
            errors.append(str(e))
    if errors:
        raise ConfigError("\n".join(errors))
    return keys


def parse_args(argv: list[str], *, backend: str = "cpu") -> Config:
    """`["model=small", "mesh=4x2", "steps=20"]` → Config; raises ConfigError (one line).

    Keys the user leaves out take the backend's defaults (BACKEND_DEFAULTS), then the
    dataclass defaults.
    """
    return make_config(backend=backend, **parse_keys(argv))


NAME_MAX = 255  # bytes in one folder name on Linux and macOS file systems


def check_name(name: str) -> None:
    """A run name is one folder name under out_dir: never a path that leaves it, no control
    character (a newline splits every line that names the folder), and short enough for a
    file system to create."""
    if name and (PurePath(name).name != name or name in (".", "..") or "\0" in name):
        raise ConfigError(
            f"name={name!r}: a run name is one folder name (no '/' or '..'); "
            "choose the location with out_dir="
        )
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ConfigError(f"name={name!r}: a run name has no control characters (newline, tab)")
    if len(name.encode(errors="surrogateescape")) > NAME_MAX:
        raise ConfigError(
            f"name={name[:20]}…: {len(name.encode(errors='surrogateescape'))} bytes, longer "
            f"than the {NAME_MAX} a folder name may have"
        )


def stamped_name(prefix: str, mesh: str) -> str:
    """A default run name, `PREFIX-MESH-YYYYmmdd-HHMMSS`, with the mesh in folder-safe
    characters (`data:2,fsdp:-1` → `data2_fsdp-1`): a ':' in a folder name breaks scp and
    rsync (host:path), TensorBoard's name:folder lists and Windows file systems."""
    slug = re.sub(r"[^A-Za-z0-9.+-]+", "_", mesh.replace(":", "")).strip("_") or "mesh"
    return f"{prefix}-{slug}-{time.strftime('%Y%m%d-%H%M%S')}"


def _check_alone(cfg: Config) -> None:
    """The checks of single fields that their type cannot express (every rule that ties
    fields together is lab/resolve.py's, checked once the platform is known)."""
    if cfg.coordinator:
        check_coordinator(cfg.coordinator)
    if cfg.target and cfg.target.split(":")[0] not in ("tpu", "gpu"):
        raise ConfigError(
            f"target={cfg.target!r}: expected tpu:GEN:TOPOLOGY or gpu:KIND[:N] (see --help)"
        )
    check_name(cfg.name)


def check_coordinator(address: str, key: str = "coordinator") -> None:
    """host:port with a port in 1..65535 (an IPv6 host in brackets): checked before any
    process starts, so a typo is one line here and never a join that times out. `key` names
    where the address came from (coordinator=, or JAX_COORDINATOR_ADDRESS under SLURM)."""
    host, colon, port = address.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    bare = host[1:-1] if bracketed else host
    if not colon or not bare or any(c in bare for c in " /[]") or (":" in bare and not bracketed):
        raise ConfigError(
            f"{key}={address!r}: expected host:port (e.g. localhost:1234 or [::1]:1234)"
        )
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{key}={address!r}: the port must be a number in 1..65535")


KEY_WIDTH, DEFAULT_WIDTH = 18, 12  # the --help columns: key, default, then the meaning
HELP_WIDTH = 100  # the meaning wraps at this column


def default_text(value) -> str:
    """A default as a user types it: true/false, 1.0, 64,128; "" for an empty one (a blank
    would read as a missing column)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        value = ",".join(map(str, value))
    return str(value) if str(value) else '""'


def _key_lines(fields: dict, rename: dict | None = None, width: int = 0) -> list[str]:
    """A line per key: its name, its default and its meaning in aligned columns. The name
    column widens to the table's widest name (up to a few characters past KEY_WIDTH); a name
    or a default wider still puts the meaning on the next line, at its column."""
    lines = []
    names = {f.name: (rename or {}).get(f.name, f.name) for f, _ in fields.values()}
    width = max(width, KEY_WIDTH, *(len(k) for k in names.values() if len(k) <= KEY_WIDTH + 4))
    indent = " " * (2 + width + 1 + DEFAULT_WIDTH + 1)
    for f, _ in fields.values():
        key = names[f.name]
        default = default_text(f.default)
        if f.metadata.get("auto") is not None and f.default == f.metadata["auto"]:
            default = "auto"
        # the meaning wrapped in its column: a line of 400 characters is unreadable in a
        # terminal that folds it under the keys
        meaning = textwrap.wrap(
            f.metadata["help"],
            max(40, HELP_WIDTH - len(indent)),
            break_on_hyphens=False,  # comma-separated, warm-up: never split at their hyphen
            break_long_words=False,  # a path or data:2,model:4 stays whole
        ) or [""]
        if len(key) > width or len(default) > DEFAULT_WIDTH:
            lines.append(f"  {key:<{width}} {default}")
        else:
            lines.append(f"  {key:<{width}} {default:<{DEFAULT_WIDTH}} {meaning.pop(0)}")
        lines += [indent + m for m in meaning]
    return lines


def help_text() -> str:
    """Every key of `python -m lab.run` with its default and meaning."""
    lines = ["usage: python -m lab.run [key=value ...]", "", "run keys:"]
    width = max(len(k) for k in [*RUN_FIELDS, *MODEL_FIELDS] if len(k) <= KEY_WIDTH + 4)
    lines += _key_lines(RUN_FIELDS, {"preset": "model"}, width)
    lines += ["", "model keys (override the preset):", *_key_lines(MODEL_FIELDS, width=width)]
    lines += ["", "presets: " + ", ".join(PRESETS)]
    for backend, over in BACKEND_DEFAULTS.items():
        if over:
            keys = " ".join(f"{'model' if k == 'preset' else k}={v}" for k, v in over.items())
            lines.append(f"defaults on {backend}: {keys}")
    return "\n".join(lines)


# ------------------------------------------------------------------------ commands


def options_help(cls, prog: str, doc: str, *, run_keys: bool = False) -> str:
    """`--help` of a command: its doc, then every key with its default and meaning."""
    head = f"usage: {prog} [key=value ...]"
    lines = [head, "", doc.strip(), "", "keys:", *_key_lines(fields_of(cls))]
    if aliases := getattr(cls, "KEY_ALIASES", {}):
        said = ", ".join(f"{a}= for {k}=" for a, k in aliases.items())
        lines += ["", f"also read: {said}"]
    if run_keys:
        more = "and lab.run's keys (python -m lab.run --help)"
        if "refused" in doc:  # a command that takes some of them only: its doc says which
            more += ", as the text above says"
        lines += ["", more]
    return "\n".join(lines)


def parse_with_run_keys(cls, argv: list[str]) -> tuple:
    """(options, run keys) from one argument list: the command's own keys to `cls`, the rest
    typed as lab.run's (`make_config(**keys)` builds the Config, under the backend's
    defaults where the command knows it); a key neither knows gets the close match."""
    own = fields_of(cls)
    known = {**RUN_FIELDS, **MODEL_FIELDS}
    pairs = _pairs(argv, [*own, *known], ALIASES)
    opts = cls(**{k: parse_value(*own[k], raw) for k, raw in pairs if k in own})
    keys = {k: _parse_key(known, k, raw) for k, raw in pairs if k not in own}
    return _given(opts, [k for k, _ in pairs if k in own]), keys


def _given(opts, names, aliased=None):
    """`opts` knowing which of its keys were typed (`given_options`), a value equal to its
    default included: a key the chosen mode would not read is refused even then; and the
    older name a key was typed under (`typed_as`), for the refusal to name."""
    object.__setattr__(opts, "_lab_given", frozenset(names))
    object.__setattr__(opts, "_lab_typed_as", dict(aliased or {}))
    return opts


def given_options(opts) -> frozenset | None:
    """The option names typed on the command line (None for options made in code)."""
    return getattr(opts, "_lab_given", None)


def typed_as(opts, key: str) -> str:
    """The name `key` was typed under: an older name (the options' KEY_ALIASES) where the
    user typed that one, else `key`."""
    return getattr(opts, "_lab_typed_as", {}).get(key, key)


# Environment variables JAX reads as a number when a backend starts, and the range it can use:
# a bad value makes JAX print its traceback and drop the GPU backend (a GPU plan then blames the
# CUDA plugin), where the lab would go on with a default of its own under the variable's name.
ENV_RANGES = {
    # the share of each GPU's memory JAX's allocator takes (JAX's default 0.75)
    "XLA_PYTHON_CLIENT_MEM_FRACTION": (0.0, 1.0),
    "XLA_CLIENT_MEM_FRACTION": (0.0, 1.0),  # its newer name
}


def check_environment(environ=None) -> None:
    """ConfigError (one line, before JAX starts a backend) for an environment variable of
    ENV_RANGES that is set but not a number in its range, (low, high], and for the allocator
    share set under both its names."""
    import os

    environ = os.environ if environ is None else environ
    for name, (low, high) in ENV_RANGES.items():
        raw = environ.get(name)
        if raw is None:
            continue
        try:
            ok = low < float(raw) <= high
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(
                f"{name}={raw!r}: expected a number greater than {low:g} and at most {high:g}"
                " (the share of each GPU's memory JAX's allocator takes); unset it for JAX's"
                " default, 0.75"
            )
    if environ.get("XLA_CLIENT_MEM_FRACTION") and environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"):
        raise ConfigError(  # JAX's GPU backend raises a ValueError at start on both
            "XLA_CLIENT_MEM_FRACTION and XLA_PYTHON_CLIENT_MEM_FRACTION are both set, which "
            "JAX refuses: unset the second, the older name"
        )


def cli(
    cls, run, *, prog: str, doc: str, argv=None, run_keys: bool = False, guarded: bool = False
) -> int:
    """The shared main of every command: help, parse `cls` (and lab.run's keys with
    `run_keys`), call `run(options)` or `run(options, run_keys)`; a user mistake is one
    line on stderr and exit 2, a run that cannot go on exit 1, Ctrl-C exit 130. `guarded`:
    a signal stays one line and an exit (startup.guard_imports) until `run` handles signals
    itself (the launcher: JAX's start-up, which its checks run, swallows a KeyboardInterrupt)."""
    if not guarded:
        startup.imports_done()  # the command's own handling of Ctrl-C and SIGTERM starts here
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help", "help") for a in argv):
        print(options_help(cls, prog, doc, run_keys=run_keys))
        return 0

    def checked() -> int:
        check_environment()
        if run_keys:
            return run(*parse_with_run_keys(cls, argv))
        return run(parse_options(cls, argv))

    return exit_code(checked)


def exit_code(fn) -> int:
    """`fn()`'s exit code (None is 0), with the errors a user sees as one line on stderr: a
    mistake (ConfigError) exits 2, a run that cannot go on (RunError) 1, Ctrl-C 130, SIGTERM
    raised as Terminated 143. Once the outermost call has its code, a signal until the
    process exits keeps that code (startup.finished)."""
    global _depth
    _depth += 1
    code = None
    try:
        code = _exit_code(fn)
        return code
    finally:
        _depth -= 1
        if not _depth and code is not None:
            startup.finished(code)


_depth = 0  # exit_code calls under way in this process: the outermost is the command's


def _exit_code(fn) -> int:
    try:
        return fn() or 0
    except ConfigError as e:  # a request that breaks several rules: a line for each
        for line in str(e).splitlines() or [""]:
            print(f"error: {line}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        by = "SIGTERM" if isinstance(e, Terminated) else "interrupted (Ctrl-C)"
        # a command that knows where its saved work is says so in the interrupt's message
        detail = str(e) or "nothing was written after the last saved file"
        print(f"{by}: {detail}", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130

"""Configuration: two frozen dataclasses, presets, and `key=value` parsing with clear errors.

Every field carries its meaning in `help` (shown by `python -m lab.run --help`), so the
dataclass is the single source of truth for defaults, types, ranges and documentation.
Keys are flat on the command line: a key names either a run field or a model field.
"""

import dataclasses
import difflib

from lab.mesh import MeshSpecError, parse_mesh_spec

DTYPES = {
    "float32": "float32",
    "f32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "f16": "float16",
    "fp16": "float16",
}
ATTENTION_IMPLS = (
    "auto",
    "naive",
    "blockwise",
    "pallas",
    "pallas_tpu",
    "pallas_gpu",
    "xla",
    "cudnn",
    "ring",
)
STRATEGIES = ("auto", "dp", "fsdp", "tp", "fsdp+tp", "cp")


class ConfigError(ValueError):
    """A bad key or value: one line for the user, exit code 2."""


def _f(default, help: str, *, choices=None, min=None, kind=None):
    meta = {"help": help, "choices": choices, "min": min, "kind": kind}
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of the decoder-only transformer (lab/model.py)."""

    vocab_size: int = _f(256, "vocabulary size (256 = bytes, for data=text)", min=2)
    d_model: int = _f(64, "width of the residual stream", min=1)
    n_layers: int = _f(2, "number of transformer blocks", min=1)
    n_heads: int = _f(4, "query heads per attention layer", min=1)
    n_kv_heads: int = _f(2, "key/value heads (grouped-query); must divide n_heads", min=1)
    d_ff: int = _f(192, "hidden width of the SwiGLU MLP", min=1)
    tie_embeddings: bool = _f(True, "reuse the token embedding as the output head")
    rope_theta: float = _f(10000.0, "rotary embedding base", min=1.0)
    param_dtype: str = _f("float32", "dtype the parameters are stored in", kind="dtype")
    dtype: str = _f(
        "auto", "compute dtype; auto = bfloat16 on GPU/TPU, float32 on CPU", kind="dtype"
    )
    attention: str = _f(
        "auto",
        "attention implementation (lab.kernels.attention); ring = lab.parallel.ring_attention "
        "over the sequence axis (needs strategy=cp)",
        choices=ATTENTION_IMPLS,
    )
    remat: str = _f(
        "none",
        "rematerialise each block: none | full | dots (save matmuls)",
        choices=("none", "full", "dots"),
    )
    scan_layers: bool = _f(False, "stack the blocks with nn.scan (one compiled body)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


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
}


@dataclasses.dataclass(frozen=True)
class Config:
    """One run of `python -m lab.run`: the model plus how to train and measure it."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    preset: str = _f(
        "tiny", "model preset (model=NAME); model fields override it", choices=tuple(PRESETS)
    )
    mesh: str = _f(
        "1",
        "device mesh: 4x2 (data x model), 2x2x2 (data x fsdp x model), "
        "data:2,fsdp:2,model:2; -1 fills the rest",
        kind="mesh",
    )
    strategy: str = _f(
        "auto",
        "sharding rules: dp | fsdp | tp | fsdp+tp | cp (sequence over model); auto from the mesh",
        choices=STRATEGIES,
    )
    cpu_devices: int = _f(0, "simulated CPU devices; 0 = as many as the mesh needs", min=0)
    batch_size: int = _f(16, "global batch (sequences per step)", min=1)
    seq_len: int = _f(128, "tokens per sequence", min=2)
    steps: int = _f(150, "training steps", min=0)
    lr: float = _f(3e-3, "peak learning rate (AdamW)", min=0.0)
    warmup_steps: int = _f(20, "linear warm-up steps before the cosine decay", min=0)
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of lr", min=0.0)
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay", min=0.0)
    grad_clip: float = _f(1.0, "clip gradients to this global norm; 0 = off", min=0.0)
    loss_scale: float = _f(
        0.0, "static loss scale for float16; 0 = auto (2^15 for fp16, else 1)", min=0.0
    )
    data: str = _f(
        "auto",
        "synthetic | text (bundled corpus, bytes); auto = text if vocab is 256",
        choices=("auto", "synthetic", "text"),
    )
    seed: int = _f(0, "seed for parameters and data: same seed, same run", min=0)
    name: str = _f("", "run name (folder under out_dir); empty = model-mesh-time")
    out_dir: str = _f("runs", "where run folders are written")
    log_every: int = _f(10, "steps between metric records", min=1)
    checkpoint_every: int = _f(0, "steps between checkpoints; 0 = no checkpoints", min=0)
    resume: bool = _f(False, "continue from the latest complete checkpoint of this run name")
    compile_only: bool = _f(False, "compile the step, print memory and cost, do not train")
    explain: bool = _f(
        False, "print per-device memory and the compiled step's collectives vs analytic"
    )
    target: str = _f(
        "",
        "compile ahead of time for a TPU slice, e.g. tpu:v5e:2x4 (needs "
        "libtpu; implies compile_only)",
    )
    profile: bool = _f(False, "capture a jax.profiler trace of a few steps into the run folder")
    coordinator: str = _f("", "jax.distributed coordinator host:port (multi-host)")
    num_processes: int = _f(1, "jax.distributed process count", min=1)
    process_id: int = _f(0, "jax.distributed id of this process", min=0)


RUN_FIELDS = {f.name: f for f in dataclasses.fields(Config) if f.name != "model"}
MODEL_FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig)}
ALIASES = {"model": "preset"}


def _parse_bool(key: str, raw: str) -> bool:
    low = raw.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{key}={raw!r}: expected a boolean (true/false)")


def _parse_value(field: dataclasses.Field, raw: str):
    key, meta = field.name, field.metadata
    typ = field.type
    if meta.get("kind") == "dtype":
        if raw.lower() not in DTYPES and raw != "auto":
            raise ConfigError(
                f"{key}={raw!r}: expected one of float32, bfloat16, float16"
                + (", auto" if field.default == "auto" else "")
            )
        return DTYPES.get(raw.lower(), raw)
    if meta.get("kind") == "mesh":
        try:
            parse_mesh_spec(raw)
        except MeshSpecError as e:
            raise ConfigError(f"mesh={raw!r}: {e}") from None
        return raw
    if typ in (bool, "bool"):
        return _parse_bool(key, raw)
    if typ in (int, "int", float, "float"):
        cast = int if typ in (int, "int") else float
        try:
            value = cast(raw)
        except ValueError:
            raise ConfigError(
                f"{key}={raw!r}: expected {'an integer' if cast is int else 'a number'}"
            ) from None
        if meta.get("min") is not None and value < meta["min"]:
            raise ConfigError(f"{key}={raw!r}: must be >= {meta['min']}")
        return value
    if meta.get("choices") and raw not in meta["choices"]:
        raise ConfigError(f"{key}={raw!r}: expected one of {' | '.join(meta['choices'])}")
    return raw


def _split(arg: str) -> tuple[str, str]:
    if "=" not in arg:
        raise ConfigError(f"{arg!r}: arguments are key=value (see --help)")
    key, raw = arg.split("=", 1)
    key = ALIASES.get(key.strip(), key.strip())
    if key not in RUN_FIELDS and key not in MODEL_FIELDS:
        known = [*RUN_FIELDS, *MODEL_FIELDS, *ALIASES]
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else " (see --help)"
        raise ConfigError(f"unknown key {key!r}{hint}")
    return key, raw.strip()


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


def parse_args(argv: list[str], *, backend: str = "cpu") -> Config:
    """`["model=small", "mesh=4x2", "steps=20"]` → Config; raises ConfigError (one line).

    Keys the user leaves out take the backend's defaults (BACKEND_DEFAULTS), then the
    dataclass defaults.
    """
    pairs = [_split(a) for a in argv]
    for key, _ in pairs:
        if sum(k == key for k, _ in pairs) > 1:
            raise ConfigError(f"{key} is given more than once")
    run_kw = dict(BACKEND_DEFAULTS.get(backend, {}))
    model_kw = {}
    for key, raw in pairs:
        if key in RUN_FIELDS:
            run_kw[key] = _parse_value(RUN_FIELDS[key], raw)
        else:
            model_kw[key] = _parse_value(MODEL_FIELDS[key], raw)
    preset = run_kw.get("preset", RUN_FIELDS["preset"].default)
    model = ModelConfig(**{**PRESETS[preset], **model_kw})
    cfg = Config(model=model, **run_kw)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Cross-field checks that a single value's type cannot express."""
    m = cfg.model
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"n_kv_heads={m.n_kv_heads} must divide n_heads={m.n_heads}")
    if m.d_model % m.n_heads:
        raise ConfigError(f"n_heads={m.n_heads} must divide d_model={m.d_model}")
    if m.head_dim % 2:
        raise ConfigError(
            f"head_dim=d_model/n_heads={m.head_dim} must be even for rotary embeddings"
        )
    if cfg.data == "text" and m.vocab_size < 256:
        raise ConfigError(f"data=text needs vocab_size >= 256 (bytes), got {m.vocab_size}")
    if m.attention == "ring" and cfg.strategy != "cp":
        raise ConfigError(
            "attention=ring passes keys/values around the sequence axis: add strategy=cp "
            "(the sequence split over the mesh's model axis, e.g. mesh=2x4)"
        )
    if cfg.process_id >= cfg.num_processes:
        raise ConfigError(
            f"process_id={cfg.process_id} must be < num_processes={cfg.num_processes}"
        )
    if cfg.target:
        from lab.aot import parse_target

        parse_target(cfg.target)
    if cfg.num_processes > 1 and not cfg.coordinator:
        raise ConfigError("num_processes > 1 needs coordinator=host:port")


def help_text() -> str:
    """Every key with its default and meaning, for `python -m lab.run --help`."""
    lines = ["usage: python -m lab.run [key=value ...]", "", "run keys:"]
    for f in RUN_FIELDS.values():
        key = "model" if f.name == "preset" else f.name
        lines.append(f"  {key:<18} {str(f.default)!r:<12} {f.metadata['help']}")
    lines += ["", "model keys (override the preset):"]
    for f in MODEL_FIELDS.values():
        lines.append(f"  {f.name:<18} {str(f.default)!r:<12} {f.metadata['help']}")
    from lab.aot import target_help

    lines += ["", "presets: " + ", ".join(PRESETS), "targets (e.g.): " + target_help()]
    for backend, over in BACKEND_DEFAULTS.items():
        if over:
            keys = " ".join(f"{'model' if k == 'preset' else k}={v}" for k, v in over.items())
            lines.append(f"defaults on {backend}: {keys}")
    return "\n".join(lines)

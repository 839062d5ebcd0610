"""The parameters lab.serve decodes with: a trained run's newest good checkpoint, or random
weights of a preset, on the decoding session's shardings.

Restoring needs a session (the trainer's abstract state and mesh), which lies above
lab.decode in the layers: so this lives with the study, not with the decoder.
"""

import dataclasses
import re
from pathlib import Path

import jax

from lab import checkpoint, decode
from lab.config import MODEL_FIELDS, Config, ModelConfig, override
from lab.errors import ConfigError
from lab.mesh import parse_mesh_spec, strategy_mesh
from lab.model import natural_layers
from lab.names import STAGE
from lab.resolve import Request, resolve
from lab.rundir import LAYOUT_FIELDS, STATE_FIELDS, saved_config
from lab.session import Session, session_for
from lab.train import restore_in_layout


def config_of_run(run_dir: Path) -> Config:
    """The Config a run folder was trained with (its config.json)."""
    saved = saved_config(run_dir, asked=f"run={run_dir.name}")
    try:
        model = ModelConfig(**saved["model"])
        rest = {k: v for k, v in saved.items() if k not in ("model", "request", "block_order")}
        return dataclasses.replace(Config(model=model), **rest)
    except (KeyError, TypeError) as e:
        raise ConfigError(
            f"run={run_dir.name}: {run_dir / 'config.json'} is damaged ({e})"
        ) from None


def _serving_mesh(saved: Config, *, target: bool = False) -> dict:
    """The mesh a trained run is served on unless mesh= is given: its tensor-parallel axis
    (the weights stay split as they were trained), none of the axes that split the batch
    (a decode of batch 1 splits over none; the trainer's data and fsdp axes would refuse
    every small batch). A plan for a `target` uses all of its devices (a slice runs one
    program over all of them), those left over by the tensor-parallel axis on `data`, so
    plan_batch= splits over them. A pipeline's run keeps its mesh."""
    if saved.strategy.startswith("pp"):
        return {}  # a pipeline's run is served on its own mesh (its microbatches need a stage)
    try:
        sizes = parse_mesh_spec(strategy_mesh(saved.mesh, saved.strategy))
    except ConfigError:
        return {}  # the run's mesh as it was: resolve says what is wrong with it
    model = sizes.get("model", 1)
    if model > 1 and saved.strategy in ("tp", "fsdp+tp"):
        return {"mesh": f"data:-1,model:{model}" if target else f"model:{model}", "strategy": "tp"}
    return {"mesh": "-1" if target else "1", "strategy": "dp"}


# the run fields a served run takes from its training (the rest train: steps, lr, batch_size,
# checkpoint_every, …, and would do nothing, or be refused as such, in a serving request)
SERVED_RUN_FIELDS = ("preset", "mesh", "strategy", "cpu_devices", "data")


def kept_request(run_dir: Path, saved: Config) -> dict:
    """The keys a run was asked with (config.json's `request`: what the user gave, not what
    this machine resolved them to, so a CPU run's attention=cpu_flash is not carried to a GPU
    plan), less those that only train, with the model's shape from its config (the weights'
    own). A folder written before config.json kept its request gives its config's fields,
    less those that default to `auto` (resolved on the machine it ran on)."""
    raw = saved_config(run_dir, asked=f"run={run_dir.name}")
    asked = raw.get("request")
    if isinstance(asked, dict):
        keys = {k: v for k, v in asked.items() if k in SERVED_RUN_FIELDS or k in MODEL_FIELDS}
    elif asked is None:
        auto = {f.name for f in dataclasses.fields(ModelConfig) if f.default == "auto"}
        keys = {k: getattr(saved, k) for k in SERVED_RUN_FIELDS}
        keys |= {k: getattr(saved.model, k) for k in MODEL_FIELDS if k not in auto}
        keys = {k: v for k, v in keys.items() if not (k in ("strategy", "data") and v == "auto")}
    else:
        raise ConfigError(
            f"run={run_dir.name}: {run_dir / 'config.json'} is damaged (its request is not a table)"
        )
    return {**keys, **{k: getattr(saved.model, k) for k in STATE_FIELDS}}


def serving_request(run_dir: Path, keys: dict) -> Request:
    """The request that serves a trained run: the keys the run was asked with (kept_request)
    with the user's keys over them (a model field that changes the weights' shapes is
    refused: those weights would not load); resolved on this platform, or for target=, like
    any request."""
    saved = config_of_run(run_dir)
    shape_keys = {k: v for k, v in keys.items() if k in STATE_FIELDS or k in ("preset", "model")}
    if shape_keys:
        changed = override(saved, **shape_keys)
        diffs = [
            f"{k}={getattr(saved.model, k)!r} → {getattr(changed.model, k)!r}"
            for k in STATE_FIELDS
            if k not in LAYOUT_FIELDS and getattr(saved.model, k) != getattr(changed.model, k)
        ]
        if diffs:
            raise ConfigError(
                f"run={run_dir.name} holds another model than asked ({', '.join(diffs)}): "
                "leave the model keys out to serve the run's own"
            )
    run_keys = {k: v for k, v in keys.items() if k not in shape_keys}
    if "mesh" not in keys:
        run_keys = {**_serving_mesh(saved, target=bool(keys.get("target"))), **run_keys}
    kept = kept_request(run_dir, saved)
    if keys.get("target"):  # a plan: the run's simulated CPU devices are not the target's
        kept.pop("cpu_devices", None)
    # serving needs neither the run's name, steps nor its checkpoint cadence
    over = {**run_keys, "name": "", "resume": False, "overwrite": False, "steps": 0}
    try:
        request = Request.of(**kept)
    except ConfigError as e:
        raise ConfigError(
            f"run={run_dir.name}: {run_dir / 'config.json'} is damaged ({e})"
        ) from None
    return request.with_keys(**over)


# model keys that change what trained weights compute without changing their shapes: served
# with other values than the run trained with, the outputs are another model's
MATH_FIELDS = ("rope_theta", "window", "window_pattern", "softcap")


def changed_from_run(run_dir: Path, keys: dict) -> list[str]:
    """The model keys the user gave that serve the run's weights as another model computes
    them ("rope_theta 10000.0 → 2.0"): allowed (an experiment may want it), said."""
    saved = config_of_run(run_dir)
    asked = {k: v for k, v in keys.items() if k in MATH_FIELDS}
    if not asked:
        return []
    changed = override(saved, **asked)
    return [
        f"{k} {getattr(saved.model, k)!r} → {getattr(changed.model, k)!r}"
        for k in MATH_FIELDS
        if getattr(saved.model, k) != getattr(changed.model, k)
    ]


def blame_run(e: ConfigError, run_dir: Path, request: Request, given: dict) -> ConfigError:
    """`e` (resolving `request`, serving_request's) with each line that names a key the run's
    config.json gave, not the user (`given`), said to be the run's: "run=NAME: … (from
    runs/NAME/config.json)", so a damaged folder is named, not the user's keys blamed."""
    from_run = [k for k in request.dict() if k not in given]
    lines, changed = str(e).splitlines(), False
    for i, line in enumerate(lines):
        if any(re.search(rf"\b{k}=", line) for k in from_run):
            lines[i] = f"run={run_dir.name}: {line} (from {run_dir / 'config.json'})"
            changed = True
    return ConfigError("\n".join(lines)) if changed else e


def for_decoding(session: Session, batches=()) -> Session:
    """The session of the decoder (lab.decode.unstack_layers says why it runs unscanned):
    the session's request resolved again for decoding on the same platform, never its
    resolved config edited (a pipeline's scan and stage axis are the trainer's); the rules
    of decoding checked there, `batches` (the batch sizes decoders will be built for)
    splitting over its mesh among them. A session already resolved for decoding those
    batches is its own."""
    r = session.resolved
    if r.purpose == "decode" and set(batches) <= set(r.batches):
        return session
    return session_for(resolve(r.request, r.platform, "decode", batches=batches))


def load_params(session: Session, run_dir: Path | None, seed: int, warn=print, *, decoding=None):
    """(decoding session, parameters, where they came from): the newest good checkpoint of
    `run_dir`, or random weights of the preset (the model's own initialisation) when there is
    no run; unscanned for decoding (`decoding`, else `for_decoding`) and placed on its
    shardings."""
    decoding = decoding or for_decoding(session)
    if run_dir is None:
        params = decoding.trainer.init_params(jax.random.key(seed))
        return decoding, params, f"random weights (seed {seed})"
    params, source = _restore(session, run_dir, warn)
    if session.cfg.model.scan_layers:
        stages = dict(session.trainer.mesh.shape).get(STAGE, 1)
        if stages > 1:  # a circular run stores its blocks stage-major: back to layer order
            blocks = natural_layers(session.cfg.model, params["blocks"], stages)
            params = {**params, "blocks": blocks}
        params = decode.unstack_layers(params, session.cfg.model.n_layers)
    params = jax.device_put(params, decoding.trainer.state_shardings.params)
    return decoding, params, source


def _restore(session: Session, run_dir: Path, warn):
    # serving only reads: a read-only run folder is fine, a live run's too, and a damaged
    # step is skipped and left where it is (lab.run resume=true sets it aside)
    trainer = session.trainer
    damaged = []
    # (each step in the layout it was saved in: a run resumed in another layout keeps its
    # older steps in the first, moved here into the layout of the run's config.json)
    # The weights alone are read and checked: the optimizer's moments (twice their bytes)
    # never decode, so they are not held, and a damaged moment costs no step its weights.
    step, params, _ = restore_in_layout(
        run_dir,
        trainer,
        saved_config(run_dir),
        params_only=True,
        warn=warn,
        why=f"run={run_dir.name}",
        moved=damaged,
        read_only=True,
    )
    if params is None and damaged:  # it was checkpointed: say so
        n = f"{len(damaged)} damaged step{'s' if len(damaged) > 1 else ''}"
        raise ConfigError(
            f"run={run_dir.name}: its {n} ({', '.join(map(str, sorted(damaged)))}) could not "
            "be read; none is left to serve"
        )
    if params is None and (aside := checkpoint.damaged_steps(run_dir)):
        raise ConfigError(
            f"run={run_dir.name}: no checkpoint to serve in {checkpoint.folder(run_dir)}; "
            f"{checkpoint.damaged_folder(run_dir)} keeps {', '.join(aside)}, set aside by a "
            "resume (leave run= out for random weights)"
        )
    if params is None:
        raise ConfigError(
            f"run={run_dir.name}: no checkpoint to serve in {checkpoint.folder(run_dir)} "
            "(train it with checkpoint_every=N, or leave run= out for random weights)"
        )
    return params, f"run {run_dir.name}, step {step}"

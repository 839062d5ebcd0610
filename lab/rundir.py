"""The run folder `out_dir/name/`: what may go in it, who may write it, and how its files survive.

A run folder belongs to one live run (a lock), a resume must ask for the model the folder holds
(checked against its config.json before anything runs), metrics lines are never deleted (a
resume that repeats steps moves the repeated lines to metrics-superseded.jsonl; a line torn by a
kill mid-write is kept in metrics-torn.jsonl), and libraries' log output goes to lab.log in the
folder, so the user reads the lab's own one-line messages.
"""

import json
import logging
from pathlib import Path

from lab.errors import ConfigError

# Fields that decide the shape of the saved state: a resume that changes one cannot load it.
STATE_FIELDS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "d_ff",
    "tie_embeddings",
    "param_dtype",
    "scan_layers",
)


def saved_config(run_dir: Path) -> dict:
    """config.json of an earlier run in this folder; ConfigError if there is none to resume."""
    path = run_dir / "config.json"
    if not path.exists():
        raise ConfigError(
            f"resume=true: no run named {run_dir.name!r} in {str(run_dir.parent)!r} "
            "(nothing to resume; leave out resume=true to start it)"
        )
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"resume=true: {path} is damaged ({e})") from None


def check_same_state(saved: dict, new: dict) -> None:
    """The fields that shape the saved state must match; ConfigError naming every one that
    differs (the checkpoints would not load, and a fresh start would replace them)."""
    diffs = [
        f"{k}={saved['model'].get(k)!r} → {new['model'].get(k)!r}"
        for k in STATE_FIELDS
        if saved.get("model", {}).get(k) != new["model"].get(k)
    ]
    if (saved.get("grad_clip", 0) > 0) != (new.get("grad_clip", 0) > 0):
        diffs.append(f"grad_clip={saved.get('grad_clip')!r} → {new.get('grad_clip')!r}")
    if diffs:
        raise ConfigError(
            f"resume=true: this run's model differs from the one saved in the folder "
            f"({', '.join(diffs)}); resume with the saved keys or choose a new name="
        )


def check_steps(saved_step: int, steps: int) -> None:
    if steps <= saved_step:
        raise ConfigError(
            f"resume=true: the run is saved at step {saved_step} and steps={steps} leaves "
            f"nothing to train; ask for steps > {saved_step}"
        )


def read_metrics(path: Path) -> tuple[list[dict], list[str]]:
    """(records, torn lines): every line of metrics.jsonl that parses, and those that do not
    (a kill mid-write leaves a partial last line)."""
    if not path.exists():
        return [], []
    good, torn = [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            good.append(json.loads(line))
        except ValueError:
            torn.append(line)
    return good, torn


def keep_metrics_before(run_dir: Path, start: int) -> None:
    """metrics.jsonl keeps the steps up to `start` (where the run resumes); the steps after
    it, which this run will log again, move to metrics-superseded.jsonl, and torn lines to
    metrics-torn.jsonl: every step appears once in metrics.jsonl, and no line is lost."""
    path = run_dir / "metrics.jsonl"
    good, torn = read_metrics(path)
    kept = [r for r in good if r.get("step", 0) <= start]
    moved = [r for r in good if r.get("step", 0) > start]
    if moved:
        with open(run_dir / "metrics-superseded.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in moved)
    if torn:
        with open(run_dir / "metrics-torn.jsonl", "a") as f:
            f.writelines(line + "\n" for line in torn)
    if path.exists():
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def quiet_libraries(run_dir: Path) -> None:
    """Python logging of the libraries (orbax, absl, TensorStore's Python side) to lab.log in
    the run folder instead of the terminal."""
    handler = logging.FileHandler(run_dir / "lab.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    for name in ("absl", "orbax", "jax._src.distributed", "tensorstore"):
        log = logging.getLogger(name)
        log.handlers = [handler]
        log.propagate = False

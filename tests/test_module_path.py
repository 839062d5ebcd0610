"""The path a config takes from a command to the step it builds: never back up a layer, and
each module entered once.

The setup of lab.run (argv to a built trainer, without training) and of lab.serve (keys to a
built decoder) runs under a profiler that keeps every call into a lab module made from
another lab module (the nearest lab frame below it on the stack: calls that jax or flax make
on the lab's behalf count as the lab module's that asked). Nothing is compiled: a tiny model
on one device, abstract shapes only.

(a) No call goes from a module into one of a higher layer (pyproject.toml's import-linter
    contract) unless that module is already on the stack: a callback handed down
    (lab.config.exit_code runs lab.run's closure) returns to where it came from, a climb
    would need an import the contract forbids.
(b) The path, the calls into the layers from the command down to the model, is the one
    written here, each module entered once (REENTERED and SERVE_REENTERED, empty, would list
    a module entered again), so a new re-entry fails this test.
"""

import sys
import tomllib
from pathlib import Path

import pytest

import lab.loop
import lab.model
from lab import run as lab_run
from lab import serve
from lab.studies.serving import timed, weights

ROOT = Path(__file__).resolve().parents[1]

# The layers of the lab's modules, highest first (pyproject.toml, the exhaustive contract).
_CONTRACT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
_LAYERS = next(c for c in _CONTRACT["contracts"] if c.get("containers") == ["lab"])["layers"]
LAYER = {name.strip(): i for i, line in enumerate(_LAYERS) for name in line.split("|")}

# The path's layers: the command down to the model; below it (config, mesh, kernels, quant,
# measure) are the helpers every layer calls.
PATH_LAYERS = LAYER["model"]


def layer(module: str) -> int:
    """The layer of lab.X or lab.X.Y (lower numbers are higher layers)."""
    return LAYER[module.split(".")[1]]


def _lab(frame) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name.startswith("lab.") else None


def trace(fn):
    """(fn's result, [(caller, callee, function, modules on the stack)]) for every call into
    a lab module from another lab module (or from outside the lab: caller None)."""
    entries = []
    lab.model.build.cache_clear()  # a model built by an earlier test is entered all the same

    def profile(frame, event, _arg):
        if event != "call" or (callee := _lab(frame)) is None:
            return
        stack, f = [], frame.f_back
        while f is not None:
            if (m := _lab(f)) is not None:
                stack.append(m)
            f = f.f_back
        caller = stack[0] if stack else None
        if caller != callee:
            entries.append((caller, callee, frame.f_code.co_name, frozenset(stack)))

    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, entries


def climbs(entries) -> list[str]:
    """Calls from a module into a higher layer's module that is not already on the stack."""
    return [
        f"{caller} → {callee}.{fn}"
        for caller, callee, fn, stack in entries
        if caller and layer(callee) < layer(caller) and callee not in stack
    ]


def path(entries) -> list[str]:
    """module.function for each call into the path's layers from another module (the
    dataclasses' own methods left out: they are the types, not the path; a flax module's
    __call__ kept: the model traced, here for abstract shapes)."""
    return [
        f"{callee}.{fn}"
        for caller, callee, fn, _ in entries
        if layer(callee) <= PATH_LAYERS and (fn == "__call__" or not fn.startswith("__"))
    ]


def reentered(steps: list[str]) -> dict[str, list[str]]:
    """Modules entered again after the path has gone into another module: module → its calls."""
    seen, out, last = {}, {}, None
    for step in steps:
        module = step.rsplit(".", 1)[0]
        if module != last:
            seen.setdefault(module, []).append(step)
            last = module
    for module, calls in seen.items():
        if len(calls) > 1:
            out[module] = calls
    return out


# No module is entered twice: resolve's rule that every weight splits over the mesh builds the
# model (its attention kernel chosen first) and traces its abstract weights; the Resolved
# carries both, and the trainer takes them without entering lab.model again.
REENTERED = {}

# lab.serve with random weights resolves once, for decoding the batches asked. (Serving a
# trained run resolves twice by design, DESIGN.md: a derived config goes through resolve again
# from a request; first for the session the run's checkpoint restores into, its scanned layers
# and pipeline, then for decoding.)
SERVE_REENTERED = {}


@pytest.fixture
def no_training(monkeypatch):
    built = []
    monkeypatch.setattr(lab.loop, "run_training", lambda session: built.append(session) or 0)
    return built


def test_lab_run_resolves_once_and_builds_its_step_going_down(no_training, tmp_path):
    argv = ["model=tiny", "mesh=1", "steps=1", "name=p", f"out_dir={tmp_path}"]
    rc, entries = trace(lambda: lab_run.main(argv))
    assert rc == 0 and no_training[0].trainer.cfg.model.n_layers > 0
    assert climbs(entries) == []
    steps = path(entries)
    assert steps == [
        "lab.run.main",
        "lab.run.run",  # lab.config.exit_code runs it: the one callback (not a climb)
        "lab.session.open_session",
        "lab.resolve.resumed",  # resume=true takes the run's own keys (none asked here)
        "lab.resolve.found",  # the platform, once
        "lab.resolve.resolve",  # the rules, once
        "lab.model.build",  # resolve's rule: every weight splits over the mesh
        "lab.model.__call__",  # (abstract)
        "lab.train.make_trainer",  # the builder takes the Resolved (its model, its weights)
    ]
    assert reentered(steps) == REENTERED


def test_lab_serve_resolves_for_decoding_once_and_builds_its_decoder_going_down():
    keys = {"model": "tiny", "mesh": "1"}
    o = serve.Options(batches=(2,), prefill_batches=(2,), prompt_len=8, decode_steps=2)

    def setup():  # lab.serve.run up to the decoder (weights abstract: nothing is compiled)
        s, _ = serve._session(o, keys)
        decoding = weights.for_decoding(s, (*o.batches, *o.prefill_batches))
        params = decoding.trainer.abstract_state.params
        return timed.make_decoder(decoding, params, batch=2, max_len=16, int8_cache=False)

    dec, entries = trace(setup)
    assert dec.batch_sharding is not None
    assert climbs(entries) == []
    steps = path(entries)
    assert steps == [
        "lab.serve._session",
        "lab.session.open_session",
        "lab.resolve.of",  # the request of the user's keys
        "lab.resolve.found",  # the platform, once
        "lab.resolve.resolve",  # for decoding the batches asked: the rules, once
        "lab.model.build",
        "lab.model.__call__",  # (abstract: the weights rule)
        "lab.train.make_trainer",  # the decoding session's (unscanned) trainer
        "lab.studies.serving.weights.for_decoding",  # already resolved for those batches
        "lab.studies.serving.timed.make_decoder",
        "lab.decode.param_shardings",
        "lab.decode.make_decoder",  # takes the decoding session's config: no resolve below
    ]
    assert reentered(steps) == SERVE_REENTERED


def test_a_climb_is_found():
    """The check itself: a call from a lower layer into a higher one not on the stack."""
    entries = [("lab.model", "lab.train", "make_trainer", frozenset({"lab.model"}))]
    assert climbs(entries) == ["lab.model → lab.train.make_trainer"]
    callback = [("lab.config", "lab.run", "run", frozenset({"lab.config", "lab.run"}))]
    assert climbs(callback) == []
    steps = ["lab.run.main", "lab.session.open_session", "lab.resolve.resolve", "lab.run.run"]
    assert reentered(steps) == {"lab.run": ["lab.run.main", "lab.run.run"]}

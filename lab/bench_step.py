"""Does the lab's machinery cost anything? Its train step against a bare flax+optax step.

`python -m lab.bench_step model=small` builds the lab's step (shardings, logical constraints,
donation, loss scaling hooks) and a bare step written the plain way (`jax.jit` of
`model.apply` + `optax.adamw`, no shardings), for the same model on the same batch, and times
them alternately in one run (lab.measure.timing.compare). Ratio = lab / bare.
"""

import sys

import jax
import optax

from lab.config import ConfigError, parse_args
from lab.data import host_batch, to_global
from lab.measure.timing import compare
from lab.model import build
from lab.run import setup
from lab.train import cross_entropy, make_optimizer


def bare_step_fn(model, tx):
    """The step a user would write first: no shardings, no constraints, no donation."""

    @jax.jit
    def step(params, opt_state, tokens_BxL1):
        def loss_fn(p):
            logits = model.apply({"params": p}, tokens_BxL1[:, :-1])
            return cross_entropy(logits, tokens_BxL1[:, 1:])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def _stepper(fn, state):
    """A zero-argument call that advances its own state (so donation stays legal) and
    returns that state, so the timer blocks on every leaf of the update."""
    box = [state]

    def call():
        box[0] = fn(box[0])
        return box[0]

    return call


def run(argv: list[str]) -> dict:
    cfg, info, trainer = setup(parse_args(["steps=1000", *argv]))
    tokens = to_global(
        host_batch(cfg.data, cfg.seed, 0, cfg.batch_size, cfg.seq_len, cfg.model.vocab_size),
        trainer.batch_sharding,
    )
    compiled = trainer.lower().compile()
    lab_call = _stepper(lambda s: compiled(s, tokens)[0], trainer.init(jax.random.key(cfg.seed)))
    params = jax.device_put(trainer.init(jax.random.key(cfg.seed)).params, jax.devices()[0])
    tx = make_optimizer(cfg)  # the same optimizer: only the machinery differs
    bare = bare_step_fn(build(cfg.model), tx)
    bare_call = _stepper(lambda s: bare(*s, tokens)[:2], (params, tx.init(params)))
    results = compare({"bare": bare_call, "lab": lab_call}, baseline="bare", budget_s=5.0)
    print(f"{info.header()}; model={cfg.preset}, batch {cfg.batch_size}×{cfg.seq_len}")
    for name, r in results.items():
        print(
            f"  {name:<5} median {r['median_s'] * 1e3:8.2f} ms  p10 {r['p10_s'] * 1e3:8.2f}  "
            f"p90 {r['p90_s'] * 1e3:8.2f}  runs {r['runs']:4d}  ratio {r['ratio']:.3f}"
        )
    return results


if __name__ == "__main__":
    try:
        run(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

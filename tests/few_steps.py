"""The few-step training loop the model-level tests share: a config's trainer, initialised from
seed 0, stepped on the deterministic text batches `lab.run` feeds, as `lab.run` steps it."""

import jax

from lab.data import host_batch, to_global
from lab.mesh import make_mesh
from lab.train import make_trainer


def train_steps(cfg, steps: int = 3):
    """(losses, trainer, state) after `steps` steps of `cfg` on the mesh `cfg.mesh` names."""
    trainer = make_trainer(cfg, make_mesh(cfg.mesh))
    state = trainer.init(jax.random.key(0))
    losses = []
    for step in range(steps):
        tokens = host_batch("text", 0, step, cfg.batch_size, cfg.seq_len, 256)
        state, metrics = trainer.step(state, to_global(tokens, trainer.batch_sharding))
        losses.append(float(metrics["loss"]))
    return losses, trainer, state

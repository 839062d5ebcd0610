"""The PyTorch decoder peer of lab.serve (lab/studies/torch_decoder.py) decodes the same
logits as the lab's decoder from the same weights: prefill, then steps. Skipped where PyTorch
is not installed (the `peers` extra; CI does not install it)."""

import jax
import numpy as np
import pytest

from lab import decode
from lab.config import make_config
from lab.mesh import make_mesh
from lab.studies import torch_decoder
from lab.train import make_trainer

pytest.importorskip("torch")

BATCH, PROMPT, STEPS = 2, 5, 3


def test_the_torch_decoder_matches_the_labs():
    cfg = make_config(preset="tiny", dtype="float32", n_kv_heads=2, batch_size=BATCH)
    trainer = make_trainer(cfg, make_mesh(cfg.mesh))
    params = trainer.init(jax.random.key(0)).params
    max_len = PROMPT + STEPS
    dec = decode.make_decoder(
        cfg.model,
        trainer.mesh,
        trainer.rules,
        trainer.state_shardings.params,
        batch=BATCH,
        max_len=max_len,
    )
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.model.vocab_size, (BATCH, PROMPT)).astype(np.int32)
    fed = rng.integers(0, cfg.model.vocab_size, (BATCH, STEPS)).astype(np.int32)
    peer = torch_decoder.TorchDecoder.build(
        cfg.model, jax.device_get(params), batch=BATCH, max_len=max_len
    )
    with jax.set_mesh(trainer.mesh):
        lengths = np.full((BATCH,), PROMPT, np.int32)
        logits, cache = dec.prefill(params, prompts, lengths, dec.empty_cache())
        got, want = [peer.prefill(prompts).numpy()], [np.asarray(logits)]
        for t in range(STEPS):
            logits, cache = dec.step(params, fed[:, t], cache)
            want.append(np.asarray(logits))
            got.append(peer.step(fed[:, t]).numpy())
    np.testing.assert_allclose(np.stack(got), np.stack(want), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="the cache is full"):
        peer.step(fed[:, 0])

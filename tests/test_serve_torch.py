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


def test_the_peer_keeps_to_its_budget_and_says_when_it_cut_the_steps():
    """time_decode's samples fit budget_s (both thread counts together): with far more steps
    asked than fit, each sample is shorter and the result says how many steps it took."""
    import time

    from lab.measure.serving import PeerPoint
    from lab.report.tables import serving_peers

    cfg = make_config(preset="tiny", dtype="float32", batch_size=BATCH)
    trainer = make_trainer(cfg, make_mesh(cfg.mesh))
    params = jax.device_get(trainer.init(jax.random.key(0)).params)
    prompts = np.random.default_rng(0).integers(0, 256, (BATCH, PROMPT)).astype(np.int32)
    t0 = time.perf_counter()
    r = torch_decoder.time_decode(cfg.model, params, prompts, steps=100_000, budget_s=0.05)
    assert time.perf_counter() - t0 < 20  # 100,000 steps × 3 samples × 2 counts would be hours
    assert 1 <= r["steps"] < 100_000 and r["samples"] >= 1, r
    (line,) = serving_peers([PeerPoint(**r, lab_over_torch=1.0)], 100_000)
    assert f"budget= cut its samples to {r['steps']} step" in line, line


def test_a_float16_model_is_served_with_the_peer_skipped_in_one_line(tmp_path, capsys):
    """float16 (which the peer does not compute) is served whole: the peer's line says why."""
    from lab.serve import main as serve

    args = ["model=tiny", "dtype=float16", "batches=1", "prefill_batches=1", "prompt_len=8"]
    args += ["decode_steps=2", "budget=0.01", "int8=false", "plot=false", f"results={tmp_path}"]
    assert serve(args) == 0
    out = capsys.readouterr().out
    assert "peer    none: the PyTorch decoder computes in float32 or bfloat16" in out, out
    assert list(tmp_path.glob("serve-*.jsonl"))

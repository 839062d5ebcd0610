"""Batches as a pure function of (seed, step): any step can be rebuilt, so resume is exact.

Each batch is computed in full on every host (it is small) and placed on the mesh with
`jax.make_array_from_callback`, which hands each device only its slice: the same code serves
one process or many under `jax.distributed`.
"""

import functools
from importlib import resources

import jax
import numpy as np


@functools.cache
def corpus_bytes() -> np.ndarray:
    """The bundled public-domain text as uint8 tokens (byte-level: vocab 256)."""
    raw = resources.files("lab").joinpath("data_files/corpus.txt").read_bytes()
    return np.frombuffer(raw, dtype=np.uint8)


def _rng(seed: int, step: int) -> np.random.Generator:
    return np.random.default_rng([seed, step])


def text_batch(seed: int, step: int, batch: int, seq_len: int) -> np.ndarray:
    """`batch` windows of seq_len+1 bytes at random offsets: inputs are [:-1], targets [1:]."""
    text = corpus_bytes()
    if len(text) <= seq_len + 1:
        raise ValueError(f"seq_len={seq_len} is longer than the bundled corpus ({len(text)} bytes)")
    starts_B = _rng(seed, step).integers(0, len(text) - seq_len - 1, size=batch)
    idx_BxL = starts_B[:, None] + np.arange(seq_len + 1)[None, :]
    return text[idx_BxL].astype(np.int32)


def synthetic_batch(seed: int, step: int, batch: int, seq_len: int, vocab: int) -> np.ndarray:
    """Uniform random tokens: for timing, where what is learned does not matter."""
    return _rng(seed, step).integers(0, vocab, size=(batch, seq_len + 1), dtype=np.int32)


def host_batch(kind: str, seed: int, step: int, batch: int, seq_len: int, vocab: int):
    if kind == "text":
        return text_batch(seed, step, batch, seq_len)
    return synthetic_batch(seed, step, batch, seq_len, vocab)


def to_global(tokens_BxL1: np.ndarray, sharding) -> jax.Array:
    """Place a host batch on the mesh; each device receives only its own slice."""
    return jax.make_array_from_callback(tokens_BxL1.shape, sharding, lambda i: tokens_BxL1[i])

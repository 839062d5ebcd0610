"""Batches as a pure function of (seed, step): any step can be rebuilt, so resume is exact.

Each batch is computed in full on every host (it is small) and placed on the mesh with
`jax.make_array_from_callback`, which hands each device only its slice: the same code serves
one process or many under `jax.distributed`.
"""

import functools
import re
from importlib import resources

import jax
import numpy as np


@functools.cache
def corpus_bytes() -> np.ndarray:
    """The bundled public-domain text as uint8 tokens (byte-level: vocab 256)."""
    raw = resources.files("lab").joinpath("data_files/corpus.txt").read_bytes()
    return np.frombuffer(raw, dtype=np.uint8)


# A document of the corpus: its preamble, then each titled section (a fable, a sonnet, the
# address): a line of capitals (SONNET 18 has digits) after a blank line starts the next one.
_TITLE = re.compile(rb"\n\n(?=[A-Z][A-Z0-9 ,'.-]*\n)")


@functools.cache
def document_starts() -> np.ndarray:
    """[len(corpus)] bool: True at the first byte of each document (byte 0 included); the
    blank line before a title ends the document before it."""
    raw = corpus_bytes().tobytes()
    starts = np.zeros(len(raw), bool)
    starts[0] = True
    starts[[m.end() for m in _TITLE.finditer(raw)]] = True
    return starts


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


def packed_text_batch(seed: int, step: int, batch: int, seq_len: int) -> np.ndarray:
    """[B, 2, seq_len+1]: row [:, 0] the bytes, as text_batch (seq_len+1 at a random offset,
    running on through the next documents, the corpus read as a loop), row [:, 1] each byte's
    document within its row (0, 1, ...: the segment ids, a new id at every document start).
    Every byte is real text (no padding), so the loss counts every target; the target of a
    document's last byte is the next one's first (its context is one document, as always)."""
    text, starts = corpus_bytes(), document_starts()
    starts_B = _rng(seed, step).integers(0, len(text), size=batch)
    idx_BxL1 = (starts_B[:, None] + np.arange(seq_len + 1)[None, :]) % len(text)
    new_BxL1 = starts[idx_BxL1]
    new_BxL1[:, 0] = False
    segments_BxL1 = np.cumsum(new_BxL1, axis=1)
    return np.stack([text[idx_BxL1], segments_BxL1], axis=1).astype(np.int32)


def synthetic_batch(seed: int, step: int, batch: int, seq_len: int, vocab: int) -> np.ndarray:
    """Uniform random tokens: for timing, where what is learned does not matter."""
    return _rng(seed, step).integers(0, vocab, size=(batch, seq_len + 1), dtype=np.int32)


def host_batch(
    kind: str, seed: int, step: int, batch: int, seq_len: int, vocab: int, pack: bool = False
):
    """[B, seq_len+1] tokens; packed text (pack=True) [B, 2, seq_len+1]: tokens, segment ids."""
    if kind == "text" and pack:
        return packed_text_batch(seed, step, batch, seq_len)
    if kind == "text":
        return text_batch(seed, step, batch, seq_len)
    return synthetic_batch(seed, step, batch, seq_len, vocab)


def to_global(tokens_BxL1: np.ndarray, sharding) -> jax.Array:
    """Place a host batch on the mesh; each device receives only its own slice."""
    return jax.make_array_from_callback(tokens_BxL1.shape, sharding, lambda i: tokens_BxL1[i])

"""Batches depend on (seed, step) only, and the bundled text is real bytes."""

import numpy as np

from lab.data import corpus_bytes, host_batch


def test_batches_are_deterministic_and_vary_by_step():
    a = host_batch("text", 0, 5, 4, 16, 256)
    np.testing.assert_array_equal(a, host_batch("text", 0, 5, 4, 16, 256))
    assert not np.array_equal(a, host_batch("text", 0, 6, 4, 16, 256))
    assert not np.array_equal(a, host_batch("text", 1, 5, 4, 16, 256))
    assert a.shape == (4, 17) and a.dtype == np.int32


def test_text_windows_are_contiguous_corpus_slices():
    text = corpus_bytes()
    row = host_batch("text", 3, 0, 1, 64, 256)[0]
    starts = np.flatnonzero(text[: len(text) - 64] == row[0])
    assert any(np.array_equal(text[s : s + 65], row) for s in starts)
    assert len(text) > 10_000


def test_synthetic_tokens_cover_the_vocab():
    toks = host_batch("synthetic", 0, 0, 64, 64, 1000)
    assert toks.min() >= 0 and toks.max() < 1000 and len(np.unique(toks)) > 900

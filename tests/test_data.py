"""Batches depend on (seed, step) only, and the bundled text is real bytes."""

import numpy as np

from lab.data import corpus_bytes, document_starts, host_batch


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


def test_documents_are_the_titled_sections():
    text = corpus_bytes().tobytes()
    firsts = [text[i : text.index(b"\n", i)] for i in np.flatnonzero(document_starts())]
    assert firsts[1:4] == [
        b"THE WOLF AND THE LAMB",
        b"THE TORTOISE AND THE HARE",
        b"THE FOX AND THE GRAPES",
    ]
    assert b"SONNET 130" in firsts and firsts[-1] == b"THE GETTYSBURG ADDRESS"
    assert len(firsts) == 1 + text.count(b"\n\nTHE ") + text.count(b"\n\nSONNET ")


def test_packed_rows_carry_a_new_segment_at_every_document_start():
    """Tokens as the corpus read as a loop from a random offset; segment ids 0, 1, ... going up
    by one exactly where a document starts (never at a row's first token); deterministic."""
    text, starts = corpus_bytes(), document_starts()
    batch = host_batch("text", 3, 7, 64, 900, 256, pack=True)
    assert batch.shape == (64, 2, 901) and batch.dtype == np.int32
    np.testing.assert_array_equal(batch, host_batch("text", 3, 7, 64, 900, 256, pack=True))
    for _, segments in batch:
        assert segments[0] == 0 and set(np.unique(np.diff(segments))) <= {0, 1}
    # the offsets: find each row in the looped corpus and check the boundaries there
    looped = np.concatenate([text, text[:901]])
    hits = 0
    for tokens, segments in batch[:8]:
        for o in np.flatnonzero(looped[: len(text)] == tokens[0]):
            if np.array_equal(looped[o : o + 901], tokens):
                np.testing.assert_array_equal(
                    np.diff(segments), starts[(o + np.arange(1, 901)) % len(text)]
                )
                hits += 1
                break
    assert hits == 8
    assert batch[:, 1].max() >= 1  # 900 bytes always span a document boundary somewhere

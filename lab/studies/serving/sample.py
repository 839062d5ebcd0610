"""A short continuation of a prompt by a trained byte-level model: what lab.serve prints
beside its figures, so a run's weights are seen to decode text."""

import jax
import numpy as np

from lab import decode


def sample_text(session, params, *, prompt: str, tokens: int, temperature: float, seed: int):
    """A short continuation of `prompt` by a byte-level model (vocab 256): the text. The
    prompt's bytes are the command line's own (bytes that are not UTF-8 come through Python's
    surrogate escapes unchanged)."""
    raw = np.frombuffer(prompt.encode("utf-8", "surrogateescape"), np.uint8).astype(np.int32)[None]
    batch = decode.batch_multiple(session.trainer)
    prompts = np.repeat(raw, batch, 0)
    dec = decode.make_decoder(
        session.cfg.model,
        session.trainer.mesh,
        session.trainer.rules,
        session.trainer.state_shardings.params,
        batch=batch,
        max_len=raw.shape[1] + tokens + 1,
        steps=tokens,
        temperature=temperature,
    )
    lengths = np.full((batch,), raw.shape[1], np.int32)
    with jax.set_mesh(dec.mesh):
        logits, cache = dec.prefill(params, prompts, lengths, dec.empty_cache())
        out, _ = dec.generate(params, logits, cache, jax.random.key(seed))
    made = np.asarray(out[0])
    made = made[made >= 0]  # NO_TOKEN (NaN logits: a full cache, or a model that diverged)
    text = bytes(made.astype(np.uint8)).decode("utf-8", errors="replace")
    return printable(text)


def _escaped(c: str) -> str:
    """A character as Python writes it in a string: \\x1b, \\u2028."""
    n = ord(c)
    return f"\\x{n:02x}" if n <= 0xFF else f"\\u{n:04x}" if n <= 0xFFFF else f"\\U{n:08x}"


def printable(text: str) -> str:
    """`text` safe for a terminal: control characters (an ESC would start a terminal command)
    shown as escapes (\\x1b), newlines and tabs kept."""
    return "".join(
        c if c in "\n\t" or (c.isprintable() and c != "\x7f") else _escaped(c) for c in text
    )

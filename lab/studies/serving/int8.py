"""What int8 weights and an int8 KV cache cost in accuracy, on the bundled text."""

import jax
import numpy as np

from lab import data, quant
from lab.measure.serving import Int8Error
from lab.model import build
from lab.studies.serving.timed import make_decoder
from lab.train import cross_entropy


def corpus_tokens(batch: int, length: int, vocab: int) -> np.ndarray:
    """`batch` windows of the bundled text (bytes) as token ids, the same every call."""
    text = np.frombuffer(data.corpus_bytes(), np.uint8).astype(np.int32) % vocab
    starts = np.linspace(0, len(text) - length - 1, batch).astype(int)
    return np.stack([text[s : s + length + 1] for s in starts])


def int8_error(session, params, params_i8, *, batch: int, prompt_len: int, steps: int) -> Int8Error:
    """The loss of the full forward pass with float and int8 weights, and the logits of
    prefill + decode steps with int8 weights and an int8 cache against float (relative RMS
    and max |difference|). The prompts are windows of the bundled text, so a prompt longer
    than the text is cut to it (Int8Error.prompt_len says how long they were)."""
    model = session.cfg.model
    t = session.trainer
    prompt_len = min(prompt_len, len(data.corpus_bytes()) - steps - 1)
    seqs = corpus_tokens(batch, prompt_len + steps, model.vocab_size)
    net = build(model)

    def loss(p):
        with jax.set_mesh(t.mesh):
            logits = jax.jit(lambda p, x: net.apply({"params": p}, x))(p, seqs[:, :-1])
        return float(cross_entropy(logits, seqs[:, 1:]))

    def decoded(p, int8_cache):
        dec = make_decoder(
            session, p, batch=batch, max_len=prompt_len + steps, int8_cache=int8_cache
        )
        lengths = np.full((batch,), prompt_len, np.int32)
        with jax.set_mesh(t.mesh):
            logits, cache = dec.prefill(p, seqs[:, :prompt_len], lengths, dec.empty_cache())
            out = [np.asarray(logits)]
            for i in range(steps - 1):
                logits, cache = dec.step(p, seqs[:, prompt_len + i], cache)
                out.append(np.asarray(logits))
        return np.stack(out, 1)

    ref = decoded(params, False)
    got = decoded(params_i8, True)
    diff = got - ref
    return Int8Error(
        prompt_len=prompt_len,
        loss_float=loss(params),
        loss_int8=loss(params_i8),
        logits_rel_rms=float(np.sqrt(np.mean(diff**2) / np.mean(ref**2))),
        logits_max_abs=float(np.abs(diff).max()),
        logits_scale=float(np.abs(ref).max()),
        top1_agreement=float(np.mean(np.argmax(got, -1) == np.argmax(ref, -1))),
        weight_bytes_float=quant.weight_bytes(params),
        weight_bytes_int8=quant.weight_bytes(params_i8),
        window_len=prompt_len + steps,
    )

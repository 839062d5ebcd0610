"""What int8 weights and an int8 KV cache cost in accuracy, on the bundled text."""

import jax
import numpy as np

from lab import data, decode, quant
from lab.measure.serving import Int8Error, Int8MatmulError
from lab.model import build
from lab.studies.serving.timed import make_decoder
from lab.train import cross_entropy

# decode positions lab.serve compares per sequence and matmul: a top-1 share over 8 moves in
# steps of 12.5 %; each position is one decode step more per matmul measured
ERROR_STEPS = 32


def corpus_tokens(batch: int, length: int, vocab: int) -> np.ndarray:
    """`batch` windows of the bundled text (bytes) as token ids, the same every call."""
    text = np.frombuffer(data.corpus_bytes(), np.uint8).astype(np.int32) % vocab
    starts = np.linspace(0, len(text) - length - 1, batch).astype(int)
    return np.stack([text[s : s + length + 1] for s in starts])


def int8_error(
    session, params, params_i8, *, batch: int, prompt_len: int, steps: int, matmuls=("auto",)
) -> Int8Error:
    """For each of `matmuls` (the ways the int8 weights' decode speed was measured: the
    error stated beside a speed is that matmul's), the loss of the full forward pass with
    int8 weights multiplied that way against float, and the logits of prefill + `steps`
    decode steps with those weights and an int8 cache against float weights and cache
    (relative RMS, max |difference|, positions whose top token is the same). The prompts are
    windows of the bundled text, so a prompt longer than the text is cut to it
    (Int8Error.prompt_len says how long they were)."""
    model = session.cfg.model
    t = session.trainer
    prompt_len = min(prompt_len, len(data.corpus_bytes()) - steps - 1)
    seqs = corpus_tokens(batch, prompt_len + steps, model.vocab_size)
    net = build(model)
    platform = session.info.backend

    def loss(p, matmul="xla"):
        with jax.set_mesh(t.mesh), quant.using(decode.matmuls(matmul, platform)):
            logits = jax.jit(lambda p, x: net.apply({"params": p}, x))(p, seqs[:, :-1])
        return float(cross_entropy(logits, seqs[:, 1:]))

    def decoded(p, int8_cache, matmul="auto"):
        dec = make_decoder(
            session,
            p,
            batch=batch,
            max_len=prompt_len + steps,
            int8_cache=int8_cache,
            matmul=matmul,
        )
        lengths = np.full((batch,), prompt_len, np.int32)
        with jax.set_mesh(t.mesh):
            logits, cache = dec.prefill(p, seqs[:, :prompt_len], lengths, dec.empty_cache())
            out = [np.asarray(logits)]
            for i in range(steps - 1):
                logits, cache = dec.step(p, seqs[:, prompt_len + i], cache)
                out.append(np.asarray(logits))
        return dec.matmul, np.stack(out, 1)

    _, ref = decoded(params, False)
    errors = []
    for m in dict.fromkeys(decode.resolve_matmul(m, t.mesh) for m in matmuls):
        name, got = decoded(params_i8, True, m)
        diff = got - ref
        same = np.argmax(got, -1) == np.argmax(ref, -1)
        errors.append(
            Int8MatmulError(
                matmul=name,
                loss_int8=loss(params_i8, name),
                logits_rel_rms=float(np.sqrt(np.mean(diff**2) / np.mean(ref**2))),
                logits_max_abs=float(np.abs(diff).max()),
                top1_same=int(same.sum()),
                positions=int(same.size),
            )
        )
    return Int8Error(
        prompt_len=prompt_len,
        loss_float=loss(params),
        logits_scale=float(np.abs(ref).max()),
        weight_bytes_float=quant.weight_bytes(params),
        weight_bytes_int8=quant.weight_bytes(params_i8),
        window_len=prompt_len + steps,
        matmuls=tuple(errors),
    )

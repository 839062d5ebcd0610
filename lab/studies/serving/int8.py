"""What int8 weights and an int8 KV cache cost in accuracy, on the bundled text."""

import jax
import numpy as np

from lab import data, decode, quant
from lab.measure.serving import Int8Error, Int8MatmulError
from lab.model import build
from lab.studies.serving.timed import make_decoder
from lab.train import cross_entropy

# decode positions lab.serve compares per window and matmul: each is one decode step more per
# matmul measured
ERROR_STEPS = 32
# windows of the bundled text the error is measured on, spread over the whole text: a single
# window reads one passage (the licence at byte 0) and cannot tell a loss change of 1e-4 from
# noise; 8 windows × 32 steps compare 256 positions, and the windows' spread gives the loss
# change a standard error. Rounded up to a multiple of the devices the batch splits over;
# fewer where the text does not hold this many disjoint windows (a long prompt), so the cost
# stays about 8 windows or one pass over the text.
ERROR_WINDOWS = 8


def error_windows(n_devices: int, window_len: int, text_len: int) -> int:
    """How many windows of `window_len` tokens the error is measured on: ERROR_WINDOWS, or as
    many disjoint ones as the text holds where that is fewer (at least one), rounded up to a
    multiple of `n_devices` (the batch splits over them)."""
    want = max(1, min(ERROR_WINDOWS, text_len // window_len))
    return -(-want // n_devices) * n_devices


def corpus_tokens(batch: int, length: int, vocab: int) -> np.ndarray:
    """`batch` windows of the bundled text (bytes) as token ids, spread evenly from its start
    to its end, the same every call."""
    text = np.frombuffer(data.corpus_bytes(), np.uint8).astype(np.int32) % vocab
    starts = np.linspace(0, len(text) - length - 1, batch).astype(int)
    return np.stack([text[s : s + length + 1] for s in starts])


class _Programs:
    """Each distinct program compiled and run once on the same weights. Variants often trace
    to one program: native and native1 leave a forward pass's and a prefill's many rows to
    XLA's dot, as xla does, so their loss and prefill are xla's. `run(jitted, params, ...)`
    lowers `jitted` (a trace, no compile) and gives the outputs of the first run of an
    identical program on the same `params` where there was one; the other arguments are the
    same text windows every call."""

    def __init__(self):
        self.outputs: dict[tuple[str, int], object] = {}

    def run(self, jitted, params, *args):
        key = (jitted.lower(params, *args).as_text(), id(params))
        if key not in self.outputs:
            self.outputs[key] = jitted(params, *args)
        return self.outputs[key]


def int8_error(
    session, params, params_i8, *, prompt_len: int, steps: int, matmuls=("auto",)
) -> Int8Error:
    """For each of `matmuls` (the ways the int8 weights' decode speed was measured: the
    error stated beside a speed is that matmul's), the loss of the full forward pass with
    int8 weights multiplied that way against float, and the logits of prefill + `steps`
    decode steps with those weights and an int8 cache against float weights and cache
    (relative RMS, max |difference|, positions whose top token is the same). The prompts are
    windows of the bundled text spread over all of it (error_windows: Int8Error.windows says
    how many), so a prompt longer than the text is cut to it (Int8Error.prompt_len says how
    long they were). The loss change is the mean of the windows' changes, with its standard
    error over them."""
    model = session.cfg.model
    t = session.trainer
    text_len = len(data.corpus_bytes())
    prompt_len = min(prompt_len, text_len - steps - 1)
    batch = error_windows(decode.batch_multiple(t), prompt_len + steps, text_len)
    seqs = corpus_tokens(batch, prompt_len + steps, model.vocab_size)
    net = build(model)
    platform = session.info.backend
    programs = _Programs()

    def forward(matmul):
        def losses(p, x, y):  # each window's mean loss
            with quant.using(decode.matmuls(matmul, platform)):
                logits = net.apply({"params": p}, x)
            return jax.vmap(cross_entropy)(logits, y)

        return jax.jit(losses)

    def loss(p, matmul="xla"):
        x, y = seqs[:, :-1], seqs[:, 1:]
        with jax.set_mesh(t.mesh):
            return np.asarray(programs.run(forward(matmul), p, x, y), np.float64)

    def decoded(p, int8_cache, matmul="auto"):
        dec = make_decoder(
            session,
            p,
            batch=batch,
            max_len=prompt_len + steps,
            int8_cache=int8_cache,
            matmul=matmul,
        )
        prompts = seqs[:, :prompt_len]
        lengths = np.full((batch,), prompt_len, np.int32)
        with jax.set_mesh(t.mesh):
            logits, filled = programs.run(dec.prefill, p, prompts, lengths, dec.empty_cache())
            # a copy: the steps donate their cache, and another variant may start from it
            cache = jax.device_put(filled, dec.cache_sharding, may_alias=False)
            out = [np.asarray(logits)]
            for i in range(steps - 1):
                logits, cache = dec.step(p, seqs[:, prompt_len + i], cache)
                out.append(np.asarray(logits))
        return dec.matmul, np.stack(out, 1)

    _, ref = decoded(params, False)
    loss_float = loss(params)
    errors = []
    for m in dict.fromkeys(decode.resolve_matmul(m, t.mesh) for m in matmuls):
        name, got = decoded(params_i8, True, m)
        diff = got - ref
        same = np.argmax(got, -1) == np.argmax(ref, -1)
        loss_int8 = loss(params_i8, name)
        change = loss_int8 - loss_float  # each window's
        errors.append(
            Int8MatmulError(
                matmul=name,
                loss_int8=float(loss_int8.mean()),
                logits_rel_rms=float(np.sqrt(np.mean(diff**2) / np.mean(ref**2))),
                logits_max_abs=float(np.abs(diff).max()),
                top1_same=int(same.sum()),
                positions=int(same.size),
                loss_change_se=float(change.std(ddof=1) / np.sqrt(batch)) if batch > 1 else None,
            )
        )
    return Int8Error(
        prompt_len=prompt_len,
        loss_float=float(loss_float.mean()),
        logits_scale=float(np.abs(ref).max()),
        weight_bytes_float=quant.weight_bytes(params),
        weight_bytes_int8=quant.weight_bytes(params_i8),
        window_len=prompt_len + steps,
        matmuls=tuple(errors),
        windows=batch,
    )

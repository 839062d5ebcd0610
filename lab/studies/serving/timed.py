"""Prefill and decode steps of lab.decode timed as a server runs them: random prompts, a
decoder on the session's mesh (int8 weights sharded like the float ones), the compile and
warm-up kept out of the median."""

import time

import jax
import numpy as np

from lab import decode
from lab.measure import timing
from lab.session import Session

WARM_STEPS = 3  # cache slots the compile call and warm-up of time_decode use


def random_prompts(vocab: int, batch: int, length: int, seed: int):
    """`batch` random prompts of `length` tokens, the same for the same seed."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (batch, length)).astype(np.int32)


def make_decoder(
    session: Session, params, *, batch: int, max_len: int, int8_cache: bool, matmul: str = "auto"
):
    """lab.decode's decoder for `params` (float or int8 weights) on the session's mesh."""
    t = session.trainer
    shardings = decode.param_shardings(t.state_shardings.params, params)
    return decode.make_decoder(
        t.cfg.model,
        t.mesh,
        t.rules,
        shardings,
        batch=batch,
        max_len=max_len,
        int8_cache=int8_cache,
        matmul=matmul,
    )


def time_prefill(dec, params, prompts, *, budget_s: float) -> timing.BenchResult:
    """Prefill of the whole batch of prompts: a fresh cache each call (lengths reset)."""
    lengths = np.full((prompts.shape[0],), prompts.shape[1], np.int32)
    with jax.set_mesh(dec.mesh):
        call = timing.threaded(
            lambda c: dec.prefill(params, prompts, lengths, c)[1], dec.empty_cache()
        )
        return timing.bench(call, warmup=1, min_runs=3, budget_s=budget_s)


def time_decode(
    dec, params, prompts, *, steps: int, budget_s: float, queued: bool = True
) -> timing.BenchResult:
    """Seconds per decode step at a context of the prompts' length, one token per sequence
    written into the cache. The cache is filled with random entries up to that length
    (Decoder.filled_cache) rather than by a prefill: a step reads the same slots either way,
    and a long context's prefill would cost more than every step timed (prefills are timed
    by time_prefill).

    queued (what a server does): each sample is `steps` steps dispatched back to back and
    blocked once at the end, the cache's lengths then rewound to where the sample began (the
    same slots are written again: the same work, and a cache of prompt + WARM_STEPS + steps
    slots times any number of samples). Not queued: every step blocked on its own, at most
    `steps` of them, which adds the host's wait and the next dispatch to every token."""
    lengths = np.full((prompts.shape[0],), prompts.shape[1], np.int32)
    tokens = prompts[:, -1]
    with jax.set_mesh(dec.mesh):
        cache = dec.filled_cache(lengths)
        if not queued:
            call = timing.threaded(lambda c: dec.step(params, tokens, c)[1], cache)
            return timing.bench(
                call, warmup=2, min_runs=min(5, steps), max_runs=steps, budget_s=budget_s
            )
        t0 = time.perf_counter()
        for _ in range(WARM_STEPS):  # the compile call and warm-up
            cache = dec.step(params, tokens, cache)[1]
        cache = jax.block_until_ready(cache)
        compile_s = time.perf_counter() - t0
        start = np.asarray(cache.lengths)  # a copy: the cache's own buffers are donated
        times_s: list[float] = []
        begun = time.perf_counter()
        while len(times_s) < 3 or time.perf_counter() - begun < budget_s:
            t0 = time.perf_counter()
            for _ in range(steps):
                cache = dec.step(params, tokens, cache)[1]
            cache = jax.block_until_ready(cache)
            times_s.append((time.perf_counter() - t0) / steps)
            cache = cache.replace(lengths=jax.device_put(start, dec.batch_sharding))
    return timing.summarise(times_s, compile_s)

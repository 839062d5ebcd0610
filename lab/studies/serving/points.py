"""One point of the serving study: a prefill or a decode batch timed, with the bytes and FLOPs
its step implies (lab.measure.cost) and the rates they make."""

import dataclasses

from lab import decode, quant
from lab.measure import cost
from lab.measure.serving import DecodePoint, PrefillPoint, Roofs
from lab.session import Session
from lab.studies.serving.timed import (
    WARM_STEPS,
    make_decoder,
    random_prompts,
    time_decode,
    time_prefill,
)


def weight_read_bytes(params, model, batch: int) -> int:
    """Bytes of `params` one forward step of `batch` sequences reads (cost.weight_read_bytes):
    all but an untied embedding table, of which a lookup reads B rows."""
    total = quant.weight_bytes(params)
    if model.tie_embeddings:
        return cost.weight_read_bytes(total, batch)
    table = params["embed"]
    table_bytes = table.size * table.dtype.itemsize
    return cost.weight_read_bytes(total, batch, table_bytes=table_bytes, table_rows=table.shape[0])


def matmul_candidates(session: Session, params) -> tuple[str, ...]:
    """The ways a decoder can multiply these weights here (lab.decode.MATMULS): XLA's dot,
    its int8 × int8 dot where the weights are int8, the native CPU kernel (threaded, and on
    one thread) on one CPU device where it builds."""
    out = ["xla"]
    if quant.is_int8(params):
        out.append("w8a8")
    if decode.resolve_matmul("auto", session.trainer.mesh) == "native":
        out += ["native", "native1"]
    return tuple(out)


def decode_point(
    session,
    params,
    roofs: Roofs,
    *,
    batch,
    prompt_len,
    steps,
    budget_s,
    int8_cache,
    max_len,
    matmul: str = "auto",
    queued: bool = True,
) -> DecodePoint:
    """One decode batch size: its time, and the bytes and FLOPs of a step."""
    model = session.cfg.model
    dec = make_decoder(
        session, params, batch=batch, max_len=max_len, int8_cache=int8_cache, matmul=matmul
    )
    prompts = random_prompts(model.vocab_size, batch, prompt_len, seed=batch)
    r = time_decode(dec, params, prompts, steps=steps, budget_s=budget_s, queued=queued)
    # The plain-JAX decode attention reads every slot of the cache; a Pallas kernel stops
    # at each sequence's length (on average halfway through the timed steps).
    reads_all = decode.reads_whole_cache(model, session.info.backend, int8_cache=int8_cache)
    # the middle timed step's slots: a step at length n writes its token and reads n + 1
    mid = prompt_len + WARM_STEPS + steps // 2 + 1
    slots = max_len if reads_all else mid
    return DecodePoint(
        batch=batch,
        int8_weights=quant.is_int8(params),
        int8_cache=int8_cache,
        matmul=dec.matmul,
        bench=r,
        weight_bytes=weight_read_bytes(params, model, batch),
        cache_bytes=decode.cache_bytes(
            dec.abstract_cache, None if reads_all else [mid] * batch, model.layer_windows
        ),
        flops=cost.step_flops(model, batch, slots, None if reads_all else model.layer_windows),
        slots_read=slots,
        context=max_len,
        roof_bandwidth=roofs.bandwidth,
    )


def fastest_point(session, params, roofs: Roofs, **kw) -> DecodePoint:
    """decode_point with each of matmul_candidates, the fastest kept; `matmuls` on it holds
    every candidate's tokens/s (the run says which it used and what the others did)."""
    points = [
        decode_point(session, params, roofs, matmul=m, **kw)
        for m in matmul_candidates(session, params)
    ]
    best = max(points, key=lambda p: p.tokens_per_s)
    return dataclasses.replace(best, matmuls=tuple((p.matmul, p.tokens_per_s) for p in points))


def prefill_point(session, params, *, batch, prompt_len, budget_s) -> PrefillPoint:
    """The whole batch of prompts prefilled at once, timed, with its FLOPs."""
    model = session.cfg.model
    dec = make_decoder(session, params, batch=batch, max_len=prompt_len, int8_cache=False)
    prompts = random_prompts(model.vocab_size, batch, prompt_len, 100 + batch)
    return PrefillPoint(
        batch=batch,
        prompt_len=prompt_len,
        bench=time_prefill(dec, params, prompts, budget_s=budget_s),
        flops=cost.prefill_flops(model, batch, prompt_len),
    )


def prefill_estimate(model, batch: int, prompt_len: int, peak_flops: float) -> str:
    """A long prompt's prefill can take minutes per run on a CPU (attention grows with the
    square of the prompt): its FLOPs and the seconds one run takes at the measured matmul
    peak (a floor), so a progress bar that stands still for long says why. Empty when short."""
    flops = cost.prefill_flops(model, batch, prompt_len)
    seconds = flops / peak_flops
    if seconds < 10:
        return ""
    return f" ({flops / 1e12:,.1f} TFLOP: at least {seconds / 60:,.1f} min a run at the peak)"


def decode_estimate(session: Session, params, roofs: Roofs, batch: int, steps: int) -> str:
    """Many decode steps a call (decode_steps=) can take minutes per batch: each way of
    multiplying the weights is timed over at least three calls of `steps` steps after the
    warm-up, and each step reads the weights at most at the measured memory roof (a floor:
    the cache is not counted), so a progress bar that stands still for long says why. Empty
    when short."""
    if not roofs.bandwidth > 0:  # no roof to judge by: nothing said
        return ""
    ways = len(matmul_candidates(session, params))
    step_s = weight_read_bytes(params, session.cfg.model, batch) / roofs.bandwidth
    seconds = ways * (WARM_STEPS + 3 * steps) * step_s
    if seconds < 10:
        return ""
    each = f" × {ways} ways to multiply" if ways > 1 else ""
    return (
        f" (3 calls of {steps:,} steps{each}: at least {seconds / 60:,.1f} min at the memory roof)"
    )

"""The whole serving study: what to measure (Plan), the checks that refuse it in one line
before anything is allocated, the sweep (roofs, prefill, decode float and int8, int8's
error, the PyTorch peer, the bandwidths again) and the figures derived from it."""

import dataclasses
import math

import jax

from lab import quant
from lab.errors import ConfigError
from lab.measure import cost, memory
from lab.measure.serving import DecodePoint, PeerPoint, PrefillPoint, Roofs, Study, Summary
from lab.session import Session
from lab.studies.serving.int8 import ERROR_STEPS, int8_error
from lab.studies.serving.points import (
    decode_estimate,
    fastest_point,
    prefill_estimate,
    prefill_point,
)
from lab.studies.serving.roofs import against, best_roofs, measure_again, measure_roofs
from lab.studies.serving.timed import WARM_STEPS, random_prompts


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to measure (lab.serve's options without the presentation)."""

    batches: tuple[int, ...]
    prefill_batches: tuple[int, ...]
    prompt_len: int
    steps: int
    budget_s: float
    int8: bool
    seed: int = 0
    context: int = 0  # cache slots per sequence; 0 = prompt_len + WARM_STEPS + steps

    def slots(self) -> int:
        return self.context or self.prompt_len + WARM_STEPS + self.steps


def memory_needed(model, plan: Plan) -> dict[str, float]:
    """Bytes the study holds at its peak, by part (cost.serving_peak_bytes): the weights and
    the larger of the largest decode batch's cache filled by its prefill, and the largest
    prefill batch's own cache, logits and temporaries (the study runs one point at a time)."""
    return cost.serving_peak_bytes(
        model,
        decode_batch=max(plan.batches),
        slots=plan.slots(),
        prefill_batch=max(plan.prefill_batches),
        prompt_len=plan.prompt_len,
    )


def check_memory(session: Session, plan: Plan) -> None:
    """On CPU, a study that cannot fit this machine's memory is one line before anything is
    allocated (a long prompt at a big batch would otherwise swap or run for hours). The
    limit is 80% of the memory the host has available now, not its total: other work on a
    shared host holds the rest."""
    total = memory.host_available_bytes()
    if session.info.backend != "cpu" or not total:
        return
    parts = memory_needed(session.cfg.model, plan)
    need = sum(parts.values())
    if need > 0.8 * total:
        biggest = max(parts, key=parts.get)
        at = (
            f"decoding batch {max(plan.batches)}"
            if "cache" in parts
            else f"prefilling batch {max(plan.prefill_batches)}"
        )
        raise ConfigError(
            f"prompt_len={plan.prompt_len}, {plan.slots():,} cache slots, batches up to "
            f"{max(plan.batches)}, prefill_batches up to {max(plan.prefill_batches)}: needs "
            f"{need / 2**30:,.1f} GiB {at} ({biggest} {parts[biggest] / 2**30:,.1f} GiB), "
            "more than "
            f"80% of this machine's {total / 2**30:,.1f} GiB available; "
            + ("give a smaller context=" if plan.context else "shorten the prompt")
            + ", take fewer or smaller batches, or plan it for an accelerator with target="
        )


def check_plan(plan: Plan) -> None:
    """Each batch size once, and the prompt and the steps timed fit the cache asked for: one
    line, before any weights are made or loaded."""
    for key, sizes in (("batches", plan.batches), ("prefill_batches", plan.prefill_batches)):
        twice = sorted({b for b in sizes if sizes.count(b) > 1})
        if twice:
            raise ConfigError(
                f"{key}={','.join(map(str, sizes))}: batch {twice[0]} is given twice (each "
                "size is measured once)"
            )
    need = plan.prompt_len + WARM_STEPS + plan.steps
    if need > plan.slots():
        raise ConfigError(
            f"context={plan.context}: prompt_len={plan.prompt_len} plus decode_steps="
            f"{plan.steps} and {WARM_STEPS} warm-up steps need {need} cache slots; raise "
            "context= (0 sizes the cache to fit) or shorten prompt_len= or decode_steps="
        )


def measure(session: Session, params, plan: Plan, *, progress=None, finished=None) -> Study:
    """The whole study: roofs, prefill, decode over the batch sweep (float, then int8 weights
    and cache at the smallest and largest batch), int8 error, the bandwidths measured again.
    `progress(label)` is called before each point and each batch of the PyTorch peer (a
    progress bar's advance: `ticks` counts them). `session`
    decodes: resolved for decoding with the plan's batches (weights.for_decoding), which
    split over its mesh."""
    check_memory(session, plan)
    check_plan(plan)
    tick = progress or (lambda label: None)
    model = session.cfg.model
    tick("roofs: copy bandwidth and matmul peak")
    roofs = measure_roofs(model.dtype, budget_s=plan.budget_s)
    # `finished` (a dict, or None) holds the points as they are measured: what a stop keeps
    done = finished if finished is not None else {}
    prefill, points, points_i8 = [], [], []
    done.update(roofs=roofs, prefill=prefill, decode=points, decode_int8=points_i8)
    for b in plan.prefill_batches:
        tick(f"prefill batch {b}{prefill_estimate(model, b, plan.prompt_len, roofs.peak_flops)}")
        prefill.append(
            prefill_point(
                session, params, batch=b, prompt_len=plan.prompt_len, budget_s=plan.budget_s
            )
        )
    kw = dict(
        prompt_len=plan.prompt_len, steps=plan.steps, budget_s=plan.budget_s, max_len=plan.slots()
    )
    for b in plan.batches:
        tick(f"decode batch {b}{decode_estimate(session, params, roofs, b, plan.steps)}")
        points.append(fastest_point(session, params, roofs, batch=b, int8_cache=False, **kw))
    torch, peer_note = torch_peer(session, params, plan, points, tick)
    error = None
    if plan.int8:
        params_i8 = jax.jit(quant.quantize_params)(params)
        for b in sorted({min(plan.batches), max(plan.batches)}):
            later = decode_estimate(session, params_i8, roofs, b, plan.steps)
            tick(f"decode batch {b}, int8 weights and cache{later}")
            points_i8.append(
                fastest_point(session, params_i8, roofs, batch=b, int8_cache=True, **kw)
            )
        tick("int8 error on the bundled text")
        timed = dict.fromkeys(m for p in points_i8 for m, _ in p.matmuls)  # every one shown
        error = int8_error(
            session,
            params,
            params_i8,
            prompt_len=plan.prompt_len,
            steps=ERROR_STEPS,
            matmuls=tuple(timed),
        )
        del params_i8  # freed before the copy buffers below are allocated (an accelerator's HBM)
    tick("roofs again: copy bandwidth and read stream after the sweep")
    roofs = measure_again(roofs, budget_s=plan.budget_s)
    roofs = best_roofs(roofs, points + points_i8)
    points, points_i8 = against(points, roofs), against(points_i8, roofs)
    return Study(
        roofs=roofs,
        prefill=tuple(prefill),
        decode=points,
        decode_int8=points_i8,
        int8=error,
        summary=summarise(roofs, prefill, points, points_i8),
        torch=tuple(torch),
        peer_note=peer_note,
    )


def peer_skipped(session: Session) -> str | None:
    """Why the PyTorch decoder is not timed beside the lab's (one line), "" where it is not
    and nothing need be said (not on CPU), None where it is timed."""
    from lab.studies import torch_decoder  # beside this study; only serving times the peer

    if session.info.backend != "cpu":
        return ""
    if not torch_decoder.available():
        return "PyTorch is not installed, so its decoder is skipped"
    return torch_decoder.unsupported(session.cfg.model)


def ticks(session: Session, plan: Plan) -> int:
    """How many times measure() calls `progress` to advance: one per point and peer batch."""
    peer = len(plan.batches) if peer_skipped(session) is None else 0
    return len(plan.batches) + len(plan.prefill_batches) + 1 + (3 if plan.int8 else 0) + peer


def torch_peer(
    session: Session, params, plan: Plan, points: list[DecodePoint], tick=None
) -> tuple[list[PeerPoint], str]:
    """The PyTorch decoder of the same shape and weights (lab/studies/torch_decoder.py) timed
    at every decode batch within budget= each, beside the lab's float points, and a note:
    none where PyTorch is not installed, the decoder is not on CPU, or the model has what the
    peer does not (sliding windows, a soft-cap, float16: it would time another model), the
    note saying why. A peer that fails keeps the batches it timed and the note says where it
    stopped: the lab's own figures are never lost to it. `tick(label)` before each batch."""
    from lab.studies import torch_decoder

    if (why := peer_skipped(session)) is not None:
        return [], why
    host = jax.device_get(params)
    rows = []
    for p in points:
        if tick:
            tick(f"PyTorch peer batch {p.batch}")
        prompts = random_prompts(session.cfg.model.vocab_size, p.batch, plan.prompt_len, p.batch)
        try:
            r = torch_decoder.time_decode(
                session.cfg.model, host, prompts, steps=plan.steps, budget_s=plan.budget_s
            )
        except Exception as e:  # the peer is a comparison: its failure costs only its rows
            first = (str(e).strip().splitlines() or [""])[0]  # the note is one line
            return (
                rows,
                f"the PyTorch decoder failed at batch {p.batch} ({type(e).__name__}: {first})",
            )
        rows.append(PeerPoint(**r, lab_over_torch=p.tokens_per_s / r["tokens_per_s"]))
    return rows, ""


def summarise(
    roofs: Roofs,
    prefill: list[PrefillPoint],
    points: list[DecodePoint],
    points_i8: list[DecodePoint],
) -> Summary:
    """The derived figures: the ridge and critical batch (from the smallest float batch's
    bytes and FLOPs per sequence), the best rates, the output/input price ratio on this
    device and int8's speed-up at each batch it was measured at."""
    one = min(points, key=lambda r: r.batch)
    per_seq_cache = one.cache_bytes / one.batch
    per_seq_flops = one.flops / one.batch
    best_decode = max(points, key=lambda r: r.tokens_per_s)
    best_prefill = max(prefill, key=lambda r: r.tokens_per_s, default=None)
    float_at: dict[int, DecodePoint] = {}
    for p in points:  # the first float point at each batch
        float_at.setdefault(p.batch, p)
    s = Summary(
        ridge=roofs.ridge,
        critical_batch=cost.critical_batch(
            one.weight_bytes, per_seq_flops, per_seq_cache, roofs.ridge
        ),
        critical_batch_sensitivity=cost.critical_batch_sensitivity(
            per_seq_flops, per_seq_cache, roofs.ridge
        ),
        cache_intensity=per_seq_flops / per_seq_cache if per_seq_cache else math.inf,
        batch1_roof_share=one.memory_roof_share,
        batch1_intensity=one.intensity,
        best_decode=best_decode,
        smallest=one,
        int8_speedup=tuple(
            (p.batch, p.tokens_per_s / float_at[p.batch].tokens_per_s) for p in points_i8
        ),
    )
    if best_prefill is None:
        return s
    # self-hosted price ∝ device time per token: output over input at the best rates
    return dataclasses.replace(
        s,
        best_prefill=best_prefill,
        output_input_cost_ratio=best_prefill.tokens_per_s / best_decode.tokens_per_s,
        output_input_cost_ratio_batch1=best_prefill.tokens_per_s / one.tokens_per_s,
    )

"""The serving study's figures as lab.measure records, built from its types: one record per
figure, `config` (model, mesh, options) on every one. The ledger, the experiments and the
decode plot read these records by their keys, so the fields stay as they are."""

import math

from lab.measure import records
from lab.measure.serving import PlanRow, Study


def to_records(out: Study, config: dict) -> list[dict]:
    """One record per figure of `measure` (series decode_batch / prefill_batch for the
    plots)."""
    roofs, s = out.roofs, out.summary
    recs = [
        records.make_record("copy bandwidth", roofs.copy["bytes_per_s"], "B/s", **config),
        *(
            [records.make_record("read bandwidth", roofs.read["bytes_per_s"], "B/s", **config)]
            if roofs.read
            else []
        ),
        *(  # the same two measured again after the sweep (the host's bandwidth moves)
            records.make_record(
                f"{what} bandwidth after the sweep", r["bytes_per_s"], "B/s", **config
            )
            for what, r in (("copy", roofs.copy_after), ("read", roofs.read_after))
            if r
        ),
        records.make_record(
            "memory roof", roofs.bandwidth, "B/s", label="derived", note=roofs.how, **config
        ),
        records.make_record(
            f"matmul peak ({roofs.peak_name})", roofs.peak_flops, "FLOP/s", **config
        ),
        records.make_record("ridge point", roofs.ridge, "FLOP/B", label="derived", **config),
        records.make_record(
            "decode critical batch",
            s.critical_batch_or_none,
            "sequences",
            label="derived",
            **{
                **config,
                "metric": "decode_critical_batch",
                # % it moves per 1% of the ridge: an estimate past cost.ILL_DETERMINED
                "sensitivity": None
                if math.isinf(s.critical_batch_sensitivity)
                else s.critical_batch_sensitivity,
            },
        ),
    ]
    return (
        recs
        + _point_records(out.prefill, out.decode + out.decode_int8, config, roofs.peak_flops)
        + _rest(out, config)
    )


def finished_records(done: dict, config: dict) -> list[dict]:
    """The records of a study stopped part-way (`measure`'s `finished`): the copy bandwidth
    and the points measured so far, marked partial; nothing derived from the whole sweep."""
    config = {**config, "partial": True}
    recs = []
    if done.get("roofs") is not None:
        copy = done["roofs"].copy["bytes_per_s"]
        recs.append(records.make_record("copy bandwidth", copy, "B/s", **config))
    decode = list(done.get("decode", ())) + list(done.get("decode_int8", ()))
    peak = done["roofs"].peak_flops if done.get("roofs") is not None else None
    return recs + _point_records(done.get("prefill", ()), decode, config, peak)


def _point_records(prefill, decode, config: dict, peak_flops: float | None) -> list[dict]:
    """The prefill and decode points' records; a decode record says what bounds its step
    (`bound`: DecodePoint.bound) where the matmul peak is known."""
    recs = []
    for p in prefill:
        recs.append(
            records.make_record(
                f"prefill tokens/s, batch {p.batch}",
                p.tokens_per_s,
                "tokens/s",
                series="prefill_batch",
                **{**config, **p.record_config()},
            )
        )
    for p in decode:
        kind = "int8" if p.int8_cache else "float"
        recs.append(
            records.make_record(
                f"decode tokens/s, batch {p.batch}, {kind}",
                p.tokens_per_s,
                "tokens/s",
                series="decode_batch",
                int8=p.int8_cache,
                **{**config, **p.record_config()},
                **({"bound": p.bound(peak_flops)} if peak_flops else {}),
            )
        )
    return recs


def _rest(out: Study, config: dict) -> list[dict]:
    s, recs = out.summary, []
    # why the peer stopped, where it did (a failure at a later batch, fewer steps in budget)
    note = {"peer_note": out.peer_note} if out.peer_note else {}
    for r in out.torch:
        recs.append(
            records.make_record(
                f"PyTorch decoder tokens/s, batch {r.batch}, float",
                r.tokens_per_s,
                "tokens/s",
                peer="torch",
                **{**config, **r.record_config(), **note},
            )
        )
    if s.output_input_cost_ratio is not None:
        recs.append(
            records.make_record(
                "output / input token cost (prefill tokens/s over decode tokens/s, best rates)",
                s.output_input_cost_ratio,
                "×",
                label="derived",
                **config,
            )
        )
    if out.int8:
        e = out.int8
        for m in e.matmuls:  # each int8 matmul whose speed was measured, named
            c = {**config, **e.record_config(m.matmul)}
            for what, value in (
                ("int8 weights: loss change on the bundled text", e.loss_change(m.matmul)),
                ("int8 weights + cache: decode logits relative RMS error", m.logits_rel_rms),
            ):
                recs.append(
                    records.make_record(f"{what}, {m.matmul}", value, "", label="derived", **c)
                )
        recs.append(
            records.make_record(
                "int8 weights: bytes saved",
                e.bytes_saved,
                "B",
                label="derived",
                **{**config, **e.record_config()},
            )
        )
    return recs


def plan_records(rows: list[PlanRow], config: dict) -> list[dict]:
    """One record per compiled serving plan: memory per device, compiled, not run, with the
    calculator's figure and the chip's capacity beside it."""
    out = []
    for r in rows:
        kind = "int8" if r.int8 else "float"
        out.append(
            records.make_record(
                f"decode step memory per device, {kind} weights and cache",
                r.compiled_bytes,
                "B",
                label="compiled, not run",
                **{**config, **r.record_config()},
                compiled_memory=r.compiled,
            )
        )
    return out

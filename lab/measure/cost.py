"""FLOPs and bytes: what the compiler counted, and the analytic formulas with their conventions.

One FLOP is one floating-point add or multiply, so a fused multiply-add counts 2 and a matmul
of (M×K)·(K×N) is 2·M·N·K. XLA's cost analysis uses the same convention, which is why the
tests can hold the two against each other. Everything here is per *step of work asked for*;
divide by a measured time to get FLOP/s.
"""

import math

import jax.numpy as jnp

from lab.measure import hlo, memory

# Keys of XLA's per-program cost dict that are totals (the rest are per-operand details
# such as "bytes accessed0{}").
_TOTAL_KEYS = ("flops", "bytes accessed", "transcendentals", "optimal_seconds", "utilization")


def compiled_cost(compiled) -> dict | None:
    """{"flops", "bytes accessed", …} per device of one call of a compiled program, or None.

    XLA's cost analysis, with every loop counted as many times as it runs: XLA walks a while
    loop's body once, so a scanned model, a pipeline's tick loop or an accumulation scan would
    come out short by the trip count; the body's share is added again for each further trip,
    counted from the optimized HLO as XLA counts it (lab/measure/hlo.py). Where the backend
    gives no cost analysis (XLA:GPU ahead of time) or a figure of -1 (XLA:GPU on the device,
    whose cost analysis cannot count a cuBLAS call), the HLO walk alone gives the figures.

    Besides XLA's totals the dict says how it was counted: "source", "xla_flops" and
    "xla_bytes accessed" (XLA's own figures, each loop body once), "loops" ([body, trip count]
    of every while loop) and "unknown_loops" (loops whose trip count the program does not
    state, counted once: the figures are then a lower bound). The compiler's own time estimate
    ("optimal_seconds") is dropped where a loop repeats, since it too counts each body once.
    Under SPMD the compiled program is the one each device runs, so these are per-device
    figures. Older JAX returns a list with one dict per program, newer a dict; both handled.
    """
    try:
        raw = compiled.cost_analysis()
    except (NotImplementedError, RuntimeError):  # backends without it (XlaRuntimeError is a
        raw = None  # RuntimeError); anything else is a bug and should surface
    if isinstance(raw, list | tuple):
        raw = raw[0] if raw else None
    program = compiled_program(compiled)
    # XLA writes -1 for a figure it cannot count (XLA:GPU on the device, for a program that is
    # one cuBLAS call): unknown, not a count. Then the HLO walk counts all three figures, so
    # they come from one account of the program.
    counted = ("flops", "bytes accessed", "transcendentals")
    unknown = bool(raw) and any(raw.get(k, 0) < 0 for k in counted)
    if (not raw or unknown) and program is None:
        return None
    if not raw or unknown:
        walk = hlo.total_cost(program)
        out = {"flops": walk.flops, "bytes accessed": walk.bytes}
        out["transcendentals"] = walk.transcendentals
        out["source"] = (
            "HLO walk (the compiler's cost analysis says -1: unknown)"
            if unknown
            else "HLO walk (the compiler gives no cost analysis)"
        )
    else:
        out = {k: float(v) for k, v in raw.items() if k in _TOTAL_KEYS}
        out.setdefault("flops", None)
        out.setdefault("bytes accessed", None)
        out["source"] = "XLA cost analysis"
        extra = hlo.repeated_cost(program) if program else hlo.Cost()
        if extra.flops or extra.bytes:
            out["xla_flops"], out["xla_bytes accessed"] = out["flops"], out["bytes accessed"]
            out["flops"] = (out["flops"] or 0.0) + extra.flops
            out["bytes accessed"] = (out["bytes accessed"] or 0.0) + extra.bytes
            if "transcendentals" in out:
                out["transcendentals"] += extra.transcendentals
            out.pop("optimal_seconds", None)
            out["source"] = "XLA cost analysis, each loop body × its trip count"
    if program is not None:
        out["loops"] = [[body, n] for body, n in program.loops]
        out["unknown_loops"] = len(program.unknown_loops)
    return out


# the source of a time that is the compiler's own estimate (plans, reports and records key on it)
COMPILER_ESTIMATE = "compiler estimate"


def estimate_with_error(source: str, error: str | None) -> str:
    """A time's source as said beside it: the compiler's own estimate with what is known of
    its error after it ('compiler estimate: not checked against …'); any other source (the
    step-time model's time, a roofline floor) already says its error, so it stands alone."""
    if source == COMPILER_ESTIMATE and error:
        return f"{source}: {error}"
    return source


def unchecked_estimate(device_kind: str) -> str:
    """What is known of the error of a compiler's own time estimate ('optimal_seconds') on
    `device_kind`: the lab holds no measurement there to check its cost model against (the
    step-time model's error is measured; this one's is not), so the error is unknown."""
    if device_kind.upper().startswith("TPU"):
        return "not checked against any TPU measurement: XLA:TPU's own cost model"
    on = device_kind or "the target"
    return f"not checked against any measurement on {on}: XLA's own cost model"


def compiled_program(compiled):
    """The optimized HLO of a compiled program, parsed; None where it cannot be printed."""
    try:
        text = compiled.as_text()
    except (NotImplementedError, RuntimeError, AttributeError):
        return None
    return hlo.parse(text) if text else None


def lower_bound_note(c: dict | None) -> str:
    """'' or a few words saying the figures are a lower bound (a loop of unknown trip count)."""
    n = (c or {}).get("unknown_loops") or 0
    return f" (at least: {n} loop(s) of unknown trip count counted once)" if n else ""


def matmul_flops(m: int, n: int, k: int, *, batch: int = 1) -> int:
    """2·M·N·K (one multiply and one add per term) for (M×K)·(K×N), times `batch`."""
    return 2 * batch * m * n * k


def matmul_bytes(m: int, n: int, k: int, itemsize: int, *, batch: int = 1) -> int:
    """Minimum HBM traffic of a matmul: read both inputs once, write the output once."""
    return batch * itemsize * (m * k + k * n + m * n)


def visible_pairs(sq: int, sk: int, *, causal: bool) -> float:
    """(query, key) pairs one head of one sequence computes: Sq·Sk, or causal with the mask
    aligned bottom-right as every attention kernel here aligns it (lab.kernels.attention.common:
    query i sees key j iff j <= i + Sk - Sq) the exact count Σ_i min(Sk, max(0, i + 1 + Sk -
    Sq)). With m = min(Sq, Sk) rows that see a key, that is m·(Sk - m) + m·(m + 1)/2: Sq·Sk -
    Sq·(Sq - 1)/2 when Sq <= Sk (a single query sees every key), Sk·(Sk + 1)/2 when Sq > Sk
    (the first Sq - Sk rows see none)."""
    if not causal:
        return float(sq) * sk
    m = min(sq, sk)
    return float(m) * (sk - m) + m * (m + 1) / 2


def attention_flops(
    b: int, h: int, sq: int, sk: int, d: int, *, causal: bool, backward: bool = False
) -> float:
    """Matmul FLOPs of softmax(Q·Kᵀ)·V over B batch, H heads, Sq queries, Sk keys, D head dim.

    Forward: Q·Kᵀ plus P·V, 2·D each per (query, key) pair: 4·B·H·D·`visible_pairs`, i.e.
    4·B·H·Sq·Sk·D in full. Causal counts only the pairs the bottom-right aligned mask leaves,
    the work a kernel that skips masked blocks does (a naive kernel computes them all; count
    it with causal=False): for Sq == Sk that is ½·(1 + 1/S) of the full count (the
    FlashAttention benchmarks' ½ to within 1/S), and a single query against Sk keys counts
    all Sk. Backward (returned alone, not added to the forward): 2.5× forward, the
    FlashAttention-2 convention — five matmuls (Q·Kᵀ recomputed, dV, dP, dQ, dK) against the
    forward's two. Softmax exp/max/sum are not counted.
    """
    fwd = 4.0 * b * h * d * visible_pairs(sq, sk, causal=causal)
    return 2.5 * fwd if backward else fwd


def visible_keys(seq_len: int, window: int | None = None) -> float:
    """Keys a query sees on average in a causal sequence of seq_len: (seq_len + 1) / 2, or
    with a sliding window of W (itself and the W - 1 before it) the mean of min(i + 1, W)."""
    W = seq_len if window is None else min(window, seq_len)
    # queries 0 … W-1 see i + 1 keys; the seq_len - W after them see W each
    return (W * (W + 1) / 2 + (seq_len - W) * W) / seq_len


def packed_visible_keys(segment_ids_BxL, window: int | None = None) -> float:
    """Keys a query sees on average in packed rows [B, L] of segment ids (a document's ids
    contiguous, a new id where one starts): those of its own document up to itself (causal
    within it), at most `window` of them; the mean over every token of the rows. A query at
    position p of its document sees min(p + 1, window) keys, so a document of n tokens
    contributes n·visible_keys(n, window)."""
    import numpy as np

    ids_BxL = np.asarray(segment_ids_BxL)
    if ids_BxL.size == 0:
        return 0.0
    B, L = ids_BxL.shape
    start_BxL = np.ones((B, L), bool)
    start_BxL[:, 1:] = ids_BxL[:, 1:] != ids_BxL[:, :-1]
    pos_L = np.arange(L)
    # each token's document start: the last start at or before it, per row
    first_BxL = np.maximum.accumulate(np.where(start_BxL, pos_L, 0), axis=1)
    keys_BxL = pos_L - first_BxL + 1
    if window is not None:
        keys_BxL = np.minimum(keys_BxL, window)
    return float(keys_BxL.mean())


def transformer_flops_per_token(
    n_params_nonembed: int,
    n_layers: int,
    seq_len: int,
    d_model: int,
    *,
    training: bool = True,
    keys_per_layer=None,
) -> float:
    """Model FLOPs per token, the PaLM convention (Chowdhery et al. 2022, appendix B).

    Training: 6·N + 12·n_layers·seq_len·d_model. 6·N: every weight does a multiply-add per
    token in the forward (2·N) and two in the backward (4·N, gradients of activations and of
    weights). Attention adds Q·Kᵀ and P·V per layer, 2·2·seq_len·d_model per token forward,
    ×3 with the backward = 12·L·S·D. The causal mask is *not* halved (as in PaLM): this is the
    work a plain implementation does, and it keeps MFU comparable with published figures.
    Inference (training=False): the forward third, 2·N + 4·L·S·D. Rematerialisation is not
    counted: recomputation is overhead, not model FLOPs (that is the "M" in MFU).
    N excludes the input embedding table (a lookup, no FLOPs); an output head counts.
    `keys_per_layer`: the keys a query sees in each layer (e.g. `visible_keys`, causal or
    windowed), in place of seq_len: only the unmasked (query, key) pairs counted.
    """
    keys = n_layers * seq_len if keys_per_layer is None else sum(keys_per_layer)
    attention = 4 * keys * d_model
    per_token = 2 * n_params_nonembed + attention
    return 3.0 * per_token if training else float(per_token)


def gpt3_training_flops(n_params: float, n_tokens: float) -> float:
    """C = 6·N·D for N parameters trained on D tokens (Kaplan et al. 2020; attention omitted).

    GPT-3 175B on 300B tokens: 6 × 175e9 × 300e9 = 3.15e23 FLOPs.
    """
    return 6.0 * n_params * n_tokens


# ------------------------------------------------------------------------------- serving
# What a decode step of the lab's transformer must move and compute (MaxText's inference
# microbenchmark, the scaling book's inference chapter); `model` is a ModelConfig.


def nonembed_params(model) -> int:
    """Parameters that do FLOPs: all but an untied input embedding table (a lookup)."""
    embed = model.vocab_size * model.d_model
    return memory.lab_param_count(model) - (0 if model.tie_embeddings else embed)


def weight_read_bytes(weight_bytes: int, batch: int, *, table_bytes: int = 0, table_rows=1):
    """Bytes of weights one forward step of `batch` sequences reads: all `weight_bytes` but
    an untied embedding table's `table_bytes`, plus the B rows a lookup takes from it. A tied
    table (table_bytes 0) is read whole: it is also the head."""
    return int(weight_bytes - table_bytes + batch * (table_bytes // table_rows))


def step_flops(model, batch: int, slots: int, windows=None) -> float:
    """B · (2·N + 4·layers·S·d_model): one token per sequence against S cache slots; with
    `windows` (one per layer, None for a global one), a windowed layer's query sees
    min(S, window) of them, as the kernels that stop at each length compute."""
    keys = None if windows is None else [min(slots, w or slots) for w in windows]
    return batch * transformer_flops_per_token(
        nonembed_params(model),
        model.n_layers,
        slots,
        model.d_model,
        training=False,
        keys_per_layer=keys,
    )


def prefill_flops(model, batch: int, prompt_len: int) -> float:
    """B · P · (2·(N − V·D) + 4·layers·P·d_model) + B · 2·V·D: every prompt token through the
    blocks against the whole prompt (the causal mask not halved, as
    transformer_flops_per_token counts it), and the head (V·D, tied or not) on each
    sequence's last token only, the one whose logits a prefill returns."""
    head = model.vocab_size * model.d_model
    blocks = transformer_flops_per_token(
        nonembed_params(model) - head, model.n_layers, prompt_len, model.d_model, training=False
    )
    return batch * (prompt_len * blocks + 2.0 * head)


def critical_batch(weight_bytes: float, flops_per_seq: float, cache_per_seq: float, ridge):
    """The batch where a decode step's intensity reaches the ridge, or inf where the cache's
    bytes grow as fast as the FLOPs (attention-dominated: never compute-bound).

    Intensity B·f / (W + B·c) = ridge solves to B* = ridge · W / (f − ridge · c), with W the
    weight bytes, f the FLOPs and c the cache bytes per sequence."""
    denominator = flops_per_seq - ridge * cache_per_seq
    return math.inf if denominator <= 0 else ridge * weight_bytes / denominator


# Past this sensitivity (the critical batch's % change per 1% of the ridge) the figure is an
# estimate, and the report says so: the roofs of a shared host move by 10% and more within a
# run (copy before and after the sweep), which would move it by 30% and more.
ILL_DETERMINED = 3.0


def critical_batch_sensitivity(flops_per_seq: float, cache_per_seq: float, ridge) -> float:
    """How far the critical batch moves, in %, per 1% change of the ridge (of either roof):
    d ln B* / d ln ridge = f / (f − ridge · c); inf where there is no critical batch.

    Near 1 where the weights dominate the bytes (B* then scales with the ridge); large where
    decode's intensity can only approach f / c and f / c is close to the ridge, so a few %
    of a roof's noise moves B* many times over."""
    denominator = flops_per_seq - ridge * cache_per_seq
    return math.inf if denominator <= 0 else flops_per_seq / denominator


def serving_peak_bytes(
    model, *, decode_batch: int, slots: int, prefill_batch: int, prompt_len: int
) -> dict[str, float]:
    """Bytes a serving study holds at its peak, by part. The study measures its prefill
    points and its decode points one at a time, so the peak is the float32 weights plus the
    larger of two phases:

    - decode: the KV cache of `decode_batch` sequences (keys and values of every layer, every
      one of `slots`, in the compute dtype), filled by a prefill of `decode_batch` prompts
      whose logits and temporaries sit beside it;
    - prefill: the prefill's own cache (`prefill_batch` × `prompt_len` slots), its logits and
      temporaries.

    Logits are [B, vocab] float32 (the last token's only); temporaries B·P·(3·d_ff + 2·d_model)
    float32, the MLP's gate, up and their product with the residual stream and its norm beside
    them. That last term was fitted to XLA's buffer assignment of the CPU prefill
    (memory_analysis' temporaries came to 3.3-3.4·d_ff floats per token at model=tiny, small
    and base; tests/test_serve.py holds both phases to the compiled programs')."""
    itemsize = jnp.dtype(model.dtype).itemsize
    per_slot = 2 * model.n_layers * model.n_kv_heads * model.head_dim * itemsize
    weights = float(nonembed_params(model) + model.vocab_size * model.d_model) * 4

    def filled(batch: int) -> dict[str, float]:  # a prefill of `batch` prompts: beside its cache
        return {
            "prefill logits": 4.0 * batch * model.vocab_size,
            "prefill activations": 4.0 * batch * prompt_len * (3 * model.d_ff + 2 * model.d_model),
        }

    decoding = {"cache": float(per_slot * decode_batch * slots), **filled(decode_batch)}
    prefilling = {"prefill cache": float(per_slot * prefill_batch * prompt_len)}
    prefilling.update(filled(prefill_batch))
    phase = max(decoding, prefilling, key=lambda parts: sum(parts.values()))
    return {"weights": weights, **phase}


def arithmetic_intensity(flops: float, bytes_accessed: float) -> float:
    """FLOPs per byte moved: where an op sits on the roofline's x axis."""
    return flops / bytes_accessed if bytes_accessed else math.inf


def bus_bytes(kind: str, buffer_bytes: float, group_size: int) -> float:
    """Per-device bytes on the wire for one collective of buffer V over W devices, in the
    nccl-tests "bus bytes" convention (a bandwidth-optimal ring): all-reduce 2·V·(W-1)/W;
    all-gather (V = output), reduce-scatter (V = input), all-to-all V·(W-1)/W; a
    collective-permute sends its whole buffer once."""
    W = group_size
    if kind == "collective-permute":
        return float(buffer_bytes)
    if W <= 1:
        return 0.0
    factor = 2.0 if kind == "all-reduce" else 1.0
    return factor * buffer_bytes * (W - 1) / W

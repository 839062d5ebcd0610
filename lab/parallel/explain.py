"""A sharding strategy explained by the compiler: per-device bytes and collectives, vs analytic.

Two tables for one compiled train step. Memory: the per-device bytes of parameters,
gradients and optimizer state (exact, from the shardings), beside the training-memory
calculator (lab.measure.memory) and XLA's own buffer assignment (`memory_analysis`).
Communication: the collectives read from the compiled HLO (lab.parallel.collectives_hlo),
grouped by role, beside the analytic figure (ring algorithm, bytes each device sends):

    all-gather / reduce-scatter of V over W devices   V·(W-1)/W
    all-reduce of V over W devices                    2·V·(W-1)/W

Roles and what the analytic model assumes (scaling-book style, per step):
  grad reduction    every device's gradient summed over the batch axes. DP: one all-reduce
                    of all gradients. FSDP: reduce-scatter over the weight-shard axes, then
                    all-reduce of the shard over the remaining batch axes. A tied embedding
                    has two uses whose partial gradients XLA reduces separately, so it counts
                    twice. The CPU compiler has no reduce-scatter pass: there the
                    reduce-scatter runs as an all-reduce plus a local slice (2× the bytes),
                    and the analytic figure says so. accumulate=K: once per microbatch,
                    except over the axes that split the batch and no weight, where the K
                    microbatches' sum is reduced once (lab.train.unreduced_axes). CP: the
                    point is one all-reduce over the batch and sequence axes together; XLA
                    reduces over each axis in turn (two all-reduces of the whole gradient,
                    2·V·Σ(Wa-1)/Wa: 1.33× on 2×2), the range's high end.
  param all-gather  FSDP gathers each weight once in the forward (a tied embedding's
                    lookup and head read the same gathered table). ZeRO-3 gathers again in
                    the backward; XLA instead keeps the gathered weight live when nothing
                    forces it out, and re-gathers only weights of rematerialised or scanned
                    blocks (a scan's backward loop saves the sharded weight, not the
                    gathered one). The expectation is that rule; the range runs from
                    forward-only to forward+backward for everything.
  activation        tensor parallel (Megatron): an all-reduce of B·L·D activations after each
  all-reduce        row-parallel matmul (attention out, MLP down: 2 per layer forward), after
                    the vocab-parallel embedding lookup, and in the backward one per
                    column-parallel matmul's input gradient (wq, wk, wv, w_gate, w_up: 5 per
                    layer; Megatron's `g` operator sums those partials first and sends 2),
                    one for the vocab-parallel head, plus three B·L float32 reductions of the
                    sharded softmax. remat=full recomputes the forward ones a block's
                    backward needs (attention out; not the block's last output).
  stage permute     a pipeline (strategy=pp*): one microbatch's activations sent to the next
                    stage at every tick of the forward and back at every tick of the backward,
                    ticks = repeats·M + P - 1 each way, once per accumulation microbatch
                    (lab/parallel/pipeline_hlo.py). Block
                    parameters split over `stage` are never gathered and their gradients are
                    reduced over the data axes only; tables split over `stage` along the
                    vocabulary are gathered per use, as FSDP does.
  stage weight      pp+fsdp: each stage gathers its block weights over fsdp once per step,
  gather / grad     before the tick loop (one all-gather per weight, V·(W-1)/W), and
  reduce-scatter    reduce-scatters their gradient once after it; the rest of their gradient
                    reduction is an all-reduce of the shard over the data axes. Not once per
                    layer per tick, as XLA's automatic gathers inside the loop would be.
Each figure assumes an element type (the compute dtype for activations, the parameter dtype
for weights and their gradients); where the compiled collectives carry another, the row names
both, since the bytes differ by the ratio of their sizes (XLA:CPU runs 16-bit collectives in
float32; XLA:TPU may sum float32 weights' gradients in bfloat16 before the cast back).
"""

import dataclasses
import math

import jax
import numpy as np

from lab.measure import memory
from lab.measure.memory import MemorySplit
from lab.names import BATCH, EMBED, HEADS, HOST_MEMORY, LAYERS, SEQ, STAGE, VOCAB
from lab.parallel import collectives_hlo, pipeline_hlo

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Expected:
    """What one role should move per step, per device."""

    role: str
    kind: str  # the collective kind expected on this backend
    axes: tuple[str, ...]
    bus_bytes: float  # point estimate (the rule in the module docstring)
    low: float  # the least the strategy can move (FSDP: forward gathers only)
    high: float  # the textbook's most (FSDP: ZeRO-3, every weight gathered again backward)
    formula: str  # the arithmetic, for the reader
    dtype: str = ""  # HLO element type the figure assumes for most of its bytes ("f32")
    other_dtypes: tuple[str, ...] = ()  # types it counts for a few terms (softmax statistics)


def hlo_dtype(dtype) -> str:
    """numpy's name of an element type as HLO writes it (float32 → f32, bfloat16 → bf16)."""
    name = np.dtype(dtype).name
    return {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}.get(
        name, name
    )


@dataclasses.dataclass(frozen=True)
class Row:
    """One role: measured beside expected."""

    role: str
    expected: Expected | None
    measured_bus_bytes: float
    measured_ops: int
    measured: tuple  # ((kind, axes, ops, bus_bytes), ...) of the collectives in this role
    dtypes: tuple[str, ...] = ()  # element types the compiled collectives of this role carry

    @property
    def dtype_note(self) -> str:
        """Where the compiled collectives run in another type than the figure assumes (its
        bytes differ by the ratio of their sizes): the two types, named."""
        e = self.expected
        if not e or not e.dtype or not self.dtypes:
            return ""
        if e.dtype in self.dtypes and set(self.dtypes) <= {e.dtype, *e.other_dtypes}:
            return ""
        return (
            f"the compiled collectives carry {', '.join(self.dtypes)}; the figure assumes {e.dtype}"
        )

    @property
    def ratio(self) -> float | None:
        if not self.expected or not self.expected.bus_bytes:
            return None
        return self.measured_bus_bytes / self.expected.bus_bytes


# --- the strategy's geometry ---------------------------------------------------------------


def _live(axes, sizes: dict[str, int]) -> tuple[str, ...]:
    """Mesh axes of a rule that really split something (size > 1), in mesh order."""
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return tuple(a for a in sizes if a in names and sizes[a] > 1)


def _prod(axes, sizes) -> int:
    return math.prod(sizes[a] for a in axes)


@dataclasses.dataclass(frozen=True)
class Geometry:
    sizes: dict[str, int]  # mesh axis sizes
    batch_axes: tuple[str, ...]  # the batch is split over these
    shard_axes: tuple[str, ...]  # FSDP: weights split over these, gathered per use
    tensor_axes: tuple[str, ...]  # TP: heads/mlp/vocab split over these
    stage_axes: tuple[str, ...] = ()  # PP: the stacked layers split over these, never gathered
    seq_axes: tuple[str, ...] = ()  # CP: the sequence split over these (keys/values travel)

    @classmethod
    def of(cls, rules, sizes: dict[str, int]) -> "Geometry":
        r = dict(rules)
        tensor = _live(r.get(HEADS), sizes)
        tokens = tuple(r.get(BATCH) or ()) + tuple(r.get(SEQ) or ())  # cp splits seq too
        batch = _live(tokens, sizes)
        # a table split along the vocabulary over batch axes (pp) is gathered per use: FSDP
        gathered = _live(r.get(EMBED), sizes) + tuple(
            a for a in _live(r.get(VOCAB), sizes) if a in batch
        )
        return cls(
            sizes=dict(sizes),
            batch_axes=batch,
            shard_axes=tuple(a for a in sizes if a in gathered),
            tensor_axes=tensor,
            stage_axes=_live(r.get(LAYERS), sizes),
            seq_axes=_live(r.get(SEQ), sizes),
        )

    def split(self, path: str, axes) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(gathered axes, stage axes) of one parameter: the stacked blocks' layer axis is
        split over `stage` and stays split; any other split over a shard axis is gathered."""
        staged = tuple(a for a in self.stage_axes if a in axes and _in_block(path))
        return tuple(a for a in self.shard_axes if a in axes and a not in staged), staged


def _leaf_bytes(x) -> tuple[int, int, tuple[str, ...]]:
    """(full bytes, bytes on one device, mesh axes it is split over) of a sharded leaf."""
    itemsize = np.dtype(x.dtype).itemsize
    full = math.prod(x.shape) * itemsize
    local = math.prod(x.sharding.shard_shape(x.shape)) * itemsize
    axes = []
    for entry in x.sharding.spec:
        axes += [entry] if isinstance(entry, str) else list(entry or ())
    return full, local, tuple(axes)


def per_device_bytes(tree) -> int:
    return sum(_leaf_bytes(x)[1] for x in jax.tree.leaves(tree))


def _params(abstract_params):
    """(path, full, local, axes) for every parameter."""
    out = []
    for path, x in jax.tree_util.tree_leaves_with_path(abstract_params):
        full, local, axes = _leaf_bytes(x)
        out.append((jax.tree_util.keystr(path), full, local, axes))
    return out


def _uses(path: str, model_cfg) -> int:
    """How many times the forward uses a weight: a tied embedding is lookup and head."""
    return 2 if model_cfg.tie_embeddings and "'embed'" in path else 1


def _in_block(path: str) -> bool:
    return "block" in path


# --- the analytic expectations --------------------------------------------------------------


def _stage_gathered(path: str, S, geo: Geometry, pipelined: bool) -> bool:
    """A pipeline's block weight split over a shard axis: gathered once per step inside the
    pipeline, its gradient reduce-scattered there (lab/kernels/pipeline.py)."""
    return pipelined and bool(S) and _in_block(path) and bool(geo.stage_axes)


def expect_grad_reduction(
    params,
    geo: Geometry,
    model_cfg,
    reduce_scatter: bool,
    pipelined: bool = False,
    accumulate: int = 1,
    unreduced: tuple = (),
) -> Expected:
    """accumulate=K: the reduction runs once per microbatch over the batch axes, except over
    `unreduced` (lab.train.unreduced_axes), where the K microbatches' gradients are summed
    on each device first (a tied embedding's two uses with them) and reduced once."""
    B = geo.batch_axes
    WB = _prod(B, geo.sizes)
    K = max(1, accumulate)
    U = tuple(a for a in unreduced if a in B) if K > 1 else ()
    WU = _prod(U, geo.sizes)
    wide = max(1.0, 4 / np.dtype(model_cfg.param_dtype).itemsize)  # float32 over bf16/f16
    moved, summed = 0.0, 0.0  # summed: the bytes all-reduced once over U
    # cp: the tokens are split over the batch's axes and the sequence's; XLA's SPMD
    # partitioner sums a reduction over dimensions split on several mesh axes one axis at a
    # time, so a replicated weight's gradient is all-reduced over each axis in turn
    turns = [a for a in B if a not in U] if geo.seq_axes else []
    in_turn = 0.0  # the bytes the program moves that way (the figure's high end)
    groups: dict[tuple, float] = {}  # (how, W, WS) -> the gradient bytes reduced that way
    for path, _, local, axes in params:
        S, staged = geo.split(path, axes)
        WS = _prod(S, geo.sizes)
        G = local * WS * _uses(path, model_cfg)  # the gradient one device holds before the sum
        W = WB // _prod(staged, geo.sizes) // WU  # a stage's layers: summed over its replicas
        turn = 0.0
        if _stage_gathered(path, S, geo, pipelined):  # the shard's all-reduce only
            how, WR = "shard", W // WS
            per = 2 * (G / WS) * (WR - 1) / WR
        elif reduce_scatter and WS > 1:
            how, WR = "rs", W // WS
            per = G * (WS - 1) / WS + 2 * (G / WS) * (WR - 1) / WR
        else:
            how = "ar"
            per = 2 * G * (W - 1) / W
            if len(turns) > 1 and not staged and not S:
                turn = sum(2 * G * (geo.sizes[a] - 1) / geo.sizes[a] for a in turns) - per
        groups[how, W, WS] = groups.get((how, W, WS), 0.0) + G
        # over U: the sum of the K microbatches (and of a tied table's uses), as each device
        # holds it (the shard, where it was reduce-scattered), all-reduced once in float32
        moved += K * per + 2 * local * wide * (WU - 1) / WU
        in_turn += K * turn
        summed += local * wide
    kind = "reduce-scatter + all-reduce" if reduce_scatter and geo.shard_axes else "all-reduce"
    if geo.shard_axes and not reduce_scatter:
        kind = "all-reduce (reduce-scatter as all-reduce + slice: no RS pass on CPU)"
    formula = "per weight, over the W devices that share its gradient"
    if model_cfg.tie_embeddings:
        formula += " (the tied embedding's counted ×2)"
    terms = [_reduction_term(how, G, W, WS) for (how, W, WS), G in groups.items() if W > 1]
    alone = "none per microbatch" if K > 1 else "none: no other device shares a gradient"
    formula += ": " + (" + ".join(terms) or alone)
    if K > 1:
        rest = ",".join(a for a in B if a not in U)
        each = f"once per microbatch (×{K})" + (f" over {rest}" if U else "")
        formula += f"; accumulate={K}: " + "; ".join(
            ([each] if rest else [])
            + (
                [
                    f"summed on each device, reduced once over {','.join(U)} in float32: "
                    f"2·{_amount(summed)}·({WU}-1)/{WU}"
                ]
                if U
                else []
            )
        )
    if in_turn:
        each = " + ".join(f"2·V·({geo.sizes[a]}-1)/{geo.sizes[a]} over {a}" for a in turns)
        formula += (
            f"; the compiled program reduces over {' and '.join(turns)} in turn (XLA's SPMD "
            f"partitioner sums the tokens, split over the batch and the sequence, one mesh "
            f"axis at a time): {each} = {(moved + in_turn) / MiB:.3f} MiB, "
            f"{(moved + in_turn) / moved:.3f}× one reduction over {'×'.join(turns)} "
            "(the range's high end)"
        )
    dtype = hlo_dtype(model_cfg.param_dtype)
    return Expected("grad reduction", kind, B, moved, moved, moved + in_turn, formula, dtype)


def _amount(x: float) -> str:
    """Bytes in the unit that shows them: a group of a few norm scales is KiB, not 0.00 MiB."""
    if x >= MiB / 100:
        return f"{x / MiB:.2f} MiB"
    return f"{x / 1024:.1f} KiB" if x >= 1024 else f"{x:.0f} B"


def _reduction_term(how: str, G: float, W: int, WS: int) -> str:
    """One group's bytes as the formula that gives them."""
    g = _amount(G)
    if how == "ar":
        return f"2·{g}·({W}-1)/{W}"
    shard = f"2·({g}/{WS})·({W // WS}-1)/{W // WS}"
    return shard if how == "shard" else f"{g}·({WS}-1)/{WS} + {shard}"


def expect_param_gather(params, geo: Geometry, model_cfg, pipelined=False) -> Expected | None:
    if not geo.shard_axes:
        return None
    fwd = bwd_remat = bwd_all = 0.0
    for path, _, local, axes in params:
        S, _ = geo.split(path, axes)
        WS = _prod(S, geo.sizes)
        if WS == 1 or _stage_gathered(path, S, geo, pipelined):
            continue
        once = local * WS * (WS - 1) / WS
        fwd += once  # a tied table too: its lookup and the head read one gathered copy
        bwd_all += once
        regathered = model_cfg.remat != "none" or model_cfg.scan_layers
        bwd_remat += once if (_in_block(path) and regathered) else 0.0
    point = fwd + bwd_remat
    formula = (
        f"forward {fwd / MiB:.2f} MiB (V·(W-1)/W per use) + backward re-gathers of "
        f"rematerialised/scanned blocks {bwd_remat / MiB:.2f} MiB; "
        f"ZeRO-3 would add {bwd_all / MiB:.2f}"
    )
    return Expected(
        "param all-gather",
        "all-gather",
        geo.shard_axes,
        point,
        fwd,
        fwd + bwd_all,
        formula,
        hlo_dtype(model_cfg.param_dtype),
    )


def expect_context_kv(cfg, geo: Geometry) -> Expected | None:
    """cp: the keys and values of a sequence split W ways, per layer, with b = one device's
    block of K or V (its rows, L/W positions, the kv heads, in the compute dtype).
    attention=ring passes K and V round the ring forward and their gradients back:
    4·(W-1)·b a layer (collective-permutes), and the forward's passes again under any remat
    (no policy saves a permute's output). Otherwise XLA gathers K and V whole (2 all-gathers
    of W·b, (W-1)·b each), again in the backward (the range's low end leaves that out), a
    third time under remat, and sums dK and dV back (all-reduce on CPU, 2·2W·b·(W-1)/W;
    a reduce-scatter on GPU, half that). XLA:CPU runs bfloat16 collectives in float32 (2×)."""
    if not geo.seq_axes:
        return None
    m = cfg.model
    W = _prod(geo.seq_axes, geo.sizes)
    rows = cfg.batch_size // _prod([a for a in geo.batch_axes if a not in geo.seq_axes], geo.sizes)
    b = rows * (cfg.seq_len // W) * m.n_kv_heads * m.head_dim * np.dtype(m.dtype).itemsize
    L = m.n_layers
    if m.attention == "ring":
        passes = 4 + (2 if m.remat != "none" else 0)
        moved = L * passes * (W - 1) * b
        formula = f"{L} layers × {passes} passes × (W-1={W - 1}) × b={b / MiB:.3f} MiB"
        return Expected(
            "context-parallel keys/values",
            "collective-permute",
            geo.seq_axes,
            moved,
            moved,
            moved,
            formula,
            hlo_dtype(m.dtype),
        )
    gather, reduce = (W - 1) * b, 4 * (W - 1) * b
    gathers = 6 if m.remat != "none" else 4  # forward, (recomputed forward,) backward
    moved, low = L * (gathers * gather + reduce), L * (2 * gather + reduce / 2)
    formula = (
        f"{L} layers × (K, V gathered {gathers}×(W-1)·b + dK, dV summed back 4·(W-1)·b), "
        f"W={W}, b={b / MiB:.3f} MiB; low: gathered forward only, dK, dV reduce-scattered"
    )
    return Expected(
        "context-parallel keys/values",
        "all-gather + all-reduce or reduce-scatter",
        geo.seq_axes,
        moved,
        low,
        moved,
        formula,
        hlo_dtype(m.dtype),
    )


def expect_activation_reduce(cfg, geo: Geometry) -> Expected | None:
    if not geo.tensor_axes:
        return None
    m = cfg.model
    W = _prod(geo.tensor_axes, geo.sizes)
    b_local = cfg.batch_size // _prod(geo.batch_axes, geo.sizes)
    c = np.dtype(m.dtype).itemsize
    act = b_local * cfg.seq_len * m.d_model * c
    lookup = b_local * cfg.seq_len * m.d_model * np.dtype(m.param_dtype).itemsize
    L = m.n_layers
    # remat=full recomputes each block's forward but not its last output (attention out only)
    recompute = {"none": 0, "full": L, "dots": 0}[m.remat]
    n_act = 2 * L + 5 * L + 1 + recompute  # fwd row-parallel, bwd column-parallel, head bwd
    softmax = 3 * b_local * cfg.seq_len * 4
    V = n_act * act + lookup + softmax
    ar = lambda v: 2 * v * (W - 1) / W
    high = V + (L * act if m.remat == "dots" else 0)
    megatron = (4 * L + 1) * act + lookup + softmax
    formula = (
        f"{n_act}+1 all-reduces of B·L·D ({act / MiB:.3f} MiB) + softmax stats over W={W}; "
        f"Megatron's fused backward: {4 * L + 1}+1 → {ar(megatron) / MiB:.2f} MiB"
    )
    return Expected(
        "activation all-reduce",
        "all-reduce",
        geo.tensor_axes,
        ar(V),
        ar(V),
        ar(high),
        formula,
        hlo_dtype(m.dtype),
        (hlo_dtype(m.param_dtype), "f32"),  # the lookup's, the softmax statistics'
    )


def expect_stage_permutes(trainer) -> Expected | None:
    """A pipeline's activations, stage to stage, both directions (pipeline_hlo's analytic)."""
    s = trainer.schedule
    if s is None:
        return None
    a = pipeline_hlo.microbatch_bytes(trainer.cfg, trainer.rules, dict(trainer.mesh.shape))
    K = max(1, trainer.cfg.accumulate)  # the schedule runs once per accumulation microbatch
    per_device = K * s.permute_bytes(a)["per_device"]
    runs = f"accumulate={K} runs × " if K > 1 else ""
    formula = (
        f"{runs}ticks={s.ticks} (repeats·M+P-1, M={s.microbatches}, P={s.stages}) × a={a:,} B "
        "(one microbatch's B·L·D per device) each way, forward and backward"
    )
    v = 2 * per_device
    dtype = hlo_dtype(trainer.cfg.model.dtype)
    return Expected("stage permute", "collective-permute", (STAGE,), v, v, v, formula, dtype)


def expect_stage_weights(params, geo: Geometry, pipelined: bool, dtype="") -> list[Expected]:
    """pp+fsdp: each stage's block weights gathered once per step, their gradient
    reduce-scattered once (one op each per weight), over the shard axes."""
    n, once, axes = 0, 0.0, set()
    for path, _, local, leaf_axes in params:
        S, _ = geo.split(path, leaf_axes)
        if not _stage_gathered(path, S, geo, pipelined):
            continue
        WS = _prod(S, geo.sizes)
        n, once, axes = n + 1, once + local * WS * (WS - 1) / WS, axes | set(S)
    if not n:
        return []
    axes = tuple(a for a in geo.sizes if a in axes)
    formula = (
        f"{n} block weights split over {','.join(axes)}: {n} ops once per step, none per "
        f"tick; the stage's weights V·(W-1)/W = {once / MiB:.3f} MiB"
    )
    return [
        Expected("stage weight gather", "all-gather", axes, once, once, once, formula, dtype),
        Expected(
            "stage weight grad reduce-scatter",
            "reduce-scatter",
            axes,
            once,
            once,
            once,
            formula,
            dtype,
        ),
    ]


def expectations(cfg, trainer, reduce_scatter: bool) -> list[Expected]:
    geo = Geometry.of(trainer.rules, dict(trainer.mesh.shape))
    params = _params(trainer.abstract_state.params)
    piped = trainer.schedule is not None
    out = [
        expect_grad_reduction(
            params, geo, cfg.model, reduce_scatter, piped, cfg.accumulate, trainer.unreduced
        ),
        expect_param_gather(params, geo, cfg.model, piped),
        expect_activation_reduce(cfg, geo),
        expect_context_kv(cfg, geo),
        expect_stage_permutes(trainer),
        *expect_stage_weights(params, geo, piped, hlo_dtype(cfg.model.param_dtype)),
    ]
    return [e for e in out if e is not None]


# --- measured, by role -----------------------------------------------------------------------


def role_of(c: collectives_hlo.Collective, geo: Geometry) -> str:
    axes = set(c.axes)
    if c.kind == "collective-permute" and c.axes == (STAGE,) and "ppermute" in c.op_name:
        return "stage permute"
    if axes == {STAGE} and "shard_map/" in c.op_name and c.kind != "collective-permute":
        return "pipeline input/output"  # microbatches gathered to stage 0, results scattered
    if "shard_map/" in c.op_name and geo.stage_axes and axes and axes <= set(geo.shard_axes):
        if c.kind == "all-gather":  # a stage's weights, once per step (lab/kernels/pipeline.py)
            return "stage weight gather"
        if c.kind == "reduce-scatter":
            return "stage weight grad reduce-scatter"
    attention_op = "/attn/" in c.op_name and ":" not in c.op_name  # not a combined reduction
    # attention's keys and values gathered over the sequence's axes: JAX 0.10 names the op
    # (XLA:GPU's after a sharding constraint), JAX 0.12's CPU program leaves it unnamed (a
    # gather named elsewhere is another's: "other")
    kv_gather = c.kind == "all-gather" and (not c.op_name or "/attn/" in c.op_name)
    if geo.seq_axes and axes and axes <= set(geo.seq_axes) and (attention_op or kv_gather):
        # the sequence split: keys and values gathered or passed round (ring), and their
        # gradients summed back over the sequence's shards (dK, dV), not the weights'
        return "context-parallel keys/values"
    if c.kind == "all-gather" and axes and axes <= set(geo.shard_axes):
        return "param all-gather"
    if c.kind in ("all-reduce", "reduce-scatter") and axes and axes <= set(geo.batch_axes):
        return "grad reduction"
    if c.kind == "all-reduce" and axes and axes <= set(geo.tensor_axes):
        return "activation all-reduce"
    return "other"


def compare(collectives, expected: list[Expected], geo: Geometry) -> list[Row]:
    by_role: dict[str, dict] = {}
    dtypes: dict[str, set] = {}
    for c in collectives:
        if c.group_size <= 1 and c.kind != "collective-permute":
            continue
        role = role_of(c, geo)
        dtypes.setdefault(role, set()).update(c.dtypes)
        key = (c.kind, c.axes)
        ops, bus = by_role.setdefault(role, {}).get(key, (0, 0.0))
        by_role[role][key] = (ops + c.count, bus + c.total_bus_bytes)
    rows = []
    for e in expected:
        got = by_role.pop(e.role, {})
        rows.append(_row(e.role, e, got, dtypes.get(e.role, ())))
    for role, got in by_role.items():
        rows.append(_row(role, None, got, dtypes.get(role, ())))
    return rows


def _row(role, expected, got: dict, dtypes=()) -> Row:
    measured = tuple((k, a, ops, bus) for (k, a), (ops, bus) in got.items())
    return Row(
        role=role,
        expected=expected,
        measured_bus_bytes=sum(m[3] for m in measured),
        measured_ops=sum(m[2] for m in measured),
        measured=measured,
        dtypes=tuple(sorted(dtypes)),
    )


# --- memory ---------------------------------------------------------------------------------


def as_compiled(cfg, trainer):
    """The config the compiled program really is: an optimizer state the devices could not
    put in host memory (a GPU plan's abstract devices list no memory kinds) stayed on them."""
    kinds = {s.memory_kind for s in jax.tree.leaves(trainer.state_shardings.opt_state)}
    if cfg.offload_optimizer and HOST_MEMORY not in kinds:
        return dataclasses.replace(cfg, offload_optimizer=False)
    return cfg


def memory_rows(cfg, trainer, compiled) -> MemorySplit:
    """Per-device bytes: exact from shardings, predicted by the calculator, compiled by XLA.
    Device memory only: an optimizer state the program keeps in host memory (offloaded) is
    not in the device's figure, and an offload the devices could not do (no host memory
    kind: a GPU plan's abstract devices) is predicted as the program really is, on device."""
    state = trainer.abstract_state
    params = per_device_bytes(state.params)
    kinds = [s.memory_kind for s in jax.tree.leaves(trainer.state_shardings.opt_state)]
    on_device = [
        x
        for x, kind in zip(jax.tree.leaves(state.opt_state), kinds, strict=True)
        if kind != HOST_MEMORY
    ]
    cfg = as_compiled(cfg, trainer)
    return MemorySplit(
        params=params,
        grads=params,
        optimizer=per_device_bytes(on_device),
        predicted=memory.predict_lab_step(
            cfg,
            sizes=dict(trainer.mesh.shape),
            backend=trainer.mesh.devices.flat[0].platform,
            census=trainer.census,
        ),
        compiled=memory.compiled_memory(compiled) if compiled is not None else None,
    )


# --- putting it together --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Explanation:
    strategy: str
    mesh: dict
    backend: str
    rows: list[Row]
    memory: MemorySplit
    collectives: list
    pipeline: pipeline_hlo.PipelineReading | None = None

    def as_dict(self) -> dict:
        rows = []
        for r in self.rows:
            e = r.expected
            rows.append(
                {
                    "role": r.role,
                    "measured_bus_bytes": r.measured_bus_bytes,
                    "measured_ops": r.measured_ops,
                    "measured": [
                        {"kind": k, "axes": list(a), "ops": o, "bus_bytes": b}
                        for k, a, o, b in r.measured
                    ],
                    "expected": dataclasses.asdict(e) if e else None,
                    "ratio": r.ratio,
                    "dtypes": list(r.dtypes),
                    "dtype_note": r.dtype_note,
                }
            )
        return {
            "strategy": self.strategy,
            "mesh": self.mesh,
            "backend": self.backend,
            "collectives": rows,
            "memory": self.memory.record(),
            "pipeline": self.pipeline.as_dict() if self.pipeline else None,
        }


def explain(trainer, compiled=None) -> Explanation:
    """Compile (unless given) and explain the step of `trainer` (lab.train.make_trainer)."""
    compiled = compiled if compiled is not None else trainer.lower().compile()
    cfg, mesh = trainer.cfg, trainer.mesh
    backend = mesh.devices.flat[0].platform
    strategy = cfg.strategy
    geo = Geometry.of(trainer.rules, dict(mesh.shape))
    colls = collectives_hlo.from_compiled(compiled, mesh)
    expected = expectations(cfg, trainer, reduce_scatter=backend != "cpu")
    return Explanation(
        strategy=strategy,
        mesh=dict(mesh.shape),
        backend=backend,
        rows=compare(colls, expected, geo),
        memory=memory_rows(cfg, trainer, compiled),
        collectives=colls,
        pipeline=pipeline_hlo.from_trainer(colls, trainer),
    )

"""Compiled FLOPs and bytes count every trip of every loop (lab/measure/hlo.py, cost.compiled_cost).

XLA's cost analysis walks a while loop's body once; the lab adds the body again for each
further trip. Held here: known answers (a scanned matmul), the walk agreeing with XLA on a
program without loops, a loop of unknown trip count reported as such, and the real training
step giving the same compiled FLOPs scanned and unrolled across strategies, remat and
accumulation.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from lab.config import make_config
from lab.measure import cost, hlo
from lab.mesh import make_mesh
from lab.train import make_trainer

M, K, N, TRIPS = 64, 128, 96, 6


def _scanned(x, ws):
    def body(x, w):
        return jnp.tanh(x @ w), None

    return jax.lax.scan(body, x, ws)[0]


def _unrolled(x, ws):
    for i in range(ws.shape[0]):
        x = jnp.tanh(x @ ws[i])
    return x


def _inputs():
    kx, kw = jax.random.split(jax.random.key(0))
    return jax.random.normal(kx, (M, K)), jax.random.normal(kw, (TRIPS, K, K)) / K**0.5


@pytest.mark.parametrize("fn", [_scanned, _unrolled])
def test_scanned_matmul_counts_every_trip(fn):
    x, ws = _inputs()
    c = cost.compiled_cost(jax.jit(fn).lower(x, ws).compile())
    want = TRIPS * cost.matmul_flops(M, K, K)
    # the matmuls, plus one FLOP per element for what the compiler counts besides (≤ 1%)
    assert want <= c["flops"] <= 1.01 * want, (c["flops"], want)
    assert c["unknown_loops"] == 0


def test_gradient_of_scan_matches_unrolled():
    x, ws = _inputs()

    def grads(fn):
        loss = lambda ws, x: fn(x, ws).sum()
        return cost.compiled_cost(jax.jit(jax.grad(loss)).lower(ws, x).compile())

    scanned, unrolled = grads(_scanned), grads(_unrolled)
    # forward + two backward matmuls per trip
    assert scanned["flops"] >= 3 * TRIPS * cost.matmul_flops(M, K, K)
    assert scanned["flops"] == pytest.approx(unrolled["flops"], rel=0.05)
    assert scanned["xla_flops"] < scanned["flops"] / (TRIPS - 1)  # what XLA alone says
    assert [n for _, n in scanned["loops"]] == [TRIPS, TRIPS]
    assert "optimal_seconds" not in scanned  # the compiler's estimate also counts one trip


def test_walk_agrees_with_xla_without_loops():
    """The HLO walk counts what XLA counts: on a program with no loop, the same totals."""
    x, ws = _inputs()
    compiled = jax.jit(jax.grad(lambda ws, x: _unrolled(x, ws).sum())).lower(ws, x).compile()
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list | tuple) else xla
    walk = hlo.total_cost(hlo.parse(compiled.as_text()))
    assert walk.flops == pytest.approx(xla["flops"], rel=1e-3)
    assert walk.bytes == pytest.approx(xla["bytes accessed"], rel=0.02)


def test_unknown_trip_count_is_said():
    def dynamic(n, x):
        return jax.lax.fori_loop(0, n, lambda i, x: jnp.tanh(x @ x), x)

    x = jax.random.normal(jax.random.key(1), (32, 32))
    c = cost.compiled_cost(jax.jit(dynamic).lower(3, x).compile())
    assert c["unknown_loops"] == 1
    assert "at least" in cost.lower_bound_note(c)
    assert cost.lower_bound_note({"unknown_loops": 0}) == ""


# a loop body the handwritten programs below share: 32 multiplies a trip
HEAD = """HloModule m

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %y = f32[4,8]{1,0} multiply(%x, %x)
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %y)
}
"""


def test_trip_count_from_condition():
    """XLA:TPU keeps no known_trip_count: the bound is read from the loop's condition."""
    text = (
        HEAD
        + """
%cond (q: (s32[], f32[4,8])) -> pred[] {
  %q = (s32[], f32[4,8]{1,0}) parameter(0)
  %c = s32[] constant(5)
  %j = s32[] get-tuple-element(%q), index=0
  ROOT %lt = pred[] compare(%j, %c), direction=LT
}

ENTRY %main (a: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %a = (s32[], f32[4,8]{1,0}) parameter(0)
  ROOT %w = (s32[], f32[4,8]{1,0}) while(%a), condition=%cond, body=%body
}
"""
    )
    program = hlo.parse(text)
    assert program.loops == (("body", 5),)
    assert hlo.total_cost(program).flops == 5 * 32
    assert hlo.repeated_cost(program).flops == 4 * 32


def test_trip_count_from_a_counter_that_starts_at_a_constant_and_steps_by_two():
    """XLA:TPU's windowed einsum loops (an FSDP matmul split into steps that overlap its
    all-gather) count an unsigned counter from a constant 0, copied in, by 2 up to N: N / 2
    trips. The counter is read from the condition's compare, its start from the init tuple
    and its step from what the body adds to it, through the copies between."""
    text = """HloModule m

%wbody (p: (f32[4,8], u32[])) -> (f32[4,8], u32[]) {
  %p = (f32[4,8]{1,0}, u32[]) parameter(0)
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=0
  %i = u32[] get-tuple-element(%p), index=1
  %y = f32[4,8]{1,0} multiply(%x, %x)
  %ic = u32[] copy(%i)
  %two = u32[] constant(2)
  %next = u32[] add(%ic, %two)
  ROOT %t = (f32[4,8]{1,0}, u32[]) tuple(%y, %next)
}

%wcond (q: (f32[4,8], u32[])) -> pred[] {
  %c = u32[] constant(8)
  %q = (f32[4,8]{1,0}, u32[]) parameter(0)
  %j = u32[] get-tuple-element(%q), index=1
  ROOT %lt = pred[] compare(%j, %c), direction=LT
}

ENTRY %main (a: f32[4,8]) -> (f32[4,8], u32[]) {
  %a = f32[4,8]{1,0} parameter(0)
  %zero = u32[] constant(0)
  %z1 = u32[] copy(%zero)
  %z2 = u32[] copy(%z1)
  %init = (f32[4,8]{1,0}, u32[]) tuple(%a, %z2)
  ROOT %w = (f32[4,8]{1,0}, u32[]) while(%init), condition=%wcond, body=%wbody
}
"""
    program = hlo.parse(text)
    assert program.loops == (("wbody", 4),) and program.unknown_loops == ()
    assert hlo.total_cost(program).flops == 4 * (32 + 1)  # the multiply and the add, 4 times
    # started at 3 instead: (8 - 3) / 2 rounds up to 3 trips
    assert hlo.parse(text.replace("constant(0)", "constant(3)")).loops == (("wbody", 3),)


def test_computation_shared_by_two_loops_counts_both():
    """A body two loops share (XLA deduplicates identical computations) runs once per trip
    of each: its count is the sum over call sites of caller count × trips, here 3 + 2·5."""
    text = (
        HEAD
        + """
%cond1 (q: (s32[], f32[4,8])) -> pred[] {
  %q = (s32[], f32[4,8]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %c = s32[] constant(1)
  ROOT %lt = pred[] compare(%j, %c), direction=LT
}

%cond3 (q: (s32[], f32[4,8])) -> pred[] {
  %q = (s32[], f32[4,8]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %c), direction=LT
}

%cond5 (q: (s32[], f32[4,8])) -> pred[] {
  %q = (s32[], f32[4,8]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %c = s32[] constant(5)
  ROOT %lt = pred[] compare(%j, %c), direction=LT
}

%twice (r: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %r = (s32[], f32[4,8]{1,0}) parameter(0)
  %w1 = (s32[], f32[4,8]{1,0}) while(%r), condition=%cond5, body=%body
  ROOT %w2 = (s32[], f32[4,8]{1,0}) while(%w1), condition=%cond5, body=%body
}

ENTRY %main (a: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %a = (s32[], f32[4,8]{1,0}) parameter(0)
  %w0 = (s32[], f32[4,8]{1,0}) while(%a), condition=%cond3, body=%body
  ROOT %o = (s32[], f32[4,8]{1,0}) while(%w0), condition=%cond1, body=%twice
}
"""
    )
    program = hlo.parse(text)
    assert program.counts["twice"] == 1
    assert program.counts["body"] == 3 + 5 + 5
    assert hlo.total_cost(program).flops == 13 * 4 * 8
    assert hlo.repeated_cost(program).flops == 12 * 4 * 8


def test_bitcast_of_in_place_update_writes_the_update():
    """A fusion whose root is a bitcast of a dynamic-update-slice into a stacked [L, ...]
    buffer (a scan writing one layer's gradient) reads and writes that layer's slice, not the
    whole stack, as the same update without the bitcast does."""
    text = """HloModule m

%fused (b: f32[6,32,16], u: f32[32,16], i: s32[]) -> f32[6,512] {
  %b = f32[6,32,16]{2,1,0} parameter(0)
  %u = f32[32,16]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %u3 = f32[1,32,16]{2,1,0} bitcast(%u)
  %z = s32[] constant(0)
  %d = f32[6,32,16]{2,1,0} dynamic-update-slice(%b, %u3, %i, %z, %z)
  ROOT %r = f32[6,512]{1,0} bitcast(%d)
}

ENTRY %main (s: f32[6,32,16], g: f32[32,16], k: s32[]) -> f32[6,512] {
  %s = f32[6,32,16]{2,1,0} parameter(0)
  %g = f32[32,16]{1,0} parameter(1)
  %k = s32[] parameter(2)
  ROOT %f = f32[6,512]{1,0} fusion(%s, %g, %k), kind=kLoop, calls=%fused
}
"""
    program = hlo.parse(text)
    fusion = program.computations["main"][-1]
    # the update read, the same bytes written, the index read
    assert hlo.instruction_cost(fusion, program, "main").bytes == 2 * 32 * 16 * 4 + 4


def test_async_fusion_is_timed_as_the_fusion_it_runs():
    """XLA:GPU runs some fusions asynchronously (`fusion-start` … `fusion-done`: a scan's
    in-place dynamic-update-slice into its stacked [L, ...] residuals). The pair costs what the
    same `fusion` costs: the update read and written in place, not the whole stack read and
    written plus the start's tuple (operands, result, context); the called computation is
    fused (its dynamic-update-slice is not counted a second time as an op of its own) and the
    done moves nothing."""
    fused = """%fused (b: f32[6,32,16], i: s32[], u: f32[1,32,16]) -> f32[6,32,16] {
  %b = f32[6,32,16]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %u = f32[1,32,16]{2,1,0} parameter(2)
  %z = s32[] constant(0)
  ROOT %d = f32[6,32,16]{2,1,0} dynamic-update-slice(%b, %u, %i, %z, %z)
}
"""
    head = """
ENTRY %main (s: f32[6,32,16], k: s32[], g: f32[1,32,16]) -> f32[6,32,16] {
  %s = f32[6,32,16]{2,1,0} parameter(0)
  %k = s32[] parameter(1)
  %g = f32[1,32,16]{2,1,0} parameter(2)
"""
    plain = "  ROOT %f = f32[6,32,16]{2,1,0} fusion(%s, %k, %g), kind=kLoop, calls=%fused\n}\n"
    pair = (
        "  %f = ((f32[6,32,16]{2,1,0}, s32[], f32[1,32,16]{2,1,0}), f32[6,32,16]{2,1,0}, u32[]) "
        "fusion-start(%s, %k, %g), kind=kLoop, calls=%fused\n"
        "  ROOT %e = f32[6,32,16]{2,1,0} fusion-done(%f)\n}\n"
    )
    expected = 2 * 32 * 16 * 4 + 4  # the update read, the same bytes written, the index read
    for body in (plain, pair):
        program = hlo.parse("HloModule m\n\n" + fused + head + body)
        assert "fused" in program.fused
        start = program.computations["main"][3]
        assert hlo.instruction_cost(start, program, "main").bytes == expected
        assert hlo.total_cost(program).bytes == expected


def test_dot_and_convolution_formulas():
    """2·out·contracted for a dot; valid taps only for a dilated, padded convolution."""
    text = """HloModule m

ENTRY %main (a: f32[4,16], b: f32[16,8], c: f32[1,10,3], k: f32[3,3,5]) -> f32[4,8] {
  %a = f32[4,16]{1,0} parameter(0)
  %b = f32[16,8]{1,0} parameter(1)
  %c = f32[1,10,3]{2,1,0} parameter(2)
  %k = f32[3,3,5]{2,1,0} parameter(3)
  %conv = f32[1,10,5]{2,1,0} convolution(%c, %k), window={size=3 pad=1_1}, dim_labels=b0f_0io->b0f
  ROOT %d = f32[4,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    program = hlo.parse(text)
    ins = {i.name: i for i in program.computations["main"]}
    assert hlo.instruction_cost(ins["d"], program, "main").flops == 2 * 4 * 8 * 16
    # 10 outputs × 3 taps, less the 2 taps that fall on the padding at either end: 28 taps,
    # each 3 input features × 5 output features
    assert hlo.instruction_cost(ins["conv"], program, "main").flops == 2 * 28 * 3 * 5


CASES = [
    dict(mesh="2x4", strategy="dp"),
    dict(mesh="data:2,fsdp:4", strategy="fsdp", remat="full"),
    dict(mesh="4x2", strategy="tp"),
    dict(mesh="2x4", strategy="dp", accumulate=4, batch_size=32),
    dict(mesh="data:2,fsdp:4", strategy="fsdp", accumulate=4, batch_size=32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_step_flops_agree_scanned_and_unrolled(case):
    """The same training step, layers scanned or unrolled: compiled FLOPs within 2%; bytes
    within the traffic the scanned program really adds.

    Bytes, scanned / unrolled, measured on XLA:CPU (JAX 0.10): dp 1.23, dp remat=full 1.15, fsdp
    remat=full 1.06, tp 1.30, tp remat=full 1.14, dp accumulate=4 1.52, fsdp accumulate=4 1.57.
    The walk counts each instruction as XLA's HloCostAnalysis does (one trip of each scanned
    program: within 0.5% of XLA's own figure), so the excess is the scanned program's own
    traffic, not a counting error: each trip copies its layer's weights out of the stacked [L,
    ...] arrays (a dynamic-slice fusion; XLA:CPU's dot does not read a slice in place), writes
    its gradients and saved residuals into [L, ...] stacks (dynamic-update-slice, the update
    only), and before the loop the stacks are zeroed and copied into the loop's state (copy
    insertion). With accumulation all of it repeats per microbatch, and under fsdp the scanned
    step gathers each layer's weights every microbatch where the unrolled one gathers them once,
    outside the accumulation loop. Never below the unrolled step: the scanned one does the same
    work plus that stacking."""
    costs = {}
    for scan in (False, True):
        cfg = make_config(
            **{"model": "small", "batch_size": 8, "seq_len": 64, **case}, scan_layers=scan
        )
        trainer = make_trainer(cfg, make_mesh(cfg.mesh))
        costs[scan] = cost.compiled_cost(trainer.lower().compile())
    assert costs[True]["flops"] == pytest.approx(costs[False]["flops"], rel=0.02)
    ratio = costs[True]["bytes accessed"] / costs[False]["bytes accessed"]
    assert 0.99 <= ratio <= (1.7 if case.get("accumulate") else 1.4), ratio
    assert costs[True]["unknown_loops"] == 0


def test_pipeline_flops_are_dp_times_ticks():
    """A pipelined step runs its tick loop M + P - 1 times for M microbatches of work: the
    compiled FLOPs (all devices) are the unpipelined step's times ticks / M."""
    base = dict(model="small", batch_size=16, seq_len=64)
    totals = {}
    for name, kw in {
        "dp": dict(mesh="2x4", strategy="dp"),
        "pp": dict(mesh="stage:4,data:2", strategy="pp", microbatches=8),
    }.items():
        cfg = make_config(**base, **kw)
        c = cost.compiled_cost(make_trainer(cfg, make_mesh(cfg.mesh)).lower().compile())
        totals[name] = c["flops"] * 8
        assert c["unknown_loops"] == 0
    ticks, microbatches = 8 + 4 - 1, 8
    assert totals["pp"] == pytest.approx(totals["dp"] * ticks / microbatches, rel=0.03)


def _flops_per_trip(program: hlo.Program, body: str, memo=None) -> float:
    """FLOPs of one run of a loop body: its instructions and, once per call site, those of
    every computation it calls."""
    memo = {} if memo is None else memo
    if body not in memo:
        total = hlo.computation_cost(program, body).flops
        for ins in program.computations[body]:
            for callee in re.findall(r"calls=%?([\w.\-]+)", ins.attrs):
                total += _flops_per_trip(program, callee, memo)
        memo[body] = total
    return memo[body]


@pytest.mark.slow_plan
def test_13b_tpu_plan_counts_every_layer():
    """A 13B model (40 layers) on a v5e 4x4 slice, FSDP over 16 chips, scanned: XLA:TPU splits
    each layer's FSDP matmuls into windowed einsum loops (steps that overlap the all-gather or
    reduce-scatter), whose trip count the program does not state. Each is read from the loop's
    counter: every windowed loop computes exactly one whole local matmul of the model's sizes,
    and no loop is left uncounted. The step's compiled FLOPs per device are then the analytic
    count to within 2% (each windowed loop counted once, they fell far short of it: 0.59 of
    it at 2048 tokens and 4 layers). 512 tokens a sequence: at 256 XLA:TPU windows no matmul,
    and at 2048 it projects q, k and v once more per layer, 6.6% of the step, and the compile
    takes half as long again. Remat's convention: full remat recomputes each block's forward
    except its last matmul (the MLP's down projection, whose output the backward does not
    need); the flash kernel is a custom call XLA counts no FLOPs for, so attention is left
    out."""
    pytest.importorskip("libtpu", reason="libtpu not installed: pip install -e '.[tpu]'")
    from lab.session import open_session

    shape = dict(d_model=5120, n_layers=40, n_heads=40, n_kv_heads=40, d_ff=13824)
    cfg = make_config(
        model="1b", target="tpu:v5e:4x4", mesh="fsdp:16", vocab_size=32000,
        batch_size=16, seq_len=512, scan_layers=True, remat="full", **shape,
    )  # fmt: skip
    compiled = open_session(cfg).trainer.lower().compile()
    c = cost.compiled_cost(compiled)
    D, L, F, V, T = shape["d_model"], shape["n_layers"], shape["d_ff"], 32000, 512
    assert c["unknown_loops"] == 0, c
    program = hlo.parse(compiled.as_text())
    windowed = [(body, n) for body, n in program.loops if "windowed_dot_general_body" in body]
    assert len(windowed) >= 8, program.loops
    matmuls = {2 * T * D * D, 2 * T * D * F, 2 * T * D * V}  # one sequence per chip
    for body, n in windowed:
        whole = n * _flops_per_trip(program, body)
        assert any(whole == pytest.approx(m, rel=0.01) for m in matmuls), (body, n, whole)
    layers = [n for body, n in program.loops if "windowed" not in body]
    assert L in layers, program.loops
    block = 4 * D * D + 3 * D * F  # q, k, v, out; gate, up, down
    want = (6 * (L * block + V * D) + 2 * L * (block - D * F)) * T
    assert want <= c["flops"] <= 1.02 * want, (c["flops"], want)


def test_an_attention_plan_row_says_when_its_flops_are_a_lower_bound():
    from rich.console import Console

    from lab.measure.attention import PlanPoint
    from lab.report import tables

    row = PlanPoint(
        seq=1024, head_dim=64, mode="fwd", device_kind="TPU v5 lite", devices=4, compile_s=1.0,
        memory=None, hbm_bytes=None, compiled_flops=2e9,
        compiled_flops_note=cost.lower_bound_note({"unknown_loops": 1}),
        analytic_flops_per_device=2.1e9, estimated_s=None, estimate_source="floor",
        peak_flops=None, impl="pallas_tpu", attention_note=None,
    )  # fmt: skip
    console = Console(width=300, record=True)
    console.print(tables.attention_plan([row], "plan"))
    assert "2.0 (at least: 1 loop(s) of unknown trip count counted once) | 2.1 G" in (
        console.export_text()
    )


def test_an_attention_plan_row_states_the_compilers_estimate_error():
    """A time that is XLA:TPU's own estimate says under the table that no measurement checks
    it, and beside the number its ratio to the roofline floor of the same program; the record
    carries the whole error."""
    from rich.console import Console

    from lab import plans
    from lab.measure.attention import PlanPoint
    from lab.report import tables
    from lab.studies import plan

    error = plans.compiler_estimate_error("TPU v5 lite", 1.3)
    row = PlanPoint(
        seq=1024, head_dim=64, mode="fwd", device_kind="TPU v5 lite", devices=4, compile_s=1.0,
        memory=None, hbm_bytes=None, compiled_flops=2e9, compiled_flops_note="",
        analytic_flops_per_device=2.1e9, estimated_s=1e-3, estimate_source="compiler estimate",
        peak_flops=1e14, impl="pallas_tpu", attention_note=None, estimate_error=error,
        estimate_over_floor=1.3,
    )  # fmt: skip
    console = Console(width=300, record=True)
    console.print(tables.attention_plan([row], "plan"))
    text = console.export_text()
    assert "(1) 1.3×" in text, text
    assert "(1) compiler estimate: not checked against any TPU measurement: XLA:TPU's own" in text
    (step,) = [r for r in plan.to_records([row], {}) if r["what"] == "attention plan step time"]
    assert step["config"]["model_error"] == error
    assert error.endswith("; 1.3× the roofline floor of the same program"), error
    # a ratio in the hundreds reads in plain digits, never as 1.5e+02
    far = dataclasses.replace(row, estimate_over_floor=150.0)
    console = Console(width=300, record=True)
    console.print(tables.attention_plan([far], "plan"))
    assert "(1) 150×" in console.export_text() and "e+" not in console.export_text()
    far_error = plans.compiler_estimate_error("TPU v5 lite", 150.0)
    assert far_error.endswith("; 150× the roofline floor of the same program"), far_error


def test_compiler_estimate_dropped_where_a_loop_repeats():
    """XLA's optimal_seconds counts each loop body once: a plan's step time does not use it
    for a scanned program, and does for the same program unrolled. (XLA:CPU gives no
    estimate, so the compiler's answer is stood in for; the programs are the real ones.)"""
    from lab import plans

    class WithEstimate:
        def __init__(self, compiled, seconds):
            self.text, self.seconds = compiled.as_text(), seconds

        def cost_analysis(self):
            return {"optimal_seconds": self.seconds}

        def as_text(self):
            return self.text

    x, ws = _inputs()
    seconds = float(jax.random.uniform(jax.random.key(2), minval=1e-6, maxval=1e-3))
    unrolled = WithEstimate(jax.jit(_unrolled).lower(x, ws).compile(), seconds)
    scanned = WithEstimate(jax.jit(_scanned).lower(x, ws).compile(), seconds)
    assert plans.estimated_seconds(unrolled) == pytest.approx(seconds)
    assert plans.estimated_seconds(scanned) is None


def test_a_cache_write_and_read_per_row_count_only_the_rows():
    """A KV-cache step: each row reads its own slot (a vmapped dynamic_slice: a gather) and
    writes one new entry there (a vmapped dynamic_update_slice: a scatter, in place on the
    donated buffer). Only those rows move, not the whole cache."""
    B, S, K = 8, 4096, 64
    cache = jax.ShapeDtypeStruct((B, S, K), jnp.float32)
    new = jax.ShapeDtypeStruct((B, 1, K), jnp.float32)
    pos = jax.ShapeDtypeStruct((B,), jnp.int32)

    def step(cache, new, pos):
        put = lambda c, n, p: jax.lax.dynamic_update_slice(c, n, (p, 0))  # noqa: E731
        get = lambda c, p: jax.lax.dynamic_slice(c, (p, 0), (1, K))  # noqa: E731
        old = jax.vmap(get)(cache, pos)
        return jax.vmap(put)(cache, jnp.where(pos[:, None, None] > 0, new, old), pos)

    text = jax.jit(step, donate_argnums=0).lower(cache, new, pos).compile().as_text()
    ops = {i.opcode for c in hlo.parse(text).computations.values() for i in c}
    assert ops & {"scatter", "gather"}, ops  # the vmapped slices, as XLA writes them
    moved = hlo.total_cost(hlo.parse(text)).bytes
    assert moved < 0.05 * B * S * K * 4, moved  # a few rows' worth, not the 8 MiB cache


def test_the_walk_reads_a_mosaic_gpu_kernels_cost_estimate():
    """Mosaic GPU (jax 0.11+) writes a kernel's cost_estimate into its custom call's backend
    config as JSON (quotes escaped \\22); the walk counts its flops and transcendentals,
    where XLA:GPU ahead of time gives no cost analysis at all."""
    text = r"""
ENTRY %main (x: f32[128,128]) -> f32[128,128] {
  %x = f32[128,128]{1,0} parameter(0)
  ROOT %k = f32[128,128]{1,0} custom-call(%x), custom_call_target="mosaic_gpu_v2", backend_config={cost_estimate_json = "{\22flops\22: 123456789, \22transcendentals\22: 7, \22bytes_accessed\22: 4242}", module = "x"}
}
"""  # noqa: E501
    c = hlo.total_cost(hlo.parse(text))
    assert (c.flops, c.transcendentals) == (123456789, 7)


@pytest.mark.parametrize("kernel", ["pallas_tpu", "pallas_gpu", "pallas_mgpu"])
def test_the_kernels_count_only_the_tiles_their_block_map_leaves(kernel):
    """What the pallas_calls' cost estimates carry (kernel_cost, from the block map that
    skips tiles), at S = 8,192: a window of 1,024 and 8 packed documents of 1,024 give at
    least 3x fewer FLOPs than causal, forward and backward (the CPU benchmark's factor);
    with the segment ids traced only the causal band is known, an upper bound, and says so.
    pallas_mgpu takes no window or segment ids: its causal count against the full one."""
    import numpy as np

    from lab.kernels.attention import common, pallas_gpu, pallas_mgpu, pallas_tpu

    module = {"pallas_tpu": pallas_tpu, "pallas_gpu": pallas_gpu, "pallas_mgpu": pallas_mgpu}
    S, q, kv = 8192, (1, 8192, 2, 128), (1, 8192, 1, 128)
    ids = (np.arange(S) // 1024).astype(np.int32)[None]
    masks = {
        "causal": common.Mask.make(causal=True),
        "window": common.Mask.make(causal=True, window=(1023, 0)),
        "docs": common.Mask.make(causal=True, q_segment_ids=ids, kv_segment_ids=ids),
        "full": common.Mask.make(),
    }
    bs = {"pallas_gpu": pallas_gpu.BlockSizes(), "pallas_mgpu": pallas_mgpu.BLOCK_SIZES[128]}
    for backward in (False, True):

        def flops(name, backward=backward):
            c = module[kernel].kernel_cost(
                q, kv, 128, "bfloat16", mask=masks[name], backward=backward,
                block_sizes=bs.get(kernel),
            )  # fmt: skip
            assert c.exact and c.flops > 0
            return c.flops

        if kernel == "pallas_mgpu":
            assert flops("full") / flops("causal") > 1.9
            continue
        assert flops("causal") / flops("window") >= 3.0
        assert flops("causal") / flops("docs") >= 3.0
    g = common.Geometry(L=S, S=S, G=1, R=2, bq=128, bk=128, causal=True, scale=1.0)
    traced = common.launch_cost(g, common.Mask.make(causal=True), True, "fwd", 1, 2, 128, 128, 2)
    assert not traced.exact  # segment ids unseen: the causal band's count, an upper bound


def test_a_gpu_plans_block_map_flops_are_shown_and_recorded_as_derived():
    """XLA:GPU reports no cost for a Triton call (compiled ~0): the table shows the block
    map's count in its place, and it and the records say the lab derived it."""
    from rich.console import Console

    from lab.measure.attention import PlanPoint
    from lab.report import tables
    from lab.studies import plan

    FLOPS = "attention plan FLOPs per device"
    row = PlanPoint(
        seq=4096, head_dim=128, mode="fwd", device_kind="NVIDIA H100 80GB HBM3", devices=1,
        compile_s=1.0, memory=None, hbm_bytes=None, compiled_flops=0.0, compiled_flops_note="",
        analytic_flops_per_device=70e9, estimated_s=None, estimate_source="floor",
        peak_flops=None, impl="pallas_gpu", attention_note=None, mask="causal",
        kernel_flops=36e9, kernel_flops_static=36e9,
    )  # fmt: skip
    assert row.flops == 36e9 and row.flops_derived and not row.estimate_compiled
    console = Console(width=300, record=True)
    console.print(tables.attention_plan([row], "plan"))
    text = console.export_text()
    assert "36.0 derived (block map) | 70.0 G" in text and " 0.0 " not in text, text
    assert "derived (block map): counted by the lab, not the compiler: block map" in text
    (flops,) = [r for r in plan.to_records([row], {}) if r["what"] == FLOPS]
    assert flops["label"] == "derived" and flops["value"] == 36e9
    assert flops["config"]["flops_source"].startswith("block map")
    # a TPU kernel whose cost estimate the compiled count holds stays the compiler's figure
    tpu = dataclasses.replace(row, compiled_flops=36e9, impl="pallas_tpu")
    assert not tpu.flops_derived
    (flops,) = [r for r in plan.to_records([tpu], {}) if r["what"] == FLOPS]
    assert flops["label"] == "compiled, not run"
    console.print(tables.attention_plan([tpu], "plan"))
    assert "36.0 | 70.0 G" in console.export_text()


def test_a_gpu_plans_kernel_resources_are_in_its_records():
    """The registers, spills and shared memory the plan's table shows per GPU kernel are
    written to the records too (compiled, not run), one record per kernel."""
    from lab.measure.attention import PlanPoint
    from lab.measure.gpu_kernels import Kernel
    from lab.studies import plan

    k = Kernel(
        name="flash_attention_fwd", launches=1, grid=(32, 64, 1), threads=128, registers=168,
        spill_store_bytes=8, spill_load_bytes=4, stack_bytes=16, static_smem=0,
        dynamic_smem=98304, blocks_per_sm=1, limiter="smem", occupancy=0.0625,
    )  # fmt: skip
    row = PlanPoint(
        seq=4096, head_dim=128, mode="fwd", device_kind="NVIDIA H100 80GB HBM3", devices=1,
        compile_s=1.0, memory=None, hbm_bytes=None, compiled_flops=0.0, compiled_flops_note="",
        analytic_flops_per_device=70e9, estimated_s=None, estimate_source="floor",
        peak_flops=None, impl="pallas_gpu", attention_note=None, kernels=(k, k),
    )  # fmt: skip
    regs = [r for r in plan.to_records([row], {}) if r["what"] == "attention plan kernel registers"]
    assert len(regs) == 2
    r = regs[0]
    assert r["value"] == 168 and r["label"] == "compiled, not run"
    kernel = r["config"]["kernel"]
    assert kernel["spill_bytes"] == 12 and kernel["smem"] == 98304
    assert kernel["blocks_per_sm"] == 1 and kernel["name"] == "flash_attention_fwd"
    assert Kernel.from_record(kernel) == k


def test_an_uncounted_launch_is_null_in_the_records_and_a_dash_in_the_table():
    """A Mosaic GPU kernel's launches are not in XLA's thunk sequence: the record says null
    (not 0 launches) and the kernel table '–'; counted launches show their number."""
    import json

    from rich.console import Console

    from lab.measure.gpu_kernels import Kernel
    from lab.report.tables.compiled import kernels

    fields = dict(
        grid=(32, 64, 1), threads=128, registers=168, spill_store_bytes=0, spill_load_bytes=0,
        stack_bytes=0, static_smem=0, dynamic_smem=1024, blocks_per_sm=1, limiter="smem",
        occupancy=0.0625,
    )  # fmt: skip
    mosaic = Kernel(name="flash_attention_mgpu_fwd", launches=None, **fields)
    triton = Kernel(name="flash_attention_fwd", launches=6, **fields)
    record = json.loads(json.dumps(mosaic.record()))
    assert record["launches"] is None and Kernel.from_record(record) == mosaic
    console = Console(record=True, width=200)
    console.print(kernels([mosaic, triton], "kernels"))
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in console.export_text().splitlines() if "flash" in line}  # fmt: skip
    assert rows == {"flash_attention_mgpu_fwd": "–", "flash_attention_fwd": "6"}, rows


def test_only_the_compilers_estimate_has_its_error_said_after_it():
    """One wording for a time's source beside it (the run's plan, its records, the attention
    plan's notes, the ledger): the compiler's own estimate is followed by what is known of
    its error; a model's time or a floor already says its own, and no error adds nothing."""
    from lab.measure.attention import PlanPoint
    from lab.report.tables.attention import _source_note

    error = "not checked against any TPU measurement: XLA:TPU's own cost model"
    assert cost.estimate_with_error(cost.COMPILER_ESTIMATE, error) == f"compiler estimate: {error}"
    assert cost.estimate_with_error(cost.COMPILER_ESTIMATE, None) == "compiler estimate"
    floor = "roofline floor (compute-bound): no faster, likely slower"
    assert cost.estimate_with_error(floor, floor) == floor
    row = PlanPoint(
        seq=1024, head_dim=64, mode="fwd", device_kind="TPU v5 lite", devices=4, compile_s=1.0,
        memory=None, hbm_bytes=None, compiled_flops=2e9, compiled_flops_note="",
        analytic_flops_per_device=2.1e9, estimated_s=1e-3,
        estimate_source=cost.COMPILER_ESTIMATE, peak_flops=1e14, impl="pallas_tpu",
        attention_note=None,
    )  # fmt: skip
    assert _source_note(row) == cost.estimate_with_error(cost.COMPILER_ESTIMATE, error)

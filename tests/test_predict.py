"""The step-time model against hand-computed answers: a matmul, a copy, an all-gather and an
all-reduce on a known mesh, an overlapped collective; and the machines built from specs."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from lab.measure import hlo, specs
from lab.parallel import collectives_hlo
from lab.predict import machines
from lab.predict.model import Machine, Schedule, predict, predict_compiled

PEAK, BW, LINK = 100e9, 10e9, 5e9


def _machine(**kw) -> Machine:
    return Machine("test", {"float32": PEAK}, BW, {"data": LINK, "model": LINK / 2}, **kw)


def test_matmul_is_compute_bound_at_peak_times_efficiency():
    m = k = n = 256
    a, b = jnp.ones((m, k)), jnp.ones((k, n))
    compiled = jax.jit(jnp.matmul).lower(a, b).compile()
    machine = _machine(compute_efficiency=0.5, op_overhead_s=1e-6)
    p = predict_compiled(compiled, machine)
    flops = 2 * m * n * k
    moved = 4 * (m * k + k * n + m * n)
    assert flops / (0.5 * PEAK) > moved / BW  # compute-bound at these figures
    assert p.seconds == pytest.approx(flops / (0.5 * PEAK) + 1e-6, rel=1e-6)
    assert p.compute_s == pytest.approx(flops / (0.5 * PEAK), rel=1e-6)


def test_an_accelerator_overlaps_launches_with_work():
    """async_launch: an op costs max(work, launch), not their sum: the matmul above (work
    far longer than 1 µs) costs its work alone; with a launch longer than the work, the
    launch."""
    m = k = n = 256
    compiled = jax.jit(jnp.matmul).lower(jnp.ones((m, k)), jnp.ones((k, n))).compile()
    work = 2 * m * n * k / PEAK
    p = predict_compiled(compiled, _machine(op_overhead_s=1e-6, async_launch=True))
    assert p.seconds == pytest.approx(work, rel=1e-6) and p.overhead_s == 0.0
    slow = predict_compiled(compiled, _machine(op_overhead_s=10 * work, async_launch=True))
    assert slow.seconds == pytest.approx(10 * work, rel=1e-6)
    assert slow.overhead_s == pytest.approx(9 * work, rel=1e-6)


def test_a_call_adds_its_fixed_cost_to_its_ops():
    """call_overhead_s is added to the ops' time once per call, on an accelerator (ops
    launched ahead, each max(work, launch)) as on a CPU (work + launch), whether the call's
    cost is shorter or longer than its work."""
    m = k = n = 256
    compiled = jax.jit(jnp.matmul).lower(jnp.ones((m, k)), jnp.ones((k, n))).compile()
    work = 2 * m * n * k / PEAK
    for t_call in (3 * work, work / 4):
        gpu = predict_compiled(compiled, _machine(call_overhead_s=t_call, async_launch=True))
        assert gpu.seconds == pytest.approx(work + t_call, rel=1e-6)
        assert gpu.overhead_s == pytest.approx(t_call, rel=1e-6)
        assert gpu.compute_s == pytest.approx(work, rel=1e-6)
    cpu = predict_compiled(compiled, _machine(call_overhead_s=work / 4, op_overhead_s=work / 2))
    assert cpu.seconds == pytest.approx(1.75 * work, rel=1e-6)


def test_copy_is_memory_bound_at_bandwidth():
    n = 1 << 20
    compiled = jax.jit(lambda x: x * 1.5).lower(jnp.ones((n,))).compile()
    p = predict_compiled(compiled, _machine(memory_efficiency=0.8))
    assert p.memory_s == pytest.approx(2 * 4 * n / (0.8 * BW), rel=1e-3)
    assert p.seconds == pytest.approx(p.memory_s, rel=1e-6)


_GATHER = """HloModule m

ENTRY %main (p: f32[1024,256]) -> f32[8192,256] {
  %p = f32[1024,256]{1,0} parameter(0)
  ROOT %g = f32[8192,256]{1,0} all-gather(%p), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
}
"""
_REDUCE = """HloModule m

ENTRY %main (p: f32[1024,256]) -> f32[1024,256] {
  %p = f32[1024,256]{1,0} parameter(0)
  ROOT %g = f32[1024,256]{1,0} all-reduce(%p), channel_id=1, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add
}
"""


@pytest.mark.parametrize(
    "text, buffer, factor",
    [
        (_GATHER, 8192 * 256 * 4, 7 / 8),  # V(W-1)/W, V the gathered output
        (_REDUCE, 1024 * 256 * 4, 2 * 7 / 8),  # 2V(W-1)/W
    ],
    ids=["all-gather", "all-reduce"],
)
def test_collectives_on_a_known_mesh(text, buffer, factor):
    program = hlo.parse(text)
    found = {c.name: c for c in collectives_hlo.parse(text, {"data": 8})}
    p = predict(program, _machine(link_latency_s=2e-6), found)
    want = factor * buffer / LINK + 2e-6
    assert p.seconds == pytest.approx(want, rel=1e-6)
    assert p.exposed_collective_s == pytest.approx(want, rel=1e-6)


_OVERLAP = """HloModule m

ENTRY %main (p: f32[1024,256], a: f32[{m},512], b: f32[512,512]) -> (f32[1024,256], f32[{m},512]) {{
  %p = f32[1024,256]{{1,0}} parameter(0)
  %a = f32[{m},512]{{1,0}} parameter(1)
  %b = f32[512,512]{{1,0}} parameter(2)
  %s = f32[1024,256]{{1,0}} all-reduce-start(%p), channel_id=1, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add
  %d = f32[{m},512]{{1,0}} dot(%a, %b), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %e = f32[1024,256]{{1,0}} all-reduce-done(%s)
  ROOT %t = (f32[1024,256]{{1,0}}, f32[{m},512]{{1,0}}) tuple(%e, %d)
}}
"""


@pytest.mark.parametrize("m", [64, 4096])
def test_an_async_collective_hides_behind_the_compute_between_start_and_done(m):
    text = _OVERLAP.format(m=m)
    program = hlo.parse(text)
    found = {c.name: c for c in collectives_hlo.parse(text, {"data": 8})}
    p = predict(program, _machine(), found)
    comm = 2 * 7 / 8 * 1024 * 256 * 4 / LINK
    dot = max(2 * m * 512 * 512 / PEAK, 4 * (m * 512 * 2 + 512 * 512) / BW)
    assert p.collective_s == pytest.approx(comm, rel=1e-6)
    assert p.exposed_collective_s == pytest.approx(max(0.0, comm - dot), rel=1e-6)
    assert p.seconds == pytest.approx(dot + max(0.0, comm - dot), rel=1e-6)


_FITS = [
    {},
    dict(compute_efficiency=0.5, memory_efficiency=0.8),
    dict(op_overhead_s=3e-6, link_latency_s=2e-5, call_overhead_s=4e-6),
    dict(compute_efficiency=0.7, memory_efficiency=0.9, op_overhead_s=1e-4, link_latency_s=1e-6),
    dict(compute_efficiency=0.05, memory_efficiency=4.0, op_overhead_s=1e-7, link_latency_s=1e-3),
]

# A loop run three times whose body times an op before an async all-reduce's start, a dot
# and a custom call under it, an op after its done, a synchronous all-reduce, one that moves
# nothing, and an all-gather started and never awaited (covered to the body's end).
_SCHEDULE = """HloModule m

%body (q: (s32[], f32[256,512])) -> (s32[], f32[256,512]) {
  %q = (s32[], f32[256,512]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%q), index=0
  %x = f32[256,512]{1,0} get-tuple-element(%q), index=1
  %w = f32[512,512]{1,0} constant({...})
  %pre = f32[256,512]{1,0} exponential(%x)
  %s = f32[256,512]{1,0} all-reduce-start(%pre), channel_id=1, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add
  %d = f32[256,512]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %k = f32[256,512]{1,0} custom-call(%d), custom_call_target="kernel"
  %e = f32[256,512]{1,0} all-reduce-done(%s)
  %post = f32[256,512]{1,0} add(%e, %k)
  %r = f32[256,512]{1,0} all-reduce(%post), channel_id=2, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add
  %z = f32[0]{0} all-reduce(%i), channel_id=3, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add
  %g = f32[2048,512]{1,0} all-gather-start(%r), channel_id=4, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  %t = f32[256,512]{1,0} tanh(%r)
  ROOT %out = (s32[], f32[256,512]{1,0}) tuple(%i, %t)
}

ENTRY %main (a: (s32[], f32[256,512])) -> (s32[], f32[256,512]) {
  %a = (s32[], f32[256,512]{1,0}) parameter(0)
  ROOT %loop = (s32[], f32[256,512]{1,0}) while(%a), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
}
"""


@pytest.mark.parametrize("async_launch", [False, True])
@pytest.mark.parametrize("m", [64, 4096])
def test_the_schedule_gives_predicts_seconds_under_any_fit(m, async_launch):
    """Schedule (what the fit evaluates) against predict, for fits that make each term
    count: the overlapped program (its collective hidden or exposed), the loop above (ops
    before and after an async collective, a synchronous one, one of no bytes, one never
    awaited, a custom call given FLOPs, three trips), and a compiled program on this CPU's
    machine (simulated devices sharing the cores, a last-level cache)."""
    text = _OVERLAP.format(m=m)
    found = {c.name: c for c in collectives_hlo.parse(text, {"data": 8})}
    loop = {c.name: c for c in collectives_hlo.parse(_SCHEDULE, {"data": 8})}
    f = jax.jit(lambda x, w: jnp.tanh(x @ w).sum(0) * 2.0)
    compiled = f.lower(jnp.ones((m // 8, 96)), jnp.ones((96, 160))).compile()
    cpu = machines.cpu_machine(
        {"float32": PEAK}, BW, 8, cache_bytes=m * 1000.0, cache_bytes_per_s=4 * BW
    )
    base = _machine(async_launch=async_launch)
    cases = [
        (hlo.parse(text), found, base, 0.0),
        (hlo.parse(_SCHEDULE), loop, base, 1e9),
        (
            hlo.parse(compiled.as_text()),
            {},
            dataclasses.replace(cpu, async_launch=async_launch),
            0.0,
        ),
    ]
    assert cases[1][0].counts["body"] == 3
    for program, colls, machine, custom in cases:
        schedule = Schedule(program, machine, colls, custom_flops=custom)
        for fit in _FITS:
            fitted = dataclasses.replace(machine, **fit)
            want = predict(program, fitted, colls, custom_flops=custom).seconds
            assert schedule.seconds(**fit) == pytest.approx(want, rel=1e-9), fit


def test_gpu_links_nvlink_inside_a_host_infiniband_across():
    spec = specs.lookup("NVIDIA H100 80GB HBM3")
    m = machines.gpu_machine(spec, {"data": 4, "fsdp": 8})
    assert m.link_bandwidth["fsdp"] == spec.interconnect_bandwidth / 2  # inside 8 GPUs
    assert m.link_bandwidth["data"] == machines.IB_PER_GPU  # across hosts
    # point to point (and all-to-all): the slowest axis it spans, one NIC per device
    assert m.link(("data", "fsdp"), "collective-permute") == machines.IB_PER_GPU
    assert m.link(("data",), "all-reduce") == machines.IB_PER_GPU  # one member per host


def test_a_ring_across_hosts_runs_one_ring_per_members_nic():
    """A ring collective whose group has g members on each host runs g rings, each leaving
    the host through its own 50 GB/s NIC: min(g × 50 GB/s, NVLink) per device. Data 48 × model
    m (model innermost, 8 GPUs a host): the data groups hold 8/m GPUs of each host."""
    spec = specs.lookup("NVIDIA H100 80GB HBM3")
    nvlink = spec.interconnect_bandwidth / 2
    ib = machines.IB_PER_GPU
    for model, per_host in ((1, 8), (2, 4), (4, 2), (8, 1)):
        m = machines.gpu_machine(spec, {"data": 48, "model": model} if model > 1 else {"data": 48})
        assert m.link(("data",), "all-reduce") == min(per_host * ib, nvlink)
        assert m.link(("data",), "reduce-scatter") == min(per_host * ib, nvlink)
        assert m.link(("data",), "collective-permute") == ib
        if model > 1:
            assert m.link(("model",), "all-gather") == nvlink  # inside a host
            assert m.link(("data", "model"), "all-reduce") == min(8 * ib, nvlink)
    # an all-reduce over 48 GPUs of 6 hosts (8 each): 2·47/48 of 1 GiB at 8 × 50 GB/s
    m = machines.gpu_machine(spec, {"data": 48})
    text = _OVERLAP.format(m=64)
    program = hlo.parse(text)
    found = {c.name: c for c in collectives_hlo.parse(text, {"data": 8})}
    found = {k: dataclasses.replace(c, group_size=48) for k, c in found.items()}
    p = predict(program, m, found)
    assert p.collective_s == pytest.approx(2 * 47 / 48 * 1024 * 256 * 4 / (8 * ib), rel=1e-6)


def test_tpu_links_share_the_chip_ici_among_torus_axes():
    spec = specs.lookup("TPU v5 lite")
    m = machines.tpu_machine(spec, "16x16", {"fsdp": 256})
    assert m.link_bandwidth["fsdp"] == spec.interconnect_bandwidth / 2


def test_fit_recovers_known_parameters_on_its_calibration_points():
    """Points made with efficiency 0.4: the fit finds (close to) it from those points alone."""

    def point(flops):
        return lambda **fit: flops / (PEAK * fit["compute_efficiency"]), flops / (PEAK * 0.4)

    fitted = machines.fit([point(f) for f in (1e9, 3e9, 1e10)], params=("compute_efficiency",))
    assert fitted["compute_efficiency"] == pytest.approx(0.4, rel=0.15)


def test_a_fit_pushed_to_the_end_of_its_range_says_so():
    """Points a 10x-too-fast memory system would explain: the fit stops at the top of its
    range, and at_edge names that parameter (not one fitted inside, not an overhead of 0)."""

    def point(nbytes, efficiency):
        return (
            lambda **fit: nbytes / (1e11 * fit["memory_efficiency"]),
            nbytes / (1e11 * efficiency),
        )

    wild = machines.fit([point(b, 10.0) for b in (1e8, 1e9)], params=("memory_efficiency",))
    (edge,) = machines.at_edge(wild, ("memory_efficiency",))
    assert edge.startswith("memory_efficiency ") and "the top of 0.05–4" in edge
    tame = machines.fit([point(b, 0.5) for b in (1e8, 1e9)], params=("memory_efficiency",))
    assert (
        machines.at_edge({**tame, "op_overhead_s": 0.0}, ("memory_efficiency", "op_overhead_s"))
        == []
    )
    assert machines.at_edge({"compute_efficiency": 0.05})[0].endswith("the bottom of 0.05–1")


def test_leave_one_out_fits_on_the_other_points_only():
    """Two points made with efficiencies 0.4 and 0.1: each, left out, is predicted with the
    other's efficiency (4x too slow, 4x too fast); a fit that saw it would land between."""

    def point(flops, efficiency):
        return (
            lambda **fit: flops / (PEAK * fit["compute_efficiency"]),
            flops / (PEAK * efficiency),
        )

    seen = []
    ratios = machines.leave_one_out(
        [point(1e9, 0.4), point(3e9, 0.1)], params=("compute_efficiency",), tick=seen.append
    )
    assert seen == [0, 1]
    assert ratios[0] == pytest.approx(4.0, rel=0.05)
    assert ratios[1] == pytest.approx(0.25, rel=0.05)


def test_a_machine_class_without_a_fit_says_its_prediction_is_uncalibrated(monkeypatch):
    """Nothing calibrates TPU predictions (no usable published point): the roofline with
    efficiencies 1 predicts, and the statement says so before its held-out error."""
    from lab.predict import step

    held = {"n": 1, "median": 0.25, "worst": 1.25, "what": "published points"}
    monkeypatch.setattr(step, "fits", lambda: {"tpu": {"fit": None, "held_out": held}})
    monkeypatch.setattr(step, "device_checks", lambda: {})
    said = step.error_statement("tpu")
    assert said.startswith("uncalibrated for TPU (no usable calibration point: the roofline")
    # one point is no median: its error alone
    assert said.endswith("model error 25% on 1 held-out published point")


def test_the_cpu_error_names_the_processor_it_was_measured_on(monkeypatch):
    """A VM moves between hosts: the CPU fit's error is this processor's only if it was
    measured here; otherwise the statement names the other one and how to refit."""
    from lab.measure import records
    from lab.predict import step

    held = {"n": 7, "median": 0.06, "worst": 1.5, "what": "lab.run configurations on this CPU"}
    entry = {"fit": {}, "held_out": held, "host": records.cpu_model(), "date": "2026-11-29"}
    monkeypatch.setattr(step, "fits", lambda: {"cpu": entry})
    said = step.error_statement("cpu")
    assert said.endswith("on 7 held-out lab.run configurations on this CPU (2026-11-29)"), said
    monkeypatch.setattr(step, "fits", lambda: {"cpu": {**entry, "host": "Other CPU, 64 cores"}})
    said = step.error_statement("cpu")
    assert "on another CPU (Other CPU, 64 cores, 2026-11-29): refit here with" in said, said


def test_device_checks_say_which_way_their_predictions_lean(monkeypatch):
    from lab.predict import step

    held = {"n": 15, "median": 0.09, "worst": 1.5, "what": "published points"}
    monkeypatch.setattr(step, "fits", lambda: {"gpu": {"fit": {}, "held_out": held}})

    def checks(mean):
        c = {"n": 5, "median": 0.12, "worst": 1.37, "mean_ratio": mean, "backend": "gpu"}
        return lambda: {"NVIDIA H100 80GB HBM3": {**c, "dates": ["2026-11-27"]}}

    monkeypatch.setattr(step, "device_checks", checks(0.88))
    assert "predicted faster than measured: mean predicted/measured 0.88" in (
        step.error_statement("gpu")
    )
    monkeypatch.setattr(step, "device_checks", checks(1.2))
    assert "predicted slower than measured: mean predicted/measured 1.20" in (
        step.error_statement("gpu")
    )
    monkeypatch.setattr(step, "device_checks", checks(1.02))  # no lean worth a word
    assert "predicted faster" not in step.error_statement("gpu")
    assert "predicted slower" not in step.error_statement("gpu")


def test_a_training_plans_error_leads_with_training_steps_and_names_the_chips(monkeypatch):
    """The held-out published points are mostly single ops, decode and prefill: the statement
    says what they are, and a training step's plan leads with the error on training steps.
    Steps measured on H100/H200 are not an A100's check: the statement says so."""
    from lab.predict import step

    held = {"n": 4, "median": 0.09, "worst": 1.5, "what": "published points"}

    def row(workload, hardware, error, **more):
        return {"role": "held-out", "workload": workload, "hardware": hardware, "error": error}

    # a rate's error: +27% TFLOP/s is a step predicted 21% shorter, not 27% longer
    rate = {"unit": "TFLOP/s per chip", "published": 492.0, "predicted": 624.4}
    rows = [
        {**row("train", "h100 × 8", 0.27), **rate},
        row("gemm", "h100 × 1", 0.02),
        row("gemm", "a100 × 1", -0.18),
        row("decode", "a100 × 1", 0.15),
        {"role": "calibration", "workload": "train", "hardware": "h100 × 16", "error": 0.0},
        row("train", "tpu-v6e × 256", 0.25),  # another machine class
    ]
    fitted = {"gpu": {"fit": {}, "held_out": held}, "validation": {"rows": rows}}
    monkeypatch.setattr(step, "fits", lambda: fitted)
    c = {"n": 5, "median": 0.12, "worst": 1.37, "mean_ratio": 1.0, "backend": "gpu"}
    monkeypatch.setattr(
        step, "device_checks", lambda: {"NVIDIA H100 80GB HBM3": {**c, "dates": ["2026-11-27"]}}
    )
    mix = "on 4 held-out published points (1 training step, 2 GEMMs, 1 decode)"
    assert step.error_statement("gpu").startswith(f"model error 9% median, worst 1.50×, {mix}")
    h100 = step.error_statement("gpu", step_on="NVIDIA H100 80GB HBM3")
    assert h100.startswith("model error on training steps: 12% median, worst 1.37×, on 5 lab.run")
    said = "step time predicted 21% shorter (TFLOP/s per chip +27%; h100 × 8) than published on 1 held-out published"
    assert said + " training step" in h100
    assert h100.endswith(f"over every held-out point: model error 9% median, worst 1.50×, {mix}")
    assert "not this chip" not in h100
    a100 = step.error_statement("gpu", step_on="NVIDIA A100-SXM4-80GB")
    assert a100.startswith(
        "model error on training steps: no step measured on an NVIDIA A100-SXM4-80GB; 12% median"
    )
    assert "measured on an NVIDIA H100 80GB HBM3 (not this chip; 2026-11-27" in a100
    assert "21% shorter (TFLOP/s per chip +27%; h100 × 8, not this chip) than published" in a100
    # a plan names its target as the spec table does, a measured device as its driver does
    # ('NVIDIA H100' against 'NVIDIA H100 80GB HBM3'): one chip, not another
    named = step.error_statement("gpu", step_on="NVIDIA H100")
    assert "not this chip" not in named and "no step measured" not in named
    # steps measured before the fit in use was made were not predicted by it
    fitted["validation"]["date"] = "2026-11-29"
    assert "the fit in use, of 2026-11-29, is not checked on them" in step.error_statement("gpu")
    fitted["validation"]["date"] = "2026-11-27"
    assert "not checked" not in step.error_statement("gpu")


def test_a_tpu_plans_error_names_its_one_point_as_another_chips(monkeypatch):
    """The one held-out TPU point is a v6e training step: a v5e plan's statement says it is
    another chip, in time (a rate's +25% is a step 20% shorter) with the rate's own error
    beside it, as fits.json holds it, and does not repeat it."""
    from lab.predict import step

    held = {"n": 1, "median": 0.25, "worst": 1.25, "what": "published points"}
    v6e = {"role": "held-out", "workload": "train", "hardware": "tpu-v6e × 256", "error": 0.25}
    v6e |= {"unit": "TFLOP/s per chip", "published": 100.0, "predicted": 125.0}
    fitted = {"tpu": {"fit": None, "held_out": held}, "validation": {"rows": [v6e]}}
    monkeypatch.setattr(step, "fits", lambda: fitted)
    monkeypatch.setattr(step, "device_checks", lambda: {})
    said = step.error_statement("tpu", step_on="TPU v5 lite")
    assert said.endswith(
        "model error on training steps: step time predicted 20% shorter (TFLOP/s per chip "
        "+25%; tpu-v6e × 256, not this chip) than published on 1 held-out published "
        "training step"
    ), said
    assert "not this chip" not in step.error_statement("tpu", step_on="TPU v6 lite")


def test_an_ops_last_name_leaves_out_the_transforms_closing_parentheses():
    from lab.measure.predicted import OpTime

    def what(op_name):
        return OpTime("x", "all-gather-start", "collective", 1, 0, 0, 0, 0, op_name).what

    assert what("jit(step)/transpose(jvp(block/convert_element_type))") == "convert_element_type"
    assert what("jit(step)/dot_general") == "dot_general"
    assert what("") == "all-gather-start"


def test_only_the_first_process_of_a_job_predicts_the_step(monkeypatch):
    """Process 0 alone prints and records the predicted step; on CPU the model first measures
    the host, and every process measuring at once cost each seconds and skewed process 0's
    peak. The others' analysis holds no prediction and measures nothing."""
    from lab import devices, summary
    from lab.config import make_config
    from lab.session import open_session

    session = open_session(make_config(preset="tiny", steps=1, mesh="1"))
    compiled = session.trainer.lower().compile()
    info = devices.describe()
    calls = []
    real = summary.predict_step
    monkeypatch.setattr(summary, "predict_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = summary.analyse(compiled, session.cfg, info, session.trainer)
    assert calls == [1] and first["predicted_step"] is not None
    monkeypatch.setattr(summary.jax, "process_index", lambda *a, **k: 1)
    other = summary.analyse(compiled, session.cfg, info, session.trainer)
    assert calls == [1] and other["predicted_step"] is None

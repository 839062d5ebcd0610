"""One model over 1, 2, 4, 8 devices per strategy; remat; batch (`python -m lab.tools.scaling`).

Three experiments on the real compiled train step (lab.train.make_trainer), one record each
figure (lab.measure.records), the records of one row held by its type (lab/measure/scaling.py):

1. Scaling (strong: the global batch is fixed). Per strategy and device count: step time
   (lab.measure.timing.bench over the donated step), per-device memory (memory_analysis),
   and the split of the step into collectives and compute. The collective time is derived:
   the collectives the compiled step really holds (lab.parallel.collectives_hlo), each
   kind's bus bytes divided by the bus bandwidth that kind measured here at its mean message
   size (lab.measure.collectives); compute is the rest of the step.
2. Data-parallel efficiency at 16, 64 and 256 devices, *extrapolated* (weak scaling: the
   per-device batch of the largest measured run). Compute is measured: one device running
   that per-device batch (experiment 1's dp step). Its one checkable error: the model's step
   on the largest measured device count against dp's step measured there.
   Communication is the ring all-reduce of every gradient, 2·G·(N-1)/N bytes, at the
   interconnect bandwidth of the device's spec entry (or, with no entry, e.g. CPU, the
   all-reduce bus bandwidth measured here, which is labelled so).
   Bandwidth only: no latency term, no hierarchy beyond one link; so an upper bound.
       efficiency = t_compute / (t_compute + t_comm)     (no overlap)
       overlapped = t_compute / max(t_compute, t_comm)   (perfect overlap)
3. Remat and batch. remat=none|full|dots across batch sizes on one device: peak memory
   (memory_analysis of the compiled step) and step time. The blocks are scanned
   (scan_layers=true): XLA:CPU schedules an unscanned remat's recomputation early and keeps
   the activations anyway (see tests/test_memory.py).

On CPU the devices are simulated (slices of one host): the split and the trend are real
properties of the compiled programs, the absolute times are not an interconnect's.
"""

import dataclasses
import functools
import math

import jax
import numpy as np

from lab.config import Config, make_config, override
from lab.data import synthetic_batch, to_global
from lab.measure import collectives, memory, records, specs, timing
from lab.measure.scaling import DPExtrapolation, RematPoint, ScalingStudy, StrongPoint
from lab.mesh import make_mesh
from lab.names import DATA
from lab.parallel import collectives_hlo
from lab.train import make_trainer

STRATEGIES = ("dp", "fsdp", "tp", "fsdp+tp")
EXTRAPOLATE_TO = (16, 64, 256)
OP_OF_KIND = {"collective-permute": "ppermute"}


@dataclasses.dataclass(frozen=True)
class Size:
    """How big and how long: quick for CPU and CI, full for an accelerator."""

    model: dict  # model fields (and preset) of the runs
    batch: int  # global batch of the scaling runs
    seq_len: int
    device_counts: tuple[int, ...]
    remats: tuple[str, ...]
    batches: tuple[int, ...]  # remat experiment batch sizes
    budget_s: float  # timed seconds per figure

    def summary(self) -> str:
        """'the tiny model (1 layer), batch 8 × seq 32, on 1,2 devices, 0.02 s a figure'."""
        layers = f" ({self.model['n_layers']} layer)" if "n_layers" in self.model else ""
        counts = ",".join(map(str, self.device_counts))
        return (
            f"the {self.model['preset']} model{layers}, batch {self.batch} × seq "
            f"{self.seq_len}, on {counts} devices, {self.budget_s:g} s a figure"
        )


SIZES = {
    "tiny": Size(dict(preset="tiny", n_layers=1), 8, 32, (1, 2), ("none", "full"), (4,), 0.02),
    "quick": Size(
        dict(preset="tiny"), 16, 64, (1, 2, 4, 8), ("none", "full", "dots"), (2, 8, 32), 0.3
    ),
    "full": Size(
        dict(preset="small"), 32, 256, (1, 2, 4, 8), ("none", "full", "dots"), (8, 16, 32, 64), 2.0
    ),
}


def mesh_spec(strategy: str, n: int) -> str:
    """The mesh each strategy uses on n devices; tp splits heads over at most 2 (tiny has 2
    kv heads), the rest of the devices go to the batch."""
    model = min(n, 2)
    return {
        "dp": f"data:{n}",
        "fsdp": f"fsdp:{n}",
        "tp": f"data:{n // model},model:{model}",
        "fsdp+tp": f"fsdp:{n // model},model:{model}",
    }[strategy]


def _config(size: Size, mesh: str, strategy: str, batch: int, **extra) -> Config:
    cfg = make_config(
        **size.model,
        mesh=mesh,
        strategy=strategy,
        batch_size=batch,
        seq_len=size.seq_len,
        dtype="float32",
        data="synthetic",
    )
    return override(cfg, **extra)


def _model_name(size: Size) -> str:
    return " ".join(f"{k}={v}" for k, v in size.model.items())


@dataclasses.dataclass
class Measured:
    """One compiled, timed step."""

    step: timing.BenchResult
    memory: dict
    collectives: dict  # (kind, axes) → {ops, buffer_bytes, bus_bytes}
    mesh: object
    grad_bytes: int  # all parameter bytes (f32 gradients), for the extrapolation


def random_state(abstract_state, seed: int):
    """Random state placed straight on its shardings, no init to compile: the step's cost does
    not depend on the values (positive, so Adam's second moment is a valid one; never zero)."""
    rng = np.random.default_rng(seed)

    def leaf(x):
        if not np.issubdtype(x.dtype, np.floating):
            return jax.device_put(np.zeros(x.shape, x.dtype), x.sharding)
        value = np.abs(rng.normal(0.0, 0.02, x.shape)) + 1e-6
        return jax.device_put(value.astype(x.dtype), x.sharding)

    return jax.tree.map(leaf, abstract_state)


@functools.cache  # the experiments share configurations (extrapolation and remat=none)
def measure_step(cfg, n: int, budget_s: float) -> Measured:
    """Compile and time the real train step of `cfg` on the first n devices."""
    mesh = make_mesh(cfg.mesh, jax.devices()[:n])
    trainer = make_trainer(cfg, mesh)
    compiled = trainer.lower().compile()
    tokens = synthetic_batch(cfg.seed, 0, cfg.batch_size, cfg.seq_len, cfg.model.vocab_size)
    batch = to_global(tokens, trainer.batch_sharding)
    holder = [random_state(trainer.abstract_state, cfg.seed)]

    def step(batch):  # the step donates its state: thread it through
        holder[0], metrics = compiled(holder[0], batch)
        return metrics

    result = timing.bench(step, batch, warmup=2, min_runs=5, budget_s=budget_s)
    params = trainer.abstract_state.params
    grad_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
    return Measured(
        step=result,
        memory=memory.compiled_memory(compiled) or {},
        collectives=collectives_hlo.totals(collectives_hlo.from_compiled(compiled, mesh)),
        mesh=mesh,
        grad_bytes=grad_bytes,
    )


@functools.cache
def _busbw(op: str, mesh, axes: tuple, size_bytes: int, budget_s: float) -> float:
    return collectives.time_one(op, mesh, axes, size_bytes, budget_s).busbw


def collective_seconds(m: Measured, budget_s: float) -> float:
    """Σ over the step's collectives of bus bytes / the bus bandwidth measured for that kind."""
    total = 0.0
    for (kind, axes), row in m.collectives.items():
        if not axes:
            continue
        size = max(4096, int(row["buffer_bytes"] / row["ops"]))
        size = 2 ** round(math.log2(size))  # a few sizes, reused across configs
        bw = _busbw(OP_OF_KIND.get(kind, kind), m.mesh, axes, size, budget_s)
        total += row["bus_bytes"] / bw
    return total


def _env_note() -> dict:
    env = records.environment()
    return {"simulated_devices": env["backend"] == "cpu" and env["device_count"] > 1}


def _counts(size: Size) -> list[int]:
    return [n for n in size.device_counts if n <= jax.device_count()]


def skipped_counts(size: str) -> list[int]:
    """The device counts of `size` this process has too few devices for (not timed)."""
    return [n for n in SIZES[size].device_counts if n > jax.device_count()]


def points_planned(size: str, strategies=STRATEGIES) -> int:
    """How many points `run` times: each strategy × device count, the extrapolation's one
    step, each remat × batch (a progress bar's total)."""
    s = SIZES[size]
    return len(strategies) * len(_counts(s)) + 1 + len(s.remats) * len(s.batches)


def _nothing(*_) -> None:
    pass


def scaling(
    size: Size, strategies=STRATEGIES, *, at=_nothing, each=_nothing
) -> tuple[StrongPoint, ...]:
    """Experiment 1: step time, collective/compute split and memory, a row per strategy and
    device count (four records each). `at(label)` before each point, `each(rows)` with the
    rows so far after it."""
    out = []
    counts = _counts(size)
    for strategy in strategies:
        for n in counts:
            at(f"strong scaling: {strategy} on {n} device{'s' if n != 1 else ''}")
            spec = mesh_spec(strategy, n)
            cfg = _config(size, spec, strategy, size.batch)
            m = measure_step(cfg, n, size.budget_s)
            comm = collective_seconds(m, size.budget_s)
            common = dict(
                experiment="scaling",
                strategy=strategy,
                devices=n,
                mesh=spec,
                batch=size.batch,
                seq_len=size.seq_len,
                model=_model_name(size),
                **_env_note(),
            )
            recs = [
                records.make_record(
                    "step time", m.step.median_s, "s", **common, **m.step.as_dict()
                ),
                records.make_record(
                    "collective time (HLO bytes / measured busbw)",
                    comm,
                    "s",
                    label="derived",
                    **common,
                ),
                records.make_record(
                    "compute time (step - collectives)",
                    max(m.step.median_s - comm, 0.0),
                    "s",
                    label="derived",
                    **common,
                ),
                records.make_record(
                    "memory per device",
                    m.memory.get("total_bytes"),
                    "B",
                    label="compiled",
                    source="memory_analysis",
                    **common,
                ),
            ]
            out.append(StrongPoint.from_records(recs))
            each(tuple(out))
    return tuple(out)


def dp_bandwidth(mesh, budget_s: float) -> tuple[float, str]:
    """Bytes/s for the extrapolation: the spec's interconnect, else measured all-reduce busbw."""
    kind = jax.devices()[0].device_kind
    spec = specs.lookup(kind)
    if spec is not None and spec.interconnect_bandwidth:
        src = spec.source_of("interconnect_bandwidth")
        return spec.interconnect_bandwidth, f"{spec.interconnect} spec ({src})"
    bw = _busbw("all-reduce", mesh, (DATA,), 1 << 20, budget_s)
    return bw, f"1 MiB all-reduce busbw measured here on {mesh.shape[DATA]} {kind} devices"


def model_check(strong, n: int, compute_s: float, comm_s: float) -> dict | None:
    """The extrapolation's model held against a measured step it was not given: dp's step at
    the global batch on the n devices whose bandwidth the model uses (the per-device batch
    of the one-device compute it adds the all-reduce to). None where no such step was
    measured (one device, or no dp point at n)."""
    if n < 2 or not math.isfinite(comm_s):
        return None
    hit = [p for p in strong if p.strategy == "dp" and p.devices == n and p.step_s]
    if not hit:
        return None
    predicted = compute_s + comm_s
    return {
        "devices": n,
        "predicted_s": predicted,
        "measured_s": hit[0].step_s,
        "ratio": predicted / hit[0].step_s,
    }


def extrapolate(size: Size, strong=()) -> tuple[DPExtrapolation, ...]:
    """Experiment 2: DP efficiency at 16/64/256 devices, extrapolated (weak scaling), a row
    per device count. Where `strong` (experiment 1) timed dp on the devices the bandwidth
    is measured on, each row carries the model's step there against that measurement
    (`check`): the one error of the model this host can show."""
    n_max = max(n for n in size.device_counts if n <= jax.device_count())
    per_device = max(1, size.batch // n_max)
    cfg = _config(size, "1", "dp", per_device)  # experiment 1's dp step, on one device
    one = measure_step(cfg, 1, size.budget_s)
    if n_max > 1:
        bw, source = dp_bandwidth(make_mesh(f"data:{n_max}", jax.devices()[:n_max]), size.budget_s)
    else:
        bw, source = math.nan, "one device: no all-reduce to measure"
    t_c = one.step.median_s
    per_strong = size.batch // n_max == per_device  # the strong step's rows per device
    at_n = 2 * one.grad_bytes * (n_max - 1) / n_max / bw if n_max > 1 else math.nan
    check = model_check(strong, n_max, t_c, at_n) if per_strong else None
    out = []
    for n in EXTRAPOLATE_TO:
        t_comm = 2 * one.grad_bytes * (n - 1) / n / bw
        common = dict(
            experiment="dp extrapolation",
            devices=n,
            per_device_batch=per_device,
            compute_s=t_c,
            comm_s=t_comm,
            grad_bytes=one.grad_bytes,
            bandwidth=bw,
            bandwidth_source=source,
            model=_model_name(size),
            seq_len=size.seq_len,
            check=check,
            **_env_note(),
        )
        if math.isfinite(t_comm):
            eff, eff_overlap = t_c / (t_c + t_comm), t_c / max(t_c, t_comm)
        else:  # no bandwidth measured (one device): nothing to extrapolate with
            eff = eff_overlap = common["comm_s"] = common["bandwidth"] = None
        recs = [
            records.make_record(
                "DP efficiency (extrapolated, no overlap)", eff, "1", label="predicted", **common
            ),
            records.make_record(
                "DP efficiency (extrapolated, perfect overlap)",
                eff_overlap,
                "1",
                label="predicted",
                **common,
            ),
        ]
        out.append(DPExtrapolation.from_records(recs))
    return tuple(out)


def remat_batch(size: Size, *, at=_nothing, each=_nothing) -> tuple[RematPoint, ...]:
    """Experiment 3: peak memory and step time per remat policy and batch, one device
    (`at` and `each` as in `scaling`)."""
    out = []
    for remat in size.remats:
        for batch in size.batches:
            at(f"remat={remat}, batch {batch} on one device")
            cfg = _config(size, "1", "dp", batch, remat=remat, scan_layers=True)
            m = measure_step(cfg, 1, size.budget_s)
            common = dict(
                experiment="remat",
                remat=remat,
                batch=batch,
                seq_len=size.seq_len,
                model=_model_name(size),
                scan_layers=True,
            )
            recs = [
                records.make_record(
                    "step time", m.step.median_s, "s", **common, **m.step.as_dict()
                ),
                records.make_record(
                    "peak memory per device",
                    m.memory.get("total_bytes"),
                    "B",
                    label="compiled",
                    source="memory_analysis",
                    temp_bytes=m.memory.get("temp_bytes"),
                    **common,
                ),
            ]
            out.append(RematPoint.from_records(recs))
            each(tuple(out))
    return tuple(out)


def run(size: str = "quick", strategies=STRATEGIES, progress=None, done=None) -> ScalingStudy:
    """All three experiments at `size` (tiny | quick | full); `.records()` is their records.
    `progress(label)` is called as each point starts (`points_planned` of them), `done(study)`
    with the study so far as each ends (a caller that keeps what finished on a stop)."""
    if size not in SIZES:
        raise ValueError(f"size={size!r}: expected one of {', '.join(SIZES)}")
    s = SIZES[size]
    tick = progress or _nothing
    done = done or _nothing
    strong = scaling(s, strategies, at=tick, each=lambda rows: done(ScalingStudy(rows)))
    tick("data-parallel efficiency, extrapolated")
    extrapolated = extrapolate(s, strong)
    done(ScalingStudy(strong, extrapolated))
    study = ScalingStudy(
        strong,
        extrapolated,
        remat_batch(s, at=tick, each=lambda rows: done(ScalingStudy(strong, extrapolated, rows))),
    )
    return study

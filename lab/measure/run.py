"""What lab.run reads of its compiled step and of its finished run, as frozen types.

lab.summary works the figures out and summary.json keeps them under its keys; these types sit
here, below lab.report, so the run's renderers (lab/report/tables/run.py: `analysis`,
`run_summary`) take them and read their fields instead of the dict whose keys they must know.
`from_record()` reads the summary.json form (the analysis, or the whole summary), `record()`
gives back the keys it read, value for value.
"""

import dataclasses
from typing import Any

from lab.measure.cost import estimate_with_error, lower_bound_note
from lab.measure.offload import OffloadCost
from lab.measure.pipeline import PipelineReading
from lab.measure.predicted import PredictedStep

# The calculator's parts of a step's memory per device (lab.measure.memory.predict_lab_step),
# in the order the run prints them.
PREDICTED_PARTS = ("params", "grads", "optimizer", "activations", "workspace")


@dataclasses.dataclass(frozen=True)
class PredictedMemory:
    """The calculator's bytes per device: its parts, the total, what sits in host memory."""

    parts: tuple[tuple[str, float], ...]  # (part, bytes) in PREDICTED_PARTS order
    total: float
    host: float | None = None  # bytes in host memory (offloading), when any
    source: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_record(cls, d: dict) -> "PredictedMemory":
        parts = tuple((k, d[k]) for k in PREDICTED_PARTS)
        return cls(parts, d["total"], d.get("host"), source=dict(d))

    def record(self) -> dict:
        return dict(self.source)


@dataclasses.dataclass(frozen=True)
class CompiledCost:
    """XLA's cost of one call per device (lab.measure.cost.compiled_cost), as the run prints
    it: FLOPs, bytes accessed, the trip counts of its loops, whether it is a lower bound."""

    flops: float | None
    bytes_accessed: float | None
    loop_trips: tuple[int, ...]  # the known trip counts of its while loops
    lower_bound_note: str  # '' or the words that say the figures are at least this
    source: dict | None = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def from_record(cls, d: dict | None) -> "CompiledCost":
        c = d or {}
        trips = tuple(n for _, n in c.get("loops", []) if n)
        return cls(c.get("flops"), c.get("bytes accessed"), trips, lower_bound_note(c), d)

    def record(self) -> dict | None:
        return self.source


# A plan whose step does not fit the target's memory still gets a step time, tokens/s and MFU
# (what the program would do with the memory it needs); each carries this, so none reads as a
# step the target can run.
CANNOT_RUN = "for a step that cannot run on this target as configured: it does not fit in memory"


def cannot_run(fit: str) -> bool:
    """The plan's fit line says the step does not fit the target (short, or refused)."""
    return fit.startswith("does NOT fit")


@dataclasses.dataclass(frozen=True)
class PlanFigures:
    """A plan's (compiled, not run) fit and step time: summary.json's "aot"."""

    fit: str
    estimated_step_s: float | None
    estimate_source: str
    implied_mfu: float | None
    label: str
    source: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def cannot_run(self) -> bool:
        """The step does not fit the target: its time, tokens/s and MFU are labelled so."""
        return cannot_run(self.fit)

    @property
    def mfu_is_a_bound(self) -> bool:
        """The estimate is the roofline's floor, so the MFU is at most this."""
        return self.estimate_source.startswith("roofline floor")

    @property
    def estimate_how(self) -> str:
        """Where the step time comes from, with its error: the compiler's own estimate
        (labelled compiled, not run) carries its error apart (`estimate_error`); a model's
        time or a floor says it in its source."""
        return estimate_with_error(self.estimate_source, self.source.get("estimate_error"))

    @classmethod
    def from_record(cls, d: dict) -> "PlanFigures":
        keys = ("fit", "estimated_step_s", "estimate_source", "implied_mfu", "label")
        return cls(*(d[k] for k in keys), source=dict(d))

    def record(self) -> dict:
        return dict(self.source)


@dataclasses.dataclass(frozen=True)
class StepAnalysis:
    """The compiled step per device (lab.summary.analyse): memory compiled and predicted,
    cost, FLOPs per token; offloading, a pipeline, notes; a plan's figures."""

    compiled_memory: tuple[tuple[str, Any], ...]  # (field, bytes) as the compiler reports
    predicted_memory: PredictedMemory
    compiled_cost: CompiledCost
    model_flops_per_token: float
    flops_convention: str
    tokens_per_step: int | None = None
    notes: tuple[str, ...] = ()
    pipeline: PipelineReading | None = None
    offload: OffloadCost | None = None
    plan: PlanFigures | None = None
    capacity_bytes: float | None = None
    predicted_step: PredictedStep | None = None
    source: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def compiled_total_bytes(self):
        return dict(self.compiled_memory).get("total_bytes")

    @classmethod
    def from_record(cls, a: dict) -> "StepAnalysis":
        """From the analysis (or the whole summary) as summary.json keeps it."""
        keys = (
            "compiled_memory_per_device",
            "predicted_memory_per_device",
            "compiled_cost_per_device",
            "model_flops_per_token",
            "flops_convention",
            "tokens_per_step",
            "notes",
            "pipeline",
            "offload",
            "aot",
            "capacity_bytes_per_device",
            "predicted_step",
            "device_kind",
        )
        return cls(
            compiled_memory=tuple((a["compiled_memory_per_device"] or {}).items()),
            predicted_memory=PredictedMemory.from_record(a["predicted_memory_per_device"]),
            compiled_cost=CompiledCost.from_record(a["compiled_cost_per_device"]),
            model_flops_per_token=a["model_flops_per_token"],
            flops_convention=a["flops_convention"],
            tokens_per_step=a.get("tokens_per_step"),
            notes=tuple(a.get("notes", ())),
            pipeline=a.get("pipeline") and PipelineReading.from_record(a["pipeline"]),
            offload=a.get("offload") and OffloadCost.from_record(a["offload"]),
            plan=PlanFigures.from_record(a["aot"]) if "aot" in a else None,
            capacity_bytes=a.get("capacity_bytes_per_device"),
            predicted_step=a.get("predicted_step")
            and PredictedStep.from_record(a["predicted_step"]),
            source={k: a[k] for k in keys if k in a},
        )

    def record(self) -> dict:
        return dict(self.source)


STEP_TIME_KEYS = ("median_s", "p10_s", "p90_s", "runs", "compile_s")


@dataclasses.dataclass(frozen=True)
class StepTime:
    """The measured step time (lab.measure.timing.BenchResult's record)."""

    median_s: float
    p10_s: float
    p90_s: float
    runs: int
    compile_s: float


@dataclasses.dataclass(frozen=True)
class PredictedVsMeasured:
    """The step-time model's seconds beside the measured median."""

    seconds: float
    ratio_to_measured: float
    error: str
    caveat: str = ""  # why the ratio may land outside the error (a busy host)


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """A finished run (lab.summary.summarise_run): its step analysis, the measured time,
    throughput, MFU, memory in use and the loss."""

    analysis: StepAnalysis
    step_time: StepTime
    tokens_per_s: float
    tokens_per_s_per_device: float
    mfu: float | None
    peak_source: str
    peak_bytes_in_use: float | None = None
    predicted: PredictedVsMeasured | None = None
    loss_first: float | None = None
    loss_last: float | None = None
    # after a resume: the step the run resumed from, and the first loss of this segment
    resumed_from: int | None = None
    segment_loss_first: float | None = None
    loss_first_step: int | None = None  # the step of loss_first, after a resume
    profiled_steps: tuple | None = None  # (first, last) traced by profile=true: not timed
    warmup_timed: bool = False  # the times are warm-up steps (a run too short for others)
    # (count, total seconds) of the checkpoint saves the loop waited for: not in the step time
    checkpoint_saves: tuple | None = None
    source: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_record(cls, s: dict) -> "RunSummary":
        """From summary.json's form (lab.summary.summarise_run)."""
        st, p = s["step_time"], s.get("predicted_step_time")
        return cls(
            analysis=StepAnalysis.from_record(s),
            step_time=StepTime(*(st[k] for k in STEP_TIME_KEYS)),
            tokens_per_s=s["tokens_per_s"],
            tokens_per_s_per_device=s["tokens_per_s_per_device"],
            mfu=s["mfu"],
            peak_source=s["peak_source"],
            peak_bytes_in_use=(s["memory_stats"] or {}).get("peak_bytes_in_use"),
            predicted=p
            and PredictedVsMeasured(
                p["seconds"], p["ratio_to_measured"], p["error"], p.get("caveat", "")
            ),
            loss_first=s["loss_first"],
            loss_last=s["loss_last"],
            resumed_from=s.get("resumed_from"),
            segment_loss_first=s.get("segment_loss_first"),
            loss_first_step=s.get("loss_first_step"),
            profiled_steps=tuple(s["profiled_steps"]) if s.get("profiled_steps") else None,
            warmup_timed=bool(s.get("warmup_timed")),
            checkpoint_saves=(
                (s["checkpoint_saves"]["count"], s["checkpoint_saves"]["total_s"])
                if s.get("checkpoint_saves")
                else None
            ),
            source=dict(s),
        )

    def record(self) -> dict:
        return dict(self.source)

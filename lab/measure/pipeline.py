"""What a pipelined step sends between stages, as frozen types: one direction's stage
permutes, and the whole reading (the schedule on paper beside the compiled program).

With accumulate=K the schedule runs once per accumulation microbatch: the ticks and the
bubble are one run's, the bytes a step's (K runs).

lab.parallel.pipeline_hlo reads them from a compiled program; they sit here, below
lab.report, so the renderer (lab/report/tables/explain.py) takes the reading itself and uses
its fields and properties, instead of a dict whose keys it must know. `as_dict()` is the form
the run's summary.json keeps, and `from_record()` reads that form back.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Direction:
    """The stage permutes of one direction, as the compiled program runs them."""

    ops: int  # collective-permute instructions in the HLO
    executions: int  # per step per device (an op in a loop runs once per trip)
    trip_counts: tuple[int, ...]  # executions per step of each op: nested loops multiplied
    bytes_per_device: int
    # the own trip counts of the innermost loops they sit in: the tick loop's, without an
    # accumulation loop around it (which multiplies `trip_counts` by accumulate=K)
    loop_trips: tuple[int, ...] = ()

    @classmethod
    def from_record(cls, d: dict) -> "Direction":
        return cls(
            **{
                **d,
                "trip_counts": tuple(d["trip_counts"]),
                "loop_trips": tuple(d.get("loop_trips", ())),
            }
        )


@dataclasses.dataclass(frozen=True)
class PipelineReading:
    """A pipelined step: the schedule on paper beside what the compiled program does."""

    stages: int
    microbatches: int
    repeats: int
    microbatch_bytes: int  # a: one microbatch's activations on one device
    ticks: int  # analytic, per run of the schedule
    bubble: float  # analytic, (P-1)/(repeats·M+P-1)
    bytes_per_device: int  # analytic, per direction, per step: K·ticks·a
    useful_bytes: int  # analytic, per direction, per data replica, per step: K·M·(repeats·P-1)·a
    forward: Direction
    backward: Direction
    weights_split: int = 0  # analytic: block weights split over a batch axis (fsdp) as well
    weight_gathers: Direction | None = None  # compiled: their all-gathers in the pipeline
    weight_scatters: Direction | None = None  # compiled: their gradients' reduce-scatters
    accumulate: int = 1  # K: the schedule runs once per accumulation microbatch

    @property
    def compiled_ticks(self) -> int | None:
        """One run of the schedule's ticks in the compiled program: its forward stage
        permutes' executions (one a tick) over the K runs a step (an accumulation loop around
        the tick loop runs it K times). Not the tick loop's trip count alone: XLA may peel a
        tick out of the loop, as XLA:TPU does under remat=offload (one permute before a loop
        of P+M-2 trips, or of those inside the accumulation loop)."""
        runs, k = self.forward.executions, max(1, self.accumulate)
        if runs and runs % k == 0:
            return runs // k
        return max(self.forward.loop_trips, default=None) or None  # K runs not all alike

    @property
    def compiled_bubble(self) -> float | None:
        """The bubble counted from the compiled schedule: idle ticks over ticks."""
        t = self.compiled_ticks
        return (t - self.repeats * self.microbatches) / t if t else None

    def as_dict(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "compiled_ticks": self.compiled_ticks,
            "compiled_bubble": self.compiled_bubble,
        }

    @classmethod
    def from_record(cls, d: dict) -> "PipelineReading":
        """The reading back from its `as_dict()` (a summary.json's "pipeline"): the derived
        figures are dropped, since the properties compute them again from the fields."""
        fields = {f.name for f in dataclasses.fields(cls)}
        kept = {k: v for k, v in d.items() if k in fields}
        for k in ("forward", "backward", "weight_gathers", "weight_scatters"):
            if kept.get(k) is not None:
                kept[k] = Direction.from_record(kept[k])
        return cls(**kept)

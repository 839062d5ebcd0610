"""What lab.studies.scaling measures, as frozen types: one row per strong-scaling run, per
extrapolated device count and per remat × batch point, and the study that holds the three.

The study makes the figures as records (lab.measure.records: one JSON record each, several to
a row); these types sit here, below lab.report, so the scaling tables and plot
(lab/report/tables/parallelism.py `scaling`, lab/report/plots.py `scaling_study`) read their
fields instead of the records whose keys they must know. `from_records()` groups a study's
records into its rows, `records()` gives them back, dict for dict and in their order.
"""

import copy
import dataclasses

STEP = "step time"
COLLECTIVES = "collective time (HLO bytes / measured busbw)"
COMPUTE = "compute time (step - collectives)"
MEMORY = "memory per device"
NO_OVERLAP = "DP efficiency (extrapolated, no overlap)"
OVERLAP = "DP efficiency (extrapolated, perfect overlap)"
PEAK = "peak memory per device"

# the `experiment` of each kind of row's records
STRONG, EXTRAPOLATED, REMAT = "scaling", "dp extrapolation", "remat"


def _value(recs: tuple[dict, ...], what: str):
    return next((r["value"] for r in recs if r["what"] == what), None)


def _first(recs: tuple[dict, ...], what: str) -> dict | None:
    return next((r for r in recs if r["what"] == what), None)


def _copies(recs: tuple[dict, ...]) -> list[dict]:
    return copy.deepcopy(list(recs))  # a caller may add keys to what it is given


@dataclasses.dataclass(frozen=True)
class StrongPoint:
    """One strategy on `devices` devices at the fixed global batch: the measured step, its
    split into collectives (derived) and compute (the rest), the compiled memory per device."""

    strategy: str
    devices: int
    mesh: str  # the mesh spec it ran on
    step_s: float | None  # median measured step
    collective_s: float | None  # HLO bus bytes / measured bus bandwidth (derived)
    compute_s: float | None  # step - collectives (derived)
    memory_bytes: float | None  # memory_analysis per device
    simulated: bool  # CPU devices simulated on one host
    source: tuple[dict, ...] = dataclasses.field(default=(), compare=False, repr=False)

    @classmethod
    def from_records(cls, recs) -> "StrongPoint":
        recs = tuple(recs)
        c = recs[0]["config"]
        return cls(
            c["strategy"],
            c["devices"],
            c["mesh"],
            _value(recs, STEP),
            _value(recs, COLLECTIVES),
            _value(recs, COMPUTE),
            _value(recs, MEMORY),
            bool(c.get("simulated_devices")),
            source=recs,
        )

    def records(self) -> list[dict]:
        return _copies(self.source)

    @property
    def step_spread(self) -> tuple[float, float] | None:
        """(p10, p90) seconds of the timed steps, where the record holds them."""
        c = (_first(self.source, STEP) or {}).get("config", {})
        return (c["p10_s"], c["p90_s"]) if "p10_s" in c and "p90_s" in c else None


@dataclasses.dataclass(frozen=True)
class DPExtrapolation:
    """Data-parallel efficiency at `devices` devices, extrapolated (predicted): measured
    compute of one device at the per-device batch, the ring all-reduce at a bandwidth."""

    devices: int
    per_device_batch: int
    compute_s: float  # measured on one device
    comm_s: float  # the all-reduce's bytes over the bandwidth (model)
    efficiency: float | None  # compute / (compute + comm): no overlap
    efficiency_overlap: float | None  # compute / max(compute, comm): perfect overlap
    bandwidth_source: str
    simulated: bool
    # the model's step on the devices whose bandwidth it uses, against dp's step measured
    # there: {"devices", "predicted_s", "measured_s", "ratio"}; None where none was measured
    check: dict | None = None
    source: tuple[dict, ...] = dataclasses.field(default=(), compare=False, repr=False)

    @classmethod
    def from_records(cls, recs) -> "DPExtrapolation":
        recs = tuple(recs)
        c = recs[0]["config"]
        return cls(
            c["devices"],
            c["per_device_batch"],
            c["compute_s"],
            c["comm_s"],
            _value(recs, NO_OVERLAP),
            _value(recs, OVERLAP),
            c["bandwidth_source"],
            bool(c.get("simulated_devices")),
            check=c.get("check"),
            source=recs,
        )

    def records(self) -> list[dict]:
        return _copies(self.source)


@dataclasses.dataclass(frozen=True)
class RematPoint:
    """One remat policy at one batch on one device (scanned blocks): the compiled step's
    peak memory and temporaries, its measured step time."""

    remat: str
    batch: int
    step_s: float | None
    peak_bytes: float | None  # memory_analysis
    temp_bytes: float | None
    source: tuple[dict, ...] = dataclasses.field(default=(), compare=False, repr=False)

    @classmethod
    def from_records(cls, recs) -> "RematPoint":
        recs = tuple(recs)
        c = recs[0]["config"]
        peak = _first(recs, PEAK)
        temp = peak["config"].get("temp_bytes") if peak else None
        return cls(c["remat"], c["batch"], _value(recs, STEP), _value(recs, PEAK), temp, recs)

    def records(self) -> list[dict]:
        return _copies(self.source)


_ROWS = {
    STRONG: (StrongPoint, ("strategy", "devices")),
    EXTRAPOLATED: (DPExtrapolation, ("devices",)),
    REMAT: (RematPoint, ("remat", "batch")),
}


@dataclasses.dataclass(frozen=True)
class ScalingStudy:
    """The three experiments' rows, each in the order it was measured."""

    strong: tuple[StrongPoint, ...] = ()
    extrapolated: tuple[DPExtrapolation, ...] = ()
    remat: tuple[RematPoint, ...] = ()

    @property
    def simulated(self) -> bool:
        """Any figure came from CPU devices simulated on one host."""
        return any(p.simulated for p in (*self.strong, *self.extrapolated))

    @classmethod
    def from_records(cls, recs: list[dict]) -> "ScalingStudy":
        """The rows of a study's records (records of other experiments are left out)."""
        groups = {kind: {} for kind in _ROWS}
        for r in recs:
            kind = r["config"].get("experiment")
            if kind in _ROWS:
                key = tuple(r["config"].get(k) for k in _ROWS[kind][1])
                groups[kind].setdefault(key, []).append(r)
        rows = {k: tuple(_ROWS[k][0].from_records(g) for g in groups[k].values()) for k in _ROWS}
        return cls(rows[STRONG], rows[EXTRAPOLATED], rows[REMAT])

    def records(self) -> list[dict]:
        return [r for p in (*self.strong, *self.extrapolated, *self.remat) for r in p.records()]

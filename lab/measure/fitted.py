"""The step-time model's fitted parameters (lab.predict.machines.fit), as a frozen type.

lab.studies.prediction fits them and lab/predict/fits.json keeps them; the type sits here,
below lab.report, so the prediction tables (lab/report/tables/prediction.py) read its fields
instead of the dict whose keys they must know. `record()` is the form fits.json keeps,
`from_record()` reads it back.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Fit:
    """Shares of a machine's roofs the model's steps reach, and its fixed costs."""

    compute_efficiency: float  # share of the matmul peak
    memory_efficiency: float  # share of the memory (copy) bandwidth
    op_overhead_s: float  # seconds per op
    link_latency_s: float | None = None  # seconds per collective (not fitted on a CPU)
    call_overhead_s: float | None = None  # seconds per call of the program (accelerators)

    @classmethod
    def from_record(cls, d: dict) -> "Fit":
        return cls(**d)

    def record(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def fits_of(records: dict) -> dict[str, Fit]:
    """{vendor: Fit} from {vendor: fitted parameters} (a validation's fits)."""
    return {v: Fit.from_record(f) for v, f in records.items()}

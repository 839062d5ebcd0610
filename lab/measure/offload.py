"""What offloading to host memory moves per step and what it would cost, as a frozen type.

lab.summary works it out from the compiled memory and the host link; it sits here, below
lab.report, so the run's renderer (lab/report/tables/run.py) takes it and reads its fields,
instead of a dict whose keys it must know. `record()` is the form summary.json keeps,
`from_record()` reads it back.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class OffloadCost:
    """Bytes each way per step, and the time they would add at the host link's bandwidth with
    no overlap with compute: what the step would grow by at most, so predicted."""

    bytes_to_device: int
    bytes_to_host: int
    host_to_device_bytes_per_s: float | None
    device_to_host_bytes_per_s: float | None
    bandwidth_source: str
    added_step_s: float | None  # None: no host-link bandwidth for this device
    label: str = "predicted"

    def record(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, d: dict) -> "OffloadCost":
        return cls(**d)

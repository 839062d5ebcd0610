"""A step's predicted time as frozen types: each op the step-time model timed, and the step.

lab.predict times a compiled program; its result sits here, below lab.report, so the run's
renderer (lab/report/tables/run.py) takes the prediction itself and reads its fields and
properties, instead of a dict whose keys it must know. `record()` is the form summary.json
keeps (key for key what the run wrote before), `from_record()` reads it back.
"""

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class OpTime:
    """One instruction of the schedule, as the model times it (all executions per call)."""

    name: str
    opcode: str
    kind: str  # compute | memory | collective | custom | overhead
    count: int  # executions per call
    flops: float  # per execution
    bytes: float  # per execution (bus bytes for a collective)
    seconds: float  # all executions
    exposed_s: float  # of `seconds`, what no overlapped compute hides (collectives)
    op_name: str = ""  # the JAX op it came from

    @property
    def what(self) -> str:
        """The JAX op's last name, or the opcode where the op carries none. The name path
        nests transforms, as in `transpose(jvp(f/convert_element_type))`: the closing
        parentheses of the outer ones are not the last name's."""
        last = self.op_name.rsplit("/", 1)[-1]
        while last.endswith(")") and last.count(")") > last.count("("):
            last = last[:-1]
        return last or self.opcode


@dataclasses.dataclass(frozen=True)
class PredictedStep:
    """One training step as the step-time model predicts it on a machine, labelled with the
    model's measured error."""

    seconds: float
    breakdown: Mapping[str, float]  # compute, memory, exposed communication, … → seconds
    collective_s: float  # every collective, overlapped or not
    machine: str
    top_ops: tuple[OpTime, ...]  # the ops the step spends most on, most first
    error: str  # the model's measured error where the machine is of this kind
    machine_source: str  # where the machine's figures come from
    label: str = "predicted"

    @property
    def shares(self) -> list[tuple[str, float]]:
        """Each part of the breakdown as a share of the whole, largest first."""
        total = sum(self.breakdown.values()) or 1.0
        return sorted(((k, v / total) for k, v in self.breakdown.items()), key=lambda kv: -kv[1])

    def record(self) -> dict:
        return {
            "seconds": self.seconds,
            "breakdown": dict(self.breakdown),
            "collective_s": self.collective_s,
            "machine": self.machine,
            "top_ops": [dataclasses.asdict(o) for o in self.top_ops],
            "label": self.label,
            "error": self.error,
            "machine_source": self.machine_source,
        }

    @classmethod
    def from_record(cls, d: dict) -> "PredictedStep":
        return cls(
            seconds=d["seconds"],
            breakdown=dict(d["breakdown"]),
            collective_s=d["collective_s"],
            machine=d["machine"],
            top_ops=tuple(OpTime(**o) for o in d["top_ops"]),
            error=d["error"],
            machine_source=d["machine_source"],
            label=d["label"],
        )

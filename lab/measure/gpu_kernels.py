"""One GPU kernel of a compiled program as the compiler built it (registers, spills, shared
memory, launch shape, occupancy): *compiled, not run*.

The type sits here, below lab.report, so the kernel tables (lab/report/tables/compiled.py)
take it instead of dicts whose keys they must know; lab/plans/resources.py reads the figures
from the compiler and builds it. `record()` is the dict summary.json has always held for a
kernel, and `from_record` reads one back.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One GPU kernel of a compiled program, as the compiler built it."""

    name: str
    # per call, × the trips of the loops around it; None where the compiled program does not
    # say (Mosaic GPU kernels: their launches are not in XLA's thunk sequence)
    launches: int | None
    grid: tuple | None  # blocks (x, y, z); None where the dump does not say
    threads: int  # per block
    registers: int  # per thread
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int  # per thread: local memory for spills and local arrays
    static_smem: int  # bytes, from ptxas
    dynamic_smem: int  # bytes, from the launch
    blocks_per_sm: int  # resident blocks one SM holds (0: it cannot launch)
    limiter: str  # what bounds blocks_per_sm: regs, smem, warps, blocks (or why it cannot run)
    occupancy: float  # resident warps / 64
    notes: tuple = ()  # ptxas performance remarks, e.g. C7515 (wgmma serialised)
    # launched inside a loop whose trip count the program does not state: that loop counted
    # once, so `launches` is a lower bound
    launches_unknown_loop: bool = False

    @property
    def smem(self) -> int:
        return self.static_smem + self.dynamic_smem

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes

    def record(self) -> dict:
        """Every field, and the two sums, as summary.json holds a kernel."""
        return {**dataclasses.asdict(self), "smem": self.smem, "spill_bytes": self.spill_bytes}

    @classmethod
    def from_record(cls, r: dict) -> "Kernel":
        """The kernel of a `record()` (read back from JSON: lists where tuples were)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        k = {n: v for n, v in r.items() if n in fields}
        k["grid"] = tuple(k["grid"]) if k.get("grid") is not None else None
        k["notes"] = tuple(k.get("notes", ()))
        return cls(**k)

"""What the attention studies measured, as frozen types: one implementation at one point of the
sweep as it was measured (`Measured`) and as its records give it back (`SweepRow`), a lab
kernel's verdict against the GPU-speed targets (`TargetVerdict`) and the kernel compiled for a
target (`PlanPoint`).

They sit here, below lab.report, so the renderers (lab/report/tables/attention.py,
lab/report/tables/compiled.py, lab/report/plots.py, lab/report/markdown.py) take the types
instead of dicts whose keys they must know. Derived figures are properties computed from the
measured ones, so each has one definition. The records the studies write keep their fields:
the ledger and the tests read them by key.
"""

import dataclasses

from lab.measure.gpu_kernels import Kernel
from lab.measure.timing import BenchResult
from lab.measure.toolchain import Toolchain

TIME = "attention time"
TFLOPS = "attention TFLOP/s"
MAX_ERROR = "attention max error"
PEAK_TEMP = "attention peak temp memory"
SKIPPED = "attention skipped"
RATIO = "attention time ratio vs "  # + the baseline's name


@dataclasses.dataclass(frozen=True)
class Measured:
    """One implementation at one (seq, causal, mode) of the sweep, as it was measured:
    compiled always (or refused), timed and checked where it fit."""

    impl: str
    compile_s: float  # seconds to build its program (0 where it did not build)
    memory: dict | None  # lab.measure.memory.compiled_memory; None: not built, or not XLA's
    skipped: str | None  # why it was not timed, or None
    bench: BenchResult | None = None  # seconds per call (timing.compare); None: not timed
    inner: int | None = None  # calls per timed sample (the same for every contender)
    ratio: float | None = None  # median over the baseline's; None where the baseline did not run
    max_error: float | None = None  # max |out − ref| / max |ref| against float64

    @property
    def ran(self) -> bool:
        return self.bench is not None


@dataclasses.dataclass(frozen=True)
class SweepRow:
    """One (impl, seq, causal, mode) of the sweep as its records hold it
    (lab.studies.attention.rows_of): each figure None where no record gave it."""

    impl: str
    seq: int  # L = S
    causal: bool
    mode: str  # fwd or fwd+bwd
    time_s: float | None = None  # median seconds per call; None where it was not timed
    tflops: float | None = None  # analytic FLOPs over time_s (derived)
    max_error: float | None = None  # relative, against float64
    ratio: float | None = None  # time over the baseline's
    peak_temp_bytes: float | None = None  # XLA's temporary allocation of the program
    memory_label: str | None = None  # the memory's label: compiled, or compiled, not run
    memory_excludes: str | None = None  # what the memory figure leaves out (a native kernel's)
    skipped: str | None = None  # why it was not timed

    @property
    def ran(self) -> bool:
        return self.time_s is not None

    @classmethod
    def from_records(cls, point: dict, records: list[dict]) -> "SweepRow":
        """The row of one point ({impl, seq, causal, mode}) from the records of that point."""
        figures = {}
        for r in records:
            what = r["what"]
            if what == TIME:
                figures["time_s"] = r["value"]
            elif what == TFLOPS:
                figures["tflops"] = r["value"]
            elif what == MAX_ERROR:
                figures["max_error"] = r["value"]
            elif what.startswith(RATIO):
                figures["ratio"] = r["value"]
            elif what == PEAK_TEMP:
                figures.update(peak_temp_bytes=r["value"], memory_label=r["label"])
                figures["memory_excludes"] = r["config"].get("excludes")
            elif what == SKIPPED:
                figures["skipped"] = r["value"]
        return cls(**point, **figures)


@dataclasses.dataclass(frozen=True)
class TargetVerdict:
    """A lab kernel at one point of the GPU-speed grid against its target
    (lab.studies.targets.judge)."""

    kernel: str  # the lab kernel judged (pallas_mgpu or pallas_gpu)
    head_dim: int
    seq: int  # L = S
    causal: bool
    mode: str  # fwd or fwd+bwd
    target: float  # the speed it must reach: reference time / kernel time
    met: bool  # speed at least the target and ahead of every peer it must beat that ran
    note: str  # why it was not met ('' where nothing is to be said)
    reference: str | None = None  # cuDNN, or the fastest fallback; None: none ran
    kernel_s: float | None = None  # the kernel's median seconds per call; None: it did not run
    reference_s: float | None = None  # the reference's median
    kernel_tflops: float | None = None  # the kernel's TFLOP/s (derived)
    reference_tflops: float | None = None  # the reference's
    ahead_of: tuple[str, ...] = ()  # peers it must beat that it was faster than

    @property
    def speed(self) -> float | None:
        """Reference time over the kernel's: above 1 the kernel is faster."""
        if self.kernel_s is None or self.reference_s is None:
            return None
        return self.reference_s / self.kernel_s


@dataclasses.dataclass(frozen=True)
class PlanPoint:
    """The attention kernel compiled for a target at one (seq, head_dim, mode): the
    compiler's figures per device, the analytic FLOPs and the time floor they imply (compiled,
    not run; lab.studies.plan)."""

    mode: str  # fwd or fwd+bwd
    seq: int | None  # L = S
    head_dim: int | None  # K
    device_kind: str  # the target's
    devices: int  # devices of the mesh
    compile_s: float
    memory: dict | None  # lab.measure.memory.compiled_memory per device
    hbm_bytes: float | None  # what a program may hold: a TPU compiler's HBM, else the spec sheet's
    compiled_flops: float | None  # XLA's cost analysis per device (misses a Mosaic call)
    compiled_flops_note: str  # '' or why compiled_flops is a lower bound
    analytic_flops_per_device: float  # lab.measure.cost.attention_flops over the devices
    # seconds per call (predicted): compiler estimate floored by the roofline; where the
    # compiled cost is an upper bound, the roofline of the analytic FLOPs and the bytes read
    # and written once
    estimated_s: float | None
    estimate_source: str  # how estimated_s was reached
    peak_flops: float | None  # the chip's peak FLOP/s at the dtype (spec sheet)
    impl: str  # the kernel the dispatch chose for the target
    attention_note: str | None  # why it passed over the one it prefers there, or None
    kernels: tuple[Kernel, ...] = ()  # on a GPU target, every kernel of the program
    toolchain: Toolchain | None = None  # on a GPU target, the compiler the kernels are from
    mask: str = ""  # the mask compiled: causal, full, "window 1,024", "docs of 1,024"
    # FLOPs per device of the tiles the kernels visit, from the block map that skips them
    # (each kernel's kernel_cost), with the segment ids known; None: a kernel with no count
    kernel_flops: float | None = None
    # the same from the mask's static part (causal, window): what the pallas_calls' cost
    # estimates carry, since segment ids are data when they are traced
    kernel_flops_static: float | None = None
    # what is known of estimated_s's error, in words: a floor's source, or the compiler's
    # estimate unchecked by any measurement there and its ratio to the floor (estimate_over_floor)
    estimate_error: str | None = None
    estimate_over_floor: float | None = None

    @property
    def estimate_is_a_floor(self) -> bool:
        """The time is the roofline's floor: a least, so the rates it implies are a most."""
        return self.estimate_source.startswith("roofline floor")

    @property
    def estimate_compiled(self) -> bool:
        """Whether the compiled count holds the kernels' cost estimates (Mosaic TPU; Mosaic
        GPU from jax 0.11, read from its backend config): not where a lowering drops them
        (Triton; Mosaic GPU on 0.10), leaving ~0 for the kernels."""
        if self.compiled_flops is None or not self.kernel_flops_static:
            return False
        return self.compiled_flops >= 0.99 * self.kernel_flops_static

    @property
    def flops(self) -> float | None:
        """FLOPs per device that count only the tiles the mask leaves: the compiled count
        where it holds the kernels' estimates and they are exact, else the block map's."""
        if self.kernel_flops is None:
            return self.compiled_flops
        if self.estimate_compiled and self.kernel_flops >= self.kernel_flops_static:
            return self.compiled_flops
        return self.kernel_flops

    @property
    def flops_source(self) -> str:
        """Where `flops` comes from, in words."""
        if self.kernel_flops is None:
            return "compiled"
        if not self.estimate_compiled:
            return "block map (this lowering drops the cost estimate: compiled counts ~0)"
        if self.kernel_flops < self.kernel_flops_static:
            return (
                "block map of the segment ids (compiled: an upper bound from the causal "
                "band, the ids being data when traced)"
            )
        return "compiled (the kernels' cost estimates)"

    @property
    def flops_derived(self) -> bool:
        """Whether `flops` is the lab's own count from the block map (label: derived), not a
        figure the compiler reported (compiled, not run)."""
        return self.kernel_flops is not None and self.flops_source.startswith("block map")

    @property
    def memory_bytes(self) -> float | None:
        return self.memory["total_bytes"] if self.memory else None

    @property
    def tflops(self) -> float | None:
        if not self.estimated_s:
            return None
        return self.analytic_flops_per_device / self.estimated_s / 1e12

    @property
    def peak_share(self) -> float | None:
        if not (self.estimated_s and self.peak_flops):
            return None
        return self.analytic_flops_per_device / self.estimated_s / self.peak_flops

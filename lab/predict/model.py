"""A step-time model of a compiled program: every op of the optimized HLO, timed on a machine.

The program is the one XLA compiled for the target (fusions, sharding, collectives and the
schedule as the compiler chose them), read by lab/measure/hlo.py: each instruction of a
non-fused computation runs `count` times per call (loop bodies their trip count). Each is
timed as follows, per execution:

    compute / memory op   max(FLOPs / (peak[dtype] · e_c), bytes / (bandwidth · e_m)) + t_op
    collective            bus bytes / (link bandwidth of its mesh axes) + t_link
    custom call           as a compute / memory op from the FLOPs and bytes given for it
                          (XLA counts none for a Pallas kernel: `custom_flops` supplies them)

where the bus bytes follow the ring algorithm (lab/measure/cost.bus_bytes), e_c and e_m are
the efficiencies a unit reaches on real shapes (fitted, never per point), and t_op, t_link a
fixed cost per launched op and per collective. An asynchronous collective (`*-start` …
`*-done`) overlaps the compute scheduled between its start and its done: only what that
compute does not cover is exposed. The step is the sum over the schedule plus t_call, a
fixed cost of one call of the program: what a program of one small kernel spends beyond its
work at the fitted rates (its launch, the kernel's pipeline filling and draining, the last
wave's idle units), on every backend alike.

What this leaves out, on purpose: cache effects, the shape efficiency of each individual
matmul (tile padding is folded into e_c), contention between overlapped ops.
"""

import dataclasses
import re
from collections.abc import Mapping

from lab.measure import cost as costs
from lab.measure import hlo
from lab.measure.predicted import OpTime

RINGS = ("all-reduce", "all-gather", "reduce-scatter")  # one ring per channel (NCCL's rings)
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPES = {
    "f32": "float32",
    "bf16": "bfloat16",
    "f16": "float16",
    "s8": "int8",
    "u8": "int8",
    "f8e4m3fn": "float8",
    "f8e5m2": "float8",
    "f64": "float32",
}


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the model needs to know of a target, each figure with where it came from."""

    name: str
    peak_flops: Mapping[str, float]  # dtype → FLOP/s of one device (dense)
    memory_bandwidth: float  # bytes/s of one device's memory
    link_bandwidth: Mapping[str, float]  # mesh axis → bytes/s one device sends over it
    compute_efficiency: float = 1.0  # e_c: share of peak a matmul reaches (fitted)
    memory_efficiency: float = 1.0  # e_m: share of the bandwidth a memory-bound op reaches
    op_overhead_s: float = 0.0  # t_op: fixed cost of launching one op
    # An accelerator's host queues ops ahead of the device, so launching one overlaps the work
    # of the one before: an op costs max(its work, t_op), not both (only ops shorter than a
    # launch are launch-bound). A CPU runs each op's thunk in turn: work + t_op.
    async_launch: bool = False
    link_latency_s: float = 0.0  # t_link: fixed cost of one collective
    # t_call: a fixed cost of one call of the whole program, added to its ops' time. It is
    # what a one-kernel benchmark spends beyond its work at the fitted rates (the launch, the
    # kernel's pipeline filling and draining, a last wave of tiles that leaves units idle).
    # Added, not a floor: as a floor (max(ops, t_call), calls queued back to back) the
    # calibration set's leave-one-out error was 25% median and 4.26× worst, against 10% and
    # 1.33× added, on the calibration set of 2026-11-28 (BENCHMARKS.md; the set has changed
    # since, and its leave-one-out error with it: `prediction loo=true` gives today's), and
    # the floor pulled the fitted compute efficiency down to 0.50 to make a 1024³ GEMM on an
    # A100 slow enough.
    call_overhead_s: float = 0.0
    # A ring collective (all-reduce, all-gather, reduce-scatter) over exactly these axes, where
    # it runs faster than its slowest axis alone: on a GPU cluster, a group with several
    # members per host runs one ring per member's network card (lab/predict/machines.py).
    ring_bandwidth: Mapping[frozenset, float] = dataclasses.field(default_factory=dict)
    devices_per_core_group: int = 1  # simulated devices sharing one set of cores (CPU: all)
    cache_bytes: float = 0.0  # an op whose bytes (× devices sharing it) fit here runs at …
    cache_bandwidth: float = 0.0  # … this bandwidth instead (CPU: the last-level cache)
    source: str = ""  # where the figures come from

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s at `dtype`; a dtype without its own figure runs at the float32 one (or
        the slowest listed)."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        return self.peak_flops.get("float32") or min(self.peak_flops.values())

    def link(self, axes: tuple[str, ...], kind: str = "") -> float:
        """Bandwidth of a collective of `kind` over `axes`: a ring collective's over exactly
        those axes where the machine gives one, else the slowest axis it spans."""
        if kind in RINGS and frozenset(axes) in self.ring_bandwidth:
            return self.ring_bandwidth[frozenset(axes)]
        known = [self.link_bandwidth[a] for a in axes if a in self.link_bandwidth]
        if known:
            return min(known)
        return min(self.link_bandwidth.values()) if self.link_bandwidth else float("inf")


@dataclasses.dataclass(frozen=True)
class Prediction:
    """The predicted time of one call of a compiled program, and where it goes."""

    seconds: float
    compute_s: float  # compute-bound ops
    memory_s: float  # memory-bound ops
    collective_s: float  # every collective, overlapped or not
    exposed_collective_s: float  # the part no compute hides
    custom_s: float  # custom calls (Pallas / Mosaic kernels)
    overhead_s: float  # fixed costs: per op and per call of the program
    ops: tuple[OpTime, ...]
    machine: str

    def top(self, n: int = 8) -> list[OpTime]:
        return sorted(self.ops, key=lambda o: -o.exposed_s)[:n]

    def breakdown(self) -> dict[str, float]:
        return {
            "compute": self.compute_s,
            "memory": self.memory_s,
            "exposed communication": self.exposed_collective_s,
            "custom kernels": self.custom_s,
            "op and call overhead": self.overhead_s,
        }

    def as_dict(self, top: int = 8) -> dict:
        return {
            "seconds": self.seconds,
            "breakdown": self.breakdown(),
            "collective_s": self.collective_s,
            "machine": self.machine,
            "top_ops": [dataclasses.asdict(o) for o in self.top(top)],
        }


def _dtype_of(ins: hlo.Instruction, program: hlo.Program, machine: Machine) -> str:
    """The dtype a compute op runs at: its first dot's operand (inside a fusion), else its
    result's. A float32 dot at default precision runs as TF32 where the machine has it
    (XLA:GPU's default on Ampere and later); `operand_precision={highest…}` keeps float32."""
    shape, attrs = ins.shape, ins.attrs
    for callee in re.findall(r"calls=%?([\w.\-]+)", ins.attrs):
        for inner in program.computations.get(callee, ()):
            if inner.opcode in ("dot", "convolution") and inner.operands:
                shape, attrs = program.shapes.get(inner.operands[0], shape), inner.attrs
                break
    if ins.opcode in ("dot", "convolution", "custom-call") and ins.operands:
        shape = program.shapes.get(ins.operands[0], shape)
    arrays = hlo.arrays(shape)
    dtype = _DTYPES.get(arrays[0][0], "float32") if arrays else "float32"
    if dtype == "float32" and "tf32" in machine.peak_flops and "highest" not in attrs:
        return "tf32"
    return dtype


def _fused_flops(program: hlo.Program, name: str, depth: int = 0) -> float:
    """FLOPs of a fused computation, nested fusions included."""
    total = 0.0
    for ins in program.computations.get(name, ()):
        total += hlo.instruction_cost(ins, program, name).flops
        if depth < 8:
            for callee in re.findall(r"calls=%?([\w.\-]+)", ins.attrs):
                total += _fused_flops(program, callee, depth + 1)
    return total


# Per program, what no fit changes: each op's FLOPs (nested fusions included), bytes and the
# dtype it runs at (per TF32 or not), so predicting a parsed program again (another machine,
# a Schedule built from it) does not recount them.
_OP_COSTS: dict[int, tuple] = {}


def _op_cost(program: hlo.Program, comp: str, ins: hlo.Instruction, machine) -> tuple:
    """(flops, bytes, dtype) of one op of `program`, cached per program."""
    entry = _OP_COSTS.get(id(program))
    if entry is None or entry[0] is not program:
        if len(_OP_COSTS) > 64:
            _OP_COSTS.clear()
        entry = _OP_COSTS[id(program)] = (program, {})
        # (a program object outlives its entry's use: the entry holds it, so ids never repeat)
    key = (comp, ins.name, "tf32" in machine.peak_flops)
    hit = entry[1].get(key)
    if hit is None:
        c = hlo.instruction_cost(ins, program, comp)
        flops = c.flops
        for callee in re.findall(r"calls=%?([\w.\-]+)", ins.attrs):
            flops += _fused_flops(program, callee)
        hit = entry[1][key] = (flops, c.bytes, _dtype_of(ins, program, machine))
    return hit


_SKIP = hlo._NO_BYTES | {"copy-done", "send-done", "recv-done", "all-gather-done"}


def _collective(ins: hlo.Instruction) -> str | None:
    base = ins.opcode.removesuffix("-start")
    return base if base in COLLECTIVES else None


def _custom_bytes(program: hlo.Program) -> float:
    """Bytes of the program's custom calls (not cuBLAS / cuDNN GEMMs) per call: what
    `custom_flops` is shared by."""
    customs = [
        (name, ins)
        for name in program.counts
        if name not in program.fused
        for ins in program.computations.get(name, ())
        if ins.opcode == "custom-call" and not any(t in ins.attrs for t in hlo._GEMM_TARGETS)
    ]
    return sum(hlo.instruction_cost(i, program, c).bytes * program.counts[c] for c, i in customs)


def _moved(ins: hlo.Instruction, kind: str, collectives: Mapping) -> tuple[float, tuple]:
    """(bus bytes, mesh axes) of a collective: as parsed with its mesh, else its result's
    bytes over the ring of two."""
    c = collectives.get(ins.name)
    if c is not None:
        return c.bus_bytes, c.axes
    return costs.bus_bytes(kind, sum(hlo.shape_sizes(ins.shape)), 2), ()


def _work(program, comp, ins, machine, custom_flops: float, custom_bytes: float):
    """(flops, bytes, seconds at peak, seconds at bandwidth, custom) of a compute or memory
    op, both at efficiency 1 (the machine's last-level cache where it fits); None for an
    op that moves and computes nothing."""
    flops, nbytes, dtype = _op_cost(program, comp, ins, machine)
    custom = ins.opcode == "custom-call" and not any(t in ins.attrs for t in hlo._GEMM_TARGETS)
    if custom and custom_flops and custom_bytes:
        flops = custom_flops * nbytes / custom_bytes
    if not flops and not nbytes:
        return None
    bandwidth = machine.memory_bandwidth
    if machine.cache_bandwidth and nbytes * machine.devices_per_core_group <= machine.cache_bytes:
        bandwidth = machine.cache_bandwidth
    return flops, nbytes, flops / machine.peak(dtype), nbytes / bandwidth, custom


def predict(
    program: hlo.Program,
    machine: Machine,
    collectives: Mapping[str, object] | None = None,
    *,
    custom_flops: float = 0.0,
) -> Prediction:
    """The predicted time of one call of `program` on `machine`.

    `collectives`: instruction name → lab.parallel.collectives_hlo.Collective (bus bytes and
    mesh axes of each collective); a collective missing there moves its result's bytes over
    the slowest link. `custom_flops`: the FLOPs of the program's custom calls per call (XLA
    counts none inside a Pallas kernel), shared among them by their bytes.
    """
    collectives = collectives or {}
    custom_bytes = _custom_bytes(program)
    ops: list[OpTime] = []
    sums = dict(compute=0.0, memory=0.0, collective=0.0, exposed=0.0, custom=0.0, overhead=0.0)
    for comp, count in program.counts.items():
        if comp in program.fused:
            continue
        pending: dict[str, list] = {}  # async collective name → [seconds, compute seen since]
        for ins in program.computations.get(comp, ()):
            op = ins.opcode
            if op.endswith("-done"):
                start = ins.operands[0] if ins.operands else ""
                if start in pending:
                    seconds, covered, index = pending.pop(start)
                    exposed = max(0.0, seconds - covered)
                    ops[index] = dataclasses.replace(ops[index], exposed_s=exposed * count)
                    sums["exposed"] += exposed * count
                continue
            if op in _SKIP:
                continue
            kind = _collective(ins)
            if kind:
                moved, axes = _moved(ins, kind, collectives)
                link = machine.link(axes, kind)
                seconds = moved / link + machine.link_latency_s if moved else 0.0
                is_async = op.endswith("-start")
                ops.append(
                    OpTime(
                        ins.name,
                        op,
                        "collective",
                        count,
                        0.0,
                        moved,
                        seconds * count,
                        0.0 if is_async else seconds * count,
                        _op_name(ins),
                    )
                )
                sums["collective"] += seconds * count
                if is_async:
                    pending[ins.name] = [seconds, 0.0, len(ops) - 1]
                else:
                    sums["exposed"] += seconds * count
                continue
            work = _work(program, comp, ins, machine, custom_flops, custom_bytes)
            if work is None:
                continue
            flops, nbytes, at_peak_s, at_bandwidth_s, custom = work
            compute_s = at_peak_s / machine.compute_efficiency
            memory_s = at_bandwidth_s / machine.memory_efficiency
            busy = max(compute_s, memory_s) * machine.devices_per_core_group
            if machine.async_launch:
                seconds = max(busy, machine.op_overhead_s)
            else:
                seconds = busy + machine.op_overhead_s
            which = "custom" if custom else ("compute" if compute_s >= memory_s else "memory")
            ops.append(
                OpTime(
                    ins.name,
                    op,
                    which,
                    count,
                    flops,
                    nbytes,
                    seconds * count,
                    seconds * count,
                    _op_name(ins),
                )
            )
            sums[which] += busy * count
            sums["overhead"] += (seconds - busy) * count
            for p in pending.values():
                p[1] += seconds
        for seconds, covered, index in pending.values():  # started, never awaited here
            exposed = max(0.0, seconds - covered)
            ops[index] = dataclasses.replace(ops[index], exposed_s=exposed * count)
            sums["exposed"] += exposed * count
    total = sums["compute"] + sums["memory"] + sums["custom"] + sums["overhead"] + sums["exposed"]
    sums["overhead"] += machine.call_overhead_s
    total += machine.call_overhead_s
    return Prediction(
        seconds=total,
        compute_s=sums["compute"],
        memory_s=sums["memory"],
        collective_s=sums["collective"],
        exposed_collective_s=sums["exposed"],
        custom_s=sums["custom"],
        overhead_s=sums["overhead"],
        ops=tuple(ops),
        machine=machine.name,
    )


class Schedule:
    """A program's ops on a machine reduced to what a fit does not change, so that its time
    under any fit is a few array operations, not a walk of every op: the same seconds as
    `predict(program, replace(machine, **fit), ...)` (tested), what fitting and the
    leave-one-out evaluate thousands of times. `machine`'s own fitted parameters are
    ignored: `seconds(**fit)` supplies them."""

    def __init__(self, program, machine, collectives=None, *, custom_flops: float = 0.0):
        import numpy as np

        collectives = collectives or {}
        custom_bytes = _custom_bytes(program)
        comp_s, mem_s, op_n = [], [], []  # per compute / memory op: seconds at e = 1, count
        coll_s, coll_n = [], []  # per collective: seconds without its latency, count, ...
        # ... whether it moves bytes, and the compute ops that cover it: [first, last) of
        # comp_s, from its start to its done (a synchronous one: empty, nothing hides it)
        coll_moved, ranges = [], []
        for comp, count in program.counts.items():
            if comp in program.fused:
                continue
            pending: dict[str, int] = {}  # async collective name → index in coll_*
            for ins in program.computations.get(comp, ()):
                op = ins.opcode
                if op.endswith("-done"):
                    start = ins.operands[0] if ins.operands else ""
                    if start in pending:
                        j = pending.pop(start)
                        ranges[j] = (ranges[j][0], len(comp_s))
                    continue
                if op in _SKIP:
                    continue
                kind = _collective(ins)
                if kind:
                    moved, axes = _moved(ins, kind, collectives)
                    coll_s.append(moved / machine.link(axes, kind) if moved else 0.0)
                    coll_moved.append(bool(moved))
                    coll_n.append(count)
                    ranges.append((len(comp_s), len(comp_s)))
                    if op.endswith("-start"):
                        pending[ins.name] = len(coll_s) - 1
                    continue
                work = _work(program, comp, ins, machine, custom_flops, custom_bytes)
                if work is None:
                    continue
                comp_s.append(work[2])
                mem_s.append(work[3])
                op_n.append(count)
            for j in pending.values():  # started, never awaited here: covered to the end
                ranges[j] = (ranges[j][0], len(comp_s))
        self._np = np
        self.comp_s, self.mem_s = np.array(comp_s, float), np.array(mem_s, float)
        self.op_n = np.array(op_n, float)
        self.coll_s, self.coll_n = np.array(coll_s, float), np.array(coll_n, float)
        self.coll_moved = np.array(coll_moved, bool)
        r = np.array(ranges, int).reshape(-1, 2)
        self.first, self.last = r[:, 0], r[:, 1]
        self.async_launch = machine.async_launch
        self.per_group = machine.devices_per_core_group

    def seconds(
        self,
        compute_efficiency: float = 1.0,
        memory_efficiency: float = 1.0,
        op_overhead_s: float = 0.0,
        link_latency_s: float = 0.0,
        call_overhead_s: float = 0.0,
    ) -> float:
        """The predicted seconds of one call under these fitted parameters."""
        np = self._np
        busy = np.maximum(self.comp_s / compute_efficiency, self.mem_s / memory_efficiency)
        busy = busy * self.per_group
        if self.async_launch:
            each = np.maximum(busy, op_overhead_s)
        else:
            each = busy + op_overhead_s
        total = float(each @ self.op_n)
        if self.coll_s.size:
            coll = np.where(self.coll_moved, self.coll_s + link_latency_s, 0.0)
            covered = np.concatenate([[0.0], np.cumsum(each)])
            hidden = covered[self.last] - covered[self.first]
            total += float(np.maximum(0.0, coll - hidden) @ self.coll_n)
        return total + call_overhead_s


def _op_name(ins: hlo.Instruction) -> str:
    m = re.search(r'op_name="([^"]*)"', ins.attrs)
    return m.group(1) if m else ""


def predict_compiled(compiled, machine: Machine, mesh=None, *, custom_flops: float = 0.0):
    """`predict` for a `jax.jit(...).lower(...).compile()` result on `mesh` (None: one device)."""
    text = compiled.as_text()
    program = hlo.parse(text)
    found = {}
    if mesh is not None:
        from lab.parallel import collectives_hlo

        found = {c.name: c for c in collectives_hlo.parse(text, dict(mesh.shape))}
    return predict(program, machine, found, custom_flops=custom_flops)


def at_roofs(compiled, peaks: Mapping[str, float], bandwidth: float, mesh=None) -> dict:
    """A compiled program with every op at its roof: max(FLOPs / peak[dtype], bytes /
    bandwidth) per op, `predict` with no efficiency below the roofs and no fixed cost, the
    collectives left out. {"seconds" (the ops' sum), "compute_s", "memory_s", "custom_s",
    "share" (the memory-bound ops' share of the time; None for a program of no work), "ops"
    (how many ops are memory-bound, how many compute-bound)}."""
    pred = predict_compiled(compiled, Machine("roofs", dict(peaks), bandwidth, {}), mesh)
    busy = pred.compute_s + pred.memory_s + pred.custom_s
    kinds = [o.kind for o in pred.ops]
    return {
        "seconds": busy,
        "compute_s": pred.compute_s,
        "memory_s": pred.memory_s,
        "custom_s": pred.custom_s,
        "share": pred.memory_s / busy if busy else None,
        "ops": (kinds.count("memory"), kinds.count("compute")),
    }

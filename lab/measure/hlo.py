"""The compiled program as data: its computations, their instructions, and how often each runs.

XLA's cost analysis (`compiled.cost_analysis()`) walks every computation of a module once: a
while loop's body is counted as if it ran one time. A scanned model (`nn.scan` over layers),
a pipeline's tick loop, a gradient-accumulation scan and a decode loop all run their body many
times, so their compiled FLOPs and bytes come out short by the loop's trip count. This module
reads the optimized HLO text (`compiled.as_text()`), finds how many times each computation runs
per call — a loop body its trip count times its caller's, nested loops multiplied — and counts
every instruction's FLOPs and bytes the way XLA's `HloCostAnalysis` does, so the body's share
can be added as many more times as the loop runs (`lab.measure.cost.compiled_cost`).

Trip counts: the loop's `known_trip_count` where the compiler records it (XLA:CPU, XLA:GPU), else
from its condition `i < N` (XLA:TPU drops the backend config), the counter's start and step read
from the loop's init tuple and body (a scan: 0 and 1; XLA:TPU's windowed einsum: 0 and 2). A
loop whose trip count neither gives is counted once and reported in `Program.unknown_loops`.

Per instruction, as XLA counts (one FLOP is one add or multiply):
    dot            2 · (output elements) · (contracted elements)
    convolution    2 · (output elements) · (kernel elements / output features)
    cuBLAS gemm    as a dot, from the dimension numbers in its backend config
    Pallas kernel  the flops and transcendentals of its `cost_estimate` where the custom
                   call carries it (Mosaic GPU, jax 0.11+); other kernels count 0
    elementwise    one FLOP per output element (exp, log, tanh, … are transcendentals instead)
    reduce         one FLOP per input element
Bytes are counted at the level of what reads and writes memory: the instructions of
non-fused computations (a fusion's inside stays in registers), each reading its operands and
writing its result; a fusion parameter only sliced reads the slice, a dynamic-update-slice
writes the update (both in place, as XLA counts them).
"""

import dataclasses
import json
import math
import re
from collections import defaultdict

_COMP_RE = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_WHILE_TRIP_RE = re.compile(r"\"known_trip_count\":\{\"n\":\"(?P<n>\d+)\"")
_COND_RE = re.compile(r"condition=%?(?P<cond>[\w.\-]+),\s*body=%?(?P<body>[\w.\-]+)")
_CALL_RE = re.compile(r"(?:calls|body|branch_computations)=\{?%?(?P<callee>[\w.\-]+)")
_CONST_RE = re.compile(
    r"\s*%?(?P<name>[\w.\-]+)\s*=\s*[su](?:8|16|32|64)\[\]\S*\s+constant\((?P<n>-?\d+)\)"
)
_INDEX_RE = re.compile(r"\bindex=(\d+)")
_SHAPE_RE = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")
_HEAD_RE = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*")

# Instructions that move no data of their own (aliases, tuples, control) or whose work is
# counted in the computations they call.
_NO_BYTES = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "while",
    "call",
    "conditional",
    "after-all",
    "partition-id",
    "replica-id",
    "iota",
    "opt-barrier",
    "add-dependency",
    "domain",
    # an asynchronous fusion's work (reads, writes, FLOPs) is its start's; the done only waits
    "fusion-done",
}
# A fusion run in place or asynchronously (XLA:GPU's `fusion-start` … `fusion-done`, e.g. a
# scan's in-place dynamic-update-slice of its stacked carries) is a fusion like any other: its
# computation stays in registers and its bytes are the fusion's operands and results.
FUSIONS = ("fusion", "fusion-start")
# The second and third halves of an async pair name the computation the start runs; they do
# not run it again.
_NOT_A_CALL = {"async-update", "async-done"}
_TRANSCENDENTAL = {
    "exponential",
    "exponential-minus-one",
    "log",
    "log-plus-one",
    "tanh",
    "logistic",
    "sqrt",
    "rsqrt",
    "cbrt",
    "power",
    "sine",
    "cosine",
    "tan",
    "atan2",
    "erf",
}
_ELEMENTWISE = {
    "add",
    "subtract",
    "multiply",
    "divide",
    "maximum",
    "minimum",
    "negate",
    "abs",
    "compare",
    "select",
    "clamp",
    "remainder",
    "sign",
    "floor",
    "ceil",
    "round-nearest-even",
    "round-nearest-afz",
    "and",
    "or",
    "xor",
    "not",
}
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cudnn$matmul")


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of an HLO element type (f32 → 4, bf16 → 2, pred → 1, f8e4m3fn → 1;
    s4/u4 count a whole byte)."""
    if dtype == "pred":
        return 1
    bits = re.match(r"[a-z]+(\d+)", dtype)
    return max(1, int(bits.group(1)) // 8) if bits else 0


def arrays(shape_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in an HLO type (a tuple gives several)."""
    return [
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _SHAPE_RE.findall(shape_text)
    ]


def shape_sizes(shape_text: str) -> list[int]:
    """Byte sizes of every array in an HLO result type (a tuple gives several)."""
    return [math.prod(dims) * dtype_bytes(dtype) for dtype, dims in arrays(shape_text)]


def elements(shape_text: str) -> int:
    """Elements of the first array of an HLO type (the result of a non-tuple op)."""
    a = arrays(shape_text)
    return math.prod(a[0][1]) if a else 0


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: `name = shape opcode(operands), attrs`."""

    name: str
    shape: str  # the result type, as printed (a tuple for several results)
    opcode: str
    operands: tuple[str, ...]  # instruction names
    attrs: str  # the rest of the line: dimension numbers, calls=, backend_config, metadata
    root: bool = False  # the computation's result


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at `start` ('(' or '{')."""
    opening = text[start]
    closing = {"(": ")", "{": "}"}[opening]
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c == opening:
            depth += 1
        elif c == closing:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def parse_instruction(line: str) -> Instruction | None:
    """An instruction line of HLO text, or None for anything else."""
    m = _HEAD_RE.match(line)
    if not m:
        return None
    i = m.end()
    if i < len(line) and line[i] == "(":  # a tuple type
        j = _balanced(line, i)
    else:
        j = line.find(" ", i)
        if j < 0:
            return None
    shape = line[i:j]
    rest = line[j:].lstrip()
    k = rest.find("(")
    if k <= 0:
        return None
    opcode = rest[:k]
    if not re.fullmatch(r"[a-z][\w\-]*", opcode):
        return None
    end = _balanced(rest, k)
    args = rest[k + 1 : end - 1]
    operands = tuple(n for n in re.findall(r"%([\w.\-]+)", args)) or tuple(
        a.strip().split(" ")[-1] for a in _split_top(args) if a.strip()
    )
    root = line.lstrip().startswith("ROOT")
    return Instruction(m.group("name"), shape, opcode, operands, rest[end:], root)


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets (operands printed without %)."""
    out, depth, cur = [], 0, []
    for c in text:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    out.append("".join(cur))
    return out


@dataclasses.dataclass(frozen=True)
class Program:
    """An optimized HLO module, with how often each of its computations runs per call."""

    computations: dict[str, tuple[Instruction, ...]]
    entry: str | None
    counts: dict[str, int]  # executions per call (loop bodies: trip count × caller's count)
    fused: frozenset[str]  # computations inside a fusion (their bytes are the fusion's)
    loops: tuple[tuple[str, int | None], ...]  # (body, trip count or None) of every while
    shapes: dict[str, str]  # instruction name → result type
    trips: dict[str, int | None] = dataclasses.field(default_factory=dict)  # while → trips
    # computation → the own trip count of the innermost loop it runs in (1 outside any loop):
    # a pipeline's tick loop inside an accumulation loop runs `ticks` trips per microbatch,
    # while `counts` multiplies the two
    inner_trips: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def unknown_loops(self) -> tuple[str, ...]:
        """Loop bodies whose trip count the program does not state (counted once)."""
        return tuple(body for body, n in self.loops if n is None)


def _condition_trip_counts(comps: dict[str, tuple[Instruction, ...]], text: dict) -> dict:
    """{condition: (N, k)} for loop conditions whose root compares the counter with a constant N
    (LT): the form a scan's loop takes (XLA:TPU keeps no `known_trip_count`). k is the counter's
    index in the loop's tuple where the condition reads it straight from its parameter (None
    where it does not say: the compare wrapped in a fusion, as XLA:CPU has it)."""
    out = {}
    for name, lines in text.items():
        consts, s32 = {}, {}  # integer constants; the s32 ones (XLA:CPU's fused bound)
        for line in lines:
            c = _CONST_RE.match(line)
            if c:
                consts[c.group("name")] = int(c.group("n"))
                if re.match(r"\s*%?[\w.\-]+\s*=\s*s32\[", line):
                    s32[c.group("name")] = int(c.group("n"))
            if "ROOT" in line and "compare(" in line and "direction=LT" in line:
                args = re.search(r"compare\(([^)]*)\)", line).group(1)
                names = [a.strip().split(" ")[-1].lstrip("%") for a in args.split(",")]
                if len(names) == 2 and names[1] in consts:
                    counter = next((i for i in comps[name] if i.name == names[0]), None)
                    index = None
                    if counter is not None and counter.opcode == "get-tuple-element":
                        found = _INDEX_RE.search(counter.attrs)
                        index = int(found.group(1)) if found else None
                    out[name] = (consts[names[1]], index)
            elif "ROOT" in line and "fusion(" in line and len(s32) == 1:
                # the compare wrapped in a fusion (XLA:CPU): its bound is the one constant
                inner = _CALL_RE.search(line)
                if inner and any("direction=LT" in x for x in text.get(inner["callee"], [])):
                    out[name] = (next(iter(s32.values())), None)
    return out


def _through_copies(name: str, instructions: dict[str, Instruction]) -> Instruction | None:
    """The instruction `name` is a copy, bitcast or conversion of (or itself)."""
    for _ in range(16):
        ins = instructions.get(name)
        if ins is None or ins.opcode not in ("copy", "bitcast", "convert") or not ins.operands:
            return ins
        name = ins.operands[0]
    return None


def _scalar(name: str, instructions: dict[str, Instruction]) -> int | None:
    """The integer constant `name` is, through copies and bitcasts; None if it is not one."""
    ins = _through_copies(name, instructions)
    if ins is None or ins.opcode != "constant":
        return None
    return int(ins.operands[0]) if re.fullmatch(r"-?\d+", ins.operands[0]) else None


def _loop_trips(
    bound: int, index: int | None, init: Instruction | None, body: tuple[Instruction, ...], caller
) -> int:
    """Trips of `while (i < bound)` whose counter is element `index` of the loop's tuple: from
    its start (the init tuple's element, a constant) in steps of what the body adds to it. A
    scan counts 0, 1, …; XLA:TPU's windowed einsum loops (FSDP matmuls split into steps that
    overlap the all-gather) start at 0 and step by 2. Where start or step is not a constant,
    0 and 1 are taken."""
    start, step = 0, 1
    if index is not None:
        if init is not None and init.opcode == "tuple" and index < len(init.operands):
            start = _scalar(init.operands[index], caller)
            start = 0 if start is None else start
        by_name = {i.name: i for i in body}
        root = next((i for i in body if i.root), None)
        if root is not None and root.opcode == "tuple" and index < len(root.operands):
            nxt = by_name.get(root.operands[index])
            if nxt is not None and nxt.opcode == "add" and len(nxt.operands) == 2:
                for a, b in (nxt.operands, nxt.operands[::-1]):
                    counter = _through_copies(a, by_name)
                    if (
                        counter is not None
                        and counter.opcode == "get-tuple-element"
                        and _INDEX_RE.search(counter.attrs)
                        and _INDEX_RE.search(counter.attrs).group(1) == str(index)
                    ):
                        found = _scalar(b, by_name)
                        step = found if found and found > 0 else 1
                        break
    return max(0, -(-(bound - start) // step))


def _counts(entry: str | None, calls: dict[str, list[tuple[str, int]]]) -> dict[str, int]:
    """Executions per call of every computation reached from `entry`: the sum, over its call
    sites, of the caller's executions times the site's trips (1, or a loop's trip count).

    A sum, not a maximum: a computation called from two loops (XLA shares a body or a fused
    computation between identical call sites) runs once per trip of each. Counted in
    topological order of the call graph, so each call site adds its caller's final count."""
    if not entry:
        return {}
    order: list[str] = []
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack = [(entry, iter(calls.get(entry, ())))]
    state[entry] = 1
    while stack:
        name, edges = stack[-1]
        for callee, _ in edges:
            if callee not in state:  # a cycle (none in valid HLO) is cut where it closes
                state[callee] = 1
                stack.append((callee, iter(calls.get(callee, ()))))
                break
        else:
            stack.pop()
            state[name] = 2
            order.append(name)
    counts = dict.fromkeys(order, 0)
    counts[entry] = 1
    position = {name: i for i, name in enumerate(order)}
    for name in reversed(order):  # callers before callees
        for callee, n in calls.get(name, ()):
            if position[callee] < position[name]:  # not a back edge of a cycle
                counts[callee] += counts[name] * n
    return counts


def _inner_trips(entry: str | None, calls: dict, loop_edges: set) -> dict[str, int]:
    """Per computation reached from `entry`, the trip count of the innermost while loop whose
    body runs it (directly or through calls and fusions); 1 outside every loop."""
    if not entry:
        return {}
    out, stack = {entry: 1}, [entry]
    while stack:
        name = stack.pop()
        for callee, n in calls.get(name, ()):
            if callee not in out:
                out[callee] = n if (name, callee) in loop_edges else out[name]
                stack.append(callee)
    return out


def parse(hlo_text: str) -> Program:
    """Every computation of an HLO module, its instructions, and its executions per call."""
    text: dict[str, list[str]] = {}
    entry, comp = None, None
    for line in hlo_text.splitlines():
        m = _COMP_RE.match(line)
        if m and not line.startswith(" "):
            comp = m.group("name")
            text[comp] = []
            if line.startswith("ENTRY"):
                entry = comp
            continue
        if comp is not None and line.strip() == "}":
            comp = None
            continue
        if comp is not None:
            text[comp].append(line)
    comps = {
        name: tuple(i for i in map(parse_instruction, lines) if i) for name, lines in text.items()
    }
    by_condition = _condition_trip_counts(comps, text)
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    fused: set[str] = set()
    loops, trips, loop_edges = [], {}, set()
    for name, instructions in comps.items():
        by_name = {i.name: i for i in instructions}
        for ins in instructions:
            if ins.opcode == "while":
                cb = _COND_RE.search(ins.attrs)
                if not cb:
                    continue
                trip = _WHILE_TRIP_RE.search(ins.attrs)
                n = int(trip["n"]) if trip else None
                if n is None and cb["cond"] in by_condition:
                    init = by_name.get(ins.operands[0]) if ins.operands else None
                    body = comps.get(cb["body"], ())
                    n = _loop_trips(*by_condition[cb["cond"]], init, body, by_name)
                loops.append((cb["body"], n))
                trips[ins.name] = n
                calls[name].append((cb["body"], n if n is not None else 1))
                loop_edges.add((name, cb["body"]))
                continue
            if ins.opcode in _NOT_A_CALL:
                continue
            for c in _CALL_RE.finditer(ins.attrs):
                calls[name].append((c["callee"], 1))
                if ins.opcode in FUSIONS:
                    fused.add(c["callee"])
    counts = _counts(entry, calls)
    # A fusion's nested computations are fused too.
    stack = list(fused)
    while stack:
        for callee, _ in calls.get(stack.pop(), ()):
            if callee not in fused:
                fused.add(callee)
                stack.append(callee)
    shapes = {i.name: i.shape for ins in comps.values() for i in ins}
    inner = _inner_trips(entry, calls, loop_edges)
    return Program(comps, entry, counts, frozenset(fused), tuple(loops), shapes, trips, inner)


def computation_counts(hlo_text: str) -> dict[str, int]:
    """How many times each computation runs per call: loop bodies run their trip count."""
    return parse(hlo_text).counts


@dataclasses.dataclass(frozen=True)
class Cost:
    """FLOPs, transcendentals and bytes accessed of some instructions, one execution each."""

    flops: float = 0.0
    transcendentals: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(
            self.flops + other.flops,
            self.transcendentals + other.transcendentals,
            self.bytes + other.bytes,
        )

    def __mul__(self, n: float) -> "Cost":
        return Cost(self.flops * n, self.transcendentals * n, self.bytes * n)


def _dims(attrs: str, key: str) -> list[int]:
    m = re.search(key + r"=\{([\d,]*)\}", attrs)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def _dot_flops(ins: Instruction, program: Program) -> float:
    lhs = arrays(program.shapes.get(ins.operands[0], "")) if ins.operands else []
    if not lhs:
        return 0.0
    contracted = math.prod(lhs[0][1][d] for d in _dims(ins.attrs, "lhs_contracting_dims"))
    return 2.0 * elements(ins.shape) * contracted


def _gemm_flops(ins: Instruction, program: Program) -> float:
    """A cuBLAS/cuDNN gemm custom call: dimension numbers from its backend config."""
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
    lhs = arrays(program.shapes.get(ins.operands[0], "")) if ins.operands else []
    if not (m and lhs):
        return 0.0
    dims = [int(x) for x in json.loads(f"[{m.group(1)}]")]
    return 2.0 * elements(ins.shape) * math.prod(lhs[0][1][d] for d in dims)


def _window(attrs: str) -> dict[str, list]:
    """`window={size=1x8 stride=2x1 pad=0_0x7_7 lhs_dilate=4x1 rhs_dilate=1x1}` as lists."""
    m = re.search(r"window=\{([^}]*)\}", attrs)
    fields = dict(f.split("=", 1) for f in m.group(1).split()) if m else {}
    out = {}
    for key in ("size", "stride", "lhs_dilate", "rhs_dilate"):
        out[key] = [int(x) for x in fields[key].split("x")] if key in fields else None
    pad = fields.get("pad")
    out["pad"] = [int(p.split("_")[0]) for p in pad.split("x")] if pad else None
    return out


def _valid_taps(out_size: int, kernel: int, in_size: int, stride, pad_lo, lhs_d, rhs_d) -> int:
    """(output, kernel) position pairs of one spatial dimension that land on a real input
    element, not on padding or a hole of the input's dilation: XLA's count of a
    convolution's multiply-adds along that dimension."""
    import numpy as np

    o = np.arange(out_size, dtype=np.int64)
    total = 0
    for k in range(kernel):
        pos = o * stride - pad_lo + k * rhs_d
        hit = (pos >= 0) & (pos % lhs_d == 0) & (pos // lhs_d < in_size)
        total += int(hit.sum())
    return total


def _convolution_flops(ins: Instruction, program: Program) -> float:
    """2 · batch · output features · input features per group · Π valid taps per spatial dim,
    as XLA counts it (XLA:TPU writes batched matmuls as convolutions over dilated windows,
    where most taps fall on padding or holes)."""
    if len(ins.operands) < 2:
        return 0.0
    lhs = arrays(program.shapes.get(ins.operands[0], ""))
    rhs = arrays(program.shapes.get(ins.operands[1], ""))
    out = arrays(ins.shape)
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    if not (lhs and rhs and out and labels):
        return 0.0
    (l_lab, k_lab, o_lab), l_dims, k_dims, o_dims = labels.groups(), lhs[0][1], rhs[0][1], out[0][1]
    fma = o_dims[o_lab.index("b")] * o_dims[o_lab.index("f")] * k_dims[k_lab.index("i")]
    spatial = sorted(c for c in k_lab if c.isdigit())
    w = _window(ins.attrs)
    for n, d in enumerate(spatial):

        def get(key, default, n=n):
            v = w.get(key)
            return v[n] if v and n < len(v) else default

        fma *= _valid_taps(
            o_dims[o_lab.index(d)],
            k_dims[k_lab.index(d)],
            l_dims[l_lab.index(d)],
            get("stride", 1),
            get("pad", 0),
            get("lhs_dilate", 1),
            get("rhs_dilate", 1),
        )
    return 2.0 * fma


_ESTIMATE_RE = re.compile(r'cost_estimate_json\s*=\s*"(?P<json>[^"]*)"')


def _estimated(ins: Instruction) -> tuple[float, float]:
    """(flops, transcendentals) a Pallas kernel's `cost_estimate` states: Mosaic GPU (jax
    0.11+) writes it into its custom call's backend config as JSON, quotes escaped as \\22."""
    m = _ESTIMATE_RE.search(ins.attrs)
    if not m:
        return 0.0, 0.0
    est = json.loads(m["json"].replace("\\22", '"'))
    return float(est.get("flops", 0)), float(est.get("transcendentals", 0))


def _flops(ins: Instruction, program: Program) -> tuple[float, float]:
    """(flops, transcendentals) of one execution of one instruction."""
    op = ins.opcode
    if op == "dot":
        return _dot_flops(ins, program), 0.0
    if op == "convolution":
        return _convolution_flops(ins, program), 0.0
    if op == "custom-call" and any(t in ins.attrs for t in _GEMM_TARGETS):
        return _gemm_flops(ins, program), 0.0
    if op == "custom-call" and "cost_estimate_json" in ins.attrs:
        return _estimated(ins)
    if op in _TRANSCENDENTAL:
        return 0.0, float(elements(ins.shape))
    if op in _ELEMENTWISE:
        return float(elements(ins.shape)), 0.0
    if op in ("reduce", "reduce-window") and ins.operands:
        inputs = ins.operands[: max(1, len(ins.operands) // 2)]
        return float(sum(elements(program.shapes.get(o, "")) for o in inputs)), 0.0
    return 0.0, 0.0


def _fusion_bytes(ins: Instruction, program: Program) -> float:
    """Operands read and results written by a fusion: a parameter only sliced (or gathered)
    inside reads the slices; a result made by dynamic-update-slice or scatter into a parameter
    (alone or in a tuple of results, bitcast or not) writes the update in place and does not
    read the rest of the buffer."""
    callee = _CALL_RE.search(ins.attrs)
    body = program.computations.get(callee["callee"], ()) if callee else ()
    if not body:
        return sum(sum(shape_sizes(program.shapes.get(o, ""))) for o in ins.operands) + sum(
            shape_sizes(ins.shape)
        )
    by_name = {i.name: i for i in body}
    params: dict[int, str] = {}
    users: dict[str, list[Instruction]] = defaultdict(list)
    for i in body:
        if i.opcode == "parameter":
            idx = i.operands[0] if i.operands else ""
            params[int(idx) if idx.isdigit() else len(params)] = i.name
        for o in i.operands:
            users[o].append(i)
    root = next((i for i in body if i.root), body[-1])
    outputs = [by_name[o] for o in root.operands if o in by_name] if root.opcode == "tuple" else []
    outputs = outputs or [root]

    def source(name: str) -> str:  # through bitcasts, to the value they alias
        while name in by_name and by_name[name].opcode == "bitcast" and by_name[name].operands:
            name = by_name[name].operands[0]
        return name

    in_place: set[str] = set()
    written = 0.0
    for out in outputs:
        # a bitcast of the updated buffer is the same buffer, still updated in place
        while out.opcode == "bitcast" and out.operands and out.operands[0] in by_name:
            out = by_name[out.operands[0]]
        # what a dynamic-update-slice (operand 1) or a one-buffer scatter (buffer, indices,
        # updates: a vmapped dynamic-update-slice, e.g. a KV cache write) writes, in place
        update = None
        if out.opcode == "dynamic-update-slice" and len(out.operands) > 1:
            update = out.operands[1]
        elif out.opcode == "scatter" and len(out.operands) == 3:
            update = out.operands[2]
        if update is not None:
            in_place.add(source(out.operands[0]))
            written += sum(shape_sizes(by_name[update].shape)) if update in by_name else 0.0
        else:
            written += sum(shape_sizes(out.shape))

    def only_sliced(name: str, seen: int = 0) -> list[Instruction] | None:
        """The slices that read `name` (through bitcasts), or None if anything else does; a
        gather from `name` (a vmapped dynamic-slice) reads only what it gathers."""
        found = []
        for u in users.get(name, []):
            if u.opcode in ("dynamic-slice", "slice") or (
                u.opcode == "gather" and u.operands and u.operands[0] == name
            ):
                found.append(u)
            elif u.opcode == "bitcast" and seen < 8:
                more = only_sliced(u.name, seen + 1)
                if more is None:
                    return None
                found += more
            else:
                return None
        return found or None

    read = 0.0
    for k, operand in enumerate(ins.operands):
        size = sum(shape_sizes(program.shapes.get(operand, "")))
        p = params.get(k)
        if p is not None and p in in_place:
            size = 0.0
        elif p is not None:
            slices = only_sliced(p)
            if slices:
                size = min(size, sum(sum(shape_sizes(u.shape)) for u in slices))
        read += size
    return read + written


def _bytes(ins: Instruction, program: Program) -> float:
    if ins.opcode in _NO_BYTES:
        return 0.0
    if ins.opcode in FUSIONS:
        return _fusion_bytes(ins, program)
    if ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1:
        update = sum(shape_sizes(program.shapes.get(ins.operands[1], "")))
        return 2.0 * update
    if ins.opcode == "scatter" and len(ins.operands) == 3:  # in place: the updates, twice
        return 2.0 * sum(shape_sizes(program.shapes.get(ins.operands[2], "")))
    if ins.opcode in ("dynamic-slice", "slice", "gather"):
        return 2.0 * sum(shape_sizes(ins.shape))
    read = sum(sum(shape_sizes(program.shapes.get(o, ""))) for o in ins.operands)
    return read + sum(shape_sizes(ins.shape))


def instruction_cost(ins: Instruction, program: Program, computation: str) -> Cost:
    """One execution of one instruction: its FLOPs wherever it sits, its bytes only outside a
    fusion (inside one, values stay in registers)."""
    flops, trans = _flops(ins, program)
    nbytes = 0.0 if computation in program.fused else _bytes(ins, program)
    return Cost(flops, trans, nbytes)


def computation_cost(program: Program, name: str) -> Cost:
    """One execution of a computation's own instructions (not of the ones it calls)."""
    total = Cost()
    for ins in program.computations.get(name, ()):
        total = total + instruction_cost(ins, program, name)
    return total


def total_cost(program: Program) -> Cost:
    """Every instruction of every computation reached from the entry, times its executions."""
    total = Cost()
    for name, n in program.counts.items():
        total = total + computation_cost(program, name) * n
    return total


def repeated_cost(program: Program) -> Cost:
    """What a walk that counts each computation once leaves out: every computation that runs
    more than once per call (a loop body, and what it calls), times its extra executions."""
    total = Cost()
    for name, n in program.counts.items():
        if n > 1:
            total = total + computation_cost(program, name) * (n - 1)
    return total

"""Read the collectives a compiled program really contains from its HLO text.

The compiler, not the sharding rules, decides which collectives run: it may combine several
into one tuple op, keep a gathered weight for the backward pass, or lower a reduce-scatter as
an all-reduce plus a local slice. So the lab reads `compiled.as_text()` and reports, per op:
its kind, the mesh axes its replica groups span, and the bytes each device sends, in the
nccl-tests "bus bytes" convention (what a bandwidth-optimal ring moves per device):

    all-reduce       2·V·(W-1)/W     V = the buffer (input = output)
    all-gather       V·(W-1)/W       V = the gathered output
    reduce-scatter   V·(W-1)/W       V = the input (output · W)
    all-to-all       V·(W-1)/W       V = the buffer
    collective-permute  V            every device sends its whole buffer once

Ops inside a while loop with a known trip count (nn.scan over layers, a pipeline's ticks) count
once per trip, counted as every cost of a compiled program is (lab/measure/hlo.py); nested
loops multiply, and each op also keeps its innermost loop's own trip count.
"""

import dataclasses
import math
import re

import numpy as np

from lab.measure import hlo
from lab.measure.cost import bus_bytes
from lab.measure.hlo import arrays, dtype_bytes

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_OP_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\("
)
_COMP_RE = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_OPNAME_RE = re.compile(r'op_name="(?P<op>[^"]*)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of the compiled program, as one device sees it."""

    name: str  # HLO instruction name
    kind: str  # one of KINDS
    axes: tuple[str, ...]  # mesh axes the replica groups span; () if it could not be told
    group_size: int  # W: devices in each group (2 for a permute pair)
    buffer_bytes: int  # V: see the module docstring for which buffer
    count: int  # executions per step (trip count of an enclosing loop, else 1)
    op_name: str  # the JAX op that produced it (metadata), for the reader
    dtypes: tuple[str, ...] = ()  # HLO element types it carries ("f32", "bf16")
    trips: int = 1  # the own trip count of the innermost loop around it (`count` multiplies
    # every enclosing loop's: a tick loop inside an accumulation loop)

    @property
    def bus_bytes(self) -> float:
        """Bytes each device sends per execution (ring-algorithm convention)."""
        return bus_bytes(self.kind, self.buffer_bytes, self.group_size)

    @property
    def total_bus_bytes(self) -> float:
        return self.bus_bytes * self.count


def _iota_groups(text: str) -> list[list[int]] | None:
    """`[4,2]<=[8]` or `[4,2]<=[2,4]T(1,0)`: an iota reshaped, transposed, regrouped."""
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if not m:
        return None
    groups_shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(groups_shape[0], -1).tolist()


def _device_order(text: str | None, n: int) -> np.ndarray:
    """`device_ids=([2,4]T(1,0))` (an iota permuted) or `(3,1,...)`; absent: 0..n-1."""
    if not text:
        return np.arange(n)
    m = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip())
    if not m:
        return np.array([int(x) for x in text.split(",") if x.strip()])
    ids = np.arange(n).reshape([int(x) for x in m.group(1).split(",")])
    if m.group(2):
        ids = ids.transpose([int(x) for x in m.group(2).split(",")])
    return ids.reshape(-1)


def _mesh_groups(text: str) -> list[list[int]] | None:
    """`mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_1'}`: devices laid out
    over those sizes (in `device_ids` order); each group varies the named sub-axes."""
    m = re.match(
        r"mesh\[([^\]]*)\](?:,\s*device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?|[\d,\s]+)\))?"
        r"\s*\{([^}]*)\}",
        text,
    )
    if not m:
        return None
    sizes = [(n, int(s)) for n, s in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
    names = [n for n, _ in sizes]
    chosen = [names.index(n) for n in re.findall(r"'([^']+)'", m.group(3))]
    n = math.prod(s for _, s in sizes)
    ids = _device_order(m.group(2), n).reshape([s for _, s in sizes])
    others = [i for i in range(len(sizes)) if i not in chosen]
    group_size = math.prod(sizes[i][1] for i in chosen) if chosen else 1
    return ids.transpose(others + chosen).reshape(-1, group_size).tolist()


def _explicit_groups(text: str) -> list[list[int]] | None:
    """`{{0,1},{2,3}}`; `{}` means one group of every device (None here: size unknown)."""
    m = re.match(r"\{((?:\{[\d,\s]*\},?\s*)*)\}", text)
    if not m or not m.group(1).strip():
        return None
    return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([^{}]*)\}", m[0])]


def replica_groups(line: str, n_devices: int) -> list[list[int]]:
    """The device groups of a collective line (logical ids: positions in the mesh)."""
    m = re.search(r"source_target_pairs=\{(.*?)\}\}?", line)
    if m:
        pairs = re.findall(r"\{(\d+),(\d+)\}", line[m.start() :])
        return [[int(a), int(b)] for a, b in pairs]
    m = re.search(r"replica_groups=(.*)", line)
    if not m:
        return [list(range(n_devices))]
    text = m.group(1)
    for parse in (_mesh_groups, _iota_groups, _explicit_groups):
        groups = parse(text)
        if groups:
            return groups
    return [list(range(n_devices))]


def axes_of(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """Mesh axes along which the members of a group differ (the same for every group)."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    varying: set[str] = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.asarray(group), sizes)).T
        varying |= {names[i] for i in range(len(names)) if len(set(coords[:, i])) > 1}
    return tuple(n for n in names if n in varying)


def _buffer_bytes(kind: str, start: bool, shape_text: str, W: int) -> int:
    """V for the bus-bytes formula, from the arrays in the op's result type."""
    arrs = arrays(shape_text)
    if start and kind == "collective-permute":
        while arrs and arrs[-1] == ("u32", ()):  # XLA:TPU appends u32[] context scalars
            arrs = arrs[:-1]
    sizes = [math.prod(dims) * dtype_bytes(dtype) for dtype, dims in arrs]
    if start and kind in ("all-gather", "collective-permute", "reduce-scatter"):
        # async start ops return (operands, outputs); XLA:GPU's tuple permute of K and V
        # returns ((k, v), (k', v')): every operand counts
        sizes = sizes[len(sizes) // 2 :]
    total = sum(sizes)
    return total * W if kind == "reduce-scatter" else total


def _dtypes(shape_text: str) -> tuple[str, ...]:
    """The element types an op moves (XLA:TPU's u32[] context scalars left out)."""
    return tuple(sorted({d for d, dims in arrays(shape_text) if dims or d != "u32"}))


def parse(hlo_text: str, mesh_shape: dict[str, int]) -> list[Collective]:
    """Every collective in a compiled HLO module; `mesh_shape` is `dict(mesh.shape)`."""
    lines = hlo_text.splitlines()
    program = hlo.parse(hlo_text)
    counts, inner = program.counts, program.inner_trips
    n_devices = math.prod(mesh_shape.values())
    out, comp = [], None
    for line in lines:
        m = _COMP_RE.match(line)
        if m and not line.startswith(" "):
            comp = m.group("name")
            continue
        op = _OP_RE.match(line)
        if not op:
            continue
        kind, start = op.group("kind"), bool(op.group("start"))
        groups = replica_groups(line, n_devices)
        W = 2 if kind == "collective-permute" else len(groups[0])
        opname = _OPNAME_RE.search(line)
        out.append(
            Collective(
                name=op.group("name"),
                kind=kind,
                axes=axes_of(groups, mesh_shape),
                group_size=W,
                buffer_bytes=_buffer_bytes(kind, start, op.group("shape"), W),
                count=counts.get(comp, 1),
                op_name=opname.group("op") if opname else "",
                trips=inner.get(comp, 1),
                dtypes=_dtypes(op.group("shape")),
            )
        )
    return out


def from_compiled(compiled, mesh) -> list[Collective]:
    """The collectives of a `jax.jit(...).lower(...).compile()` result on `mesh`."""
    return parse(compiled.as_text(), dict(mesh.shape))


def totals(collectives: list[Collective]) -> dict[tuple[str, tuple[str, ...]], dict]:
    """Per (kind, axes): ops executed per step, buffer bytes and bus bytes per device."""
    out: dict = {}
    for c in collectives:
        if c.group_size <= 1 and c.kind != "collective-permute":
            continue  # a group of one moves nothing
        row = out.setdefault((c.kind, c.axes), {"ops": 0, "buffer_bytes": 0, "bus_bytes": 0.0})
        row["ops"] += c.count
        row["buffer_bytes"] += c.buffer_bytes * c.count
        row["bus_bytes"] += c.total_bus_bytes
    return out

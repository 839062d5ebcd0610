"""Each collective timed over each mesh axis, nccl-tests style (`python -m lab.tools.collectives`).

Five collectives, written by hand with shard_map so that exactly one op runs per call:
all-reduce (psum), all-gather, reduce-scatter (psum_scatter), all-to-all and ppermute (a
ring shift). For a message of S bytes over a group of W devices, nccl-tests reports

    algbw = S / t        busbw = algbw · factor
    factor: all-reduce 2(W-1)/W; all-gather, reduce-scatter, all-to-all (W-1)/W; ppermute 1

where S is the all-reduce buffer, the all-gather *output*, the reduce-scatter *input*, the
all-to-all buffer and the ppermute buffer, per device. busbw is what one device's link
carries under a bandwidth-optimal ring, so it compares across W and with the link's spec
(the same bus-bytes rule, lab.measure.cost.bus_bytes, reads the compiled programs' HLO in
lab.parallel.collectives_hlo). On CPU the devices are simulated:
every "device" is a slice of the same host, and the figures are memory copies, not a link.

Times come from lab.measure.timing.bench (median after warm-up, blocked on the output);
records from lab.measure.records.
"""

import dataclasses
import math

import jax
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lab.measure import records, timing
from lab.measure.cost import bus_bytes

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ppermute")
HLO_KIND = {"ppermute": "collective-permute"}  # the name collectives_hlo uses for the factor
ITEMSIZE = 4  # float32 messages
KiB, MiB = 2**10, 2**20


def bus_factor(op: str, group_size: int) -> float:
    """busbw / algbw for `op` over `group_size` devices (nccl-tests PERFORMANCE.md)."""
    return bus_bytes(HLO_KIND.get(op, op), 1.0, group_size)


def _local_fn(op: str, axis: str, W: int):
    """What each device does with its local block x_N (N elements)."""
    if op == "all-reduce":
        return lambda x_N: lax.psum(x_N, axis)
    if op == "all-gather":
        return lambda x_N: lax.all_gather(x_N, axis, tiled=True)
    if op == "reduce-scatter":
        return lambda x_N: lax.psum_scatter(x_N, axis, tiled=True)
    if op == "all-to-all":
        return lambda x_N: lax.all_to_all(x_N, axis, 0, 0, tiled=True)
    if op == "ppermute":
        ring = [(i, (i + 1) % W) for i in range(W)]
        return lambda x_N: lax.ppermute(x_N, axis, ring)
    raise ValueError(f"op={op!r}: expected one of {', '.join(OPS)}")


def input_elems(op: str, size_bytes: int, W: int) -> int:
    """Elements of each device's input so that the nccl-tests message size is `size_bytes`
    (all-gather: the output is S, so the input is S/W); a multiple of W so every op splits."""
    n = size_bytes // ITEMSIZE // (W if op == "all-gather" else 1)
    return max(W, n - n % W)


def message_bytes(op: str, n_elems: int, W: int) -> int:
    """S in the nccl-tests sense for a per-device input of `n_elems` float32."""
    return n_elems * ITEMSIZE * (W if op == "all-gather" else 1)


def group_size(mesh, axis) -> int:
    """Devices in one group of a collective over `axis` (a mesh axis name or a tuple of them)."""
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    return math.prod(mesh.shape[a] for a in names)


def collective(op: str, mesh, axis):
    """jit(shard_map) of `op` over `axis`: global x of shape (devices·N,), one block each."""
    spec = P(tuple(mesh.axis_names))
    local = _local_fn(op, axis, group_size(mesh, axis))
    fn = jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    return jax.jit(fn)


def global_input(mesh, n_elems: int, seed: int = 0):
    """Random (never zero) float32 input, each device holding its own N elements."""
    (x,) = timing.random_inputs(seed, [(mesh.size * n_elems,)])
    return jax.device_put(x, NamedSharding(mesh, P(tuple(mesh.axis_names))))


@dataclasses.dataclass(frozen=True)
class Point:
    """One timed collective."""

    op: str
    axis: str | tuple  # mesh axis, or several taken together
    group_size: int  # W
    size_bytes: int  # S, nccl-tests convention
    result: timing.BenchResult

    @property
    def algbw(self) -> float:
        return self.size_bytes / self.result.median_s

    @property
    def busbw(self) -> float:
        return self.algbw * bus_factor(self.op, self.group_size)


def time_one(op: str, mesh, axis, size_bytes: int, budget_s: float) -> Point:
    """One collective of nccl-tests message size `size_bytes` over `axis`, timed."""
    W = group_size(mesh, axis)
    n = input_elems(op, size_bytes, W)
    fn = collective(op, mesh, axis)
    x = global_input(mesh, n)
    result = timing.bench(fn, x, warmup=2, min_runs=5, budget_s=budget_s)
    return Point(op, axis, W, message_bytes(op, n, W), result)


def sizes_between(lo: int, hi: int, step: int = 4) -> list[int]:
    """Message sizes lo, lo·step, … up to hi (bytes)."""
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= step
    return out


def bench_axes(mesh) -> list[str]:
    """Every mesh axis that holds more than one device."""
    return [a for a in mesh.axis_names if mesh.shape[a] > 1]


def run(
    mesh,
    sizes: list[int],
    ops=OPS,
    axes=None,
    budget_s: float = 0.3,
    progress=None,
    done=None,
) -> list[Point]:
    """Every (axis, op, size) point; `progress(label)` is called as each starts, with the
    message size it times (a size is rounded up to whole float32 elements per device, and two
    sizes that round alike are timed once); `done(point)` as each finishes (a caller that
    keeps what finished when a signal stops it)."""
    points = []
    for axis in axes or bench_axes(mesh):
        W = group_size(mesh, axis)
        for op in ops:
            timed = set()
            for size in sizes:
                actual = message_bytes(op, input_elems(op, size, W), W)
                if actual in timed:
                    continue
                timed.add(actual)
                if progress:
                    progress(f"{op} over {axis}, {actual:,} B")
                points.append(time_one(op, mesh, axis, actual, budget_s))
                if done:
                    done(points[-1])
    return points


def points_planned(mesh, sizes: list[int], ops=OPS, axes=None) -> int:
    """How many points `run` times (sizes that round alike counted once)."""
    return sum(
        len(
            {
                message_bytes(op, input_elems(op, s, group_size(mesh, a)), group_size(mesh, a))
                for s in sizes
            }
        )
        for a in axes or bench_axes(mesh)
        for op in ops
    )


def to_records(points: list[Point], simulated: bool) -> list[dict]:
    out = []
    for p in points:
        cfg = dict(
            op=p.op,
            axis=p.axis,
            group_size=p.group_size,
            size_bytes=p.size_bytes,
            median_s=p.result.median_s,
            p10_s=p.result.p10_s,
            p90_s=p.result.p90_s,
            runs=p.result.runs,
            simulated_devices=simulated,
        )
        out.append(records.make_record("collective algbw", p.algbw, "B/s", **cfg))
        # busbw is algbw times nccl-tests' factor for the op: derived from the measured time
        out.append(records.make_record("collective busbw", p.busbw, "B/s", label="derived", **cfg))
    return out


def default_mesh(n_devices: int) -> str:
    """Two axes of different sizes where possible, so per-axis figures differ: 4x2 on 8."""
    return f"{n_devices // 2}x2" if n_devices >= 4 and n_devices % 2 == 0 else str(n_devices)


def reference(op: str, blocks_WxN: np.ndarray) -> np.ndarray:
    """What each of W devices holds after `op`, from their inputs, in numpy (for tests)."""
    W, N = blocks_WxN.shape
    if op == "all-reduce":
        return np.tile(blocks_WxN.sum(0), (W, 1))
    if op == "all-gather":
        return np.tile(blocks_WxN.reshape(-1), (W, 1))
    if op == "reduce-scatter":
        return blocks_WxN.sum(0).reshape(W, N // W)
    if op == "all-to-all":
        chunks_WxWxC = blocks_WxN.reshape(W, W, N // W)
        return chunks_WxWxC.transpose(1, 0, 2).reshape(W, N)
    if op == "ppermute":
        return np.roll(blocks_WxN, 1, axis=0)
    raise ValueError(op)

"""Machines for the step-time model: a datasheet entry with its links, or this CPU as measured.

Links, per device and direction (what one device can send on a mesh axis while the ring
algorithm runs):
- TPU: the chip's ICI figure (both directions, all links: lab/measure/specs.py) shared by the
  torus axes of the slice; a bidirectional ring on one axis uses both directions of its
  links, so an axis gets total / (torus dimensions).
- NVIDIA GPU: NVLink through NVSwitch inside a host of 8 (the datasheet's total over 2 per
  direction); an axis that spans hosts runs at the host's network share per GPU (one 400 Gb/s
  InfiniBand NIC per GPU on DGX H100 / H200 systems, 50 GB/s: NVIDIA DGX H100 user guide,
  "networking": eight single-port ConnectX-7 400 Gb/s). A ring collective (all-reduce,
  all-gather, reduce-scatter) whose group has g members on each host runs g rings at once,
  each leaving the host through a different member's NIC, so it moves its bus bytes at
  min(g × NIC, NVLink) per device: NCCL "will form multiple rings so that it can utilize all
  the available NICs" (NVIDIA/nccl-tests#277), and a DGX A100's 8 × 200 Gb/s NICs measure
  192 GB/s all-reduce bus bandwidth across hosts (NVIDIA/nccl#812), 8 × 25 GB/s, not 25 GB/s.
  A point-to-point transfer (collective-permute) or an all-to-all uses each device's own NIC.
- CPU (simulated devices): every "link" is a memory copy at the measured copy bandwidth, and
  all simulated devices share the same cores, so an op costs its time × devices.
"""

import math

from lab.measure import specs
from lab.predict.model import Machine

IB_PER_GPU = 50e9  # bytes/s: 400 Gb/s per GPU (DGX H100 user guide, networking)
MESH_ORDER = ("data", "stage", "fsdp", "model")  # lab/mesh.py: the innermost axis is last
# Links for a chip whose source gives no interconnect figure (TPU v4's page, a PCIe card):
# assumptions, and the machine's source says so.
ASSUMED_ICI = 45e9  # bytes/s per torus axis
ASSUMED_NVLINK = 25e9  # bytes/s per direction

# The model's free parameters for accelerators: efficiencies and fixed costs, fitted on the
# calibration subset of the published measurements (lab/studies/prediction.py), never per
# point. Before any fit they are 1 and 0: the pure roofline of each op.
DEFAULT_FIT = {
    "compute_efficiency": 1.0,
    "memory_efficiency": 1.0,
    "op_overhead_s": 0.0,
    "link_latency_s": 0.0,
    "call_overhead_s": 0.0,
}


def tpu_machine(spec: specs.DeviceSpec, topology: str, mesh_shape: dict, fit=None) -> Machine:
    dims = max(1, len([d for d in topology.split("x") if int(d) > 1]))
    per_axis = (spec.interconnect_bandwidth or 0.0) / dims or ASSUMED_ICI
    ici = f"ICI {per_axis / 1e9:.0f} GB/s per axis ({dims}-D torus)"
    if not spec.interconnect_bandwidth:
        ici += ", assumed: the chip's source gives no per-chip ICI figure"
    return Machine(
        name=spec.name,
        peak_flops=dict(spec.peak_flops),
        memory_bandwidth=spec.memory_bandwidth,
        link_bandwidth={a: per_axis for a in mesh_shape},
        source=f"{spec.source_of('*')}; {ici}",
        async_launch=True,
        **(fit or DEFAULT_FIT),
    )


def gpu_machine(spec: specs.DeviceSpec, mesh_shape: dict, per_host: int = 8, fit=None) -> Machine:
    nvlink = (spec.interconnect_bandwidth or 0.0) / 2 or ASSUMED_NVLINK
    links, inner = {}, 1
    for axis in reversed(
        [a for a in MESH_ORDER if a in mesh_shape] + [a for a in mesh_shape if a not in MESH_ORDER]
    ):
        inner *= mesh_shape[axis]
        links[axis] = nvlink if inner <= per_host else IB_PER_GPU
    return Machine(
        name=spec.name,
        peak_flops=dict(spec.peak_flops),
        memory_bandwidth=spec.memory_bandwidth,
        link_bandwidth=links,
        ring_bandwidth=ring_bandwidth(mesh_shape, nvlink, per_host),
        source=(
            f"{spec.source_of('*')}; NVLink {nvlink / 1e9:.0f} GB/s per direction inside "
            f"{per_host} GPUs"
            + ("" if spec.interconnect_bandwidth else " (assumed: the card's source gives none)")
            + f", InfiniBand {IB_PER_GPU / 1e9:.0f} GB/s per GPU across hosts"
        ),
        async_launch=True,
        **(fit or DEFAULT_FIT),
    )


def ring_bandwidth(mesh_shape: dict, nvlink: float, per_host: int = 8) -> dict:
    """Per set of mesh axes a group may span (axes of size > 1): the bus bandwidth per device
    of a ring collective over them. Devices fill hosts of `per_host` in mesh order, the last
    axis innermost; a group with g members on each host it spans runs g rings, one through
    each member's NIC: min(g × IB_PER_GPU, NVLink). A group inside one host: NVLink."""
    import itertools

    order = [a for a in MESH_ORDER if a in mesh_shape] + [
        a for a in mesh_shape if a not in MESH_ORDER
    ]
    stride, on_host = 1, {}
    for axis in reversed(order):  # members of the axis a host holds: its span over strides
        on_host[axis] = min(mesh_shape[axis], max(1, per_host // stride))
        stride *= mesh_shape[axis]
    axes = [a for a in order if mesh_shape[a] > 1]
    out = {}
    for r in range(1, len(axes) + 1):
        for group in itertools.combinations(axes, r):
            size = math.prod(mesh_shape[a] for a in group)
            per = math.prod(on_host[a] for a in group)
            out[frozenset(group)] = nvlink if size <= per else min(per * IB_PER_GPU, nvlink)
    return out


def cpu_machine(
    peak_flops: dict,
    copy_bytes_per_s: float,
    n_devices: int,
    fit=None,
    source: str = "",
    *,
    cache_bytes: float = 0.0,
    cache_bytes_per_s: float = 0.0,
) -> Machine:
    return Machine(
        cache_bytes=cache_bytes,
        cache_bandwidth=cache_bytes_per_s,
        name="this CPU (measured)",
        peak_flops=dict(peak_flops),
        memory_bandwidth=copy_bytes_per_s,
        link_bandwidth={a: copy_bytes_per_s for a in MESH_ORDER},
        devices_per_core_group=max(1, n_devices),
        source=source or "measured matmul peak and copy bandwidth of this host",
        **(fit or DEFAULT_FIT),
    )


FIT_PARAMS = (
    "compute_efficiency",
    "memory_efficiency",
    "op_overhead_s",
    "link_latency_s",
    "call_overhead_s",
)


def _grids() -> dict:
    import numpy as np

    return {
        "compute_efficiency": np.geomspace(0.05, 1.0, 14),
        "memory_efficiency": np.geomspace(0.05, 4.0, 16),
        "op_overhead_s": np.concatenate([[0.0], np.geomspace(1e-7, 1e-3, 13)]),
        "link_latency_s": np.concatenate([[0.0], np.geomspace(1e-7, 1e-3, 9)]),
        "call_overhead_s": np.concatenate([[0.0], np.geomspace(1e-7, 1e-3, 13)]),
    }


def at_edge(fitted: dict, params=FIT_PARAMS) -> list[str]:
    """The fitted parameters that sit at an end of the range `fit` searches ('memory_efficiency
    3.93, the top of 0.05–4'): the points asked for a value the model does not allow, so its
    form (or the points: a loaded host's) explains them badly. An overhead of 0 is a value
    (none), not an edge; an efficiency at its floor or any parameter at its ceiling is."""
    out = []
    for name in params:
        if name not in fitted:
            continue
        grid = _grids()[name]
        value, lo, hi = float(fitted[name]), float(grid[grid > 0][0]), float(grid[-1])
        step = (grid[-1] / grid[-2]) ** (1 / 8)  # a few of the fine search's steps
        if value >= hi / step:
            out.append(f"{name} {value:.3g}, the top of {lo:.3g}–{hi:.3g}")
        elif grid[0] > 0 and value <= lo * step:
            out.append(f"{name} {value:.3g}, the bottom of {lo:.3g}–{hi:.3g}")
    return out


def fit(points, params=FIT_PARAMS[:3]) -> dict:
    """Free parameters that minimise the median |log(predicted / measured)| over `points`
    plus a tenth of the largest (so that no point is left far off for a better median), each
    a callable `predict(**fit) -> seconds` with its measured seconds: (predict, measured).
    A coarse grid, then a finer one around the best: a handful of parameters, few points."""
    import numpy as np

    grids = _grids()
    best = dict(DEFAULT_FIT)

    def score(candidate) -> float:
        errors = [abs(math.log(max(p(**candidate), 1e-12) / m)) for p, m in points]
        return float(np.median(errors)) + 0.1 * float(np.max(errors))

    current = score(best)
    for _ in range(3):  # coordinate descent over the grids
        for name in params:
            for value in grids[name]:
                trial = {**best, name: float(value)}
                s = score(trial)
                if s < current:
                    best, current = trial, s
    for _ in range(2):  # then finer: each parameter between its best value's grid neighbours
        for name in params:
            grid = grids[name]
            at = int(np.argmin(np.abs(grid - best[name])))
            lo, hi = grid[max(at - 1, 0)], grid[min(at + 1, len(grid) - 1)]
            if lo <= 0.0:  # the grid's 0: refine from its first positive value
                lo = grid[1] / 10
            for value in np.geomspace(lo, hi, 17):
                trial = {**best, name: float(value)}
                s = score(trial)
                if s < current:
                    best, current = trial, s
    return best


def leave_one_out(points, params=FIT_PARAMS[:3], tick=None) -> list[float]:
    """Each point's predicted / measured time when the parameters are fitted on the others
    (`fit` over the rest): how well the model's form explains points its fit did not see,
    from the calibration set alone. A form chosen by this error is chosen blind to the
    held-out points. `tick(i)` before each fit."""
    ratios = []
    for i, (predict, measured) in enumerate(points):
        if tick:
            tick(i)
        rest = points[:i] + points[i + 1 :]
        ratios.append(predict(**fit(rest, params=params)) / measured)
    return ratios

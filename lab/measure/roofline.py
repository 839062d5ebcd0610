"""The roofline: attainable FLOP/s = min(peak, arithmetic intensity × memory bandwidth).

An op that does few FLOPs per byte it moves waits on memory ("memory-bound"); past the
ridge point (peak / bandwidth FLOP per byte) it waits on the arithmetic units. Here both
roofs are *measured* (matmul peak, copy bandwidth: lab/measure/ceilings.py) and a sweep of
ops of growing intensity shows where real ops land under them.

Two families of ops, each with FLOPs and bytes counted analytically (minimum traffic):
  poly_k:  a degree-k polynomial of every element (Horner: k multiply-adds, 2k FLOPs), one
           read and one write per element: intensity 2k / (2·itemsize), elementwise units.
  mm_m:    x (m×n) · w (n×n): 2·m·n² FLOPs over itemsize·(2·m·n + n²) bytes, from m=1
           (matrix-vector, intensity ≈ 1/itemsize … 2/itemsize) up to m=n (square matmul).
"""

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from lab.measure import cost, timing


def describe(name: str) -> str:
    """A sweep op's name in words: poly_4 → 'a degree-4 polynomial of each element', mm_8 →
    'matmul x[8×n] · w[n×n]'."""
    family, _, k = name.partition("_")
    if family == "poly":
        return f"a degree-{k} polynomial of each element"
    if family == "mm":
        return f"matmul x[{k}×n] · w[n×n]"
    return name


@dataclasses.dataclass(frozen=True)
class Op:
    """One point of the sweep: a jitted function, its input sets and its analytic cost."""

    name: str
    fn: Callable
    arg_sets: Sequence[tuple]  # rotated, so caches cannot hold one input across calls
    flops: float
    bytes: float


@dataclasses.dataclass(frozen=True)
class Point:
    """A measured op on the roofline."""

    name: str
    flops: float
    bytes: float
    median_s: float

    @property
    def intensity(self) -> float:
        return cost.arithmetic_intensity(self.flops, self.bytes)

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.median_s


def attainable(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The roofline: what an op of this intensity can reach at best."""
    return min(peak_flops, intensity * bandwidth)


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """FLOP per byte where the memory roof meets the compute roof."""
    return peak_flops / bandwidth


def _horner(x, degree: int):
    y = jnp.full_like(x, 0.5)
    for i in range(degree):  # distinct coefficients so nothing folds
        y = y * x + (1.0 + 1.0 / (i + 2))
    return y


def poly_ops(n_elements: int, degrees: Sequence[int], *, dtype=jnp.float32, sets: int = 4):
    """Elementwise ops of intensity degree/itemsize: the memory-bound side of the roof."""
    xs = [(x,) for x in timing.random_inputs(1, [(n_elements,)] * sets, dtype)]
    itemsize = jnp.dtype(dtype).itemsize
    return [
        Op(
            name=f"poly_{k}",
            fn=jax.jit(lambda x, k=k: _horner(x, k)),
            arg_sets=xs,
            flops=2.0 * k * n_elements,
            bytes=2.0 * itemsize * n_elements,
        )
        for k in degrees
    ]


def matmul_ops(n: int, ms: Sequence[int], *, dtype=jnp.float32, sets: int = 4):
    """x (m×n) · w (n×n) for each m: from matrix-vector up to a square matmul.

    `sets` weight matrices are rotated: 4 × 16 MiB at n=2048 float32 is twice a 32 MiB L3,
    so a matrix-vector product cannot be served from cache (it would beat the memory roof).
    """
    ws = timing.random_inputs(2, [(n, n)] * sets, dtype)
    itemsize = jnp.dtype(dtype).itemsize
    mm = jax.jit(jnp.matmul)
    ops = []
    for m in ms:
        xs = timing.random_inputs(3 + m, [(m, n)] * sets, dtype)
        ops.append(
            Op(
                name=f"mm_{m}",
                fn=mm,
                arg_sets=list(zip(xs, ws, strict=True)),
                flops=float(cost.matmul_flops(m, n, n)),
                bytes=float(cost.matmul_bytes(m, n, n, itemsize)),
            )
        )
    return ops


def sweep(ops: Sequence[Op], *, budget_s: float = 0.3, inner: int = 1, done=None) -> list[Point]:
    """Time every op with `timing.bench` (rotating its input sets; `inner` calls queued per
    timed sample, as `lab.measure.ceilings.queued` chooses for the device); `done(point)` is
    called as each point is timed."""
    points = []
    for op in ops:
        r = timing.bench(
            op.fn, rotate=op.arg_sets, budget_s=budget_s, warmup=1, min_runs=3, inner=inner
        )
        points.append(Point(op.name, op.flops, op.bytes, r.median_s))
        if done is not None:
            done(points[-1])
    return points

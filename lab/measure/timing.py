"""Timing that can be trusted: warm-up apart, blocked on every output, median of many runs.

Asynchronous dispatch means a JAX call returns before the device is done; timing without
`jax.block_until_ready` on *every* output leaf measures the dispatch, not the work. Compile
time is measured on its own (the first call) and never mixed into the steady-state figure.
"""

import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class BenchResult:
    """Seconds per call of one function on one input set (or a rotation of them)."""

    median_s: float  # median over the timed runs
    p10_s: float  # 10th percentile: the best the machine reliably does
    p90_s: float  # 90th percentile: the noise ceiling
    runs: int  # timed calls (warm-up excluded)
    compile_s: float  # first call (trace + compile + one run), never part of the median
    times_s: tuple[float, ...] = dataclasses.field(repr=False, default=())

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("times_s")
        return d


def _call_blocked(fn: Callable, args: Sequence, inner: int = 1) -> float:
    """Seconds per call of `inner` back-to-back calls, blocked once on the last one's
    outputs: on an accelerator the calls queue up as they would in a real program, and the
    host's synchronisation is paid once, not per call (it is ~10-50 µs: a fair share of a
    sub-millisecond kernel)."""
    t0 = time.perf_counter()
    for _ in range(inner - 1):
        fn(*args)
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) / inner


def _check_runs(inner: int, min_runs: int, max_runs: int | None = None) -> None:
    """ValueError for run counts that would time nothing: a median needs one run at least."""
    if inner < 1:
        raise ValueError(f"inner={inner}: must be >= 1")
    if min_runs < 1:
        raise ValueError(f"min_runs={min_runs}: must be >= 1 (a median needs one timed run)")
    if max_runs is not None and max_runs < min_runs:
        raise ValueError(f"max_runs={max_runs}: must be >= min_runs={min_runs}")


def summarise(times_s: list[float], compile_s: float) -> BenchResult:
    """Median and spread of measured seconds (also used by the training loop)."""
    q = np.percentile(times_s, [10, 90])
    return BenchResult(
        median_s=statistics.median(times_s),
        p10_s=float(q[0]),
        p90_s=float(q[1]),
        runs=len(times_s),
        compile_s=compile_s,
        times_s=tuple(times_s),
    )


def bench(
    fn: Callable,
    *args,
    rotate: Sequence[Sequence] | None = None,
    warmup: int = 2,
    min_runs: int = 5,
    max_runs: int = 1000,
    budget_s: float = 1.0,
    inner: int = 1,
) -> BenchResult:
    """Time `fn(*args)`: one compile call, `warmup` untimed calls, then runs until `budget_s`.

    `rotate` is a list of argument tuples used in turn (instead of `args`), so that caches
    holding the previous call's inputs do not flatter the figure. `inner` > 1 makes each run
    `inner` calls queued back to back and blocked once (`_call_blocked`), the figure per call.
    At least `min_runs` (>= 1) and at most `max_runs` (>= min_runs) runs are timed.
    """
    _check_runs(inner, min_runs, max_runs)
    arg_sets = [tuple(a) for a in rotate] if rotate else [args]
    t0 = time.perf_counter()
    for a in arg_sets:  # every input set compiles (same shapes: one trace) and lands on device
        jax.block_until_ready(fn(*a))
        if t0 is not None:
            compile_s, t0 = time.perf_counter() - t0, None
    cycle = itertools.cycle(arg_sets)
    for _ in range(warmup):
        _call_blocked(fn, next(cycle), inner)
    times_s: list[float] = []
    start = time.perf_counter()
    while len(times_s) < max_runs and (
        len(times_s) < min_runs or time.perf_counter() - start < budget_s
    ):
        times_s.append(_call_blocked(fn, next(cycle), inner))
    return summarise(times_s, compile_s)


def bench_in_place(
    fn: Callable,
    arrays: list,
    *,
    warmup: int = 2,
    min_runs: int = 5,
    max_runs: int = 1000,
    budget_s: float = 1.0,
    inner: int = 1,
) -> BenchResult:
    """Time `fn(array) → array` that consumes its (donated) input, over `arrays` in turn,
    each result put back in its place: `bench`'s rotation for a kernel that writes in place
    (no fresh output per call, so no allocator in the figure). One untimed pass over every
    array first (the compile, then each buffer touched), `warmup` untimed runs, then runs
    until `budget_s`. Each run is `inner` calls queued back to back (over the next arrays in
    turn) and blocked once on the last, the figure per call, as in `bench` (and its run
    counts: min_runs >= 1, max_runs >= min_runs)."""
    _check_runs(inner, min_runs, max_runs)
    t0 = time.perf_counter()
    compile_s = None
    for k in range(len(arrays)):
        arrays[k] = jax.block_until_ready(fn(arrays[k]))
        if compile_s is None:
            compile_s = time.perf_counter() - t0
    i = 0

    def call() -> float:
        nonlocal i
        t = time.perf_counter()
        for _ in range(inner):
            k, i = i % len(arrays), i + 1
            arrays[k] = fn(arrays[k])
        jax.block_until_ready(arrays[k])  # the last call's: the device ran them in order
        return (time.perf_counter() - t) / inner

    for _ in range(warmup):
        call()
    times_s: list[float] = []
    start = time.perf_counter()
    while len(times_s) < max_runs and (
        len(times_s) < min_runs or time.perf_counter() - start < budget_s
    ):
        times_s.append(call())
    jax.block_until_ready(arrays)
    return summarise(times_s, compile_s)


@dataclasses.dataclass(frozen=True)
class Contender:
    """One implementation's times in a `comparison` and its baseline's median."""

    name: str
    bench: BenchResult  # its seconds per call
    baseline_median_s: float  # the baseline's median in the same alternated run

    @property
    def ratio(self) -> float:
        """Median over the baseline's median: below 1 is faster than the baseline."""
        return self.bench.median_s / self.baseline_median_s

    def as_dict(self) -> dict:
        return {**self.bench.as_dict(), "ratio": self.ratio}


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Several implementations of one op timed alternately (`comparison`), in the order given."""

    baseline: str  # the name every ratio is taken against
    contenders: tuple[Contender, ...]

    def __getitem__(self, name: str) -> Contender:
        for c in self.contenders:
            if c.name == name:
                return c
        raise KeyError(name)

    def as_dict(self) -> dict[str, dict]:
        """Per name, the BenchResult fields plus `ratio`: `compare`'s form, which records keep."""
        return {c.name: c.as_dict() for c in self.contenders}


def comparison(
    impls: dict[str, Callable],
    *args,
    baseline: str,
    warmup: int = 2,
    min_runs: int = 5,
    budget_s: float = 1.0,
    inner: int = 1,
    settle_s: float = 0.0,
) -> Comparison:
    """Time several implementations of one op on the same inputs, alternating call by call.

    Alternating spreads drift (thermal, other processes) evenly over the contenders, so the
    ratios are fairer than timing one after the other. Each contender's ratio is its median
    over the baseline's (below 1 is faster than the baseline). `inner` > 1 makes each sample
    `inner` queued calls blocked once (see `_call_blocked`). `settle_s` > 0 waits that long,
    untimed, before each sample: on a CPU a contender's work can outlast its return (PyTorch's
    OpenMP threads spin for a while after each parallel region; XLA frees its buffers), and
    the next contender's sample would pay for it. On a 2-core VM, cpu_flash right after
    PyTorch's SDPA took 68–69 ms where 20 ms later it took 63, and PyTorch's 60 ms did not move.
    At least `min_runs` (>= 1) rounds are timed.
    """
    _check_runs(inner, min_runs)
    if baseline not in impls:
        raise ValueError(f"baseline={baseline!r} is not one of {sorted(impls)}")
    if settle_s < 0:
        raise ValueError(f"settle_s={settle_s}: must be >= 0")
    compile_s = {}
    for name, fn in impls.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        compile_s[name] = time.perf_counter() - t0
    for _ in range(warmup):
        for fn in impls.values():
            _call_blocked(fn, args, inner)
    times_s: dict[str, list[float]] = {name: [] for name in impls}
    start = time.perf_counter()
    rounds, settled = 0, 0.0
    while rounds < min_runs or time.perf_counter() - start - settled < budget_s * len(impls):
        for name, fn in impls.items():
            if settle_s:  # the wait as slept: a loaded host oversleeps, and that is not timed
                t0 = time.perf_counter()
                time.sleep(settle_s)
                settled += time.perf_counter() - t0
            times_s[name].append(_call_blocked(fn, args, inner))
        rounds += 1
    results = {name: summarise(t, compile_s[name]) for name, t in times_s.items()}
    base_s = results[baseline].median_s
    return Comparison(baseline, tuple(Contender(n, r, base_s) for n, r in results.items()))


def compare(impls: dict[str, Callable], *args, baseline: str, **kwargs) -> dict[str, dict]:
    """`comparison` as plain dicts: per name, the BenchResult fields plus `ratio` = median /
    baseline median. For callers that put the figures straight into records."""
    return comparison(impls, *args, baseline=baseline, **kwargs).as_dict()


def threaded(fn: Callable, state) -> Callable:
    """A zero-argument call that advances its own state, `state = fn(state)`, and returns it:
    a step that donates its state can be timed (each call passes the last call's output, so
    donation stays legal), and the timer blocks on every leaf of the update."""
    box = [state]

    def call():
        box[0] = fn(box[0])
        return box[0]

    return call


# Benchmark inputs are drawn on the host (numpy) and then put on the device: a draw on the
# device compiles a program for each shape and dtype (the random bits, the transform to a
# normal, the scale, the cast), about a second each on a small CPU host, and a sweep draws
# dozens of shapes. The values only need to be random and never zero.


def _host_normal(rng: np.random.Generator, shape, dtype, scale: float) -> jax.Array:
    x = rng.standard_normal(tuple(shape), dtype=np.float32)
    if scale != 1.0:
        x *= np.float32(scale)
    return jnp.asarray(x.astype(jnp.dtype(dtype)))


def random_normal(key, shape, dtype=jnp.float32, scale: float = 1.0) -> jax.Array:
    """Random inputs for benchmarks and tests: never zeros, which some hardware fast-paths.
    The same key gives the same array (the key's data seeds the host's generator)."""
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    data = np.asarray(jax.random.key_data(key) if typed else key).astype(np.uint32)
    return _host_normal(np.random.default_rng(data.ravel().tolist()), shape, dtype, scale)


def random_inputs(seed: int, shapes: Sequence[tuple], dtype=jnp.float32) -> list:
    """One random array per shape, drawn in turn from one generator seeded by `seed`."""
    rng = np.random.default_rng(seed)
    return [_host_normal(rng, s, dtype, 1.0) for s in shapes]

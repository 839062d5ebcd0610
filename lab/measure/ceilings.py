"""Ceilings of the device present, measured: matmul FLOP/s per dtype and precision, memory
copy bandwidth, host↔device bandwidth, and a roofline sweep with its measured ridge point.

These are the "100%" every other figure is held against where no datasheet applies (on CPU
the measured matmul peak is the reference for MFU) and the check on the datasheet where one
does (achieved / spec peak). Sizes are chosen per backend so the whole set runs in well under
two minutes on a laptop CPU and in seconds on an accelerator. Every time comes from
`timing.bench` (the in-place copy from `timing.bench_in_place`, which puts each donated
buffer's successor back in its place): compile apart, blocked on the outputs, median over a
time budget. On an accelerator each timed sample is `queued()` calls back to back, blocked
once: the device's time per call, as a program that queues its work sees it (the calls of one
sample share an input set; the sets rotate from sample to sample, and every buffer is larger
than the chips' L2). Blocked on every call, the host's wait and the next dispatch join each
call's time: in BENCHMARKS.md's op table for one H200, a 1.07 GB copy took 0.71 ms a call
blocked and 0.50 ms queued, a bf16 8192³ matmul 1.81 against 1.64 ms; and the ledger's first
run on an H200, which blocked on every call, read its roofs as 2.81 TB/s and 628 TFLOP/s.

`python -m lab.tools.ceilings` runs `run_all` and prints, saves and plots the results:
`run_all` returns a `Ceilings` (its rows as `Row`s), typed here, below lab.report, so the
terminal table (lab/report/tables/roofline.py) takes it instead of a dict whose keys it must
know.
"""

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from lab.measure import cost, records, roofline, specs, timing

MiB = 2**20


def backend() -> str:
    return jax.default_backend()


def matmul_n(backend_name: str | None = None) -> int:
    """Square matmul size: big enough to fill the device, small enough for ~0.1 s on a CPU."""
    return 2048 if (backend_name or backend()) == "cpu" else 8192


def _sizes(backend_name: str) -> dict[str, int]:
    """Bytes per buffer for the bandwidth tests, rotated over `SETS` buffers (the copy and
    read streams over `_sets`).

    CPU: 24 MiB, at least four of them and enough for three times the last-level cache
    (`_sets`); the roofline's elementwise ops take `poly` float32 elements. Accelerators:
    large, their allocators reuse; the elementwise ops read and write 512 MiB, so a call
    (1 GiB moved: 0.25 ms at the 4.26 TB/s an H200's copy reached) outlasts its dispatch
    from Python (40–70 µs there), which queued calls would otherwise measure instead.
    """
    if backend_name == "cpu":
        return {"copy": 24 * MiB, "transfer": 24 * MiB, "poly": 6 * 2**20, "mm_n": 2048}
    return {"copy": 1024 * MiB, "transfer": 256 * MiB, "poly": 128 * 2**20, "mm_n": 8192}


SETS = 4
QUEUED = 10  # calls per timed sample on an accelerator (see the module docstring)


def queued(backend_name: str | None = None) -> int:
    """Calls queued per timed sample: `QUEUED` on an accelerator; 1 on CPU, where XLA runs a
    call on the calling thread's behalf and there is no device queue to fill."""
    return 1 if (backend_name or backend()) == "cpu" else QUEUED


def _precision_name(precision) -> str:
    if precision is None:
        return "default"
    return getattr(precision, "name", str(precision)).lower()


MATMUL_DTYPES = ("float32", "bfloat16", "float16", "int8", "float8_e4m3fn")
# What a matmul of each input dtype accumulates in (int8 × int8 → int32: the integer units'
# path, IMMA on GPU and the MXU's int8 mode on TPU; fp8 → float32 as the fp8 Tensor Cores do).
ACCUMULATE = {"int8": jnp.int32, "float8_e4m3fn": jnp.float32}


def _array_dtype(dtype) -> str:
    """The array dtype of a matmul at `dtype` ("tf32" is float32 at default precision)."""
    name = specs.canonical_dtype(dtype)
    name = {"tf32": "float32", "float8": "float8_e4m3fn"}.get(name, name)
    if name not in MATMUL_DTYPES:
        raise ValueError(f"dtype={dtype!r}: matmul ceilings cover {', '.join(MATMUL_DTYPES)}")
    return name


def _matmul_inputs(n: int, dtype) -> list:
    """Four random n×n operands: normal values for floats, uniform codes in [-127, 127] for
    int8 (never zeros; no hardware fast path applies)."""
    if dtype == jnp.int8:
        keys = jax.random.split(jax.random.key(0), 4)
        return [jax.random.randint(k, (n, n), -127, 128, jnp.int32).astype(jnp.int8) for k in keys]
    return timing.random_inputs(0, [(n, n)] * 4, dtype)


def measure_matmul(
    dtype="float32", *, precision=None, n: int | None = None, budget_s: float = 1.0
) -> dict:
    """FLOP/s of a jitted n×n·n×n matmul on the default device (2·n³ FLOPs per call).

    Two random input pairs are rotated so no call reuses the last call's operands.
    """
    n = n or matmul_n()
    dtype = jnp.dtype(_array_dtype(dtype))
    acc = ACCUMULATE.get(dtype.name)
    fn = jax.jit(lambda a, b: jnp.matmul(a, b, precision=precision, preferred_element_type=acc))
    inputs = _matmul_inputs(n, dtype)
    result = timing.bench(fn, rotate=[inputs[:2], inputs[2:]], budget_s=budget_s, inner=queued())
    flops = cost.matmul_flops(n, n, n)
    return {
        "dtype": dtype.name,
        "precision": _precision_name(precision),
        "n": n,
        "flops": flops,
        "flops_per_s": flops / result.median_s,
        **result.as_dict(),
    }


@functools.cache
def _cached_peak(backend_name: str, dtype: str, precision: str, n: int, budget_s: float):
    precision_arg = None if precision == "default" else precision
    return measure_matmul(dtype, precision=precision_arg, n=n, budget_s=budget_s)["flops_per_s"]


def matmul_peak(
    dtype="float32", *, precision=None, n: int | None = None, budget_s: float = 0.5
) -> float:
    """Measured matmul FLOP/s at `dtype`, cached for the process (so `lab.run` can ask often).

    On CPU this is the reference for MFU (no datasheet applies); about a second the first
    time, free afterwards.
    """
    return _cached_peak(
        backend(), _array_dtype(dtype), _precision_name(precision), n or matmul_n(), budget_s
    )


@functools.cache
def copy_peak(nbytes: int | None = None, budget_s: float = 0.5, cached: bool = False) -> float:
    """Measured copy bandwidth (bytes/s, x ← x·s in place), cached for the process like
    `matmul_peak`: the memory side of this device's roofline, for the step-time model on CPU."""
    return copy_bandwidth(nbytes, budget_s=budget_s, cached=cached)["bytes_per_s"]


def numpy_matmul(n: int = 2048, *, budget_s: float = 1.0) -> dict:
    """FLOP/s of numpy's BLAS on the same float32 matmul: an outside check of the CPU figure."""
    rng = np.random.default_rng(0)
    pairs = [tuple(rng.standard_normal((2, n, n), dtype=np.float32)) for _ in range(2)]
    result = timing.bench(np.matmul, rotate=pairs, budget_s=budget_s)
    flops = cost.matmul_flops(n, n, n)
    return {"n": n, "flops": flops, "flops_per_s": flops / result.median_s, **result.as_dict()}


def memory_roof(copy_bytes_per_s: float, rates: dict[str, float]) -> tuple[float, str | None]:
    """(memory roof, why it is not the copy kernel's, or None): the best bandwidth measured.

    A roof is what the device can be seen to reach: no op may sit above it. The copy kernel
    sets the memory roof unless an op (`rates`: name → bytes/s) moved bytes faster (a noisy
    host can slow one measurement and not another), in which case that op's bandwidth is the
    roof and the note (a phrase: "set by <note>") names it and says by how much the copy
    figure fell short."""
    name, best = max(rates.items(), key=lambda kv: kv[1], default=("", 0.0))
    if best <= copy_bytes_per_s:
        return copy_bytes_per_s, None
    short = 1 - copy_bytes_per_s / best
    return best, (
        f"{name}, which moved bytes faster (the copy figure is {short:.0%} below it: a noisy host?)"
    )


def roof_matmuls(matmuls: dict, dtype=None) -> list[dict]:
    """The matmuls that set the compute roof of a sweep run in `dtype`: that dtype's (a CPU's
    float32 ops are not held to its bfloat16 rate), or every float one where none is."""
    name = jnp.dtype(dtype).name if dtype is not None else None
    same = [m for (d, _), m in matmuls.items() if d == name]
    return same or [m for (d, _), m in matmuls.items() if d not in ACCUMULATE]


def roofs(matmuls: dict, copy_bytes_per_s: float, points, dtype=None) -> tuple[float, float, str]:
    """(compute roof, memory roof, how the memory roof was set): the best figures measured,
    the matmuls' in the sweep's `dtype` (`roof_matmuls`) and the sweep's own points
    (`memory_roof`: an op of the sweep that moved bytes faster than the copy kernel raises
    the memory roof to its own rate)."""
    floats = [m["flops_per_s"] for m in roof_matmuls(matmuls, dtype)]
    peak = max(floats + [p.flops_per_s for p in points])
    bandwidth, note = memory_roof(copy_bytes_per_s, {p.name: p.bytes / p.median_s for p in points})
    return peak, bandwidth, note or "the copy kernel's (x ← x·s)"


def last_level_cache_bytes() -> int:
    """This host's last-level cache per socket (sysfs), 0 where it cannot be read."""
    from pathlib import Path

    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        value = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        best = max(best, value)
    return best


MAX_SETS = 64  # at most this many buffers rotate (CPU: 1.5 GiB of 24 MiB ones)


def _sets(nbytes: int, cached: bool) -> int:
    """How many buffers of `nbytes` rotate so no cache holds the last call's: `SETS`, and on
    CPU enough for three times the last-level cache (a 300 MiB L3 holds four 24 MiB ones);
    one when the figure wanted is the cache's own (`cached`)."""
    if cached:
        return 1
    if backend() != "cpu":
        return SETS
    return min(MAX_SETS, max(SETS, -(-3 * last_level_cache_bytes() // nbytes)))


def copy_bandwidth(nbytes: int | None = None, *, budget_s: float = 1.0, cached: bool = False):
    """Device-memory bandwidth of x ← x·s in place: every byte read once and written once
    (2·nbytes).

    In place (the input donated), because a fresh output per call measures the allocator as
    much as the memory: on CPU glibc hands a large block fresh pages (zeroed by page faults
    inside the timed call) unless an earlier free raised its threshold, and the same 2-core
    host measured x·s out of place at 4.6–6.7 GB/s or 24–31 GB/s with the allocator's state,
    against 26.9–34.9 GB/s in place; a separate output's lines are also read before they are
    written (write-allocate), bytes the figure would not count. The buffers rotate (`_sets`)
    so no cache holds the last call's; `cached=True` reuses one: the bandwidth of an array
    that stays in the cache."""
    nbytes = nbytes or _sizes(backend())["copy"]
    n = nbytes // 4
    scale = jnp.float32(1.0001)
    fn = jax.jit(lambda x, s: x * s, donate_argnums=0)
    xs = [jnp.full((n,), 1.0 + i / 64, jnp.float32) for i in range(_sets(nbytes, cached))]
    result = timing.bench_in_place(lambda x: fn(x, scale), xs, budget_s=budget_s, inner=queued())
    moved = 2 * n * 4
    return {
        "bytes": moved,
        "bytes_per_s": moved / result.median_s,
        "buffer_bytes": n * 4,
        "buffers": len(xs),  # rotated
        **result.as_dict(),
    }


def read_bandwidth(nbytes: int | None = None, *, budget_s: float = 1.0) -> dict:
    """Device-memory bandwidth of a read stream: the sum of x, every byte read once and none
    written, over the same rotation as `copy_bandwidth`. What a memory-bound decode step
    does (it reads the weights and writes little); on a host whose cores can keep only so
    many reads in flight it is well below the copy figure, whose writes go back to memory
    alongside (2 cores of one VM: 17.6–24.3 GB/s read, 26.9–34.9 GB/s copied)."""
    nbytes = nbytes or _sizes(backend())["copy"]
    n = nbytes // 4
    fn = jax.jit(jnp.sum)
    xs = [jnp.full((n,), 1.0 + i / 64, jnp.float32) for i in range(_sets(nbytes, False))]
    result = timing.bench(fn, rotate=[(x,) for x in xs], budget_s=budget_s, inner=queued())
    return {"bytes": n * 4, "bytes_per_s": n * 4 / result.median_s, **result.as_dict()}


def numpy_copy_bandwidth(nbytes: int, *, budget_s: float = 1.0) -> dict:
    """np.multiply(x, s, out=y) into preallocated buffers: the host's memory bandwidth as
    numpy sees it (one core), beside XLA's figure on CPU."""
    rng = np.random.default_rng(2)
    n = nbytes // 4
    pairs = [
        (rng.standard_normal(n, dtype=np.float32), np.empty(n, np.float32))
        for _ in range(_sets(nbytes, False))  # as many as XLA's copy: no cache holds them
    ]
    fn = lambda x, y: np.multiply(x, np.float32(1.0001), out=y)
    result = timing.bench(fn, rotate=pairs, budget_s=budget_s)
    return {"bytes": 2 * nbytes, "bytes_per_s": 2 * nbytes / result.median_s, **result.as_dict()}


def _cpu_device():
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None


def _off_alignment(a: np.ndarray) -> np.ndarray:
    """A copy of `a` whose data starts 4 bytes past a 64-byte boundary.

    XLA:CPU does not copy a host array whose data is 64-byte aligned: `jax.device_put(...,
    may_alias=False)` shares its buffer (a host write after the put shows in the device
    array; JAX 0.10 and 0.12 alike), and copies any other. Which rotated array happened to be
    aligned was the allocator's choice, so the CPU's host→device figure swung 20× between
    runs (13.23 and 285.71 GB/s beside a 56.57 GB/s copy): the shared ones timed as free.
    Off the boundary, every put is the copy a transfer is on CPU, into a buffer XLA owns."""
    buf = np.empty(a.size + 64 // a.itemsize, a.dtype)
    start = (-buf.ctypes.data % 64 + 4) // a.itemsize
    out = buf[start : start + a.size]
    out[...] = a.ravel()
    return out.reshape(a.shape)


def host_to_device(nbytes: int | None = None, *, budget_s: float = 1.0) -> dict:
    """numpy → default device with `jax.device_put(may_alias=False)`. On CPU, host and device
    are the same memory: the figure is XLA's copy into a buffer it owns, from host arrays
    kept off 64-byte alignment, which XLA:CPU would share instead (`_off_alignment`)."""
    nbytes = nbytes or _sizes(backend())["transfer"]
    rng = np.random.default_rng(1)
    hosts = [(rng.standard_normal(nbytes // 4, dtype=np.float32),) for _ in range(SETS)]
    if backend() == "cpu":
        hosts = [(_off_alignment(a),) for (a,) in hosts]
    device = jax.devices()[0]
    fn = lambda a: jax.device_put(a, device, may_alias=False)
    result = timing.bench(fn, rotate=hosts, budget_s=budget_s)
    return {"bytes": nbytes, "bytes_per_s": nbytes / result.median_s, **result.as_dict()}


def device_to_host(nbytes: int | None = None, *, budget_s: float = 1.0) -> dict:
    """Default device → host memory.

    On an accelerator: `jax.device_put` onto the CPU device. On CPU, where host and device
    are the same memory, the same call with may_alias=False: a host memcpy, labelled so.
    """
    nbytes = nbytes or _sizes(backend())["transfer"]
    target = _cpu_device()
    if target is None:
        return {"bytes": nbytes, "bytes_per_s": None, "note": "no CPU backend in this process"}
    xs = [(x,) for x in timing.random_inputs(11, [(nbytes // 4,)] * SETS, jnp.float32)]
    fn = lambda x: jax.device_put(x, target, may_alias=False)
    result = timing.bench(fn, rotate=xs, budget_s=budget_s)
    return {"bytes": nbytes, "bytes_per_s": nbytes / result.median_s, **result.as_dict()}


def has_fp8(device=None) -> bool:
    """fp8 matmul units: NVIDIA compute capability 8.9+ (Ada, Hopper and later)."""
    device = device or jax.devices()[0]
    try:
        return device.platform == "gpu" and float(device.compute_capability) >= 8.9
    except (AttributeError, TypeError, ValueError):
        return False


def matmul_configs(backend_name: str) -> list[tuple[str, str | None]]:
    """(dtype, precision) pairs worth measuring: f32 exact and default, then half types, int8
    (what quantized inference multiplies in) and fp8 where the device has fp8 units."""
    configs = [("float32", "highest"), ("float32", None), ("bfloat16", None)]
    if backend_name == "gpu":
        configs.append(("float16", None))
    configs.append(("int8", None))
    if backend_name == "gpu" and has_fp8():
        configs.append(("float8_e4m3fn", None))
    return configs


def sizes(backend_name: str, size: str = "full") -> dict:
    """Buffer sizes and the sweep of one run. quick keeps the full buffers and halves the
    matmul;
    tiny (the tests) shrinks everything, since its numbers only exercise the code."""
    base = _sizes(backend_name)
    if size == "tiny":
        out = {k: v // 16 for k, v in base.items()} | {"mm_n": 128}
    elif size == "quick":
        out = base | {"mm_n": base["mm_n"] // 2}
    else:
        out = dict(base)
    n = out["mm_n"]
    wide = size == "full"
    out["degrees"] = (1, 2, 4, 8, 16, 32, 64, 128, 256) if wide else (1, 4, 16, 64)
    out["ms"] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, n) if wide else (1, 8, 64, n)
    return out


OUTLIER = 1.1  # a point this far above its roof is a measurement error, reported as one


def matmul_ratio_note(ratio: float, busy: tuple | None = None) -> str:
    """What JAX's CPU matmul over numpy's BLAS (the same product, same run) says; on a busy
    host (`records.busy_host()`), that it says nothing: the two were timed one after the
    other, and other work took cores from either (0.41× under load 3 on 2 cores, 0.98×
    quiet)."""
    if busy is not None:
        return (
            f"JAX at {ratio:.2f}× numpy's BLAS, timed one after the other on a busy host "
            f"(load {busy[0]:.1f} on {busy[1]} cores): no verdict, rerun on a quiet host"
        )
    if ratio > 1.2:
        return f"JAX {ratio:.2f}× numpy's BLAS: faster than the usual CPU matmul here"
    if ratio >= 0.8:
        return "JAX within 0.8–1.2× numpy's BLAS: the lab's CPU matmul is as fast as the usual one"
    return f"JAX at {ratio:.2f}× numpy's BLAS: slower than the usual CPU matmul here"


def roofline_ceilings(
    size: str = "full", *, budget_s: float = 1.0, matmuls=None, copy=None, done=None
) -> dict:
    """The roofline of the default device, measured in one place for lab.tools.ceilings and
    the ledger (C06): matmul peaks (or the given `matmuls`), the copy bandwidth, the sweep of
    ops of growing intensity, the roofs as the best rates measured (`roofs`), the ridge, and
    every point that still sits more than 10% above min(peak, intensity × bandwidth): with
    roofs taken as the best measured there should be none, so one is a measurement error.
    `copy`: the copy bandwidth's result where it was measured already; `done(point)` is
    called as each point of the sweep is timed."""
    be = backend()
    sz = sizes(be, size)
    if matmuls is None:
        matmuls = {}
        for dtype, precision in matmul_configs(be):
            m = measure_matmul(dtype, precision=precision, n=sz["mm_n"], budget_s=budget_s)
            matmuls[(dtype, m["precision"])] = m
    copy = copy or copy_bandwidth(sz["copy"], budget_s=budget_s)
    dtype = jnp.float32 if be == "cpu" else jnp.bfloat16
    ops = roofline.poly_ops(sz["poly"], sz["degrees"])
    ops += roofline.matmul_ops(sz["mm_n"], sorted(set(sz["ms"])), dtype=dtype)
    points = roofline.sweep(ops, budget_s=budget_s / 4, inner=queued(be), done=done)
    peak, bandwidth, how = roofs(matmuls, copy["bytes_per_s"], points, dtype)
    above = [
        (p, p.flops_per_s / roofline.attainable(p.intensity, peak, bandwidth))
        for p in points
        if p.flops_per_s > OUTLIER * roofline.attainable(p.intensity, peak, bandwidth)
    ]
    best = max(roof_matmuls(matmuls, dtype), key=lambda m: m["flops_per_s"])
    peak_op = f"matmul {best['dtype']} precision={best['precision']}, n={best['n']}"
    matmul_name = f"{best['dtype']} matmul, precision={best['precision']}, n={best['n']}"
    name = matmul_name
    if peak > best["flops_per_s"]:  # a point of the sweep ran faster: its rate is the roof
        fastest = max(points, key=lambda p: p.flops_per_s)
        name = f"the sweep's {fastest.name}, faster than the {matmul_name}"
        peak_op = fastest.name
    bandwidth_op = "copy"
    if bandwidth > copy["bytes_per_s"]:  # an op of the sweep moved bytes faster (memory_roof)
        bandwidth_op = max(points, key=lambda p: p.bytes / p.median_s).name
    return {
        "sizes": sz,
        "matmuls": matmuls,
        "peak_name": name,  # the op whose rate is the compute roof (a matmul or a sweep op)
        "peak_op": peak_op,  # what set each roof: "matmul <dtype…>" or a sweep point's name
        "bandwidth_op": bandwidth_op,  # "copy" or a sweep point's name
        "matmul_peak": best["flops_per_s"],  # the best matmul alone, and what it was
        "matmul_name": matmul_name,
        "copy": copy,
        "points": points,
        "peak_flops": peak,
        "bandwidth": bandwidth,
        "bandwidth_note": how,
        "ridge": roofline.ridge_point(peak, bandwidth),
        "above_roof": above,
    }


@dataclasses.dataclass(frozen=True)
class Row:
    """One figure of the ceilings table, as measured or derived (the record says which)."""

    what: str  # the record's `what`
    value: float | None  # None where it could not be measured here
    unit: str  # FLOP/s, B/s, ratio, FLOP/B
    note: str = ""  # how it was measured (size, method), or what it means
    # the datasheet figure this is a share of: a DeviceSpec.peak_flops key (the matmul's
    # dtype, tf32 for float32 at default precision), "memory_bandwidth", or None for none
    spec_key: str | None = None


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """Every ceiling of the default device (`run_all`): the table's rows, their records, the
    roofline sweep and the roofs taken from it."""

    # the table's order: the peaks and bandwidths as measured, then the roofs and the ridge,
    # then the sweep's points (each with its share of the roofs, known only after the sweep)
    rows: tuple[Row, ...]
    # one per row, in the order measured, as `done` got them and the .jsonl holds them: each
    # sweep point's record as it was timed, so before the roofs and the ridge taken from them
    records: tuple[dict, ...]
    points: tuple  # lab.measure.roofline.Point of the sweep
    peak_flops: float  # FLOP/s: the compute roof, the best rate measured
    bandwidth: float  # bytes/s: the memory roof, the best rate measured
    above_roof: tuple  # (point, its rate over its roof) for points > OUTLIER above it
    spec: specs.DeviceSpec | None  # the datasheet entry of this device, where there is one
    elapsed_s: float  # seconds the whole set took

    @property
    def ridge(self) -> float:
        """FLOP/B where the measured compute roof meets the measured memory roof."""
        return roofline.ridge_point(self.peak_flops, self.bandwidth)

    def share_of_spec(self, row: Row) -> tuple[float, str] | None:
        """(the row's value over its datasheet figure, the figure's name), where both exist."""
        if self.spec is None or row.value is None or row.spec_key is None:
            return None
        if row.spec_key == "memory_bandwidth":
            return row.value / self.spec.memory_bandwidth, row.spec_key
        peak = self.spec.peak_flops.get(row.spec_key)
        return (row.value / peak, row.spec_key) if peak else None


def _matmul_spec_key(dtype: str, precision: str) -> str:
    """The datasheet peak a matmul is held against: float32 at default precision runs as TF32
    on the GPUs that have it."""
    return "tf32" if dtype == "float32" and precision == "default" else dtype


RIDGE = "ridge point (compute roof / memory roof)"


def planned_rows(quick: bool = False) -> list[str]:
    """The `what` of every row `run_all` measures or derives on this device, so a stopped run
    can say which it did not reach."""
    be = backend()
    sz = sizes(be, "tiny" if quick else "full")
    names = [f"matmul {d} precision={_precision_name(p)}" for d, p in matmul_configs(be)]
    cpu = be == "cpu"
    names += ["matmul float32 numpy BLAS", "matmul float32 jax / numpy"] if cpu else []
    names += ["copy bandwidth (read+write)"] + (["copy bandwidth numpy (out=)"] if cpu else [])
    names += ["host→device bandwidth", "device→host bandwidth"]
    names += [f"roofline poly_{k}" for k in sz["degrees"]]
    names += [f"roofline mm_{m}" for m in sorted(set(sz["ms"]))]
    return names + ["compute roof", "memory roof", RIDGE]


def run_all(*, budget_s: float = 1.0, quick: bool = False, done=None) -> Ceilings:
    """Every ceiling of the default device: records, roofline points and roofs.

    `quick` shrinks every size (a code-path check for tests: the numbers mean little).
    `done(record, row)` is called as each row is measured or derived, so a stopped run keeps
    what it finished: a sweep point's row then says its intensity alone (the roofs its share
    is of come after the sweep; the final rows say it, and the record is the same).
    """
    t0 = time.perf_counter()
    be = backend()
    size = "tiny" if quick else "full"
    sz = sizes(be, size)
    n = sz["mm_n"]
    recs, rows = [], []
    done = done or (lambda record, row: None)

    def add(what, value, unit, note="", spec_key=None, label="measured", **config):
        recs.append(records.make_record(what, value, unit, label=label, **config))
        rows.append(Row(what, value, unit, note, spec_key))
        done(recs[-1], rows[-1])

    matmuls = {}
    for dtype, precision in matmul_configs(be):
        m = measure_matmul(dtype, precision=precision, n=n, budget_s=budget_s)
        matmuls[(dtype, m["precision"])] = m
        add(
            f"matmul {dtype} precision={m['precision']}",
            m["flops_per_s"],
            "OP/s" if dtype == "int8" else "FLOP/s",  # integer multiply-adds are not FLOPs
            f"n={n}, compile {m['compile_s']:.2f} s",
            spec_key=_matmul_spec_key(dtype, m["precision"]),
            **{k: m[k] for k in ("dtype", "precision", "n", "median_s", "p10_s", "p90_s", "runs")},
        )
    if be == "cpu":
        npm = numpy_matmul(n, budget_s=budget_s)
        jax_f32 = matmuls[("float32", "default")]["flops_per_s"]
        add("matmul float32 numpy BLAS", npm["flops_per_s"], "FLOP/s", f"n={n}", n=n)
        ratio = jax_f32 / npm["flops_per_s"]
        add(
            "matmul float32 jax / numpy",
            ratio,
            "×",
            matmul_ratio_note(ratio, records.busy_host()),
            label="derived",  # a ratio of two measured rows
            n=n,
        )
    copy_result = copy_bandwidth(sz["copy"], budget_s=budget_s)
    mib = f"{sz['copy'] / MiB:g} MiB × {_sets(sz['copy'], False)} rotated"
    note = f"XLA x ← x·s in place, {mib}"
    copy = copy_result["bytes_per_s"]
    add("copy bandwidth (read+write)", copy, "B/s", note, spec_key="memory_bandwidth")
    if be == "cpu":
        npc = numpy_copy_bandwidth(sz["copy"], budget_s=budget_s)
        note = f"one core, {mib}"
        add(
            "copy bandwidth numpy (out=)",
            npc["bytes_per_s"],
            "B/s",
            note,
            spec_key="memory_bandwidth",
        )
    cpu_note = " (CPU: host memcpy, same memory)" if be == "cpu" else ""
    notes = {  # an aligned host array XLA:CPU would share, not copy (`_off_alignment`)
        "host→device": " (CPU: XLA's memcpy into its own buffer, from an unaligned host array)"
    }
    for name, fn in (("host→device", host_to_device), ("device→host", device_to_host)):
        r = fn(sz["transfer"], budget_s=budget_s)
        note = f"{r['bytes'] / MiB:g} MiB{notes.get(name, cpu_note) if be == 'cpu' else ''}"
        add(f"{name} bandwidth", r["bytes_per_s"], "B/s", note)

    def point_record(p) -> dict:
        config = {"intensity": p.intensity, "flops": p.flops, "bytes": p.bytes}
        return records.make_record(
            f"roofline {p.name}", p.flops_per_s, "FLOP/s", **config, median_s=p.median_s
        )

    def timed(p) -> None:  # a sweep point as it is timed: its record now, its row's share later
        recs.append(point_record(p))
        note = f"intensity {p.intensity:.3g} FLOP/B (its share of the roof: after the sweep)"
        done(recs[-1], Row(f"roofline {p.name}", p.flops_per_s, "FLOP/s", note))

    roof = roofline_ceilings(size, budget_s=budget_s, matmuls=matmuls, copy=copy_result, done=timed)
    peak, bandwidth = roof["peak_flops"], roof["bandwidth"]
    # the roofs are the best of other rows, the ridge their ratio: derived, not measured again
    add("compute roof", peak, "FLOP/s", f"the roofline's: {roof['peak_name']}", label="derived")
    add("memory roof", bandwidth, "B/s", roof["bandwidth_note"], label="derived")
    add(RIDGE, roof["ridge"], "FLOP/B", "from the measured roofs", label="derived")
    for p in roof["points"]:  # their records were written as they were timed (`timed`)
        share = p.flops_per_s / roofline.attainable(p.intensity, peak, bandwidth)
        note = f"intensity {p.intensity:.3g} FLOP/B, {share:.0%} of roof" + (
            " — MEASUREMENT ERROR: above its roof" if share > OUTLIER else ""
        )
        rows.append(Row(f"roofline {p.name}", p.flops_per_s, "FLOP/s", note))
    return Ceilings(
        rows=tuple(rows),
        records=tuple(recs),
        points=tuple(roof["points"]),
        peak_flops=peak,
        bandwidth=bandwidth,
        above_roof=tuple(roof["above_roof"]),
        spec=specs.lookup(records.environment()["device_kind"]),
        elapsed_s=time.perf_counter() - t0,
    )


def so_far(rows, elapsed_s: float) -> Ceilings:
    """The rows a stopped run finished, as a `Ceilings` the table renders (no roofs yet)."""
    spec = specs.lookup(records.environment()["device_kind"])
    return Ceilings(tuple(rows), (), (), math.nan, math.nan, (), spec, elapsed_s)

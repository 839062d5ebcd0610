"""bench() and compare(): they wait for the work, keep compile time apart, rotate inputs."""

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab.measure import timing


class SlowLeaf:
    """A pytree leaf whose work is 'done' only when block_until_ready returns."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def block_until_ready(self):
        time.sleep(self.seconds)
        return self


def test_bench_blocks_on_every_leaf():
    # The slow leaf is the second output: blocking on the first leaf alone would miss it.
    fn = lambda x: (x, {"late": SlowLeaf(0.03)})
    r = timing.bench(fn, jnp.ones(3), warmup=0, min_runs=3, budget_s=0.0)
    assert r.median_s >= 0.03
    assert r.runs == 3


@jax.jit
def _heavy(x_NxN):
    """~0.7 GFLOP of dependent matmuls: tens of ms on a CPU, dispatched in well under 1 ms."""
    return jax.lax.fori_loop(0, 20, lambda i, y: jnp.tanh(y @ x_NxN), x_NxN)


def test_skipping_block_until_ready_would_be_visibly_wrong(monkeypatch):
    x = timing.random_normal(jax.random.key(0), (256, 256), scale=0.05)
    honest = timing.bench(_heavy, x, budget_s=0.2, min_runs=5)
    one_call_s = float("inf")  # the fastest of three: one call slowed by the host says little
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(_heavy(x))
        one_call_s = min(one_call_s, time.perf_counter() - t0)
    # JAX dispatches asynchronously: without the block, bench would time the dispatch only.
    monkeypatch.setattr(jax, "block_until_ready", lambda tree: tree)
    broken = timing.bench(_heavy, x, budget_s=0.0, warmup=0, min_runs=5)
    monkeypatch.undo()
    jax.block_until_ready(_heavy(x))  # drain what the broken run queued
    assert honest.median_s > 0.3 * one_call_s
    assert broken.median_s < honest.median_s / 5, (broken.median_s, honest.median_s)


def test_compile_time_is_reported_apart():
    def slow_to_trace(x):
        time.sleep(0.2)  # runs once, while tracing
        return x + 1

    r = timing.bench(jax.jit(slow_to_trace), jnp.ones(4), budget_s=0.05)
    assert r.compile_s >= 0.2
    assert r.median_s < 0.1
    assert r.p10_s <= r.median_s <= r.p90_s
    assert "times_s" not in r.as_dict()


def test_rotate_cycles_through_input_sets():
    seen = []
    fn = lambda a: seen.append(a) or a
    timing.bench(fn, rotate=[(1,), (2,), (3,)], warmup=0, min_runs=6, budget_s=0.0)
    assert seen[:3] == [1, 2, 3]  # each set once up front (compile / first placement)
    assert seen[3:9] == [1, 2, 3, 1, 2, 3]


def test_budget_bounds_the_runs():
    r = timing.bench(lambda: None, min_runs=5, max_runs=50, budget_s=10.0)
    assert r.runs == 50
    r = timing.bench(lambda: time.sleep(0.01), min_runs=3, budget_s=0.0)
    assert r.runs == 3


def test_compare_alternates_and_reports_ratios():
    order = []
    fast = lambda x: order.append("fast") or x
    slow = lambda x: order.append("slow") or time.sleep(0.005) or x
    out = timing.compare({"fast": fast, "slow": slow}, 1, baseline="slow", min_runs=4, budget_s=0)
    assert out["slow"]["ratio"] == pytest.approx(1.0)
    assert out["fast"]["ratio"] < 0.5
    timed = order[6:]  # after one compile call each and two warm-up rounds
    assert len(timed) >= 8 and timed == ["fast", "slow"] * (len(timed) // 2)
    with pytest.raises(ValueError, match="baseline"):
        timing.compare({"a": fast}, 1, baseline="b")


def test_inner_calls_queue_and_block_once_per_sample():
    """inner=4: four calls per sample, one block on the last, time per call."""
    calls, blocks = [], []

    class Leaf:
        def block_until_ready(self):
            blocks.append(len(calls))
            time.sleep(0.02)  # the queued work finishing: paid once per sample
            return self

    fn = lambda x: calls.append(x) or Leaf()
    out = timing.compare({"f": fn}, 1, baseline="f", warmup=0, min_runs=3, budget_s=0, inner=4)
    assert out["f"]["runs"] == 3
    assert blocks[1:] == [5, 9, 13]  # after the compile call, every 4th call
    assert 0.004 < out["f"]["median_s"] < 0.02  # 20 ms over 4 calls, not 20 ms a call
    with pytest.raises(ValueError, match="inner=0"):
        timing.compare({"f": fn}, 1, baseline="f", inner=0)


def test_summarise_percentiles():
    r = timing.summarise([float(i) for i in range(1, 101)], compile_s=0.5)
    assert r.median_s == pytest.approx(50.5)
    assert r.p10_s == pytest.approx(10.9)
    assert r.p90_s == pytest.approx(90.1)
    assert r.runs == 100 and r.compile_s == 0.5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_random_inputs_are_never_zero_and_differ(dtype):
    a, b = timing.random_inputs(0, [(64, 64), (64, 64)], dtype)
    assert a.dtype == dtype and a.shape == (64, 64)
    assert np.count_nonzero(np.asarray(a, np.float32)) > 0.99 * a.size
    assert not np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    again = timing.random_inputs(0, [(64, 64), (64, 64)], dtype)[0]  # same seed, same data
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(again, np.float32))


def test_comparison_is_typed_and_compare_keeps_its_dicts():
    """`comparison` gives each contender its bench and ratio (a property over the baseline's
    median); `compare` is the same figures as the dicts records are made of."""
    c = timing.comparison(
        {"a": lambda x: x + 1, "b": lambda x: x * 2}, 1.0, baseline="b", min_runs=2, budget_s=0
    )
    assert c.baseline == "b" and [x.name for x in c.contenders] == ["a", "b"]
    assert c["b"].ratio == 1.0 and c["a"].ratio == c["a"].bench.median_s / c["b"].bench.median_s
    d = c.as_dict()
    assert set(d["a"]) == {"median_s", "p10_s", "p90_s", "runs", "compile_s", "ratio"}
    assert d["a"]["ratio"] == c["a"].ratio
    with pytest.raises(KeyError):
        c["c"]


def test_in_place_rotation_puts_each_result_back_and_times_only_after_warm_up():
    """bench_in_place: every array once up front, then in turn, each call's result replacing
    its input (a donated buffer's successor), the runs bounded as bench's are."""
    calls = []

    def fn(a):
        calls.append(int(a[0]))
        return a + 10

    arrays = [jnp.array([1]), jnp.array([2])]
    r = timing.bench_in_place(fn, arrays, warmup=1, min_runs=4, max_runs=4, budget_s=10.0)
    assert calls == [1, 2, 11, 12, 21, 22, 31]  # up-front pass, warm-up, then 4 timed
    assert r.runs == 4 and r.compile_s > 0
    assert [int(a[0]) for a in arrays] == [41, 32]


def test_in_place_runs_queue_inner_calls_over_the_arrays_in_turn():
    """inner=3: each timed run is three calls over the next arrays in turn, blocked once; the
    figure is per call, and every result still lands in its array's place."""
    calls = []

    def fn(a):
        calls.append(int(a[0]))
        return a + 10

    arrays = [jnp.array([1]), jnp.array([2])]
    r = timing.bench_in_place(fn, arrays, warmup=0, min_runs=2, max_runs=2, inner=3)
    assert calls == [1, 2, 11, 12, 21, 22, 31, 32]  # up-front pass, then 2 runs × 3 calls
    assert r.runs == 2
    assert [int(a[0]) for a in arrays] == [41, 42]
    with pytest.raises(ValueError, match="inner=0"):
        timing.bench_in_place(fn, arrays, inner=0)


def test_ceilings_queue_calls_on_an_accelerator_and_block_each_on_cpu(monkeypatch):
    """The roofs on an accelerator are the device's time per call (calls queued, one wait a
    sample); on CPU each call is blocked on, as before."""
    from lab.measure import ceilings

    seen = []
    real = timing.bench

    def spy(*args, inner=1, **kwargs):
        seen.append(inner)
        return real(*args, inner=inner, **kwargs)

    real_in_place = timing.bench_in_place

    def spy_in_place(*args, inner=1, **kwargs):
        seen.append(("in place", inner))
        return real_in_place(*args, inner=inner, **kwargs)

    monkeypatch.setattr(timing, "bench", spy)
    monkeypatch.setattr(timing, "bench_in_place", spy_in_place)
    ceilings.measure_matmul("float32", n=64, budget_s=0.0)
    ceilings.copy_bandwidth(1 << 16, budget_s=0.0)
    monkeypatch.setattr(ceilings, "backend", lambda: "gpu")
    ceilings.measure_matmul("float32", n=64, budget_s=0.0)
    ceilings.read_bandwidth(1 << 16, budget_s=0.0)
    ceilings.copy_bandwidth(1 << 16, budget_s=0.0)
    q = ceilings.QUEUED
    assert seen == [1, ("in place", 1), q, q, ("in place", q)]
    assert ceilings.queued("cpu") == 1 and ceilings.queued("tpu") == q
    seen.clear()  # the roofline sweep: every point queued as the device asks
    given = {"dtype": "float32", "precision": "default", "n": 64, "flops_per_s": 1e9}
    # at the CPU's tiny sizes, two points of each kind: a GPU's sizes (64 MiB copies, 8
    # Mi-element polynomials) and more points only add seconds here, not other calls
    cpu_sizes = {**ceilings.sizes("cpu", "tiny"), "degrees": (1, 4), "ms": (1, 8)}
    monkeypatch.setattr(ceilings, "sizes", lambda backend, size: cpu_sizes)
    ceilings.roofline_ceilings("tiny", budget_s=0.0, matmuls={("float32", "default"): given})
    assert seen and set(seen) <= {q, ("in place", q)}


def test_comparison_settles_before_each_sample_and_does_not_time_the_pause():
    """settle_s: a pause before every contender's sample, untimed, and not taken from the
    budget; a negative pause is refused."""
    order = []

    def make(name):
        return lambda x: order.append((name, time.perf_counter())) or jnp.asarray(x)

    impls = {"a": make("a"), "b": make("b")}
    out = timing.comparison(
        impls, 1.0, baseline="a", warmup=0, min_runs=3, budget_s=0.0, settle_s=0.02
    )
    timed = order[2:]  # after one compile call each
    assert [n for n, _ in timed] == ["a", "b"] * 3
    gaps = [t1 - t0 for (_, t0), (_, t1) in zip(timed, timed[1:], strict=False)]
    assert min(gaps) >= 0.02  # every sample waited
    assert all(c.bench.median_s < 0.02 for c in out.contenders)  # the wait is not in the figure
    with pytest.raises(ValueError, match="settle_s"):
        timing.comparison(impls, 1.0, baseline="a", settle_s=-1.0)


@pytest.mark.parametrize(
    "call, needle",
    [
        (lambda f: timing.bench(f, 1.0, max_runs=0), "max_runs=0: must be >= min_runs=5"),
        (lambda f: timing.bench(f, 1.0, min_runs=0, budget_s=0), "min_runs=0: must be >= 1"),
        (lambda f: timing.bench_in_place(f, [1.0], min_runs=0), "min_runs=0: must be >= 1"),
        (
            lambda f: timing.compare({"a": f}, 1.0, baseline="a", min_runs=0, budget_s=0),
            "min_runs=0: must be >= 1",
        ),
    ],
)
def test_run_counts_that_time_nothing_are_refused_before_any_call(call, needle):
    """A median of no runs has no value: the counts are refused up front, in a line that
    names them, not by NumPy's percentile of an empty list after the compile."""
    calls = []
    with pytest.raises(ValueError, match=re.escape(needle)):
        call(lambda x: calls.append(x) or x)
    assert calls == []

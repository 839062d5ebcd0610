"""Eight simulated CPU devices, set before JAX initialises its backends."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu (installed for ahead-of-time TPU compilation) takes a machine-wide lock and probes
# for TPU metadata; test workers compile in parallel on a machine with no TPU.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5e-8")


def _fast_compiles():
    """The suite compiles thousands of small programs, in its workers and in the lab processes
    it starts, and compiling is most of its time: LLVM's optimisation of the generated CPU code
    is skipped (the programs are tiny; the HLO under test is unchanged) and every process
    shares one persistent compilation cache for the session, so a program compiled by one test
    or subprocess is loaded by the next (a damaged entry is compiled afresh). XLA_FLAGS naming
    an optimisation level, or JAX_COMPILATION_CACHE_DIR, set by the caller win."""
    import atexit
    import shutil
    import tempfile

    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the first process (xdist's controller)
        cache = tempfile.mkdtemp(prefix="lab-tests-compile-cache-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = cache  # inherited by workers and subprocesses
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    # JAX writes cache entries in place, not atomically: a process a test kills or limits
    # (SIGKILL, RLIMIT_FSIZE) can leave a truncated entry, and a worker can read one another is
    # still writing. JAX then compiles afresh and warns on stderr, which tests of the lab's
    # one-line errors read; the warning is about the test harness's cache, so it is filtered.
    quiet = [
        f"ignore:Error {verb} persistent compilation cache entry:UserWarning"
        for verb in ("reading", "writing")
    ]
    filters = [f for f in os.environ.get("PYTHONWARNINGS", "").split(",") if f]
    os.environ["PYTHONWARNINGS"] = ",".join(filters + [q for q in quiet if q not in filters])


_fast_compiles()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
assert len(jax.devices()) == 8  # start the backend now: runs under test cannot resize it


def pytest_collection_modifyitems(config, items):
    """CI runs the suite on two legs (.ci/run). The newest-JAX leg (Python 3.12+) runs every
    test. The oldest leg (Python 3.11, JAX 0.10) proves that every test function works on the
    old JAX, at a fraction of the cost: of a parametrized test only its first case, and not the
    tests marked `slow_plan` (big ahead-of-time compiles) or `once` (long multi-process or
    end-to-end runs whose JAX-facing code shorter tests cover on both legs).
    LAB_FULL=1 runs everything anywhere, LAB_FULL=0 the short set anywhere; LAB_SLOW_PLANS=1
    adds the slow plans to the short set, LAB_SLOW_PLANS=0 drops them everywhere.
    Tests marked `exhaustive` (the rest of an interpreted kernel's full case product, beyond
    the pairwise subset every leg runs) run only with LAB_EXHAUSTIVE=1, on any leg."""
    import sys

    import pytest

    want = os.environ.get("LAB_FULL")
    full = sys.version_info >= (3, 12) if want is None else want == "1"
    plans = os.environ.get("LAB_SLOW_PLANS")
    plans = full if plans is None else plans == "1"
    skip_plan = pytest.mark.skip(reason="slow plan: runs on the newest-JAX leg (LAB_SLOW_PLANS=1)")
    skip_once = pytest.mark.skip(reason="long run: runs on the newest-JAX leg (LAB_FULL=1)")
    skip_case = pytest.mark.skip(
        reason="a further case of a parametrized test: runs on the newest-JAX leg (LAB_FULL=1)"
    )
    exhaustive = os.environ.get("LAB_EXHAUSTIVE") == "1"
    skip_exhaustive = pytest.mark.skip(
        reason="beyond the pairwise cases of a kernel's matrix: LAB_EXHAUSTIVE=1 runs it"
    )
    first_seen = set()
    for item in items:
        if "exhaustive" in item.keywords and not exhaustive:
            item.add_marker(skip_exhaustive)
            continue
        if "slow_plan" in item.keywords:
            if not plans:
                item.add_marker(skip_plan)
            continue
        if full:
            continue
        if "once" in item.keywords:
            item.add_marker(skip_once)
        elif getattr(item, "callspec", None) is not None:
            function = item.nodeid.split("[")[0]
            if function in first_seen:
                item.add_marker(skip_case)
            first_seen.add(function)


import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng(request):
    """A fresh random generator per test (inputs differ on every run, never one fixed draw),
    its seed said in a failure's report so the draw can be repeated: LAB_SEED=N draws it
    again."""
    seed = os.environ.get("LAB_SEED", "").strip()
    seed = int(seed) if seed else int(np.random.SeedSequence().entropy % 2**32)
    request.node.lab_seed = seed
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    seed = getattr(item, "lab_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("random inputs", f"seed {seed}: LAB_SEED={seed} draws them again"))

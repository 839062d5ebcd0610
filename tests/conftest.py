"""Eight simulated CPU devices, set before JAX initialises its backends."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu (installed for ahead-of-time TPU compilation) takes a machine-wide lock and probes
# for TPU metadata; test workers compile in parallel on a machine with no TPU.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5e-8")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
assert len(jax.devices()) == 8  # start the backend now: runs under test cannot resize it


def pytest_collection_modifyitems(config, items):
    """`slow_plan` tests (big ahead-of-time compiles) run once per CI: on the newest-JAX leg
    (Python 3.12+), not on the 3.11 / JAX 0.10 leg, whose plans the quick tests already cover.
    LAB_SLOW_PLANS=1 runs them anywhere, LAB_SLOW_PLANS=0 nowhere."""
    import sys

    import pytest

    want = os.environ.get("LAB_SLOW_PLANS")
    run = sys.version_info >= (3, 12) if want is None else want == "1"
    if run:
        return
    skip = pytest.mark.skip(reason="slow plan: runs on the newest-JAX leg (LAB_SLOW_PLANS=1)")
    for item in items:
        if "slow_plan" in item.keywords:
            item.add_marker(skip)

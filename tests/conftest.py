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

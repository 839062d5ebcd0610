"""lab: measure what an accelerator buys you, with the same JAX code on CPU, GPU and TPU.

Importing the package quiets the compilers for absent hardware: with the `tpu` extra
installed (for ahead-of-time TPU plans), JAX's start-up would otherwise make libtpu query a
TPU VM's metadata server, and with the `gpu-plan` extra the CUDA plugin look for CUDA
libraries, each printing a screen of errors before every CPU run.
"""

import sys

from lab import startup

startup.huge_pages()  # a lab command starts again, its allocator in huge pages (once)
if startup.command():  # before the imports below (jax): Ctrl-C is one line from the start
    startup.install()
elif startup.main_module().partition(".")[0] in ("lab", "experiments"):
    startup.guard_imports()  # the other commands: one line until their main handles it
if startup.command() or startup.main_module() == "experiments":  # before jaxlib loads
    startup.native_log_level(startup.main_module(), [a.strip() for a in sys.argv[1:]])

from lab.plans.gpu import quiet_cuda_off_gpu  # noqa: E402
from lab.plans.tpu import quiet_libtpu_off_tpu  # noqa: E402

quiet_libtpu_off_tpu()
quiet_cuda_off_gpu()

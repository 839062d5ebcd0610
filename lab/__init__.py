"""lab: measure what an accelerator buys you, with the same JAX code on CPU, GPU and TPU.

Importing the package quiets libtpu on machines without TPU chips: with the `tpu` extra
installed (for ahead-of-time TPU plans), JAX's start-up would otherwise make libtpu query a
TPU VM's metadata server and print a screen of errors before every CPU or GPU run.
"""

from lab.devices import quiet_libtpu_off_tpu

quiet_libtpu_off_tpu()

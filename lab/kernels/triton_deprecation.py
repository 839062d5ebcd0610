"""JAX's deprecation of the Pallas Triton backend, explained once instead of per kernel.

From jax 0.11, lowering any Pallas kernel through Triton warns — a DeprecationWarning raised in
jax/_src/pallas/triton/pallas_call_registration.py (`deprecations.warn("jax-pallas-triton",
...)`) for every kernel: three per training step (the flash forward, dQ and dK/dV kernels),
one per decode kernel. Python hides DeprecationWarnings from library code by default, but
pytest, `python -W default` and any `PYTHONWARNINGS` show them, each test and each program
again. The lab keeps Triton on purpose: `pallas_gpu` is its portable GPU kernel (every NVIDIA
GPU since Volta, and the one the block-size tuner searches); Hopper has the Mosaic GPU kernel
(`pallas_mgpu`), the path JAX points to. So importing this module filters JAX's text (one
`warnings` filter, set once), and `explain()` prints one line on stderr instead, the first
time in a process that a Triton kernel is built for a GPU on a JAX that deprecates it.
"""

import functools
import sys
import warnings

import jax

JAX_TEXT = "The Pallas Triton backend is deprecated"  # the start of jax's message
SINCE = (0, 11)
NOTE = (
    "note: jax {version} deprecates Pallas's Triton backend (its warning is silenced): the lab "
    "keeps its Triton kernels (pallas_gpu: any NVIDIA GPU since Volta; the tuner's), and Hopper "
    "has the Mosaic GPU kernel (pallas_mgpu). Nothing to do (lab/kernels/triton_deprecation.py)."
)


def silence() -> None:
    """Filter JAX's warning (done once, on import; a repeated call adds no second filter)."""
    warnings.filterwarnings("ignore", message=JAX_TEXT, category=DeprecationWarning)


silence()


def deprecated_here() -> bool:
    """Whether this JAX deprecates the Pallas Triton backend."""
    return tuple(jax.__version_info__[:2]) >= SINCE


@functools.cache  # once per process
def explain() -> None:
    """One line on stderr where JAX deprecates Triton; call it where a Triton kernel is
    built for a GPU (not for the interpreter)."""
    if deprecated_here():
        print(NOTE.format(version=jax.__version__), file=sys.stderr)

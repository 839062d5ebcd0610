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
time in a process that a Triton kernel is built for a GPU on a JAX that deprecates it, where
the warning would have been shown (a plain `python -m lab…` hides it: no line there).
"""

import functools
import re
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


# the module JAX's warning is attributed to (its stacklevel names the caller of the Triton
# lowering in pallas_call_registration): what a filter's module pattern is matched against
_WARNS_FROM = "jax._src.pallas.pallas_call"


def _would_be_shown() -> bool:
    """Whether JAX's warning would be shown without the lab's filter: under the warnings
    filters in force (pytest's, `-W`, PYTHONWARNINGS) the first that matches it, other than
    the lab's own, does not ignore it. By default Python ignores a DeprecationWarning from
    library code: there is then nothing to explain."""
    for action, message, category, module, _ in warnings.filters:
        if message is not None and getattr(message, "pattern", message) == JAX_TEXT:
            continue  # the lab's own filter
        if message is not None and not re.match(message, JAX_TEXT):
            continue  # another warning's (numpy's sizes)
        if not issubclass(DeprecationWarning, category):
            continue
        if module is not None and not re.match(getattr(module, "pattern", module), _WARNS_FROM):
            continue
        return action != "ignore"
    return True  # no filter matches: Python's default action shows it


@functools.cache  # once per process
def explain() -> None:
    """One line on stderr where JAX deprecates Triton and its warning would have been shown;
    call it where a Triton kernel is built for a GPU (not for the interpreter)."""
    if deprecated_here() and _would_be_shown():
        print(NOTE.format(version=jax.__version__), file=sys.stderr)

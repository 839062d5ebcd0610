"""`python -m lab.run key=value ...`: train the transformer on a device mesh, on any backend.

Thin on purpose: parse, open a session (devices, mesh, trainer: lab/session.py), then hand over
to lab/loop.py. Every user mistake ends here as one line on stderr and exit code 2.
"""

import os
import sys
import time

from lab import plans
from lab.config import exit_code, help_text, make_config, parse_keys
from lab.errors import ConfigError


def _help() -> str:
    return f"{help_text()}\ntargets (e.g.): {plans.target_help()}"


def _named(keys: dict) -> dict:
    """The run folder's name: the user's, or model-mesh-time."""
    if keys.get("name"):
        return keys
    if keys.get("resume"):
        raise ConfigError("resume=true needs the run's name=NAME")
    cfg = make_config(**keys)
    return {**keys, "name": f"{cfg.preset}-{cfg.mesh}-{time.strftime('%Y%m%d-%H%M%S')}"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(_help())
        return 0

    def run() -> int:
        keys = _named(parse_keys(argv))
        from lab.loop import run_training  # heavy imports only once the keys are sound
        from lab.session import open_session

        return run_training(open_session(keys=keys))

    return exit_code(run)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    from lab.report.progress import survive_lost_output

    survive_lost_output()
    sys.exit(main())

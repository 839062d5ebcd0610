"""`python -m lab.run key=value ...`: train the transformer on a device mesh, on any backend.

Thin on purpose: parse, open a session (platform, resolve, trainer: lab/session.py), then
hand over to lab/loop.py. Every user mistake ends here as one line on stderr (a line for each
broken rule) and exit code 2.
"""

import sys

from lab import plans
from lab.config import check_environment, exit_code, help_text, parse_keys


def _help() -> str:
    return f"{help_text()}\ntargets (e.g.): {plans.target_help()}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(_help())
        return 0

    def run() -> int:
        check_environment()  # what JAX reads as its backend starts: before anything
        keys = parse_keys(argv)  # each key checked alone, before anything heavy is imported
        from lab.loop import run_training
        from lab.resolve import Request
        from lab.session import open_session

        # the rules, the backend's defaults and the run's name: once the platform is known
        return run_training(open_session(request=Request(tuple(keys.items()))))

    return exit_code(run)


if __name__ == "__main__":
    from lab.report.progress import survive_lost_output

    survive_lost_output()
    sys.exit(main())

"""The errors a user sees as one line: what every entry point catches and turns into an exit code.

`ConfigError` is a mistake in what the user asked for (a key, a value, a mesh or a compiled
step that does not fit the devices, a damaged run folder, a missing compiler package): exit
code 2. `RunError` is a run that cannot go on after it started (a NaN loss, a full disk):
exit code 1.
"""


class ConfigError(ValueError):
    """A bad key, value or input: one line for the user, exit code 2."""


class RunError(Exception):
    """A run that cannot go on (a NaN loss, a failed write): one line on stderr, exit code 1."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop) raised where Ctrl-C would be, so the same clean-up runs:
    one line on stderr, exit code 143 (128 + SIGTERM), not Ctrl-C's 130."""

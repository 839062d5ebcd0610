"""Errors the user sees as one line (config mistakes live in lab.config.ConfigError)."""


class RunError(Exception):
    """A run that cannot go on (memory, NaN loss): one line on stderr, exit code 1."""

"""The one exception type for mistakes a user fixes by changing a command, a config or a file.

Entry points catch ``ConfigError`` only: it prints as one line and exits with status 2. Every other exception is a
bug or a failure of the machine and keeps its traceback. It subclasses ``ValueError`` because every user error is a
bad value somewhere (an override, a path, a file's contents), so callers that already handle bad values keep working.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A user error: the message names what is wrong (the dotted key, the value, the file) and how to fix it."""


def config_error(key: str, value: object, problem: str, fix: str) -> ConfigError:
    """The user error in the one style every message follows: ``key=value: problem. Fix: override``."""
    return ConfigError(f"{key}={value!r}: {problem}. Fix: {fix}")

"""The one base class of every error a user of the toolkit's commands is shown as a single line.

Each command catches `UserError` only and prints `PROG: error: MESSAGE`; anything else is a bug and keeps
its traceback. Exit codes: 2 for usage errors (an option or config value that cannot work, as argparse
does), 1 for errors found while working (files, data, checkpoints).
"""

from __future__ import annotations

import sys


class UserError(Exception):
    """Bad input found while working; `str()` is the whole message, naming the file or field."""

    exit_code = 1


class UsageError(UserError):
    """An option or config value that cannot work."""

    exit_code = 2


def report(prog: str, error: UserError) -> int:
    """Print `error` as the command's one error line; returns the exit code."""
    print(f"{prog}: error: {error}", file=sys.stderr)
    return error.exit_code

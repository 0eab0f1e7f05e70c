"""hvdtrain's own errors, for callers of the Python API; the CLI turns them into one line and exit 2.

Input refused before anything starts is a `UserError`. It subclasses ValueError, so code that
validates with ValueError (config parsing, recipe variants) and the API agree without wrapping.
A job that starts and then fails is no error: `hvdtrain.run` returns a RunResult saying so.
"""

from __future__ import annotations

from pathlib import Path

EXIT_USAGE = 2


class HvdtrainError(Exception):
    """Every error hvdtrain raises on purpose."""


class UserError(HvdtrainError, ValueError):
    """Bad input, refused before anything starts: the message says what is wrong and what would fix it."""

    exit_code = EXIT_USAGE


class UnknownRecipeError(UserError):
    """A recipe name that no recipe module registers; the message names the known recipes."""


class NothingToDo(HvdtrainError):
    """A request that is already fulfilled (resuming a finished run): said, exit 0, nothing changed."""

    def __init__(self, message: str, run_dir: Path) -> None:
        super().__init__(message)
        self.run_dir = run_dir

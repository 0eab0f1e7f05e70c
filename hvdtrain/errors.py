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


class InputError(UserError):
    """What a rank was given and cannot use: a data file that does not decode, a folder it cannot
    read, a recipe whose build() breaks its contract. The rank says it in one line (INPUT_ERROR) and
    keeps the traceback in its log, for the error is in the input, not in the code."""

    @staticmethod
    def line_of(error: BaseException) -> str:
        """The message, one line: an error re-raised from a DataLoader worker carries that worker's
        traceback in its message, with the original line last."""
        lines = str(error).strip().splitlines() or [""]
        return lines[-1].split(f"{InputError.__name__}: ", 1)[-1]


INPUT_ERROR = "hvdtrain: error:"
"""How a rank's line about its input begins."""
TRACEBACK_FOLLOWS = "hvdtrain: the traceback of the input error below, for the rank's log:"
"""The line before such a rank's traceback: the console leaves out what follows up to its line."""


class UnknownRecipeError(UserError):
    """A recipe name that no recipe module registers; the message names the known recipes."""


class NothingToDo(HvdtrainError):
    """A request that is already fulfilled (resuming a finished run): said, exit 0, nothing changed."""

    def __init__(self, message: str, run_dir: Path) -> None:
        super().__init__(message)
        self.run_dir = run_dir

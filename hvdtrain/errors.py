"""hvdtrain's own errors, for callers of the Python API; the CLI turns them into one line and exit 2.

Input refused before anything starts is a `UserError`. It subclasses ValueError, so code that
validates with ValueError (config parsing, recipe variants) and the API agree without wrapping.
A job that starts and then fails is no error: `hvdtrain.run` returns a RunResult saying so.
"""

from __future__ import annotations

from pathlib import Path

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INCONSISTENT_WEIGHTS = 3
EXIT_DIVERGED = 4
EXIT_WRITE_FAILED = 5
EXIT_STALL = 75
SIGNAL_EXITS = range(129, 160)
"""128 + the signal that stopped hvdtrain (SIGINT 130, SIGTERM 143)."""

EXIT_CODES = {
    0: "finished, or preempted with its checkpoint written",
    EXIT_FAILED: "the job failed: a rank's own exit code or signal (in the message and run.json's "
    "`rank_exit_code`), a launcher that failed, a lost host",
    EXIT_USAGE: "bad input: refused before any rank started, or input a rank could not use",
    EXIT_INCONSISTENT_WEIGHTS: "the ranks ended with different weights",
    EXIT_DIVERGED: "diverged: a loss or gradient that is not finite",
    EXIT_WRITE_FAILED: "a checkpoint could not be written (a full disk, a read-only folder)",
    EXIT_STALL: "a stall: a rank stopped joining collectives for --stall-timeout",
}
"""hvdtrain's own exit codes, and 128 + N for a signal. A rank's own code is never passed on as
hvdtrain's, where a script's exit(2) would read as bad input: the job exits 1 and says the code."""


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
INCONSISTENT_WEIGHTS = "hvdtrain: ranks ended with different weights"
"""How a rank says the ranks' weights differ at the end (exit EXIT_INCONSISTENT_WEIGHTS)."""
TRACEBACK_FOLLOWS = "hvdtrain: the traceback of the input error below, for the rank's log:"
"""The line before such a rank's traceback: the console leaves out what follows up to its line."""


class UnknownRecipeError(UserError):
    """A recipe name that no recipe module registers; the message names the known recipes."""


class NothingToDo(HvdtrainError):
    """A request that is already fulfilled (resuming a finished run): said, exit 0, nothing changed."""

    def __init__(self, message: str, run_dir: Path) -> None:
        super().__init__(message)
        self.run_dir = run_dir

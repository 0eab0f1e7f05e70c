"""hvdtrain's exit codes: its own, documented in one table, never confused with a rank's own."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from hvdtrain import errors
from hvdtrain.job.report import exit_code_of, failure_lines, rank_exit_code
from hvdtrain.launching.runner import LaunchResult
from hvdtrain.launching.spec import Failure
from hvdtrain.runtime.checkpoint import WRITE_FAILED
from hvdtrain.runtime.watchdog import STALL_MARKER

ROOT = Path(__file__).resolve().parents[2]


def ended(code: int | None, *lines: str, returncode: int = 1, rank: int = 1) -> LaunchResult:
    failure = Failure(rank, code) if code is not None or rank >= 0 else None
    return LaunchResult(returncode, failure, list(lines), 1.0)


@pytest.mark.parametrize(
    ("result", "job", "rank"),
    [
        (ended(0, returncode=0), 0, None),
        (ended(3), errors.EXIT_FAILED, 3),  # a script's own 3
        (ended(2), errors.EXIT_FAILED, 2),  # a script's 2 is not bad input
        (ended(75), errors.EXIT_FAILED, 75),  # nor its 75 a stall
        (ended(-9), errors.EXIT_FAILED, -9),  # a rank killed by SIGKILL is not hvdtrain stopped by it
        (ended(2, "[1,1]<stderr>:hvdtrain: error: cannot decode x.jpg"), errors.EXIT_USAGE, None),
        (ended(75, f"{STALL_MARKER} rank 1 waited 30s"), errors.EXIT_STALL, None),
        (ended(1, f"{STALL_MARKER} rank 0 waited 30s"), errors.EXIT_STALL, None),  # a peer named first
        (ended(None, f"{STALL_MARKER} rank 0 waited 30s", rank=-1), errors.EXIT_STALL, None),
        (ended(5, f"{WRITE_FAILED} cannot write"), errors.EXIT_WRITE_FAILED, None),
        (ended(3, f"{errors.INCONSISTENT_WEIGHTS} (runs/x)"), errors.EXIT_INCONSISTENT_WEIGHTS, None),
        (ended(3, f"{STALL_MARKER} rank 0 waited"), errors.EXIT_FAILED, 3),  # the marker is not its code's
        (ended(None, rank=-1), errors.EXIT_FAILED, None),
    ],
)
def test_a_job_exits_with_hvdtrains_code_only_where_a_rank_said_why(result, job, rank):
    assert (exit_code_of(result), rank_exit_code(result)) == (job, rank)


def test_a_signal_to_hvdtrain_is_128_plus_it_and_a_divergence_4():
    stopped = LaunchResult(1, Failure(1, 2), [], 1.0, stopped_by=signal.SIGTERM)
    assert exit_code_of(stopped) == 143 and rank_exit_code(stopped) is None
    diverged = LaunchResult(1, Failure(1, 1), [], 1.0, diverged={"step": 3})
    assert exit_code_of(diverged) == errors.EXIT_DIVERGED


def test_the_codes_do_not_collide_and_usage_md_lists_each():
    own = set(errors.EXIT_CODES)
    assert len(own) == len(errors.EXIT_CODES) and not own & set(errors.SIGNAL_EXITS)
    text = (ROOT / "docs" / "usage.md").read_text()
    table = dict(re.findall(r"^\| `(\d+)` \| (.+?) \|$", text, re.M))
    assert set(map(int, table)) == own, table


def test_bad_input_names_the_log_of_the_rank_that_said_it_not_of_a_peer_that_exited_first(tmp_path):
    """A peer taken down by the failed rank can exit before it (a TF rank's teardown is slow)."""
    logs = tmp_path / "logs"
    line = f"{errors.INPUT_ERROR} x.png cannot be read"
    said = f"{errors.TRACEBACK_FOLLOWS}\nTraceback (most recent call last):\n{line}\n"
    for rank, text in ((0, said), (1, "hvdtrain: a collective ended because another rank did\n")):
        (logs / "1" / f"rank.{rank}").mkdir(parents=True)
        (logs / "1" / f"rank.{rank}" / "stderr").write_text(text)
    lines = [f"[1,0]<stderr>:{errors.TRACEBACK_FOLLOWS}", f"[1,0]<stderr>:{line}"]
    first = failure_lines(LaunchResult(1, Failure(1, 1), lines, 1.0), logs)[0]
    assert first.endswith(f"(its traceback: {logs / '1' / 'rank.0' / 'stderr'})"), first

"""How a job ended, as a RunResult, and the lines that say it."""

from __future__ import annotations

import json
import re
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hvdtrain.errors import (
    EXIT_DIVERGED,
    EXIT_FAILED,
    EXIT_INCONSISTENT_WEIGHTS,
    EXIT_STALL,
    EXIT_USAGE,
    EXIT_WRITE_FAILED,
    INCONSISTENT_WEIGHTS,
    INPUT_ERROR,
    TRACEBACK_FOLLOWS,
)
from hvdtrain.launching.console import human
from hvdtrain.launching.rank_output import rank_output_files, rank_stderr_tail
from hvdtrain.launching.runner import LaunchResult
from hvdtrain.records.runs import status_of
from hvdtrain.runtime import divergence
from hvdtrain.runtime.checkpoint import WRITE_FAILED
from hvdtrain.runtime.common import atomic_write_bytes, read_json_object
from hvdtrain.runtime.watchdog import STALL_MARKER
from hvdtrain.strategies.ps import PS_MARKER


@dataclass(frozen=True)
class RunResult:
    """How a job ended. A job that starts and fails is a result, not an exception."""

    status: str
    """finished, failed, diverged, interrupted or preempted: the word run.json records."""
    exit_code: int
    """What `hvdtrain run` exits with: 0, one of hvdtrain's codes (hvdtrain.errors.EXIT_CODES), or
    128 + the stopping signal."""
    run_dir: Path
    summary: dict[str, Any] = field(default_factory=dict)
    """summary.json (the start-up included in wall_seconds); empty where the job wrote none."""
    message: str = ""
    """What the CLI says at the end: the summary line, or what happened (what failed and where its
    logs are)."""
    rank_exit_code: int | None = None
    """The failed rank's own exit code (negative: the signal that killed it), where the job failed
    because a rank did and hvdtrain did not end it with a code of its own."""

    @property
    def ok(self) -> bool:
        return self.status == "finished"


def say(console: bool, line: str, *, err: bool = False) -> None:
    """hvdtrain's own lines beside the job's output; silent where the caller turned the console off."""
    if console:
        print(line, file=sys.stderr if err else sys.stdout, flush=True)


def report(run_dir: Path, rank_hosts: tuple[str, ...], result: LaunchResult) -> RunResult:
    """The result of a job that ran, with the summary line or the lines naming what failed."""
    logs = run_dir / "logs"
    code = exit_code_of(result)
    status = status_of(code, result.stopped_by, result.preempted, result.diverged is not None)
    if result.diverged is not None:
        saved = result.diverged.get("checkpoint")
        if saved is None:
            kept = "no checkpoint was written before it"
        else:
            kept = f"its last checkpoint (step {saved}) is kept: --resume --run-dir {run_dir}"
            kept += " --set lr=... goes on from it"
        return RunResult(status, code, run_dir, message=f"{divergence.describe(result.diverged)}; {kept}")
    if result.stopped_at is not None:
        step = result.stopped_at.get("step")
        if result.stopped_at.get("checkpoint"):
            then = f"its checkpoint saved; --resume --run-dir {run_dir} continues the run"
        else:
            then = "no checkpoint written (checkpoint=false): the run cannot be resumed"
        how = "preempted" if result.preempted else f"stopped by {signal.Signals(result.stopped_by).name}"
        return RunResult(
            status, code, run_dir, message=f"{how}: every rank stopped after step {step}, {then}"
        )
    if result.stopped_by is not None:
        name = signal.Signals(result.stopped_by).name
        return RunResult(
            status, code, run_dir, message=f"stopped by {name}: every rank was ended; logs: {logs}"
        )
    if result.returncode != 0:
        lines = [*result.lost_hosts.values(), *failure_lines(result, logs, rank_hosts)]
        summary = read_json_object(run_dir / "summary.json") or {}
        return RunResult(status, code, run_dir, summary, "\n".join(lines), rank_exit_code(result))
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        return RunResult(status, code, run_dir, message=f"done in {result.wall_seconds:.1f}s; logs in {logs}")
    summary = {**json.loads(summary_path.read_text()), "wall_seconds": result.wall_seconds}
    atomic_write_bytes(summary_path, (json.dumps(summary, indent=2) + "\n").encode())  # start-up included
    return RunResult(status, code, run_dir, summary, summary_line(summary))


OWN_EXITS = (
    (STALL_MARKER, EXIT_STALL),
    (WRITE_FAILED, EXIT_WRITE_FAILED),
    (INPUT_ERROR, EXIT_USAGE),
    (INCONSISTENT_WEIGHTS, EXIT_INCONSISTENT_WEIGHTS),
)
"""The line a rank says before it exits with one of hvdtrain's codes: a code alone may be a
script's own sys.exit(2)."""


def exit_code_of(result: LaunchResult) -> int:
    """0; 128 + the signal that stopped the job; one of hvdtrain's codes where a rank said why it
    exits with it; else EXIT_FAILED (the rank's own code goes in RunResult.rank_exit_code)."""
    if result.stopped_by is not None:
        return 128 + result.stopped_by
    if result.diverged is not None:
        return EXIT_DIVERGED
    if result.returncode == 0:
        return 0
    code = result.failure.exit_code if result.failure else None
    said = next((own for line in result.output_tail for marker, own in OWN_EXITS if marker in line), None)
    # the rank named first may be a peer the failed one took down (exit 1)
    if said is not None and code in (None, EXIT_FAILED, said):
        return said
    return EXIT_FAILED


def rank_exit_code(result: LaunchResult) -> int | None:
    """The failed rank's own code where the job's is not one of hvdtrain's."""
    if result.failure is None or exit_code_of(result) != EXIT_FAILED:
        return None
    return result.failure.exit_code


def failure_lines(result: LaunchResult, logs: Path, rank_hosts: tuple[str, ...] = ()) -> list[str]:
    markers = (STALL_MARKER, PS_MARKER, WRITE_FAILED, INPUT_ERROR)
    reports = [line for line in result.output_tail if any(m in line for m in markers)]
    if reports:
        line = reports[0][reports[0].index("hvdtrain: ") + len("hvdtrain: ") :]  # show() adds it
        lines = [MPI_TAG_AFTER.sub("", line)]
        traced = any(TRACEBACK_FOLLOWS in line for line in result.output_tail)
        if INPUT_ERROR in reports[0] and traced:
            lines[0] += f" (its traceback: {input_error_log(logs, result)})"
    elif result.failure is not None:
        rank, code = result.failure.rank, result.failure.exit_code
        if code is not None and code < 0:
            how = f"killed by {signal_name(-code)}"
        else:
            how = f"exit code {code}" if code is not None else f"job exit code {result.returncode}"
        where = f" on {rank_hosts[rank]}" if rank < len(rank_hosts) else ""
        lines = [f"rank {rank}{where} failed first ({how}); last lines of its stderr:"]
        lines += [f"  {line}" for line in rank_stderr_tail(logs, rank)]
    else:
        lines = [f"the job failed (exit code {result.returncode}); last lines of its output:"]
        lines += [f"  {line}" for line in result.output_tail[-15:]]
    return [*lines, f"logs: {logs}"]


def input_error_log(logs: Path, result: LaunchResult) -> Path:
    """The stderr file of the rank that said the input error: not always the rank the launcher saw
    fail first, as a peer taken down by it may exit sooner than it ends (a TF rank's teardown)."""
    files = rank_output_files(logs, "stderr")
    for _rank, path in sorted(files.items()):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        if INPUT_ERROR in text and TRACEBACK_FOLLOWS in text:
            return path
    return files.get(result.failure.rank, logs) if result.failure is not None else logs


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


MPI_TAG_AFTER = re.compile(r"\[\d+,\d+\]<std(?:out|err)>:.*$")
"""mpirun's tag of another line, which its output can put after the end of a rank's line."""

SUMMARY_KEYS = (
    "recipe",
    "strategy",
    "world_size",
    "final_loss",
    "test_accuracy",
    "samples_per_sec",
    "tokens_per_sec",
    "mfu",
    "peak_device_memory_mib",
    "wall_seconds",
    "weights_consistent",
    "run_dir",
)


SHOWN_WHERE_REPORTED = {"tokens_per_sec", "mfu", "peak_device_memory_mib"}
"""Keys a run reports only where they mean something (tokens, a known peak, a GPU)."""


def summary_line(summary: dict) -> str:
    """The keys of SUMMARY_KEYS, with every test metric the run reported where test_accuracy stands."""

    def shown(value):
        return human(value).replace(",", "") if isinstance(value, float) else str(value)

    summary = dict(summary)
    if summary.get("peak_device_memory_bytes"):  # the most any rank held
        summary["peak_device_memory_mib"] = max(summary["peak_device_memory_bytes"]) / 2**20
    tested = [key for key in summary if key.startswith("test_")] or ["test_accuracy"]
    keys = [name for key in SUMMARY_KEYS for name in (tested if key == "test_accuracy" else [key])]
    keys = [key for key in keys if key not in SHOWN_WHERE_REPORTED or summary.get(key) is not None]
    return "summary: " + "  ".join(f"{key}={shown(summary.get(key))}" for key in keys)

"""Runs to look back at: `hvdtrain runs` lists run directories, `hvdtrain show` explains one.

`read_run` reads a run directory once into RunFacts (the only I/O besides writing curves.png); every
decision after it (the status, the row, the listing, the curves) is a pure function of those facts.

run.json is the run's record. `hvdtrain run` writes it with status "running", its pid, host and start
time before the ranks start, and rewrites it when the job ends: "finished" (exit 0), "failed" (with
the exit code) or "interrupted" (a signal stopped hvdtrain). See `run_status` for how a record that
was never rewritten (hvdtrain itself was killed) or an older run without one is read.
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from hvdtrain.runtime.common import RUN_RECORD

STATUSES = ("finished", "failed", "diverged", "interrupted", "preempted", "running", "submitted", "unknown")
RUN_FILES = (RUN_RECORD, "summary.json", "config.json", "metrics.jsonl")
"""What makes a folder a run directory: any one of these."""
SWEEP_FILE = "sweep.json"
"""What makes a folder a sweep directory (hvdtrain sweep): its trials' run directories are in it."""
NAME_STAMP = re.compile(r"-(\d{8}-\d{6})$")
"""A default run directory's name ends with its start time: runs/RECIPE-YYYYmmdd-HHMMSS."""
START_SLACK_S = 2.0
"""A live pid is the run's own if its process began no later than this after the recorded start
(the record's times are to the second); a later one is another process that got the pid."""


def now_iso() -> str:
    """Local time with its UTC offset, to the second: readable, and unambiguous across hosts."""
    return datetime.now().astimezone().isoformat(timespec="seconds")


def running_record(
    base: dict[str, Any], previous: dict[str, Any] | None, *, pid: int, host: str, now: str, resume: bool
) -> dict[str, Any]:
    """run.json as a job starts. A restart within the same `hvdtrain run` (same pid and host) keeps
    its start time; a --resume keeps the run's first start as "first_started"."""
    previous = previous or {}
    restart = previous.get("pid") == pid and previous.get("host") == host and "started" in previous
    record = {**base, "status": "running", "pid": pid, "host": host}
    record["started"] = previous["started"] if restart else now
    first = (previous.get("first_started") or previous.get("started")) if resume or restart else None
    if first and first != record["started"]:
        record["first_started"] = first
    if (resume or restart) and "mlflow" in previous:  # the MLflow run a resume goes on logging to
        record["mlflow"] = previous["mlflow"]
    if previous.get("status") == "submitted":  # hvdtrain submit's job; inside it, the job's own follow
        record |= {key: value for key, value in previous.items() if key.startswith("slurm_")}
    return record


def status_of(exit_code: int, stopped_by: int | None, preempted: bool = False, diverged: bool = False) -> str:
    """How a job ended, in run.json's words (and `hvdtrain.run`'s RunResult.status): preempted
    where every rank stopped at one step for SIGUSR1, its checkpoint written; diverged where every
    rank stopped at one step because a loss or gradient was not finite."""
    if diverged:
        return "diverged"
    if preempted:
        return "preempted"
    if stopped_by is not None:
        return "interrupted"
    return "finished" if exit_code == 0 else "failed"


def ended_record(
    record: dict[str, Any],
    exit_code: int,
    stopped_by: int | None,
    now: str,
    preempted: bool = False,
    diverged: dict[str, Any] | None = None,
    rank_exit_code: int | None = None,
) -> dict[str, Any]:
    """run.json as the job ends: how, and with which exit code of hvdtrain's (and the failed rank's
    own, where that made the job fail); where it diverged, rank 0's record of where
    (hvdtrain.runtime.divergence)."""
    status = status_of(exit_code, stopped_by, preempted, diverged is not None)
    ended = {**record, "ended": now, "exit_code": exit_code, "status": status}
    ended.pop("rank_exit_code", None)
    if rank_exit_code is not None:
        ended["rank_exit_code"] = rank_exit_code
    if diverged is not None:
        ended["diverged"] = {key: value for key, value in diverged.items() if key != "time"}
    else:
        ended.pop("diverged", None)
    if "slurm_job_id" in record:
        from hvdtrain.launching.slurm import STATE_AT_END

        ended["slurm_state"] = STATE_AT_END[ended["status"]]
    if stopped_by is not None:
        return {**ended, "signal": signal.Signals(stopped_by).name}
    return ended


@dataclass(frozen=True)
class RunFacts:
    """One run directory, as read from disk (and, for a running record, this host's process table)."""

    path: Path
    record: dict[str, Any] | None = None
    """run.json, None where missing or damaged."""
    summary: dict[str, Any] | None = None
    config: dict[str, Any] | None = None
    epochs: tuple[dict[str, Any], ...] = ()
    """The epoch records of metrics.jsonl, by epoch; a resumed epoch's later record wins."""
    problems: tuple[str, ...] = ()
    """What is damaged, one line each (a bad JSON file, a bad metrics line)."""
    pid_alive: bool | None = None
    """Whether a running record's pid is still its process here; None where not checkable (another
    host's record, or no running record)."""
    mtime: float | None = None
    """When config.json (else the directory) was last changed: the start of a run that says nothing else."""
    slurm_state: str | None = None
    """The state of the run's Slurm job as Slurm tells it now; None where it no longer knows the job
    (or no Slurm answers here): run.json's last recorded state is shown then."""
    sweep: str | None = None
    """The name of the sweep directory this run is a trial of (hvdtrain sweep), else None."""


def run_status(record: dict[str, Any] | None, has_summary: bool, pid_alive: bool | None) -> str:
    """The status a run is shown with.

    - A record with an end status (finished, failed, diverged, interrupted, preempted) says it.
    - A record that still says "running" is interrupted when its pid is no longer its process on
      this host (hvdtrain was SIGKILLed, the machine rebooted); running when it is, or when the
      record comes from another host, which cannot be checked from here.
    - A run that `hvdtrain submit` handed to Slurm, whose job has not started it yet, is submitted.
    - A run of an older hvdtrain, whose record has no status: finished when rank 0 wrote its
      summary.json, else unknown (failed, stopped or still running cannot be told apart).
    """
    status = (record or {}).get("status")
    if status == "running":
        return "interrupted" if pid_alive is False else "running"
    if status in ("finished", "failed", "diverged", "interrupted", "preempted", "submitted"):
        return status
    return "finished" if has_summary else "unknown"


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in RUN_FILES)


def is_sweep_dir(path: Path) -> bool:
    return path.is_dir() and (path / SWEEP_FILE).is_file() and not is_run_dir(path)


def _read_object(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """A JSON object and None, or None and what is wrong with the file (None, None: no such file)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, None
    except OSError as error:
        return None, f"{path}: {error.strerror}"
    try:
        value = json.loads(text)
    except ValueError:
        return None, f"{path} is damaged (not valid JSON)"
    return (value, None) if isinstance(value, dict) else (None, f"{path} is damaged (not a JSON object)")


def parse_metrics(text: str, where: str = "metrics.jsonl") -> tuple[tuple[dict[str, Any], ...], str | None]:
    """The epoch records of metrics.jsonl by epoch (a resumed run repeats epochs after its checkpoint:
    the later record is the one training went on from), and the first damaged line, if any. Per-step
    learning-rate records are left out."""
    by_epoch: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            return tuple(by_epoch[e] for e in sorted(by_epoch)), f"{where} line {number} is damaged"
        if "epoch" not in record:
            continue
        epoch = record["epoch"]
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            return tuple(by_epoch[e] for e in sorted(by_epoch)), f"{where} line {number}: bad epoch {epoch!r}"
        by_epoch[epoch] = record
    return tuple(by_epoch[e] for e in sorted(by_epoch)), None


def pid_alive(pid: object, started: object) -> bool:
    """Is pid still the process that wrote a running record at `started`, on this host?"""
    import psutil

    if not isinstance(pid, int):
        return False
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        created = process.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False
    began = parse_time(started)
    return began is None or created <= began.timestamp() + START_SLACK_S


def read_run(run_dir: Path, this_host: str) -> RunFacts:
    """Everything `runs` and `show` say about a run directory, read once; a ValueError where the
    path is missing or is not a run directory. Damaged files are listed in `problems`, not raised."""
    if not run_dir.exists():
        raise ValueError(f"{run_dir}: no such directory")
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir} is a file, not a run directory")
    if not is_run_dir(run_dir):
        raise ValueError(f"{run_dir} is not a run directory (it has none of {', '.join(RUN_FILES)})")
    record, record_problem = _read_object(run_dir / RUN_RECORD)
    summary, summary_problem = _read_object(run_dir / "summary.json")
    config, config_problem = _read_object(run_dir / "config.json")
    epochs, metrics_problem = (), None
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        try:
            epochs, metrics_problem = parse_metrics(metrics.read_text(errors="replace"), str(metrics))
        except OSError as error:
            metrics_problem = f"{metrics}: {error.strerror}"
    alive = None
    if record and record.get("status") == "running" and record.get("host") == this_host:
        alive = pid_alive(record.get("pid"), record.get("started"))
    started_file = run_dir / "config.json" if (run_dir / "config.json").is_file() else run_dir
    job_id = (record or {}).get("slurm_job_id")
    if (record or {}).get("status") not in ("submitted", "running"):
        job_id = None  # ended: the state recorded then is the one to show; squeue is not asked
    return RunFacts(
        path=run_dir,
        record=record,
        summary=summary,
        config=config,
        epochs=epochs,
        problems=tuple(p for p in (record_problem, summary_problem, config_problem, metrics_problem) if p),
        pid_alive=alive,
        mtime=started_file.stat().st_mtime,
        slurm_state=_slurm_state(str(job_id)) if job_id else None,
        sweep=run_dir.parent.name if is_sweep_dir(run_dir.parent) else None,
    )


def _slurm_state(job_id: str) -> str | None:
    """What squeue says of the job now, while slurmctld still knows it."""
    import subprocess

    from hvdtrain.launching.slurm import state_from_squeue

    try:
        asked = subprocess.run(
            ["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return state_from_squeue(asked.stdout) if asked.returncode == 0 else None


def find_runs(folder: Path) -> list[Path]:
    """The run directories in folder (folder itself, where it is one), and the trials of the sweep
    directories in it (of folder itself, where it is one)."""
    if is_run_dir(folder):
        return [folder]
    found = []
    for path in sorted(folder.iterdir()):
        if is_run_dir(path):
            found.append(path)
        elif is_sweep_dir(path):
            found += sorted(trial for trial in path.iterdir() if is_run_dir(trial))
    return found


def parse_time(value: object) -> datetime | None:
    """An ISO time from a record, aware (a time without an offset is this host's local time)."""
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.astimezone()

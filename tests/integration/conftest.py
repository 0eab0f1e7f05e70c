"""Integration tests start real ranks: `hvdtrain run` as a subprocess, with a timeout, on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from hvdtrain.launch import rank_output_files

PROGRAMS = Path(__file__).parent / "programs"


@dataclass
class Result:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def rank_json_lines(run_dir: Path) -> list[dict]:
    """JSON objects the ranks printed, read from their own stdout files (the console interleaves them),
    with mpirun's rank tag removed."""
    found = []
    for path in rank_output_files(run_dir / "logs").values():
        for line in path.read_text(errors="replace").splitlines():
            start = line.find("{")
            if start >= 0:
                with contextlib.suppress(json.JSONDecodeError):
                    found.append(json.loads(line[start:]))
    return found


def _rank_logs(run_dir: Path | None) -> str:
    if run_dir is None:
        return ""
    parts = []
    for path in sorted(run_dir.glob("logs/**/rank.*/std*")):
        lines = path.read_text(errors="replace").splitlines()[-20:]
        parts.append(f"--- {path} (last 20 lines)\n" + "\n".join(lines))
    return "\n".join(parts)


def hvdtrain(
    *args: str,
    timeout: float = 300,
    check: bool = True,
    run_dir: Path | None = None,
    env: dict[str, str] | None = None,
) -> Result:
    argv = [sys.executable, "-m", "hvdtrain", *args]
    if run_dir is not None:  # before any `--`, after the command and its target
        argv[5:5] = ["--run-dir", str(run_dir)]
    process = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the whole job: launcher and ranks
        stdout, _ = process.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(argv)}\n{stdout[-6000:]}\n{_rank_logs(run_dir)}")
    done = subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)
    result = Result(argv, done.returncode, done.stdout, done.stderr)
    if check and done.returncode != 0:
        pytest.fail(
            f"exit {done.returncode}: {' '.join(argv)}\n{result.output[-6000:]}\n{_rank_logs(run_dir)}"
        )
    return result


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())

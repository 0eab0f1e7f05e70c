"""Start-up overhead: what `hvdtrain run` costs besides training, against a plain `horovodrun --gloo`
of the same training written by hand (handwritten_digits.py). Each is the launching process's wall
time minus the time in training steps its run reports, so it holds interpreter and framework start,
the rendezvous, data, evaluation, checkpoints and exit. Goal: hvdtrain within 1 s of the raw run."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks import PROGRAMS
from hvdtrain.launching.rank_output import rank_json_records
from hvdtrain.measure.bench import BenchError, checked_run

RECIPE, NP = "digits-mlp-torch", 2
GOAL_SECONDS = 1.0


def hvdtrain_argv(python: str, run_dir: Path) -> list[str]:
    return [python, "-m", "hvdtrain", "run", RECIPE, "--variant", "debug", "--np", str(NP)] + [
        "--launcher",
        "gloo",
        "--run-dir",
        str(run_dir),
    ]


def horovodrun_argv(python: str, log_dir: Path) -> list[str]:
    """The venv's own horovodrun, gloo pinned to loopback as hvdtrain pins it on one host."""
    horovodrun = str(Path(python).parent / "horovodrun")
    return [horovodrun, "-np", str(NP), "--gloo", "--network-interface", "lo"] + [
        "--output-filename",
        str(log_dir),
        python,
        str(PROGRAMS / "handwritten_digits.py"),
    ]


def raw_env(environ: dict[str, str], cores: int) -> dict[str, str]:
    """The threads hvdtrain gives each rank on one host (its cores shared by the ranks)."""
    return {**environ, "OMP_NUM_THREADS": str(max(1, cores // NP))}


def render(ours: list[float], raw: list[float]) -> str:
    mine, theirs = statistics.median(ours), statistics.median(raw)
    return (
        f"{RECIPE} --variant debug, np={NP}, gloo, median of {len(ours)}: start-up overhead (wall - "
        f"training) hvdtrain {mine:.2f} s, raw horovodrun {theirs:.2f} s, difference "
        f"{mine - theirs:+.2f} s  (goal <= {GOAL_SECONDS:.1f} s)"
    )


def _timed(argv: list[str], env: dict[str, str] | None = None) -> float:
    began = time.monotonic()
    checked_run(argv, env=env)
    return time.monotonic() - began


def hvdtrain_overhead(run_dir: Path) -> float:
    wall = _timed(hvdtrain_argv(sys.executable, run_dir))
    return wall - float(json.loads((run_dir / "summary.json").read_text())["train_seconds"])


def raw_overhead(log_dir: Path) -> float:
    wall = _timed(
        horovodrun_argv(sys.executable, log_dir), raw_env(dict(os.environ), len(os.sched_getaffinity(0)) or 1)
    )
    for record in rank_json_records(log_dir):
        if "train_seconds" in record:
            return wall - float(record["train_seconds"])
    raise BenchError(f"handwritten_digits.py printed no train_seconds (logs: {log_dir})")


def main(out: Path, repeats: int = 3) -> None:
    ours, raw = [], []
    for repeat in range(repeats):  # interleaved, so drift on a shared machine hits both alike
        ours.append(hvdtrain_overhead(out / f"startup-hvdtrain-{repeat}"))
        raw.append(raw_overhead(out / f"startup-horovodrun-{repeat}"))
    print(render(ours, raw))

"""The one place a launch command runs: in its own process group, its output streamed, and no
process left behind however it ends."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

from hvdtrain.launch import ROOT_CAUSE, LaunchCommand, first_failed_rank

# TensorFlow's start-up chatter (CPU features, oneDNN, absl): kept in the per-rank log files, not shown.
FRAMEWORK_NOISE = re.compile(
    r"oneDNN custom operations are on|All log messages before absl::InitializeLog|"
    r"rebuild TensorFlow with the appropriate compiler flags|This TensorFlow binary is optimized|"
    r"Unable to register cu(DNN|FFT|BLAS) factory|computation placer already registered|"
    r"Could not find cuda drivers|failed call to cuInit|TF-TRT Warning"
)

RANK_TAG = re.compile(r"^(\[\d+\]|\[\d+,\d+\])<std(out|err)>:")


@dataclass
class LaunchResult:
    returncode: int
    failed_rank: int | None
    output_tail: list[str]
    wall_seconds: float


def run_launch(
    command: LaunchCommand,
    failed_rank_patterns: tuple[re.Pattern[str], ...] = (),
    show_framework_noise: bool = False,
) -> LaunchResult:
    """Run the launcher in its own process group, stream its output, and leave no process behind."""
    start = time.monotonic()
    tail: deque[str] = deque(maxlen=400)
    failures: list[str] = []
    process = subprocess.Popen(
        command.argv,
        env={**os.environ, **command.env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        bufsize=1,
        start_new_session=True,
    )

    def pump() -> None:
        assert process.stdout is not None
        in_launcher_traceback = False
        for line in process.stdout:
            tail.append(line.rstrip("\n"))
            if ROOT_CAUSE in line or first_failed_rank([line], failed_rank_patterns) is not None:
                failures.append(line)
            # horovodrun reports a failed rank with a Python traceback of its own; hvdtrain reports
            # it in one message instead. Ranks' lines carry a rank tag and are always shown.
            from_launcher = not RANK_TAG.match(line)
            in_launcher_traceback = from_launcher and (in_launcher_traceback or line.startswith("Traceback"))
            hidden = in_launcher_traceback or (FRAMEWORK_NOISE.search(line) and not show_framework_noise)
            if not hidden:
                sys.stdout.write(line)
                sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        returncode = process.wait()
    except KeyboardInterrupt:
        returncode = 130
    finally:
        _kill_group(process)
    reader.join(timeout=5)
    return LaunchResult(
        returncode, first_failed_rank(failures, failed_rank_patterns), list(tail), time.monotonic() - start
    )


def _kill_group(process: subprocess.Popen) -> None:
    """End the launcher and every rank it started, also ranks in sessions of their own
    (horovodrun starts each rank under a setsid'd middleman): SIGTERM, a grace period, SIGKILL."""
    import psutil

    try:
        family = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.terminate()
    _, alive = psutil.wait_procs(family, timeout=5)
    for member in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()

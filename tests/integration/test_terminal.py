"""What a user sees on a terminal: rank 0's progress redrawn in place, the launcher's tags gone."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

from tests.support.helpers import summary


def run_on_terminal(argv: list[str], env: dict[str, str], timeout: float = 180) -> tuple[int, str]:
    """Run argv with a pseudo-terminal as its stdout and stderr; what it wrote, as a terminal shows it."""
    main, secondary = pty.openpty()
    process = subprocess.Popen(
        argv, stdout=secondary, stderr=secondary, stdin=subprocess.DEVNULL, env=env, start_new_session=True
    )
    os.close(secondary)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # EIO: every writer has closed the terminal
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            elif process.poll() is not None:
                break
        returncode = process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        os.close(main)
        if process.poll() is None:
            os.killpg(process.pid, 9)
    return returncode, b"".join(chunks).decode(errors="replace")


def test_a_terminal_sees_rank_zeros_progress_redrawn_in_place(tmp_path):
    argv = [sys.executable, "-m", "hvdtrain", "run", "digits-mlp-torch", "--np", "2", "--launcher", "mpi"]
    argv += ["--run-dir", str(tmp_path)]
    env = {**os.environ, "HVDTRAIN_PROGRESS_S": "0", "COLUMNS": "120"}
    returncode, shown = run_on_terminal(argv, env)
    assert returncode == 0, shown[-3000:]
    assert summary(tmp_path)["test_accuracy"] >= 0.95
    assert "samples/s  ETA" in shown and "\r" in shown and "\x1b[2K" in shown, "a bar, redrawn in place"
    assert "/15  loss" in shown and "samples/s" in shown
    assert "<stdout>:" not in shown and "hvdtrain:progress" not in shown, "no tags, no raw records"
    assert "epoch 15/15  loss" in shown and "summary: recipe=digits-mlp-torch" in shown

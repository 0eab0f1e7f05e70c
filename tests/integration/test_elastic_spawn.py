"""Elastic training on this host, with a host the discovery script adds whose rank cannot start (its
ssh is refused): the ranks that were waiting for it in the rendezvous reset again, Horovod's driver
leaves the host out, and the job trains on (Horovod patch 0020). Before, the waiting ranks aborted
when Gloo's wait for the missing rank timed out, every host counted as failed, and the job ended."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.support.helpers import beyond_loopback, listeners

UNREACHABLE = "127.0.0.9"
"""A loopback address that is not one of this host's: Horovod reaches it over ssh, on SSH_PORT."""
SSH_PORT = "1"
"""Nothing listens there: the spawn's ssh is refused at once."""


def _epochs(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if '"epoch"' in line]


def _wait(condition, what: str, job: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if job.poll() is not None:
            pytest.fail(f"the job ended (exit {job.returncode}) before {what}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not seen in {timeout:.0f} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


def test_a_host_whose_rank_cannot_start_is_left_out_and_the_job_trains_on(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    run_dir, log = tmp_path / "run", tmp_path / "console.log"
    argv = [
        sys.executable, "-m", "hvdtrain", "run", "digits-mlp-torch", "--min-np", "2", "--max-np", "3",
        "--host-discovery-script", str(discover), "--network-interface", "lo", "--ssh-port", SSH_PORT,
        "--stall-timeout", "15", "--set", "epochs=100000", "--run-dir", str(run_dir),
    ]  # fmt: skip
    with log.open("w") as out:
        job = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        _wait(lambda: len(_epochs(metrics)) >= 3, "the first epochs", job, log, 120)
        family = [psutil.Process(job.pid), *psutil.Process(job.pid).children(recursive=True)]
        heard = listeners(family)  # horovodrun's elastic rendezvous and the ranks' services (patch 0021)
        assert heard, "nothing listens: the check would prove nothing"
        assert not beyond_loopback(heard), f"listening beyond loopback: {beyond_loopback(heard)}"
        hosts.write_text(f"localhost:2\n{UNREACHABLE}:1\n")
        _wait(lambda: "exit with status code 255" in log.read_text(), "the refused spawn", job, log, 60)
        spawned = len(_epochs(metrics))
        _wait(lambda: len(_epochs(metrics)) >= spawned + 3, "training after it", job, log, 120)
        hosts.write_text("localhost:2\n")  # no second try once its cooldown ends
        job.send_signal(signal.SIGTERM)  # ended here, however fast this machine trains
        assert job.wait(timeout=120) == 128 + signal.SIGTERM, log.read_text()[-4000:]
    finally:
        if job.poll() is None:  # a failed check: the launcher and its ranks (in sessions of their own)
            ranks = psutil.Process(job.pid).children(recursive=True)
            os.killpg(job.pid, signal.SIGKILL)
            for rank in ranks:
                with contextlib.suppress(psutil.Error):
                    rank.kill()
            job.wait()
    output = log.read_text()
    assert "the rendezvous failed" in output, "the waiting ranks reset again (patch 0020)"
    epochs = _epochs(metrics)
    assert len(epochs) >= spawned + 3 and {e["world_size"] for e in epochs} == {2}
    assert epochs[-1]["test_accuracy"] >= 0.9

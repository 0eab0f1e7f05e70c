"""Elastic training on namespace hosts, for real: Horovod's elastic driver keeps the job going when a
rank dies or a host's link goes down, and takes the host back when it returns (the measurements are
make bench's too: tests/support/elastic.py)."""

from __future__ import annotations

import json
import signal

from tests.support.elastic import killed_rank, lost_link
from tests.support.helpers import summary

BAR = 0.9


def test_a_killed_rank_leaves_the_job_running_and_its_host_comes_back(rig):
    recovery = killed_rank(rig, epochs=350)  # the host is back by about epoch 150
    assert recovery.job.process.returncode == 0, recovery.output[-3000:]
    found = summary(recovery.job.run_dir)
    assert found["test_accuracy"] >= BAR and found["weights_consistent"] is True
    assert recovery.resumed_s < 30 and recovery.regrown_s < 90
    print(f"\nrank killed: 1 rank in {recovery.resumed_s:.1f} s; 2 again {recovery.regrown_s:.1f} s later")
    assert rig.leftover_processes(timeout=30) == {}


def test_a_host_whose_link_goes_down_is_left_behind_and_rejoins_when_it_returns(rig):
    """Ended by SIGTERM once the host is back: the finish itself is the killed-rank test's."""
    recovery = lost_link(rig)
    job = recovery.job
    assert job.process.returncode == 128 + signal.SIGTERM, recovery.output[-3000:]
    last = json.loads(job.metrics.read_text().splitlines()[-1])
    assert last["test_accuracy"] >= BAR and last["world_size"] == 2
    assert recovery.resumed_s < 10 + 30, "Gloo's timeout follows --stall-timeout 10"
    print(f"\nlink down: 1 rank in {recovery.resumed_s:.1f} s; 2 again {recovery.regrown_s:.1f} s later")
    assert rig.leftover_processes(timeout=30) == {}

"""Elastic training on namespace hosts, for real: Horovod's elastic driver keeps the job going when a
rank dies or a host's link goes down, and takes the host back when it returns (the measurements are
make bench's too: tests/support/elastic.py)."""

from __future__ import annotations

import json
import re
import signal

import torch

from hvdtrain.runtime import checkpoint
from tests.support.elastic import killed_rank, lost_link
from tests.support.helpers import summary

BAR = 0.9


def test_a_killed_rank_leaves_the_job_running_and_its_host_comes_back(rig):
    """Under a cosine decay, with a checkpoint every 40 steps (an epoch is 21 steps at 2 ranks, 42
    at 1): the schedule follows progress through both world sizes, and the step checkpoints record
    where in the elastic order the worlds were."""
    sets = ("lr_schedule=cosine", "checkpoint_every_steps=40", "keep_checkpoints=5")
    recovery = killed_rank(rig, epochs=350, sets=sets)  # the host is back by about epoch 150
    assert recovery.job.process.returncode == 0, recovery.output[-3000:]
    found = summary(recovery.job.run_dir)
    assert found["test_accuracy"] >= BAR and found["weights_consistent"] is True
    epochs = [json.loads(line) for line in recovery.job.metrics.read_text().splitlines() if '"epoch"' in line]
    # The lr scales with the world size. An epoch that a reset only finishes (no step in the new
    # world, so no samples/s) records the last step's lr, of the world before: left out.
    trained = [e for e in epochs if e["samples_per_sec"] is not None]
    rises = [
        (a["epoch"], a["lr"], b["epoch"], b["lr"], b["world_size"])
        for a, b in zip(trained, trained[1:], strict=False)
        if a["world_size"] == b["world_size"] and b["lr"] > a["lr"]
    ]
    assert len(epochs) >= 350 and not rises, rises[:5]
    assert epochs[-1]["lr"] < 1e-3 * epochs[0]["lr"] and {e["world_size"] for e in epochs} == {1, 2}
    kept = [
        torch.load(path, weights_only=True)
        for path in sorted((recovery.job.chief_run_dir / checkpoint.CHECKPOINTS).glob("*/checkpoint.pt"))
    ]
    within = [state["within"] for state in kept if state.get("within")]
    assert within and all(w["order"] == "elastic" and w["done"] > 0 for w in within)
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
    address = re.escape(rig.host(job.other_host).address)
    named = (
        rf"hvdtrain: no heartbeat for [5-9] s from rank \d on host {address} \(pid \d+\): its host does not"
    )
    assert re.search(named, recovery.output), "the silent host is named, not only Gloo's timeouts"
    print(f"\nlink down: 1 rank in {recovery.resumed_s:.1f} s; 2 again {recovery.regrown_s:.1f} s later")
    assert rig.leftover_processes(timeout=30) == {}

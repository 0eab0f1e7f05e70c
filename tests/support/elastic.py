"""Elastic recovery, measured on namespace hosts (tests/support/rig.py): how long after a fault the job
trains on, and how long until a returning host is back in the world. tests/integration/test_elastic.py
asserts on these measurements and `make bench` (benchmarks/elastic.py) prints the same ones."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.rig import rig_host_args

RECIPE = "digits-mlp-torch"


def world_sizes(metrics: Path) -> list[int]:
    if not metrics.exists():
        return []
    return [json.loads(line)["world_size"] for line in metrics.read_text().splitlines() if '"epoch"' in line]


class ElasticJob:
    """An elastic job on rig hosts 1 and 2 (or `hosts`), watched through rank 0's metrics.jsonl on the
    host it runs on (Horovod's elastic driver may place rank 0 on any). With `output` its console goes
    to that file rather than a pipe (a long job's would fill the pipe); with `resume` it goes on from
    the run directory's checkpoint, with the config saved there."""

    def __init__(
        self,
        rig,
        name: str,
        epochs: int,
        sets: tuple[str, ...] = (),
        hosts: tuple[int, ...] = (1, 2),
        output: Path | None = None,
        resume: bool = False,
    ) -> None:
        self.rig, self.run_dir, self.name, self.hosts = rig, rig.disk / name, name, hosts
        argv = [sys.executable, "-m", "hvdtrain", "run", RECIPE, *rig_host_args(rig, *hosts)]
        argv += ["--min-np", "1", "--max-np", str(len(hosts)), "--stall-timeout", "10"]
        if resume:
            argv += ["--resume"]
        else:
            argv += ["--set", f"epochs={epochs}", *(item for value in sets for item in ("--set", value))]
        argv += ["--run-dir", str(self.run_dir)]
        self.output = output
        stdout = subprocess.PIPE if output is None else output.open("a")
        self.process = subprocess.Popen(
            argv, stdout=stdout, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        if output is not None:
            stdout.close()  # the child has it

    @property
    def chief_host(self) -> int:
        found = [h for h in self.hosts if (self.rig.private_disk(h) / self.name / "metrics.jsonl").exists()]
        return found[0] if found else self.hosts[0]

    @property
    def other_host(self) -> int:
        return 2 if self.chief_host == 1 else 1

    @property
    def chief_run_dir(self) -> Path:
        """The run directory on rank 0's host (the hosts share no disk)."""
        return self.rig.private_disk(self.chief_host) / self.name

    @property
    def metrics(self) -> Path:
        return self.chief_run_dir / "metrics.jsonl"

    @property
    def sizes(self) -> list[int]:
        return world_sizes(self.metrics)

    def wait_for(self, predicate, timeout: float, what: str) -> float:
        """Seconds until predicate(world sizes logged so far) holds."""
        started = time.monotonic()
        while not predicate(self.sizes):
            if time.monotonic() - started > timeout or self.process.poll() is not None:
                self.stop()
                output = self.finish()[-3000:]
                raise RuntimeError(f"{what}: not within {timeout} s; world sizes {self.sizes}\n{output}")
            time.sleep(0.1)
        return time.monotonic() - started

    def finish(self, timeout: float = 600) -> str:
        """Waits for the job to end; its console."""
        printed = self.process.communicate(timeout=timeout)[0]
        return printed if self.output is None else self.output.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)


def logged_after(count: int, size: int):
    """World sizes of which one logged after the first `count` epochs is `size`."""
    return lambda sizes: size in sizes[count:]


@dataclass
class Recovery:
    resumed_s: float
    """From the fault to the next epoch logged by the smaller world."""
    regrown_s: float
    """From then to the first epoch logged by the full world again."""
    job: ElasticJob
    output: str


def killed_rank(rig, epochs: int = 600, sets: tuple[str, ...] = ()) -> Recovery:
    """Kill the rank on the host without rank 0; its host is blacklisted, then taken back after the
    cooldown. The job runs to its end."""
    job = ElasticJob(rig, "elastic-kill", epochs, sets)
    try:
        job.wait_for(lambda sizes: len(sizes) >= 3 and sizes[-1] == 2, 120, "two ranks training")
        before = len(job.sizes)
        if not rig.kill_host_processes(job.other_host, r"hvdtrain\.worker"):
            raise RuntimeError("no rank on the other host")
        resumed = job.wait_for(logged_after(before, 1), 60, "training on with one rank")
        regrown = job.wait_for(logged_after(len(job.sizes), 2), 120, "the host taken back")
        return Recovery(resumed, regrown, job, job.finish())
    finally:
        job.stop()


def lost_link(rig) -> Recovery:
    """Take the link of the host without rank 0 down, then up again once the job trains on without it;
    the job is ended by SIGTERM once two ranks train again."""
    job, lost = ElasticJob(rig, "elastic-link", epochs=100_000), None
    try:
        job.wait_for(lambda sizes: len(sizes) >= 3 and sizes[-1] == 2, 120, "two ranks training")
        before, lost = len(job.sizes), job.other_host
        rig.link_down(lost)
        try:
            resumed = job.wait_for(logged_after(before, 1), 90, "training on without the lost host")
        finally:
            rig.link_up(lost)
        regrown = job.wait_for(logged_after(len(job.sizes), 2), 120, "the host taken back")
        job.wait_for(lambda sizes: sizes[-3:] == [2, 2, 2], 60, "two ranks training again")
        os.kill(job.process.pid, signal.SIGTERM)
        return Recovery(resumed, regrown, job, job.finish(timeout=60))
    finally:
        if lost is not None:
            rig.link_up(lost)
        job.stop()

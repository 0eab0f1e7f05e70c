"""`make bench` section: a chaos run. One elastic job (digits-mlp-torch under Horovod's elastic driver,
tests/support/elastic.py's ElasticJob, --min-np 1 --stall-timeout 10) on four namespace hosts
(tests/support/rig.py) while a seeded random schedule (random.Random(seed)) injects, one at a time,
for MINUTES (HVDTRAIN_CHAOS_MINUTES, or `python -m benchmarks chaos --chaos-minutes 3`):

- kill: kill -9 of a rank;
- stop: SIGSTOP of a rank, SIGCONT 2-25 s later (past --stall-timeout or not);
- link: a host's link down (ip link), up again 5-40 s later;
- sshd: a host's sshd stopped, the rank on it killed 1-3 s later (a stopped sshd alone changes nothing
  for ranks already running: Horovod only needs it to start one), sshd started again 10-40 s later;
- sigterm: SIGTERM to `hvdtrain`, then `hvdtrain run ... --resume` of the same run directory.

Each fault is aimed at a host that runs a rank (rank 0's included), and the next waits until four
ranks train again (or 90 s). The kinds come in shuffled rounds, so a short run still sees each. A
job that a fault ends (not the harness's SIGTERM) is the fault not survived: the harness undoes the
fault and resumes the run with --resume, as an operator would, so the job still ends where planned.

Per fault, `training waited` is from the injection (for sshd, the kill) until a step past those
recorded at the injection plus two commits is recorded, what tests/support/elastic.py calls
resumed_s; where the fault ended the job, the wait from the job's last record until it trains on
after the resume is added. `4 ranks again` is from the fault's end (the SIGCONT, the link up, sshd
started, the resume) until an epoch trained by four ranks is recorded after it and after training
went on. The goals printed at the end:

- the planned steps: summary.json's `steps` is EPOCHS x STEPS_PER_EPOCH (each epoch has that many
  steps at any world size up to 4: batch_size 16 leaves 22 full ones per rank at 4 ranks);
- consistent weights: summary.json's `weights_consistent`;
- every fault named in the job's console, in the part printed between its injection and the next
  one's: a line that says which rank or host it was. A killed rank (kill, sshd) by horovodrun's
  `Process N exit with status code` (N: the HOROVOD_RANK the rank was started with, read from its
  environment at the injection); a stopped rank or a host whose link went down by the same line, or
  by the host's address (hvdtrain's `no heartbeat for N s from rank R on host ADDRESS`, ssh's
  `Timeout, server ADDRESS not responding`, `ssh: connect to host ADDRESS`); an sshd that refused
  Horovod, where that ended the job, by the address too; SIGTERM by
  `stopped by SIGTERM` and the resume by `resuming from`. Gloo's timeouts, which every rank prints
  alike, name nobody and do not count. A fault the job never noticed (a stop or a link down shorter
  than the stall timeout: training only waits) has nothing to name and counts as n/a;
- no step trained twice before the last commit. The job runs with log_step_lr, so rank 0 adds a
  {"step": S, "lr": ...} record to metrics.jsonl for every step S it begins, written at each
  checkpoint and epoch end; the harness tails metrics.jsonl on every host's own disk while the job
  runs (rank 0 moves host when its host fails, and a resume stages the collected copy onto every
  host, whose first bytes it skips). The elastic state is committed every COMMIT_EVERY steps and at
  each epoch's end, and checkpointed at the same steps (checkpoint_every_steps), so a fault rolls the
  job back to a multiple of COMMIT_EVERY: the records that follow step P go on with P + 1, except
  after a fault. There the next record R must be a commit (R % COMMIT_EVERY == 0) no earlier than the
  last commit before step P began (R >= P // COMMIT_EVERY * COMMIT_EVERY). Steps after that commit
  are trained again (that is the rollback, counted as `retrained`); a step at or before it never is.
  A gap (R > P + 1: rank 0 was killed before writing records) must also land on a commit. The
  records cannot tell whether the commit right after step P was reached before the fault; where it
  was, a rollback to the commit before it would pass too. So the check bounds what is trained again
  to one commit interval (COMMIT_EVERY steps) per fault, and the planned step count bounds what is
  counted;
- every fault survived: the job trained on without being started again (SIGTERM: the resume did).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.support.elastic import RECIPE, ElasticJob
from tests.support.rig import Rig, RigError

MINUTES = 10.0
MINUTES_ENV = "HVDTRAIN_CHAOS_MINUTES"
SEED = 41
SEED_ENV = "HVDTRAIN_CHAOS_SEED"
HOSTS = (1, 2, 3, 4)
NAME = "chaos"
STEPS_PER_EPOCH = 20
COMMIT_EVERY = 10
"""hvdtrain's --commit-every default; the checkpoints are at the same steps."""
EPOCHS_PER_MINUTE = 250
"""The job's length: about what four ranks train here in a minute between the faults."""
SETS = (
    f"steps_per_epoch={STEPS_PER_EPOCH}",
    "batch_size=16",
    "log_step_lr=true",
    f"checkpoint_every_steps={COMMIT_EVERY}",
)
STALL_TIMEOUT_S = 10
"""ElasticJob's --stall-timeout, which Gloo's timeout follows under elastic training."""
KINDS = ("kill", "stop", "link", "sshd", "sigterm")
LABELS = {
    "kill": "rank killed (kill -9)",
    "stop": "rank stopped, continued",
    "link": "link down, then up",
    "sshd": "sshd stopped, rank killed",
    "sigterm": "SIGTERM, then --resume",
}
GAP_S = (3.0, 10.0)
"""Quiet time before each fault, once four ranks train."""
HOLD_S = {"stop": (2.0, 25.0), "link": (5.0, 40.0), "sshd": (10.0, 40.0), "sigterm": (1.0, 5.0)}
"""How long each fault lasts (sigterm: from the job's end to the resume)."""
START_TIMEOUT_S = 180
TRAINS_ON_TIMEOUT_S = 150
FULL_TIMEOUT_S = 90
WORKER = re.compile(r"-m hvdtrain\.worker\b")
NOTICED = re.compile(
    r"uncaught exception|exit with status code|not responding|ssh: connect to host|no heartbeat for"
)
"""What the console says once the job has noticed a fault (and not before)."""


def minutes_wanted(value: float | None = None) -> float:
    return value if value is not None else float(os.environ.get(MINUTES_ENV, MINUTES))


def seed_wanted(value: int | None = None) -> int:
    return value if value is not None else int(os.environ.get(SEED_ENV, SEED))


# -- what rank 0 records


class StepRecords:
    """Tails rank 0's metrics.jsonl on every host's own disk (a background thread): the step records
    in the order written, and the world size of each epoch record, each with when it was seen."""

    TAIL = 256

    def __init__(self, rig: Rig, name: str, hosts: tuple[int, ...]) -> None:
        self.paths = {host: rig.private_disk(host) / name / "metrics.jsonl" for host in hosts}
        self.read: dict[int, tuple[int, bytes]] = {}
        """host -> (offset consumed, the bytes before it): a file whose bytes there changed was replaced."""
        self.staged = b""
        self.rebase: set[int] = set()
        """Hosts whose file a resume replaces with the staged copy, not seen yet."""
        self.steps: list[tuple[float, int]] = []
        self.epochs: list[tuple[float, int]] = []
        self.problems: list[str] = []
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StepRecords:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.done.set()
        self.thread.join(timeout=5)
        self.poll()

    def _run(self) -> None:
        while not self.done.wait(0.1):
            self.poll()

    def resuming(self, staged: bytes) -> None:
        """A resume is about to copy the collected run directory, whose metrics.jsonl is `staged`,
        onto every host: each host's file then begins with it, and only what follows is new."""
        self.poll()  # what the job before wrote, all of it
        with self.lock:
            self.staged, self.rebase = staged, set(self.paths)

    def poll(self) -> None:
        with self.lock:
            fresh = []
            for host, path in self.paths.items():
                try:
                    with path.open("rb") as stream:
                        new = self._new_bytes(host, stream)
                        modified = os.fstat(stream.fileno()).st_mtime_ns
                except FileNotFoundError:
                    continue
                if new:
                    fresh.append((modified, host, new))
            now = time.monotonic()
            for _, _, new in sorted(fresh):  # two hosts at once: the file written first goes first
                for line in new.decode(errors="replace").splitlines():
                    self._take(now, line)

    def _new_bytes(self, host: int, stream) -> bytes:
        offset, tail = self.read.get(host, (0, b""))
        if host in self.rebase:  # the staged copy, once there, was read before
            head = stream.read(len(self.staged))
            if head == self.staged:
                self.rebase.discard(host)
                offset, tail = len(self.staged), self.staged[-self.TAIL :]
            elif self.staged.startswith(head):
                return b""  # not copied yet, or being copied
        size = os.fstat(stream.fileno()).st_size
        stream.seek(max(0, offset - len(tail)))
        if size < offset or stream.read(len(tail)) != tail:
            self.problems.append(f"host {host}'s metrics.jsonl was replaced, not by a resume")
            offset = 0
        stream.seek(offset)
        new = stream.read()
        new = new[: new.rfind(b"\n") + 1]
        offset += len(new)
        stream.seek(max(0, offset - self.TAIL))
        self.read[host] = (offset, stream.read(min(offset, self.TAIL)))
        return new

    def _take(self, now: float, line: str) -> None:
        try:
            record = json.loads(line)
        except ValueError:
            self.problems.append(f"a damaged metrics.jsonl line: {line[:80]!r}")
            return
        if "epoch" in record:
            self.epochs.append((now, int(record.get("world_size") or 0)))
        elif "step" in record:
            self.steps.append((now, int(record["step"])))

    @property
    def top(self) -> int:
        with self.lock:
            return max((step for _, step in self.steps), default=-1)

    @property
    def last_seen(self) -> float:
        with self.lock:
            return self.steps[-1][0] if self.steps else time.monotonic()

    def world_since(self, since: float) -> list[int]:
        """The world sizes of the epochs recorded since `since`."""
        with self.lock:
            return [size for seen, size in self.epochs if seen >= since]


def restarts(steps: list[int]) -> list[tuple[int, int, int]]:
    """(index, P, R) of every record R that does not follow the record P before it by one."""
    return [(i, p, r) for i, (p, r) in enumerate(zip(steps, steps[1:], strict=False), start=1) if r != p + 1]


def bad_restart(p: int, r: int, commit_every: int) -> bool:
    """Whether going on at step R after step P broke the rule: a commit, no earlier than the last
    commit before P began."""
    return r % commit_every != 0 or r < p // commit_every * commit_every


# -- the faults


@dataclass
class Fault:
    kind: str
    host: int
    address: str
    at: float
    """When it was injected (time.monotonic())."""
    hold_s: float
    top: int
    """The highest step recorded at the injection."""
    log_from: int
    """The job console's size at the injection: what it printed about this fault follows."""
    rank: int | None = None
    """HOROVOD_RANK of the rank it hit, as started: horovodrun's `Process N`, hvdtrain's `[rank N]`."""
    ended: float | None = None
    stalled: float = 0.0
    """Since when training has waited (the injection; the job's last record, where it ended)."""
    trains_on: float | None = None
    lost_s: float = 0.0
    """Time training waited for it: the injection until training went on, and where the fault
    ended the job, the job's last record until it trained on after the resume."""
    full: float | None = None
    ended_job: bool = False
    """The fault ended the job (it was resumed by the harness)."""
    resumed: bool = False
    log_to: int | None = None
    noticed: bool = False
    named: bool | None = None
    retrained: int = 0
    note: str = ""

    @property
    def survived(self) -> bool:
        return not self.ended_job and self.trains_on is not None

    @property
    def full_s(self) -> float | None:
        return None if self.full is None or self.ended is None else self.full - self.ended


def worker(rig: Rig, host: int) -> tuple[int, int | None] | None:
    """(pid, HOROVOD_RANK as started) of the rank on host, if one runs there."""
    for pid, cmdline in rig.processes(host):
        if WORKER.search(cmdline):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            ranks = [entry.split(b"=", 1)[1] for entry in environ if entry.startswith(b"HOROVOD_RANK=")]
            return pid, int(ranks[0]) if ranks else None
    return None


def kill(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


class Chaos:
    """The job, its records, the schedule and what happened; run() does it all."""

    def __init__(self, rig: Rig, out: Path, minutes: float, seed: int) -> None:
        self.rig, self.out, self.minutes, self.seed = rig, out, minutes, seed
        self.rng = random.Random(seed)
        self.epochs = max(20, round(minutes * EPOCHS_PER_MINUTE))
        self.planned = self.epochs * STEPS_PER_EPOCH
        self.log = out / "chaos-job.log"
        self.events = out / "chaos-events.log"
        self.faults: list[Fault] = []
        self.job: ElasticJob | None = None
        self.records = StepRecords(rig, NAME, HOSTS)
        self.started = time.monotonic()
        self.chaos_s = 0.0
        self.summary: dict = {}
        self.job_exit: int | None = None
        self.bad: list[tuple[int, int]] = []
        self.unrecorded = 0

    # -- the job

    def say(self, line: str) -> None:
        stamped = f"{time.monotonic() - self.started:7.1f} s  {line}"
        with self.events.open("a") as stream:
            stream.write(stamped + "\n")
        print(stamped, flush=True)

    def log_size(self) -> int:
        return self.log.stat().st_size if self.log.exists() else 0

    def start(self, resume: bool) -> None:
        if resume:
            collected = self.job.run_dir / "metrics.jsonl"  # type: ignore[union-attr]
            self.records.resuming(collected.read_bytes() if collected.exists() else b"")
        self.job = ElasticJob(self.rig, NAME, self.epochs, SETS, hosts=HOSTS, output=self.log, resume=resume)

    def ended(self) -> bool:
        return self.job is not None and self.job.process.poll() is not None

    def ranks(self) -> dict[int, tuple[int, int | None]]:
        return {host: found for host in HOSTS if (found := worker(self.rig, host)) is not None}

    def wait(
        self, until: Callable[[], bool], timeout: float, on_end: Callable[[], bool] | None = None
    ) -> bool:
        """Polls until `until()` holds (True) or timeout (False); if the job ends meanwhile, on_end()
        decides: True goes on waiting (it was resumed), False gives up."""
        deadline = time.monotonic() + timeout
        while not until():
            if self.ended() and (on_end is None or not on_end()):
                return False
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def full_world(self, since: float) -> bool:
        return self.records.world_since(since)[-1:] == [len(HOSTS)]

    # -- one fault

    def inject(self, kind: str) -> Fault | None:
        ranks = self.ranks()
        if not ranks:
            return None
        host = self.rng.choice(sorted(ranks))
        hold = self.rng.uniform(*HOLD_S[kind]) if kind in HOLD_S else 0.0
        pid, rank = ranks[host]
        fault = Fault(
            kind, host, self.rig.host(host).address, time.monotonic(), hold, self.records.top, self.log_size()
        )
        fault.rank, fault.stalled = rank, fault.at
        self.faults.append(fault)
        what = {
            "kill": f"kill -9 of rank {rank} on host {host} ({fault.address})",
            "stop": f"SIGSTOP of rank {rank} on host {host} ({fault.address}) for {hold:.1f} s",
            "link": f"host {host}'s link ({fault.address}, rank {rank}) down for {hold:.1f} s",
            "sshd": f"host {host}'s sshd ({fault.address}) stopped for {hold:.1f} s, its rank {rank} killed",
            "sigterm": "SIGTERM to hvdtrain, then --resume",
        }[kind]
        self.say(f"fault {len(self.faults)}: {what}")
        if kind == "kill":
            kill(pid, signal.SIGKILL)
            fault.ended = fault.at
        elif kind == "stop":
            kill(pid, signal.SIGSTOP)
            self.hold(fault, lambda: kill(pid, signal.SIGCONT))
        elif kind == "link":
            self.rig.link_down(host)
            self.hold(fault, lambda: self.rig.link_up(host))
        elif kind == "sshd":
            self.rig.stop_sshd(host)
            killed_at = self.rng.uniform(1.0, 3.0)
            self.pause(killed_at, fault)
            kill(pid, signal.SIGKILL)  # the fault, timed from here: the stopped sshd alone costs nothing
            fault.at, fault.top, fault.hold_s = time.monotonic(), self.records.top, max(0.0, hold - killed_at)
            fault.stalled, fault.trains_on, fault.lost_s = fault.at, None, 0.0
            self.hold(fault, lambda: self.rig.start_sshd(host))
        elif kind == "sigterm":
            kill(self.job.process.pid, signal.SIGTERM)  # type: ignore[union-attr]
            self.job.process.wait(timeout=120)  # type: ignore[union-attr]
            self.say(f"  hvdtrain exited {self.job.process.returncode}")  # type: ignore[union-attr]
            time.sleep(hold)
            fault.ended = time.monotonic()
            self.start(resume=True)
            fault.resumed = True
        self.recover(fault)
        return fault

    def pause(self, seconds: float, fault: Fault) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self.ended():
            self.check_trains_on(fault)
            time.sleep(0.1)

    def hold(self, fault: Fault, undo: Callable[[], None]) -> None:
        """Keeps the fault up for its time (less if it ends the job), then undoes it."""
        self.pause(fault.at + fault.hold_s - time.monotonic(), fault)
        undo()
        fault.ended = time.monotonic()

    def check_trains_on(self, fault: Fault) -> bool:
        if fault.trains_on is None and self.records.top > fault.top + 2 * COMMIT_EVERY:
            fault.trains_on = time.monotonic()
            fault.lost_s += fault.trains_on - fault.stalled
        return fault.trains_on is not None

    def job_ended(self, fault: Fault) -> bool:
        """The job ended during the fault: the fault not survived. The run is resumed (the fault is
        undone by then); True: go on waiting."""
        code = self.job.process.returncode  # type: ignore[union-attr]
        if code == 0:
            return False  # it finished
        if code == 2:
            raise RuntimeError(f"chaos: hvdtrain refused the run (exit 2); console:\n{self.tail()}")
        fault.ended_job = True
        if fault.trains_on is not None:  # it trained on, then stopped: from its last record
            fault.stalled, fault.trains_on = self.records.last_seen, None
        fault.top = self.records.top
        self.say(f"  the job ended (exit {code}): resumed with --resume")
        self.start(resume=True)
        fault.resumed = True
        return True

    def recover(self, fault: Fault) -> None:
        """Waits until training goes on after the fault, then until four ranks train (a job the fault
        ends meanwhile is resumed, and waited for again)."""
        for _ in range(3):
            if self.ended() and not self.job_ended(fault):
                return  # it finished
            went_on = self.wait(
                lambda: self.check_trains_on(fault), TRAINS_ON_TIMEOUT_S, lambda: self.job_ended(fault)
            )
            if not went_on:
                if not self.ended():
                    fault.note = f"no training within {TRAINS_ON_TIMEOUT_S} s after it"
                break
            since = max(fault.ended or fault.at, fault.trains_on or fault.at)
            self.wait(lambda at=since: self.full_world(at), FULL_TIMEOUT_S, lambda: self.job_ended(fault))
            if fault.trains_on is not None:  # else the job ended meanwhile: wait for it again
                break
        if fault.trains_on is not None and self.full_world(max(fault.ended or fault.at, fault.trains_on)):
            fault.full = time.monotonic()
        lost = "-" if fault.trains_on is None else f"{fault.lost_s:.1f} s"
        full = "-" if fault.full_s is None else f"{fault.full_s:.1f} s"
        self.say(f"  training waited {lost}; 4 ranks again {full} after the fault's end")

    # -- the run

    def run(self) -> None:
        self.log.write_text("")
        self.events.write_text("")
        with self.records:
            self.start(resume=False)
            self.say(
                f"{RECIPE} on hosts {', '.join(map(str, HOSTS))}: {self.epochs} epochs of {STEPS_PER_EPOCH} "
                f"steps ({self.planned} steps), chaos for {self.minutes:g} min, seed {self.seed}"
            )
            if not self.wait(lambda: self.full_world(self.started), START_TIMEOUT_S):
                raise RuntimeError(f"chaos: four ranks never trained; console:\n{self.tail()}")
            began = time.monotonic()
            deadline = began + self.minutes * 60
            kinds: list[str] = []
            while time.monotonic() < deadline and not self.ended():
                if self.records.top > self.planned - 10 * STEPS_PER_EPOCH:
                    self.say("the job is about to finish: no more faults")
                    break
                time.sleep(self.rng.uniform(*GAP_S))
                if not kinds:
                    kinds = self.rng.sample(KINDS, len(KINDS))
                if self.inject(kinds.pop(0)) is None:
                    self.wait(lambda: bool(self.ranks()), 30)
            self.chaos_s = time.monotonic() - began
            self.say(f"chaos over after {self.chaos_s / 60:.1f} min; the job trains to its end")
            while True:
                try:
                    self.job.finish(timeout=max(600, self.minutes * 120))  # type: ignore[union-attr]
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"chaos: the job did not end; console:\n{self.tail()}") from None
                if self.job.process.returncode == 0 or not self.faults:  # type: ignore[union-attr]
                    break
                # a job that ends on its own after the last fault: that fault's doing
                if not self.job_ended(self.faults[-1]):
                    break
            self.job_exit = self.job.process.returncode  # type: ignore[union-attr]
        self.say(f"the job exited {self.job_exit}, {(time.monotonic() - self.started) / 60:.1f} min in all")
        summary = self.job.run_dir / "summary.json"  # type: ignore[union-attr]
        self.summary = json.loads(summary.read_text()) if summary.exists() else {}
        self.judge()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    # -- what happened

    def judge(self) -> None:
        text = self.log.read_bytes()
        for fault, following in zip(self.faults, [*self.faults[1:], None], strict=True):
            fault.log_to = following.log_from if following else len(text)
            window = text[fault.log_from : fault.log_to].decode(errors="replace")
            shrank = any(size < len(HOSTS) for size in self.world_since_between(fault, following))
            fault.noticed = (
                fault.kind in ("kill", "sshd", "sigterm")
                or fault.ended_job
                or shrank
                or NOTICED.search(window) is not None
            )
            fault.named = named(fault, window) if fault.noticed else None
        steps = [step for _, step in self.records.steps]
        times = [seen for seen, _ in self.records.steps]
        self.bad = []
        for index, p, r in restarts(steps):
            if bad_restart(p, r, COMMIT_EVERY):
                self.bad.append((p, r))
            if r <= p:
                owner = [f for f in self.faults if f.at <= times[index]]
                if owner:
                    owner[-1].retrained += p - r + 1
        recorded = set(steps)
        self.unrecorded = sum(1 for step in range(self.planned) if step not in recorded)

    def world_since_between(self, fault: Fault, following: Fault | None) -> list[int]:
        end = following.at if following else float("inf")
        with self.records.lock:
            return [size for seen, size in self.records.epochs if fault.at <= seen < end]


def named(fault: Fault, window: str) -> bool:
    """Whether the console names the fault (the module's docstring says how, per kind)."""
    process = f"Process {fault.rank} exit with status code"
    address = re.compile(rf"(server|host) {re.escape(fault.address)}\b")
    if fault.kind == "kill":
        found = process in window
    elif fault.kind in ("stop", "link"):
        found = process in window or address.search(window) is not None
    elif fault.kind == "sshd":
        found = process in window and (not fault.ended_job or address.search(window) is not None)
    else:
        found = "stopped by SIGTERM" in window and "resuming from" in window
    if fault.ended_job and fault.kind != "sshd":
        found = found and ("resuming from" in window)
    return found


# -- the report


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.1f}" if values else "-"


def render(chaos: Chaos) -> str:
    lines = [
        f"{'fault':<27}{'injected':>9}{'survived':>9}{'named':>7}{'training waited s':>24}"
        f"{'4 ranks again s':>17}{'retrained':>10}",
        f"{'':<27}{'':>9}{'':>9}{'':>7}{'median    max  total':>24}{'median':>17}{'steps':>10}",
    ]
    for kind in KINDS:
        faults = [f for f in chaos.faults if f.kind == kind]
        if not faults:
            lines.append(f"{LABELS[kind]:<27}{0:>9}")
            continue
        lost = [f.lost_s for f in faults if f.trains_on is not None]
        full = [f.full_s for f in faults if f.full_s is not None]
        judged = [f for f in faults if f.named is not None]
        named_text = f"{sum(1 for f in judged if f.named)}/{len(judged)}" if judged else "n/a"
        survived = sum(1 for f in faults if f.survived)
        longest = f"{max(lost):.1f}" if lost else "-"
        lines.append(
            f"{LABELS[kind]:<27}{len(faults):>9}{survived:>9}{named_text:>7}"
            f"{median(lost):>11}{longest:>7}{sum(lost):>6.1f}{median(full):>17}"
            f"{sum(f.retrained for f in faults):>10}"
        )
    ended = [f for f in chaos.faults if f.ended_job]
    for fault in ended:
        lines.append(
            f"not survived: fault {chaos.faults.index(fault) + 1} ({LABELS[fault.kind]}, host "
            f"{fault.host}, held {fault.hold_s:.1f} s) ended the job; resumed from its last checkpoint"
        )
    quiet = [f for f in chaos.faults if f.named is None]
    if quiet:
        lines.append(
            f"not noticed by the job (training only waited; nothing to name): "
            f"{', '.join(f'{LABELS[f.kind]} {f.hold_s:.1f} s' for f in quiet)}"
        )
    for fault in chaos.faults:
        if fault.note:
            lines.append(f"fault {chaos.faults.index(fault) + 1} ({LABELS[fault.kind]}): {fault.note}")
    steps = chaos.summary.get("steps")
    lines.append(
        f"chaos {chaos.chaos_s / 60:.1f} min, {len(chaos.faults)} faults, seed {chaos.seed}; the job: exit "
        f"{chaos.job_exit}, {steps} steps of {chaos.planned} planned, {len(chaos.records.steps)} step "
        f"records ({chaos.unrecorded} steps without one: rank 0 killed before writing them)"
    )
    for problem in chaos.records.problems[:5]:
        lines.append(f"records: {problem}")
    unnamed = [f for f in chaos.faults if f.named is False]
    goals = {
        "the planned steps trained": steps == chaos.planned and chaos.job_exit == 0,
        "consistent weights": chaos.summary.get("weights_consistent") is True,
        "every fault named in the log": not unnamed,
        "no step trained twice before the last commit": not chaos.bad and not chaos.records.problems,
        "every fault survived": not ended and all(f.trains_on is not None for f in chaos.faults),
    }
    details = {
        "every fault named in the log": ", ".join(
            f"fault {chaos.faults.index(f) + 1} ({LABELS[f.kind]})" for f in unnamed
        ),
        "no step trained twice before the last commit": ", ".join(
            f"step {p} -> {r}" for p, r in chaos.bad[:5]
        ),
        "every fault survived": ", ".join(
            f"{LABELS[f.kind]} (fault {chaos.faults.index(f) + 1})" for f in ended
        ),
    }
    for goal, met in goals.items():
        detail = details.get(goal, "") if not met else ""
        lines.append(f"{goal}: {'met' if met else 'MISSED'}" + (f" ({detail})" if detail else ""))
    return "\n".join(lines)


def main(out: Path, minutes: float | None = None, seed: int | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    try:
        with Rig(hosts=len(HOSTS)) as rig:
            chaos = Chaos(rig, out, minutes_wanted(minutes), seed_wanted(seed))
            try:
                chaos.run()
            finally:
                if chaos.job is not None:
                    chaos.job.stop()
    except RigError as error:
        raise RuntimeError(str(error)) from None
    print(render(chaos))

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
from collections.abc import Iterator
from dataclasses import dataclass, field

from hvdtrain.errors import INPUT_ERROR, TRACEBACK_FOLLOWS
from hvdtrain.launching import rank_output
from hvdtrain.launching.console import Console
from hvdtrain.launching.slurm import TASK_FAILED
from hvdtrain.launching.spec import ROOT_CAUSE, Failure, LaunchCommand, first_failure
from hvdtrain.launching.torchrun import MODULE as TORCHRUN
from hvdtrain.runtime import preempt

# TensorFlow's start-up chatter (CPU features, oneDNN, absl): kept in the per-rank log files, not shown.
FRAMEWORK_NOISE = re.compile(
    r"oneDNN custom operations are on|All log messages before absl::InitializeLog|"
    r"rebuild TensorFlow with the appropriate compiler flags|This TensorFlow binary is optimized|"
    r"Unable to register cu(DNN|FFT|BLAS) factory|computation placer already registered|"
    r"Could not find cuda drivers|failed call to cuInit|TF-TRT Warning|"
    r"The hostname of the client socket cannot be retrieved"  # torchrun's store, hosts without reverse DNS
)

WIND_DOWN_S = 10
"""How long a launcher that reported a failed rank may take to end the others: mpirun waits on the
orted of a host whose link is down for minutes after its job has aborted."""

STALL_REPORTED = re.compile(r"hvdtrain: stall:")
"""hvdtrain's own watchdog saying the job is ending in failure; launchers declare their own lines
(mpirun names the failed rank only once every daemon has answered)."""

STOP_GRACE_S = preempt.STOP_GRACE_S + 5
"""How long ranks asked to stop by SIGTERM (scancel, a scheduler's preemption, docker stop, systemd,
timeout) have to stop at an agreed step and checkpoint there before hvdtrain ends them: a little
longer than each rank gives itself."""
PASS_ON_AGAIN_S = 5.0
"""SIGUSR1 goes to the ranks again this often until the job ends: a rank that got it while it
started (and ignored it, or had no handler yet) gets it once it can act on it."""
SCHEDULER_STOPPED = re.compile(r"\*\*\* (?:STEP|JOB) \S+ ON \S+ CANCELLED AT ")
"""Slurm's slurmstepd saying it ends the job (scancel, its time limit, a requeue), as srun passes it
on: the job is being stopped, as by a signal to hvdtrain, whose own SIGTERM may come only after the
ranks' steps are gone."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
"""What timeout, systemd, Slurm, docker stop, a closed terminal and Ctrl-C send: each ends the job,
SIGTERM (once) after the ranks stopped at a step and checkpointed it, where they can be reached."""


@dataclass
class LaunchResult:
    returncode: int
    failure: Failure | None
    """The rank that failed first, as the launcher reported it."""
    output_tail: list[str]
    wall_seconds: float
    stopped_by: int | None = None
    """The signal that stopped hvdtrain (and so the job), if one did."""
    stopped_at: dict | None = None
    """Rank 0's marker where every rank stopped at one step as asked (SIGUSR1, or SIGTERM): the step,
    and whether a checkpoint was written there (hvdtrain.runtime.preempt; read by hvdtrain.job.execute)."""
    lost_hosts: dict[str, str] = field(default_factory=dict)
    """Other hosts that did not answer when the job ended -> what happened."""
    launcher_exit: int | None = None
    """The launcher's own exit code; None where hvdtrain ended it."""
    diverged: dict | None = None
    """Rank 0's marker where every rank stopped at one step because the run diverged: where, what
    was not finite, and the step of the last checkpoint (hvdtrain.runtime.divergence)."""

    @property
    def preempted(self) -> bool:
        """Stopped at a step for the preemption warning (SIGUSR1), not by a signal that ends the job."""
        return self.stopped_at is not None and self.stopped_by is None


def run_launch(
    command: LaunchCommand,
    environment: dict[str, str],
    failed_rank_patterns: tuple[re.Pattern[str], ...] = (),
    show_framework_noise: bool = False,
    console: Console | None = None,
    job_failing: tuple[re.Pattern[str], ...] = (),
    preempt_via_launcher: bool = False,
    stops_at_step: bool = True,
) -> LaunchResult:
    """Run the launcher in its own process group with `environment` and the command's variables (no
    other variable of this process), show its output on `console` (a new one on stdout by default),
    and leave no process behind. SIGUSR1 is passed on to the ranks that run here (and to the
    launcher, where it passes it on to every rank itself: `preempt_via_launcher`); the job goes on
    until they stop (hvdtrain.runtime.preempt). SIGTERM, or Slurm saying it cancels the job, is
    passed on the same way, and the job ends once they stopped or after STOP_GRACE_S."""
    console = console or Console()
    failing_lines = (*job_failing, STALL_REPORTED)
    rank_tag = rank_output.rank_tag()
    start = time.monotonic()
    tail: deque[str] = deque(maxlen=400)
    failures: list[str] = []
    failing: list[float] = []  # when the job was first said to be failing
    stops: list[int] = []  # the signal handler only records; the wait loop below acts on it
    # A signal already ignored (nohup's SIGHUP) stays ignored.
    # Python takes signals on its main thread only; from another thread (hvdtrain.run in a pool)
    # they stay the caller's to handle.
    main_thread = threading.current_thread() is threading.main_thread()
    watched = [s for s in STOP_SIGNALS if main_thread and signal.getsignal(s) is not signal.SIG_IGN]
    previous = {signum: signal.signal(signum, lambda signum, _: stops.append(signum)) for signum in watched}
    preempts: list[int] = []
    cancelled: list[int] = []  # the scheduler said it ends the job (SCHEDULER_STOPPED)
    if main_thread and signal.getsignal(preempt.SIGNAL) is not signal.SIG_IGN:
        previous[preempt.SIGNAL] = signal.signal(preempt.SIGNAL, lambda signum, _: preempts.append(signum))
    try:
        process = subprocess.Popen(
            command.argv,
            env={**environment, **command.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,
        )
    except OSError:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        raise

    def whole_lines() -> Iterator[str]:
        assert process.stdout is not None
        whole = rank_output.WholeLines(rank_output.piece_tag())
        for line in process.stdout:
            yield from whole.feed(line)
        yield from whole.rest()

    def pump() -> None:
        in_launcher_traceback, keep, failed_task = False, 0, False
        quiet: set[int] = set()  # ranks printing the traceback of an input error, for their logs only
        for line in whole_lines():
            tail.append(line.rstrip("\n"))
            if ROOT_CAUSE in line or first_failure([line], failed_rank_patterns) is not None:
                keep = 4  # the line naming the rank and the few after it, which give its exit code
            if keep:
                failures.append(line)
                keep -= 1
            failed_task = failed_task or bool(TASK_FAILED.search(line))  # srun ends its step then too
            if SCHEDULER_STOPPED.search(line) and not failures and not failed_task:
                cancelled.append(signal.SIGTERM)
            if not failing and (keep or any(pattern.search(line) for pattern in failing_lines)):
                failing.append(time.monotonic())
            # horovodrun reports a failed rank with a Python traceback of its own; hvdtrain reports
            # it in one message instead. Ranks' lines carry a rank tag and are always shown.
            tag = rank_tag.match(line)
            from_launcher = tag is None
            in_launcher_traceback = from_launcher and (in_launcher_traceback or line.startswith("Traceback"))
            hidden = in_launcher_traceback or (FRAMEWORK_NOISE.search(line) and not show_framework_noise)
            if tag is not None:
                rank = rank_output.tagged(tag)[0]
                if TRACEBACK_FOLLOWS in line:
                    quiet.add(rank)
                elif INPUT_ERROR in line:
                    quiet.discard(rank)
                hidden = hidden or rank in quiet or TRACEBACK_FOLLOWS in line
            try:
                console.feed(line, show=not hidden)
            except Exception:  # the console must never stop the pump: a full pipe would block the job
                if not hidden:
                    sys.stdout.write(line)
                    sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    returncode = None
    stopped_by = None
    try:
        passed_on = 0.0  # when SIGUSR1 last went to the ranks
        continued: list[None] = []
        asked: list[float] = []  # when the job was asked to stop at a step (SIGTERM, the scheduler)
        while returncode is None:
            if any(signum != signal.SIGTERM for signum in stops) or len(stops) > 1:
                break  # Ctrl-C, a closed terminal, SIGTERM again: no waiting for a step
            if stops and not stops_at_step:
                break  # a script's ranks, or elastic ones, have no step to agree on
            if (stops or cancelled) and not asked:
                asked.append(time.monotonic())
                stopped_by = signal.SIGTERM
            with contextlib.suppress(subprocess.TimeoutExpired):
                returncode = process.wait(timeout=0.2)
            if (preempts or asked) and returncode is None and time.monotonic() - passed_on > PASS_ON_AGAIN_S:
                passed_on = time.monotonic()
                if not _pass_on_preemption(process, preempt_via_launcher) and asked:
                    break  # no rank here and a launcher that passes nothing on (horovodrun's ssh, Ray)
            if failing and not continued:  # a stopped rank ends with the others only once continued
                continued.append(_continue_all(process))
            if returncode is None and failing and not asked and time.monotonic() - failing[0] > WIND_DOWN_S:
                break  # the job is failing and the launcher hangs on: the finally ends it
            if returncode is None and asked and time.monotonic() - asked[0] > STOP_GRACE_S:
                break  # the ranks did not stop in time: the finally ends them
        if stops and returncode is None:  # not one during clean-up
            stopped_by = stops[0]
    finally:
        _kill_group(process)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    launcher_exit = returncode
    if returncode is None and stopped_by is None:
        returncode = 1  # ended by hvdtrain after the launcher reported a failed rank and hung on
    reader.join(timeout=5)
    if stopped_by is None and cancelled:  # the launcher may end before the scheduler's signal here
        stopped_by = cancelled[0]
    console.close()  # a reader still feeding after this prints plain lines
    if stopped_by is not None:
        returncode = 128 + stopped_by
    failure = None if stopped_by else first_failure(failures, failed_rank_patterns)
    return LaunchResult(
        returncode, failure, list(tail), time.monotonic() - start, stopped_by, launcher_exit=launcher_exit
    )


def _continue_all(process: subprocess.Popen) -> None:
    """SIGCONT to the launcher and everything it started here: the launcher ends a failing job's
    other ranks with SIGTERM, which a stopped rank (the stall the watchdog named) acts on only then."""
    import psutil

    with contextlib.suppress(psutil.Error):
        for member in [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                member.resume()


def _pass_on_preemption(process: subprocess.Popen, via_launcher: bool) -> int:
    """SIGUSR1 to every rank of this host (hvdtrain.worker processes under the launcher), and to the
    launcher itself where it passes signals on to every rank (srun, mpirun). Returns how many
    processes it went to."""
    import psutil

    try:
        launcher = psutil.Process(process.pid)
        family = launcher.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    targets = [launcher] if via_launcher else []
    for member in family:
        with contextlib.suppress(psutil.Error):
            command = member.cmdline()
            if "hvdtrain.worker" in command and TORCHRUN not in command:  # not torchrun
                targets.append(member)
    for target in targets:
        with contextlib.suppress(psutil.Error):
            target.send_signal(preempt.SIGNAL)
    return len(targets)


def end_processes(processes, grace_s: float, *, terminate: bool = True) -> None:
    """The one reaper: SIGTERM each process (unless told to stop already, `terminate=False`), wait up
    to grace_s for them to exit, SIGKILL those left, and reap them all. Takes psutil.Process or
    subprocess.Popen objects; a process already gone is no error."""
    import psutil

    family = []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            family.append(process if isinstance(process, psutil.Process) else psutil.Process(process.pid))
    if terminate:
        for member in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                member.terminate()
                member.resume()  # a stopped rank acts on SIGTERM only once continued
    _, alive = psutil.wait_procs(family, timeout=grace_s)
    for member in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    psutil.wait_procs(alive, timeout=5)
    for process in processes:  # a Popen whose child psutil reaped still learns its exit code
        if isinstance(process, subprocess.Popen):
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=1)


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
    end_processes(family, grace_s=5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()

"""The sweep itself: an Optuna study in the sweep directory, each trial a real `hvdtrain run` in a run
directory of its own under it, started as a child process of this one.

This process alone imports Optuna. It reads each running trial's metrics.jsonl (one record an epoch,
written by rank 0) and reports the metric to the study; where the pruner says so it sends the trial
SIGTERM, which `hvdtrain run` turns into every rank stopping at one agreed step with a checkpoint
(hvdtrain.runtime.preempt), and the trial is recorded as pruned. The ranks do not know they are in a
sweep.

Nothing is lost when the sweep is stopped or killed. SIGTERM or Ctrl-C to the sweep is passed on to
every running trial as SIGTERM (they checkpoint and stop); a SIGKILL of the sweep does the same,
since every trial is started with the kernel's parent-death signal set to SIGTERM. Those trials stay
RUNNING in the study, with their intermediate values and run directories. The same command again
adopts every RUNNING trial whose sweep process is gone: the same trial (number, params, reports),
`hvdtrain run --resume` in its run directory (from the start, in it, where no checkpoint was
written yet), then asks for new trials until the study holds --trials of them. A finished trial is
never run again, and the sweep ends with the same number of trials as one never stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hvdtrain.errors import EXIT_USAGE, UserError
from hvdtrain.job.submit import run_argv as _run_argv
from hvdtrain.records.runs import now_iso, pid_alive
from hvdtrain.records.tracking import finite_number
from hvdtrain.runtime.common import RUN_RECORD, atomic_write_bytes, read_json_object
from hvdtrain.sweep import parent_run, space
from hvdtrain.sweep.space import TrialRow
from hvdtrain.sweep.study import (
    SURPLUS,
    SweepPlan,
    SweepResult,
    counted,
    epochs_of,
    open_study,
    optuna_module,
    owner_record,
    refusal,
    suggest,
    surplus,
    trial_rows,
)
from hvdtrain.sweep.study import orphans as find_orphans

POLL_S = 0.1
"""How often running trials' metrics.jsonl are read: an epoch's report reaches the pruner this soon."""
FREE_WAIT_S = 120.0
"""How long a sweep started again waits for a trial's run directory to be let go of by the
`hvdtrain run` the killed sweep left stopping there."""
TRIAL_OUTPUT = "sweep-trial.log"
"""In a trial's run directory: what its `hvdtrain run` printed (its logs/ keep every rank's output)."""


@dataclass
class Running:
    """One trial's `hvdtrain run`, as this process follows it."""

    number: int
    trial: Any
    params: dict[str, Any]
    run_dir: Path
    process: subprocess.Popen
    reported: set[int] = field(default_factory=set)
    prune_asked: bool = False
    slot: int = 0
    stopping: bool = False
    seen_size: int = -1
    """metrics.jsonl's size when last read: it is read again only once it grew."""


def _die_with_parent() -> None:
    """In a trial's process before it runs: SIGTERM when the sweep's process dies, even by SIGKILL,
    so the trial checkpoints and stops rather than running on unwatched (Linux's PR_SET_PDEATHSIG)."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def trial_env(environ: dict[str, str]) -> dict[str, str]:
    """The sweep's environment for a trial, without HVDTRAIN_RUN_* (the trial's options are its
    command line's, all of them)."""
    return {key: value for key, value in environ.items() if not key.startswith("HVDTRAIN_RUN_")}


class Sweep:
    def __init__(self, plan: SweepPlan, out: Callable[[str], None] | None = None) -> None:
        self.plan = plan
        self.optuna = optuna_module()
        self.say = out or (lambda line: print(line, flush=True) if plan.console else None)
        self.running: dict[int, Running] = {}
        self.stops: list[int] = []
        self.abort: str = ""
        self.mlflow: dict[str, str] | None = None
        """The sweep's MLflow run, its trials' parent (parent_run.open_sweep_run); None: none."""
        self.owner = owner_record(socket.gethostname(), now_iso(), os.environ)

    # the trials ----------------------------------------------------------------------------------
    def launch(self, study, trial, values: dict[str, Any], slot: int, adopted: bool) -> Running:
        plan = self.plan
        run_dir = space.trial_dir(plan.sweep_dir, trial.number)
        trial.set_user_attr("run_dir", str(run_dir.absolute()))
        trial.set_user_attr("hvdtrain.owner", self.owner)
        base = replace(plan.base, **plan.slots[slot]) if plan.slots else plan.base
        request = space.trial_request(base, values, run_dir)
        if adopted:
            self._wait_until_free(run_dir)
            from hvdtrain.job.resume import resume_facts
            from hvdtrain.runtime import checkpoint

            if checkpoint.resume_problem(resume_facts(run_dir).files, plan.framework) is None:
                request = space.resume_request(base, run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "hvdtrain", "run", *_run_argv(request)]
        with open(run_dir / TRIAL_OUTPUT, "ab") as output:
            output.write(f"$ {space.command_line(_run_argv(request))}\n".encode())
            output.flush()
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                env=parent_run.trial_environ(trial_env(dict(os.environ)), self.mlflow),
                start_new_session=True,  # the terminal's Ctrl-C is the sweep's to pass on as SIGTERM
                preexec_fn=_die_with_parent,
            )
        reported = set(study._storage.get_trial(trial._trial_id).intermediate_values)
        return Running(trial.number, trial, values, run_dir, process, reported, slot=slot)

    def _wait_until_free(self, run_dir: Path) -> None:
        """A killed sweep's trial may still be stopping at its checkpoint: its run is let go of first."""
        deadline = time.monotonic() + FREE_WAIT_S
        said = False
        while True:
            record = read_json_object(run_dir / RUN_RECORD) or {}
            busy = record.get("status") == "running" and record.get("host") == self.owner["host"]
            if not busy or not pid_alive(record.get("pid"), record.get("started")):
                return
            if not said:
                self.say(f"hvdtrain: waiting for {run_dir} to be let go of (pid {record.get('pid')})")
                said = True
            if time.monotonic() > deadline:
                raise UserError(f"{run_dir} is still being trained by pid {record.get('pid')}")
            time.sleep(0.5)

    def follow(self, study, running: Running) -> bool:
        """Report the epochs written since the last look; ask the pruner. Whether any was new."""
        try:
            size = (running.run_dir / "metrics.jsonl").stat().st_size
        except OSError:
            size = -1
        if size == running.seen_size:
            return False
        running.seen_size = size
        epochs = epochs_of(running.run_dir)
        fresh = False
        for record in epochs:
            epoch, value = record.get("epoch"), finite_number(record.get(self.plan.metric))
            if epoch in running.reported or value is None:
                continue
            running.trial.report(value, epoch)
            running.reported.add(epoch)
            fresh = True
        if fresh and not running.prune_asked and not self.stops and running.trial.should_prune():
            running.prune_asked = True
            with contextlib.suppress(ProcessLookupError):
                running.process.send_signal(signal.SIGTERM)  # every rank stops at a step, checkpointed
        return fresh

    def finish(self, study, running: Running) -> None:
        """The trial's run has ended: tell the study how."""
        TrialState = self.optuna.trial.TrialState
        running.seen_size = -1
        self.follow(study, running)
        record = read_json_object(running.run_dir / RUN_RECORD) or {}
        status = record.get("status")
        code = running.process.returncode
        epochs = epochs_of(running.run_dir)
        value = finite_number(epochs[-1].get(self.plan.metric)) if epochs else None
        # exit 0: finished, also where --resume found every epoch done but run.json kept "interrupted"
        if (status == "finished" or code == 0) and value is not None:
            study.tell(running.number, value)
            return
        if running.prune_asked and status in ("interrupted", "finished"):
            study.tell(running.number, state=TrialState.PRUNED)
            return
        if self.stops and status in ("interrupted", "running", None):
            return  # stopped with the sweep: RUNNING, for the same command to go on with
        why = f"its run {status or 'did not start'} (exit code {code})"
        if code == EXIT_USAGE and status in (None, "failed"):  # refused: every trial would be
            last = _last_line(running.run_dir / TRIAL_OUTPUT)
            self.abort = f"trial {running.number} was refused: {last}"
            why = last
        running.trial.set_user_attr("reason", why)
        study.tell(running.number, state=TrialState.FAIL)

    # the loop ------------------------------------------------------------------------------------
    def run(self) -> SweepResult:
        plan = self.plan
        with _stop_signals(self.stops):  # from the start: a warning while the study opens is kept
            study = open_study(plan, self.optuna)
            self.mlflow = parent_run.open_sweep_run(study, plan, self.say)
            try:
                self._loop(study)
            except BaseException:
                parent_run.end_sweep_run(self.mlflow, None, self.say)
                raise
        rows = trial_rows(plan, study, self.optuna)
        best = space.best_of(rows, plan.direction)
        command = None
        if best is not None:
            command = space.command_line(_run_argv(space.trial_request(plan.base, best.params, None)))
        self.write_record(rows, best, command)
        stopped = self.stops[0] if self.stops else None
        message = f"error: {self.abort}" if self.abort else ""
        result = SweepResult(
            plan.sweep_dir, tuple(rows), best, command, plan.metric, plan.direction, stopped, message
        )
        parent_run.end_sweep_run(self.mlflow, result, self.say)
        return result

    def _loop(self, study) -> None:
        """Trials started, followed and finished until the study holds its budget, or a signal or
        a refused trial stops the sweep."""
        plan = self.plan
        orphans = find_orphans(study, self.optuna, self.owner)
        free = list(range(max(plan.concurrent, 1)))
        self.say(_header(plan, len(counted(study)), len(orphans)))
        shown: dict[int, str] = {}
        changed = True
        while True:
            while free and not self.stops and not self.abort:
                if orphans:
                    frozen = orphans.pop(0)
                    trial = self.optuna.trial.Trial(study, frozen._trial_id)
                    values = dict(frozen.params)
                    adopted = True
                elif len(counted(study)) < plan.trials:
                    trial = study.ask()
                    if surplus(study, trial.number, plan.trials):  # another sweep process took the last
                        trial.set_user_attr(SURPLUS, True)
                        study.tell(trial.number, state=self.optuna.trial.TrialState.FAIL)
                        continue
                    values = suggest(plan, trial)
                    adopted = False
                    refused = refusal(plan.config, values)
                    if refused is not None:  # no run: the trial fails, the sweep goes on
                        trial.set_user_attr("reason", refused)
                        study.tell(trial.number, state=self.optuna.trial.TrialState.FAIL)
                        self.say(f"hvdtrain: sweep: trial {trial.number} not run: {refused}")
                        changed = True
                        continue
                else:
                    break
                slot = free.pop(0)
                self.running[trial.number] = self.launch(study, trial, values, slot, adopted)
                changed = True
            if not self.running:
                break
            if len(self.stops) > 1:
                for running in self.running.values():  # asked again: no waiting for a step
                    with contextlib.suppress(ProcessLookupError):
                        running.process.send_signal(signal.SIGTERM)
                self.stops[:] = self.stops[:1]
            for number, running in list(self.running.items()):
                if self.stops and not running.stopping:
                    running.stopping = True
                    with contextlib.suppress(ProcessLookupError):
                        running.process.send_signal(signal.SIGTERM)
                if running.process.poll() is None:
                    changed = self.follow(study, running) or changed
                    continue
                self.finish(study, running)
                del self.running[number]
                free = sorted([*free, running.slot])
                changed = True
            if changed:
                rows = trial_rows(plan, study, self.optuna)
                self.write_record(rows)
                for row in rows:  # a line as a trial starts and as it ends
                    if shown.get(row.number) != row.state:
                        shown[row.number] = row.state
                        self.say(space.row_line(row, plan.metric))
                changed = False
            time.sleep(POLL_S)

    def write_record(
        self, rows: list[TrialRow], best: TrialRow | None = None, command: str | None = None
    ) -> None:
        best = best or space.best_of(rows, self.plan.direction)
        if best is not None and command is None:
            command = space.command_line(_run_argv(space.trial_request(self.plan.base, best.params, None)))
        record = space.sweep_record(self.plan.settings(), rows, best, command)
        with contextlib.suppress(OSError):
            atomic_write_bytes(
                self.plan.sweep_dir / space.SWEEP_RECORD, (json.dumps(record, indent=1) + "\n").encode()
            )


def _header(plan: SweepPlan, already: int, orphans: int) -> str:
    searched = ", ".join(param.spec for param in plan.params)
    pruner = plan.settings()["pruner"]
    line = (
        f"sweep: {plan.recipe}, {plan.trials} trials over {searched}; {plan.direction} {plan.metric}; "
        f"sampler {plan.sampler}, pruner {pruner}; in {plan.sweep_dir}"
    )
    if already:
        line += f"\nsweep: continuing: {already} trials recorded, {orphans} to resume"
    return line


@contextlib.contextmanager
def _stop_signals(stops: list[int]):
    """SIGTERM, SIGINT, SIGHUP and SIGUSR1 (Slurm's warning before a preemption or the time limit) to
    the sweep are noted; the loop stops every trial at a checkpoint."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            previous[signum] = signal.signal(signum, lambda signum, _: stops.append(signum))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no output"
    said = [line for line in lines if line.startswith("hvdtrain: ")]
    return (said or lines or ["no output"])[-1].removeprefix("hvdtrain: ")

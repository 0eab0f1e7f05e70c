"""Starting a plan: what only running can check, the run record, staging on other hosts, the job."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

from hvdtrain import config as config_module
from hvdtrain.errors import UserError
from hvdtrain.job.plan import RunPlan
from hvdtrain.job.report import say
from hvdtrain.launching import heartbeats, remote, slurm
from hvdtrain.launching.console import Console
from hvdtrain.launching.runner import LaunchResult, run_launch
from hvdtrain.records.runs import ended_record, now_iso, running_record
from hvdtrain.runtime import checkpoint, divergence, preempt
from hvdtrain.runtime.common import RUN_RECORD, atomic_write_bytes, read_json_object, remove_stale_tmp_files


def execute(plan: RunPlan, first_attempt: bool = True) -> LaunchResult:
    """Check what only running can check, leave the config in the run directory, run the job. A
    restart does not check the tracking store again: the job goes on whether or not it answers."""
    if plan.preflight is not None and plan.config is not None:
        plan.preflight(plan.config)
    if plan.check_horovod_build:
        _check_horovod_build(plan.framework)
    if plan.tracking_uri is not None and first_attempt:
        _check_tracking(plan.tracking_uri)
    apart = _check_hosts(plan)
    try:
        plan.run_dir.mkdir(parents=True, exist_ok=True)
        if plan.config is not None:
            config_module.save(plan.config, plan.run_dir / "config.json")
        record = {"recipe": plan.recipe, "framework": plan.framework, "strategy": plan.strategy}
        record |= {"recipe_source": plan.recipe_source} if plan.recipe_source else {}
        previous = read_json_object(plan.run_dir / RUN_RECORD)
        record = running_record(
            record, previous, pid=os.getpid(), host=socket.gethostname(), now=now_iso(), resume=plan.resume
        )
        if plan.slurm_job is not None:
            record |= slurm.record_fields(plan.slurm_job)
        atomic_write_bytes(plan.run_dir / RUN_RECORD, (json.dumps(record) + "\n").encode())
    except OSError as error:
        raise UserError(f"cannot write the run directory {plan.run_dir}: {error.strerror}") from None
    for note in plan.notes:
        say(plan.console, note)
    lost: dict[str, str] = {}
    if plan.resume_from is not None:  # what every rank's checkpointer loads
        checkpoint.point_latest(plan.run_dir, plan.resume_from)
    for marker in (preempt.MARKER, divergence.MARKER):  # an earlier stop's, resumed now
        (plan.run_dir / marker).unlink(missing_ok=True)
    began = time.time()
    live = _live_tracking(plan)
    try:
        if problems := [
            c.problem for c in remote.stage(apart, plan.transport, plan.run_dir.absolute()) if c.problem
        ]:
            raise UserError("; ".join(problems))
        with open(os.devnull, "w") as nowhere:
            console = Console() if plan.console else Console(nowhere, live=False)
            port = plan.transport.port if isinstance(plan.transport, remote.Ssh) else None  # their ssh
            with heartbeats.listening(plan.command, plan.remote_hosts, console.feed, port) as command:
                result = run_launch(
                    command,
                    plan.environment,
                    plan.failed_rank_patterns,
                    plan.verbose,
                    console,
                    plan.job_failing,
                    plan.preempt_via_launcher,
                    plan.stops_at_step,
                )
        if result.returncode != 0 and result.stopped_by is None:  # who answers: a restart goes on with them
            shared = [host for host in plan.remote_hosts if host not in apart]
            lost = {
                check.host: check.problem for check in remote.alive(shared, plan.transport) if check.problem
            }
    finally:
        if live is not None:  # the rest is log_to_tracking's, once the job has ended
            live.stop()
        if apart:
            collected = remote.collect(apart, plan.transport, plan.run_dir.absolute())
            lost |= {check.host: check.problem for check in collected if check.problem}
        (plan.run_dir / remote.MARKER).unlink(missing_ok=True)
        remove_stale_tmp_files(plan.run_dir)  # what a killed rank 0 was writing
    marker = read_json_object(plan.run_dir / preempt.MARKER)  # collected from rank 0's host
    ended_well = result.launcher_exit == 0 or result.stopped_by is not None  # mpirun: 1 after SIGTERM
    if not marker or not ended_well or not marker.get("time", 0) >= began:
        marker = None  # not this job's: rank 0 writes it once the step's checkpoint is whole
    diverged = read_json_object(plan.run_dir / divergence.MARKER)
    if not diverged or result.returncode != 0 or not diverged.get("time", 0) >= began:
        diverged = None
    return replace(result, lost_hosts=lost, stopped_at=marker, diverged=diverged)


def record_end(
    run_dir: Path,
    exit_code: int,
    stopped_by: int | None,
    preempted: bool = False,
    diverged: dict | None = None,
    rank_exit_code: int | None = None,
) -> None:
    """Close the running record this process wrote in run.json with how the job ended; a record
    that is not this process's (a start refused before writing one) is left as it is."""
    record = read_json_object(run_dir / RUN_RECORD)
    if not record or record.get("status") != "running" or record.get("pid") != os.getpid():
        return
    if record.get("host") != socket.gethostname():
        return
    ended = ended_record(record, exit_code, stopped_by, now_iso(), preempted, diverged, rank_exit_code)
    with contextlib.suppress(OSError):  # what the job did is reported either way
        atomic_write_bytes(run_dir / RUN_RECORD, (json.dumps(ended) + "\n").encode())


def _check_hosts(plan: RunPlan) -> list[str]:
    """Every other host answers with the same hvdtrain and Horovod build, or the job does not start
    and nothing is written. Returns the hosts that do not share this host's run directory."""
    if not plan.remote_hosts:
        return []
    from hvdtrain.measure import doctor

    run_dir = plan.run_dir.absolute()
    made = [path for path in (run_dir, *run_dir.parents) if not path.exists()]
    try:
        token = remote.write_marker(run_dir)
    except OSError as error:
        raise UserError(f"cannot write the run directory {plan.run_dir}: {error.strerror}") from None
    expected = {name: doctor.installed_version(name) or "none" for name in ("hvdtrain", "horovod")}
    expected |= {"bind_library": plan.bind_library} if plan.bind_library else {}
    checks = remote.preflight(list(plan.remote_hosts), plan.transport, plan.python, run_dir, expected, token)
    for check in checks:
        if check.warning:
            say(plan.console, f"hvdtrain: {check.warning}", err=True)
    if problems := [check.problem for check in checks if check.problem]:
        (run_dir / remote.MARKER).unlink(missing_ok=True)
        for path in made:  # a refused start leaves no run directory behind
            with contextlib.suppress(OSError):
                path.rmdir()
        raise UserError("; ".join(problems))
    return [check.host for check in checks if not check.shared]


def _check_tracking(uri: str) -> None:
    """The store answers and MLflow is installed, or nothing starts."""
    from hvdtrain.records import tracking

    try:
        import mlflow  # noqa: F401
    except ImportError:
        raise UserError(f"--mlflow {uri}: MLflow is not installed; pip install 'hvdtrain[mlflow]'") from None
    try:
        tracking.check_reachable(uri)
    except ValueError as error:
        raise UserError(str(error)) from None


def _live_tracking(plan: RunPlan):
    """The config and each epoch into MLflow while the job runs, from this process: a thread the
    job never waits on (hvdtrain.records.live_tracking.LiveLogging)."""
    if plan.tracking_uri is None:
        return None
    from hvdtrain.records.live_tracking import LiveLogging

    return LiveLogging(plan.tracking_uri, plan.run_dir, partial(say, plan.console, err=True)).start()


def log_to_tracking(plan: RunPlan, status: str, console: bool) -> None:
    """The rest of the run into MLflow, once the job has ended: what LiveLogging did not log, the
    artifacts and the status; its run id into run.json. A store that stopped answering during the
    job is said in one line: the run itself is not failed for it."""
    if plan.tracking_uri is None:
        return
    from hvdtrain.records import tracking

    record = read_json_object(plan.run_dir / RUN_RECORD) or {}
    failed: Exception | None = None
    try:
        entry = tracking.log_run(plan.tracking_uri, plan.run_dir, record, status)
    except tracking.LoggingFailed as error:  # the MLflow run exists: a resume goes on in it
        entry, failed = error.entry, error
    except Exception as error:  # MLflow's own errors, the network's: the run's results are on disk
        entry, failed = None, error
    if entry is not None:
        record[tracking.RECORD_KEY] = entry
        with contextlib.suppress(OSError):
            atomic_write_bytes(plan.run_dir / RUN_RECORD, (json.dumps(record) + "\n").encode())
    if failed is not None:
        line = f"hvdtrain: not logged to MLflow at {plan.tracking_uri}: {failed}".splitlines()[0]
        say(console, line, err=True)
        return
    say(console, f"hvdtrain: logged to MLflow at {plan.tracking_uri}: run {entry['run_id']}")


def _check_horovod_build(framework: str) -> None:
    """A missing framework in the Horovod build is one line before any rank starts."""
    from hvdtrain.measure import doctor

    if doctor.installed_version("horovod") is None:
        raise UserError(f"Horovod is not installed; fix: {doctor.FIX_COMMAND}")
    if not doctor.framework_built(framework):
        raise UserError(
            f"Horovod was built without {doctor.FRAMEWORKS[framework]}; fix: {doctor.FIX_COMMAND}"
        )


def requeue(job_id: str, what: str = "the run") -> str:
    """Asks Slurm to requeue the job this preempted run is in (it was submitted with --requeue); the
    line that says what happened. Slurm then ends this job and starts it again, and its
    `hvdtrain run` resumes the run (hvdtrain.job.request.requeued). Slurm's SIGTERM comes as soon as
    it requeues, so this process ignores it from then on, or the line would be lost: the process ends
    on its own right after, and Slurm's SIGKILL bounds it."""
    import signal
    import subprocess
    import threading

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN) if main_thread else None
    try:
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        done, failure = None, str(error)
    if done is None or done.returncode != 0:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if done is not None:
            why = (done.stderr or done.stdout).strip().splitlines()
            failure = why[-1] if why else str(done.returncode)
        return f"hvdtrain: Slurm job {job_id} could not be requeued: {failure}"
    return f"hvdtrain: Slurm job {job_id} requeued: it resumes {what} when it starts again"

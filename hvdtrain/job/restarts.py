"""--max-restarts: a failed job relaunched from its last checkpoint, planned anew, without lost hosts."""

from __future__ import annotations

import signal
from dataclasses import replace

from hvdtrain.errors import HvdtrainError, NothingToDo
from hvdtrain.job.execute import execute, record_end
from hvdtrain.job.facts import gather_facts
from hvdtrain.job.plan import RunPlan, plan_run
from hvdtrain.job.report import exit_code_of, failure_lines, rank_exit_code, say
from hvdtrain.job.request import RunRequest
from hvdtrain.job.resume import resume_facts
from hvdtrain.launching.runner import LaunchResult
from hvdtrain.runtime import checkpoint


def restart_request(request: RunRequest, plan: RunPlan, result: LaunchResult) -> RunRequest:
    """What a restart after a failure runs: a resume of the same run directory from its last
    checkpoint (its saved config, so no --variant or --set), or the same run afresh where no epoch
    was saved yet; without the hosts that were lost, when others remain."""
    checkpointed = checkpoint.resume_problem(resume_facts(plan.run_dir).files, plan.framework) is None
    retry = replace(request, run_dir=plan.run_dir, resume=checkpointed, resume_from=None)
    if checkpointed:
        retry = replace(retry, variant=None, overrides=())
    hosts = plan.hosts  # this attempt's: hosts dropped by an earlier restart stay dropped
    kept = tuple(h for h in hosts if h.name not in result.lost_hosts) or hosts
    if hosts:
        retry = replace(retry, hosts=",".join(f"{h.name}:{h.slots}" for h in kept), hostfile=None)
    if len(kept) < len(hosts):
        slots = sum(h.slots for h in kept)
        retry = replace(retry, np=min(request.np or slots, slots))
    return retry


def run_with_restarts(request: RunRequest, plan: RunPlan) -> tuple[RunPlan, LaunchResult]:
    """execute, and with --max-restarts N relaunch a failed job up to N times, planned anew by
    restart_request. A signal that stopped the job is never overridden by a restart. However it
    ends, run.json then says so (hvdtrain runs shows it)."""
    run_dir = plan.run_dir  # restarts and resumes keep it
    try:
        plan, result = _attempts(request, plan)
    except KeyboardInterrupt:
        record_end(run_dir, 128 + signal.SIGINT, signal.SIGINT)
        raise
    except BaseException as error:  # refused input or a refused restart (exit 2), ...
        refused = isinstance(error, ValueError | RestartRefused)
        record_end(run_dir, 2 if refused else getattr(error, "exit_code", 1), None)
        raise
    record_end(
        run_dir,
        exit_code_of(result),
        result.stopped_by,
        result.preempted,
        result.diverged,
        rank_exit_code(result),
    )
    return plan, result


class RestartRefused(HvdtrainError):
    """A restart that its own plan or preflight refused: the job had started, and failed."""


def _attempts(request: RunRequest, plan: RunPlan) -> tuple[RunPlan, LaunchResult]:
    result = execute(plan)
    try:
        return _restarts(request, plan, result)
    except ValueError as error:  # UserError too: the restart's plan or preflight refused it
        raise RestartRefused(str(error)) from None


def _restarts(request: RunRequest, plan: RunPlan, result: LaunchResult) -> tuple[RunPlan, LaunchResult]:
    for attempt in range(1, request.max_restarts + 1):
        if result.returncode == 0 or result.stopped_by is not None or result.preempted:
            break
        for line in [
            *result.lost_hosts.values(),
            *failure_lines(result, plan.run_dir / "logs", plan.rank_hosts),
        ]:
            say(plan.console, f"hvdtrain: {line}", err=True)
        retry = restart_request(request, plan, result)
        try:
            plan = plan_run(retry, gather_facts(retry))
        except NothingToDo as done:  # rank 0 had finished every epoch before the job failed
            say(plan.console, f"hvdtrain: {done}", err=True)
            break
        how = "from its last checkpoint" if retry.resume else "from the start (no checkpoint was saved yet)"
        where = f" on {retry.hosts}" if retry.hosts != request.hosts else ""
        say(plan.console, f"hvdtrain: restart {attempt} of {request.max_restarts} {how}{where}", err=True)
        result = execute(plan, first_attempt=False)
    return plan, result

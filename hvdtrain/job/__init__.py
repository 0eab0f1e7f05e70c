"""One `hvdtrain run`, in one direction: request -> facts -> plan -> execute -> report. Each step is a
module here, visited once:

- request.py: what was asked (RunRequest), before anything is read;
- facts.py: this machine, read once (gather_facts);
- environment.py: which variables the launcher and the ranks get;
- plan.py: the pure plan (plan_run): placement.py places the ranks, target.py resolves what trains,
  the strategy picks its launcher, the launcher its argv;
- execute.py: the run record, the other hosts' preflight and staging, the job itself;
- restarts.py: --max-restarts, each attempt planned anew;
- report.py: the RunResult and the lines that say how the job ended.

`hvdtrain.run` and the CLI both come in through `prepare` and `start`.
"""

from __future__ import annotations

import os

from hvdtrain.errors import EXIT_USAGE, NothingToDo, UserError
from hvdtrain.job.execute import log_to_tracking, requeue
from hvdtrain.job.facts import gather_facts
from hvdtrain.job.plan import RunPlan, plan_run
from hvdtrain.job.report import RunResult, report, say
from hvdtrain.job.request import RunRequest, requeued
from hvdtrain.job.restarts import RestartRefused, run_with_restarts
from hvdtrain.runtime.common import read_json_object

__all__ = ["RunPlan", "RunRequest", "RunResult", "prepare", "start"]


def prepare(request: RunRequest) -> RunPlan:
    """The plan of a request, nothing written; bad input is a UserError (NothingToDo passes through)."""
    try:
        request = requeued(request, os.environ)
        return plan_run(request, gather_facts(request))
    except UserError:
        raise
    except ValueError as error:
        raise UserError(str(error)) from None


def start(request: RunRequest) -> RunResult:
    """Plan, run (with restarts) and report; with the console on, the last line says how it ended.
    Raises only for input refused before the job starts: a job that started is a RunResult."""
    requeued_job = None  # the Slurm job to requeue once all is said
    try:
        plan = prepare(request)
    except NothingToDo as done:
        summary = read_json_object(done.run_dir / "summary.json") or {}
        result = RunResult("finished", 0, done.run_dir, summary, str(done))
    else:
        try:
            plan, launched = run_with_restarts(request, plan)
        except RestartRefused as refused:  # the job ran and failed; what would follow it was refused
            result = RunResult("failed", EXIT_USAGE, plan.run_dir, message=f"error: {refused}")
        except UserError:
            raise
        except ValueError as error:  # the recipe's own check before any rank starts
            raise UserError(str(error)) from None
        else:
            result = report(plan.run_dir, plan.rank_hosts, launched)
            log_to_tracking(plan, result.status, request.console)
            # requeued where the job's run resumes: its line names the run directory, a checkpoint is there
            saved = launched.preempted and (launched.stopped_at or {}).get("checkpoint")
            if saved and plan.slurm_job is not None and request.run_dir is not None:
                requeued_job = plan.slurm_job.job_id
    if result.ok:
        summary_line = result.message.startswith("summary: ")
        say(request.console, result.message if summary_line else f"hvdtrain: {result.message}")
    else:
        say(request.console, f"hvdtrain: {result.message}", err=True)
    if requeued_job is not None:  # last: Slurm ends this job now
        say(request.console, requeue(requeued_job), err=True)
    return result

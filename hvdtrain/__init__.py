"""hvdtrain: data-parallel training of PyTorch and TensorFlow/Keras 3 models with Horovod.

The Python API; `hvdtrain run` is a thin shell over it::

    import hvdtrain

    result = hvdtrain.run("digits-mlp-torch", np=2, overrides={"epochs": 3})
    print(result.status, result.summary["test_accuracy"], result.run_dir)

Importing hvdtrain imports no framework: every rank imports this package first.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hvdtrain.errors import HvdtrainError, NothingToDo, UnknownRecipeError, UserError

if TYPE_CHECKING:
    from hvdtrain.job import RunPlan, RunResult

__version__ = "0.1.0"
__all__ = [
    "HvdtrainError", "NothingToDo", "RunResult", "UnknownRecipeError", "UserError", "consolidate", "plan",
    "run", "submit", "sweep",
]  # fmt: skip


def run(target: str, **keywords: Any) -> RunResult:
    """Train TARGET (a recipe name, a recipe file or `module:pkg.mod`, or a Horovod script) and
    return how it ended: a RunResult with the status run.json records ("finished", "failed",
    "interrupted"), the exit code the CLI would exit with, the run directory and its summary.

    Each keyword is an `hvdtrain run` option named like it (hvdtrain.options.COMMON, and the options
    strategies and launchers declare): `np=4`, `strategy="ddp"`, `hosts="a:2,b:2"`,
    `variant="debug"`, `overrides={"lr": 0.1}` (or `--set`'s "KEY=VALUE" strings),
    `run_dir="runs/x"`, `resume=True`, `launcher="gloo"`, `min_np=2`, `num_ps=1`,
    `threads_per_rank=1`, `max_restarts=2`, `env=["MY_VAR"]`, `script_args=[...]`, `verbose=True`.

    `console=True` (the default) shows what `hvdtrain run` shows (the ranks' output, rank 0's
    progress, the summary line); `console=False` shows nothing. The run directory's logs/ keep every
    rank's output either way.

    Raises UserError (UnknownRecipeError for a recipe name nobody registers) for input refused before
    anything starts, a keyword nobody reads or a value of the wrong kind among them; a job that
    starts and fails returns status "failed" instead.
    """
    from hvdtrain import job
    from hvdtrain.job.request import from_keywords

    if keywords.get("dry_run"):
        raise UserError("run() starts the job; hvdtrain.plan(...) is the dry run")
    return job.start(from_keywords(target, keywords))


def plan(target: str, **keywords: Any) -> RunPlan:
    """What `run` with the same keywords would start (the launch command, its environment, the run
    directory), decided without starting, writing or probing anything: `hvdtrain run --dry-run`."""
    from hvdtrain import job
    from hvdtrain.job.request import from_keywords

    return job.prepare(from_keywords(target, {**keywords, "dry_run": True}))


def submit(
    target: str,
    *,
    nodes: int = 1,
    ntasks_per_node: int | None = None,
    time: str | None = None,
    partition: str | None = None,
    sbatch_args: Sequence[str] = (),
    dry_run: bool = False,
    **keywords: Any,
) -> Any:
    """Submit `hvdtrain run TARGET` with `keywords` (as `run` takes them) as a Slurm batch job on
    `nodes` nodes of `ntasks_per_node` tasks (default: np spread over the nodes, else one a node).
    The batch script goes into the run directory; returns a Submission (job_id, run_dir, script),
    or with dry_run the SubmitPlan, whose `script` nothing has written or submitted.

    Raises UserError for input refused before anything is submitted, and for sbatch's refusal."""
    from hvdtrain.job import submit as submitting
    from hvdtrain.job.request import check_kinds, from_keywords

    allocation = {"nodes": nodes, "ntasks_per_node": ntasks_per_node, "time": time, "partition": partition,
                  "sbatch_args": sbatch_args}  # fmt: skip
    check_kinds({**allocation, "dry_run": dry_run}, {**submitting.ALLOCATION_KINDS, "dry_run": "bool"})
    request = submitting.SubmitRequest(
        from_keywords(target, keywords), nodes, ntasks_per_node, time, partition, tuple(sbatch_args)
    )
    try:
        plan = submitting.prepare(request)
        return plan if dry_run else submitting.submit(plan)
    except UserError:
        raise
    except ValueError as error:
        raise UserError(str(error)) from None


def consolidate(run_dir: str | Path, step: int | None = None) -> Path:
    """A sharded checkpoint of `run_dir` (`--strategy zero`'s: the newest, or that of `step`) as one
    whole checkpoint, in the new step directory returned (checkpoints/<step>-consolidated/, which
    `latest` names unless a newer step is there); the sharded one stays. The whole one resumes under
    any torch strategy and at any world size, and `torch.load` reads its checkpoint.pt: "model" and
    "optimizer" are plain state dicts. Raises UserError for what cannot be consolidated."""
    from hvdtrain.job.resume import resume_facts
    from hvdtrain.runtime.torch.zero_checkpoint import consolidate as consolidating

    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise UserError(f"step must be a step number (an int, 0 or more), got {step!r}")
    if Path(run_dir).is_dir() and (pid := resume_facts(Path(run_dir)).in_use_by) is not None:
        raise UserError(f"{run_dir} is being trained right now (pid {pid}); consolidate it once it ends")
    try:
        return consolidating(Path(run_dir), step)
    except ValueError as error:
        raise UserError(str(error)) from None
    except OSError as error:
        raise UserError(f"cannot consolidate {run_dir}: {error}") from None


def __getattr__(name: str) -> Any:
    if name == "sweep":  # hvdtrain.sweep(...): the package is callable (hvdtrain/sweep/__init__.py)
        import hvdtrain.sweep

        return hvdtrain.sweep
    if name == "RunResult":  # the job package loads on first use, not with every rank's import
        from hvdtrain.job import RunResult

        return RunResult
    raise AttributeError(f"module 'hvdtrain' has no attribute {name!r}")

"""hvdtrain: data-parallel training of PyTorch and TensorFlow/Keras 3 models with Horovod.

The Python API; `hvdtrain run` is a thin shell over it::

    import hvdtrain

    result = hvdtrain.run("digits-mlp-torch", np=2, overrides={"epochs": 3})
    print(result.status, result.summary["test_accuracy"], result.run_dir)

Importing hvdtrain imports no framework: every rank imports this package first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hvdtrain import options as options_module
from hvdtrain.errors import HvdtrainError, NothingToDo, UnknownRecipeError, UserError

if TYPE_CHECKING:
    from hvdtrain.job import RunPlan, RunRequest, RunResult

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

    if keywords.get("dry_run"):
        raise UserError("run() starts the job; hvdtrain.plan(...) is the dry run")
    return job.start(_request(target, keywords))


def plan(target: str, **keywords: Any) -> RunPlan:
    """What `run` with the same keywords would start (the launch command, its environment, the run
    directory), decided without starting, writing or probing anything: `hvdtrain run --dry-run`."""
    from hvdtrain import job

    return job.prepare(_request(target, {**keywords, "dry_run": True}))


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

    own = {
        "nodes": (nodes, "int"), "ntasks_per_node": (ntasks_per_node, "int"), "time": (time, "str"),
        "partition": (partition, "str"), "sbatch_args": (sbatch_args, "strings"),
        "dry_run": (dry_run, "bool"),
    }  # fmt: skip
    for name, (value, kind) in own.items():
        if value is not None and not _fits(value, kind):
            raise UserError(f"{name} must be {EXPECTED[kind]}, got {value!r}")
    request = submitting.SubmitRequest(
        _request(target, keywords), nodes, ntasks_per_node, time, partition, tuple(sbatch_args)
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


EXPECTED = {
    "int": "an int",
    "float": "a number",
    "bool": "True or False",
    "str": "a string",
    "path": "a path",
    "strings": "a list of strings",
    "hosts": "'HOST:SLOTS,...' or a list of 'HOST:SLOTS' strings",
    "overrides": "a mapping of config fields, or a list of 'KEY=VALUE' strings",
}


def _fits(value: Any, kind: Any) -> bool:
    if isinstance(kind, tuple):
        return value in kind
    many = isinstance(value, Sequence) and not isinstance(value, str)
    return {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, int | float) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
        "path": isinstance(value, str | os.PathLike),
        "strings": many and all(isinstance(item, str) for item in value),
        "hosts": isinstance(value, str) or (many and all(isinstance(item, str) for item in value)),
        "overrides": isinstance(value, Mapping) or (many and all(isinstance(item, str) for item in value)),
    }[kind]


def _request(target: str, keywords: Mapping[str, Any]) -> RunRequest:
    """The RunRequest of the API's keywords; a keyword nobody reads, or a value of the wrong kind,
    is a UserError before anything is read from the machine."""
    from hvdtrain import strategies
    from hvdtrain.job import RunRequest

    common = {option.name: option.kind for option in options_module.COMMON}
    strategy_options = strategies.all_options()
    named = {int: "int", float: "float", bool: "bool", str: "str"}
    kinds = {**common, **{name: named.get(option.type, option.type)
                          for name, (option, _) in strategy_options.items()}}  # fmt: skip
    if unknown := sorted(set(keywords) - set(kinds)):
        raise UserError(f"unknown option {', '.join(unknown)}; options: {', '.join(sorted(kinds))}")
    for name, value in keywords.items():
        if value is not None and not _fits(value, kinds[name]):
            kind = kinds[name]
            expected = f"one of {', '.join(map(str, kind))}" if isinstance(kind, tuple) else EXPECTED[kind]
            raise UserError(f"{name} must be {expected}, got {value!r}")
    fields = {name: value for name, value in keywords.items() if name in common and value is not None}
    if isinstance(fields.get("overrides"), Mapping):
        fields["overrides"] = [f"{key}={value}" for key, value in fields["overrides"].items()]
    if not isinstance(fields.get("hosts", ""), str):
        fields["hosts"] = ",".join(fields["hosts"])
    for name in ("overrides", "script_args", "env"):
        fields[name] = tuple(fields.get(name, ()))
    for name in ("hostfile", "ssh_identity_file"):
        fields |= {name: str(fields[name])} if name in fields else {}
    fields |= {"run_dir": Path(fields["run_dir"])} if "run_dir" in fields else {}
    strategy_given = {name: keywords.get(name) for name in strategy_options}
    return RunRequest(target=str(target), strategy_options=strategy_given, **fields)


def __getattr__(name: str) -> Any:
    if name == "sweep":  # hvdtrain.sweep(...): the package is callable (hvdtrain/sweep/__init__.py)
        import hvdtrain.sweep

        return hvdtrain.sweep
    if name == "RunResult":  # the job package loads on first use, not with every rank's import
        from hvdtrain.job import RunResult

        return RunResult
    raise AttributeError(f"module 'hvdtrain' has no attribute {name!r}")

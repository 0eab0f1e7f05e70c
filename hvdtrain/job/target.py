"""What a run trains, decided from the request and the facts: a recipe (its config, built from the
command line over its variant over its defaults, or a resumed run's) or a user's script, the
strategy that runs it, the run directory and each rank's program."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hvdtrain import config as config_module
from hvdtrain import registry, strategies
from hvdtrain.config import TrainConfig
from hvdtrain.job.facts import Facts
from hvdtrain.job.request import RUNS, RunRequest, recipe_spec, script_name
from hvdtrain.job.resume import resumed_config
from hvdtrain.runtime import metrics

TORCH_ONLY = {
    "sync_batch_norm": "keeps each rank's batch statistics (averaged at epochs' ends)",
    "compile": "runs its steps as tf.function graphs already",
    "async_checkpoint": "saves with Keras's model.save, which reads the model as it trains on",
}
"""Config knobs the Keras loops cannot honour yet, and what they do instead."""


@dataclass(frozen=True)
class Target:
    name: str
    """The recipe's name, or the script's file name without .py."""
    framework: str
    strategy: strategies.Strategy
    run_dir: Path
    program: list[str]
    """What each rank runs: hvdtrain.worker with the recipe and its config, or with the script."""
    recipe_ref: str | None = None
    """The recipe as the ranks load it (a name, a file, module:NAME); None for a script."""
    source: str | None = None
    """The file or module:NAME of a recipe that is not built in."""
    config: TrainConfig | None = None
    preflight: Any = None


def resolve(request: RunRequest, facts: Facts, python: str) -> Target:
    """The recipe or script the request names, or a ValueError naming what is wrong."""
    recipe_ref = recipe_spec(request.target, facts.script_text, facts.cwd, request.module)
    resumed = facts.resume if request.resume else None
    if resumed and resumed.recipe_source and recipe_ref == resumed.recipe == request.target:
        recipe_ref = resumed.recipe_source  # resumed by name: the file or module the run was made with
    source = None if recipe_ref is None else registry.source(recipe_ref)
    text = facts.script_text
    path = os.path.normpath(facts.cwd / request.target) if request.is_path else facts.script_path
    if text is not None and path is not None and (problem := registry.syntax_problem(text, path)):
        raise ValueError(problem)
    if recipe_ref is None:
        return _script(request, facts, python)
    if request.script_args:
        raise ValueError("arguments after -- are for scripts; recipes take --set KEY=VALUE")
    recipe = registry.load(recipe_ref)
    strategy = strategies.get(request.strategy, recipe.framework)
    config = _recipe_config(recipe, source, request, facts)
    if resumed and resumed.sharded_by not in (None, strategy.name):
        where, sharded_by = resumed.run_dir, resumed.sharded_by
        raise ValueError(
            f"--resume: the checkpoint in {where} is sharded by --strategy {sharded_by}, which alone "
            f"resumes it; `hvdtrain checkpoint consolidate {where}` makes a whole one for --strategy "
            f"{strategy.name}"
        )
    run_dir = (
        facts.resume.run_dir
        if request.resume
        else request.run_dir or RUNS / f"{recipe.name}-{facts.timestamp}"
    )
    program = [python, "-m", "hvdtrain.worker", "--recipe", recipe_ref]
    program += ["--run-dir", str(facts.cwd / run_dir), "--strategy", strategy.name]
    program += ["--config", config_module.to_json(config)]
    program += ["--resume"] if request.resume else []
    return Target(
        recipe.name,
        recipe.framework,
        strategy,
        run_dir,
        program,
        recipe_ref,
        source,
        config,
        recipe.preflight,
    )


def _script(request: RunRequest, facts: Facts, python: str) -> Target:
    if request.module and request.target.endswith(".py"):
        raise ValueError(f"-m takes a module name, not a file: hvdtrain run {request.target} (without -m)")
    if facts.script_text is None and request.module:
        raise ValueError(f"--module: no module named {request.target} here ({facts.cwd}) or installed")
    if facts.script_text is None:
        raise ValueError(f"script {request.target} not found")
    if request.overrides or request.variant or request.resume or request.max_restarts:
        raise ValueError(
            "--set, --variant, --resume and --max-restarts apply to recipes, not to scripts "
            f"({request.target} defines no RECIPE)"
        )
    text = facts.script_text
    framework = "tensorflow" if ("horovod.tensorflow" in text or "import tensorflow" in text) else "torch"
    name = script_name(request.target, request.module)
    how = "--module" if request.module else "--script"
    program = [python, "-m", "hvdtrain.worker", how, request.target, "--", *request.script_args]
    run_dir = request.run_dir or RUNS / f"{name}-{facts.timestamp}"
    return Target(name, framework, strategies.get(request.strategy, framework), run_dir, program)


def _recipe_config(
    recipe: registry.Recipe, source: str | None, request: RunRequest, facts: Facts
) -> TrainConfig:
    overrides = config_module.parse_overrides(recipe.config, request.overrides)
    if request.resume_from is not None and not request.resume:
        raise ValueError("--resume-from applies with --resume")
    if not request.resume:
        config = config_module.apply(recipe.make_config(request.variant), overrides)
    elif request.variant:
        raise ValueError("--variant applies to a new run; --resume continues the run's saved config")
    elif facts.resume is None:
        raise ValueError(f"--resume: no earlier run of {recipe.name} under {RUNS}/; pass --run-dir")
    else:
        config = resumed_config(recipe, source, facts.resume, overrides)
    metrics.check_monitor(config.monitor, config.mode, recipe.metrics, recipe.name)
    if recipe.framework != "torch":
        for knob, why in TORCH_ONLY.items():
            if getattr(config, knob):
                raise ValueError(f"{knob}: torch recipes only; {recipe.name}'s Keras loop {why}")
    return config

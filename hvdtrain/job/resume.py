"""What --resume continues, checked before any rank starts, so a refused resume changes nothing."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hvdtrain import config as config_module
from hvdtrain.config import TrainConfig
from hvdtrain.errors import NothingToDo
from hvdtrain.records.runs import pid_alive
from hvdtrain.registry import Recipe
from hvdtrain.runtime import checkpoint
from hvdtrain.runtime.common import RUN_RECORD, read_json_object

MAY_CHANGE_ON_RESUME = (
    "epochs",
    "lr",
    "lr_schedule",
    "lr_milestones",
    "lr_gamma",
    "min_lr",
    "warmup_epochs",
    "clip_grad_norm",
    "stop_on_nonfinite",
    "nonfinite_patience",
    "slow_rank_every_steps",
    "slow_rank_factor",
    "slow_rank_checks",
    "steps_per_epoch",
    "checkpoint",
    "data_dir",
    "fp16_allreduce",
    "log_step_lr",
    "keep_checkpoints",
    "checkpoint_every_steps",
    "async_checkpoint",
    "early_stopping_patience",
    "zero_stage",
)
"""Fields a resumed run may set anew; the others shape the model, the data or the optimizer the
checkpoint was made with."""


@dataclass(frozen=True)
class ResumeFacts:
    run_dir: Path
    saved_config: dict[str, Any] | None = None
    """run_dir/config.json, None where missing or unreadable."""
    recipe: str | None = None
    """The recipe run_dir/run.json names (runs of older versions have none)."""
    files: dict[str, str] = field(default_factory=dict)
    """Checkpoint file, relative to run_dir -> "ok", "missing", or what is wrong with it
    (hvdtrain.runtime.checkpoint.inspect)."""
    finished_epochs: int | None = None
    """The epochs of a run that finished (its summary.json), else None."""
    recipe_source: str | None = None
    """The file or module:NAME of a recipe that is not built in, as run_dir/run.json records it."""
    in_use_by: int | None = None
    """The pid of another hvdtrain on this host that is training this run right now."""
    sharded_by: str | None = None
    """The strategy whose ranks each wrote a file of the checkpoint, and alone read it; None: whole."""
    step: int | None = None
    """--resume-from's step: the checkpoint the files are of; None: the latest."""
    intact: int | None = None
    """Where that checkpoint fails its manifest: the newest older one that passes."""


def resume_facts(run_dir: Path, step: int | None = None) -> ResumeFacts:
    summary = read_json_object(run_dir / "summary.json")
    record = read_json_object(run_dir / RUN_RECORD) or {}
    files = checkpoint.inspect(run_dir, step)
    found = checkpoint.at(run_dir, step) if step is not None else checkpoint.latest(run_dir)
    intact = None
    if any(status != "ok" for name, status in files.items() if name.startswith(checkpoint.CHECKPOINTS)):
        newest = step if step is not None else (found.manifest.step if found and found.manifest else None)
        intact = checkpoint.newest_intact(run_dir, newest)
    return ResumeFacts(
        run_dir=run_dir,
        saved_config=read_json_object(run_dir / "config.json"),
        recipe=record.get("recipe"),
        recipe_source=record.get("recipe_source"),
        files=files,
        finished_epochs=summary.get("epochs") if summary else None,
        in_use_by=_training_it(record),
        sharded_by=found.sharded_by if found else None,
        step=step,
        intact=intact,
    )


def _training_it(record: dict) -> int | None:
    """The pid of another live hvdtrain on this host whose record says it is running this run."""
    pid = record.get("pid")
    if record.get("status") != "running" or record.get("host") != socket.gethostname() or pid == os.getpid():
        return None
    return pid if pid_alive(pid, record.get("started")) else None


def resumed_config(
    recipe: Recipe, source: str | None, resume: ResumeFacts, overrides: dict[str, Any]
) -> TrainConfig:
    """The saved config with what may change on resume; every check before any rank starts, so a
    refused resume leaves the run directory as it was."""
    where = resume.run_dir
    if resume.in_use_by is not None:
        raise ValueError(f"--resume: {where} is being trained right now by hvdtrain (pid {resume.in_use_by})")
    if resume.saved_config is None:
        raise ValueError(f"--resume: {where} holds no run (no readable config.json)")
    if resume.recipe not in (None, recipe.name):
        raise ValueError(f"--resume: {where} is a run of {resume.recipe}, not of {recipe.name}")
    if resume.recipe is not None and resume.recipe_source != source:
        builtin = f"the built-in {recipe.name}"
        raise ValueError(
            f"--resume: {where} is a run of {resume.recipe_source or builtin}, not of {source or builtin}"
        )
    if problem := checkpoint.resume_problem(resume.files, recipe.framework):
        name, status = problem
        other = f"; step {resume.intact} is intact: --resume-from {resume.intact} goes on from it" * (
            resume.intact is not None
        )
        raise ValueError(f"--resume: {where / name} is {status}; nothing was changed{other}")
    saved = config_module.from_dict(recipe.config, resume.saved_config)
    changed = sorted(name for name, value in overrides.items() if getattr(saved, name) != value)
    if fixed := [name for name in changed if name not in MAY_CHANGE_ON_RESUME]:
        raise ValueError(
            f"--resume: {', '.join(fixed)} cannot change on resume (the checkpoint was made with "
            f"{', '.join(f'{name}={getattr(saved, name)}' for name in fixed)}); "
            f"what may change: {', '.join(MAY_CHANGE_ON_RESUME)}"
        )
    config = config_module.apply(saved, overrides)
    if resume.finished_epochs is not None and config.epochs <= resume.finished_epochs:
        raise NothingToDo(
            f"{where} already finished its {resume.finished_epochs} epochs; nothing changed "
            f"(--resume --set epochs=N with N > {resume.finished_epochs} trains more)",
            where,
        )
    return config

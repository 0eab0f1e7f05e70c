"""Horovod allreduce (the default): a launcher from hvdtrain.launchers starts the ranks, Horovod
averages gradients."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from hvdtrain import launchers
from hvdtrain.launch import LaunchSpec
from hvdtrain.launchers import AUTO
from hvdtrain.strategies import LaunchContext, Option, Strategy, StrategyLaunch, rank_threads

OPTIONS = (
    Option("launcher", "--launcher", AUTO, launchers.help_text(), (AUTO, *launchers.names())),
    Option("stall_timeout", "--stall-timeout", 120, "Seconds a rank may wait in a collective.", int),
    Option("horovod_autotune", "--horovod-autotune", False, "Let Horovod tune fusion and cycle time.", bool),
)


def horovod_env(spec: LaunchSpec, stall_timeout: int, autotune: bool) -> dict[str, str]:
    env = {
        # Horovod's own stall check (it works under the MPI controller), then hvdtrain's watchdog.
        "HOROVOD_STALL_CHECK_TIME_SECONDS": str(max(1, stall_timeout // 2)),
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(stall_timeout),
        "HVDTRAIN_STALL_TIMEOUT": str(stall_timeout),
        # Gloo's own wait for a peer (30 s by default): a lost host ends the job after the stall timeout.
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(stall_timeout),
    }
    if spec.log_dir:
        env["HVDTRAIN_STATUS_DIR"] = f"{spec.log_dir}/status"
    if autotune and spec.log_dir:
        env["HOROVOD_AUTOTUNE"] = "1"
        env["HOROVOD_AUTOTUNE_LOG"] = str(Path(spec.log_dir).parent / "horovod-autotune.csv")
    return env


def launch(spec: LaunchSpec, options: Mapping[str, Any], context: LaunchContext) -> StrategyLaunch:
    if options["stall_timeout"] < 1:
        raise ValueError(f"--stall-timeout must be at least 1 second, got {options['stall_timeout']}")
    name, notes = options["launcher"], ()
    available = {
        n
        for n, launcher in launchers.all_launchers().items()
        if launcher.executable in (None, *context.executables)
    }
    if name == launchers.AUTO:
        name = launchers.choose(context.measured_launchers, context.framework, available)
        measured = context.measured_launchers.get(context.framework)
        basis = f"measured {dict(measured)}" if measured else "the project's measured default"
        notes = (f"hvdtrain: --launcher auto chose {name} ({basis})",)
    launcher = launchers.get(name)
    if name not in available:
        raise ValueError(
            f"--launcher {name} needs {launcher.executable} on PATH; install Open MPI or use --launcher gloo"
        )
    env = {
        **rank_threads(spec, context),
        **horovod_env(spec, options["stall_timeout"], options["horovod_autotune"]),
        **spec.env,
    }
    hvd = launchers.HorovodLaunch(horovodrun=context.horovodrun, run_as_root=context.run_as_root)
    command = launcher.build(replace(spec, env=env), hvd)
    return StrategyLaunch(command, launcher.failed_rank_patterns, launcher=name, notes=notes)


def train(recipe, config, run_dir: Path, resume: bool) -> dict:
    if recipe.framework == "torch":
        from hvdtrain.runtime import torch as runtime

        return runtime.run(recipe.build, config, runtime.HorovodTorch(), run_dir, recipe.name, resume)
    from hvdtrain.runtime import tensorflow as runtime

    return runtime.run(recipe.build, config, runtime.HorovodKeras(), run_dir, recipe.name, resume)


STRATEGY = Strategy(
    name="horovod",
    frameworks=("torch", "tensorflow"),
    description="batch-synchronous allreduce of gradients with Horovod (gloo or MPI)",
    launch=launch,
    train=train,
    options=OPTIONS,
)

"""Horovod allreduce (the default): a launcher from hvdtrain.launchers starts the ranks, Horovod
averages gradients."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from hvdtrain import launchers
from hvdtrain.config import TrainConfig
from hvdtrain.launchers import AUTO
from hvdtrain.launching.spec import LaunchSpec
from hvdtrain.measure import tuning
from hvdtrain.measure.estimate import Traffic
from hvdtrain.options import Option
from hvdtrain.runtime import watchdog
from hvdtrain.strategies import LaunchContext, Strategy, StrategyLaunch, rank_threads

TIMELINE = "horovod-timeline.json"
"""Where --timeline puts Horovod's trace, in the run directory (rank 0, the coordinator, writes it)."""
OWN_OPTIONS = (
    Option("launcher", "--launcher", AUTO, launchers.help_text(), (AUTO, *launchers.names())),
    Option("stall_timeout", "--stall-timeout", 120, "Seconds a rank may wait in a collective.", int),
    Option("horovod_autotune", "--horovod-autotune", False, "Let Horovod tune fusion and cycle time.", bool),
    Option(
        "timeline",
        "--timeline",
        False,
        f"Record Horovod's timeline (Chrome trace JSON) into RUN_DIR/{TIMELINE}.",
        bool,
    ),
    Option(
        "timeline_filename",
        "--timeline-filename",
        None,
        "Record Horovod's timeline into this file (horovodrun's flag; --timeline picks the run directory).",
    ),
    Option(
        "fusion_threshold_mb",
        "--fusion-threshold-mb",
        None,
        "Horovod's tensor fusion buffer, MiB (HOROVOD_FUSION_THRESHOLD). [default: a kept tuning, else 128]",
        float,
    ),
    Option(
        "cycle_time_ms",
        "--cycle-time-ms",
        None,
        "Horovod's cycle time, ms (HOROVOD_CYCLE_TIME). [default: a kept tuning, else Horovod's]",
        float,
    ),
    Option(
        "hierarchical_allreduce",
        "--hierarchical-allreduce",
        False,
        "Allreduce within each host first, then across hosts (HOROVOD_HIERARCHICAL_ALLREDUCE).",
        bool,
    ),
    Option(
        "log_level",
        "--log-level",
        None,
        "Horovod's log level (HOROVOD_LOG_LEVEL).",
        ("trace", "debug", "info", "warning", "error", "fatal"),
    ),
    Option(
        "start_timeout",
        "--start-timeout",
        None,
        "Seconds the ranks may take to start and meet (HOROVOD_START_TIMEOUT). [default: Horovod's 30]",
        int,
    ),
    Option("commit_every", "--commit-every", 10, "Elastic: commit the state every N steps.", int),
    Option(
        "host_discovery_script",
        "--host-discovery-script",
        None,
        "Elastic: a program printing the available hosts, one HOST:SLOTS a line, instead of --hosts.",
    ),
)
OPTIONS = (*OWN_OPTIONS, *(replace(option, default=None) for option, _ in launchers.all_options().values()))
"""This strategy's options, then every launcher's own: None until given, so that each launcher
applies its own default and refuses the others' given ones."""
BACKSTOP_FACTOR = 3
"""Gloo's timeout and Horovod's stall shutdown, in stall timeouts: a job suspended whole for longer
than this many stall timeouts ends by them after it is resumed."""
ELASTIC_OPTIONS = (*(option.name for option in launchers.elastic_default().options), "host_discovery_script")
"""Any of these asks for elastic training (on the elastic launcher, unless another that takes it is
chosen)."""


def asks_for_elastic(options: Mapping[str, Any]) -> bool:
    """Whether these options ask for elastic training: a launcher that always runs it, or any
    elastic option given."""
    name = options["launcher"]
    chosen = name != launchers.AUTO and name in launchers.names() and launchers.get(name).elastic
    return chosen or any(options[key] is not None for key in ELASTIC_OPTIONS)


def horovod_env(
    spec: LaunchSpec,
    stall_timeout: int,
    autotune: bool,
    elastic: bool = False,
    timeline: bool = False,
    framework: str = "torch",
) -> dict[str, str]:
    # Gloo's own wait for a peer (30 s by default): under elastic training a lost host resets the
    # job after the stall timeout.
    env = {"HOROVOD_GLOO_TIMEOUT_SECONDS": str(stall_timeout)}
    if elastic:  # every rank times out alike there: hvdtrain names a rank silent half that long
        env[watchdog.HEARTBEAT_ENV] = str(max(stall_timeout // 2, watchdog.HEARTBEAT_MIN_SILENCE_S))
    else:  # elastic ranks wait in collectives while the job resets: that is no stall
        # hvdtrain's watchdog names a stalled rank, or a lost host's, at the stall timeout under
        # either controller, and tells a job suspended whole (Slurm's SIGSTOP to every rank) from a
        # stall. Gloo's timeout and Horovod's own stall check count the time a job was stopped too
        # (a tensor some ranks had submitted before the SIGSTOP is "missing ranks" right after the
        # SIGCONT), and Horovod's shutdown ends a job with a bare traceback, so they come only well
        # after. TensorFlow's collectives run inside graphs, where the watchdog does not see them:
        # there Horovod's check warns at half the timeout and is the stall check.
        torch = framework == "torch"
        backstop = str((BACKSTOP_FACTOR if torch else 1) * stall_timeout)
        warning = (BACKSTOP_FACTOR - 1) * stall_timeout if torch else max(1, stall_timeout // 2)
        env |= {
            "HOROVOD_GLOO_TIMEOUT_SECONDS": backstop,
            "HOROVOD_STALL_CHECK_TIME_SECONDS": str(warning),
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": backstop,
            "HVDTRAIN_STALL_TIMEOUT": str(stall_timeout),
        }
    if spec.log_dir:
        env["HVDTRAIN_STATUS_DIR"] = f"{spec.log_dir}/status"
    if autotune and spec.log_dir:
        env["HOROVOD_AUTOTUNE"] = "1"
        env["HOROVOD_AUTOTUNE_LOG"] = str(Path(spec.log_dir).parent / "horovod-autotune.csv")
    if timeline and spec.log_dir:
        env["HOROVOD_TIMELINE"] = str(Path(spec.log_dir).parent / TIMELINE)
    return env


def horovodrun_settings(options: Mapping[str, Any]) -> dict[str, str]:
    """The variables horovodrun's tuning flags set, for those given."""
    if options["fusion_threshold_mb"] is not None and options["fusion_threshold_mb"] < 0:
        raise ValueError(
            f"--fusion-threshold-mb must be 0 (no fusion) or more, got {options['fusion_threshold_mb']}"
        )
    for name in ("cycle_time_ms", "start_timeout"):
        if options[name] is not None and options[name] <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be above 0, got {options[name]}")
    fusion = options["fusion_threshold_mb"]
    values = {
        "HOROVOD_FUSION_THRESHOLD": None if fusion is None else str(int(fusion * 2**20)),  # 0: no fusion
        "HOROVOD_CYCLE_TIME": options["cycle_time_ms"] and f"{options['cycle_time_ms']:g}",
        "HOROVOD_HIERARCHICAL_ALLREDUCE": options["hierarchical_allreduce"] and "1",
        "HOROVOD_LOG_LEVEL": options["log_level"] and options["log_level"].upper(),
        "HOROVOD_START_TIMEOUT": options["start_timeout"] and str(options["start_timeout"]),
        "HOROVOD_TIMELINE": options["timeline_filename"]
        and str(Path(options["timeline_filename"]).absolute()),
    }
    return {name: value for name, value in values.items() if value}


def launch(
    spec: LaunchSpec, options: Mapping[str, Any], context: LaunchContext, config: TrainConfig | None = None
) -> StrategyLaunch:
    """The chosen launcher's command; a config the launcher cannot run (None: a script) is refused."""
    if options["stall_timeout"] < 1:
        raise ValueError(f"--stall-timeout must be at least 1 second, got {options['stall_timeout']}")
    name, notes = options["launcher"], ()
    elastic = asks_for_elastic(options)
    takes_it = [launcher.name for launcher in launchers.all_launchers().values() if launcher.takes_elastic]
    if elastic and name not in (launchers.AUTO, *takes_it):
        raise ValueError(
            f"--min-np/--max-np run on --launcher {' or '.join(takes_it)}, not --launcher {name}"
        )
    if elastic and context.framework != "torch":
        raise ValueError(
            "elastic training runs torch recipes: hvdtrain's Keras loops do not yet keep Horovod's "
            "elastic KerasState (it needs Horovod's DistributedOptimizer under Keras 3)"
        )
    if elastic and name == launchers.AUTO:
        name = launchers.elastic_default().name
    available = {
        n
        for n, launcher in launchers.all_launchers().items()
        if launcher.executable in (None, *context.executables) and launcher.module in (None, *context.modules)
    }
    allocation = context.allocation
    for candidate in launchers.all_launchers().values() if name == launchers.AUTO and not elastic else ():
        # one this place calls for (srun inside an allocation), before any measured speed
        why = candidate.preferred(allocation, context.probed.get(candidate.name, frozenset()))
        if candidate.name in available and why:
            name, notes = candidate.name, (f"hvdtrain: --launcher auto chose {candidate.name} ({why})",)
            break
    if name == launchers.AUTO and not elastic:
        name = launchers.choose(context.measured_launchers, context.framework, available)
        measured = context.measured_launchers.get(context.framework)
        basis = f"measured {dict(measured)}" if measured else "the project's measured default"
        notes = (f"hvdtrain: --launcher auto chose {name} ({basis})",)
    launcher = launchers.get(name)
    if config is not None and (reason := launcher.refuse(config)):
        raise ValueError(reason)
    own = launchers.own_options(launcher, options)
    if name not in available and launcher.missing:
        raise ValueError(launcher.missing)
    if name not in available:
        raise ValueError(
            f"--launcher {name} needs {launcher.executable} on PATH; install Open MPI or use --launcher gloo"
        )
    if reason := launcher.refuse_here(allocation, context.probed.get(name, frozenset())):
        raise ValueError(reason)
    flags = horovodrun_settings(options)
    kept = None if options["horovod_autotune"] else context.tuning
    tuned, line = tuning.planned(tuning.HOROVOD, kept, {*spec.env, *spec.forward_env, *flags})
    notes = (*notes, line) if line else notes
    env = {
        **rank_threads(spec, context),
        **horovod_env(
            spec,
            options["stall_timeout"],
            options["horovod_autotune"],
            elastic,
            options["timeline"],
            context.framework,
        ),
        **tuned,
        **spec.env,
        **flags,
    }
    if elastic:
        if options["commit_every"] < 1:
            raise ValueError(f"--commit-every must be at least 1, got {options['commit_every']}")
        env["HVDTRAIN_COMMIT_EVERY"] = str(options["commit_every"])
    command = launcher.build(
        replace(spec, env=env, discovery_script=options["host_discovery_script"]), context, own
    )
    return StrategyLaunch(
        command, launcher.failed_rank_patterns, launcher.job_failing, name, notes, launcher.passes_on_usr1
    )


def train(recipe, config, run_dir: Path, resume: bool) -> dict:
    if recipe.framework == "torch":
        from hvdtrain.runtime import torch as runtime

        return runtime.run(recipe.build, config, runtime.HorovodTorch(), run_dir, recipe.name, resume)
    from hvdtrain.runtime import tensorflow as runtime

    return runtime.run(recipe.build, config, runtime.HorovodKeras(), run_dir, recipe.name, resume)


def finalize(framework: str) -> None:
    """hvd.shutdown(): the background thread stops, and under MPI, MPI_Finalize runs, which mpirun
    needs to count a rank as finished."""
    if framework == "torch":
        import horovod.torch as hvd
    else:
        import horovod.tensorflow as hvd
    hvd.shutdown()


STRATEGY = Strategy(
    traffic=Traffic(overlap="fused"),
    checks_horovod_build=True,
    spans_hosts=True,
    tunable=tuning.HOROVOD,
    name="horovod",
    frameworks=("torch", "tensorflow"),
    description="batch-synchronous allreduce of gradients with Horovod (gloo or MPI)",
    launch=launch,
    train=train,
    finalize=finalize,
    options=OPTIONS,
)

"""How one recipe runs under each way of parallelising, as a registry: `hvdtrain run --strategy NAME`.

A strategy is one module here. It owns how its processes start (a pure `launch`), the `hvdtrain run`
options it reads (any other strategy refuses them), the config knobs it cannot honour, and the
backend each process trains with.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hvdtrain.config import TrainConfig
from hvdtrain.launchers import LaunchContext
from hvdtrain.launching.spec import (
    LaunchCommand,
    LaunchSpec,
    RankOutput,
    is_local,
    thread_env,
    threads_per_rank,
)
from hvdtrain.measure.estimate import Traffic
from hvdtrain.measure.tuning import Tunable
from hvdtrain.options import Option, given_over_defaults, readers_of
from hvdtrain.plugins import discover, installed, named


@dataclass(frozen=True)
class StrategyLaunch:
    command: LaunchCommand
    failed_rank_patterns: tuple[re.Pattern[str], ...] = ()
    job_failing: tuple[re.Pattern[str], ...] = ()
    """Lines by which the launcher says the job is ending in failure, before it names the rank."""
    launcher: str | None = None
    """The Horovod launcher chosen, where the strategy has several."""
    notes: tuple[str, ...] = ()
    """Lines the CLI prints before the job starts."""
    passes_on_usr1: bool = False
    """Its command passes SIGUSR1 on to every rank, also on other hosts (mpirun, srun)."""


@dataclass(frozen=True)
class Strategy:
    name: str
    frameworks: tuple[str, ...]
    description: str
    launch: Callable[[LaunchSpec, Mapping[str, Any], LaunchContext, TrainConfig | None], StrategyLaunch]
    """Pure: the command that starts this strategy's processes, from the spec, its own options and
    the recipe's config (None for a script), which its launcher may refuse."""
    train: Callable[[Any, Any, Path, bool], dict]
    """On each process: (recipe, config, run_dir, resume) -> summary."""
    options: tuple[Option, ...] = ()
    """The run options this strategy reads; any other strategy refuses them when given."""
    refuse: Callable[[TrainConfig], str | None] = lambda config: None
    """The reason this strategy cannot honour a config, or None."""
    output: RankOutput | None = None
    """How the processes it starts itself tag and keep their output (None: a Horovod launcher's)."""
    checks_horovod_build: bool = False
    """Its ranks run Horovod: planning has doctor's verdict on the installed build checked first."""
    spans_hosts: bool = False
    """It runs across hosts: a Slurm allocation's nodes (and `submit --nodes` above 1) are its hosts;
    otherwise it runs on the node it starts on."""
    takes_stop_request: bool = True
    """Its loop stops at an agreed step when asked (preemption, SIGTERM); a coordinator whose loop
    takes no such request (ps) ends as its processes end."""
    tunable: Tunable | None = None
    """The communication settings `hvdtrain bench --tune` times for it and `run` then sets (None:
    nothing to tune)."""
    traffic: Traffic | None = None
    """What each rank holds of the model and sends in a step, as `hvdtrain estimate` models it
    (None: not estimated)."""
    devices: Callable[[int | None, int], int] | None = None
    """Where --np counts the devices one process trains on (dp), not processes: given --np (None: not
    given) and the GPUs visible here, the number it runs, or a ValueError saying why it cannot. None:
    --np counts processes, by default the hosts' slots or the cores."""
    finalize: Callable[[str], None] | None = None
    """Given the recipe's framework, ends the framework's communication once a process's results are
    written, so that the process can end with os._exit: the interpreter's own teardown costs about a
    second once torch or TensorFlow is loaded, and Gloo's threads can abort it (SIGABRT) after a run
    that succeeded. None: the process ends as Python ends it."""


PLUGIN_GROUP = "hvdtrain.strategies"


def _registry() -> tuple[dict[str, Strategy], dict[str, str]]:
    found = discover(sys.modules[__name__], "STRATEGY", Strategy)
    broken: dict[str, str] = {}
    found += installed(PLUGIN_GROUP, Strategy, [strategy.name for strategy in found], broken)
    ordered = sorted(found, key=lambda s: (s.name != "horovod", s.name))
    return {strategy.name: strategy for strategy in ordered}, broken


def all_strategies() -> dict[str, Strategy]:
    """Every module of this package that defines STRATEGY, the default (horovod) first, and the
    strategies installed packages declare (entry points in the group hvdtrain.strategies)."""
    return _registry()[0]


def broken_plugins() -> dict[str, str]:
    """Installed strategy plugins that cannot be used: where -> why."""
    return _registry()[1]


def spans_hosts(name: str) -> bool:
    """Whether the strategy of this name runs across hosts (an unknown name: no; `get` refuses it)."""
    strategy = all_strategies().get(name)
    return strategy is not None and strategy.spans_hosts


def all_options() -> dict[str, tuple[Option, list[str]]]:
    """option name -> (the option, the strategies that read it)."""
    return readers_of((strategy.name, strategy.options) for strategy in all_strategies().values())


def get(name: str, framework: str) -> Strategy:
    own = named(sys.modules[__name__], name, "STRATEGY", Strategy)  # a rank needs its strategy alone
    if own is not None and framework in own.frameworks:
        return own
    known = all_strategies()
    fitting = [s.name for s in known.values() if framework in s.frameworks]
    if name not in known:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(known)}")
    if framework not in known[name].frameworks:
        from hvdtrain import registry

        runs = sorted(
            r.name for r in registry.all_recipes().values() if r.framework in known[name].frameworks
        )
        raise ValueError(
            f"strategy {name!r} does not run {framework} recipes; "
            f"strategies for {framework}: {', '.join(fitting)}; {name} runs {', '.join(runs)}"
        )
    return known[name]


def resolve_options(strategy: Strategy, given: Mapping[str, Any]) -> dict[str, Any]:
    """The strategy's options: what the user gave over the defaults. An option the strategy does
    not read is refused rather than silently ignored."""
    own = {option.name for option in strategy.options}
    for name, value in given.items():
        if value is not None and name not in own:
            option, readers = all_options()[name]
            raise ValueError(
                f"{option.flag} does not apply to --strategy {strategy.name}; "
                f"it is for --strategy {', '.join(readers)}"
            )
    return given_over_defaults(strategy.options, given)


def launch(
    strategy: Strategy,
    spec: LaunchSpec,
    given: Mapping[str, Any],
    context: LaunchContext,
    config: TrainConfig | None,
) -> StrategyLaunch:
    """Everything the plan asks of a strategy, in one visit: whether it honours the config, its
    options over their defaults, and its launch (which asks the launcher, where it has one)."""
    if config is not None and (reason := strategy.refuse(config)):
        raise ValueError(reason)
    return strategy.launch(spec, resolve_options(strategy, given), context, config)


def rank_threads(spec: LaunchSpec, context: LaunchContext, processes_per_host: int | None = None) -> dict:
    """OMP/torch/TF threads per process, so the processes on one host share its cores."""
    if context.threads_per_rank is not None:
        return thread_env(context.threads_per_rank)
    if processes_per_host is None and spec.hosts and not is_local(spec.hosts):
        return {"HVDTRAIN_THREADS_PER_RANK": "auto"}  # each rank divides its own host's cores (worker.py)
    if processes_per_host is None:
        return thread_env(threads_per_rank(spec.np, spec.hosts, context.cores_per_host))
    return thread_env(max(1, context.cores_per_host // processes_per_host))


def help_text() -> str:
    return "; ".join(f"{s.name}: {s.description}" for s in all_strategies().values())

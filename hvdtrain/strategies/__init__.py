"""How one recipe runs under each way of parallelising: the launch, and the wrapping on each rank."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hvdtrain.launch import LaunchCommand, LaunchSpec


@dataclass(frozen=True)
class Strategy:
    name: str
    frameworks: tuple[str, ...]
    description: str
    launch: Callable[[LaunchSpec], LaunchCommand]
    """Pure: the command that starts this strategy's processes."""
    train: Callable[[Any, Any, Path, bool], dict]
    """On each process: (recipe, config, run_dir, resume) -> summary."""


def all_strategies() -> dict[str, Strategy]:
    from hvdtrain.strategies import ddp, dp, horovod, ps

    return {s.name: s for s in (horovod.STRATEGY, ddp.STRATEGY, dp.STRATEGY, ps.STRATEGY)}


def get(name: str, framework: str) -> Strategy:
    known = all_strategies()
    fitting = [s.name for s in known.values() if framework in s.frameworks]
    if name not in known:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(known)}")
    if framework not in known[name].frameworks:
        raise ValueError(
            f"strategy {name!r} does not run {framework} recipes; "
            f"strategies for {framework}: {', '.join(fitting)}"
        )
    return known[name]

"""`hvdtrain bench --tune`: each strategy's communication settings (Horovod's fusion threshold and
cycle time, DDP's bucket size) timed side by side on a recipe, and the best kept for its runs."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from hvdtrain import strategies as strategies_module
from hvdtrain.measure import tuning
from hvdtrain.measure.bench import recipe_samples_per_sec, retried_once


def tunables() -> dict[str, tuning.Tunable]:
    """strategy name -> what --tune times for it, for each strategy that has something to tune."""
    return {s.name: s.tunable for s in strategies_module.all_strategies().values() if s.tunable}


def tunable_of(strategy: str) -> tuning.Tunable:
    return tunables()[strategy]


def tune(
    strategy: str,
    recipe: str,
    np_: int,
    launcher: str | None,
    steps: int,
    epochs: int,
    batch_size: int,
    out_dir: Path,
    repeats: int = 1,
    extra: tuple[str, ...] = (),
) -> tuple[dict[tuning.Setting, float], float | None]:
    """One strategy's communication settings for one recipe: every candidate, and Horovod's autotune
    where the strategy is horovod, interleaved `repeats` times; the medians (samples/s) of the settings,
    and autotune's (None for ddp). `launcher` is for horovod."""
    tunable = tunable_of(strategy)
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in tunable.variables and not k.startswith("HOROVOD_AUTOTUNE")
    }
    runs: dict[tuning.Setting | str, dict[str, str]] = {t: {**base, **t.env()} for t in tunable.candidates}
    if tunable.autotune:
        runs[tuning.AUTOTUNE] = base
    samples: dict[tuning.Setting | str, list[float]] = {key: [] for key in runs}
    for repeat in range(repeats):
        for key, env in runs.items():
            name = key if isinstance(key, str) else "-".join(_part(v) for v in asdict(key).values())
            args = (*extra, "--set", f"batch_size={batch_size}", "--threads-per-rank", "1")
            args += ("--horovod-autotune",) if key == tuning.AUTOTUNE else ()

            def measure(attempt: int, name=name, args=args, env=env, repeat=repeat) -> float:
                run_dir = out_dir / f"tune-{strategy}-{name}-{repeat}{'-retry' if attempt else ''}"
                return recipe_samples_per_sec(
                    recipe, strategy, np_, launcher, steps, epochs, run_dir, args, env
                )

            samples[key].append(retried_once(measure))
    autotune = statistics.median(samples.pop(tuning.AUTOTUNE)) if tunable.autotune else None
    return {
        key: statistics.median(found) for key, found in samples.items() if not isinstance(key, str)
    }, autotune


def _part(value: object) -> str:
    """One setting's value in its run directory's name."""
    if value is None:
        return "default"
    return value if isinstance(value, str) else f"{value:g}"


def render_tuning(
    strategy: str, recipe: str, rates: dict[tuning.Setting, float], autotune: float | None, where: str
) -> str:
    tunable = tunable_of(strategy)
    defaults = rates[tunable.defaults]
    labels = {s: s.label() + (" (defaults)" if s == tunable.defaults else "") for s in rates}
    width = max(37, *(len(label) + 1 for label in labels.values()))
    lines = [
        f"{recipe}, {tunable.owner} {where}:",
        f"  {'setting':<{width}}{'samples/s':>10}{'vs defaults':>13}",
    ]
    for setting, rate in rates.items():
        lines.append(f"  {labels[setting]:<{width}}{rate:>10.1f}{rate / defaults:>13.2f}")
    if autotune is not None:
        lines.append(f"  {'Horovod autotune':<{width}}{autotune:>10.1f}{autotune / defaults:>13.2f}")
    chosen = tuning.choose(rates, tunable.defaults)
    verdict = (
        f"{tunable.owner}'s defaults: nothing beat them by 3 %"
        if chosen == tunable.defaults
        else f"{chosen.label()}, {rates[chosen] / defaults:.2f}x the defaults"
    )
    lines.append(f"  chosen: {verdict}")
    return "\n".join(lines)


def tune_and_keep(
    recipe: str,
    strategies: list[str],
    nps: list[int],
    launchers: list[str],
    steps: int,
    epochs: int,
    batch_size: int,
    out_dir: Path,
    repeats: int = 1,
    path: Path = tuning.TUNING_MEASUREMENTS,
    extra: tuple[str, ...] = (),
    hosts: str | None = None,
) -> str:
    """`hvdtrain bench --tune`: tune each strategy at the largest np (horovod over the first
    launcher), keep the choices for the recipe's runs, and say what was measured and where it is kept.
    `hosts`: the runs' --hosts (in `extra`), named where the choice is kept."""
    np_, tables = max(nps), []
    for strategy in strategies:
        launcher = launchers[0] if strategy == "horovod" else None
        over = f" over {launcher}" if launcher else ""
        across = f" across {hosts}" if hosts else ""
        where = f"at np={np_}{over}{across} on {time.strftime('%Y-%m-%d')}"
        rates, autotune = tune(
            strategy, recipe, np_, launcher, steps, epochs, batch_size, out_dir, repeats, extra
        )
        tuning.record(tunable_of(strategy), recipe, rates, where, autotune, path)
        tables.append(render_tuning(strategy, recipe, rates, autotune, where))
    return "\n".join(tables) + f"\nkept for `hvdtrain run {recipe}` in {path}"

"""`hvdtrain bench`: a recipe under several strategies, launchers and world sizes, measured side by side
in one run (the machines are shared and noisy, so nothing here is a pass/fail timing). The project's
own benchmark suite, `make bench`, is benchmarks/ in the repository, not part of the package."""

from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from hvdtrain.launchers.measurements import LAUNCHER_MEASUREMENTS, record_measurements


class BenchError(RuntimeError):
    def __init__(self, message: str, returncode: int | None = None) -> None:
        super().__init__(message)
        self.returncode = returncode
        """hvdtrain's exit code: 2 is bad input and 128+N a stop, neither worth a second try."""


def checked_run(
    argv: list[str], timeout: float = 900, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """A run that must succeed: one that fails is a BenchError carrying its exit code and output's tail."""
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=env
    )
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-25:])
        raise BenchError(
            f"benchmark run failed ({done.returncode}): {' '.join(argv)}\n{tail}", done.returncode
        )
    return done


def hvdtrain_run(
    target: str,
    *args: str,
    run_dir: Path,
    script_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Path:
    """One `hvdtrain run`; env, where given, is its whole environment (the ranks get its variables)."""
    argv = [sys.executable, "-m", "hvdtrain", "run", target, "--run-dir", str(run_dir), *args]
    checked_run(argv + (["--", *script_args] if script_args else []), env=env)
    return run_dir


def recipe_samples_per_sec(
    recipe: str,
    strategy: str,
    np_: int,
    launcher: str | None,
    steps: int,
    epochs: int,
    run_dir: Path,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> float:
    """Steady-state samples/s (the first epoch left out) of one `hvdtrain run`; launcher is for the
    horovod strategy (the others start their own processes)."""
    hvdtrain_run(
        recipe,
        "--strategy",
        strategy,
        "--np",
        str(np_),
        *(["--launcher", launcher] if launcher else []),
        "--set",
        f"steps_per_epoch={steps}",
        "--set",
        f"epochs={epochs}",
        *extra,
        run_dir=run_dir,
        env=env,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    return float(summary["steady_samples_per_sec"])


@dataclass
class Row:
    recipe: str
    strategy: str
    launcher: str
    np: int
    samples_per_sec: float
    ms_per_step: float
    scaling_efficiency: float | None = None
    ratio_to_horovod: float | None = None


def retried_once(measure) -> float:
    """measure(attempt): a run that fails is reported and run once more; a second failure is fatal."""
    try:
        return measure(0)
    except BenchError as error:
        if error.returncode == 2 or (error.returncode or 0) >= 128:
            raise
        print(f"bench: a run failed and is run once more: {str(error).splitlines()[0]}", file=sys.stderr)
        return measure(1)


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{option}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{option}: expected integers >= 1, got {text!r}")
    return values


def check(
    recipe_name: str,
    strategy_names: str,
    nps: str,
    launcher_names: str,
    steps: int,
    epochs: int,
    batch_size: int,
    repeats: int,
):
    """What a comparison runs, from the command's comma-separated lists: the recipe, the strategies,
    the world sizes and the launchers; or a ValueError naming what is wrong."""
    from hvdtrain import launchers, registry, strategies

    recipe = registry.get(recipe_name)
    chosen = [strategies.get(name.strip(), recipe.framework).name for name in strategy_names.split(",")]
    launcher_list = [name.strip() for name in launcher_names.split(",") if name.strip()]
    if unknown := sorted(set(launcher_list) - set(launchers.names())) or not launcher_list:
        raise ValueError(f"--launchers: unknown {unknown}; choose from {', '.join(launchers.names())}")
    world_sizes = _int_list(nps, "--np")
    if min(steps, epochs, batch_size, repeats) < 1 or epochs < 2:
        raise ValueError("--steps, --batch-size and --repeats must be >= 1 and --epochs >= 2")
    return recipe, chosen, world_sizes, launcher_list


OWN_KNOBS = {"batch_size": "--batch-size", "steps_per_epoch": "--steps", "epochs": "--epochs"}
"""Config fields bench sets from its own options."""


def run_options(
    recipe, variant: str | None, overrides: tuple[str, ...], hosts: str | None = None
) -> tuple[str, ...]:
    """`hvdtrain run`'s --variant, --set and --hosts for every benchmark run, checked first (a
    ValueError naming what is wrong), as `hvdtrain run` checks them."""
    from hvdtrain import config as config_module
    from hvdtrain.launching.spec import parse_hosts

    parsed = config_module.parse_overrides(recipe.config, overrides)
    if own := sorted(set(parsed) & set(OWN_KNOBS)):
        raise ValueError(f"--set {own[0]}: bench sets it from {OWN_KNOBS[own[0]]}")
    config_module.validate(config_module.apply(recipe.make_config(variant), parsed))
    if hosts is not None:
        parse_hosts(hosts)
    return (
        *(("--variant", variant) if variant else ()),
        *(a for pair in overrides for a in ("--set", pair)),
        *(("--hosts", hosts) if hosts is not None else ()),
    )


def matrix(
    recipe: str,
    strategies: list[str],
    nps: list[int],
    launchers: list[str],
    steps: int,
    epochs: int,
    batch_size: int,
    out_dir: Path,
    repeats: int = 1,
    extra: tuple[str, ...] = (),
) -> list[Row]:
    """Every (strategy, launcher, np), interleaved `repeats` times so drift hits all alike; the median.
    Horovod runs once per launcher; the other strategies start their own processes. `extra`: more
    `hvdtrain run` options for every run (--variant, --set)."""
    combos = [(s, launcher) for s in strategies for launcher in (launchers if s == "horovod" else ["-"])]
    samples: dict[tuple[str, str, int], list[float]] = {(s, la, n): [] for s, la in combos for n in nps}
    for repeat in range(repeats):
        for strategy, launcher, np_ in samples:

            def measure(attempt: int, strategy=strategy, launcher=launcher, np_=np_, repeat=repeat) -> float:
                return recipe_samples_per_sec(
                    recipe,
                    strategy,
                    np_,
                    None if launcher == "-" else launcher,
                    steps,
                    epochs,
                    out_dir / f"{strategy}-{launcher}-np{np_}-{repeat}{'-retry' if attempt else ''}",
                    (*extra, "--set", f"batch_size={batch_size}", "--threads-per-rank", "1"),
                )

            samples[(strategy, launcher, np_)].append(retried_once(measure))
    rate = {key: statistics.median(values) for key, values in samples.items()}
    rows = []
    for (strategy, launcher, np_), sps in rate.items():
        single = rate.get((strategy, launcher, 1))
        horovod = rate.get(("horovod", launchers[0], np_))
        rows.append(
            Row(
                recipe,
                strategy,
                launcher,
                np_,
                sps,
                1000 * batch_size * np_ / sps,
                sps / (np_ * single) if single else None,
                sps / horovod if horovod else None,
            )
        )
    return rows


def record_launchers(rows: list[Row], framework: str, path: Path = LAUNCHER_MEASUREMENTS) -> dict:
    """Keep the measured Horovod throughput per launcher (at the largest np) for `--launcher auto`."""
    horovod = [row for row in rows if row.strategy == "horovod"]
    if len({row.launcher for row in horovod}) < 2:
        return {}
    top = max(row.np for row in horovod)
    return record_measurements(
        framework, {row.launcher: row.samples_per_sec for row in horovod if row.np == top}, path
    )


def render(rows: list[Row]) -> str:
    header = (
        f"{'recipe':<16} {'strategy':<8} {'launcher':<8} {'np':>3} {'samples/s':>10} {'ms/step':>8} "
        f"{'scaling':>8} {'vs horovod':>10}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        scaling = f"{row.scaling_efficiency:.2f}" if row.scaling_efficiency is not None else "-"
        ratio = f"{row.ratio_to_horovod:.2f}" if row.ratio_to_horovod is not None else "-"
        lines.append(
            f"{row.recipe:<16} {row.strategy:<8} {row.launcher:<8} {row.np:>3} "
            f"{row.samples_per_sec:>10.1f} {row.ms_per_step:>8.1f} {scaling:>8} {ratio:>10}"
        )
    return "\n".join(lines)


def write_csv(rows: list[Row], path: Path) -> None:
    with path.open("w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for strategy, launcher in dict.fromkeys((row.strategy, row.launcher) for row in rows):
        mine = sorted(
            (r for r in rows if (r.strategy, r.launcher) == (strategy, launcher)), key=lambda r: r.np
        )
        label = strategy if launcher == "-" else f"{strategy} ({launcher})"
        axes.plot([r.np for r in mine], [r.samples_per_sec for r in mine], marker="o", label=label)
    axes.set_xlabel("processes (np)")
    axes.set_ylabel("samples / s")
    axes.set_title(f"{rows[0].recipe}: throughput by strategy")
    axes.set_xticks(sorted({row.np for row in rows}))
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)

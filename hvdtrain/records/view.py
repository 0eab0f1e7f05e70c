"""What `hvdtrain runs` and `hvdtrain show` print and draw, from the RunFacts hvdtrain.records.runs read:
pure functions of those facts, but for writing curves.png."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from hvdtrain.launching.console import human
from hvdtrain.records.runs import NAME_STAMP, RunFacts, parse_time, run_status
from hvdtrain.runtime import divergence
from hvdtrain.runtime.common import commit_file, tmp_path_for

CURVES = "curves.png"
TEST_PANEL = ("test_accuracy", "Test accuracy", "accuracy")
"""The second panel where a run recorded no test metric; else its first test_<name>."""


def panels(epochs: tuple[dict[str, Any], ...]) -> tuple[tuple[str, str, str], ...]:
    """The panels of curves.png: the epoch record's key, the panel's title, its y label. The second
    shows the run's first test metric (a recipe's first declared one)."""
    tested = first_test_metric(epochs[-1] if epochs else {})
    test = TEST_PANEL if tested is None else (tested, f"Test {tested[5:]}", tested[5:])
    return (
        ("loss", "Training loss", "loss"),
        test,
        ("lr", "Learning rate", "learning rate"),
        ("samples_per_sec", "Throughput (samples/s)", "samples / s"),
    )


def first_test_metric(values: dict[str, Any]) -> str | None:
    """The first test_<name> key of a summary or an epoch record: the recipe's first metric."""
    return next((key for key in values if key.startswith("test_")), None)


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class RunRow:
    name: str
    recipe: str
    strategy: str
    world_size: int | None
    status: str
    test: tuple[str, float] | None
    """The run's first test metric, by name (test_ left off)."""
    final_loss: float | None
    started: datetime | None
    slurm: str | None = None
    """The run's Slurm job and its state (Slurm's now, else as last recorded), None outside Slurm."""


def run_started(facts: RunFacts) -> datetime | None:
    """When the run began: its record's first start, else the time in a default run directory's
    name, else when its config.json was written."""
    record = facts.record or {}
    if moment := parse_time(record.get("first_started")) or parse_time(record.get("started")):
        return moment
    if stamp := NAME_STAMP.search(facts.path.name):
        return datetime.strptime(stamp.group(1), "%Y%m%d-%H%M%S").astimezone()
    return datetime.fromtimestamp(facts.mtime).astimezone() if facts.mtime is not None else None


def run_row(facts: RunFacts) -> RunRow:
    """One line of `hvdtrain runs`. The first test metric and the loss come from summary.json for a
    finished run and from the last epoch recorded otherwise (where a run that stopped got to)."""
    record, summary = facts.record or {}, facts.summary or {}
    status = run_status(facts.record, facts.summary is not None, facts.pid_alive)
    last = facts.epochs[-1] if facts.epochs else {}

    def value(summary_key: str, epoch_key: str) -> float | None:
        from_summary, from_epoch = _number(summary.get(summary_key)), _number(last.get(epoch_key))
        first, second = (from_summary, from_epoch) if status == "finished" else (from_epoch, from_summary)
        return first if first is not None else second

    name = first_test_metric(summary) or first_test_metric(last)
    tested = None if name is None else value(name, name)
    world_size = summary.get("world_size", last.get("world_size"))
    recipe = record.get("recipe") or summary.get("recipe") or ("(script)" if record else "-")
    return RunRow(
        name=f"{facts.sweep}/{facts.path.name}" if facts.sweep else facts.path.name,
        recipe=str(recipe),
        strategy=str(record.get("strategy") or summary.get("strategy") or "-"),
        world_size=world_size if isinstance(world_size, int) else None,
        status=status,
        test=None if tested is None else (name[5:], tested),
        final_loss=value("final_loss", "loss"),
        started=run_started(facts),
        slurm=slurm_cell(facts),
    )


def row_record(facts: RunFacts) -> dict[str, Any]:
    """`hvdtrain runs --json`: one run's row as a JSON object, with its path and the test metric named."""
    row = run_row(facts)
    return {
        "path": str(facts.path),
        "name": row.name,
        "recipe": row.recipe,
        "strategy": row.strategy,
        "world_size": row.world_size,
        "status": row.status,
        "test_metric": None if row.test is None else f"test_{row.test[0]}",
        "test_value": None if row.test is None else row.test[1],
        "final_loss": row.final_loss,
        "started": None if row.started is None else row.started.isoformat(),
        "slurm": row.slurm,
    } | ({"sweep": facts.sweep} if facts.sweep else {})  # a trial of hvdtrain sweep: its sweep's name


def show_record(facts: RunFacts) -> dict[str, Any]:
    """`hvdtrain show --json`: what a run directory holds, as read."""
    return {
        **row_record(facts),
        "record": facts.record,
        "summary": facts.summary,
        "config": facts.config,
        "epochs": list(facts.epochs),
    }


def slurm_cell(facts: RunFacts) -> str | None:
    """`41 RUNNING`: the job and its state, Slurm's own where it still knows the job."""
    record = facts.record or {}
    if "slurm_job_id" not in record:
        return None
    state = facts.slurm_state or record.get("slurm_state") or "-"
    restarts = record.get("slurm_restart_count")
    requeued = f" (requeued {restarts}x)" if isinstance(restarts, int) and restarts > 0 else ""
    return f"{record['slurm_job_id']} {state}{requeued}"


def _when(moment: datetime | None) -> str:
    return moment.astimezone().strftime("%Y-%m-%d %H:%M") if moment else "-"


ROW_HEADER = ("RECIPE", "STRATEGY", "NP", "STATUS", "TEST", "LOSS", "STARTED", "RUN")


def _test_cell(test: tuple[str, float] | None) -> str:
    return "-" if test is None else f"{test[0]} {human(test[1])}"


def render_rows(rows: list[RunRow]) -> str:
    """The table of `hvdtrain runs`, oldest first (the newest is next to the prompt)."""
    ordered = sorted(rows, key=lambda row: (row.started is None, row.started or 0, row.name))
    slurm = any(row.slurm for row in rows)  # a column only where some run was a Slurm job
    header = (*ROW_HEADER[:4], *(("SLURM",) if slurm else ()), *ROW_HEADER[4:])
    cells = [header] + [
        (
            row.recipe,
            row.strategy,
            human(row.world_size),
            row.status,
            *((row.slurm or "-",) if slurm else ()),
            _test_cell(row.test),
            human(row.final_loss),
            _when(row.started),
            row.name,
        )
        for row in ordered
    ]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    right = {
        2,
        4 + slurm,
        5 + slurm,
    }  # numbers (and a test metric's value, at the end of its cell) line up on the right
    return "\n".join(
        "  ".join(
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in cells
    )


def _shown(key: str, value: object) -> str:
    if key == "parameter_digest" and isinstance(value, str):
        return value[:16] + "..."
    if isinstance(value, list):
        counts = Counter(map(str, value))
        return ", ".join(f"{item} x{count}" if count > 1 else item for item, count in counts.items())
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return human(value)


def _exact(key: str, value: object) -> str:
    """A config value as --set takes it: 0.05 stays 0.05, 1e-05 is 0.00001, True is true, 1000 is 1000."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.12f}".rstrip("0").rstrip(".")
    return '""' if value == "" else _shown(key, value)


def _listing(values: dict[str, Any], indent: str = "  ", shown=_shown) -> list[str]:
    width = max((len(key) for key in values), default=0)
    return [f"{indent}{key:<{width}}  {shown(key, value)}" for key, value in values.items()]


def show_lines(facts: RunFacts) -> list[str]:
    """What `hvdtrain show` prints: the run, its summary and its config, as aligned listings."""
    record = facts.record or {}
    row = run_row(facts)
    status = row.status
    if "signal" in record:
        status += f" (by {record['signal']}, exit code {record.get('exit_code')})"
    elif row.status in ("failed", "diverged") and "exit_code" in record:
        own = record.get("rank_exit_code")
        rank = ""
        if isinstance(own, int):
            rank = f"; a rank's {own}" if own >= 0 else f"; a rank killed by signal {-own}"
        status += f" (exit code {record['exit_code']}{rank})"
    if row.status == "diverged" and isinstance(record.get("diverged"), dict):
        status += ": " + divergence.describe(record["diverged"]).removeprefix("diverged: ")
    elif record.get("status") == "running" and row.status == "interrupted":
        status += f" (hvdtrain, pid {record.get('pid')}, ended without closing the record)"
    run = {
        "run": str(facts.path),
        "status": status,
        "recipe": row.recipe,
        "framework": record.get("framework", "-"),
        "strategy": row.strategy,
        "world size": row.world_size,
        "started": _when(row.started),
        "ended": _when(parse_time(record.get("ended"))),
        "host": f"{record['host']} (pid {record.get('pid')})" if "host" in record else "-",
        "epochs recorded": len(facts.epochs),
        **{f"test {key[5:]}": value for key, value in _tested(facts).items()},
        "final loss": row.final_loss,
    }
    if row.slurm:
        run["slurm job"] = row.slurm
    if isinstance(tracked := record.get("mlflow"), dict):
        run["mlflow"] = f"run {tracked.get('run_id')} at {tracked.get('uri')}"
    lines = _listing(run, indent="")
    if facts.summary is not None:
        lines += ["", "summary (summary.json)", *_listing(facts.summary)]
    if facts.config is not None:
        lines += ["", "config (config.json)", *_listing(facts.config, shown=_exact)]
    return lines


def _tested(facts: RunFacts) -> dict[str, Any]:
    """Every test metric of the run: the summary's, else the last epoch's."""
    source = facts.summary or (facts.epochs[-1] if facts.epochs else {})
    found = {key: value for key, value in source.items() if key.startswith("test_")}
    return found or {"test_accuracy": None}


def curves_figure(epochs: tuple[dict[str, Any], ...], title: str):
    """The four panels of curves.png (`panels`), per epoch, on a matplotlib Figure drawn by the Agg canvas
    (no display, no pyplot state). A metric never recorded (ps has no lr) says so in its panel."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    figure = Figure(figsize=(10, 7), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, 2).flatten()
    xs = [record["epoch"] for record in epochs]
    for ax, (key, panel_title, label) in zip(axes, panels(epochs), strict=True):
        ys = [_number(record.get(key)) for record in epochs]
        if any(y is not None for y in ys):
            ax.plot(xs, [math.nan if y is None else y for y in ys], marker="o" if len(xs) <= 40 else None)
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(panel_title)
        ax.set_xlabel("epoch")
        ax.set_ylabel(label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        plain = ScalarFormatter(useOffset=False)
        plain.set_scientific(False)
        ax.yaxis.set_major_formatter(plain)
        ax.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def write_curves(figure, path: Path) -> None:
    """Write the figure as a PNG atomically: a reader sees the old file or the whole new one."""
    tmp = tmp_path_for(path)
    try:
        figure.savefig(tmp, format="png")
        commit_file(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def plotting_missing() -> str | None:
    """Why no figure can be drawn here (matplotlib, an extra, is not installed); None: it can."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed (pip install 'hvdtrain[plot]')"
    return None


def draw_curves(facts: RunFacts) -> Path:
    """RUN_DIR/curves.png of a run with epoch records (`hvdtrain show` and the MLflow artifact)."""
    path = facts.path / CURVES
    write_curves(curves_figure(facts.epochs, curves_title(facts)), path)
    return path


def curves_title(facts: RunFacts) -> str:
    row = run_row(facts)
    return f"{row.name}: {row.recipe}, {row.strategy}, np {human(row.world_size)} ({row.status})"

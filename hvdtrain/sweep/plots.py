"""`hvdtrain show SWEEP_DIR`: the sweep's trial table and best trial (from sweep.json), and its
study drawn as PNGs beside it with Optuna's matplotlib figures: the optimisation history, the
parallel coordinates of the params, and the params' importances."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hvdtrain.sweep import space

FIGURES = (
    ("optimization_history.png", "plot_optimization_history"),
    ("parallel_coordinates.png", "plot_parallel_coordinate"),
    ("param_importances.png", "plot_param_importances"),
)


def read_record(sweep_dir: Path) -> dict[str, Any]:
    """sweep.json, or a ValueError saying what is wrong with it."""
    path = sweep_dir / space.SWEEP_RECORD
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{sweep_dir} is not a sweep directory (no {space.SWEEP_RECORD})") from None
    except (OSError, ValueError):
        raise ValueError(f"{path} is damaged (not valid JSON)") from None
    if not isinstance(record, dict) or not isinstance(record.get("trials"), list):
        raise ValueError(f"{path} is damaged (no trials)")
    return record


def rows_of(record: dict[str, Any]) -> list[space.TrialRow]:
    return [
        space.TrialRow(
            trial["number"], trial["state"], trial["params"], trial.get("value"), trial.get("epochs", 0),
            trial.get("run_dir", ""), trial.get("reason", ""),
        )
        for trial in record["trials"]
    ]  # fmt: skip


def show_lines(record: dict[str, Any]) -> list[str]:
    params = ", ".join(record.get("params", []))
    lines = [
        f"sweep: {record.get('recipe')} over {params}; {record.get('direction')} {record.get('metric')}",
        f"sampler {record.get('sampler')}, pruner {record.get('pruner')}, seed {record.get('seed')}, "
        f"budget {record.get('budget')} trials; study {record.get('storage')}",
        "",
        *space.table_lines(rows_of(record), str(record.get("metric"))),
        "",
    ]
    best = record.get("best")
    if best is None:
        return [*lines, "best: none (no trial completed)"]
    return [
        *lines,
        f"best: trial {best['number']}  {record.get('metric')}={space.shown_value(best.get('value'))}  "
        f"{space.params_cell(best.get('params', {}))}",
        f"  run dir: {best.get('run_dir')}",
        f"  again:   {best.get('command')}",
    ]


def draw(sweep_dir: Path, record: dict[str, Any]) -> tuple[list[Path], list[str]]:
    """The figures written, and a line for each that could not be (too few trials, no Optuna)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import optuna
        from optuna.visualization import matplotlib as figures
    except ImportError as error:
        return [], [f"not drawn: {error.name} is not installed; pip install 'hvdtrain[sweep]'"]
    import warnings

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    storage = record.get("storage") or str(sweep_dir / space.JOURNAL)
    if storage.endswith(space.JOURNAL):
        journal = sweep_dir / space.JOURNAL
        if not journal.is_file():  # opening it would make an empty one: show changes nothing here
            return [], [f"not drawn: the study's {journal} is not there"]
        from optuna.storages.journal import JournalFileBackend

        storage = optuna.storages.JournalStorage(JournalFileBackend(str(journal)))
    try:
        study = optuna.load_study(study_name=record.get("study") or sweep_dir.name, storage=storage)
    except Exception as error:  # a storage that does not answer, a study not in it
        return [], [f"not drawn: cannot read the study: {' '.join(str(error).split())[:200]}"]
    written, problems = [], []
    for name, function in FIGURES:
        try:
            with warnings.catch_warnings():  # Optuna's "experimental" notes
                warnings.simplefilter("ignore")
                axes = getattr(figures, function)(study)
            figure = getattr(axes, "figure", None) or axes.flat[0].figure
            figure.set_size_inches(9, 5.5)
            figure.tight_layout()
            figure.savefig(sweep_dir / name, dpi=100)
            plt.close(figure)
            written.append(sweep_dir / name)
        except Exception as error:  # too few completed trials for it, a param of one value, ...
            problems.append(
                f"{name} not drawn: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
            )
    return written, problems

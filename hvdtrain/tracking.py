"""Experiment tracking in MLflow, done by the launching process from the run directory, after the job:
the config as params, metrics.jsonl as metrics (epoch records at their epoch, step records as
`step/<name>` at their step), summary.json and curves.png as artifacts. Rank 0 never talks to the
store: on several hosts or under a scheduler it may have no route to it, while the host that launched
the job had one when it was checked, before any rank started.

A resumed run logs into the same MLflow run, only the records it has not logged yet (run.json keeps
the MLflow run id and how many metric lines went there).
"""

from __future__ import annotations

import json
import logging
import math
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ENV = "MLFLOW_TRACKING_URI"
SCHEMES = ("http", "https", "file", "sqlite", "postgresql", "mysql", "mssql", "databricks")
RECORD_KEY = "mlflow"
"""run.json's entry: {"uri", "run_id", "experiment_id", "logged_lines"}."""


def check_uri(uri: str) -> str:
    """The tracking URI as given, or a ValueError saying what is malformed (pure: nothing is reached)."""
    parts = urlsplit(uri)
    if not parts.scheme:
        if uri.startswith(("/", "./", "../")):
            return uri  # a local folder, MLflow's file store
        raise ValueError(
            f"--mlflow {uri!r}: not a tracking URI; give http://HOST:PORT, sqlite:///PATH.db or a folder"
        )
    if parts.scheme not in SCHEMES:
        raise ValueError(f"--mlflow {uri!r}: unknown scheme {parts.scheme}; one of {', '.join(SCHEMES)}")
    if parts.scheme in ("http", "https") and not parts.hostname:
        raise ValueError(f"--mlflow {uri!r}: no host; give {parts.scheme}://HOST:PORT")
    if parts.scheme in ("http", "https"):
        try:
            parts.port  # noqa: B018 (raises on a port that is no number)
        except ValueError:
            raise ValueError(f"--mlflow {uri!r}: the port is not a number") from None
    if parts.scheme in ("sqlite", "file") and (parts.netloc or not parts.path):
        raise ValueError(f"--mlflow {uri!r}: give {parts.scheme}:///ABSOLUTE/PATH (three slashes)")
    return uri


def check_reachable(uri: str, timeout: float = 5.0) -> None:
    """Before any rank starts: a server answers MLflow's /health, a store's folder exists. A ValueError
    says what is wrong."""
    parts = urlsplit(uri)
    if parts.scheme in ("http", "https"):
        health = f"{uri.rstrip('/')}/health"
        try:
            with urllib.request.urlopen(health, timeout=timeout) as answer:  # noqa: S310 (http(s) only)
                status = answer.status
        except urllib.error.HTTPError as error:
            status = error.code
        except (OSError, ValueError) as error:
            reason = getattr(error, "reason", error)
            raise ValueError(f"--mlflow {uri}: the tracking server does not answer ({reason})") from None
        if status != 200:
            raise ValueError(f"--mlflow {uri}: {health} answered HTTP {status}; is it an MLflow server?")
        return
    if parts.scheme in ("sqlite", "file") or not parts.scheme:
        path = Path(parts.path if parts.scheme else uri)
        folder = path.parent if parts.scheme == "sqlite" else path if path.exists() else path.parent
        if not folder.is_dir():
            raise ValueError(f"--mlflow {uri}: {folder} is not a folder")


def _params(config: dict[str, Any]) -> dict[str, str]:
    return {key: value if isinstance(value, str) else json.dumps(value) for key, value in config.items()}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def metrics_of(line: dict[str, Any]) -> list[tuple[str, float, int]]:
    """(key, value, step) of one metrics.jsonl record: an epoch's numbers at its epoch, a step's at
    its step under `step/`; what is not a finite number (a metric not measured) is left out."""
    if "epoch" in line:
        at, prefix, skip = int(line["epoch"]), "", {"epoch"}
    elif "step" in line:
        at, prefix, skip = int(line["step"]), "step/", {"step"}
    else:
        return []
    found = []
    for key, value in line.items():
        if key not in skip and (number := _number(value)) is not None:
            found.append((f"{prefix}{key}", number, at))
    return found


def log_run(uri: str, run_dir: Path, record: dict[str, Any], status: str) -> dict[str, Any]:
    """Log what the run directory holds that MLflow does not have yet; returns run.json's new
    `mlflow` entry. `record` is run.json (its recipe and strategy become tags, its `mlflow` entry says
    which MLflow run a resume continues)."""
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    for name in ("mlflow", "alembic"):  # a new store's table set-up, line by line: not the user's news
        logging.getLogger(name).setLevel(logging.WARNING)
    client = MlflowClient(tracking_uri=uri)
    before = record.get(RECORD_KEY) if (record.get(RECORD_KEY) or {}).get("uri") == uri else None
    if before:
        run_id, experiment_id, logged = before["run_id"], before["experiment_id"], before["logged_lines"]
        have = client.get_run(run_id).data.params
        client.update_run(run_id, status="RUNNING")
    else:
        name = record.get("recipe") or "hvdtrain"
        found = client.get_experiment_by_name(name)
        experiment_id = found.experiment_id if found else client.create_experiment(name)
        tags = {
            f"hvdtrain.{key}": str(record[key])
            for key in ("recipe", "strategy", "framework")
            if key in record
        }
        run_id = client.create_run(experiment_id, run_name=run_dir.name, tags=tags).info.run_id
        logged, have = 0, {}
    config = _read_json(run_dir / "config.json") or {}
    params = [Param(key, value) for key, value in _params(config).items() if key not in have]
    # MLflow's params cannot change: what a resume set anew (more epochs, say) becomes a tag
    tags = [RunTag(f"hvdtrain.resumed.{k}", v) for k, v in _params(config).items() if have.get(k, v) != v]
    lines = _metric_lines(run_dir)
    now = int(time.time() * 1000)
    metrics = [
        Metric(key, value, now, step) for line in lines[logged:] for key, value, step in metrics_of(line)
    ]
    tags.append(RunTag("hvdtrain.run_dir", str(run_dir.absolute())))
    client.log_batch(run_id, params=params[:100], tags=tags)
    for start in range(100, len(params), 100):  # MLflow takes at most 100 params a batch
        client.log_batch(run_id, params=params[start : start + 100])
    for start in range(0, len(metrics), 1000):  # and 1000 metrics
        client.log_batch(run_id, metrics=metrics[start : start + 1000])
    _draw_curves(run_dir)
    for name in ("summary.json", "curves.png", "config.json"):
        if (run_dir / name).is_file():
            client.log_artifact(run_id, str(run_dir / name))
    client.set_terminated(
        run_id, status={"finished": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED")
    )
    return {"uri": uri, "run_id": run_id, "experiment_id": experiment_id, "logged_lines": len(lines)}


def _draw_curves(run_dir: Path) -> None:
    """curves.png, as `hvdtrain show` draws it, for the artifacts."""
    import socket

    from hvdtrain import runs, runs_view

    facts = runs.read_run(run_dir, socket.gethostname())
    if facts.epochs:
        runs_view.write_curves(
            runs_view.curves_figure(facts.epochs, runs_view.curves_title(facts)), run_dir / runs_view.CURVES
        )


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _metric_lines(run_dir: Path) -> list[dict[str, Any]]:
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except OSError:
        return []
    lines = []
    for raw in text.splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue  # a line a killed rank 0 left half-written
        if isinstance(line, dict):
            lines.append(line)
    return lines

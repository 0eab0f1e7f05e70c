"""Experiment tracking in MLflow, done by the launching process from the run directory, after the job:
the config as params, metrics.jsonl as metrics (epoch records at their epoch, step records as
`step/<name>` at their step), summary.json and curves.png as artifacts. Rank 0 never talks to the
store: on several hosts or under a scheduler it may have no route to it, while the host that launched
the job had one when it was checked, before any rank started.

A resumed run logs into the same MLflow run, only the records it has not logged yet (run.json keeps
the MLflow run id and how many metric lines went there).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hvdtrain.runtime.common import read_json_object

ENV = "MLFLOW_TRACKING_URI"
SCHEMES = ("http", "https", "file", "sqlite", "postgresql", "mysql", "mssql", "databricks")
RECORD_KEY = "mlflow"
"""run.json's entry: {"uri", "run_id", "experiment_id", "logged_lines"}."""


def check_uri(uri: str, given_as: str = "--mlflow") -> str:
    """The tracking URI as given, or a ValueError naming what is malformed and where it came from
    (`given_as`: the flag or the variable); pure, nothing is reached. A URI without a scheme is a
    folder, MLflow's file store ('databricks' alone is Databricks' workspace)."""
    try:
        parts = urlsplit(uri)
        port_problem = None
        try:
            parts.port  # noqa: B018 (raises on a port that is no number, or out of range)
        except ValueError as error:
            port_problem = str(error)
    except ValueError as error:
        raise ValueError(f"{given_as} {uri!r}: {error}") from None
    scheme = parts.scheme.split("+")[0]  # dialect+driver, as SQLAlchemy writes it
    if not uri.strip():
        raise ValueError(f"{given_as} is empty; give http://HOST:PORT, sqlite:///PATH.db or a folder")
    if not parts.scheme:
        return uri
    if scheme not in SCHEMES:
        raise ValueError(f"{given_as} {uri!r}: unknown scheme {parts.scheme}; one of {', '.join(SCHEMES)}")
    if scheme in ("http", "https") and not parts.hostname:
        raise ValueError(f"{given_as} {uri!r}: no host; give {scheme}://HOST:PORT")
    if port_problem:
        raise ValueError(f"{given_as} {uri!r}: {port_problem}")
    if scheme in ("sqlite", "file") and (parts.netloc or not parts.path.strip("/")):
        raise ValueError(
            f"{given_as} {uri!r}: give {scheme}:///PATH (relative) or {scheme}:////ABSOLUTE/PATH"
            if scheme == "sqlite"
            else f"{given_as} {uri!r}: give file:///ABSOLUTE/PATH"
        )
    return uri


def store_path(uri: str) -> Path | None:
    """The file or folder a local store lives at: sqlite:///rel.db is relative (SQLAlchemy's rule,
    sqlite:////abs.db absolute), file:///abs is absolute, a URI without a scheme is a folder."""
    parts = urlsplit(uri)
    if parts.scheme.split("+")[0] == "sqlite":
        return Path(parts.path[1:])
    if parts.scheme == "file":
        return Path(parts.path)
    return None if parts.scheme or uri == "databricks" else Path(uri)


def check_reachable(uri: str, timeout: float = 5.0) -> None:
    """Before any rank starts: a server answers MLflow's /health (or asks for credentials, which
    MLflow's client will send), a local store's folder exists. A ValueError says what is wrong."""
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
            raise ValueError(f"MLflow at {uri}: the tracking server does not answer ({reason})") from None
        if status not in (200, 401, 403):
            raise ValueError(f"MLflow at {uri}: {health} answered HTTP {status}; is it an MLflow server?")
        return
    path = store_path(uri)
    if path is not None:
        folder = path.parent if parts.scheme.startswith("sqlite") or not path.exists() else path
        if not folder.is_dir():
            raise ValueError(f"MLflow at {uri}: {folder} is not a folder")


def artifacts_of(uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: beside a sqlite file (MLflow's own default is
    ./mlruns in whatever folder the client runs in); a server or a file store chooses its own."""
    parts = urlsplit(uri)
    if parts.scheme.split("+")[0] != "sqlite":
        return None
    return (store_path(uri).absolute().parent / "mlartifacts").as_uri()


class LoggingFailed(Exception):
    """Logging stopped part way: `entry` is run.json's entry for the MLflow run it had made, so that a
    resume goes on in that run rather than making another."""

    def __init__(self, cause: Exception, entry: dict[str, Any]) -> None:
        super().__init__(str(cause))
        self.entry = entry


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
    from mlflow.tracking import MlflowClient

    for name in ("mlflow", "alembic"):  # a new store's table set-up, line by line: not the user's news
        logging.getLogger(name).setLevel(logging.WARNING)
    client = MlflowClient(tracking_uri=uri)
    previous = record.get(RECORD_KEY)
    before = previous if isinstance(previous, dict) and previous.get("uri") == uri else None
    if before:
        run_id, experiment_id, logged = before["run_id"], before["experiment_id"], before["logged_lines"]
        have = client.get_run(run_id).data.params
        client.update_run(run_id, status="RUNNING")
    else:
        name = record.get("recipe") or "hvdtrain"
        found = client.get_experiment_by_name(name)
        experiment_id = found.experiment_id if found else client.create_experiment(name, artifacts_of(uri))
        tags = {
            f"hvdtrain.{key}": str(record[key])
            for key in ("recipe", "strategy", "framework")
            if key in record
        }
        run_id = client.create_run(experiment_id, run_name=run_dir.name, tags=tags).info.run_id
        logged, have = 0, {}
    entry = {"uri": uri, "run_id": run_id, "experiment_id": experiment_id, "logged_lines": logged}
    try:
        return _log(client, run_dir, entry, have, status)
    except Exception as error:
        with contextlib.suppress(Exception):
            client.set_terminated(run_id, status="FAILED")
        raise LoggingFailed(error, entry) from error


def _log(client, run_dir: Path, entry: dict[str, Any], have: dict[str, str], status: str) -> dict[str, Any]:
    import socket

    from mlflow.entities import Metric, Param, RunTag

    from hvdtrain.records import runs
    from hvdtrain.records import view as runs_view

    run_id, logged = entry["run_id"], entry["logged_lines"]
    config = read_json_object(run_dir / "config.json") or {}
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
    facts = runs.read_run(run_dir, socket.gethostname())
    if facts.epochs and not runs_view.plotting_missing():
        runs_view.draw_curves(facts)
    for name in ("summary.json", "curves.png", "config.json"):
        if (run_dir / name).is_file():
            client.log_artifact(run_id, str(run_dir / name))
    client.set_terminated(
        run_id, status={"finished": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED")
    )
    return {**entry, "logged_lines": len(lines)}


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

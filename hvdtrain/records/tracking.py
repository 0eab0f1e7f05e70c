"""Experiment tracking in MLflow, done by the launching process from the run directory: the config as
params as the ranks start, metrics.jsonl as metrics while the job runs (LiveLogging: epoch records at
their epoch, step records as `step/<name>` at their step, each at the time rank 0 wrote it), and once
it has ended whatever is still missing, summary.json and curves.png as artifacts, and the run's status
(log_run). Rank 0 never talks to the store: on several hosts or under a scheduler it may have no route
to it, while the host that launched the job had one when it was checked, before any rank started.

A resumed run logs into the same MLflow run, only the records it has not logged yet (run.json keeps
the MLflow run id and how many metric lines went there).

A sweep is an MLflow run too, the parent of its trials' runs (hvdtrain.sweep.parent_run): each
trial's `hvdtrain run` finds the parent's id in its environment (PARENT_ENV) and makes its own run a
child of it, MLflow's tag mlflow.parentRunId.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hvdtrain.runtime.common import read_json_object

ENV = "MLFLOW_TRACKING_URI"
SCHEMES = ("http", "https", "file", "sqlite", "postgresql", "mysql", "mssql", "databricks")
RECORD_KEY = "mlflow"
"""run.json's entry: {"uri", "run_id", "experiment_id", "logged_lines"}."""
STATUS = {"finished": "FINISHED", "interrupted": "KILLED", "preempted": "KILLED"}
"""The MLflow run's status as the job ended (the rest, failed and diverged, are FAILED). A preempted
run is KILLED, not left RUNNING: nothing tells MLflow when a process is gone, and a run never resumed
would stay RUNNING for good. Its resume sets it RUNNING again; the tag hvdtrain.status says which."""
PARENT_ENV = "HVDTRAIN_MLFLOW_PARENT_RUN_ID"
"""Set by a sweep for its trials: the sweep's MLflow run, which a trial's new MLflow run is a child of."""


def chosen_uri(given: str | None, environ: Mapping[str, str]) -> str | None:
    """Where a run logs: its --mlflow, else MLFLOW_TRACKING_URI; None: nowhere."""
    return given or environ.get(ENV) or None


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


def as_params(config: dict[str, Any]) -> dict[str, str]:
    return {key: value if isinstance(value, str) else json.dumps(value) for key, value in config.items()}


def finite_number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def metrics_of(line: dict[str, Any]) -> list[tuple[str, float, int]]:
    """(key, value, step) of one metrics.jsonl record: an epoch's numbers at its epoch, a step's at
    its step under `step/`; what is not a finite number (a metric not measured) is left out, and so
    is `time`, when rank 0 wrote the record: the points' time (`_millis`)."""
    if "epoch" in line:
        at, prefix, skip = int(line["epoch"]), "", {"epoch", "time"}
    elif "step" in line:
        at, prefix, skip = int(line["step"]), "step/", {"step", "time"}
    else:
        return []
    found = []
    for key, value in line.items():
        if key not in skip and (number := finite_number(value)) is not None:
            found.append((f"{prefix}{key}", number, at))
    return found


def _millis(line: dict[str, Any], otherwise: int) -> int:
    """When rank 0 wrote the record, in MLflow's milliseconds (`otherwise` for an older hvdtrain's
    record, which has none). MLflow's SQL stores keep a point logged twice with one time once."""
    at = finite_number(line.get("time"))
    return otherwise if at is None else int(at * 1000)


def mlflow_client(uri: str):
    from mlflow.tracking import MlflowClient

    for name in ("mlflow", "alembic"):  # a new store's table set-up, line by line: not the user's news
        logging.getLogger(name).setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=uri)


def open_run(client, uri: str, run_dir: Path, record: dict[str, Any]) -> tuple[dict, dict[str, str]]:
    """The MLflow run of this run directory, RUNNING: the one run.json names (a resume's, a
    restart's, the one LiveLogging made), else a new one in the recipe's experiment (a child of the
    sweep's run, in a sweep's trial). Returns run.json's entry for it and the params it already has.
    `record` is run.json: its recipe and strategy become tags."""
    previous = record.get(RECORD_KEY)
    before = previous if isinstance(previous, dict) and previous.get("uri") == uri else None
    if before:
        run_id, experiment_id, logged = before["run_id"], before["experiment_id"], before["logged_lines"]
        have = client.get_run(run_id).data.params
        client.update_run(run_id, status="RUNNING")
    else:
        experiment_id = experiment_of(client, uri, record.get("recipe") or "hvdtrain")
        tags = {f"hvdtrain.{k}": str(record[k]) for k in ("recipe", "strategy", "framework") if k in record}
        tags |= _parent_tag(client, experiment_id, os.environ)
        run_id = client.create_run(experiment_id, run_name=run_dir.name, tags=tags).info.run_id
        logged, have = 0, {}
    return {"uri": uri, "run_id": run_id, "experiment_id": experiment_id, "logged_lines": logged}, have


def experiment_of(client, uri: str, name: str) -> str:
    """The id of the experiment named `name` (a recipe's), made where there is none yet."""
    found = client.get_experiment_by_name(name)
    return found.experiment_id if found else client.create_experiment(name, artifacts_of(uri))


def _parent_tag(client, experiment_id: str, environ: Mapping[str, str]) -> dict[str, str]:
    """MLflow's tag that makes a new run a child of the sweep's run PARENT_ENV names, where that run
    is in this experiment (MLflow shows children under their parent within one) and still there."""
    parent = environ.get(PARENT_ENV)
    with contextlib.suppress(Exception):  # unknown to this store: the trial's run is one of its own
        if parent and client.get_run(parent).info.experiment_id == experiment_id:
            return {"mlflow.parentRunId": parent}
    return {}


def log_config(client, run_id: str, run_dir: Path, have: dict[str, str], tags: dict[str, str]) -> None:
    """config.json as params, those the run does not have yet, with `tags`."""
    from mlflow.entities import Param, RunTag

    config = as_params(read_json_object(run_dir / "config.json") or {})
    params = [Param(key, value) for key, value in config.items() if key not in have]
    # MLflow's params cannot change: what a resume set anew (more epochs, say) becomes a tag
    tags = {**{f"hvdtrain.resumed.{k}": v for k, v in config.items() if have.get(k, v) != v}, **tags}
    tags["hvdtrain.run_dir"] = str(run_dir.absolute())
    client.log_batch(run_id, params=params[:100], tags=[RunTag(k, v) for k, v in tags.items()])
    for start in range(100, len(params), 100):  # MLflow takes at most 100 params a batch
        client.log_batch(run_id, params=params[start : start + 100])


def log_lines(client, run_id: str, lines: list[dict[str, Any]]) -> None:
    """metrics.jsonl records as metric points, each at its record's time."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(k, v, _millis(line, now), at) for line in lines for k, v, at in metrics_of(line)]
    for start in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a batch
        client.log_batch(run_id, metrics=metrics[start : start + 1000])


def log_run(uri: str, run_dir: Path, record: dict[str, Any], status: str) -> dict[str, Any]:
    """Once the job has ended: what the run directory holds that MLflow does not have yet, the
    artifacts and the run's status (STATUS); returns run.json's new `mlflow` entry. `record` is
    run.json (its `mlflow` entry says which MLflow run to go on in, and how much of it is logged)."""
    client = mlflow_client(uri)
    entry, have = open_run(client, uri, run_dir, record)
    try:
        return _log(client, run_dir, entry, have, status)
    except Exception as error:
        with contextlib.suppress(Exception):
            client.set_terminated(entry["run_id"], status="FAILED")
        raise LoggingFailed(error, entry) from error


def _log(client, run_dir: Path, entry: dict[str, Any], have: dict[str, str], status: str) -> dict[str, Any]:
    import socket

    from hvdtrain.records import runs
    from hvdtrain.records import view as runs_view

    run_id = entry["run_id"]
    log_config(client, run_id, run_dir, have, {"hvdtrain.status": status})
    lines = _metric_lines(run_dir)
    log_lines(client, run_id, lines[entry["logged_lines"] :])
    facts = runs.read_run(run_dir, socket.gethostname())
    if facts.epochs and not runs_view.plotting_missing():
        runs_view.draw_curves(facts)
    for name in ("summary.json", "curves.png", "config.json"):
        if (run_dir / name).is_file():
            client.log_artifact(run_id, str(run_dir / name))
    client.set_terminated(run_id, status=STATUS.get(status, "FAILED"))
    return {**entry, "logged_lines": len(lines)}


def parse_lines(text: str) -> list[dict[str, Any]]:
    lines = []
    for raw in text.splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue  # a line a killed rank 0 left half-written
        if isinstance(line, dict):
            lines.append(line)
    return lines


def _metric_lines(run_dir: Path) -> list[dict[str, Any]]:
    try:
        return parse_lines((run_dir / "metrics.jsonl").read_text())
    except OSError:
        return []


def first_line(error: Exception) -> str:
    """An error's first line, for a one-line note."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__

"""Experiment tracking in MLflow, done by the launching process from the run directory: the config as
params as the ranks start, metrics.jsonl as metrics while the job runs (LiveLogging: epoch records at
their epoch, step records as `step/<name>` at their step, each at the time rank 0 wrote it), and once
it has ended whatever is still missing, summary.json and curves.png as artifacts, and the run's status
(log_run). Rank 0 never talks to the store: on several hosts or under a scheduler it may have no route
to it, while the host that launched the job had one when it was checked, before any rank started.

A resumed run logs into the same MLflow run, only the records it has not logged yet (run.json keeps
the MLflow run id and how many metric lines went there).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hvdtrain.runtime.common import RUN_RECORD, atomic_write_bytes, read_json_object

ENV = "MLFLOW_TRACKING_URI"
SCHEMES = ("http", "https", "file", "sqlite", "postgresql", "mysql", "mssql", "databricks")
RECORD_KEY = "mlflow"
"""run.json's entry: {"uri", "run_id", "experiment_id", "logged_lines"}."""
STATUS = {"finished": "FINISHED", "interrupted": "KILLED", "preempted": "KILLED"}
"""The MLflow run's status as the job ended (the rest, failed and diverged, are FAILED). A preempted
run is KILLED, not left RUNNING: nothing tells MLflow when a process is gone, and a run never resumed
would stay RUNNING for good. Its resume sets it RUNNING again; the tag hvdtrain.status says which."""
POLL_S = 1.0
"""How often LiveLogging looks for new lines in metrics.jsonl."""
STOP_WAIT_S = 30.0
"""How long the end of the job waits for LiveLogging's MLflow call in flight (making the run, on a
short job): the end-of-job pass would wait as long on the same store."""


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
        if key not in skip and (number := _number(value)) is not None:
            found.append((f"{prefix}{key}", number, at))
    return found


def _millis(line: dict[str, Any], otherwise: int) -> int:
    """When rank 0 wrote the record, in MLflow's milliseconds (`otherwise` for an older hvdtrain's
    record, which has none). MLflow's SQL stores keep a point logged twice with one time once."""
    at = _number(line.get("time"))
    return otherwise if at is None else int(at * 1000)


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    for name in ("mlflow", "alembic"):  # a new store's table set-up, line by line: not the user's news
        logging.getLogger(name).setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=uri)


def open_run(client, uri: str, run_dir: Path, record: dict[str, Any]) -> tuple[dict, dict[str, str]]:
    """The MLflow run of this run directory, RUNNING: the one run.json names (a resume's, a
    restart's, the one LiveLogging made), else a new one in the recipe's experiment. Returns
    run.json's entry for it and the params it already has. `record` is run.json: its recipe and
    strategy become tags."""
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
        tags = {f"hvdtrain.{k}": str(record[k]) for k in ("recipe", "strategy", "framework") if k in record}
        run_id = client.create_run(experiment_id, run_name=run_dir.name, tags=tags).info.run_id
        logged, have = 0, {}
    return {"uri": uri, "run_id": run_id, "experiment_id": experiment_id, "logged_lines": logged}, have


def log_config(client, run_id: str, run_dir: Path, have: dict[str, str], tags: dict[str, str]) -> None:
    """config.json as params, those the run does not have yet, with `tags`."""
    from mlflow.entities import Param, RunTag

    config = _params(read_json_object(run_dir / "config.json") or {})
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
    client = _client(uri)
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


def _parse_lines(text: str) -> list[dict[str, Any]]:
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
        return _parse_lines((run_dir / "metrics.jsonl").read_text())
    except OSError:
        return []


class LiveLogging:
    """While the job runs, a thread of the launching process makes (or finds again) the MLflow run
    and logs the config, then logs each whole line rank 0 appends to metrics.jsonl as it appears,
    keeping run.json's entry up to date so that log_run, and a resume, log only what it did not. The
    job never waits on it: a store that fails is said in one line and the thread ends; log_run tries
    again once the job has ended."""

    def __init__(self, uri: str, run_dir: Path, say: Callable[[str], None], every_s: float = POLL_S) -> None:
        self.uri, self.run_dir, self.say, self.every_s = uri, run_dir, say, every_s
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # run.json is this thread's to write only until stop()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="hvdtrain-mlflow", daemon=True)

    def start(self) -> LiveLogging:
        self._thread.start()
        return self

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """The job has ended: no more lines are read; a call in flight may finish within wait_s."""
        self._stopping.set()
        self._thread.join(wait_s)
        with self._lock:
            self._closed = True

    def _work(self) -> None:
        try:
            client = _client(self.uri)
            record = read_json_object(self.run_dir / RUN_RECORD) or {}
            entry, have = open_run(client, self.uri, self.run_dir, record)
            made = entry != record.get(RECORD_KEY)  # not the one run.json names
            if not self._save(entry):
                if made:  # run.json will not name it (the job ended first): its end makes its own
                    client.delete_run(entry["run_id"])
                return
            log_config(client, entry["run_id"], self.run_dir, have, {})
            new_lines = _NewLines(self.run_dir / "metrics.jsonl", skip=entry["logged_lines"])
            while not self._stopping.is_set():
                if lines := new_lines.read():
                    log_lines(client, entry["run_id"], lines)
                    entry = {**entry, "logged_lines": entry["logged_lines"] + len(lines)}
                    if not self._save(entry):
                        return
                self._stopping.wait(self.every_s)
        except Exception as error:
            if not self._stopping.is_set():
                why = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                self.say(f"hvdtrain: MLflow at {self.uri}: not logging while the job runs ({why}); "
                         "what is missing is logged when it ends")  # fmt: skip

    def _save(self, entry: dict[str, Any]) -> bool:
        """run.json's entry, unless the job has ended (its own end writes run.json then)."""
        with self._lock:
            record = None if self._closed else read_json_object(self.run_dir / RUN_RECORD)
            if record is not None:
                record[RECORD_KEY] = entry
                atomic_write_bytes(self.run_dir / RUN_RECORD, (json.dumps(record) + "\n").encode())
            return record is not None


class _NewLines:
    """The records of metrics.jsonl's whole lines appended since the last read, after the first
    `skip` (those logged before), counted as log_run counts them."""

    def __init__(self, path: Path, skip: int) -> None:
        self.path, self.skip, self.offset = path, skip, 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as stream:
                stream.seek(self.offset)
                data = stream.read()
        except OSError:
            return []  # not written yet
        whole = data[: data.rfind(b"\n") + 1]  # a line being written is read once it is whole
        self.offset += len(whole)
        lines = _parse_lines(whole.decode(errors="replace"))
        skipped, self.skip = min(self.skip, len(lines)), max(0, self.skip - len(lines))
        return lines[skipped:]

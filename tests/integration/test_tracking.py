"""MLflow tracking against real stores: a sqlite file, and `mlflow server` on 127.0.0.1 started here.
The launching process logs the run from its run directory: the params are config.json, the metrics are
metrics.jsonl, and a resume goes on in the same MLflow run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from hvdtrain.records import tracking
from tests.support.helpers import hvdtrain, metric_records

SHORT = ["--np", "2", "--launcher", "gloo", "--set", "steps_per_epoch=5", "--set", "log_step_lr=true"]


def logged(uri: str, run_id: str):
    """The MLflow run's params, metric histories, artifacts, status and tags."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    history = {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        for key in run.data.metrics
    }
    artifacts = sorted(item.path for item in client.list_artifacts(run_id))
    return run.data.params, history, artifacts, run.info.status, run.data.tags


def expected_metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl read here: an epoch record's numbers at its epoch, a step record's as step/KEY."""
    found: dict[str, list[tuple[int, float]]] = {}
    for line in metric_records(run_dir):
        at, prefix = (line["epoch"], "") if "epoch" in line else (line["step"], "step/")
        for key, value in line.items():
            if key not in ("epoch", "step") and type(value) in (int, float):
                found.setdefault(prefix + key, []).append((at, float(value)))
    return {key: sorted(values) for key, values in found.items()}


def as_params(config: dict) -> dict[str, str]:
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in config.items()}


def check_logged(uri: str, run_dir: Path, config: dict | None = None) -> str:
    """The params are `config` (by default config.json), the metrics are metrics.jsonl."""
    entry = json.loads((run_dir / "run.json").read_text())["mlflow"]
    params, history, artifacts, status, _ = logged(uri, entry["run_id"])
    config = config or json.loads((run_dir / "config.json").read_text())
    assert params == as_params(config)
    assert history == expected_metrics(run_dir)
    assert {"loss", "test_accuracy", "lr", "step/lr"} <= history.keys()
    assert {"summary.json", "config.json", "curves.png"} <= set(artifacts) and status == "FINISHED"
    return entry["run_id"]


def test_a_run_and_its_resume_are_one_mlflow_run_in_a_sqlite_store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir = tmp_path / "run"
    done = hvdtrain("run", "digits-mlp-torch", *SHORT, "--set", "epochs=2", "--mlflow", uri, run_dir=run_dir)
    run_id = check_logged(uri, run_dir)
    first = json.loads((run_dir / "config.json").read_text())
    assert f"logged to MLflow at {uri}: run {run_id}" in done.stdout
    assert f"mlflow           run {run_id} at {uri}" in hvdtrain("show", str(run_dir)).stdout
    hvdtrain("run", "digits-mlp-torch", "--resume", "--set", "epochs=3", "--mlflow", uri, run_dir=run_dir)
    assert check_logged(uri, run_dir, first) == run_id, "the params stay the first run's"
    _, history, _, _, tags = logged(uri, run_id)
    assert [step for step, _ in history["loss"]] == [1, 2, 3], "each epoch once, the resumed one after"
    assert tags["hvdtrain.resumed.epochs"] == "3" and tags["hvdtrain.recipe"] == "digits-mlp-torch"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "artifacts"), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "server.log").open("w"), start_new_session=True,
    )  # fmt: skip
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                if answer.status == 200:
                    break
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            pytest.fail(f"mlflow server did not start: {(tmp_path / 'server.log').read_text()[-2000:]}")
        time.sleep(0.5)
    yield uri
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(timeout=30)


def test_a_run_is_logged_to_an_mlflow_server_and_a_closed_port_is_refused_before_any_rank(
    mlflow_server, tmp_path
):
    """The run is given the server by MLflow's own variable."""
    env = {tracking.ENV: mlflow_server}
    hvdtrain("run", "digits-mlp-torch", *SHORT, "--set", "epochs=2", run_dir=tmp_path / "served", env=env)
    check_logged(mlflow_server, tmp_path / "served")
    closed = f"http://127.0.0.1:{free_port()}"
    refused = hvdtrain("run", "digits-mlp-torch", "--mlflow", closed, run_dir=tmp_path / "never", check=False)
    assert refused.returncode == 2 and "the tracking server does not answer" in refused.stderr
    assert len(refused.output.strip().splitlines()) == 1 and not (tmp_path / "never").exists()

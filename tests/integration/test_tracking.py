"""MLflow tracking against real stores: a sqlite file, and `mlflow server` on 127.0.0.1 started here.
The launching process logs the run from its run directory: the params are config.json, the metrics are
metrics.jsonl (each epoch while the job runs, at the time rank 0 wrote it), and a resume goes on in the
same MLflow run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from hvdtrain.records import tracking
from tests.support.helpers import child_with_env, hvdtrain, kill_mid_run, metric_records

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
            if key not in ("epoch", "step", "time") and type(value) in (int, float):
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


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """One server for the module's tests: each looks only at its own runs (by run id or run name)."""
    tmp_path = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "artifacts"), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "server.log").open("w"), start_new_session=True,
        # without MLflow 3's job execution: eight more processes (a job runner and its huey consumers)
        # that hvdtrain never uses: 22 CPU-s to start the server against 7
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
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
    mlflow_server, live_job, tmp_path
):
    """The run (live_job's) is given the server by MLflow's own variable."""
    check_logged(mlflow_server, live_job.run_dir)
    closed = f"http://127.0.0.1:{free_port()}"
    refused = hvdtrain("run", "digits-mlp-torch", "--mlflow", closed, run_dir=tmp_path / "never", check=False)
    assert refused.returncode == 2 and "the tracking server does not answer" in refused.stderr
    assert len(refused.output.strip().splitlines()) == 1 and not (tmp_path / "never").exists()


SLOW = ["--np", "2", "--launcher", "gloo", "--set", "batch_size=1", "--set", "lr=0.01"]
"""Epochs of a second or so (a step a sample, a few hundred steps): slow enough to watch."""
LIVE_EPOCHS, LIVE_STEPS = 4, 300
"""live_job's: after its first epoch, three more of a second or so each (the job's MLflow thread looks
for new lines every second, the test every 0.3 s)."""


def the_cli_once_ranks_run(launcher_pid: int):
    import psutil

    ranks = child_with_env(launcher_pid, lambda env: "HVDTRAIN_THREADS_PER_RANK" in env)
    return psutil.Process(launcher_pid) if ranks else None


def the_mlflow_run(client, run_dir: Path):
    """The MLflow run hvdtrain made for run_dir, as MLflow finds it; None before there is one."""
    experiment = client.get_experiment_by_name("digits-mlp-torch")
    found = experiment and client.search_runs(
        [experiment.experiment_id], f"attributes.run_name = '{run_dir.name}'"
    )
    return found[0] if found else None


@dataclass
class LiveJob:
    run_dir: Path
    seen: tuple | None
    """(the epochs MLflow had, the run's status, its params) at the first look that found an epoch while
    the job still ran; None: none did."""


@pytest.fixture(scope="module")
def live_job(mlflow_server, tmp_path_factory) -> LiveJob:
    """A job given the server by MLflow's own variable, watched in MLflow while it runs; the tests of a
    run logged to a server and of epochs logged as they come each check it."""
    from mlflow.tracking import MlflowClient

    tmp_path = tmp_path_factory.mktemp("live")
    run_dir, client = tmp_path / "live", MlflowClient(tracking_uri=mlflow_server)
    args = [*SLOW, "--set", f"steps_per_epoch={LIVE_STEPS}", "--set", f"epochs={LIVE_EPOCHS}"]
    args += ["--set", "log_step_lr=true"]
    with (tmp_path / "job.out").open("w") as out:
        job = subprocess.Popen(
            [sys.executable, "-m", "hvdtrain", "run", "digits-mlp-torch", *args, "--run-dir", str(run_dir)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, tracking.ENV: mlflow_server},
        )  # fmt: skip
    try:
        seen = None  # (the epochs MLflow had, the run's status) while the job still ran
        while job.poll() is None and seen is None:
            run = the_mlflow_run(client, run_dir)
            epochs = [m.step for m in client.get_metric_history(run.info.run_id, "loss")] if run else []
            if epochs and job.poll() is None:
                seen = epochs, run.info.status, run.data.params
            time.sleep(0.3)
        assert job.wait(timeout=120) == 0, (tmp_path / "job.out").read_text()[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    return LiveJob(run_dir, seen)


def test_epochs_reach_an_mlflow_server_while_the_job_runs_each_once_at_its_own_time(mlflow_server, live_job):
    from mlflow.tracking import MlflowClient

    run_dir, client = live_job.run_dir, MlflowClient(tracking_uri=mlflow_server)
    assert live_job.seen is not None, "no epoch was in MLflow before the job ended"
    epochs, status, params = live_job.seen
    assert epochs[0] == 1 and len(epochs) < LIVE_EPOCHS and status == "RUNNING"
    assert params == as_params(json.loads((run_dir / "config.json").read_text())), "params as it starts"
    run_id = check_logged(mlflow_server, run_dir)
    assert the_mlflow_run(client, run_dir).info.run_id == run_id
    records = [r for r in metric_records(run_dir) if "epoch" in r]
    points = client.get_metric_history(run_id, "loss")
    assert sorted((m.step, m.timestamp) for m in points) == [
        (r["epoch"], int(r["time"] * 1000)) for r in records
    ]
    assert len({m.timestamp for m in points}) == LIVE_EPOCHS, "each epoch at its own time, not all at the end"
    steps = {r["step"]: int(r["time"] * 1000) for r in metric_records(run_dir) if "step" in r}
    assert {m.step: m.timestamp for m in client.get_metric_history(run_id, "step/lr")} == steps
    logged_lines = json.loads((run_dir / "run.json").read_text())["mlflow"]["logged_lines"]
    assert logged_lines == LIVE_EPOCHS + LIVE_EPOCHS * LIVE_STEPS


def test_a_preempted_run_is_killed_not_failed_and_its_resume_goes_on_in_the_same_mlflow_run(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir = tmp_path / "run"
    # stopped within the first few hundred steps (at ~260 on a quiet machine: the signal is sent once the
    # ranks have written their first step), so that four epochs of 200 leave it well inside the run
    args = ["run", "digits-mlp-torch", *SLOW, "--set", "steps_per_epoch=200", "--set", "epochs=4"]
    stopped = kill_mid_run(
        [*args, "--set", "log_step_lr=true", "--mlflow", uri],
        run_dir,
        ready=run_dir / "metrics.jsonl",
        find_victim=the_cli_once_ranks_run,
        signum=signal.SIGUSR1,
    )
    assert stopped.returncode == 0 and "hvdtrain: preempted" in stopped.stderr, stopped.stderr[-3000:]
    assert json.loads((run_dir / "run.json").read_text())["status"] == "preempted"
    run_id = json.loads((run_dir / "run.json").read_text())["mlflow"]["run_id"]
    params, history, _, status, tags = logged(uri, run_id)
    assert status == "KILLED" and tags["hvdtrain.status"] == "preempted", "not FAILED: it goes on"
    assert history == expected_metrics(run_dir) and len(history["loss"]) < 4
    hvdtrain("run", "digits-mlp-torch", "--resume", "--mlflow", uri, run_dir=run_dir)
    assert check_logged(uri, run_dir) == run_id, "the same MLflow run"
    _, history, _, _, tags = logged(uri, run_id)
    assert [step for step, _ in history["loss"]] == [1, 2, 3, 4], "each epoch once"
    assert [step for step, _ in history["step/lr"]] == list(range(4 * 200)), "each step once"
    assert tags["hvdtrain.status"] == "finished"
    client = MlflowClient(tracking_uri=uri)
    assert len(client.search_runs([client.get_experiment_by_name("digits-mlp-torch").experiment_id])) == 1

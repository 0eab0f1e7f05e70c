"""Logging a run directory into a real MLflow store (sqlite), in this process: while the job runs
(LiveLogging, as rank 0 appends to metrics.jsonl) and once it has ended. A failure part way still
leaves the MLflow run's id in run.json, so that a resume goes on in that run."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("mlflow")

from hvdtrain.job.execute import log_to_tracking  # noqa: E402


def test_a_logging_failure_part_way_marks_the_mlflow_run_failed_and_keeps_its_id(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"recipe": "digits-mlp-torch", "status": "finished"}))
    (run_dir / "config.json").write_text(json.dumps({"lr": 0.1}))
    # MLflow refuses a metric name with '|': the run exists by then, its metrics are refused
    (run_dir / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "loss": 1.5, "bad|name": 2.0}) + "\n")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    log_to_tracking(SimpleNamespace(tracking_uri=uri, run_dir=run_dir), "finished", console=True)
    assert "hvdtrain: not logged to MLflow at" in capsys.readouterr().err
    entry = json.loads((run_dir / "run.json").read_text())["mlflow"]
    assert entry["uri"] == uri and entry["logged_lines"] == 0
    assert MlflowClient(tracking_uri=uri).get_run(entry["run_id"]).info.status == "FAILED"


def _wait_for(predicate, seconds: float = 60.0):
    """What predicate() returns once it is truthy (the first call imports MLflow, makes the tables)."""
    deadline = time.monotonic() + seconds
    while not (found := predicate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def _logged_lines(run_dir):
    return (json.loads((run_dir / "run.json").read_text()).get("mlflow") or {}).get("logged_lines")


def test_live_logging_logs_each_whole_line_as_it_appears_and_the_end_only_the_rest(tmp_path):
    from mlflow.tracking import MlflowClient

    from hvdtrain.records.live_tracking import LiveLogging

    run_dir, uri, said = tmp_path / "run", f"sqlite:///{tmp_path / 'mlflow.db'}", []
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"recipe": "digits-mlp-torch", "status": "running"}))
    (run_dir / "config.json").write_text(json.dumps({"lr": 0.1, "epochs": 3}))
    step = {"step": 0, "lr": 0.05, "time": 1000.25}
    epoch = {"epoch": 1, "loss": 1.5, "lr": 0.1, "time": 1001.5}
    with (run_dir / "metrics.jsonl").open("w") as stream:
        stream.write(json.dumps(step) + "\n" + json.dumps(epoch)[:9])  # rank 0 part way through epoch 1
    live = LiveLogging(uri, run_dir, said.append, every_s=0.05).start()
    assert _wait_for(lambda: _logged_lines(run_dir) == 1)
    client = MlflowClient(tracking_uri=uri)
    run_id = json.loads((run_dir / "run.json").read_text())["mlflow"]["run_id"]
    assert client.get_run(run_id).data.params == {"lr": "0.1", "epochs": "3"}, "the config as it starts"
    assert [(m.step, m.timestamp) for m in client.get_metric_history(run_id, "step/lr")] == [(0, 1000250)]
    assert client.get_metric_history(run_id, "loss") == [], "half a line is not logged"
    with (run_dir / "metrics.jsonl").open("a") as stream:
        stream.write(json.dumps(epoch)[9:] + "\n")
    assert _wait_for(lambda: _logged_lines(run_dir) == 2)
    assert [(m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, "loss")] == [
        (1, 1.5, 1001500)
    ]
    with (run_dir / "metrics.jsonl").open("a") as stream:  # the last epoch, after the job's end
        live.stop()
        stream.write(json.dumps({"epoch": 2, "loss": 1.0, "lr": 0.1, "time": 1002.0}) + "\n")
    log_to_tracking(SimpleNamespace(tracking_uri=uri, run_dir=run_dir), "preempted", console=True)
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["hvdtrain.status"] == "preempted"
    assert [(m.step, m.timestamp) for m in client.get_metric_history(run_id, "loss")] == [
        (1, 1001500),
        (2, 1002000),
    ], "each point once, at its record's time"
    assert _logged_lines(run_dir) == 3 and said == []


def test_a_store_failing_while_the_job_runs_is_one_line_and_the_end_logs_it_all(tmp_path):
    from mlflow.tracking import MlflowClient

    from hvdtrain.records.live_tracking import LiveLogging

    run_dir, said = tmp_path / "run", []
    run_dir.mkdir()
    record = {"recipe": "digits-mlp-torch", "status": "running"}
    (run_dir / "run.json").write_text(json.dumps(record))
    (run_dir / "config.json").write_text(json.dumps({"lr": 0.1}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "loss": 1.5, "time": 1001.5}) + "\n")
    (tmp_path / "store").write_text("")  # where the store's folder should be: MLflow cannot make it
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    live = LiveLogging(uri, run_dir, said.append, every_s=0.05).start()
    assert _wait_for(lambda: said), "said while the job runs"
    live.stop(wait_s=5)
    assert len(said) == 1 and said[0].startswith(f"hvdtrain: MLflow at {uri}: not logging while the job runs")
    assert json.loads((run_dir / "run.json").read_text()) == record, "nothing recorded"
    (tmp_path / "store").unlink()  # the store answers again by the job's end
    log_to_tracking(SimpleNamespace(tracking_uri=uri, run_dir=run_dir), "finished", console=True)
    run_id = json.loads((run_dir / "run.json").read_text())["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [(m.step, m.timestamp) for m in client.get_metric_history(run_id, "loss")] == [(1, 1001500)]

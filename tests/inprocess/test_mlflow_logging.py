"""Logging a run directory into a real MLflow store (sqlite), in this process: a failure part way
still leaves the MLflow run's id in run.json, so that a resume goes on in that run."""

from __future__ import annotations

import json
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

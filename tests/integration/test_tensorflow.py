"""TensorFlow / Keras 3 recipes and scripts under Horovod, on real ranks."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
from conftest import PROGRAMS, hvdtrain, rank_json_lines, summary


@pytest.mark.parametrize(("launcher", "np_"), [("gloo", 2), ("mpi", 2), ("gloo", 1)])
def test_digits_tf_reaches_its_bar(launcher, np_, tmp_path):
    hvdtrain("run", "digits-mlp-tf", "--np", str(np_), "--launcher", launcher, run_dir=tmp_path)
    done = summary(tmp_path)
    assert done["world_size"] == np_ and done["strategy"] == "horovod"
    assert done["test_accuracy"] >= 0.95
    assert done["weights_consistent"] is True
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["loss"] < metrics[0]["loss"] / 3
    assert (tmp_path / "checkpoint.keras").exists()


def _weights(run_dir) -> list[np.ndarray]:
    return keras.models.load_model(run_dir / "checkpoint.keras", compile=False).get_weights()


def test_two_ranks_equal_one_process_with_twice_the_batch(tmp_path):
    common = ["--set", "scale_lr=false", "--set", "momentum=0", "--set", "epochs=3", "--set", "lr=0.1"]
    hvdtrain("run", "digits-mlp-tf", "--np", "2", "--set", "batch_size=16", *common, run_dir=tmp_path / "np2")
    hvdtrain("run", "digits-mlp-tf", "--np", "1", "--set", "batch_size=32", *common, run_dir=tmp_path / "np1")
    two_ranks, one_process = _weights(tmp_path / "np2"), _weights(tmp_path / "np1")
    assert len(two_ranks) == len(one_process) == 4
    for a, b in zip(two_ranks, one_process, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert summary(tmp_path / "np2")["steps"] == summary(tmp_path / "np1")["steps"]


def test_resume_ends_where_an_uninterrupted_run_ends(tmp_path):
    hvdtrain("run", "digits-mlp-tf", "--np", "2", "--set", "epochs=4", run_dir=tmp_path / "straight")
    hvdtrain("run", "digits-mlp-tf", "--np", "2", "--set", "epochs=2", run_dir=tmp_path / "split")
    hvdtrain("run", "digits-mlp-tf", "--np", "2", "--resume", "--set", "epochs=4", run_dir=tmp_path / "split")
    for a, b in zip(_weights(tmp_path / "straight"), _weights(tmp_path / "split"), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("launcher", ["gloo", "mpi"])
def test_synthetic_tf_custom_loop(launcher, tmp_path):
    hvdtrain(
        "run", "synthetic-tf", "--variant", "debug", "--np", "2", "--launcher", launcher, run_dir=tmp_path
    )
    done = summary(tmp_path)
    assert (
        done["weights_consistent"] is True and done["samples_per_sec"] > 0 and done["test_accuracy"] is None
    )


def test_plain_horovod_keras3_script_runs_unchanged(tmp_path):
    hvdtrain("run", str(PROGRAMS / "user_script_tf.py"), "--np", "2", "--", "--steps", "4", run_dir=tmp_path)
    lines = sorted(rank_json_lines(tmp_path), key=lambda line: line["rank"])
    assert [line["rank"] for line in lines] == [0, 1]
    assert all(line["equal"] and line["steps"] == 4 for line in lines)
    assert lines[0]["accuracy"] == lines[1]["accuracy"], "MetricAverageCallback averages across ranks"

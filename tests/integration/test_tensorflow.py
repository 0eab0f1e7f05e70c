"""TensorFlow / Keras 3 recipes and scripts under Horovod, on real ranks."""

from __future__ import annotations

import json

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

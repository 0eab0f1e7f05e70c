"""What the launching process reads of metrics.jsonl while rank 0 appends to it, and the metric points
each record becomes: no MLflow needed."""

from __future__ import annotations

import json

from hvdtrain.records import live_tracking, runs, tracking


def test_new_lines_are_read_once_whole_after_those_logged_before(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = live_tracking._NewLines(path, skip=2)
    assert lines.read() == [], "not written yet"
    records = [{"step": step, "lr": 0.1, "time": 100.0 + step} for step in range(4)]
    text = "".join(json.dumps(record) + "\n" for record in records)
    path.write_text(text[:-10])  # rank 0 is part way through the last line
    assert lines.read() == [records[2]], "the two logged before are skipped, the half line waits"
    assert lines.read() == []
    with path.open("a") as stream:
        stream.write(text[-10:] + "not json\n" + '["not", "a", "record"]\n')
    assert lines.read() == [records[3]], "read once whole; what is no record is not counted"
    epoch = {"epoch": 1, "loss": 0.5, "time": 110.0}
    with path.open("a") as stream:
        stream.write(json.dumps(epoch) + "\n")
    assert lines.read() == [epoch]
    assert len(tracking._metric_lines(tmp_path)) == 5, "counted as the end of the job counts them"


def test_a_record_is_points_at_its_epoch_or_step_at_the_time_rank_0_wrote_it():
    epoch = {"epoch": 2, "loss": 0.5, "test_accuracy": None, "lr": 0.1, "time": 1700000000.1234}
    assert tracking.metrics_of(epoch) == [("loss", 0.5, 2), ("lr", 0.1, 2)], "time is no metric"
    assert tracking.metrics_of({"step": 7, "lr": 0.05, "time": 1.0}) == [("step/lr", 0.05, 7)]
    assert tracking._millis(epoch, otherwise=5) == 1700000000123
    assert tracking._millis({"epoch": 1, "loss": 0.5}, otherwise=5) == 5, "an older hvdtrain's record"


def test_a_preempted_or_interrupted_mlflow_run_is_killed_and_a_failed_or_diverged_one_failed():
    ends = ("finished", "failed", "diverged", "interrupted", "preempted")
    assert set(ends) <= set(runs.STATUSES)
    assert {end: tracking.STATUS.get(end, "FAILED") for end in ends} == {
        "finished": "FINISHED",
        "failed": "FAILED",
        "diverged": "FAILED",
        "interrupted": "KILLED",
        "preempted": "KILLED",
    }

"""TensorFlow / Keras 3 recipes and scripts under Horovod, on real ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hvdtrain.runtime import checkpoint
from tests.support.helpers import PROGRAMS, RESUMABLE_SYNTHETIC_TF, hvdtrain, rank_json_lines, summary


def temporary_folder(tmp_path: Path) -> Path:
    """A TMPDIR of the test's own, beside its run directory."""
    folder = tmp_path.parent / f"{tmp_path.name}-tmp"
    folder.mkdir()
    return folder


def assert_nothing_left_in(folder: Path) -> None:
    left = sorted(path.name for path in folder.iterdir())
    assert not left, f"the ranks left temporary files (autograph's) behind: {left[:5]} ({len(left)})"


@pytest.mark.parametrize(("launcher", "np_"), [("gloo", 2)])  # TF over MPI: test_multihost, test_equivalence
def test_digits_tf_reaches_its_bar(launcher, np_, tmp_path):
    keep = ["--set", "keep_checkpoints=3"]
    scratch = temporary_folder(tmp_path)
    run = ("run", "digits-mlp-tf", "--np", str(np_), "--launcher", launcher, *keep)
    hvdtrain(*run, run_dir=tmp_path, env={"TMPDIR": str(scratch)})
    assert_nothing_left_in(scratch)
    done = summary(tmp_path)
    assert done["world_size"] == np_ and done["strategy"] == "horovod"
    assert done["test_accuracy"] >= 0.95
    assert done["weights_consistent"] is True
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["loss"] < metrics[0]["loss"] / 3
    assert checkpoint.latest(tmp_path).path("checkpoint.keras").exists()
    kept = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert len(kept) == 3 and kept[-1] == done["steps"] == checkpoint.latest(tmp_path).manifest.step


@pytest.mark.parametrize("launcher", ["gloo", "mpi"])
def test_synthetic_tf_custom_loop(launcher, tmp_path, shared_runs):
    """Over gloo: the uninterrupted run test_equivalence resumes bit-exact against (the same loop,
    with checkpoints, for 4 epochs); over MPI, the debug variant of its own."""
    if launcher == "gloo":
        run_dir = shared_runs.run(
            "synthetic-tf", "--np", "2", "--launcher", "gloo", *RESUMABLE_SYNTHETIC_TF, "--set", "epochs=4"
        ).run_dir
    else:
        run_dir, scratch = tmp_path, temporary_folder(tmp_path)
        run = ("run", "synthetic-tf", "--variant", "debug", "--np", "2", "--launcher", launcher)
        hvdtrain(*run, run_dir=run_dir, env={"TMPDIR": str(scratch)})
        assert_nothing_left_in(scratch)
    done = summary(run_dir)
    assert (
        done["weights_consistent"] is True and done["samples_per_sec"] > 0 and done["test_accuracy"] is None
    )


def test_plain_horovod_keras3_script_runs_unchanged(tmp_path):
    hvdtrain("run", str(PROGRAMS / "user_script_tf.py"), "--np", "2", "--", "--steps", "4", run_dir=tmp_path)
    lines = sorted(rank_json_lines(tmp_path), key=lambda line: line["rank"])
    assert [line["rank"] for line in lines] == [0, 1]
    assert all(line["equal"] and line["steps"] == 4 for line in lines)
    assert lines[0]["accuracy"] == lines[1]["accuracy"], "MetricAverageCallback averages across ranks"


def _keras2_arguments_were_dropped(line: dict) -> None:
    assert len(line["warnings"]) == 1, line["warnings"]  # two layers, one warning
    assert "fused, virtual_batch_size" in line["warnings"][0]
    assert "virtual_batch_size=4" in line["refused"]  # dropping it would change the normalization
    assert line["output_error"] < 1e-5 and line["moving_error"] < 1e-5


def test_sync_batch_norm_takes_keras2_arguments_in_one_process():
    program = PROGRAMS / "syncbn_keras2_args.py"
    done = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["size"] == 1
    _keras2_arguments_were_dropped(line)


def test_sync_batch_norm_with_keras2_arguments_matches_batch_norm_over_all_ranks(tmp_path):
    hvdtrain(
        "run", str(PROGRAMS / "syncbn_keras2_args.py"), "--np", "2", "--launcher", "gloo", run_dir=tmp_path
    )
    lines = sorted(rank_json_lines(tmp_path), key=lambda line: line["rank"])
    assert [(line["rank"], line["size"]) for line in lines] == [(0, 2), (1, 2)]
    for line in lines:
        _keras2_arguments_were_dropped(line)

"""--max-restarts on real ranks: a job whose rank dies relaunches from its last checkpoint and ends
exactly as the same job run without a fault."""

from __future__ import annotations

import json

import numpy as np

from tests.support.helpers import child_with_env, final_weights, hvdtrain, kill_mid_run


def test_a_killed_rank_restarts_from_the_checkpoint_and_ends_as_the_uninterrupted_run(tmp_path):
    common = ["digits-mlp-torch", "--np", "2", "--launcher", "gloo", "--set", "epochs=5"]
    hvdtrain("run", *common, run_dir=tmp_path / "reference")
    run_dir = tmp_path / "restarted"
    killed = kill_mid_run(
        ["run", *common, "--max-restarts", "1"],
        run_dir,
        ready=run_dir / "checkpoints" / "latest",
        find_victim=lambda pid: child_with_env(pid, lambda env: env.get("HOROVOD_RANK") == "1"),
    )
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "rank 1 failed first" in killed.stderr
    assert "restart 1 of 1 from its last checkpoint" in killed.stderr
    for ours, reference in zip(final_weights(run_dir), final_weights(tmp_path / "reference"), strict=True):
        np.testing.assert_array_equal(ours, reference)
    epochs = [json.loads(line)["epoch"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(set(epochs)) == [1, 2, 3, 4, 5]
    assert not killed.orphans
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "finished" and record["exit_code"] == 0, record  # the restart's end

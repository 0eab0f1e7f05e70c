"""hvdtrain.run from Python, on real ranks: a finished job and a failed one are results, not errors."""

from __future__ import annotations

import json

import hvdtrain
from tests.support.helpers import PROGRAMS


def test_run_trains_the_default_recipe_and_returns_its_summary(tmp_path, capsys):
    result = hvdtrain.run("digits-mlp-torch", np=2, launcher="gloo", run_dir=tmp_path / "run", console=False)
    assert (result.status, result.exit_code, result.ok) == ("finished", 0, True)
    assert result.run_dir == tmp_path / "run"
    assert result.summary["test_accuracy"] >= 0.95
    assert result.summary["world_size"] == 2 and result.summary["weights_consistent"] is True
    assert result.summary["wall_seconds"] > 0
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == result.status
    assert result.message.startswith("summary: recipe=digits-mlp-torch")
    assert capsys.readouterr().out == ""  # console=False: nothing shown, the logs keep it
    assert list((tmp_path / "run" / "logs").rglob("stdout"))


def test_a_job_that_fails_returns_failed_with_the_ranks_exit_code(tmp_path, capsys):
    result = hvdtrain.run(str(PROGRAMS / "exit_code.py"), np=2, launcher="gloo", run_dir=tmp_path / "run")
    assert (result.status, result.exit_code, result.ok, result.rank_exit_code) == ("failed", 1, False, 2)
    assert "rank 1 failed first (exit code 2)" in result.message
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert (record["status"], record["exit_code"], record["rank_exit_code"]) == ("failed", 1, 2)
    assert "hvdtrain: rank 1 failed first" in capsys.readouterr().err  # console=True says it, as the CLI does


def test_run_from_another_thread_leaves_the_signals_to_the_caller(tmp_path):
    """A notebook's or a pipeline's worker thread: Python takes signals on its main thread only."""
    from concurrent.futures import ThreadPoolExecutor

    program = str(PROGRAMS / "exit_code.py")
    with ThreadPoolExecutor(max_workers=1) as pool:
        result = pool.submit(
            hvdtrain.run, program, np=2, launcher="gloo", run_dir=tmp_path / "run", console=False
        ).result(timeout=300)
    assert (result.status, result.exit_code) == ("failed", 1)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "failed"

"""Horovod's fusion threshold and cycle time are chosen per recipe from what `hvdtrain bench --tune`
measured, and only where they beat Horovod's defaults by more than the noise."""

from __future__ import annotations

import json
from pathlib import Path

from hvdtrain import bench, tuning
from hvdtrain.tuning import HOROVOD_DEFAULTS, Tuning

FAST = Tuning(32, 5)


def rates(fast: float) -> dict[Tuning, float]:
    return {HOROVOD_DEFAULTS: 100.0, Tuning(128, 5): 101.0, FAST: fast}


def test_a_setting_is_chosen_only_where_it_beats_the_defaults_by_the_margin():
    assert tuning.choose(rates(102.9)) == HOROVOD_DEFAULTS, "within the noise: the defaults stay"
    assert tuning.choose(rates(103.0)) == FAST
    assert FAST.env() == {"HOROVOD_FUSION_THRESHOLD": str(32 * 1024 * 1024), "HOROVOD_CYCLE_TIME": "5"}
    assert Tuning(128, 0.5).env()["HOROVOD_CYCLE_TIME"] == "0.5"


def test_what_is_kept_is_read_back_per_recipe_and_the_defaults_or_a_bad_file_are_nothing(tmp_path):
    path = tmp_path / "horovod-tuning.json"
    tuning.record("resnet-torch", rates(110.0), "at np=2 over mpi", 104.0, path)
    tuning.record("gpt-torch", rates(101.0), "at np=2 over mpi", None, path)
    kept = tuning.read(path)
    assert tuning.measured(kept, "resnet-torch") == (FAST, 1.1, "at np=2 over mpi")
    assert kept["resnet-torch"]["samples_per_sec"]["autotune"] == 104.0
    assert kept["gpt-torch"]["fusion_mb"] == 128 and tuning.measured(kept, "gpt-torch") is None
    assert tuning.measured(kept, "digits-mlp-torch") is None
    path.write_text(json.dumps({"resnet-torch": {"fusion_mb": "big"}}))
    assert tuning.measured(tuning.read(path), "resnet-torch") is None
    path.write_text("not json")
    assert tuning.read(path) == {}


def test_the_tuning_table_gives_each_setting_and_autotune_against_the_defaults():
    lines = bench.render_tuning("resnet-torch", rates(110.0), 95.0, "at np=2 over mpi").splitlines()
    assert lines[0] == "resnet-torch, Horovod at np=2 over mpi:"
    assert lines[2].split() == ["fusion", "128", "MB,", "cycle", "1", "ms", "(defaults)", "100.0", "1.00"]
    assert lines[-2].split() == ["Horovod", "autotune", "95.0", "0.95"]
    assert lines[-1] == "  chosen: fusion 32 MB, cycle 5 ms, 1.10x the defaults"
    assert bench.render_tuning("r", rates(101.0), 95.0, "w").endswith("nothing beat them by 3 %")


def test_tune_times_every_candidate_and_autotune_interleaved(tmp_path, monkeypatch):
    calls = []

    def fake_rate(recipe, strategy, np_, launcher, steps, epochs, run_dir, extra, env):
        calls.append((Path(run_dir).name, env.get("HOROVOD_CYCLE_TIME"), "--horovod-autotune" in extra))
        return 50.0 + len(calls)

    monkeypatch.setattr(bench, "recipe_samples_per_sec", fake_rate)
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "9")  # the user's own setting is not what is timed
    medians, autotune = bench.tune("resnet-torch", 2, "mpi", 5, 3, 32, tmp_path, repeats=2)
    per_round = len(tuning.CANDIDATES) + 1
    assert len(calls) == 2 * per_round and calls[0][0] == "tune-fusion128-cycle1-0"
    assert calls[per_round - 1] == ("tune-autotune-0", None, True)
    assert [cycle for _, cycle, _ in calls[: per_round - 1]] == ["1", "5", "20", "1", "5"]
    assert set(medians) == set(tuning.CANDIDATES) and autotune == (50 + per_round + 50 + 2 * per_round) / 2

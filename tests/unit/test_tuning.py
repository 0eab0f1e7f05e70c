"""Each strategy's communication settings (Horovod's fusion threshold and cycle time, DDP's bucket
size) are chosen per recipe from what `hvdtrain bench --tune` measured, and only where they beat the
defaults by more than the noise."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from hvdtrain.measure import tune, tuning
from hvdtrain.measure.tuning import DDP_DEFAULTS, HOROVOD_DEFAULTS, Buckets, Tuning

FAST = Tuning(32, 5)
TUNABLE = tune.tunables()
"""What each strategy declares it tunes (Strategy.tunable)."""


def rates(fast: float) -> dict[tuning.Setting, float]:
    return {HOROVOD_DEFAULTS: 100.0, Tuning(128, 5): 101.0, FAST: fast}


def test_a_setting_is_chosen_only_where_it_beats_the_defaults_by_the_margin():
    assert tuning.choose(rates(102.9), HOROVOD_DEFAULTS) == HOROVOD_DEFAULTS, "within the noise"
    assert tuning.choose(rates(103.0), HOROVOD_DEFAULTS) == FAST
    assert FAST.env() == {"HOROVOD_FUSION_THRESHOLD": str(32 * 1024 * 1024), "HOROVOD_CYCLE_TIME": "5"}
    assert Tuning(128, 0.5).env()["HOROVOD_CYCLE_TIME"] == "0.5"
    assert Buckets(5).env() == {"HVDTRAIN_DDP_BUCKET_MB": "5"} and Buckets(12.5).label() == "buckets 12.5 MB"
    assert DDP_DEFAULTS.env() == {}, "torch's default is no size given (its first bucket is smaller)"
    assert tuning.choose({DDP_DEFAULTS: 10.0, Buckets(5): 10.4}, DDP_DEFAULTS) == Buckets(5)
    assert TUNABLE["horovod"].variables == (
        "HOROVOD_FUSION_THRESHOLD",
        "HOROVOD_CYCLE_TIME",
        "HVDTRAIN_COMPRESSION",
    )
    assert all(t.candidates[0] == t.defaults for t in TUNABLE.values())


def test_what_is_kept_is_read_back_per_strategy_and_recipe_and_the_defaults_or_a_bad_file_are_nothing(
    tmp_path,
):
    path = tmp_path / "tuning.json"
    tuning.record(TUNABLE["horovod"], "resnet-torch", rates(110.0), "at np=2 over mpi", 104.0, path)
    tuning.record(TUNABLE["horovod"], "gpt-torch", rates(101.0), "at np=2 over mpi", None, path)
    tuning.record(
        TUNABLE["ddp"], "resnet-torch", {DDP_DEFAULTS: 10.0, Buckets(100): 11.0}, "at np=2", None, path
    )
    kept = tuning.read(path)
    assert tuning.measured(kept, TUNABLE.get("horovod"), "resnet-torch") == (FAST, 1.1, "at np=2 over mpi")
    assert tuning.measured(kept, TUNABLE.get("ddp"), "resnet-torch") == (Buckets(100), 1.1, "at np=2")
    assert kept["horovod"]["resnet-torch"]["samples_per_sec"]["autotune"] == 104.0
    assert "autotune" not in kept["ddp"]["resnet-torch"]["samples_per_sec"]
    assert kept["horovod"]["gpt-torch"]["setting"] == {"fusion_mb": 128, "cycle_ms": 1, "compression": "none"}
    assert tuning.measured(kept, TUNABLE.get("horovod"), "gpt-torch") is None, "the defaults set nothing"
    assert tuning.measured(kept, TUNABLE.get("horovod"), "digits-mlp-torch") is None
    assert tuning.measured(kept, TUNABLE.get("zero"), "resnet-torch") is None
    path.write_text(json.dumps({"horovod": {"resnet-torch": {"setting": {"fusion_mb": "big"}}}}))
    assert tuning.measured(tuning.read(path), TUNABLE.get("horovod"), "resnet-torch") is None
    edited = {"setting": {"fusion_mb": "64", "cycle_ms": "2"}, "ratio_to_defaults": 1.05, "measured": "w"}
    path.write_text(json.dumps({"horovod": {"resnet-torch": edited}}))
    assert tuning.measured(tuning.read(path), TUNABLE.get("horovod"), "resnet-torch") == (
        Tuning(64, 2.0),
        1.05,
        "w",
    )
    assert kept["ddp"]["resnet-torch"]["setting"] == {"bucket_mb": 100}
    path.write_text(json.dumps({"resnet-torch": {"fusion_mb": 32, "cycle_ms": 5}}))  # the older layout
    assert tuning.measured(tuning.read(path), TUNABLE.get("horovod"), "resnet-torch") is None
    for setting in (None, "fast", [32, 5]):  # a hand-edited file
        path.write_text(json.dumps({"horovod": {"resnet-torch": {"setting": setting}}}))
        assert tuning.measured(tuning.read(path), TUNABLE.get("horovod"), "resnet-torch") is None
    path.write_text("not json")
    assert tuning.read(path) == {}


def test_compression_is_a_setting_horovod_tunes_kept_and_read_back_and_a_bad_value_is_refused(tmp_path):
    fp16 = Tuning(128, 1, "fp16")
    assert fp16 in TUNABLE["horovod"].candidates and HOROVOD_DEFAULTS.compression == "none"
    assert fp16.env() == {**HOROVOD_DEFAULTS.env(), "HVDTRAIN_COMPRESSION": "fp16"}
    assert fp16.label() == "fusion 128 MB, cycle 1 ms, fp16 compression"
    path = tmp_path / "tuning.json"
    link_bound = {HOROVOD_DEFAULTS: 40.0, Tuning(32, 5): 41.0, fp16: 70.0}
    tuning.record(TUNABLE["horovod"], "gpt-torch", link_bound, "at np=2 over mpi", None, path)
    assert tuning.measured(tuning.read(path), TUNABLE["horovod"], "gpt-torch") == (
        fp16,
        1.75,
        "at np=2 over mpi",
    )
    env, line = tuning.planned(TUNABLE["horovod"], (fp16, 1.75, "at np=2 over mpi"), {"PATH"})
    assert env["HVDTRAIN_COMPRESSION"] == "fp16" and "fp16 compression for this recipe, 1.75x" in line
    assert tuning.planned(TUNABLE["horovod"], (fp16, 1.75, "w"), {"HVDTRAIN_COMPRESSION"}) == ({}, None)
    unknown = {"setting": {**asdict(fp16), "compression": "int3"}, "ratio_to_defaults": 2.0, "measured": "w"}
    path.write_text(json.dumps({"horovod": {"gpt-torch": unknown}}))
    assert tuning.measured(tuning.read(path), TUNABLE["horovod"], "gpt-torch") is None
    tuning.check_settings({"HVDTRAIN_COMPRESSION": "fp16"})
    with pytest.raises(
        ValueError, match="HVDTRAIN_COMPRESSION is Horovod's gradient compression, none or fp16"
    ):
        tuning.check_settings({"HVDTRAIN_COMPRESSION": "bf16"})


def test_a_kept_setting_is_planned_with_its_line_unless_the_user_set_one_of_its_variables():
    chosen = (Buckets(5), 1.07, "at np=2 on 2026-12-04")
    env, line = tuning.planned(TUNABLE["ddp"], chosen, {"PATH"})
    assert env == {"HVDTRAIN_DDP_BUCKET_MB": "5"}
    assert line == (
        "hvdtrain: DDP buckets 5 MB for this recipe, 1.07x DDP's defaults as measured at np=2 on "
        "2026-12-04 (hvdtrain bench --tune)"
    )
    assert tuning.planned(TUNABLE["ddp"], chosen, {"HVDTRAIN_DDP_BUCKET_MB"}) == ({}, None)
    assert tuning.planned(TUNABLE["ddp"], None, set()) == ({}, None)


def test_the_tuning_table_gives_each_setting_and_autotune_against_the_defaults():
    lines = tune.render_tuning("horovod", "resnet-torch", rates(110.0), 95.0, "at np=2 over mpi").splitlines()
    assert lines[0] == "resnet-torch, Horovod at np=2 over mpi:"
    assert lines[2].split() == ["fusion", "128", "MB,", "cycle", "1", "ms", "(defaults)", "100.0", "1.00"]
    assert lines[-2].split() == ["Horovod", "autotune", "95.0", "0.95"]
    assert lines[-1] == "  chosen: fusion 32 MB, cycle 5 ms, 1.10x the defaults"
    assert tune.render_tuning("horovod", "r", rates(101.0), 95.0, "w").endswith("nothing beat them by 3 %")
    ddp = tune.render_tuning("ddp", "r", {DDP_DEFAULTS: 10.0, Buckets(5): 10.1}, None, "at np=2")
    assert "autotune" not in ddp and ddp.splitlines()[2].split() == [
        "buckets", "25", "MB,", "first", "1", "MB", "(defaults)", "10.0", "1.00"
    ]  # fmt: skip
    assert ddp.endswith("chosen: DDP's defaults: nothing beat them by 3 %")


def test_tune_times_every_candidate_and_autotune_interleaved(tmp_path, monkeypatch):
    calls, compressions = [], []

    def fake_rate(recipe, strategy, np_, launcher, steps, epochs, run_dir, extra, env):
        setting = env.get("HOROVOD_CYCLE_TIME" if strategy == "horovod" else "HVDTRAIN_DDP_BUCKET_MB")
        calls.append((Path(run_dir).name, strategy, launcher, setting, "--horovod-autotune" in extra))
        compressions.append(env.get("HVDTRAIN_COMPRESSION"))
        return 50.0 + len(calls)

    monkeypatch.setattr(tune, "recipe_samples_per_sec", fake_rate)
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "9")  # the user's own settings are not what is timed
    monkeypatch.setenv("HVDTRAIN_COMPRESSION", "fp16")
    medians, autotune = tune.tune("horovod", "resnet-torch", 2, "mpi", 5, 3, 32, tmp_path, repeats=2)
    candidates = TUNABLE["horovod"].candidates
    per_round = len(candidates) + 1
    assert len(calls) == 2 * per_round and calls[0][0] == "tune-horovod-128-1-none-0"
    assert calls[per_round - 1] == ("tune-horovod-autotune-0", "horovod", "mpi", None, True)
    assert [c[3] for c in calls[: per_round - 1]] == ["1", "5", "20", "1", "5", "1"]
    assert compressions[:per_round] == [None, None, None, None, None, "fp16", None]
    assert calls[per_round - 2][0] == "tune-horovod-128-1-fp16-0"
    assert set(medians) == set(candidates) and autotune == (50 + per_round + 50 + 2 * per_round) / 2
    calls.clear()
    monkeypatch.setenv("HVDTRAIN_DDP_BUCKET_MB", "7")
    medians, autotune = tune.tune("ddp", "resnet-torch", 2, None, 5, 3, 32, tmp_path)
    assert autotune is None and set(medians) == set(TUNABLE["ddp"].candidates)
    assert [(c[0], c[1], c[2], c[3]) for c in calls] == [
        ("tune-ddp-default-0", "ddp", None, None),
        ("tune-ddp-5-0", "ddp", None, "5"),
        ("tune-ddp-50-0", "ddp", None, "50"),
        ("tune-ddp-100-0", "ddp", None, "100"),
    ]

"""One recipe, four ways to parallelise: DataParallel, DDP, parameter server, Horovod."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.helpers import child_with_env, hvdtrain, kill_mid_run, metric_records, summary


@pytest.mark.parametrize("strategy", ["ddp", "dp"])
def test_digits_torch_reaches_its_bar(strategy, tmp_path):
    clip = ["--set", "clip_grad_norm=1"] if strategy == "dp" else []  # ddp clips in test_equivalence
    # dp's --np is its devices: two GPUs where there are, else the CPU alone (more is refused)
    np = "2" if strategy == "ddp" or torch.cuda.device_count() >= 2 else "1"
    result = hvdtrain("run", "digits-mlp-torch", "--strategy", strategy, "--np", np, *clip, run_dir=tmp_path)
    done = summary(tmp_path)
    assert done["strategy"] == strategy and done["world_size"] == (2 if strategy == "ddp" else 1)
    assert done["test_accuracy"] >= 0.95 and done["weights_consistent"] is True
    if clip:
        assert all("grad_norm" in r for r in metric_records(tmp_path) if "epoch" in r)
    if strategy == "dp" and not torch.cuda.is_available():
        assert "no GPU visible: DataParallel runs the model on one device" in result.output


def test_parameter_server_trains_digits_tf(tmp_path):
    hvdtrain(
        "run",
        "digits-mlp-tf",
        "--strategy",
        "ps",
        "--np",
        "2",
        "--num-ps",
        "1",
        "--set",
        "epochs=10",  # 0.971-0.982 at the end in 8 runs; each epoch is 42 round trips to the server
        *("--set", "lr_schedule=step", "--set", "lr_milestones=[8]"),
        run_dir=tmp_path,
        timeout=600,
    )
    done = summary(tmp_path)
    assert done["strategy"] == "ps" and done["world_size"] == 2 and done["num_ps"] == 1
    assert done["test_accuracy"] >= 0.95 and done["weights_consistent"] is True
    lr = json.loads((tmp_path / "config.json").read_text())["lr"]  # not scaled: one update at a time
    # what the parameter server holds after each epoch: the workers' steps set it
    lrs = [r["lr"] for r in metric_records(tmp_path) if "epoch" in r]
    assert lrs == pytest.approx([lr] * 8 + [lr * 0.1] * 2)
    assert (tmp_path / "logs" / "worker.1" / "stderr").exists() and (tmp_path / "logs" / "ps.0").is_dir()


@pytest.mark.parametrize(("role", "index"), [("worker", 1), ("ps", 0)])
def test_killing_a_ps_process_ends_the_job_naming_it(role, index, tmp_path):
    def victim(launcher_pid: int):
        return child_with_env(
            launcher_pid, lambda env: f'"type": "{role}", "index": {index}' in env.get("TF_CONFIG", "")
        )

    run = ["run", "digits-mlp-tf", "--strategy", "ps", "--np", "2", "--set", "epochs=100000"]
    killed = kill_mid_run(run, tmp_path, ready=tmp_path / "metrics.jsonl", find_victim=victim)
    assert killed.returncode != 0 and killed.seconds_to_exit < 30, killed
    assert f"hvdtrain: ps: {role} {index} exited" in killed.stderr
    assert not killed.orphans, "orphans left"


def test_bench_prints_a_table_and_writes_csv_and_png(tmp_path):
    result = hvdtrain(
        "bench",
        "digits-mlp-torch",
        "--strategies",
        "horovod,ddp",
        "--np",
        "2",
        "--steps",
        "5",
        "--epochs",
        "2",
        "--set",
        "hidden=24",
        "--out",
        str(tmp_path),
    )
    assert "vs horovod" in result.stdout
    configs = [json.loads(path.read_text()) for path in tmp_path.glob("*/config.json")]
    assert len(configs) == 2 and {(c["hidden"], c["steps_per_epoch"]) for c in configs} == {(24, 5)}
    rows = list(csv.DictReader((tmp_path / "bench.csv").open()))
    assert {(row["strategy"], row["np"]) for row in rows} == {("horovod", "2"), ("ddp", "2")}
    assert all(float(row["samples_per_sec"]) > 0 for row in rows)
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def with_kept_build_verdicts(cache: Path) -> None:
    """What hvdtrain and horovodrun keep about this install in the cache (each keyed by the extension
    files' size and mtime, written whole), copied into a cache of the test's own: its first run would
    otherwise probe the build again in child processes, as no run on this machine does (2-3 CPU-s)."""
    from horovod.common.util import _built_flags_file

    from hvdtrain.measure.doctor import BUILD_VERDICTS
    from hvdtrain.paths import cache_dir

    root = cache_dir().parent  # the cache both keep their files under
    for kept in (BUILD_VERDICTS, Path(_built_flags_file())):
        if kept.is_file():
            copy = cache / kept.relative_to(root)
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(kept, copy)


def test_bench_tune_times_horovods_settings_and_autotune_and_ddps_buckets_and_keeps_the_choices(tmp_path):
    cache = tmp_path / "cache"  # a tuning.json of the test's own
    with_kept_build_verdicts(cache)
    result = hvdtrain(
        "bench",
        "digits-mlp-torch",
        "--tune",
        "--strategies",
        "horovod,ddp",
        "--np",
        "2",
        "--steps",
        "3",
        "--epochs",
        "2",
        "--out",
        str(tmp_path / "out"),
        env={"XDG_CACHE_HOME": str(cache)},
    )
    assert "digits-mlp-torch, Horovod at np=2 over gloo on " in result.stdout
    assert "digits-mlp-torch, DDP at np=2 on " in result.stdout
    assert "Horovod autotune" in result.stdout and result.stdout.count("  chosen: ") == 2
    kept = json.loads((cache / "hvdtrain" / "tuning.json").read_text())
    horovod, ddp = kept["horovod"]["digits-mlp-torch"], kept["ddp"]["digits-mlp-torch"]
    assert len(horovod["samples_per_sec"]) == 7 and min(horovod["samples_per_sec"].values()) > 0
    assert "fusion 128 MB, cycle 1 ms, fp16 compression" in horovod["samples_per_sec"]
    assert len(ddp["samples_per_sec"]) == 4 and min(ddp["samples_per_sec"].values()) > 0
    out = tmp_path / "out"
    assert (out / "tune-horovod-autotune-0" / "horovod-autotune.csv").exists(), "autotune really ran"

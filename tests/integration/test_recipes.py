"""The recipes of the models people train, on real ranks: a transformer language model at bf16, a
torchvision-shaped ResNet under Horovod and DDP, Keras's ResNet-50; and early stopping, which every
rank takes at the same epoch."""

from __future__ import annotations

import json

import pytest

from hvdtrain.recipes import gpt_torch
from hvdtrain.runtime import checkpoint
from tests.support.helpers import hvdtrain, metric_records, summary

RESNET_BAR = 0.95
"""resnet-torch's debug variant (ResNet-18 at width 16, digits at 32x32, 5 epochs): 0.98 measured."""


def test_the_gpt_debug_variant_at_bf16_beats_the_unigram_baseline_by_a_fifth(tmp_path):
    hvdtrain(
        "run", "gpt-torch", "--np", "2", "--launcher", "gloo", "--variant", "debug",
        "--set", "precision=bf16", run_dir=tmp_path, timeout=400,
    )  # fmt: skip
    done = summary(tmp_path)
    baseline = gpt_torch.unigram_loss(gpt_torch.RECIPE.make_config("debug"))
    assert done["weights_consistent"] is True and done["compute_dtype"] == "bfloat16"
    assert done["test_loss"] <= 0.8 * baseline, (done["test_loss"], baseline)
    assert done["test_perplexity"] == pytest.approx(2.718281828 ** done["test_loss"], rel=1e-9)
    epochs = [r for r in metric_records(tmp_path) if "epoch" in r]
    assert [sorted(k for k in r if k.startswith("test_")) for r in epochs] == [
        ["test_loss", "test_perplexity"]
    ] * 2
    assert epochs[-1]["lr"] < epochs[0]["lr"]  # the cosine decay
    assert "grad_norm" in epochs[0]  # clipped to norm 1


@pytest.mark.parametrize("strategy", ["horovod", "ddp", "fsdp"])
def test_the_resnet_debug_variant_reaches_its_bar_with_its_batchnorm_statistics_averaged(strategy, tmp_path):
    """BatchNorm's running statistics are buffers each rank gathers from its own batches: averaged at
    every epoch's end, every rank evaluates and ends with the same model (its digest covers them;
    under fsdp, of the gathered parameters)."""
    hvdtrain(
        "run", "resnet-torch", "--np", "2", "--strategy", strategy, "--variant", "debug", run_dir=tmp_path
    )
    done = summary(tmp_path)
    assert done["weights_consistent"] is True
    assert done["test_accuracy"] >= RESNET_BAR and done["test_accuracy"] <= done["test_top5"] <= 1.0


@pytest.mark.parametrize("strategy", ["horovod", "zero"])
def test_a_channels_last_conv_net_trains_under_horovod_as_a_contiguous_one_does(strategy, tmp_path):
    """The layout a GPU run takes by default: Horovod's collectives refuse a channels_last gradient,
    so its weights stay contiguous (zero's buckets copy them flat and keep channels_last)."""
    losses = []
    for layout in ("channels_last", "contiguous"):
        hvdtrain(
            "run", "resnet-torch", "--np", "2", "--strategy", strategy, "--variant", "debug",
            "--set", f"memory_format={layout}", "--set", "epochs=1", "--set", "steps_per_epoch=3",
            "--set", "checkpoint=false", run_dir=tmp_path / layout,
        )  # fmt: skip
        done = summary(tmp_path / layout)
        assert done["weights_consistent"] is True and done["steps"] == 3
        losses.append(done["final_loss"])
    assert losses[0] == pytest.approx(losses[1], rel=2e-3), losses  # oneDNN rounds each layout its way


def test_keras_resnet50_trains_on_two_ranks_with_the_same_weights(tmp_path):
    """Without its checkpoint (ResNet-50's weights and momentum, 200 MB): the Keras checkpoints are
    the digits recipes' tests'."""
    hvdtrain(
        "run", "resnet-tf", "--np", "2", "--launcher", "gloo", "--variant", "debug",
        "--set", "checkpoint=false", run_dir=tmp_path,
    )  # fmt: skip
    done = summary(tmp_path)
    assert done["weights_consistent"] is True and done["steps"] == 4
    assert 0.0 <= done["test_accuracy"] <= done["test_top5"] <= 1.0


@pytest.mark.parametrize("recipe", ["digits-mlp-torch", "digits-mlp-tf"])
def test_every_rank_stops_early_at_the_same_epoch_and_the_best_checkpoint_is_kept(recipe, tmp_path):
    """mode=max on the training loss, which falls: epoch 1 stays the best, and with patience 2 the
    run stops after epoch 3 of 10, every rank with it (one rank going on would hang in an allreduce)."""
    done = hvdtrain(
        "run", recipe, "--np", "2", "--launcher", "gloo", "--set", "epochs=10",
        "--set", "monitor=loss", "--set", "mode=max", "--set", "early_stopping_patience=2",
        run_dir=tmp_path, timeout=200,
    )  # fmt: skip
    epochs = [r for r in metric_records(tmp_path) if "epoch" in r]
    final = summary(tmp_path)
    assert [r["epoch"] for r in epochs] == [1, 2, 3]
    assert epochs[2]["loss"] < epochs[1]["loss"] < epochs[0]["loss"]
    assert final["stopped_early_at"] == 3 and final["best"] == epochs[0]["loss"]
    assert final["weights_consistent"] is True
    assert "early stopping after epoch 3" in done.output
    best = tmp_path / checkpoint.CHECKPOINTS / checkpoint.BEST
    record = json.loads((best / checkpoint.BEST_RECORD).read_text())
    assert record == {"monitor": "loss", "value": epochs[0]["loss"], "epoch": 1}
    assert checkpoint.read_manifest(best).epoch == 1
    assert checkpoint.latest(tmp_path).manifest.epoch == 3

"""The recipes' models and metrics in this process: torchvision's ResNet parameter counts and names,
the transformer's causality and optimizer groups, the metrics by name, and the best checkpoint and
early stopping of the torch loop (the multi-rank tier: tests/integration/test_recipes.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hvdtrain import registry  # noqa: E402
from hvdtrain.models.gpt import GPT, decayed_groups  # noqa: E402
from hvdtrain.models.resnet import ResNet  # noqa: E402
from hvdtrain.recipes import digits_mlp_torch, gpt_torch  # noqa: E402
from hvdtrain.runtime import checkpoint  # noqa: E402
from hvdtrain.runtime import torch as torch_runtime  # noqa: E402
from hvdtrain.runtime.torch.task import METRICS  # noqa: E402

TORCHVISION_PARAMETERS = {"resnet18": 11_689_512, "resnet34": 21_797_672, "resnet50": 25_557_032}
"""`sum(p.numel() for p in torchvision.models.<arch>().parameters())`, torchvision 0.x's documented counts."""


@pytest.mark.parametrize("arch", sorted(TORCHVISION_PARAMETERS))
def test_the_resnets_have_torchvisions_parameter_counts(arch):
    model = ResNet(arch)
    assert sum(p.numel() for p in model.parameters()) == TORCHVISION_PARAMETERS[arch]


def test_the_resnet50_state_dict_has_torchvisions_names_and_shapes():
    names = ResNet("resnet50").state_dict()
    assert len(names) == 320  # parameters and BatchNorm buffers, as torchvision's resnet50
    expected = {
        "conv1.weight": (64, 3, 7, 7),
        "bn1.running_var": (64,),
        "layer1.0.conv1.weight": (64, 64, 1, 1),
        "layer1.0.downsample.0.weight": (256, 64, 1, 1),
        "layer2.0.conv2.weight": (128, 128, 3, 3),  # v1.5: the 3x3 strides
        "layer4.2.bn3.num_batches_tracked": (),
        "fc.weight": (1000, 2048),
        "fc.bias": (1000,),
    }
    assert {name: tuple(names[name].shape) for name in expected} == expected
    assert ResNet("resnet50")(torch.randn(2, 3, 64, 64)).shape == (2, 1000)


def test_the_transformer_is_causal_tied_and_decays_only_its_matrices():
    torch.manual_seed(0)
    model = GPT(vocab=256, block_size=16, layers=2, heads=2, width=32).eval()
    tokens = torch.randint(0, 256, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :10], after[:, :10]) and not torch.equal(before[:, 10:], after[:, 10:])
    assert model.lm_head.weight is model.transformer.wte.weight
    decay, plain = decayed_groups(model, 0.1)
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in plain["params"])
    assert len(decay["params"]) + len(plain["params"]) == len(list(model.parameters()))
    assert (decay["weight_decay"], plain["weight_decay"]) == (0.1, 0.0)


def test_the_named_metrics_are_sums_over_samples():
    outputs = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    targets = torch.tensor([5, 5])
    assert METRICS["accuracy"](outputs, targets) == 1.0
    assert METRICS["top5"](outputs, targets) == 1.0  # the second's 5 is its sixth highest
    entropy = torch.nn.functional.cross_entropy(outputs, targets, reduction="sum")
    assert METRICS["loss"](outputs, targets) == pytest.approx(float(entropy))
    sequences, next_tokens = torch.randn(3, 7, 11), torch.randint(0, 11, (3, 7))
    per_token = torch.nn.functional.cross_entropy(sequences.reshape(-1, 11), next_tokens.reshape(-1))
    assert METRICS["perplexity"](sequences, next_tokens) / 3 == pytest.approx(float(per_token), rel=1e-6)


def test_every_torch_recipe_reports_the_metrics_it_declares():
    for recipe in registry.all_recipes().values():
        if recipe.framework != "torch" or recipe.preflight is not None and recipe.name != "resnet-torch":
            continue  # the recipes that read files are built in their own tests
        task = recipe.build(recipe.make_config("debug"))
        declared = set(recipe.metrics) if task.evaluate else set()
        assert {name for name in task.metrics if task.evaluate} == declared, recipe.name


def test_the_gpt_corpus_is_the_standard_librarys_english_split_by_position():
    config = gpt_torch.RECIPE.make_config("debug")
    split = gpt_torch.split(config)
    assert split.x_train.shape[1] == 64 and np.array_equal(split.x_train[:, 1:], split.y_train[:, :-1])
    held_out = len(split.y_test) * 64
    assert 0.09 < held_out / (held_out + len(split.y_train) * 64) < 0.11
    assert 3.0 < gpt_torch.unigram_loss(config) < 3.5  # English bytes: about 4.7 bits each


def train(run_dir, resume=False, **changes) -> dict:
    config = digits_mlp_torch.Config(**{"epochs": 6, "lr": 0.02, **changes})
    return torch_runtime.run(
        digits_mlp_torch.build, config, torch_runtime.LocalTorch(), run_dir, "digits-mlp-torch", resume
    )


def epochs_of(run_dir) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "epoch" in r]


def test_the_best_checkpoint_holds_the_model_of_the_best_epoch(tmp_path):
    done = train(tmp_path, monitor="test_accuracy", keep_checkpoints=2)
    accuracies = [r["test_accuracy"] for r in epochs_of(tmp_path)]
    best_epoch = accuracies.index(max(accuracies)) + 1
    best = tmp_path / "checkpoints" / "best"
    assert json.loads((best / "best.json").read_text()) == {
        "monitor": "test_accuracy",
        "value": max(accuracies),
        "epoch": best_epoch,
    }
    assert done["best"] == max(accuracies) and done["stopped_early_at"] is None
    task = digits_mlp_torch.build(digits_mlp_torch.Config())
    saved = torch.load(best / "checkpoint.pt", weights_only=True)
    task.model.load_state_dict(saved["model"])
    tested = torch_runtime.evaluate(task.model, task, torch_runtime.LocalTorch())
    assert tested["accuracy"] == max(accuracies) and saved["epoch"] == best_epoch


def test_early_stopping_resumes_with_its_patience_spent(tmp_path):
    """mode=max on a falling loss: epoch 1 stays the best. Three epochs, then a resume with patience
    3 stops at once after epoch 4: the epochs since the best came back with the checkpoint."""
    train(tmp_path, epochs=3, monitor="loss", mode="max", early_stopping_patience=5)
    done = train(tmp_path, resume=True, epochs=9, monitor="loss", mode="max", early_stopping_patience=3)
    records = epochs_of(tmp_path)
    assert [r["epoch"] for r in records] == [1, 2, 3, 4]
    assert done["stopped_early_at"] == 4 and done["best"] == records[0]["loss"]
    assert checkpoint.latest(tmp_path).manifest.epoch == 4

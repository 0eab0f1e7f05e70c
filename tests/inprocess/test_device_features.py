"""What a GPU run gets from the torch core, on the code paths a CPU takes too: channels-last for conv
nets, regional compilation, model FLOPs utilisation and tokens/s in the summary, the fused optimizer
choice, the fast gradient norm and the batch reader's placement rule."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hvdtrain.recipes import gpt_torch, resnet_torch  # noqa: E402
from hvdtrain.runtime import torch as torch_runtime  # noqa: E402
from hvdtrain.runtime.torch import backends, batches, speed  # noqa: E402
from hvdtrain.runtime.torch.task import fused_where_it_runs, make_optimizer  # noqa: E402


def tiny_gpt(**changes) -> gpt_torch.Config:
    return gpt_torch.Config(
        **{
            "epochs": 2,
            "steps_per_epoch": 3,
            "block_size": 32,
            "layers": 2,
            "heads": 2,
            "width": 32,
            "batch_size": 4,
            "checkpoint": False,
            **changes,
        }
    )


def test_channels_last_conv_net_trains_with_its_weights_and_batches_in_that_layout(tmp_path):
    config = resnet_torch.Config(
        arch="resnet18", width=8, image_size=32, num_samples=16, batch_size=4, epochs=2, steps_per_epoch=2
    )
    assert speed.wants_channels_last(config, torch.nn.Conv2d(3, 3, 1), torch.device("cpu")) is False
    config = resnet_torch.Config(**{**config.__dict__, "memory_format": "channels_last"})
    task = resnet_torch.build(config)
    done = torch_runtime.train(task, config, torch_runtime.LocalTorch(), tmp_path, "resnet-torch")
    conv = task.model.conv1.weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    assert done["steps"] == 4 and math.isfinite(done["final_loss"])
    reader = batches.BatchReader(task.data, 4, torch.device("cpu"), memory_format=torch.channels_last)
    inputs, _ = next(reader(np.arange(8)))
    assert inputs.is_contiguous(memory_format=torch.channels_last)


def test_gpt_flops_formula_agrees_with_torchs_count_and_the_summary_reports_mfu_and_tokens(
    tmp_path, monkeypatch
):
    config = tiny_gpt(vocab=300)
    task = gpt_torch.build(config)
    sample, target = batches.first_sample(task.data)
    counted = speed.counted_flops(task.model, sample, target, task.loss_fn)
    # the formula counts 6 per parameter per token (the embedding lookup as a matmul too); the count
    # sees every matmul and attention's two products: within a quarter at this tiny size
    assert 0.75 < task.flops_per_sample / counted < 1.25, (task.flops_per_sample, counted)
    assert task.model.lm_head.weight.shape[0] == 300

    monkeypatch.setenv(speed.PEAK_VARIABLE, "0.5")
    done = torch_runtime.train(task, config, torch_runtime.LocalTorch(), tmp_path, "gpt-torch")
    assert done["tokens_per_sec"] == pytest.approx(done["steady_samples_per_sec"] * 32)
    assert done["mfu"] == pytest.approx(task.flops_per_sample * done["steady_samples_per_sec"] / 0.5e12)
    assert done["peak_flops_source"] == "HVDTRAIN_PEAK_TFLOPS=0.5"
    assert done["peak_device_memory_bytes"] is None  # a CPU has no allocator peak to report


def test_without_a_known_peak_no_mfu_is_reported(tmp_path, monkeypatch):
    monkeypatch.delenv(speed.PEAK_VARIABLE, raising=False)
    config = tiny_gpt()
    done = torch_runtime.train(gpt_torch.build(config), config, torch_runtime.LocalTorch(), tmp_path, "gpt")
    assert "mfu" not in done and done["tokens_per_sec"] > 0


def test_a_counted_step_changes_nothing_the_run_keeps():
    config = resnet_torch.Config(arch="resnet18", width=8, image_size=32, num_samples=4)
    task = resnet_torch.build(config)
    before = {k: v.clone() for k, v in task.model.state_dict().items()}
    sample, target = batches.first_sample(task.data)
    flops = speed.counted_flops(task.model, sample, target, task.loss_fn)
    assert flops > 3 * 2 * 8 * 3 * 9 * 32 * 32 / 4  # at least the stem's convolution, three times
    after = task.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "running statistics untouched"
    assert task.model.training and all(p.grad is None for p in task.model.parameters())


def test_regional_compilation_compiles_each_block_and_trains_like_eager(tmp_path):
    from torch._dynamo.utils import counters

    config = tiny_gpt(steps_per_epoch=2)
    compiled_before = counters["stats"]["unique_graphs"]
    torch.manual_seed(config.seed)
    task = gpt_torch.build(tiny_gpt(compile=True, compile_scope="blocks", steps_per_epoch=2))
    blocks = list(task.model.transformer.h)
    regional = torch_runtime.train(
        task,
        tiny_gpt(compile=True, compile_scope="blocks", steps_per_epoch=2),
        torch_runtime.LocalTorch(),
        tmp_path / "regional",
        "gpt",
    )
    assert counters["stats"]["unique_graphs"] > compiled_before
    assert all(getattr(b.forward, "_torchdynamo_orig_callable", None) for b in blocks)
    assert "_torchdynamo_orig_callable" not in vars(task.model)  # the model's own forward stays eager
    torch.manual_seed(config.seed)
    eager = torch_runtime.train(
        gpt_torch.build(config), config, torch_runtime.LocalTorch(), tmp_path / "eager", "gpt"
    )
    assert regional["final_loss"] == pytest.approx(eager["final_loss"], rel=1e-3)


def test_deterministic_kernels_hold_for_the_run_and_torchs_settings_come_back(tmp_path):
    assert not torch.are_deterministic_algorithms_enabled()
    seen = []
    config = tiny_gpt(deterministic=True, steps_per_epoch=1, epochs=1)
    task = gpt_torch.build(config)
    loss_fn = task.loss_fn
    task.loss_fn = lambda out, target: (
        seen.append(torch.are_deterministic_algorithms_enabled()) or loss_fn(out, target)
    )
    done = torch_runtime.train(task, config, torch_runtime.LocalTorch(), tmp_path, "gpt")
    assert seen and all(seen) and math.isfinite(done["final_loss"])
    assert not torch.are_deterministic_algorithms_enabled()


def test_param_groups_given_as_a_generator_reach_the_optimizer():
    task = gpt_torch.build(tiny_gpt())
    task.param_groups = lambda model: model.parameters()
    optimizer = make_optimizer(task, task.model, 1e-3)
    assert len(optimizer.param_groups[0]["params"]) == len(list(task.model.parameters()))


def test_the_fused_optimizer_is_asked_for_only_where_torch_has_it():
    cpu = [torch.nn.Parameter(torch.zeros(2))]
    assert fused_where_it_runs(torch.optim.AdamW, cpu) == {}  # a CPU keeps torch's default
    assert fused_where_it_runs(functools.partial(torch.optim.SGD, momentum=0.9), cpu) == {}
    if torch.cuda.is_available():
        gpu = [torch.nn.Parameter(torch.zeros(2, device="cuda"))]
        assert fused_where_it_runs(functools.partial(torch.optim.SGD, momentum=0.9), gpu) == {"fused": True}
        assert fused_where_it_runs(functools.partial(torch.optim.AdamW, fused=False), gpu) == {}
        assert fused_where_it_runs(lambda groups, lr: torch.optim.SGD(groups, lr=lr), gpu) == {}
        assert fused_where_it_runs(functools.partial(torch.optim.SGD, foreach=True), gpu) == {}
        conv = torch.nn.Conv2d(3, 8, 3).cuda().to(memory_format=torch.channels_last)
        assert fused_where_it_runs(torch.optim.SGD, list(conv.parameters())) == {}  # a channels-last weight


def test_the_gradient_norm_is_the_float64_norm_however_the_gradient_is_split():
    torch.manual_seed(0)
    whole = torch.randn(1000) * 3
    parts = list(whole.split([1, 600, 0, 399]))
    exact = whole.double().square().sum()
    assert backends.squared_sum([whole]).item() == pytest.approx(exact.item(), rel=1e-14)
    assert backends.squared_sum(parts).sqrt().float() == exact.sqrt().float()
    grads = [g.clone() for g in parts]
    norm = backends.clip_to_norm(grads, backends.squared_sum(grads), 1.0)
    assert norm == exact.sqrt().float()
    assert torch.cat(grads).norm().item() == pytest.approx(1.0, rel=1e-5)


def test_arrays_go_to_a_gpu_whole_up_to_the_limit():
    assert batches.on_device_limit({}) == batches.ON_DEVICE_MB * 2**20
    assert batches.on_device_limit({batches.ON_DEVICE_VARIABLE: "0"}) == 0
    assert batches.on_device_limit({batches.ON_DEVICE_VARIABLE: "0.5"}) == 2**19
    assert batches.on_device_limit({batches.ON_DEVICE_VARIABLE: "lots"}) == batches.ON_DEVICE_MB * 2**20

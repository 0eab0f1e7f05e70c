"""`hvdtrain estimate`'s measured step, in this process on the small MLP: what the tensors hold is
what the model and SGD's momentum hold, autograd's saved tensors are counted, each gradient's time
is read, and the command prints every strategy's row."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from hvdtrain import registry
from hvdtrain.cli import main
from hvdtrain.measure.measured_step import matmul_flops, measure_step


@pytest.fixture(scope="module")
def measured():
    recipe = registry.get("digits-mlp-torch")
    return measure_step(recipe, recipe.make_config("debug"), steps=2, warmup=1)


def test_the_measured_step_holds_what_the_model_and_optimizer_hold(measured):
    hidden = registry.get("digits-mlp-torch").make_config("debug").hidden
    params = 64 * hidden + hidden + hidden * 10 + 10  # Linear(64, hidden), Linear(hidden, 10)
    assert measured.param_bytes == 4 * params
    assert measured.grad_bytes == 4 * params
    assert measured.optimizer_bytes == 4 * params  # SGD's momentum buffer, one a parameter
    # at least the hidden layer's output (ReLU saves it) and the batch the first layer saves
    batch = measured.batch_size
    assert measured.activation_bytes >= 4 * batch * (hidden + 64)
    assert measured.blocks == 2


def test_the_step_is_timed_in_its_parts(measured):
    assert 0 < measured.forward_s < measured.compute_s
    assert 0 < measured.backward_s < measured.compute_s
    times = [at for at, _ in measured.ready]
    assert times == sorted(times) and len(times) == 4  # two weights, two biases
    assert sum(size for _, size in measured.ready) == measured.grad_bytes
    assert times[-1] == pytest.approx(measured.backward_s)
    assert measured.flops_per_s and measured.flops_per_s > 1e8


def test_the_matmul_probe_counts_two_flops_a_multiply_add():
    assert matmul_flops("fp32", size=64, repeats=2) > 1e6  # the count, not the speed: the cores are shared


def test_the_command_prints_each_strategy_at_each_world_size():
    result = CliRunner().invoke(
        main,
        ["estimate", "digits-mlp-torch", "--variant", "debug", "--np", "2,8", "--link-gbps", "10", "--json"],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert [(r["strategy"], r["world_size"]) for r in report["rows"]] == [
        (s, n)
        for s in ("horovod", "ddp", "fsdp", "zero")
        for n in (2, 8)  # the registry's order
    ]
    horovod = report["rows"][0]
    assert horovod["sent_bytes"] == pytest.approx(report["step"]["grad_bytes"])  # 2(N-1)/N at N=2
    assert horovod["step_s"] >= horovod["compute_s"] > 0
    assert report["link"] == {"gbps": 10.0, "latency_s": 10e-6, "source": "given", "bytes_per_s": 1.25e9}


def test_a_step_of_several_backward_passes_sends_its_gradients_once(measured):
    """The gradients are averaged after the last pass, and each pass frees what it saved."""
    recipe = registry.get("digits-mlp-torch")
    config = recipe.make_config("debug")
    passes = measure_step(
        recipe, config.__class__(**{**vars(config), "backward_passes_per_step": 4}), steps=2, warmup=1
    )
    assert sum(size for _, size in passes.ready) == passes.grad_bytes == measured.grad_bytes
    assert len(passes.ready) == 4
    assert passes.activation_bytes <= 2 * measured.activation_bytes

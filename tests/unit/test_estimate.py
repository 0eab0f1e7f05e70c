"""`hvdtrain estimate`'s model on steps given by hand: bytes each rank sends, memory per rank under
each strategy, what overlap hides, a device's compute, Horovod's published 512-GPU case, and bad
input refused in one line before anything is measured."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from hvdtrain import strategies
from hvdtrain.cli import main
from hvdtrain.measure.estimate import (
    DEVICES,
    Link,
    Step,
    allreduce_s,
    check_link,
    on_device,
    parse_device,
    parse_world_sizes,
    predict_all,
)
from hvdtrain.measure.estimate import predict as predict_traffic
from hvdtrain.measure.measured_step import Report

MB = 2**20


def traffic(name: str):
    """The traffic the strategy of that name declares."""
    return strategies.all_strategies()[name].traffic


def predict(s: Step, name: str, n: int, link: Link):
    return predict_traffic(s, traffic(name), n, link, name=name)


def step(compute_s: float = 0.3, grad: int = 100 * MB, **changes) -> Step:
    """A step whose forward is a third of the compute and backward the other two thirds."""
    return Step(
        **{
            "param_bytes": grad,
            "grad_bytes": grad,
            "optimizer_bytes": 2 * grad,
            "activation_bytes": 50 * MB,
            "compute_s": compute_s,
            "forward_s": compute_s / 3,
            "backward_s": 2 * compute_s / 3,
            "batch_size": 64,
            **changes,
        }
    )


@pytest.mark.parametrize("n", [2, 8, 512])
def test_bytes_sent_per_rank_follow_the_ring(n):
    share = (n - 1) / n
    s, link = step(), Link(25)
    assert predict(s, "horovod", n, link).sent_bytes == pytest.approx(2 * share * 100 * MB)
    assert predict(s, "ddp", n, link).sent_bytes == pytest.approx(2 * share * 100 * MB)
    # zero's allreduce, then every rank's updated slice broadcast: an allgather of the parameters
    assert predict(s, "zero", n, link).sent_bytes == pytest.approx(3 * share * 100 * MB)
    # fsdp gathers the parameters in the forward and again in the backward, and reduce-scatters
    assert predict(s, "fsdp", n, link).sent_bytes == pytest.approx(3 * share * 100 * MB)
    compressed = predict(step(compressed=True), "horovod", n, link)
    assert compressed.sent_bytes == pytest.approx(share * 100 * MB)


def test_memory_per_rank_is_sharded_as_each_strategy_shards_it():
    s, link = step(), Link(25)
    every = {name: traffic(name) for name in ("horovod", "ddp", "zero", "fsdp")}
    rows = {r.strategy: r for r in predict_all(s, every, [4], link)}
    for name in ("horovod", "ddp"):
        assert (rows[name].param_bytes, rows[name].grad_bytes, rows[name].optimizer_bytes) == (
            100 * MB,
            100 * MB,
            200 * MB,
        )
    assert (rows["zero"].param_bytes, rows["zero"].grad_bytes, rows["zero"].optimizer_bytes) == (
        100 * MB,
        100 * MB,
        50 * MB,
    )
    stage2 = predict(step(zero_stage=2), "zero", 4, link)
    assert (stage2.grad_bytes, stage2.optimizer_bytes) == (25 * MB, 50 * MB)
    assert (rows["fsdp"].param_bytes, rows["fsdp"].grad_bytes, rows["fsdp"].optimizer_bytes) == (
        25 * MB,
        25 * MB,
        50 * MB,
    )
    assert all(row.activation_bytes == 50 * MB for row in rows.values())
    assert rows["horovod"].memory_bytes == 450 * MB


def test_one_rank_sends_nothing_and_is_fully_efficient():
    for name in ("horovod", "ddp", "zero", "fsdp"):
        row = predict(step(), name, 1, Link(1))
        assert (row.sent_bytes, row.exposed_s, row.efficiency) == (0, 0, 1)
        assert row.step_s == row.compute_s


def test_horovod_hides_behind_the_backward_what_a_fast_link_sends_in_time():
    s = step(compute_s=0.3)  # a 0.2 s backward
    fast = Link(100, latency_s=0)  # 100 MiB at 2 ranks: 8.4 ms, far under the backward
    row = predict(s, "horovod", 2, fast)
    assert row.comm_s == pytest.approx(allreduce_s(100 * MB, 2, fast))
    # only what the last gradients need after the backward ends stays exposed
    assert 0 < row.exposed_s < row.comm_s / 10
    assert row.efficiency > 0.99


def test_a_slow_link_exposes_what_the_backward_cannot_cover():
    s = step(compute_s=0.3)
    slow = Link(1, latency_s=0)  # 100 MiB at 2 ranks: 0.84 s, four times the backward
    row = predict(s, "horovod", 2, slow)
    whole = allreduce_s(100 * MB, 2, slow)
    # the link starts with the first gradients made and never waits again
    assert row.exposed_s == pytest.approx(whole - s.backward_s, rel=0.05)
    assert row.step_s == pytest.approx(s.compute_s + row.exposed_s)
    assert row.efficiency == pytest.approx(s.compute_s / row.step_s)
    # zero overlaps nothing: its allreduce and allgather are all exposed
    zero = predict(s, "zero", 2, slow)
    assert zero.exposed_s == pytest.approx(zero.comm_s)
    assert zero.exposed_s > row.exposed_s


def test_ddp_buckets_wait_until_full():
    s = step(ready=((0.1, 10 * MB), (0.2, 90 * MB)))
    link = Link(100, latency_s=0)
    row = predict(s, "ddp", 2, link)
    # the first bucket (1 MB) leaves at 0.1 s, the rest only once the backward's last gradient is made
    assert row.exposed_s == pytest.approx(allreduce_s(90 * MB, 2, link))


def test_the_latency_term_grows_with_the_ring():
    s = step()
    link = Link(25, latency_s=10e-6)
    small, large = predict(s, "horovod", 8, link), predict(s, "horovod", 512, link)
    assert large.efficiency < small.efficiency
    assert allreduce_s(0, 512, link) == pytest.approx(2 * 511 * 10e-6)


RESNET101_PARAMS = 44.5e6
P100_RESNET101_STEP_S = 0.49
"""ResNet-101 at batch 64 on one P100, fp32: TensorFlow's published DGX-1 P100 benchmark (synthetic
ImageNet, batch 64 per GPU, tf_cnn_benchmarks) gives 219 images/s for ResNet-50 (0.292 s a step)
and 91.8 for ResNet-152 (0.697 s); ResNet-101's 7.8 GFLOPs a forward lies between their 4.1 and
11.6, which puts its step at 0.49 s (130 images/s). It is also no faster than 64 x 3 x 2 x 7.8e9
FLOPs at the P100's 10.6 TFLOP/s fp32 peak allows (0.28 s)."""


def test_horovods_512_gpu_resnet101_case_lands_near_its_published_90_percent():
    """Horovod's docs/benchmarks.rst: 128 servers of 4 P100s on 25 Gbit/s RoCE, 90% scaling
    efficiency for ResNet-101 at 512 GPUs. The model's default latency (10 us a ring step), not one
    fitted to that figure; docs/performance.md says why it is above 90%."""
    grads = int(RESNET101_PARAMS * 4)
    s = Step(
        param_bytes=grads,
        grad_bytes=grads,
        optimizer_bytes=grads,  # SGD's momentum
        activation_bytes=0,
        compute_s=P100_RESNET101_STEP_S,
        forward_s=P100_RESNET101_STEP_S / 3,
        backward_s=2 * P100_RESNET101_STEP_S / 3,
        batch_size=64,
    )
    row = predict(s, "horovod", 512, Link(25))
    assert row.sent_bytes == pytest.approx(2 * 511 / 512 * 178e6)
    assert 0.90 <= row.efficiency <= 0.97
    # what it loses at 512 is the latency of the last messages, which nothing follows to hide them
    assert predict(s, "horovod", 512, Link(25, latency_s=0)).efficiency > 0.99
    # the brief's faster step (0.23 s) scales worse, still within 10 points of Horovod's figure
    quick = predict(s.scaled(0.23 / P100_RESNET101_STEP_S), "horovod", 512, Link(25))
    assert 0.80 <= quick.efficiency < row.efficiency


def test_a_device_scales_the_compute_by_its_peak_over_the_rate_measured_here():
    here = step(compute_s=1.0, flops_per_s=1e12, ready=((0.5, 60 * MB), (0.6, 40 * MB)))
    on_h100, line = on_device(here, DEVICES["h100"], None)
    assert on_h100.compute_s == pytest.approx(1.0 / 66.9)
    assert on_h100.ready[-1][0] == pytest.approx(0.6 / 66.9)
    assert "H100" in line
    on_half, _ = on_device(step(compute_s=1.0, flops_per_s=1e12, precision="bf16"), DEVICES["a100"], None)
    assert on_half.compute_s == pytest.approx(1.0 / 312)
    given, line = on_device(here, None, 230.0)
    assert given.compute_s == pytest.approx(0.23)
    assert given.backward_s == pytest.approx(here.backward_s * 0.23)
    assert "--compute-ms" in line


@pytest.mark.parametrize("text", ["0", "2,0", "-1", "a,b", "", "2,,8", "1.5"])
def test_world_sizes_must_be_positive_integers(text):
    with pytest.raises(ValueError, match="--np"):
        parse_world_sizes(text)


def test_world_sizes_parse_in_order_without_repeats():
    assert parse_world_sizes("2, 8,512,8") == [2, 8, 512]


def test_unknown_device_and_bad_link_are_refused():
    with pytest.raises(ValueError, match="p100, v100, a100, h100, h200"):
        parse_device("tpu")
    assert parse_device("H100") is DEVICES["h100"]
    with pytest.raises(ValueError, match="--link-gbps"):
        check_link(-1, 10)
    with pytest.raises(ValueError, match="--link-gbps"):
        check_link(0, 10)
    with pytest.raises(ValueError, match="--latency-us"):
        check_link(25, -1)


@pytest.mark.parametrize(
    "args, says",
    [
        (["no-such-recipe"], "unknown recipe 'no-such-recipe'"),
        (["digits-mlp-torch", "--np", "0"], "--np"),
        (["digits-mlp-torch", "--np", "2,x"], "--np"),
        (["digits-mlp-torch", "--link-gbps", "-5"], "--link-gbps"),
        (["digits-mlp-torch", "--link-gbps", "fast"], "--link-gbps"),
        (["digits-mlp-torch", "--device", "tpu"], "--device"),
        (["digits-mlp-torch", "--device", "p100", "--compute-ms", "200"], "not both"),
        (["digits-mlp-torch", "--compute-ms", "-3"], "--compute-ms"),
        (["digits-mlp-torch", "--strategies", "ps"], "--strategies"),
        (["digits-mlp-tf"], "torch recipes"),
        (["digits-mlp-torch", "--set", "no_such_field=1"], "no_such_field"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, says):
    result = CliRunner().invoke(main, ["estimate", *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hvdtrain: error:") and says in lines[0], result.output


def test_only_the_strategies_that_declare_their_traffic_are_estimated():
    declared = {s.name for s in strategies.all_strategies().values() if s.traffic is not None}
    assert declared == {"horovod", "ddp", "zero", "fsdp"}


def test_the_json_of_a_report_has_every_row():
    s = step()
    rows = predict_all(s, {"horovod": traffic("horovod"), "fsdp": traffic("fsdp")}, [2, 8], Link(25))
    report = json.loads(json.dumps(Report("r", s, Link(25), "given", rows).to_dict()))
    assert [(r["strategy"], r["world_size"]) for r in report["rows"]] == [
        ("horovod", 2),
        ("horovod", 8),
        ("fsdp", 2),
        ("fsdp", 8),
    ]
    assert report["link"]["bytes_per_s"] == 25e9 / 8

"""The `scaling` and `eight-hosts` bench sections' arithmetic and verdicts, without running a rank."""

from __future__ import annotations

import numpy as np
import pytest


def test_the_declared_matrix_is_the_whole_one_and_each_axis_narrows_from_the_environment():
    from benchmarks import scaling

    whole = scaling.matrix_from({})
    assert whole.recipes == ("gpt-torch", "gpt-torch-64-tokens", "resnet-torch")
    assert whole.ranks == (1, 2, 4, 8)
    assert whole.rates == (100.0, 1000.0, 10000.0, None)
    assert {"horovod-fp16", "horovod-gloo-fp16", "zero-1", "fsdp"} <= set(whole.paths)
    narrowed = scaling.matrix_from(
        {
            "SCALING_RECIPES": "gpt-torch",
            "SCALING_RANKS": "8,2,4,2",
            "SCALING_RATES": "100, 1000,none",
            "SCALING_PATHS": "horovod-gloo,ddp",
            "SCALING_REPEATS": "3",
        }
    )
    assert narrowed == scaling.Matrix(
        ("gpt-torch",), (2, 4, 8), (100.0, 1000.0, None), ("horovod-gloo", "ddp"), 3
    )


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"SCALING_PATHS": "horovod-bf16"}, "no bf16 gradient compressor"),
        ({"SCALING_RECIPES": "bert"}, "unknown recipe bert"),
        ({"SCALING_RANKS": "16"}, "ranks are 1 to 8"),
        ({"SCALING_RATES": "-5"}, "positive"),
        ({"SCALING_REPEATS": "0"}, "1 or more"),
    ],
)
def test_a_matrix_it_cannot_run_is_refused_by_name(variables, message):
    from benchmarks import scaling

    with pytest.raises(ValueError, match=message):
        scaling.matrix_from(variables)


def test_the_step_splits_into_the_ceilings_compute_and_the_exposed_rest():
    from dataclasses import replace

    from benchmarks.scaling import Point

    # 4 ranks x batch 8 = 32 samples a step; 16 samples/s: 2 s a step; the ceiling 64 samples/s: 0.5 s
    point = Point("gpt-torch", "horovod-mpi", 4, 100.0, 16.0, 8, 64.0, predicted_step_s=1.8, link_busy_s=1.2)
    assert point.step_s == pytest.approx(2.0)
    assert point.compute_s == pytest.approx(0.5)
    assert point.exposed_s == pytest.approx(1.5)
    assert point.efficiency == pytest.approx(0.25)
    assert point.limit == "link"
    assert point.prediction_error == pytest.approx(-0.1)
    fast = Point("gpt-torch", "ddp", 4, None, 48.0, 8, 64.0)
    assert fast.limit == "compute" and fast.prediction_error is None
    assert Point("gpt-torch", "ddp", 4, None, 10.0, 8, 64.0).limit == "comm (CPU)"
    # shaped, but the bytes at the link's rate take less than the compute: not the link
    assert replace(point, link_busy_s=0.3).limit == "comm (CPU)"


def test_the_fastest_path_at_each_point_and_the_goals_read_off_one_run():
    from benchmarks.scaling import Point, goal_lines, winners

    def point(path, ranks, rate, samples):
        return Point(
            "gpt-torch", path, ranks, rate, samples, 8, 100.0, link_busy_s=None if rate is None else 9.0
        )

    points = [
        point("horovod-gloo", 8, 1000.0, 30.0),
        point("horovod-mpi", 8, 1000.0, 40.0),
        point("horovod-fp16", 8, 1000.0, 45.0),
        point("ddp", 8, 1000.0, 40.0),
        point("horovod-mpi", 8, 100.0, 10.0),  # 6.4 s a step against 0.64 s of compute: link-bound
        point("horovod-fp16", 8, 100.0, 18.0),
        point("horovod-gloo", 8, 100.0, 10.0),
        point("horovod-gloo-fp16", 8, 100.0, 17.0),
        point("horovod-mpi", 8, None, 90.0),  # not link-bound: no fp16 verdict
        point("horovod-fp16", 8, None, 90.0),
    ]
    assert winners(points)[("gpt-torch", 1000.0, 8)] == "horovod-fp16"
    assert winners(points)[("gpt-torch", 100.0, 8)] == "horovod-fp16"
    lines = goal_lines(points)
    assert lines[0] == (
        "gpt-torch at 1 Gbit/s, 8 ranks: horovod's best (horovod-fp16) / ddp samples/s 1.12  "
        "(goal >= 1.1: met)"
    )
    assert lines[1:] == [
        "gpt-torch at 1 Gbit/s, 8 ranks (link-bound): fp16 compression / uncompressed "
        "(horovod-fp16 / horovod-mpi) 1.12  (goal >= 1.5: not met)",
        "gpt-torch at 100 Mbit/s, 8 ranks (link-bound): fp16 compression / uncompressed "
        "(horovod-fp16 / horovod-mpi) 1.80  (goal >= 1.5: met)",
        "gpt-torch at 100 Mbit/s, 8 ranks (link-bound): fp16 compression / uncompressed "
        "(horovod-gloo-fp16 / horovod-gloo) 1.70  (goal >= 1.5: met)",
    ]


def test_the_model_is_given_the_ceilings_compute_and_the_shaped_link():
    from benchmarks.scaling import predicted
    from hvdtrain.measure.estimate import Link, Step

    step = Step(
        param_bytes=8_000_000, grad_bytes=8_000_000, optimizer_bytes=0, activation_bytes=0,
        compute_s=0.1, forward_s=0.03, backward_s=0.06,
    )  # fmt: skip
    # 2 ranks, allreduce of 8 MB at 100 Mbit/s: 8e6 / 12.5e6 = 0.64 s, mostly after a 0.12 s backward
    plain = predicted(step, "horovod-mpi", 2, 100.0, 0.2, Link(10.0)).step_s
    fp16 = predicted(step, "horovod-fp16", 2, 100.0, 0.2, Link(10.0)).step_s
    assert 0.7 < plain < 0.2 + 0.65 and fp16 < plain * 0.6
    assert predicted(step, "horovod-mpi", 1, 100.0, 0.2, Link(10.0)).step_s == pytest.approx(0.2)


def test_every_workload_is_a_recipe_and_command_line_words_and_tune_link_runs_one():
    from benchmarks import scaling, tune_link
    from hvdtrain import registry

    for workload, (recipe, settings) in scaling.RECIPES.items():
        assert registry.get(recipe).name == recipe, workload
        assert settings and all(isinstance(word, str) for word in settings), workload
    words = tune_link.settings()
    assert all(isinstance(word, str) for word in words)
    assert words[-2:] == ("--set", "checkpoint=false") and "batch_size=8" in words


def test_eight_hosts_requires_the_same_weights_where_the_math_is_the_same():
    from benchmarks.eight_hosts import _runs, digest_verdicts, largest_difference, trained_everywhere

    same = {"horovod mpi": "a" * 64, "mpi flat 4x2": "a" * 64, "mpi hierarchical 4x2": "a" * 64}
    assert digest_verdicts({**same, "horovod gloo": "b" * 64}) == []  # gloo sums in another order
    assert digest_verdicts({**same, "mpi hierarchical 4x2": "c" * 64}) == [
        "mpi flat 4x2 and mpi hierarchical 4x2 differ (aaaaaaaaaaaa vs cccccccccccc)"
    ]
    assert largest_difference([np.array([2.0, -4.0])], [np.array([2.0, -4.0004])]) == pytest.approx(1e-4)
    good = {"world_size": 8, "weights_consistent": True, "hosts": [f"h{i}" for i in range(8)]}
    assert trained_everywhere(good, 8, [f"h{i}" for i in range(8)]) == []
    assert trained_everywhere({**good, "world_size": 6, "weights_consistent": False}, 8, []) == [
        "world_size 6 != 8",
        "weights_consistent is not true",
        "ran on ['h0', 'h1', 'h2', 'h3', 'h4', 'h5', 'h6', 'h7']",
    ]
    assert _runs([8, 8, 8, 6, 6, 8]) == "8x3 6x2 8x1"

"""ZeRO's bookkeeping in one process: which slice of the flat, padded parameters a rank owns, that
stepping the slice updates the model in place, and how a whole optimizer state dict (a plain run's,
any world size's) becomes a rank's slices."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from hvdtrain.runtime.torch.zero import Bucket, ShardedOptimizer
from hvdtrain.runtime.torch.zero_checkpoint import whole_state


def params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(5)),
        torch.nn.Parameter(torch.randn(2, 3)),
        torch.nn.Parameter(torch.randn(1)),
    ]


def test_each_rank_owns_a_contiguous_equal_slice_of_the_padded_parameters():
    ps = params()
    before = torch.cat([p.detach().reshape(-1) for p in ps]).clone()
    bucket = Bucket(ps, rank=1, size=5)  # 12 values, padded to 15: slices of 3 values
    assert (bucket.padded, bucket.shard_size) == (15, 3)
    assert torch.equal(bucket.shard.detach(), before[3:6])
    assert torch.equal(bucket.flat[12:], torch.zeros(3))
    with torch.no_grad():
        bucket.shard.add_(1.0)  # what the optimizer's step does to this rank's slice
    assert torch.equal(ps[0].detach(), torch.cat([before[:3], before[3:5] + 1]))
    assert torch.equal(ps[1].detach().reshape(-1)[:1], before[5:6] + 1)
    assert ps[1].shape == (2, 3) and ps[1].is_leaf and ps[1].requires_grad


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_a_whole_state_dict_becomes_this_ranks_slices(rank):
    model_params = params()
    whole = torch.optim.SGD(
        [{"params": model_params[:2]}, {"params": model_params[2:], "weight_decay": 0.1}],
        lr=0.1,
        momentum=0.9,
    )
    for p in model_params:
        p.grad = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) + 1
    whole.step()
    saved = whole.state_dict()

    ps = params()
    groups = [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.1}]
    sharded = ShardedOptimizer(groups, partial(torch.optim.SGD, lr=0.1, momentum=0.9), None, rank, 3, 1)
    sharded.load_full(saved)
    momenta = torch.cat([saved["state"][i]["momentum_buffer"].reshape(-1) for i in (0, 1)])
    padded = torch.cat([momenta, torch.zeros(1)])  # 11 values padded to 12, slices of 4
    first = sharded.state[sharded.buckets[0].shard]["momentum_buffer"]
    assert torch.equal(first, padded[rank * 4 : rank * 4 + 4])
    assert sharded.param_groups[1]["weight_decay"] == 0.1


def test_a_state_of_other_shapes_is_refused_in_one_line():
    whole = torch.optim.SGD(
        [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(8))], lr=0.1, momentum=0.9
    )
    for p in whole.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    whole.step()
    sharded = ShardedOptimizer(
        [{"params": params()[:2]}], partial(torch.optim.SGD, lr=0.1, momentum=0.9), None, 0, 2, 1
    )
    with pytest.raises(ValueError, match="the recipe's parameters changed shape"):
        sharded.load_full(whole.state_dict())


def test_a_frozen_parameter_is_left_out_of_the_slices_but_keeps_its_place_in_the_state_dict():
    ps = params()
    ps[1].requires_grad_(False)
    whole = torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    for p in ps:
        p.grad = torch.ones_like(p) if p.requires_grad else None
    whole.step()
    saved = whole.state_dict()
    assert sorted(saved["state"]) == [0, 2]  # the frozen parameter has no state

    fresh = params()
    fresh[1].requires_grad_(False)
    frozen = fresh[1].detach().clone()
    sharded = ShardedOptimizer(
        [{"params": fresh}], partial(torch.optim.SGD, lr=0.1, momentum=0.9), None, 0, 1, 1
    )
    assert sharded.buckets[0].numels == [5, 1]  # the frozen 2x3 is not in the buffer
    sharded.load_full(saved)
    momentum = sharded.state[sharded.buckets[0].shard]["momentum_buffer"]
    assert torch.equal(
        momentum, torch.cat([saved["state"][0]["momentum_buffer"], saved["state"][2]["momentum_buffer"]])
    )
    assert torch.equal(fresh[1].detach(), frozen)


def test_a_checkpoint_without_the_state_of_a_trainable_parameter_is_refused_in_one_line():
    whole = torch.optim.SGD(params(), lr=0.1, momentum=0.9)
    whole.param_groups[0]["params"][0].grad = torch.ones(5)  # only the first has a gradient, and state
    whole.step()
    sharded = ShardedOptimizer(
        [{"params": params()}], partial(torch.optim.SGD, lr=0.1, momentum=0.9), None, 0, 2, 1
    )
    with pytest.raises(ValueError, match="has no 'momentum_buffer' for some trainable parameters"):
        sharded.load_full(whole.state_dict())


def adam_state(ps: list[torch.nn.Parameter]) -> dict:
    """A plain AdamW's state dict after two steps, over two groups with a frozen parameter."""
    whole = torch.optim.AdamW([{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}], lr=0.1)
    for step in range(2):
        for p in ps:
            p.grad = (
                (torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) + step)
                if p.requires_grad
                else None
            )
        whole.step()
    return whole.state_dict()


def ranks_of(size: int, saved: dict) -> list[ShardedOptimizer]:
    """Every rank's optimizer of a world of `size`, each with its slices of `saved`."""
    out = []
    for rank in range(size):
        ps = params()
        ps[1].requires_grad_(False)
        groups = [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}]
        sharded = ShardedOptimizer(groups, partial(torch.optim.AdamW, lr=0.1), None, rank, size, 2)
        sharded.load_full(saved)
        out.append(sharded)
    return out


def same_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"] and sorted(a["state"]) == sorted(b["state"])
    for index, values in a["state"].items():
        assert sorted(values) == sorted(b["state"][index])
        for key, value in values.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][index][key])), (index, key)


@pytest.mark.parametrize("size", [1, 3, 4])
def test_every_ranks_file_makes_the_whole_state_again_and_it_reshards_to_another_world(size):
    """A sharded checkpoint's files, each rank's slices, put together: the plain AdamW's state dict
    (moments, the step, a frozen parameter's place), and re-sliced for another world size."""
    ps = params()
    ps[1].requires_grad_(False)
    saved = adam_state(ps)
    files = [sharded.shard_state() for sharded in ranks_of(size, saved)]
    whole = whole_state(files)
    same_state(whole, saved)
    resharded = ranks_of(2, whole)
    assert [len(r.state[r.buckets[0].shard]["exp_avg"]) for r in resharded] == [3, 3]  # 5 values, padded to 6
    same_state(whole_state([rank.shard_state() for rank in resharded]), saved)


def test_a_ranks_own_file_of_other_shapes_is_refused_in_one_line():
    ps = params()
    ps[1].requires_grad_(False)
    own = ranks_of(2, adam_state(ps))[0].shard_state()
    other = ShardedOptimizer(
        [{"params": [torch.nn.Parameter(torch.randn(6))]}, {"params": [torch.nn.Parameter(torch.randn(1))]}],
        partial(torch.optim.AdamW, lr=0.1),
        None,
        0,
        2,
        2,
    )
    with pytest.raises(
        ValueError, match=r"shapes \[\[\[5\]\], \[\[1\]\]\], the recipe's are \[\[\[6\]\], .*changed shape"
    ):
        other.load_shard(own)
    with pytest.raises(ValueError, match="disagree on how the state is sharded"):
        whole_state([own])  # one of two ranks' files


def test_a_state_of_one_value_a_parameter_is_not_sliced():
    """NAdam keeps mu_product, one value a parameter beside its per-element moments: it goes whole to
    every rank and comes back as it was."""
    ps = params()
    whole = torch.optim.NAdam(ps, lr=0.1)
    for p in ps:
        p.grad = torch.ones_like(p)
    whole.step()
    saved = whole.state_dict()
    files = []
    for rank in range(2):
        sharded = ShardedOptimizer(
            [{"params": params()}], partial(torch.optim.NAdam, lr=0.1), None, rank, 2, 1
        )
        sharded.load_full(saved)
        files.append(sharded.shard_state())
    same_state(whole_state(files), saved)

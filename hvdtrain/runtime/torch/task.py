"""What a torch recipe gives the runtime: a model, its data, how to make its optimizer, its metrics."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hvdtrain.data import Split

Metric = Callable[[torch.Tensor, torch.Tensor], float]
"""(outputs, targets) of one test batch -> the metric summed over its samples; the runtime sums it
over batches and ranks and divides by the number of samples."""


def correct(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Top-1 hits: the mean over the test set is the accuracy."""
    return float((outputs.argmax(dim=1) == targets).sum())


def top5(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Samples whose target is among the five highest outputs (all of them with five classes or fewer)."""
    best = outputs.topk(min(5, outputs.shape[1]), dim=1).indices
    return float((best == targets.unsqueeze(1)).any(dim=1).sum())


def cross_entropy_sum(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Each sample's mean cross-entropy over its positions (one for a class, one per token for a
    sequence of logits (batch, positions, classes)), summed over the samples: the mean over the test
    set is the test loss, and its exponential the perplexity (hvdtrain.runtime.metrics.finish)."""
    per_position = torch.nn.functional.cross_entropy(
        outputs.float().reshape(-1, outputs.shape[-1]), targets.reshape(-1), reduction="none"
    )
    return float(per_position.view(len(targets), -1).mean(dim=1).sum())


METRICS: dict[str, Metric] = {
    "accuracy": correct,
    "top5": top5,
    "loss": cross_entropy_sum,
    "perplexity": cross_entropy_sum,
}
"""The metrics hvdtrain knows (hvdtrain.runtime.metrics.GOALS), for classifiers and language models
trained with cross-entropy: `metrics=named("loss", "perplexity")`."""


def named(*names: str) -> dict[str, Metric]:
    return {name: METRICS[name] for name in names}


def all_parameters(model: torch.nn.Module) -> list[dict[str, Any]]:
    """One parameter group of every parameter."""
    return [{"params": list(model.parameters())}]


@dataclass
class Datasets:
    """Data read from disk as training goes, instead of arrays in memory: map-style datasets (a
    torch Dataset, or anything with `len` and `[i]` -> (input, target), e.g. hvdtrain.data.ImageFolder).
    Each rank reads only its shard, in batches, with a DataLoader's worker processes."""

    train: Any
    test: Any
    workers: int = 2
    """DataLoader worker processes per rank (0: read in the training process)."""


@dataclass
class TorchTask:
    """What a torch recipe builds: framework code only, no distribution. The backend builds the
    optimizer from `optimizer` and `param_groups`, so a backend may wrap or shard it."""

    model: torch.nn.Module
    data: Split | Datasets
    """Arrays in memory, or datasets read from disk batch by batch."""
    optimizer: Callable[..., torch.optim.Optimizer]
    """An optimizer class or factory, called with the parameter groups and `lr=` the scheduled lr,
    e.g. `functools.partial(torch.optim.SGD, momentum=0.9)`."""
    param_groups: Callable[[torch.nn.Module], list[dict[str, Any]]] = all_parameters
    """The model -> torch's parameter groups (per-group options such as weight_decay)."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.nn.functional.cross_entropy
    metrics: Mapping[str, Metric] = field(default_factory=lambda: {"accuracy": correct})
    """Evaluation metrics by name, reported as test_<name>."""
    evaluate: bool = True
    """False for throughput recipes, whose test set means nothing."""
    blocks: Callable[[torch.nn.Module], list[torch.nn.Module]] | None = None
    """The model -> the modules `--strategy fsdp` shards one at a time (a transformer's layers), each
    gathered whole only while it computes; None: the model's top-level children that hold parameters.
    Also what `compile_scope=blocks` compiles, one block at a time."""
    tokens_per_sample: int | None = None
    """Tokens a training sample holds (a language model's context): the run reports tokens/s."""
    flops_per_sample: float | None = None
    """Floating-point operations of one training sample, forward and backward (a transformer's 6 x
    parameters x tokens plus attention); None: counted on the device from one sample's step where
    the run reports model FLOPs utilisation."""


def blocks_of(task: TorchTask, model: torch.nn.Module) -> list[torch.nn.Module]:
    """The recipe's blocks of `model`, else its top-level children that hold parameters."""
    if task.blocks is not None:
        return task.blocks(model)
    return [child for child in model.children() if any(True for _ in child.parameters())]


def fused_where_it_runs(optimizer: Callable[..., torch.optim.Optimizer], params: list) -> dict[str, Any]:
    """`fused=True` for an optimizer class of torch's that has a fused kernel (SGD, Adam, AdamW), over
    plain, contiguous floating-point CUDA tensors: one kernel a step instead of several per parameter.
    Fused kernels want a parameter, its gradient and its state in one layout, which a channels-last
    weight and the contiguous gradient or state that Horovod's optimizer broadcast or a checkpoint
    gives it need not share. Elsewhere (the CPU, channels-last conv weights, sharded DTensors, an
    optimizer of the recipe's own or one already told fused= or foreach=) torch's default."""
    factory = optimizer
    given = dict(getattr(factory, "keywords", None) or {})
    while isinstance(factory, functools.partial):
        factory = factory.func
    accepts = isinstance(factory, type) and "fused" in inspect.signature(factory.__init__).parameters
    plain_cuda = bool(params) and all(
        type(p) in (torch.Tensor, torch.nn.Parameter)
        and p.is_cuda
        and p.is_floating_point()
        and p.is_contiguous()
        for p in params
    )
    told = "fused" in given or given.get("foreach")
    return {"fused": True} if accepts and plain_cuda and not told else {}


def make_optimizer(task: TorchTask, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """The task's optimizer over its parameter groups of `model` (the model on its device), fused
    where torch has a fused kernel for it on that device."""
    groups = list(task.param_groups(model))  # a generator of parameters is read once, here
    return task.optimizer(groups, lr=lr, **fused_where_it_runs(task.optimizer, params_of(groups)))


def params_of(groups: list) -> list[torch.Tensor]:
    """Every tensor of torch's parameter groups (dicts with "params", or tensors themselves); a
    group's iterator of parameters becomes a list, so the optimizer still finds them."""
    found = []
    for group in groups:
        if isinstance(group, dict):
            if torch.is_tensor(group["params"]):
                found.append(group["params"])
            else:
                group["params"] = list(group["params"])
                found += group["params"]
        else:
            found.append(group)
    return found

"""FSDP2 (`--strategy fsdp`, torch): torchrun starts the ranks as under ddp, and `fully_shard` splits
every parameter across them, block by block (the recipe's `blocks`, else the model's top-level
children), so each rank keeps 1/N of the parameters, their gradients and the optimizer's state. A
block is gathered whole only while it computes; its gradients are reduce-scattered in the backward.

The parameters are DTensors. The optimizer is built after sharding, over them, so its state is
sharded too. Checkpoints are whole, in the plain format (checkpoint.pt: "model", "optimizer" keyed
by parameter index, the position), gathered to rank 0: a horovod or ddp run's checkpoint resumes
under fsdp and the other way round, at any world size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from hvdtrain.runtime import checkpoint, within
from hvdtrain.runtime.torch.backends import clip_to_norm, local, squared_sum, whole
from hvdtrain.runtime.torch.checkpointer import FILE, Rank0Checkpointer, per_element, restore_random_states
from hvdtrain.runtime.torch.ddp import TorchDDP
from hvdtrain.runtime.torch.task import blocks_of, make_optimizer


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A whole tensor that every rank holds, split as `like` is (no communication)."""
    if not isinstance(like, DTensor):
        return full.to(like.device)
    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


class TorchFSDP(TorchDDP):
    name = "fsdp"
    forwards_are_collective = True  # each forward gathers the blocks' parameters
    channels_last_parameters = False  # fully_shard splits contiguous parameters only

    def build_optimizer(self, task, model, lr, config):
        # every rank shards rank 0's initial weights; the optimizer is built over the shards
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)
        for block in blocks_of(task, model):
            fully_shard(block)
        fully_shard(model)
        return make_optimizer(task, model, lr)

    def wrap_model(self, model, config):
        return model  # sharded in place by build_optimizer

    def clip_grad_norm(self, model, optimizer, max_norm: float) -> torch.Tensor:
        """The whole gradient's norm from every rank's shards, and this rank's shards clipped."""
        grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
        squared = squared_sum(grads)
        dist.all_reduce(squared)
        return clip_to_norm(grads, squared, max_norm)

    def agree_on_overflow(self, found_inf: torch.Tensor) -> None:
        """Each rank's GradScaler saw only its shards: a step overflowed where any shard did."""
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)

    def checkpointer(self) -> FsdpCheckpointer:
        return FsdpCheckpointer(self)


class FsdpCheckpointer(Rank0Checkpointer):
    """Whole checkpoints: every rank gathers each sharded tensor in turn, rank 0 writes them."""

    def whole_states(self, model, optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        model_state = {name: whole(value).cpu() for name, value in model.state_dict().items()}
        saved = optimizer.state_dict()
        state = {
            index: {
                key: whole(value).cpu() if torch.is_tensor(value) else value for key, value in values.items()
            }
            for index, values in sorted(saved["state"].items())
        }
        return model_state, {"state": state, "param_groups": saved["param_groups"]}

    def load(self, run_dir, model, optimizer, resume) -> dict[str, Any] | None:
        payload = [self._saved(run_dir) if resume and self.backend.rank == 0 else None]
        dist.broadcast_object_list(payload, src=0)
        if (saved := payload[0]) is None:
            if not optimizer.state:
                first_step(model, optimizer)
            return None
        return restore_random_states(self.backend, self._apply(saved, model, optimizer))

    def read(self, run_dir, model, optimizer) -> dict[str, Any] | None:
        return self._apply(self._saved(run_dir), model, optimizer)

    def _saved(self, run_dir) -> dict[str, Any]:
        found = checkpoint.latest(run_dir, "torch")
        if found is None or FILE not in found.files:
            raise FileNotFoundError(f"--resume: no checkpoint in {run_dir}")
        saved = torch.load(found.path(FILE), weights_only=True, map_location="cpu")
        print(f"resuming from {found.path(FILE)} {within.where(saved)}", flush=True)
        return saved

    @staticmethod
    def _apply(saved: dict[str, Any], model, optimizer) -> dict[str, Any]:
        """A whole checkpoint, which this rank holds, into its shards; returns the position."""
        ours = model.state_dict()
        for name, value in ours.items():
            found = saved["model"].get(name)
            if found is None or found.shape != value.shape:
                had = "nothing" if found is None else f"shape {tuple(found.shape)}"
                raise ValueError(
                    f"the checkpoint has {had} for {name}, of shape {tuple(value.shape)} here: "
                    "the recipe's parameters changed"
                )
        with torch.no_grad():
            for name, value in ours.items():
                local(value).copy_(local(shard_like(saved["model"][name], value)))
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = {
            index: {
                key: shard_like(value, params[index]) if per_element(key, value) else value
                for key, value in values.items()
            }
            for index, values in saved["optimizer"]["state"].items()
        }
        optimizer.load_state_dict({"state": state, "param_groups": saved["optimizer"]["param_groups"]})
        return {key: value for key, value in saved.items() if key not in ("model", "optimizer")}


def first_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A fresh optimizer's first step, of zero gradients, as Horovod's broadcast_optimizer_state takes
    it to create the state: an fsdp run then takes the steps a horovod one takes (Adam counts that
    step in its bias correction, AdamW's decay shrinks the weights by it)."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad()

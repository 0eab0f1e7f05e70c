"""ZeRO (stages 1 and 2) on Horovod's own collectives: each rank keeps the optimizer state of its
own 1/N of the parameters, and at stage 2 only that 1/N of the averaged gradient.

Each parameter group's parameters become views into one flat buffer, padded to a multiple of the
world size, in the group's order. Rank r owns the contiguous slice r of every buffer: balanced by
element, not by tensor. At stage 1 the parameters' gradients are views into a flat gradient buffer
of the same layout, which the backward passes fill in place; stage 2 copies the gradients into a
new flat buffer, freeing each as it goes. The flat gradient is averaged by an in-place allreduce
and a rank keeps only its slice; the wrapped optimizer steps that slice alone (its state lives only
there), which updates the rank's part of the parameters in place, and each rank's broadcast of its
slice brings every rank's part back into each rank's buffer. Any optimizer whose state is per
element (SGD with momentum, Adam, AdamW) works so, with parameter groups and weight decay: the
padding's zeros have zero gradients and stay zero.

Checkpoints are sharded, a file a rank (hvdtrain.runtime.torch.zero_checkpoint). A whole checkpoint
(plain Horovod's, or a zero one consolidated) resumes under zero at any world size: each rank keeps
its slices of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from hvdtrain.runtime.torch.backends import HorovodTorch, clip_to_norm, squared_sum
from hvdtrain.runtime.torch.checkpointer import Checkpointer, per_element
from hvdtrain.runtime.torch.task import fused_where_it_runs, params_of
from hvdtrain.runtime.torch.zero_checkpoint import ZeroCheckpointer


class Bucket:
    """One parameter group's parameters as views into one flat, padded buffer, and this rank's slice."""

    def __init__(self, params: list[torch.Tensor], rank: int, size: int) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1 or not params[0].is_floating_point():
            raise ValueError(f"--strategy zero needs one floating dtype per parameter group, got {dtypes}")
        self.params = params
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.gradient: torch.Tensor | None = None
        """Stage 1's flat gradient, which the parameters' gradients are views of (attach_gradients)."""
        total = sum(self.numels)
        self.padded = -(-total // size) * size
        self.shard_size = self.padded // size
        self.flat = torch.zeros(self.padded, dtype=params[0].dtype, device=params[0].device)
        offset = 0
        with torch.no_grad():
            for p, n in zip(params, self.numels, strict=True):
                self.flat[offset : offset + n].copy_(p.reshape(-1))
                p.data = self.flat[offset : offset + n].view_as(p)
                offset += n
        start = rank * self.shard_size
        # a Parameter shares the slice's storage: stepping it updates the model's parameters in place
        self.shard = torch.nn.Parameter(self.flat[start : start + self.shard_size], requires_grad=False)

    def attach_gradients(self) -> None:
        """Each parameter's gradient a zeroed view into one flat gradient buffer, kept from step to
        step: the backward passes accumulate into it in place, and the collective takes it as it
        is, with no copy and no fresh whole-model allocation (whose page faults cost as much as
        the copy)."""
        if self.gradient is None:
            self.gradient = torch.zeros_like(self.flat)
        else:
            self.gradient.zero_()
        for p, offset, n in zip(self.params, self.offsets, self.numels, strict=True):
            p.grad = self.gradient[offset : offset + n].view_as(p)

    def flat_gradient(self, free: bool = False) -> torch.Tensor:
        """This rank's gradients of the group, end to end, padded with zeros: the attached buffer,
        where every gradient is still its view, or else a new buffer; with `free`, each parameter's
        gradient goes as soon as it is copied, so that the rank never holds them twice."""
        gradient = self.gradient
        attached = gradient is not None and all(
            p.grad is not None and p.grad.data_ptr() == gradient.data_ptr() + offset * gradient.element_size()
            for p, offset in zip(self.params, self.offsets, strict=True)
        )
        if attached:
            return gradient
        flat = torch.zeros(self.padded, dtype=self.flat.dtype, device=self.flat.device)
        for p, offset, n in zip(self.params, self.offsets, self.numels, strict=True):
            if p.grad is not None:
                flat[offset : offset + n].copy_(p.grad.reshape(-1))
                if free:
                    p.grad = None
        return flat

    def padded_flat(self, per_param: list[torch.Tensor]) -> torch.Tensor:
        """Per-parameter tensors (a whole state dict's values) end to end, padded with zeros."""
        flat = torch.zeros(self.padded, dtype=per_param[0].dtype, device=self.flat.device)
        offset = 0
        for tensor, n in zip(per_param, self.numels, strict=True):
            flat[offset : offset + n].copy_(tensor.reshape(-1))
            offset += n
        return flat


class ShardedOptimizer:
    """Looks like the wrapped optimizer to the loop (param_groups, zero_grad, step, state dicts); its
    param_groups hold this rank's slices, so a GradScaler unscales, and the loop's lr reaches, those."""

    def __init__(
        self,
        groups: list[dict[str, Any]],
        make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
        hvd: Any,
        rank: int,
        size: int,
        stage: int,
    ) -> None:
        """`groups`: torch's parameter groups of the model; `make`: the optimizer over such groups."""
        self.hvd, self.rank, self.size, self.stage = hvd, rank, size, stage
        # a frozen parameter keeps its values and has no state, as under a plain optimizer; it keeps
        # its place in the state dict's numbering
        self.places = [[i for i, p in enumerate(group["params"]) if p.requires_grad] for group in groups]
        self.counts = [len(group["params"]) for group in groups]
        if not all(self.places):
            raise ValueError("--strategy zero: a parameter group with no trainable parameter")
        self.buckets = [
            Bucket([group["params"][i] for i in places], rank, size)
            for group, places in zip(groups, self.places, strict=True)
        ]
        self.inner = make(
            [
                {**{k: v for k, v in group.items() if k != "params"}, "params": [bucket.shard]}
                for group, bucket in zip(groups, self.buckets, strict=True)
            ]
        )
        self._pending: dict | None = None  # a full state dict rank 0 read, until broadcast_state

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    @property
    def defaults(self) -> dict:
        return self.inner.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        for bucket in self.buckets:
            bucket.shard.grad = None
            if self.stage == 1:
                bucket.attach_gradients()
            else:
                for p in bucket.params:
                    p.grad = None

    def reduce_scatter(self) -> None:
        """Every rank's gradients averaged, each rank keeping its own slice of every group.

        An in-place allreduce, then the slice: Horovod's own reducescatter copies its input into a
        new buffer (and over gloo builds the halving-doubling algorithm anew) on every call, and
        measured slower than the in-place allreduce of twice the bytes (docs/performance.md,
        "zero's collectives")."""
        # stage 2: the full gradients go as they are flattened for the collective
        flats = [bucket.flat_gradient(free=self.stage == 2) for bucket in self.buckets]
        self.hvd.grouped_allreduce_(flats, op=self.hvd.Average, name="hvdtrain.zero.grad")
        for bucket, averaged in zip(self.buckets, flats, strict=True):
            start = self.rank * bucket.shard_size
            own = averaged[start : start + bucket.shard_size]
            # stage 2: a copy, so that the full buffer goes now and only the rank's slice stays
            bucket.shard.grad = own if averaged is bucket.gradient else own.clone()

    def step(self, closure=None) -> None:
        self.inner.step()
        self.gather()

    def gather(self) -> None:
        """Every rank's updated slice into every rank's buffers, in place: each rank broadcasts its
        own slice of each buffer. Horovod's allgather returns a new tensor of the whole buffer, to
        be copied back; an in-place sum of the buffers, the other slices zeroed, moves twice the
        bytes."""
        handles = [
            self.hvd.broadcast_async_(
                bucket.flat[owner * bucket.shard_size : (owner + 1) * bucket.shard_size],
                root_rank=owner,
                name=f"hvdtrain.zero.params.{index}.{owner}",
            )
            for index, bucket in enumerate(self.buckets)
            for owner in range(self.size)
        ]
        for handle in handles:
            self.hvd.synchronize(handle)

    def initialize(self) -> None:
        """A fresh optimizer's first step, of zero gradients, as Horovod's broadcast_optimizer_state
        takes it to create the state: a zero run then takes the steps a plain one takes (Adam counts
        that step in its bias correction, AdamW's decay shrinks the weights by it)."""
        for bucket in self.buckets:
            bucket.shard.grad = torch.zeros_like(bucket.shard)
        self.step()
        self.zero_grad()

    def grad_slices(self) -> list[torch.Tensor]:
        """This rank's slices of the averaged gradient."""
        return [bucket.shard.grad for bucket in self.buckets if bucket.shard.grad is not None]

    def layout(self) -> dict[str, Any]:
        """How this optimizer's state is sharded: each group's trainable parameters' shapes, their
        places among the group's parameters, the group's size, and the world size."""
        return {
            "shapes": [[list(p.shape) for p in bucket.params] for bucket in self.buckets],
            "places": self.places,
            "counts": self.counts,
            "ranks": self.size,
        }

    def shard_state(self) -> dict[str, Any]:
        """This rank's file of a sharded checkpoint: the wrapped optimizer's state of its slices."""
        return {"state": self.inner.state_dict(), "layout": self.layout()}

    def load_shard(self, shard: dict[str, Any]) -> None:
        """This rank's own file of a sharded checkpoint of the same world size."""
        if shard["layout"] != self.layout():
            raise ValueError(
                f"the checkpoint's optimizer state was sharded over parameters of shapes "
                f"{shard['layout']['shapes']}, the recipe's are {self.layout()['shapes']}: "
                "the recipe's parameters changed shape"
            )
        self.inner.load_state_dict(shard["state"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """On rank 0, from a checkpoint: kept on the CPU until ZeroTorch.broadcast_state gives every
        rank its slice of it."""
        self._pending = {
            "state": {
                i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in values.items()}
                for i, values in state_dict["state"].items()
            },
            "param_groups": state_dict["param_groups"],
        }

    def load_full(self, state_dict: dict[str, Any]) -> None:
        """Every rank: its slices of a whole state dict (any world size's)."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != self.counts:
            raise ValueError("the checkpoint's optimizer has other parameter groups than the recipe's")
        inner_state: dict[int, dict[str, Any]] = {}
        for group_index, (group, bucket) in enumerate(zip(groups, self.buckets, strict=True)):
            saved = [
                state_dict["state"].get(group["params"][place], {}) for place in self.places[group_index]
            ]
            keys = sorted(set().union(*saved))
            own: dict[str, Any] = {}
            for key in keys:
                if any(key not in s for s in saved):
                    raise ValueError(
                        f"the checkpoint's optimizer has no {key!r} for some trainable parameters"
                    )
                values = [s[key] for s in saved]
                if all(per_element(key, v) for v in values):
                    for v, p in zip(values, bucket.params, strict=True):
                        if v.shape != p.shape:
                            raise ValueError(
                                f"the checkpoint's optimizer state has shape {tuple(v.shape)} for a "
                                f"parameter of shape {tuple(p.shape)}: the recipe's parameters changed shape"
                            )
                    start = self.rank * bucket.shard_size
                    full = bucket.padded_flat(values)
                    own[key] = full[start : start + bucket.shard_size].clone()
                else:
                    own[key] = values[0].clone() if torch.is_tensor(values[0]) else values[0]
            if own:
                inner_state[group_index] = own
        inner_groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [group_index]}
            for group_index, group in enumerate(groups)
        ]
        self.inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})


class ZeroTorch(HorovodTorch):
    """Horovod's steps, with the optimizer's state and the averaged gradient sharded across ranks."""

    name = "zero"
    channels_last_parameters = True  # its buckets copy each gradient flat, whatever its layout

    def __init__(self, stage: int) -> None:
        super().__init__()
        self.stage = stage

    def build_optimizer(self, task, model, lr, config):
        groups = task.param_groups(model)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": list(groups)}]

        def make(shards):
            return task.optimizer(shards, lr=lr, **fused_where_it_runs(task.optimizer, params_of(shards)))

        return ShardedOptimizer(groups, make, self.hvd, self.rank, self.size, self.stage)

    def averaged_gradients(self, optimizer):
        optimizer.reduce_scatter()
        return contextlib.nullcontext()

    def clip_grad_norm(self, model, optimizer, max_norm: float) -> torch.Tensor:
        """The whole averaged gradient's norm, from every rank's slices, and this rank's slices clipped."""
        slices = optimizer.grad_slices()
        squared = self.hvd.allreduce(squared_sum(slices), op=self.hvd.Sum, name="hvdtrain.zero.norm")
        return clip_to_norm(slices, squared, max_norm)

    def agree_on_overflow(self, found_inf: torch.Tensor) -> None:
        """Each rank's GradScaler saw only its slice: a step overflowed where any slice did."""
        found_inf.copy_(self.hvd.allreduce(found_inf.cpu(), op=self.hvd.Max, name="hvdtrain.zero.inf"))

    def checkpointer(self) -> Checkpointer:
        return ZeroCheckpointer(self)

    def broadcast_state(self, model, optimizer, extra):
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        full = self.hvd.broadcast_object(optimizer._pending, root_rank=0, name="hvdtrain.zero.optimizer")
        optimizer._pending = None
        if full is not None:
            optimizer.load_full(full)
        elif not optimizer.state:
            optimizer.initialize()
        return self.hvd.broadcast_object(extra, root_rank=0, name="hvdtrain.extra")

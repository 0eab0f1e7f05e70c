"""The DistributedDataParallel backend: torchrun started the ranks, DDP averages the gradients
(gloo on CPU, NCCL where GPUs are)."""

from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist

from hvdtrain.runtime.common import BUCKET_VARIABLE
from hvdtrain.runtime.torch import sync_batch_norm
from hvdtrain.runtime.torch.backends import clip_whole_gradient, floating_buffers, rank_device, set_threads
from hvdtrain.runtime.torch.checkpointer import Checkpointer, Rank0Checkpointer, unwrapped
from hvdtrain.runtime.torch.task import make_optimizer

RELEASE_S = 0.05
"""How long close() lets Gloo's worker threads finish with the last collective's tensors."""


class TorchDDP:
    name = "ddp"

    def __init__(self) -> None:
        # one GPU per process, chosen by torchrun's LOCAL_RANK; NCCL refuses two ranks on one GPU,
        # so ranks that share GPUs (more on a host than it has) reduce CUDA tensors over gloo
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = rank_device(local_rank)
        shared = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > max(1, torch.cuda.device_count())
        self.collectives = "nccl" if self.device.type == "cuda" and not shared else "gloo"
        if self.device.type == "cuda" and shared and local_rank == 0:
            print(
                f"hvdtrain: {os.environ['LOCAL_WORLD_SIZE']} ranks share {torch.cuda.device_count()} GPU(s) "
                "on this host: gradients are averaged over gloo, not NCCL",
                flush=True,
            )
        dist.init_process_group(self.collectives)
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        set_threads()

    def build_optimizer(self, task, model, lr, config):
        return make_optimizer(task, model, lr)

    def wrap_model(self, model, config):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # a bucket size measured for this recipe (hvdtrain bench --tune), or the user's; else torch's
        # default (None: its first bucket is smaller than the others)
        bucket_mb = os.environ.get(BUCKET_VARIABLE)
        wrapped = DistributedDataParallel(
            model, device_ids=device_ids, bucket_cap_mb=float(bucket_mb) if bucket_mb else None
        )
        if config.fp16_allreduce:
            wrapped.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
        return wrapped

    def sync_batch_norm(self, model):
        return sync_batch_norm.for_ddp(model, self.device)

    def averaged_gradients(self, optimizer):
        return contextlib.nullcontext()  # DDP averaged them during backward

    clip_grad_norm = staticmethod(clip_whole_gradient)
    agree_on_overflow = None  # every rank unscaled the same averaged gradient
    forwards_are_collective = False
    channels_last_parameters = True
    gradients_averaged_in_backward = True  # backward waits for the buckets' allreduces at its end

    def broadcast_state(self, model, optimizer, extra):
        for tensor in unwrapped(model).state_dict().values():
            dist.broadcast(tensor, src=0)
        payload = [optimizer.state_dict(), extra] if self.rank == 0 else [None, None]
        dist.broadcast_object_list(payload, src=0)
        if self.rank != 0:
            optimizer.load_state_dict(payload[0])
        return payload[1]

    def average_buffers(self, model):
        # DDP broadcasts rank 0's buffers at the start of each forward pass, and the pass then
        # updates each rank's own: after the last step they differ again.
        for _, buffer in floating_buffers(model):
            dist.all_reduce(buffer)
            buffer.div_(self.size)

    def sum(self, values, name):
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def allgather_object(self, value):
        gathered = [None] * self.size
        dist.all_gather_object(gathered, value)
        return gathered

    def checkpointer(self) -> Checkpointer:
        return Rank0Checkpointer(self)

    def close(self) -> None:
        # The group's last reference goes here, and ProcessGroupGloo's destructor then waits, on this
        # thread and holding the GIL, for its worker threads: one still letting go of the last
        # collective's tensors waits for the GIL, holding the lock the destructor wants: a deadlock.
        # A pause without the GIL first lets it finish.
        time.sleep(RELEASE_S)
        dist.destroy_process_group()

"""PyTorch DistributedDataParallel: torch.distributed.run starts the ranks, DDP averages gradients.

Gloo on CPU, NCCL where GPUs are. One host: torchrun must run on every node of a multi-host job.
"""

from __future__ import annotations

import os
from pathlib import Path

from hvdtrain.launch import LaunchCommand, LaunchSpec, rank_env
from hvdtrain.strategies import Strategy


def launch(spec: LaunchSpec) -> LaunchCommand:
    if spec.np < 1:
        raise ValueError(f"--np must be at least 1, got {spec.np}")
    if len(spec.hosts) > 1:
        raise ValueError("the ddp strategy runs on one host here; use the horovod strategy for several hosts")
    python, *module_args = spec.program
    argv = [
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(spec.np),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(spec.rendezvous_port),
    ]
    if spec.log_dir:  # per-rank files under LOG_DIR/<run id>/attempt_0/<rank>/, and the console
        argv += ["--log-dir", spec.log_dir, "--tee", "3"]
    argv += module_args
    return LaunchCommand(argv, rank_env(spec, threads_hosts=()))


class TorchDDP:
    name = "ddp"

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.use_cuda = torch.cuda.is_available()
        dist.init_process_group("nccl" if self.use_cuda else "gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if self.use_cuda else "cpu")
        torch.set_num_threads(int(os.environ.get("HVDTRAIN_THREADS_PER_RANK", torch.get_num_threads())))

    def wrap(self, model, optimizer, config):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        if config.reduce_op != "average":
            raise ValueError("reduce_op=adasum needs the horovod strategy")
        wrapped = DistributedDataParallel(model)
        if config.fp16_allreduce:
            wrapped.register_comm_hook(self.dist.group.WORLD, default_hooks.fp16_compress_hook)
        return wrapped, optimizer

    def broadcast_state(self, model, optimizer, extra):
        module = getattr(model, "module", model)
        for tensor in module.state_dict().values():
            self.dist.broadcast(tensor, src=0)
        payload = [optimizer.state_dict(), extra] if self.rank == 0 else [None, None]
        self.dist.broadcast_object_list(payload, src=0)
        if self.rank != 0:
            optimizer.load_state_dict(payload[0])
        return payload[1]

    def sum(self, values, name):
        tensor = self.torch.tensor(values, dtype=self.torch.float64)
        self.dist.all_reduce(tensor)
        return tensor.tolist()

    def allgather_object(self, value):
        gathered = [None] * self.size
        self.dist.all_gather_object(gathered, value)
        return gathered


def train(recipe, config, run_dir: Path, resume: bool) -> dict:
    from hvdtrain.runtime import torch as runtime

    backend = TorchDDP()
    try:
        return runtime.run(recipe.build, config, backend, run_dir, recipe.name, resume)
    finally:
        backend.dist.destroy_process_group()


STRATEGY = Strategy(
    name="ddp",
    frameworks=("torch",),
    description="PyTorch DistributedDataParallel over gloo (CPU) or NCCL (GPU), started by torchrun",
    launch=launch,
    train=train,
)

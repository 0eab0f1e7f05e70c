"""torch.nn.DataParallel: one process replicates the model over the visible GPUs and splits each
batch between them. Without GPUs it runs on the CPU as one device, and says so."""

from __future__ import annotations

from pathlib import Path

from hvdtrain.launch import LaunchCommand, LaunchSpec, rank_env
from hvdtrain.strategies import Strategy


def launch(spec: LaunchSpec) -> LaunchCommand:
    if len(spec.hosts) > 1:
        raise ValueError("the dp strategy is one process on one host")
    env = rank_env(spec, threads_hosts=(), ranks_per_host=1)
    env["HVDTRAIN_DP_DEVICES"] = str(spec.np)
    return LaunchCommand(list(spec.program), env)


class TorchDataParallel:
    name = "dp"
    rank, size = 0, 1

    def __init__(self, max_devices: int) -> None:
        import torch

        self.torch = torch
        self.device_ids = list(range(min(max_devices, torch.cuda.device_count())))
        if not self.device_ids:
            print("hvdtrain: no GPU visible: DataParallel runs the model on one device (the CPU)", flush=True)

    def wrap(self, model, optimizer, config):
        if not self.device_ids:
            return model, optimizer
        model.to(f"cuda:{self.device_ids[0]}")
        return self.torch.nn.DataParallel(model, device_ids=self.device_ids), optimizer

    def broadcast_state(self, model, optimizer, extra):
        return extra

    def sum(self, values, name):
        return list(values)

    def allgather_object(self, value):
        return [value]


def train(recipe, config, run_dir: Path, resume: bool) -> dict:
    import os

    from hvdtrain.runtime import torch as runtime

    backend = TorchDataParallel(int(os.environ.get("HVDTRAIN_DP_DEVICES", "1")))
    return runtime.run(recipe.build, config, backend, run_dir, recipe.name, resume)


STRATEGY = Strategy(
    name="dp",
    frameworks=("torch",),
    description="single-process torch.nn.DataParallel over the visible GPUs (CPU: one device)",
    launch=launch,
    train=train,
)

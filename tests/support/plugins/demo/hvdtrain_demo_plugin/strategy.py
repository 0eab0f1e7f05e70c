"""DDP with a gradient-compression communication hook: torch's fp16_compress_hook casts each
bucket to float16 for the allreduce. Started as ddp starts its ranks; each rank counts the buckets
the hook compressed and writes the count beside the run's summary."""

from __future__ import annotations

import dataclasses
import gc
import json
from pathlib import Path

from hvdtrain.strategies import ddp

CALLS_FILE = "fp16-hook-calls.json"


def train(recipe, config, run_dir: Path, resume: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    from hvdtrain.runtime import torch as runtime
    from hvdtrain.runtime.torch.ddp import TorchDDP

    calls = [0]

    def counted(state, bucket):
        calls[0] += 1
        return fp16_compress_hook(state, bucket)

    class Compressed(TorchDDP):
        def wrap_model(self, model, config):
            wrapped = super().wrap_model(model, config)
            wrapped.register_comm_hook(None, counted)
            return wrapped

    backend = Compressed()
    try:
        summary = runtime.run(recipe.build, config, backend, run_dir, recipe.name, resume)
        path = Path(run_dir) / f"rank{dist.get_rank()}-{CALLS_FILE}"
        path.write_text(json.dumps({"buckets_compressed": calls[0]}))
        return summary
    finally:
        gc.collect()
        backend.close()


STRATEGY = dataclasses.replace(
    ddp.STRATEGY,
    name="ddp-fp16-hook",
    description="DDP whose gradient buckets travel as float16 (torch's fp16_compress_hook)",
    train=train,
    tunable=None,
)

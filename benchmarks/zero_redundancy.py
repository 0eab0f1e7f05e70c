"""The `memory` section's torch-native baseline: gpt-torch's model and AdamW groups under
DistributedDataParallel with torch's ZeroRedundancyOptimizer, written as its documentation does,
started by torchrun. Rank 0 prints one JSON line: each rank's parameter and optimizer-state bytes,
peak RSS and the samples/s of the steps after the first epoch."""

import argparse
import json
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from hvdtrain.models.gpt import sequence_loss
from hvdtrain.recipes.gpt_torch import Config, build

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--set", action="append", default=[], help="KEY=VALUE of gpt-torch's config (ints)")
args = parser.parse_args()

dist.init_process_group("gloo")
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
torch.manual_seed(42)
config = Config(**{key: int(value) for key, value in (item.split("=", 1) for item in args.set)})
task = build(config)
model = DistributedDataParallel(task.model)
groups = task.param_groups(task.model)
optimizer = ZeroRedundancyOptimizer(
    groups[0]["params"],
    optimizer_class=torch.optim.AdamW,
    lr=config.lr,
    weight_decay=groups[0]["weight_decay"],
)
optimizer.add_param_group(groups[1])
x, y = torch.from_numpy(task.data.x_train), torch.from_numpy(task.data.y_train)
rates = []
for epoch in range(args.epochs):
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch))
    began = time.perf_counter()
    for step in range(args.steps):
        batch = order[step * config.batch_size : (step + 1) * config.batch_size]
        optimizer.zero_grad()
        sequence_loss(model(x[batch]), y[batch]).backward()
        optimizer.step()
    rates.append(args.steps * config.batch_size * dist.get_world_size() / (time.perf_counter() - began))
held = sum(
    t.numel() * t.element_size()
    for s in optimizer.optim.state.values()
    for t in s.values()
    if torch.is_tensor(t)
)
params = sum(p.numel() * p.element_size() for p in task.model.parameters())
rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, (params, held, rss_mib))
if dist.get_rank() == 0:
    print(
        json.dumps(
            {
                "param_bytes": [g[0] for g in gathered],
                "optimizer_state_bytes": [g[1] for g in gathered],
                "peak_rss_mib": [g[2] for g in gathered],
                "steady_samples_per_sec": statistics.median(rates[1:] or rates),
            }
        ),
        flush=True,
    )
dist.destroy_process_group()

"""The baseline for `make bench`: a minimal hand-written Horovod training loop of synthetic-torch's
model and steps, as Horovod's own pytorch_synthetic_benchmark is written. Prints one JSON line."""

import argparse
import json
import os
import statistics
import time

import horovod.torch as hvd
import torch

from hvdtrain.recipes.synthetic_torch import Config, build

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--batch-size", type=int, default=32)
args = parser.parse_args()

hvd.init()
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
torch.manual_seed(42)
task = build(Config())
model = task.model
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
x, y = torch.from_numpy(task.data.x_train), torch.from_numpy(task.data.y_train)
rates = []
for epoch in range(args.epochs):
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch))
    began = time.perf_counter()
    for step in range(args.steps):
        batch = order[step * args.batch_size : (step + 1) * args.batch_size]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        optimizer.step()
    rates.append(args.steps * args.batch_size * hvd.size() / (time.perf_counter() - began))
if hvd.rank() == 0:
    print(json.dumps({"samples_per_sec": statistics.median(rates[1:] or rates)}))

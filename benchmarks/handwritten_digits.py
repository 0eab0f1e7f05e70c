"""The baseline of the start-up overhead in `make bench`: digits-mlp-torch's debug run written by hand,
as Horovod's pytorch_mnist example is (the same data, model, optimizer, shards and epochs, a test
pass after each epoch), started by a plain `horovodrun`. Prints one JSON line with train_seconds,
the time in the training steps, measured as hvdtrain's summary.json measures it."""

import argparse
import json
import os
import time

import horovod.torch as hvd
import numpy as np
import torch

from hvdtrain.data import digits  # the data only: the same split as the recipe's

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=8)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--seed", type=int, default=42)
args = parser.parse_args()

hvd.init()
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
torch.manual_seed(args.seed)
split = digits(args.seed)
x_train, x_test, y_train, y_test = split.x_train, split.x_test, split.y_train, split.y_test
x_train, y_train = torch.from_numpy(x_train), torch.from_numpy(y_train)
x_test, y_test = torch.from_numpy(x_test), torch.from_numpy(y_test)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

train_seconds, accuracy = 0.0, 0.0
usable = len(y_train) - len(y_train) % hvd.size()
for epoch in range(args.epochs):
    mine = torch.from_numpy(np.random.default_rng([args.seed, epoch]).permutation(len(y_train)))
    mine = mine[:usable][hvd.rank() :: hvd.size()]
    began = time.perf_counter()
    model.train()
    for start in range(0, len(mine) - args.batch_size + 1, args.batch_size):
        batch = mine[start : start + args.batch_size]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x_train[batch]), y_train[batch]).backward()
        optimizer.step()
    train_seconds += time.perf_counter() - began
    model.eval()
    with torch.no_grad():
        correct = (
            model(x_test[hvd.rank() :: hvd.size()]).argmax(1) == y_test[hvd.rank() :: hvd.size()]
        ).sum()
    accuracy = float(hvd.allreduce(correct.double(), op=hvd.Sum, name="correct")) / len(y_test)
if hvd.rank() == 0:
    print(json.dumps({"train_seconds": train_seconds, "test_accuracy": accuracy}))

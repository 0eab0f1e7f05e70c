"""The peer for `make bench`: Horovod's own synthetic ResNet benchmark, the protocol of Horovod's
examples/pytorch/pytorch_synthetic_benchmark.py written here again (not copied): one fixed batch of
random images, plain SGD at 0.01 x world size in hvd.DistributedOptimizer, warm-up batches left
out, then timed iterations of several batches each. Two departures, both so that it trains exactly
what resnet-torch trains: torchvision cannot load beside the CPU torch, so the model is hvdtrain's
ResNet (torchvision's architecture and parameter names), and its batch norm is the plain one the
recipe uses (Horovod's script passes hvd.SyncBatchNorm, an allreduce per layer per step). Prints
one JSON line: the samples/s of all ranks together, the median over the timed iterations."""

import argparse
import json
import os
import statistics
import timeit

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from hvdtrain.models.resnet import ResNet

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="resnet50")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--image-size", type=int, default=224)
parser.add_argument("--num-warmup-batches", type=int, default=10)
parser.add_argument("--num-batches-per-iter", type=int, default=10)
parser.add_argument("--num-iters", type=int, default=10)
args = parser.parse_args()

hvd.init()
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
model = ResNet(args.model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
target = torch.randint(0, 1000, (args.batch_size,))


def benchmark_step() -> None:
    optimizer.zero_grad()
    F.cross_entropy(model(data), target).backward()
    optimizer.step()


timeit.timeit(benchmark_step, number=args.num_warmup_batches)
rates = []
for _ in range(args.num_iters):
    seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    rates.append(args.batch_size * args.num_batches_per_iter * hvd.size() / seconds)
if hvd.rank() == 0:
    print(json.dumps({"samples_per_sec": statistics.median(rates)}))

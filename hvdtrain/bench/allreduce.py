"""Allreduce bus bandwidth, 2(n-1)/n x bytes / time, for Horovod (under horovodrun or mpirun) or
torch.distributed gloo (under torchrun). Rank 0 prints one JSON line per tensor size."""

import argparse
import json
import os
import time

import torch

SIZES_MB = (1, 16, 64)

parser = argparse.ArgumentParser()
parser.add_argument("--backend", choices=["horovod", "torch"], default="horovod")
parser.add_argument("--iterations", type=int, default=10)
args = parser.parse_args()

if args.backend == "horovod":
    import horovod.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    def allreduce(tensor: torch.Tensor, name: str) -> None:
        hvd.allreduce_(tensor, op=hvd.Sum, name=name)
else:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()

    def allreduce(tensor: torch.Tensor, name: str) -> None:
        dist.all_reduce(tensor)


torch.set_num_threads(int(os.environ.get("HVDTRAIN_THREADS_PER_RANK", "1")))
for megabytes in SIZES_MB:
    tensor = torch.ones(megabytes * 2**20 // 4)
    for _ in range(2):
        allreduce(tensor, f"warmup.{megabytes}")
    began = time.perf_counter()
    for _ in range(args.iterations):
        allreduce(tensor, f"bw.{megabytes}")
    seconds = (time.perf_counter() - began) / args.iterations
    if rank == 0:
        bus = 2 * (size - 1) / size * tensor.numel() * 4 / seconds / 1e9
        print(json.dumps({"megabytes": megabytes, "seconds": seconds, "bus_gb_per_s": bus}), flush=True)
if args.backend == "torch":
    dist.destroy_process_group()

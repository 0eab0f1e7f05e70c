"""Allreduce bus bandwidth, 2(n-1)/n x bytes / time, for Horovod (under horovodrun or mpirun) or
torch.distributed gloo (under torchrun), in place on float32 tensors of 1, 16 and 64 MB, with and
without fp16 compression (the tensor travels as float16 and is cast back, as Horovod's
Compression.fp16 and DDP's fp16 compress hook do; the figure counts the float32 bytes reduced).
Each size is warmed up under the name it is timed with (Horovod's response cache is hit), then
timed in rounds that start together (a barrier); rank 0 prints the median round, one JSON line a size."""

import argparse
import json
import os
import statistics
import time

import torch

SIZES_MB = (1, 16, 64)

parser = argparse.ArgumentParser()
parser.add_argument("--backend", choices=["horovod", "torch"], default="horovod")
parser.add_argument("--iterations", type=int, default=5, help="Allreduces per timed round.")
parser.add_argument("--rounds", type=int, default=5)
args = parser.parse_args()

if args.backend == "horovod":
    import horovod.torch as hvd

    hvd.init()
    rank, size, barrier = hvd.rank(), hvd.size(), hvd.barrier

    def allreduce(tensor: torch.Tensor, name: str, fp16: bool) -> None:
        if fp16:
            tensor.copy_(hvd.allreduce(tensor, op=hvd.Sum, name=name, compression=hvd.Compression.fp16))
        else:
            hvd.allreduce_(tensor, op=hvd.Sum, name=name)
else:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, size, barrier = dist.get_rank(), dist.get_world_size(), dist.barrier

    def allreduce(tensor: torch.Tensor, name: str, fp16: bool) -> None:
        if fp16:
            half = tensor.half()
            dist.all_reduce(half)
            tensor.copy_(half)
        else:
            dist.all_reduce(tensor)


torch.set_num_threads(int(os.environ.get("HVDTRAIN_THREADS_PER_RANK", "1")))
for fp16 in (False, True):
    for megabytes in SIZES_MB:
        tensor = torch.zeros(megabytes * 2**20 // 4)  # stays finite however often it is summed
        name = f"bw.{megabytes}.{'fp16' if fp16 else 'fp32'}"
        for _ in range(2):
            allreduce(tensor, name, fp16)
        rounds = []
        for _ in range(args.rounds):
            barrier()
            began = time.perf_counter()
            for _ in range(args.iterations):
                allreduce(tensor, name, fp16)
            rounds.append((time.perf_counter() - began) / args.iterations)
        seconds = statistics.median(rounds)
        if rank == 0:
            bus = 2 * (size - 1) / size * tensor.numel() * 4 / seconds / 1e9
            record = {"megabytes": megabytes, "fp16": fp16, "seconds": seconds, "bus_gb_per_s": bus}
            print(json.dumps(record), flush=True)
if args.backend == "torch":
    dist.destroy_process_group()

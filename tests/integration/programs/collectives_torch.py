"""Exact Horovod collectives on torch tensors; prints one JSON line per rank, asserts on every rank."""

import json

import horovod.torch as hvd
import torch

hvd.init()
rank, size = hvd.rank(), hvd.size()
x = torch.arange(6, dtype=torch.float64) + 10 * rank
expected_sum = sum(torch.arange(6, dtype=torch.float64) + 10 * r for r in range(size))
total = hvd.allreduce(x, op=hvd.Sum, name="sum")
mean = hvd.allreduce(x, op=hvd.Average, name="avg")
gathered = hvd.allgather(torch.full((rank + 1, 2), float(rank)), name="gather")
broadcast = hvd.broadcast(torch.tensor([rank + 100.0]), root_rank=size - 1, name="bcast")
ints = hvd.allreduce(torch.tensor([rank + 1], dtype=torch.int64), op=hvd.Sum, name="ints")

assert torch.equal(total, expected_sum), total
assert torch.equal(mean, expected_sum / size), mean
assert gathered.shape == (size * (size + 1) // 2, 2), gathered.shape
assert torch.equal(gathered[:, 0], torch.cat([torch.full((r + 1,), float(r)) for r in range(size)]))
assert broadcast.item() == size - 1 + 100.0
assert ints.item() == size * (size + 1) // 2
print(
    json.dumps(
        {
            "framework": "torch",
            "rank": rank,
            "size": size,
            "sum": total.tolist(),
            "avg": mean.tolist(),
            "gather_rows": gathered.shape[0],
            "bcast": broadcast.item(),
        }
    )
)

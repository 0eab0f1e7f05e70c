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
# fp16_allreduce: the same float32 gradients averaged with and without fp16 compression on the wire
grads = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
exact = hvd.allreduce(grads, op=hvd.Average, name="fp32")
compressed = hvd.allreduce(grads, op=hvd.Average, name="fp16", compression=hvd.Compression.fp16)
# float16 summed by the controller's own reduction (vectorised, and its element-wise tail at an odd
# length): small integers, exact in float16
halves = hvd.allreduce(((torch.arange(1003) % 64) * (rank + 1)).half(), op=hvd.Sum, name="halves")

assert torch.equal(total, expected_sum), total
assert torch.equal(mean, expected_sum / size), mean
assert gathered.shape == (size * (size + 1) // 2, 2), gathered.shape
assert torch.equal(gathered[:, 0], torch.cat([torch.full((r + 1,), float(r)) for r in range(size)]))
assert broadcast.item() == size - 1 + 100.0
assert ints.item() == size * (size + 1) // 2
assert halves.dtype == torch.float16
assert torch.equal(halves, ((torch.arange(1003) % 64) * (size * (size + 1) // 2)).half()), halves
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
            "fp16_dtype": str(compressed.dtype),
            "fp16_max_error": float((compressed - exact).abs().max()),
            "fp16_max_value": float(exact.abs().max()),
            "float16_sum": float(halves.double().sum()),
        }
    )
)

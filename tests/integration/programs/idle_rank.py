"""A Horovod rank that idles: the CPU its process spends while no tensor is in flight (Horovod's
background thread included), then an allreduce right after, which must wake it at once and be exact."""

import json
import time

import horovod.torch as hvd
import torch

hvd.init()
hvd.allreduce(torch.zeros(1), name="warm-up")
started_cpu, started = time.process_time(), time.monotonic()
time.sleep(3)
idle_cpu = time.process_time() - started_cpu
idle_wall = time.monotonic() - started
issued = time.monotonic()
total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, name="after-idle")
print(
    json.dumps(
        {
            "rank": hvd.rank(),
            "idle_cpu_s": idle_cpu,
            "idle_wall_s": idle_wall,
            "allreduce_after_idle_s": time.monotonic() - issued,
            "sum": total.item(),
        }
    )
)

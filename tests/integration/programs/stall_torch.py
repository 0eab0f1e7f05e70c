"""Rank 1 stops joining collectives: Horovod's stall check must end the job, naming the missing rank."""

import time

import horovod.torch as hvd
import torch

hvd.init()
hvd.allreduce(torch.ones(1), name="warmup")
if hvd.rank() == 1:
    time.sleep(600)
hvd.allreduce(torch.ones(1), name="never.completed")

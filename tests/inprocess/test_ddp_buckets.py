"""The ddp backend gives DDP the gradient bucket size hvdtrain's plan sets (a size `hvdtrain bench
--tune` measured, or the user's), and torch's own default without one (25 MB, the first bucket
smaller): a one-rank gloo group in this process."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import torch
import torch.distributed as dist


def test_ddp_takes_the_bucket_size_the_plan_sets_and_torchs_default_without_one(monkeypatch):
    from hvdtrain.runtime.torch.ddp import TorchDDP

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        monkeypatch.setenv(name, value)
    backend = TorchDDP()
    try:
        config = SimpleNamespace(fp16_allreduce=False)
        monkeypatch.setenv("HVDTRAIN_DDP_BUCKET_MB", "5")
        given = backend.wrap_model(torch.nn.Linear(4, 4), config)
        assert given.bucket_bytes_cap == 5 << 20 and not given.bucket_bytes_cap_default
        monkeypatch.delenv("HVDTRAIN_DDP_BUCKET_MB")
        default = backend.wrap_model(torch.nn.Linear(4, 4), config)
        # torch's own default, not 25 MB given: its first bucket is smaller, to start sooner
        assert default.bucket_bytes_cap == 25 << 20 and default.bucket_bytes_cap_default
    finally:
        dist.destroy_process_group()

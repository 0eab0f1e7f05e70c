"""The data-parallel training core for PyTorch, and the Horovod steps, written once.

`train` is the loop every torch recipe runs (loop.py, with what its fixed and elastic forms share in
training.py). What differs between ways of parallelising (Horovod allreduce, DistributedDataParallel,
DataParallel) is a small `TorchBackend` (backends.py, ddp.py), which owns the device, builds the
optimizer from what the recipe's `TorchTask` gives (task.py) and hands out the collective
checkpointer (checkpointer.py).
"""

from hvdtrain.runtime.torch.startup import defer_dynamo_import

defer_dynamo_import()

from hvdtrain.runtime.torch.backends import (  # noqa: E402
    DataParallelTorch,
    HorovodTorch,
    LocalTorch,
    TorchBackend,
    set_threads,
)
from hvdtrain.runtime.torch.checkpointer import Checkpointer, Rank0Checkpointer  # noqa: E402
from hvdtrain.runtime.torch.loop import run, train  # noqa: E402
from hvdtrain.runtime.torch.task import METRICS, Datasets, TorchTask, all_parameters, correct, named  # noqa: E402
from hvdtrain.runtime.torch.training import Training, evaluate, parameter_digest  # noqa: E402

__all__ = [
    "METRICS",
    "Checkpointer",
    "DataParallelTorch",
    "Datasets",
    "HorovodTorch",
    "LocalTorch",
    "Rank0Checkpointer",
    "TorchBackend",
    "TorchTask",
    "Training",
    "all_parameters",
    "correct",
    "evaluate",
    "named",
    "parameter_digest",
    "run",
    "set_threads",
    "train",
]

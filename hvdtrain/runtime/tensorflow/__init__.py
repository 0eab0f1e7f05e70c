"""The data-parallel training core for TensorFlow / Keras 3, and the Horovod steps, written once.

The loops (model.fit and a custom tf.function step: loop.py, following the schedule step by step
through callbacks.py; the parameter server's coordinator: ps.py) share one schedule. What differs
between ways of parallelising is a `KerasBackend` (backends.py), which builds the optimizer from what
the recipe's `KerasTask` gives (task.py) and hands out the collective checkpointer (checkpointer.py).
"""

from hvdtrain.runtime.tensorflow.backends import (
    Coordinator,
    HorovodKeras,
    KerasBackend,
    LocalKeras,
    pin_local_gpu,
)
from hvdtrain.runtime.tensorflow.checkpointer import KerasCheckpointer
from hvdtrain.runtime.tensorflow.loop import evaluate, run, train, weights_digest
from hvdtrain.runtime.tensorflow.task import METRICS, KerasTask, TFDatasets, correct, named

__all__ = [
    "METRICS",
    "Coordinator",
    "HorovodKeras",
    "KerasBackend",
    "KerasCheckpointer",
    "KerasTask",
    "LocalKeras",
    "TFDatasets",
    "correct",
    "evaluate",
    "named",
    "pin_local_gpu",
    "run",
    "train",
    "weights_digest",
]

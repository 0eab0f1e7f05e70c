"""What differs between ways of parallelising TF: a small `KerasBackend`. It builds the optimizer
from what the task gives (Horovod's DistributedOptimizer for model.fit, the plain one under a
DistributedGradientTape for the custom loop), broadcasts, reduces metrics and gives the checkpointer.

Horovod's own Keras layer (`horovod.tensorflow.keras`) fails on Keras 3 as released; the project's
build patches it (hvdtrain/building/patches/0004, 0005), so this runtime uses Horovod's
DistributedOptimizer, DistributedGradientTape and callbacks unchanged, as user scripts do.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import keras
import tensorflow as tf

from hvdtrain.config import TrainConfig
from hvdtrain.runtime.common import fp16_allreduce
from hvdtrain.runtime.tensorflow.checkpointer import KerasCheckpointer
from hvdtrain.runtime.tensorflow.task import KerasTask, make_optimizer


class KerasBackend(Protocol):
    name: str
    rank: int
    size: int

    def build_optimizer(self, task: KerasTask, lr: float, config: TrainConfig):
        """The optimizer the loop compiles the model with (fit) or steps itself (custom)."""
        ...

    def distributed_optimizer(self, optimizer: keras.optimizers.Optimizer, config: TrainConfig): ...

    def distributed_tape(self, tape: tf.GradientTape, config: TrainConfig): ...

    def broadcast_variables(self, variables: list) -> None: ...

    def broadcast_object(self, value: Any) -> Any: ...

    def sum(self, values: list[float], name: str) -> list[float]: ...

    def allgather_object(self, value: Any) -> list[Any]: ...

    def callbacks(self) -> list[keras.callbacks.Callback]: ...

    def checkpointer(self) -> KerasCheckpointer: ...

    def average_buffers(self, model: keras.Model) -> None:
        """Collective, before evaluating and saving: the model's floating-point non-trainable
        variables (BatchNormalization's moving statistics, which each rank gathers from its own
        batches) averaged over ranks, so every rank evaluates, and ends with, the same model."""
        ...


def floating_buffers(model: keras.Model) -> list:
    """Not the integer state of Keras's random seed generators, which every rank has the same."""
    return [v for v in model.non_trainable_variables if "float" in str(v.dtype)]


class LocalKeras:
    """One process, no communication: the in-process test tier."""

    name = "local"
    rank, size = 0, 1

    def build_optimizer(self, task, lr, config):
        optimizer = make_optimizer(task, lr, config)
        return self.distributed_optimizer(optimizer, config) if task.loop == "fit" else optimizer

    def checkpointer(self) -> KerasCheckpointer:
        return KerasCheckpointer(self)

    def distributed_optimizer(self, optimizer, config):
        return optimizer

    def distributed_tape(self, tape, config):
        return tape

    def broadcast_variables(self, variables):
        return None

    def broadcast_object(self, value):
        return value

    def sum(self, values, name):
        return list(values)

    def allgather_object(self, value):
        return [value]

    def callbacks(self):
        return []

    def average_buffers(self, model):
        pass


def pin_local_gpu(local_rank: int) -> None:
    """Each rank sees only the GPU of its local rank, allocating as it goes (none on CPU)."""
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.set_visible_devices(gpus[local_rank % len(gpus)], "GPU")


class HorovodKeras:
    name = "horovod"

    def __init__(self) -> None:
        import horovod.tensorflow as hvd
        import horovod.tensorflow.keras as hvd_keras

        self.hvd, self.hvd_keras = hvd, hvd_keras
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()
        pin_local_gpu(hvd.local_rank())  # hvd: one GPU per rank
        threads = int(os.environ.get("HVDTRAIN_THREADS_PER_RANK", "0"))
        if threads:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(threads)

    def _reduction(self, config: TrainConfig) -> dict[str, Any]:
        # num_groups=1: one grouped allreduce per step, so small gradients travel fused.
        return {
            "compression": self.hvd.Compression.fp16 if fp16_allreduce(config) else self.hvd.Compression.none,
            "op": self.hvd.Adasum if config.reduce_op == "adasum" else self.hvd.Average,
            "num_groups": 1,
        }

    def build_optimizer(self, task, lr, config):
        optimizer = make_optimizer(task, lr, config)
        return self.distributed_optimizer(optimizer, config) if task.loop == "fit" else optimizer

    def checkpointer(self) -> KerasCheckpointer:
        return KerasCheckpointer(self)

    def distributed_optimizer(self, optimizer, config: TrainConfig):
        return self.hvd_keras.DistributedOptimizer(optimizer, **self._reduction(config))

    def distributed_tape(self, tape, config: TrainConfig):
        return self.hvd.DistributedGradientTape(tape, **self._reduction(config))

    def broadcast_variables(self, variables: list) -> None:
        self.hvd.broadcast_variables(variables, root_rank=0)

    def broadcast_object(self, value: Any) -> Any:
        return self.hvd.broadcast_object(value, root_rank=0)

    def sum(self, values: list[float], name: str) -> list[float]:
        tensor = tf.constant(values, dtype=tf.float64)
        return self.hvd.allreduce(tensor, op=self.hvd.Sum, name=name).numpy().tolist()

    def allgather_object(self, value: Any) -> list[Any]:
        return self.hvd.allgather_object(value)

    def callbacks(self) -> list[keras.callbacks.Callback]:
        return [self.hvd_keras.callbacks.MetricAverageCallback()]

    def average_buffers(self, model: keras.Model) -> None:
        for index, variable in enumerate(floating_buffers(model)):
            variable.assign(
                self.hvd.allreduce(variable, op=self.hvd.Average, name=f"hvdtrain.buffer.{index}")
            )


class Coordinator(LocalKeras):
    """The parameter-server strategy's coordinator: the one process that runs the loop, over
    `workers` worker processes whose updates land on the parameter servers."""

    name = "ps"

    def __init__(self, workers: int) -> None:
        self.size = workers

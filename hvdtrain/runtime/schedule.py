"""One training schedule for every loop (torch, Keras fit, TF custom, parameter server).

A *step* is one optimizer update: every rank consumes `backward_passes_per_step` batches of
`batch_size`, and the gradients are averaged across ranks once. Steps per epoch, the learning rate at
each step (linear scaling and per-step warmup) and where a resumed run starts are computed here once,
so the loops cannot drift apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hvdtrain.config import TrainConfig


def lr_scale(config: TrainConfig, world_size: int) -> int:
    """Linear scaling with the world size (Goyal et al., 2017), but not under Adasum, whose
    combination of gradients already adapts to the number of ranks (Horovod's examples do the same)."""
    if not config.scale_lr or config.reduce_op == "adasum":
        return 1
    return world_size


@dataclass(frozen=True)
class Schedule:
    config: TrainConfig
    world_size: int
    steps_per_epoch: int

    @classmethod
    def for_run(cls, config: TrainConfig, train_samples: int, world_size: int) -> Schedule:
        """Every rank takes the same number of steps from its shard of `train_samples`."""
        samples_per_step = config.batch_size * config.backward_passes_per_step
        full_steps = (train_samples // world_size) // samples_per_step
        steps = min(full_steps, config.steps_per_epoch) if config.steps_per_epoch else full_steps
        if steps < 1:
            raise ValueError(
                f"{train_samples} training samples are too few for batch_size {config.batch_size} "
                f"x backward_passes_per_step {config.backward_passes_per_step} x {world_size} ranks"
            )
        return cls(config, world_size, steps)

    @property
    def batches_per_step(self) -> int:
        return self.config.backward_passes_per_step

    @property
    def samples_per_step(self) -> int:
        """Per rank."""
        return self.config.batch_size * self.config.backward_passes_per_step

    @property
    def samples_per_epoch(self) -> int:
        """Per rank."""
        return self.steps_per_epoch * self.samples_per_step

    @property
    def global_samples_per_epoch(self) -> int:
        return self.samples_per_epoch * self.world_size

    @property
    def peak_lr(self) -> float:
        return self.config.lr * lr_scale(self.config, self.world_size)

    @property
    def warmup_steps(self) -> int:
        return math.ceil(self.config.warmup_epochs * self.steps_per_epoch)

    def lr_at(self, step: int) -> float:
        """Linear warmup from the one-rank lr to the scaled lr over warmup_epochs, per step."""
        if step >= self.warmup_steps:
            return self.peak_lr
        return self.config.lr + (self.peak_lr - self.config.lr) * step / self.warmup_steps

    def start(self, state: dict | None) -> tuple[int, int]:
        """(epoch, step) a run starts at: 0 for a new run, else where the checkpoint left off (its
        step count carries on, so warmup continues where it was even if the world size changed)."""
        return (int(state["epoch"]), int(state["step"])) if state else (0, 0)

    def logs_lr(self, step: int) -> bool:
        """Warmup steps (and the first step after) go to metrics.jsonl one by one."""
        return step <= self.warmup_steps and self.warmup_steps > 0

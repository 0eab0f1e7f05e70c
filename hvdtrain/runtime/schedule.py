"""One training schedule for every loop (torch, Keras fit, TF custom, parameter server).

A *step* is one optimizer update: every rank consumes `backward_passes_per_step` batches of
`batch_size`, and the gradients are averaged across ranks once. Steps per epoch, the learning rate at
each step (linear scaling, warmup and decay, over training progress in epochs of samples seen) and
where a resumed run starts are computed here once, so the loops cannot drift apart.
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

    def progress(self, epoch: int, fraction: float) -> float:
        """Training progress in epochs: `epoch` epochs done and `fraction` of the next one's samples
        seen (over all ranks). A step is its world's share of an epoch, so progress means the same at
        every world size; an elastic loop adds up the shares of the worlds it ran in."""
        return epoch + min(1.0, fraction)

    def at(self, epoch: int, taken: int) -> float:
        """The progress of a fixed world `taken` steps into `epoch`."""
        return self.progress(epoch, taken / self.steps_per_epoch)

    def lr_at(self, progress: float) -> float:
        """The learning rate of the step that starts at `progress`: a linear warmup from the one-rank
        lr to the scaled one over warmup_epochs, then the decay lr_schedule names."""
        config, peak = self.config, self.peak_lr
        if progress < config.warmup_epochs:
            return config.lr + (peak - config.lr) * progress / config.warmup_epochs
        if config.lr_schedule == "step":
            # within a rounding error of a milestone counts as past it (epoch + taken / steps)
            return peak * config.lr_gamma ** sum(1 for m in config.lr_milestones if progress >= m - 1e-9)
        if config.lr_schedule == "constant":
            return peak
        span = config.epochs - config.warmup_epochs
        done = min(1.0, max(0.0, (progress - config.warmup_epochs) / span))
        left = (1 + math.cos(math.pi * done)) / 2 if config.lr_schedule == "cosine" else 1 - done
        return config.min_lr + (peak - config.min_lr) * left

    def logs_lr(self, progress: float) -> bool:
        """Whether the step at `progress` goes to metrics.jsonl on its own: every step with
        log_step_lr, else the warmup's steps (and the first after)."""
        if self.config.log_step_lr:
            return True
        return self.warmup_steps > 0 and progress * self.steps_per_epoch <= self.warmup_steps + 1e-9

    def lr_of_step(self, progress: float, step: int, log) -> float:
        """`lr_at(progress)`, also handed to `log.step_lr` (a RunLog's) for the steps logs_lr names."""
        lr = self.lr_at(progress)
        if self.logs_lr(progress):
            log.step_lr(step, lr)
        return lr

    def start(self, state: dict | None) -> tuple[int, int]:
        """(epoch, step) a run starts at: 0 for a new run, else where the checkpoint left off (its
        step count carries on; the learning rate follows the epoch, which any world size shares)."""
        return (int(state["epoch"]), int(state["step"])) if state else (0, 0)

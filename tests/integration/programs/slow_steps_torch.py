"""The digits MLP whose training steps each take at least `step_ms`, slow by a pause rather than by
the machine's load: a test that acts while some trials train and others have finished (a sweep
preempted halfway) sees the same order of events on an idle machine as on a busy one."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from hvdtrain.config import bounded
from hvdtrain.recipes import digits_mlp_torch
from hvdtrain.registry import Recipe


@dataclass(kw_only=True)
class Config(digits_mlp_torch.Config):
    epochs: int = 3
    step_ms: int = bounded(30, minimum=0)
    """The pause in each training step's forward pass."""


def build(config: Config):
    import torch

    class Pause(torch.nn.Module):
        def forward(self, inputs):
            if self.training:
                time.sleep(config.step_ms / 1000)
            return inputs

    task = digits_mlp_torch.build(config)
    return replace(task, model=torch.nn.Sequential(Pause(), task.model))


RECIPE = Recipe(
    name="slow-steps-torch",
    framework="torch",
    dataset="handwritten digits (shipped with hvdtrain)",
    description="the digits MLP with a pause in every training step, for tests timed by steps",
    config=Config,
    build=build,
)

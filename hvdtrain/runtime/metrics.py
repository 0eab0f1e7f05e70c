"""Evaluation metrics by name, for every framework: which way is better, and what a metric's mean over
the test set becomes when it is reported. A task computes each metric as a sum over a batch's
samples; the loop adds the sums over batches and ranks, divides by the samples, and reports
`finish(name, mean)` as test_<name>. Imports no framework.

    accuracy     top-1 hits                                  higher is better
    top5         the target among the five highest outputs  higher is better
    loss         the loss function's value                  lower is better
    perplexity   exp of the mean cross-entropy              lower is better

The training loss is `loss`, the evaluation metrics `test_<name>`: these are what `monitor` names.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

Mode = Literal["min", "max"]

GOALS: dict[str, Mode] = {"accuracy": "max", "top5": "max", "loss": "min", "perplexity": "min"}
"""The metrics hvdtrain knows; a recipe may report others, and monitoring one needs an explicit mode."""

TRAINING_LOSS = "loss"


def finish(name: str, mean: float) -> float:
    """The reported value of a metric whose per-sample mean is `mean`: perplexity sums cross-entropy
    per sample (a sum adds up across ranks; a product would not), and is its exponential."""
    if name == "perplexity":
        return math.exp(mean) if mean < 700 else math.inf
    return mean


def reported(metrics: Iterable[str]) -> tuple[str, ...]:
    """What a recipe that evaluates `metrics` can be monitored by: the training loss, then test_<name>."""
    return (TRAINING_LOSS, *(f"test_{name}" for name in metrics))


def goal(monitor: str, mode: str) -> Mode:
    """`mode` where it is min or max; for auto, the direction of the metric `monitor` names."""
    if mode in ("min", "max"):
        return mode  # type: ignore[return-value]
    name = monitor.removeprefix("test_")
    if name not in GOALS:
        raise ValueError(
            f"monitor={monitor}: hvdtrain does not know whether higher or lower is better; "
            "set mode=min or mode=max"
        )
    return GOALS[name]


def check_monitor(monitor: str, mode: str, metrics: Iterable[str], recipe: str) -> None:
    """Before any rank starts: `monitor` is one of what the recipe reports, and has a direction."""
    if not monitor:
        return
    names = reported(metrics)
    if monitor not in names:
        raise ValueError(
            f"monitor={monitor}: recipe {recipe} reports {', '.join(names)}; monitor one of those"
        )
    goal(monitor, mode)


class Watch:
    """The monitored metric across epochs, for the best checkpoint and early stopping, the same in
    every loop. Its state is part of a checkpoint's position, so a resumed run keeps its best and
    its patience."""

    def __init__(self, monitor: str, mode: str, patience: int, state: dict | None = None) -> None:
        self.monitor, self.patience = monitor, patience
        self.mode: Mode = goal(monitor, mode) if monitor else "min"
        self.best: float | None = None
        self.since_best = 0
        self.stopped_at: int | None = None
        self.load_state_dict(state)

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's or an elastic commit's watch; None (a new run) leaves it as it is."""
        if state is not None:
            self.best, self.since_best = state.get("best"), int(state.get("since_best", 0))

    def observe(self, metrics: dict[str, float | None]) -> bool:
        """An epoch's metrics; True where the monitored one is the best yet. A missing or non-finite
        value (a diverged loss) is no improvement."""
        if not self.monitor:
            return False
        value = metrics.get(self.monitor)
        if value is None or not math.isfinite(value):
            self.since_best += 1
            return False
        if self.best is None or (value < self.best if self.mode == "min" else value > self.best):
            self.best, self.since_best = float(value), 0
            return True
        self.since_best += 1
        return False

    @property
    def exhausted(self) -> bool:
        """early_stopping_patience epochs have passed without improvement."""
        return self.patience > 0 and self.since_best >= self.patience

    def state_dict(self) -> dict:
        return {"best": self.best, "since_best": self.since_best}

    def agree_to_stop(self, backend, epoch: int) -> bool:
        """Collective, at the end of `epoch` (1-based): rank 0's early-stopping decision, which every
        rank takes (their metrics are the same sums, but a rank stopping alone would leave the others
        waiting in an allreduce). `backend`: a framework backend, with rank and sum."""
        if not self.patience:
            return False
        mine = float(self.exhausted) if backend.rank == 0 else 0.0
        if backend.sum([mine], name="hvdtrain.stop")[0] <= 0:
            return False
        self.stopped_at = epoch
        if backend.rank == 0:
            print(
                f"hvdtrain: early stopping after epoch {epoch}: {self.monitor} has not improved for "
                f"{self.since_best} epochs (best {self.best:.6g})",
                flush=True,
            )
        return True

    def summary(self) -> dict:
        """What summary.json says of the watch: nothing without a monitor."""
        if not self.monitor:
            return {}
        return {"monitor": self.monitor, "best": self.best, "stopped_early_at": self.stopped_at}

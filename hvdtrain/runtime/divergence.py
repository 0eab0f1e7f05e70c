"""Stopping a run that diverged, on every rank at one step, before it writes a checkpoint of weights
that are no longer numbers.

A step is bad where its loss or its averaged gradient's norm is not finite. How a loop learns of it
depends on what the step already reads:

- By default (stop_on_nonfinite, no patience, no loss scale) the step reads nothing: each rank keeps
  its losses (and norms) on the device, and every CHECK_EVERY steps the ranks look at those of the
  CHECK_EVERY steps before the last ones (copied off the device meanwhile, so no look waits for
  it) and agree in one collective; before every checkpoint and at every epoch's end they look at
  every step not yet seen. The run stops at that step: at most 2 * CHECK_EVERY - 1 steps after the
  first bad one, and never after a checkpoint of it.
- With nonfinite_patience=N a step whose averaged gradient is not finite is skipped (the weights and
  the optimizer's state stay as they were) and the run stops at the (N+1)-th bad step in a row. The
  step reads its norm to decide, one device sync a step; the norm is the averaged gradient's, the
  same on every rank, so every rank skips and stops alike.
- With fp16 the loss scale already skips a step whose gradient overflowed and lowers the scale; a run
  stops once FP16_OVERFLOWS steps in a row overflowed (or the patience, if longer): the scale has
  then fallen by 2**24 and no scale makes its gradients finite.

Before each checkpoint the weights themselves are checked too (a finite loss with a non-finite
gradient leaves them so). Rank 0 leaves MARKER in the run directory; the launching hvdtrain records
the run as `diverged` and exits with hvdtrain.errors.EXIT_DIVERGED. The checkpoints on disk are the
last finite ones.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hvdtrain.runtime.common import atomic_write_bytes

MARKER = "diverged.json"
"""In the run directory: where and how the run diverged, written by rank 0."""
CHECK_EVERY = 5
"""Steps between the ranks' looks at their losses, where no step reads them itself."""
FP16_OVERFLOWS = 24
"""fp16 steps in a row whose gradient overflowed before the run counts as diverged."""


@dataclass(frozen=True)
class Bad:
    """The first bad step a rank saw."""

    step: int
    epoch: int
    what: str
    """"loss", "gradient norm" or "weights"."""
    value: float


class Diverged(Exception):
    """Raised on every rank, at the same step, once rank 0 has left the marker."""

    def __init__(self, bad: Bad, stopped_at: int) -> None:
        super().__init__(f"{bad.what} {bad.value} at step {bad.step}")
        self.bad, self.stopped_at = bad, stopped_at


class Guard:
    """One run's watch over its steps. Every rank calls it alike: after_step after each optimizer
    step, settle before a checkpoint and at an epoch's end."""

    def __init__(
        self,
        enabled: bool,
        patience: int,
        loss_scaled: bool,
        agree: Callable[[list[float]], list[float]],
        gather: Callable[[Any], list[Any]],
        run_dir: Path,
        is_chief: bool,
        read: Callable[[list[Any]], Callable[[], list[list[float]]]] = lambda rows: (
            lambda: [[float(v) for v in row] for row in rows]
        ),
        before_stop: Callable[[], None] = lambda: None,
    ) -> None:
        self.enabled = enabled
        self.skips = enabled and patience > 0 and not loss_scaled
        """Whether the step itself reads the gradient's norm and skips an update that is not finite."""
        self.limit = max(patience, FP16_OVERFLOWS) if loss_scaled else patience
        self.lazy = enabled and not self.skips and not loss_scaled
        """Whether the losses wait on the device for the next look."""
        self.agree, self.gather, self.run_dir, self.is_chief = agree, gather, run_dir, is_chief
        self.read, self.before_stop = read, before_stop
        """read starts reading the figures of steps as floats, in one copy off the device, and returns
        what waits for that copy: a look reads the steps of the look before, long computed, so
        it never waits for the device's queue."""
        self.pending: list[tuple[int, int, Any]] = []
        self.reading: tuple[list[tuple[int, int]], Callable[[], list[list[float]]]] | None = None
        self.in_a_row, self.first_in_a_row = 0, None
        self.went_on_after = 0
        """Bad steps skipped that good ones followed."""
        self.saved_step: int | None = None
        """The step of the newest checkpoint this run wrote (the last finite one)."""

    def after_step(
        self, step: int, epoch: int, values: Any, skipped: bool, value: Callable[[], float]
    ) -> None:
        """`values`: this step's loss (and the norm, where one was taken) as a device tensor, read
        only at the next look; `skipped`: the update was not applied (a non-finite gradient);
        `value` reads the bad figure of a skipped step."""
        if not self.enabled:
            return
        if skipped:
            self.in_a_row += 1
            if self.in_a_row == 1:
                what = "gradient norm" if self.skips else "fp16 gradient (overflowed)"
                self.first_in_a_row = Bad(step, epoch, what, value() if self.skips else math.inf)
            if self.in_a_row > self.limit:
                self._stop(self.first_in_a_row, step)
            return
        self.went_on_after += self.in_a_row
        self.in_a_row = 0
        if self.lazy:
            self.pending.append((step, epoch, values))
            if step % CHECK_EVERY == 0:
                self._look(step, epoch, None, wait=False)

    def reset(self) -> None:
        """After an elastic reset: the steps since the last commit are taken again, by a world that
        may hold new ranks, so every rank forgets what it counted of them."""
        self.in_a_row, self.first_in_a_row, self.pending, self.reading = 0, None, [], None

    def settle(self, step: int, epoch: int, finite_weights: Callable[[], bool]) -> None:
        """Before a checkpoint and at an epoch's end, on every rank: the losses not yet looked at and
        the weights, agreed on in one collective. Raises Diverged where any is not finite."""
        if self.enabled:
            self._look(step, epoch, finite_weights, wait=True)

    @property
    def skipped(self) -> int:
        """Updates not applied since this process started the run (fp16's overflows included)."""
        return self.went_on_after + self.in_a_row

    def saved(self, step: int) -> None:
        self.saved_step = step

    def _look(self, step: int, epoch: int, finite_weights: Callable[[], bool] | None, wait: bool) -> None:
        """`wait`: read the steps since the last look too (a checkpoint, or the epoch's end, waits
        for the device anyway); else only those of the look before, and start reading these."""
        bad = self._first_bad()
        self._start_reading()
        if wait:
            newer = self._first_bad()
            bad = bad or newer
        weights_bad = finite_weights is not None and not finite_weights()
        if weights_bad and bad is None:
            bad = Bad(step, epoch, "weights", math.nan)
        if self.agree([1.0 if bad is not None else 0.0], "hvdtrain.diverged")[0] == 0:
            return
        seen = [b for b in self.gather(bad) if b is not None]
        self._stop(min(seen, key=lambda b: (b.step, b.what)), step)

    def _start_reading(self) -> None:
        steps = [(step, epoch) for step, epoch, _ in self.pending]
        self.reading = (steps, self.read([values for _, _, values in self.pending])) if steps else None
        self.pending = []

    def _first_bad(self) -> Bad | None:
        """The first bad step of the figures being read, which are then done with."""
        if self.reading is None:
            return None
        steps, rows = self.reading[0], self.reading[1]()
        self.reading = None
        for (step, epoch), row in zip(steps, rows, strict=True):
            for what, value in zip(("loss", "gradient norm"), row, strict=False):
                if not math.isfinite(value):
                    return Bad(step, epoch, what, value)
        return None

    def _stop(self, bad: Bad, step: int) -> None:
        self.before_stop()  # the marker names the last checkpoint: on disk by then
        if self.is_chief:
            record = {**asdict(bad), "value": str(bad.value), "stopped_at": step, "in_a_row": self.in_a_row}
            record |= {"checkpoint": self.saved_step, "time": time.time()}
            atomic_write_bytes(self.run_dir / MARKER, (json.dumps(record) + "\n").encode())
        self.agree([0.0], "hvdtrain.diverged.done")  # no rank ends while rank 0 still writes
        raise Diverged(bad, step)


def describe(record: dict) -> str:
    """The line that says where a run diverged, from its marker."""
    at = f"{record['what']} {record['value']} at step {record['step']} (epoch {record['epoch'] + 1})"
    skipped = f", {record['in_a_row']} steps in a row skipped" if record.get("in_a_row") else ""
    return f"diverged: {at}{skipped}; every rank stopped after step {record['stopped_at']}"

"""What rank 0 prints about its progress and the launching side reads back: the progress record and
its marker, the variable that sets how often, and numbers as people write them. The rank side owns
the format (it writes it); the console imports it from here, so neither side imports the other."""

from __future__ import annotations

import json
import math

PROGRESS_MARK = "hvdtrain:progress "
PROGRESS_ENV = "HVDTRAIN_PROGRESS_S"
"""Seconds between rank 0's progress records within an epoch; the CLI sets it for the ranks."""


def human(value: object) -> str:
    """A number as people write it: 32,180 not 3.218e+04, 0.0764 not 7.64e-02, never an exponent."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    if value == 0:
        return "0"
    if abs(value) >= 999.95:  # what rounds to four digits before the point
        return f"{value:,.0f}"
    decimals = max(0, 3 - math.floor(math.log10(abs(value))))  # four significant digits
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def progress_record(
    epoch: int, epochs: int, step: int, steps: int, samples_per_sec: float, loss: float | None, eta_s: float
) -> str:
    """The line rank 0 prints within an epoch (1-based epoch, steps done of steps); `Console` reads
    it back."""
    record = {"epoch": epoch, "epochs": epochs, "step": step, "steps": steps}
    record |= {"samples_per_sec": samples_per_sec, "loss": loss, "eta_s": eta_s}
    return PROGRESS_MARK + json.dumps(record)

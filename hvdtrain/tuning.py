"""Horovod's tensor fusion threshold and cycle time per recipe, from measurements instead of faith in
Horovod's defaults (128 MB, 1 ms). `hvdtrain bench RECIPE --tune` times the defaults against a few
other settings and against Horovod's autotune, side by side, and keeps the winner for that recipe
here when it beats the defaults by more than a run's noise; `hvdtrain run RECIPE` then sets it, and
its plan says so. The plan is made before the model exists, so what was measured is keyed by recipe,
as `--launcher auto` keys its measurements by framework."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hvdtrain.paths import cache_dir
from hvdtrain.runtime.common import atomic_write_bytes, read_json_object

TUNING_MEASUREMENTS = cache_dir() / "horovod-tuning.json"
"""recipe -> the chosen setting, its ratio to Horovod's defaults and every figure behind it."""
VARIABLES = ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME")
MARGIN = 1.03
"""A setting must beat the defaults by 3 %: interleaved runs here differ by about that much."""


@dataclass(frozen=True)
class Tuning:
    fusion_mb: int
    cycle_ms: float

    def env(self) -> dict[str, str]:
        return {
            "HOROVOD_FUSION_THRESHOLD": str(self.fusion_mb << 20),
            "HOROVOD_CYCLE_TIME": f"{self.cycle_ms:g}",
        }

    def label(self) -> str:
        return f"fusion {self.fusion_mb} MB, cycle {self.cycle_ms:g} ms"


HOROVOD_DEFAULTS = Tuning(128, 1)
CANDIDATES = (HOROVOD_DEFAULTS, Tuning(128, 5), Tuning(128, 20), Tuning(32, 1), Tuning(32, 5))
"""What --tune times beside Horovod's autotune: fewer, larger fused allreduces (a longer cycle) and
smaller buffers that start sooner in the backward pass."""
AUTOTUNE = "autotune"


def choose(rates: Mapping[Tuning, float]) -> Tuning:
    """The fastest setting, where it beats Horovod's defaults by MARGIN; else the defaults."""
    best = max(rates, key=rates.get)
    return best if rates[best] >= MARGIN * rates[HOROVOD_DEFAULTS] else HOROVOD_DEFAULTS


def read(path: Path = TUNING_MEASUREMENTS) -> dict[str, dict]:
    return read_json_object(path) or {}


def record(
    recipe: str,
    rates: Mapping[Tuning, float],
    where: str,
    autotune: float | None,
    path: Path = TUNING_MEASUREMENTS,
) -> dict:
    """Keep this recipe's choice, replacing the one before (written atomically)."""
    chosen = choose(rates)
    kept = read(path)
    kept[recipe] = {
        "fusion_mb": chosen.fusion_mb,
        "cycle_ms": chosen.cycle_ms,
        "ratio_to_defaults": rates[chosen] / rates[HOROVOD_DEFAULTS],
        "measured": where,
        "samples_per_sec": {t.label(): rate for t, rate in rates.items()}
        | ({AUTOTUNE: autotune} if autotune is not None else {}),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(kept, indent=2) + "\n").encode())
    return kept


def measured(kept: Mapping[str, Mapping], recipe: str) -> tuple[Tuning, float, str] | None:
    """The setting kept for this recipe, if it is not Horovod's defaults: (setting, ratio, where)."""
    entry = kept.get(recipe)
    try:
        tuning = Tuning(int(entry["fusion_mb"]), float(entry["cycle_ms"]))
        found = tuning, float(entry["ratio_to_defaults"]), str(entry["measured"])
    except (TypeError, KeyError, ValueError):  # nothing kept, or a file from another version
        return None
    return None if tuning == HOROVOD_DEFAULTS else found

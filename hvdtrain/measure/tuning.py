"""The communication settings a strategy leaves to defaults, per recipe, from measurements instead of
faith: Horovod's tensor fusion threshold and cycle time (its defaults 128 MB, 1 ms) and whether its
gradients travel as fp16 (which pays only where the link, not the compute, bounds the step), and DDP's
gradient bucket size (torch's default 25 MB, the first bucket 1 MB). `hvdtrain bench RECIPE --tune`
times the defaults against a few other settings (and, for Horovod, its autotune) side by side, and
keeps the winner for that recipe here when it beats the defaults by more than a run's noise;
`hvdtrain run RECIPE` then sets it, and its plan says so. The plan is made before the model exists,
so what was measured is keyed by strategy and recipe, as `--launcher auto` keys its measurements by
framework."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from hvdtrain.paths import cache_dir
from hvdtrain.runtime.common import (
    BUCKET_VARIABLE,
    COMPRESSION_VARIABLE,
    COMPRESSIONS,
    atomic_write_bytes,
    read_json_object,
)

TUNING_MEASUREMENTS = cache_dir() / "tuning.json"
"""strategy -> recipe -> the chosen setting, its ratio to the defaults and every figure behind it."""
MARGIN = 1.03
"""A setting must beat the defaults by 3 %: interleaved runs here differ by about that much."""


@dataclass(frozen=True)
class Tuning:
    """Horovod's tensor fusion threshold and cycle time, and its gradient compression."""

    fusion_mb: int
    cycle_ms: float
    compression: str = "none"
    """`none` or `fp16` (COMPRESSIONS)."""

    @classmethod
    def from_json(cls, kept: Mapping) -> Tuning:
        compression = str(kept.get("compression", "none"))  # kept before compression was tuned: none
        if compression not in COMPRESSIONS:
            raise ValueError(compression)
        return cls(int(kept["fusion_mb"]), float(kept["cycle_ms"]), compression)

    def env(self) -> dict[str, str]:
        return {
            "HOROVOD_FUSION_THRESHOLD": str(self.fusion_mb << 20),
            "HOROVOD_CYCLE_TIME": f"{self.cycle_ms:g}",
        } | ({COMPRESSION_VARIABLE: self.compression} if self.compression != "none" else {})

    def label(self) -> str:
        compressed = f", {self.compression} compression" if self.compression != "none" else ""
        return f"fusion {self.fusion_mb} MB, cycle {self.cycle_ms:g} ms{compressed}"


@dataclass(frozen=True)
class Buckets:
    """DDP's gradient bucket size (`bucket_cap_mb`); None is torch's default, which is not the same
    as 25 MB given: its first bucket is 1 MB, so that the first allreduce starts early."""

    bucket_mb: float | None

    @classmethod
    def from_json(cls, kept: Mapping) -> Buckets:
        return cls(None if kept["bucket_mb"] is None else float(kept["bucket_mb"]))

    def env(self) -> dict[str, str]:
        return {} if self.bucket_mb is None else {BUCKET_VARIABLE: f"{self.bucket_mb:g}"}

    def label(self) -> str:
        return "buckets 25 MB, first 1 MB" if self.bucket_mb is None else f"buckets {self.bucket_mb:g} MB"


Setting = Tuning | Buckets


@dataclass(frozen=True)
class Tunable:
    """What --tune times for one strategy, which declares it (`Strategy.tunable`)."""

    strategy: str
    """The strategy's name, under which its measurements are kept."""
    owner: str
    """Whose settings, as the plan's line names them."""
    defaults: Setting
    candidates: tuple[Setting, ...]
    """The defaults first."""
    kind: type[Tuning] | type[Buckets]
    variables: tuple[str, ...]
    """The environment variables its settings are given by."""
    autotune: bool
    """Horovod's own autotune is timed beside them."""


HOROVOD_DEFAULTS = Tuning(128, 1)
DDP_DEFAULTS = Buckets(None)
# fewer, larger fused allreduces (a longer cycle), smaller buffers that start sooner in the backward,
# and half the bytes on the wire for a cast each way
HOROVOD = Tunable(
    "horovod",
    "Horovod",
    HOROVOD_DEFAULTS,
    (
        HOROVOD_DEFAULTS,
        Tuning(128, 5),
        Tuning(128, 20),
        Tuning(32, 1),
        Tuning(32, 5),
        Tuning(128, 1, "fp16"),
    ),
    Tuning,
    ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", COMPRESSION_VARIABLE),
    autotune=True,
)
AUTOTUNE = "autotune"


def choose(rates: Mapping[Setting, float], defaults: Setting) -> Setting:
    """The fastest setting, where it beats the defaults by MARGIN; else the defaults."""
    best = max(rates, key=rates.__getitem__)
    return best if rates[best] >= MARGIN * rates[defaults] else defaults


def read(path: Path = TUNING_MEASUREMENTS) -> dict[str, dict]:
    return read_json_object(path) or {}


def record(
    tunable: Tunable,
    recipe: str,
    rates: Mapping[Setting, float],
    where: str,
    autotune: float | None,
    path: Path = TUNING_MEASUREMENTS,
) -> dict:
    """Keep this recipe's choice for the strategy, replacing the one before (written atomically)."""
    defaults = tunable.defaults
    chosen = choose(rates, defaults)
    kept = read(path)
    kept.setdefault(tunable.strategy, {})[recipe] = {
        "setting": asdict(chosen),
        "ratio_to_defaults": rates[chosen] / rates[defaults],
        "measured": where,
        "samples_per_sec": {t.label(): rate for t, rate in rates.items()}
        | ({AUTOTUNE: autotune} if autotune is not None else {}),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(kept, indent=2) + "\n").encode())
    return kept


def measured(
    kept: Mapping[str, Mapping], tunable: Tunable | None, recipe: str
) -> tuple[Setting, float, str] | None:
    """The setting kept for this strategy and recipe, if it is not the defaults: (setting, ratio, where);
    None also for a strategy with nothing to tune."""
    if tunable is None:
        return None
    try:
        entry = kept[tunable.strategy][recipe]
        setting = tunable.kind.from_json(entry["setting"])
        found = setting, float(entry["ratio_to_defaults"]), str(entry["measured"])
    except (TypeError, KeyError, ValueError, AttributeError):  # nothing kept, or another version's file
        return None
    return None if setting == tunable.defaults else found


def check_settings(environment: Mapping[str, str]) -> None:
    """The user's own DDP bucket size and Horovod compression, refused in one line unless a positive
    number of MB and one of COMPRESSIONS (Horovod reads its own variables)."""
    compression = environment.get(COMPRESSION_VARIABLE)
    if compression is not None and compression not in COMPRESSIONS:
        raise ValueError(
            f"{COMPRESSION_VARIABLE} is Horovod's gradient compression, {' or '.join(COMPRESSIONS)}; "
            f"got {compression!r}"
        )
    value = environment.get(BUCKET_VARIABLE)
    if value is None:
        return
    try:
        mb = float(value)
    except ValueError:
        mb = math.nan
    if not (math.isfinite(mb) and mb > 0):
        raise ValueError(
            f"{BUCKET_VARIABLE} is DDP's gradient bucket size in MB, a positive number; got {value!r}"
        )


def planned(
    tunable: Tunable, chosen: tuple[Setting, float, str] | None, given: Iterable[str]
) -> tuple[dict[str, str], str | None]:
    """The variables a kept setting sets, and the plan's line saying so; nothing where none was kept
    or the user set any of its variables (`given`)."""
    if chosen is None or set(given) & set(tunable.variables):
        return {}, None
    setting, ratio, where = chosen
    owner = tunable.owner
    return setting.env(), (
        f"hvdtrain: {owner} {setting.label()} for this recipe, {ratio:.2f}x {owner}'s defaults as "
        f"measured {where} (hvdtrain bench --tune)"
    )

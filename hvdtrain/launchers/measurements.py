"""What `--launcher auto` reads: each framework's Horovod training throughput per launcher on this
machine, as `hvdtrain bench ... --launchers gloo,mpi` measured it, kept between runs."""

from __future__ import annotations

import json
from pathlib import Path

from hvdtrain.paths import cache_dir
from hvdtrain.runtime.common import atomic_write_bytes, read_json_object

LAUNCHER_MEASUREMENTS = cache_dir() / "launchers.json"
"""framework -> launcher -> samples/s."""


def read_measurements(path: Path = LAUNCHER_MEASUREMENTS) -> dict[str, dict[str, float]]:
    """What was measured here; nothing (`auto` takes the default) where the file is missing or unreadable."""
    return read_json_object(path) or {}


def record_measurements(
    framework: str, samples_per_sec: dict[str, float], path: Path = LAUNCHER_MEASUREMENTS
) -> dict[str, dict[str, float]]:
    """Replace one framework's figures, keeping the others; written atomically, so a killed bench
    leaves the last complete measurements."""
    measured = read_measurements(path)
    measured[framework] = samples_per_sec
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(measured, indent=2) + "\n").encode())
    return measured

"""Every test belongs to one tier, marked by its folder, so a tier runs alone (`pytest -m inprocess`):

- unit: no framework step, no ranks; plans, argv tables, config, registries, files;
- inprocess: the training loops in this process on a single-process backend (torch, TensorFlow);
- multirank: real ranks started by hvdtrain or horovodrun;
- rig: multi-rank tests on the namespace hosts (root), a subset of multirank.

`make check` runs unit and inprocess; `make test` runs every tier and never skips one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TIERS = {"unit": "unit", "inprocess": "inprocess", "integration": "multirank"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(item.path).relative_to(Path(__file__).parent).parts[0]
        item.add_marker(TIERS[folder])
        if "rig" in getattr(item, "fixturenames", ()):
            item.add_marker("rig")

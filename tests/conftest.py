"""Every test belongs to one tier, marked by its folder, so a tier runs alone (`pytest -m inprocess`):

- unit: no framework step, no ranks; plans, argv tables, config, registries, files;
- inprocess: the training loops in this process on a single-process backend (torch, TensorFlow);
- multirank: real ranks started by hvdtrain or horovodrun;
- rig: multi-rank tests on the namespace hosts (root), a subset of multirank.

`make check` runs unit and inprocess; `make test` runs every tier and never skips one, on two
pytest workers (pytest-xdist). Tests that time how a job ends (killed, stalled, signalled), pull
cables, kill hosts or start Ray share one group, so they run one after another on one worker while
the other worker takes the tests that only check numbers; each other integration module is a group
of its own, so the runs it shares start once; unit and in-process tests are spread one by one.
Not three workers: with more ranks than cores, a healthy rank waits seconds for a core, and the
timed tests' stall timeouts of a few seconds fire.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# A developer's own tracking server would get every test run (hvdtrain reads MLflow's variable);
# tests/integration/test_tracking.py sets its own.
os.environ.pop("MLFLOW_TRACKING_URI", None)

TIERS = {"unit": "unit", "inprocess": "inprocess", "integration": "multirank"}


ONE_AT_A_TIME = {
    "test_elastic",
    "test_failures",  # stall timeouts
    "test_multihost",
    "test_ray",  # one Ray cluster on this machine at a time
    "test_reliability",  # which addresses a job listens on
    "test_restarts",
    "test_rig",
    "test_signals",
    "test_slurm",  # the Slurm cluster's daemons run on the rig's hosts
    "test_slurm_rig",
    "test_terminal",
}
"""Integration modules whose tests run in one group, in the order collected (see above)."""


def group_of(nodeid: str) -> str:
    """The unit of work a pytest worker takes whole: the one-at-a-time group, an integration module,
    or a single test."""
    path = nodeid.split("::", 1)[0]
    if not path.startswith("tests/integration/"):
        return nodeid
    module = Path(path).stem
    return "one-at-a-time" if module in ONE_AT_A_TIME else path


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's own `--dist loadgroup` reads groups from rewritten node ids, which this pytest no
    longer lets a plugin rewrite; a scope scheduler asked for the scope directly groups the same.
    Another --dist the caller names is left to xdist."""
    from xdist.scheduler import LoadScopeScheduling

    if config.getoption("dist") != "load":  # -n N alone means load
        return None

    class Grouped(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return Grouped(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The session's Slurm cluster, once up, runs daemons on the rig's hosts until the session ends: tests
    # that use it go after those that expect the hosts to run nothing but sshd.
    items.sort(key=lambda item: "slurm" in getattr(item, "fixturenames", ()))
    for item in items:
        folder = Path(item.path).relative_to(Path(__file__).parent).parts[0]
        item.add_marker(TIERS[folder])
        if "rig" in getattr(item, "fixturenames", ()):
            item.add_marker("rig")

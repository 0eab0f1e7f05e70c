"""Every test belongs to one tier, marked by its folder, so a tier runs alone (`pytest -m inprocess`):

- unit: no framework step, no ranks; plans, argv tables, config, registries, files;
- inprocess: the training loops in this process on a single-process backend (torch, TensorFlow);
- multirank: real ranks started by hvdtrain or horovodrun;
- rig: multi-rank tests on the namespace hosts (root), a subset of multirank.

`make check` runs unit and inprocess; `make test` runs every tier and never skips one, on four
pytest workers (pytest-xdist). The tests on the namespace hosts or Ray make three groups (the hosts,
Slurm, Ray), each run one after another on one worker and its own rig; the tests that time how a job
ends on this host (killed, stalled, signalled) share another; each other integration module is a
group of its own, so the runs it shares start once; unit and in-process tests are spread one by one.
Four workers on two cores: the four long groups spend most of their time waiting (for a timeout, a
lost host, Slurm, Ray), which the tests that only check numbers fill.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# A developer's own tracking server would get every test run (hvdtrain reads MLflow's variable);
# tests/integration/test_tracking.py sets its own.
os.environ.pop("MLFLOW_TRACKING_URI", None)

# Four workers share two cores: torch's OpenMP team or TensorFlow's intra-op pool, two threads each,
# spin against the other workers' processes (a third more CPU for the in-process tier, a 15-epoch
# single-rank run up to eight times slower). One compute thread per process, in the workers and in
# every run they start: hvdtrain takes OMP_NUM_THREADS as --threads-per-rank's default. TensorFlow's
# inter-op pool keeps its size: a parameter server's, of one thread, deadlocks.
for _variable in ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS"):
    os.environ[_variable] = "1"

TIERS = {"unit": "unit", "inprocess": "inprocess", "integration": "multirank"}


ON_THE_RIG = {
    "test_elastic": "rig-hosts",
    "test_multihost": "rig-hosts",
    "test_rig": "rig-hosts",
    "test_slow_rank": "rig-hosts",  # four hosts of the rig, and timings a busier machine would blur
    "test_ray": "ray",  # one Ray on this machine at a time, and its tests count every Ray process here
    "test_slurm": "slurm",  # one Slurm cluster at a time: its daemons run on the rig's hosts
    "test_slurm_rig": "slurm",
    "test_slurm_sweep": "slurm",
}
"""Integration modules on the namespace hosts or Ray, by group: a group runs in the order collected, on
one worker and its rig (tests/integration/conftest.py); groups run at once, each worker on a rig of
its own."""

TIMED = {
    "test_failures",  # stall timeouts
    "test_reliability",  # which addresses a job listens on
    "test_restarts",
    "test_signals",
    "test_terminal",
}
"""Integration modules on this host that time how a job ends: one group, in the order collected."""

LONGEST_FIRST = ("ray", "rig-hosts", "slurm", "timed")
"""The groups that take longest, mostly waiting (for Ray, Slurm, a lost host, a timeout): the workers
take them first, and the tests that only check numbers fill the time around them (a group taken last
would be the run's tail). The other integration modules come next, one of them up to a minute long;
the in-process and unit tests, seconds each, come last and even out the workers' ends."""

TIER_ORDER = ("integration", "inprocess", "unit")


def group_of(nodeid: str) -> str:
    """The unit of work a pytest worker takes whole: one of the two groups above, an integration
    module, or a single test."""
    path = nodeid.split("::", 1)[0]
    if not path.startswith("tests/integration/"):
        return nodeid
    module = Path(path).stem
    if module in ON_THE_RIG:
        return ON_THE_RIG[module]
    return "timed" if module in TIMED else path


class GroupedScheduling:
    """The scheduler hook, registered only where pytest-xdist is installed: a conftest that defines
    an xdist hook itself makes pytest without xdist (the image's) stop on an unknown hook before
    collecting a test."""

    @staticmethod
    def pytest_xdist_make_scheduler(config: pytest.Config, log):
        """xdist's own `--dist loadgroup` reads groups from rewritten node ids, which this pytest no
        longer lets a plugin rewrite; a scope scheduler asked for the scope directly groups the same.
        Another --dist the caller names is left to xdist."""
        from xdist.scheduler import LoadScopeScheduling

        if config.getoption("dist") != "load":  # -n N alone means load
            return None
        # The order is the collection's (pytest_collection_modifyitems below), not xdist's default of
        # the groups with the most tests first, which leaves a one-test module of a minute to the end.
        config.option.loadscopereorder = False

        class Grouped(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return group_of(nodeid)

        return Grouped(config, log)


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(GroupedScheduling(), "hvdtrain-grouped-scheduling")


def folder_of(item: pytest.Item) -> str:
    return Path(item.path).relative_to(Path(__file__).parent).parts[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def order(item: pytest.Item) -> int:
        group = group_of(item.nodeid)
        if group in LONGEST_FIRST:
            return LONGEST_FIRST.index(group)
        return len(LONGEST_FIRST) + TIER_ORDER.index(folder_of(item))

    items.sort(key=order)
    for item in items:
        item.add_marker(TIERS[folder_of(item)])
        if "rig" in getattr(item, "fixturenames", ()):
            item.add_marker("rig")

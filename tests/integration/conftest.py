"""Integration tests start real ranks: `hvdtrain run` as a subprocess, with a timeout, on loopback.
Their helpers are in tests/support/helpers.py; here are the fixtures."""

from __future__ import annotations

import os

import pytest

from tests.support.helpers import SharedRuns
from tests.support.rig import Rig, RigError
from tests.support.slurm import SlurmCluster


def _up(made):
    """Starts a rig or a cluster for the session and takes it down after, even when tests fail. A
    machine that cannot make it (not root, a program missing) fails the tests that use it: they
    never skip."""
    problem = None
    try:
        made.start()
    except RigError as error:
        problem = str(error)
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="session")
def rig():
    """Four hosts on this machine behind a bridge of this pytest worker's own (hvd0 and 10.77.0.0/24
    for the first, hvd1 and 10.77.1.0/24 for the next, ...), each host with its own hostname, private
    disk and sshd (tests/support/rig.py); most tests use the first two. Workers' rigs live side by
    side, so the groups of tests on the hosts (tests/conftest.py) run at once."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    yield from _up(Rig(hosts=4, bridge=f"hvd{worker}", subnet=f"10.77.{worker}.0/24"))


@pytest.fixture(scope="module")
def slurm(rig, request):
    """A real Slurm cluster on the rig's hosts (tests/support/slurm.py): slurmctld on hvdhost1, a slurmd
    on each of the first two hosts (a module's SLURM_NODES says how many), one partition of them,
    clients through `slurm.env()` or `slurm.run(...)`. For one module at a time: its daemons run on
    the hosts, which the other tests on this worker's rig expect to run nothing but sshd."""
    yield from _up(SlurmCluster(rig, hosts=getattr(request.module, "SLURM_NODES", 2)))


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory) -> SharedRuns:
    """Runs that several tests check, each started once for the session, by whichever worker asks
    first (tests/support/helpers.py): what a test asserts stays its own, the start-up of ranks is
    paid once."""
    base = tmp_path_factory.getbasetemp()
    # pytest-xdist gives each worker base/../popen-gwN; the folder above is the session's
    return SharedRuns((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-runs")

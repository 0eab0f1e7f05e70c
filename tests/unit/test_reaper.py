"""The one reaper: what the runner, the ps supervisor and the Ray driver end goes away, also a
process that ignores SIGTERM, and none is left a zombie."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from hvdtrain.launching.runner import end_processes

STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
    "time.sleep(60)"
)


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period():
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stubborn = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
    assert stubborn.stdout.readline().strip() == "ready"  # its handler is in place
    start = time.monotonic()
    end_processes([polite, stubborn], grace_s=1)
    assert 1 <= time.monotonic() - start < 8
    assert polite.poll() is not None and stubborn.poll() is not None
    assert not psutil.pid_exists(polite.pid) and not psutil.pid_exists(stubborn.pid)  # reaped, no zombies


def test_processes_told_to_stop_already_are_waited_for_not_signalled():
    start = time.monotonic()
    finishing = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    end_processes([psutil.Process(finishing.pid)], grace_s=10, terminate=False)
    assert 1 <= time.monotonic() - start < 6  # it ran to its own end, and was not waited on for longer
    assert not psutil.pid_exists(finishing.pid)

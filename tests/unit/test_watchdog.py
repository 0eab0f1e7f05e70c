from __future__ import annotations

import sys
import threading
import time

import pytest

from hvdtrain.errors import EXIT_STALL
from hvdtrain.runtime import watchdog


def _load_fake_horovod(tmp_path):
    package = tmp_path / "horovod" / "torch"
    package.mkdir(parents=True)
    (tmp_path / "horovod" / "__init__.py").write_text("")
    (package / "__init__.py").write_text(
        "import threading\ndef allreduce(tensor, name=None, event=None):\n    event.wait()\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import horovod.torch as fake  # noqa: PLC0415
    finally:
        sys.path.remove(str(tmp_path))
    return fake


def test_collective_in_progress_reads_the_tensor_name(tmp_path, monkeypatch):
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "horovod" or k.startswith("horovod.")}
    try:
        fake = _load_fake_horovod(tmp_path)
        release = threading.Event()
        worker = threading.Thread(
            target=fake.allreduce, args=(None,), kwargs={"name": "grad.w", "event": release}
        )
        worker.start()
        time.sleep(0.1)
        assert watchdog.collective_in_progress(sys._current_frames()[worker.ident]) == "grad.w"
        assert watchdog.collective_in_progress(sys._current_frames()[threading.get_ident()]) is None
        release.set()
        worker.join()
    finally:
        for key in [k for k in sys.modules if k == "horovod" or k.startswith("horovod.")]:
            del sys.modules[key]
        sys.modules.update(saved)


def test_rank_comes_from_either_launcher(monkeypatch):
    for key in ("HOROVOD_RANK", "HOROVOD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert watchdog.rank_from_env() is None
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert watchdog.rank_from_env() == (1, 4)


def test_missing_ranks_are_those_elsewhere_silent_or_unheard():
    now = 1000.0
    waiting = {"waiting": "grad.w", "heartbeat": now}
    statuses = {
        0: waiting,
        1: {"waiting": None, "heartbeat": now},  # computing, never joined
        2: {"waiting": "grad.w", "heartbeat": now - 60},  # SIGSTOPped inside the same collective
        3: waiting,
    }
    assert watchdog.held_up_by(statuses, 4, "grad.w", now - 5) == ([1, 2], [])
    assert watchdog.stall_verdict({0: waiting}, 3, "grad.w", now - 5) == (
        "none seen here (no status from rank(s) 1, 2: another host?)"
    )


def test_horovods_launchers_frames_are_no_collective():
    """A rank of --launcher ray runs inside horovod.ray's actor method from start to end."""
    for path, expected in [
        ("/venv/site-packages/horovod/ray/worker.py", None),
        ("/venv/site-packages/horovod/runner/gloo_run.py", None),
        ("/venv/site-packages/horovod/torch/mpi_ops.py", "unnamed"),
    ]:
        namespace: dict = {}
        exec(compile("import sys\nframe = sys._getframe()", path, "exec"), namespace)
        assert watchdog.collective_in_progress(namespace["frame"]) == expected, path


def _stack_in(path: str, function: str):
    namespace: dict = {}
    source = f"import sys\ndef {function}():\n    return sys._getframe()\nframe = {function}()"
    exec(compile(source, path, "exec"), namespace)
    return namespace["frame"]


def test_ranks_all_starting_together_are_slow_not_stalled():
    """hvd.init is named apart: every rank seen waiting in it is a slow start, but a rank that has not
    reached it, or is not heard from, still ends the job."""
    basics = "/venv/site-packages/horovod/common/basics.py"
    assert watchdog.collective_in_progress(_stack_in(basics, "init")) == watchdog.STARTUP
    assert watchdog.collective_in_progress(_stack_in(basics, "shutdown")) == "unnamed"
    now = 1000.0
    starting = {"waiting": watchdog.STARTUP, "heartbeat": now}
    assert watchdog.stall_verdict({0: starting, 1: starting}, 2, watchdog.STARTUP, now - 5) is None
    computing = {"waiting": None, "heartbeat": now}
    assert watchdog.stall_verdict({0: starting, 1: computing}, 2, watchdog.STARTUP, now - 5) == "1"
    assert watchdog.stall_verdict({0: starting}, 2, watchdog.STARTUP, now - 5).startswith("none seen here")
    both = {"waiting": "grad.w", "heartbeat": now}
    assert watchdog.stall_verdict({0: both, 1: both}, 2, "grad.w", now - 5) == "none seen here"


def test_a_late_tick_is_a_stopped_process_and_its_time_is_no_wait():
    assert watchdog.stopped_for(100.0, 101.0, 1.0) == 0.0
    assert watchdog.stopped_for(100.0, 103.5, 1.0) == 0.0, "a tick late on a loaded machine"
    assert watchdog.stopped_for(100.0, 131.0, 1.0) == 30.0, "suspended for 30 s between two ticks"


def test_a_job_suspended_whole_is_no_stall_and_a_stopped_rank_is(tmp_path, monkeypatch):
    """Two ranks' watchdogs on one clock. Rank 0 waits in an allreduce that rank 1, still computing,
    has not joined, when the whole job is stopped for 30 s: continued, neither names the other, and
    the step completes. Then rank 1 alone is stopped, and rank 0 names it."""
    clock = {"now": 1000.0}
    monkeypatch.setattr(watchdog.time, "time", lambda: clock["now"])
    ended = []

    def end(code):
        ended.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(watchdog.os, "_exit", end)
    dogs = [watchdog.StallWatchdog(tmp_path, rank, 2, timeout_s=6) for rank in (0, 1)]
    where = {0: "grad.w", 1: None}  # rank 1 computes; rank 0 waits for it
    for dog in dogs:
        dog.waiting = lambda rank=dog.rank: where[rank]
    ticking = [dog.ticks(sleep=lambda seconds: None) for dog in dogs]

    def tick(*ranks):
        clock["now"] += 1.0
        for rank in ranks:
            next(ticking[rank])

    for _ in range(3):
        tick(0, 1)
    clock["now"] += 30  # SIGSTOP to both, SIGCONT 30 s later
    tick(0, 1)
    where[1] = "grad.w"  # rank 1 joins; the step completes
    tick(0, 1)
    where[0] = where[1] = None
    for _ in range(10):
        tick(0, 1)
    assert ended == [], "a job suspended whole is no stall"
    where[0] = "grad.x"  # rank 0 waits for rank 1, which is stopped alone
    with pytest.raises(SystemExit):
        for _ in range(10):
            tick(0)
    assert ended == [EXIT_STALL], "a rank stopped alone is named"

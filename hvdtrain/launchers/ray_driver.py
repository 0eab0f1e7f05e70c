"""The program `--launcher ray` runs (hvdtrain.launchers.ray builds its argv):

    python -m hvdtrain.launchers.ray_driver --np N [--address ADDR] [--min-np A --max-np B] ...
        -- -m hvdtrain.worker ARGS...

It starts a Ray instance for the run (or joins the cluster at --address), runs `hvdtrain.worker ARGS`
in each rank's actor through horovod.ray's RayExecutor with the ranks' environment (the --env names),
tees each rank's stdout and stderr into LOG_DIR/rank.N/ on the node the rank runs on, and stops what it
started, also when a signal ends it. Its exit code is the first failed rank's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path

import psutil

from hvdtrain.launchers.ray import NEEDS_RAY, WORKER
from hvdtrain.launching.runner import end_processes
from hvdtrain.launching.spec import source_address

COOLDOWN_S = (5, 30)
"""As --launcher elastic: a failed node is blacklisted, then tried again after 5 s, 10 s, ... 30 s."""
START_TIMEOUT_S = 60
"""How long the ranks may take to find each other (Horovod's rendezvous), and Ray to place them."""
OBJECT_STORE_BYTES = 256 << 20
"""The Ray started for a run carries only the ranks' exit codes: no need for Ray's 30% of memory."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
QUIET_WARNINGS = "ignore::DeprecationWarning:horovod.ray.worker"
"""horovod.ray 0.28.1 calls an API Ray 2.60 deprecates in every actor: three lines of noise a rank.
(A runtime_env would carry it to a joined cluster's workers too, but costs 3 s of new workers.)"""


LOOPBACK_RAY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch between a node address on loopback (off, as on macOS and Windows, where it keeps
firewall prompts away) and its default-route address (on, Linux's default)."""
LOOPBACK = "127.0.0.1"


class RankFailed(RuntimeError):
    """Raised in an elastic rank's actor so that Horovod's elastic driver records the failure."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hvdtrain.launchers.ray_driver")
    parser.add_argument("--np", type=int, required=True)
    parser.add_argument("--cpus-per-rank", type=int, default=1)
    parser.add_argument("--address", help="An existing Ray cluster to join (default: start one).")
    parser.add_argument("--min-np", type=int)
    parser.add_argument("--max-np", type=int)
    parser.add_argument("--network-interface")
    parser.add_argument("--log-dir")
    parser.add_argument("--env", action="append", default=[], help="A variable the ranks get from here.")
    parser.add_argument("program", nargs=argparse.REMAINDER, help="-- -m hvdtrain.worker ARGS...")
    args = parser.parse_args(argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if program[:2] != WORKER:
        parser.error(f"expected -- {' '.join(WORKER)} ARGS..., got {program[:2]}")
    args.worker_argv = program[2:]
    return args


# -- in each rank's actor


@contextlib.contextmanager
def tee_output(directory: Path, append: bool, rank: str) -> Iterator[None]:
    """fds 1 and 2 (Python's, Horovod's C++ and the frameworks' output alike) go to directory/stdout
    and stderr and, tagged `[RANK]<stdout>:` as horovodrun tags them, to the actor's own streams,
    which Ray forwards to the driver (the console reads the rank from the tag). A `tee` process of
    its own copies each: a rank that ends abruptly (the stall watchdog's os._exit, a crash) still
    leaves its last lines in the file, which a copying thread would lose."""
    directory.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    streams = []
    for fd, name in ((1, "stdout"), (2, "stderr")):
        original = os.dup(fd)
        argv = ["tee", *(["-a"] if append else []), str(directory / name)]
        copier = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        tagger = subprocess.Popen(
            ["sed", "-u", f"s/^/[{int(rank)}]<{name}>:/"],
            stdin=copier.stdout,
            stdout=original,
            start_new_session=True,
        )
        copier.stdout.close()
        os.dup2(copier.stdin.fileno(), fd)
        copier.stdin.close()
        streams.append((fd, original, copier))
        streams.append((fd, original, tagger))
    line_buffered = {stream: stream.line_buffering for stream in (sys.stdout, sys.stderr)}
    for stream in line_buffered:
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for stream, buffering in line_buffered.items():
            with contextlib.suppress(AttributeError, ValueError):
                stream.reconfigure(line_buffering=buffering)
        for fd, original, _ in streams[::2]:
            os.dup2(original, fd)  # the pipe's last write end closes: tee copies the rest and ends
        for _, _, copier in streams:
            with contextlib.suppress(subprocess.TimeoutExpired):
                copier.wait(timeout=5)
        for _, original, _ in streams[::2]:
            os.close(original)


def _worker_main(worker_argv: list[str]) -> int:
    """hvdtrain.worker as `python -m hvdtrain.worker` would end: its return value or exit code."""
    from hvdtrain import worker

    try:
        return worker.main(list(worker_argv))
    except SystemExit as exit:
        if exit.code is None or isinstance(exit.code, int):
            return exit.code or 0
        print(exit.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def run_rank(worker_argv: list[str], log_dir: str | None, elastic: bool) -> int:
    """What each rank's actor runs. Elastic ranks raise on failure: Horovod's elastic driver counts
    only an exception as a failed rank."""
    rank = os.environ.get("HOROVOD_RANK", "0")
    output = Path(log_dir) / f"rank.{rank}" if log_dir else None
    with tee_output(output, append=elastic, rank=rank) if output else contextlib.nullcontext():
        code = _worker_main(worker_argv)
    if elastic and code != 0:
        raise RankFailed(f"rank {rank} exited with code {code}")
    return code


# -- the driver


def report_failure(rank: int, code: int, why: str = "") -> None:
    """The line hvdtrain.launchers.ray's FAILED_RANK reads."""
    print(f"hvdtrain: ray: rank {rank} failed with exit code {code}{why}", flush=True)


def wait_static(ray, refs: list, job: dict) -> int:
    """Waits for every rank; the first that fails (in the order they end) decides the exit code."""
    pending = {ref: rank for rank, ref in enumerate(refs)}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
        if job.get("ending"):  # the driver is stopping the ranks: their deaths are no failures
            return 1
        for ref in done:
            rank = pending.pop(ref)
            try:
                code = ray.get(ref)
            except ray.exceptions.RayActorError as error:  # Ray does not know a dead process's exit code
                report_failure(rank, 1, f" (its actor died: {str(error).splitlines()[0]})")
                return 1
            except ray.exceptions.RayError as error:
                report_failure(rank, 1, f" ({type(error).__name__})")
                return 1
            if code != 0:
                report_failure(rank, code)
                return code
    return 0


def _record_stop_signals(stops: list[int]) -> None:
    """A stop signal is only recorded: raised inside Ray's C++ calls it would surface as a SystemError
    (measured), so the main thread polls for it and cleans up."""
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, lambda signum, frame: stops.append(signum))


def rendezvous_address(cluster: str) -> str | None:
    """This host's address as the cluster's nodes reach it: where the ranks find Horovod's rendezvous
    server, which runs here. horovod.ray gives the ranks Ray's idea of
    this host's address (its default-route address, unroutable from a private cluster network) or,
    elastic, gethostbyname(gethostname()) (127.0.0.1 where /etc/hosts says so)."""
    return source_address(cluster.rpartition(":")[0] or cluster)  # "auto": None, Horovod's choice stands


def run_job(ray, RayExecutor, args: argparse.Namespace, env: dict[str, str], job: dict) -> int:
    """Starts the ranks on the Ray connected to and waits for them (in a thread: see main)."""
    elastic = args.min_np is not None
    # One node (the Ray started here): loopback. A cluster: the NIC given, else Horovod probes the
    # nodes for the interfaces they share (static runs only: ray.check refuses elastic without one).
    nics = {args.network_interface} if args.network_interface else None if args.address else {"lo"}
    settings = RayExecutor.create_settings(timeout_s=START_TIMEOUT_S, nics=nics)
    # Horovod's rendezvous server listens where the ranks are told to find it (patch 0021)
    address = rendezvous_address(args.address) if args.address else LOOPBACK
    if address:
        env = {**env, "HOROVOD_GLOO_RENDEZVOUS_ADDR": address}
    if not elastic:
        executor = job["executor"] = RayExecutor(
            settings, num_workers=args.np, cpus_per_worker=args.cpus_per_rank
        )
        executor.start(extra_env_vars=env)
        return wait_static(
            ray, executor.run_remote(run_rank, args=[args.worker_argv, args.log_dir, False]), job
        )
    executor = job["executor"] = RayExecutor(
        settings,
        min_workers=args.min_np,
        max_workers=args.max_np,
        cpus_per_worker=args.cpus_per_rank,
        cooldown_range=COOLDOWN_S,
    )
    executor.start(extra_env_vars=env)
    try:
        executor.run(run_rank, args=[args.worker_argv, args.log_dir, True])
    except RuntimeError as error:
        print(f"hvdtrain: ray: the elastic job failed: {' '.join(str(error).split())}", flush=True)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not args.address:
        # Before Ray is imported, which reads it once: a Ray started for one host takes loopback as
        # its node's address, so that its servers (GCS, raylet, agents, each worker's) listen there
        # alone, as they do where Ray's address is loopback; else every one listens on 0.0.0.0.
        os.environ[LOOPBACK_RAY] = "0"
    try:
        import ray
        from horovod.ray import RayExecutor
    except ImportError:
        print(f"hvdtrain: {NEEDS_RAY}", file=sys.stderr)
        return 2
    env = {name: os.environ[name] for name in args.env if name in os.environ}
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # each rank's lines, not "[repeated 2x across cluster]"
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # hvdtrain passes the lines on, colour codes and all
    stops: list[int] = []
    _record_stop_signals(stops)
    job: dict = {}
    try:
        if args.address:
            try:
                ray.init(address=args.address)
            except Exception as error:  # an address with no cluster behind it, a refused token
                print(
                    f"hvdtrain: ray: cannot join {args.address}: {' '.join(str(error).split())[:300]}",
                    flush=True,
                )
                return 1
        else:
            # Never another Ray on this machine (address None would join one), and no token file in
            # ~/.ray for a cluster that lives as long as this run.
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            os.environ.setdefault("PYTHONWARNINGS", QUIET_WARNINGS)  # its workers inherit it
            ray.init(
                address="local",
                num_cpus=(args.max_np if args.min_np is not None else args.np) * args.cpus_per_rank,
                num_gpus=0,
                include_dashboard=False,
                object_store_memory=OBJECT_STORE_BYTES,
            )
        _record_stop_signals(stops)  # ray.init put its own SIGTERM handler in place
        if not stops:
            thread = threading.Thread(
                target=_run_job_into, args=(ray, RayExecutor, args, env, job), daemon=True
            )
            thread.start()
            while thread.is_alive() and not stops:
                thread.join(timeout=0.2)
        if stops:
            print(f"hvdtrain: ray: stopped by {signal.Signals(stops[0]).name}", file=sys.stderr, flush=True)
            return 128 + stops[0]
        return job.get("code", 1)
    finally:
        job["ending"] = True
        with contextlib.suppress(Exception):
            if "executor" in job:
                job["executor"].shutdown()  # its placement group, and with it the ranks' actors
        started = [] if args.address else psutil.Process().children(recursive=True)
        ray.shutdown()  # a Ray started here stops; a cluster joined is only left
        # the raylet and GCS stop with it and their workers a moment later, or are killed
        end_processes(started, grace_s=10, terminate=False)


def _run_job_into(ray, RayExecutor, args, env, job: dict) -> None:
    try:
        job["code"] = run_job(ray, RayExecutor, args, env, job)
    except Exception as error:  # Ray's or Horovod's own (a placement group that never fits, say)
        if not job.get("ending"):  # not Ray going away under a job the driver is stopping
            print(f"hvdtrain: ray: {type(error).__name__}: {' '.join(str(error).split())}", flush=True)
        job["code"] = 1


if __name__ == "__main__":
    sys.exit(main())

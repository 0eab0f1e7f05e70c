"""TensorFlow's parameter-server strategy: asynchronous updates, variables on parameter servers.

hvdtrain starts a supervisor (`python -m hvdtrain.strategies.ps`) that starts --np workers and
--num-ps parameter servers as separate processes, each a `tf.distribute.Server`, and the
coordinator (TF's "chief"), which runs the recipe with the ClusterCoordinator loop of
hvdtrain.runtime.tensorflow.ps (servers inside the coordinator's own process hung on 2 cores). The
supervisor ends every process when the coordinator finishes or when any process dies.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hvdtrain.config import TrainConfig
from hvdtrain.launching.runner import end_processes
from hvdtrain.launching.spec import LaunchCommand, LaunchSpec, free_ports, is_local
from hvdtrain.options import Option
from hvdtrain.strategies import LaunchContext, Strategy, StrategyLaunch, rank_threads

PS_MARKER = "hvdtrain: ps:"


def launch(
    spec: LaunchSpec, options: Mapping[str, Any], context: LaunchContext, config: TrainConfig | None = None
) -> StrategyLaunch:
    num_ps = options["num_ps"]
    if spec.np < 1 or num_ps < 1:
        raise ValueError(
            f"ps needs at least 1 worker and 1 parameter server, got --np {spec.np} --num-ps {num_ps}"
        )
    if not is_local(spec.hosts):
        raise ValueError(
            "the ps strategy starts its processes on this host; several hosts are not supported yet"
        )
    python = spec.program[0]
    argv = [python, "-m", "hvdtrain.strategies.ps", "--workers", str(spec.np), "--num-ps", str(num_ps)]
    if spec.log_dir:
        argv += ["--log-dir", spec.log_dir]
    env = {**rank_threads(spec, context, processes_per_host=spec.np + num_ps + 1), **spec.env}
    return StrategyLaunch(LaunchCommand([*argv, "--", *spec.program], env))


def refuse(config: TrainConfig) -> str | None:
    """Asynchronous updates: no allreduce to compress, sum or accumulate before."""
    if config.fp16_allreduce:
        return "fp16_allreduce needs --strategy horovod (ps has no allreduce)"
    if config.reduce_op != "average":
        return f"reduce_op={config.reduce_op} needs --strategy horovod (ps has no allreduce)"
    if config.backward_passes_per_step > 1:
        return "backward_passes_per_step > 1 needs --strategy horovod (ps applies each worker's step alone)"
    if config.warmup_epochs > 0:
        return "warmup_epochs: ps does not warm up the learning rate (it is not scaled by the workers)"
    if config.checkpoint_every_steps:
        return "checkpoint_every_steps needs --strategy horovod (ps checkpoints at epochs' ends)"
    if config.precision != "fp32":
        return (
            f"precision={config.precision} needs --strategy horovod (under ps, a loss scale and "
            "low-precision layers are not supported)"
        )
    return None


# --- the supervisor -------------------------------------------------------------------------------


def _cluster(workers: int, num_ps: int) -> dict[str, list[str]]:
    ports = iter(free_ports(1 + workers + num_ps))
    return {
        "chief": [f"localhost:{next(ports)}"],
        "worker": [f"localhost:{next(ports)}" for _ in range(workers)],
        "ps": [f"localhost:{next(ports)}" for _ in range(num_ps)],
    }


def supervise(workers: int, num_ps: int, chief_program: list[str], log_dir: Path | None) -> int:
    cluster = _cluster(workers, num_ps)
    processes: dict[str, subprocess.Popen] = {}
    logs = []

    def start(role: str, index: int, program: list[str]) -> None:
        env = {
            **os.environ,
            "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": role, "index": index}}),
        }
        out = err = None
        if log_dir is not None and role != "chief":
            folder = log_dir / f"{role}.{index}"
            folder.mkdir(parents=True, exist_ok=True)
            out, err = (folder / "stdout").open("w"), (folder / "stderr").open("w")
            logs.extend([out, err])
        processes[f"{role} {index}"] = subprocess.Popen(
            program, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL
        )

    server = [sys.executable, "-m", "hvdtrain.strategies.ps", "--serve"]
    for index in range(num_ps):
        start("ps", index, server)
    for index in range(workers):
        start("worker", index, server)
    start("chief", 0, chief_program)
    returncode = 0
    try:
        while True:
            time.sleep(0.2)
            finished = {name: p.returncode for name, p in processes.items() if p.poll() is not None}
            servers = {name: code for name, code in finished.items() if name != "chief 0"}
            if "chief 0" in finished and (finished["chief 0"] == 0 or not servers):
                returncode = finished["chief 0"]
                break
            # A server serves until it is stopped: one that ended is the cause, and a coordinator that
            # failed in the same look (its calls to that server refused) only the consequence.
            if servers:
                name, code = next(iter(servers.items()))
                print(
                    f"{PS_MARKER} {name} exited with code {code} before training finished; stopping the job",
                    file=sys.stderr,
                    flush=True,
                )
                returncode = 1
                break
    finally:
        end_processes([p for p in processes.values() if p.poll() is None], grace_s=10)
        for stream in logs:
            stream.close()
    return returncode


def serve() -> int:
    """A worker or parameter server: a gRPC server for the coordinator, until it is stopped."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from hvdtrain.runtime.imports import collector_off, import_tensorflow_without_extras

    with collector_off():  # as a rank imports it: a server uses none of Keras's extras
        import_tensorflow_without_extras()
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    # Default thread pools: one inter-op thread deadlocks a worker that waits on a parameter server.
    server = tf.distribute.Server(
        resolver.cluster_spec(),
        job_name=resolver.task_type,
        task_index=resolver.task_id,
        protocol="grpc",
        start=True,
    )
    server.join()
    return 0


def train(recipe, config, run_dir: Path, resume: bool) -> dict:
    """The coordinator's loop, beside the other TF loops."""
    from hvdtrain.runtime.tensorflow import ps

    return ps.train(recipe, config, run_dir, resume)


STRATEGY = Strategy(
    takes_stop_request=False,  # its coordinator's loop takes no stop request
    name="ps",
    frameworks=("tensorflow",),
    description="TensorFlow ParameterServerStrategy: a coordinator, --np workers, --num-ps parameter servers",
    launch=launch,
    train=train,
    options=(Option("num_ps", "--num-ps", 1, "Parameter servers.", int),),
    refuse=refuse,
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--serve"]:
        return serve()
    parser = argparse.ArgumentParser(prog="hvdtrain.strategies.ps")
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--num-ps", type=int, required=True)
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("chief", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    chief = args.chief[1:] if args.chief[:1] == ["--"] else args.chief
    return supervise(args.workers, args.num_ps, chief, args.log_dir)


if __name__ == "__main__":
    sys.exit(main())

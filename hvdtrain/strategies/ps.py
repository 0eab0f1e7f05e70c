"""TensorFlow's parameter-server strategy: asynchronous updates, variables on parameter servers.

hvdtrain starts a supervisor (`python -m hvdtrain.strategies.ps`) that starts --np workers and
--num-ps parameter servers as separate processes, each a `tf.distribute.Server`, and the
coordinator (TF's "chief"), which runs the recipe with a ClusterCoordinator loop: on TF 2.21,
Keras 3's model.fit under ParameterServerStrategy fails ("Cannot get the cardinality of a dataset
that is not built"), and servers inside the coordinator's own process hung on 2 cores. The
supervisor ends every process when the coordinator finishes or when any process dies.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hvdtrain.config import TrainConfig
from hvdtrain.launch import LaunchCommand, LaunchSpec, free_ports, is_local
from hvdtrain.strategies import LaunchContext, Option, Strategy, StrategyLaunch, rank_threads

PS_MARKER = "hvdtrain: ps:"


def launch(spec: LaunchSpec, options: Mapping[str, Any], context: LaunchContext) -> StrategyLaunch:
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
            if "chief 0" in finished:
                returncode = finished["chief 0"]
                break
            if finished:
                name, code = next(iter(finished.items()))
                print(
                    f"{PS_MARKER} {name} exited with code {code} before training finished; stopping the job",
                    file=sys.stderr,
                    flush=True,
                )
                returncode = 1
                break
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for stream in logs:
            stream.close()
    return returncode


def serve() -> int:
    """A worker or parameter server: a gRPC server for the coordinator, until it is stopped."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
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


# --- the coordinator's training loop --------------------------------------------------------------


def train(recipe, config, run_dir: Path, resume: bool) -> dict:
    import keras
    import numpy as np
    import tensorflow as tf

    from hvdtrain.runtime.common import RunLog, Throughput, rank_final
    from hvdtrain.runtime.schedule import Schedule
    from hvdtrain.runtime.tensorflow import (
        CHECKPOINT,
        load_checkpoint,
        save_checkpoint,
        tensorboard_writer,
        weights_digest,
    )

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    workers = len(resolver.cluster_spec().as_dict()["worker"])
    keras.utils.set_random_seed(config.seed)
    with strategy.scope():
        task = recipe.build(config)
        if not hasattr(task.data, "y_train"):
            raise SystemExit(
                "hvdtrain: --strategy ps trains on arrays in memory; this recipe reads its data from "
                "disk (tf.data): use --strategy horovod"
            )
        model = task.model
        # Asynchronous: each worker's step is applied alone, so a step is one batch and the
        # learning rate is not scaled (Schedule with a world size of 1).
        schedule = Schedule.for_run(config, len(task.data.y_train), world_size=1)
        optimizer = task.make_optimizer(schedule.peak_lr)
        optimizer.build(model.trainable_variables)
    state = None
    if resume:
        state = load_checkpoint(run_dir / CHECKPOINT, model)  # asynchronous: resumes, not bit-exact
    start_epoch, step = schedule.start(state)
    data = task.data

    def dataset_fn(context):
        dataset = tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train))
        return (
            dataset.shuffle(len(data.y_train), seed=config.seed + context.input_pipeline_id)
            .repeat()
            .batch(config.batch_size, drop_remainder=True)
        )

    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))

    @tf.function
    def worker_step(iterator):
        def step_fn(x, y):
            with tf.GradientTape() as tape:
                loss = task.loss(y, model(x, training=True))
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
            return loss

        x, y = next(iterator)
        return strategy.run(step_fn, args=(x, y))

    steps_per_epoch = schedule.steps_per_epoch
    log = RunLog(run_dir, True, recipe.name, "ps", workers)
    log.scalar_writer = tensorboard_writer(run_dir / "tensorboard")
    throughput, loss_value, accuracy = Throughput(), float("nan"), None
    for epoch in range(start_epoch, config.epochs):
        began = time.perf_counter()
        results = [coordinator.schedule(worker_step, args=(iterator,)) for _ in range(steps_per_epoch)]
        coordinator.join()
        rate = throughput.add(schedule.global_samples_per_epoch, time.perf_counter() - began)
        step += steps_per_epoch
        loss_value = float(np.mean([r.fetch() for r in results]))
        if task.evaluate:
            # model.predict would distribute the data to the workers; the coordinator reads the
            # variables from the parameter servers and evaluates by itself.
            predictions = model(data.x_test, training=False).numpy()
            accuracy = float((predictions.argmax(axis=1) == data.y_test).mean())
        log.epoch(
            epoch + 1,
            config.epochs,
            {"loss": loss_value, "test_accuracy": accuracy, "samples_per_sec": rate, "world_size": workers},
        )
        if config.checkpoint:
            save_checkpoint(run_dir, model, epoch + 1, step)
    # One copy of every variable lives on the parameter servers: consistent by construction.
    return log.finish(
        throughput,
        [rank_final(weights_digest(model))],
        step,
        test_accuracy=accuracy,
        final_loss=loss_value,
        epochs=config.epochs,
        num_ps=len(resolver.cluster_spec().as_dict()["ps"]),
    )


STRATEGY = Strategy(
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

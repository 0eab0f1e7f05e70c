"""The parameter-server loop: TF's ParameterServerStrategy with a ClusterCoordinator, run by the
coordinator (TF's "chief") that hvdtrain.strategies.ps started beside its workers and servers.

On TF 2.21, Keras 3's model.fit under ParameterServerStrategy fails ("Cannot get the cardinality of
a dataset that is not built"), so the coordinator schedules a tf.function step of its own. Updates
are asynchronous: each worker's step is applied alone, so a step is one batch and the learning rate
is not scaled (the schedule of a world size of 1).
"""

from __future__ import annotations

import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.config import TrainConfig
from hvdtrain.runtime import metrics
from hvdtrain.runtime.common import RunLog, Throughput, rank_final
from hvdtrain.runtime.metrics import Watch
from hvdtrain.runtime.schedule import Schedule
from hvdtrain.runtime.tensorflow.backends import Coordinator
from hvdtrain.runtime.tensorflow.loop import end_epoch, tensorboard_writer, weights_digest
from hvdtrain.runtime.tensorflow.task import make_optimizer


def train(recipe, config: TrainConfig, run_dir: Path, resume: bool) -> dict:
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    cluster = resolver.cluster_spec().as_dict()
    backend = Coordinator(workers=len(cluster["worker"]))
    keras.utils.set_random_seed(config.seed)
    with strategy.scope():
        task = recipe.build(config)
        if not hasattr(task.data, "y_train"):
            raise SystemExit(
                "hvdtrain: --strategy ps trains on arrays in memory; this recipe reads its data from "
                "disk (tf.data): use --strategy horovod"
            )
        model = task.model
        schedule = Schedule.for_run(config, len(task.data.y_train), world_size=1)
        optimizer = make_optimizer(task, schedule.peak_lr, config)
        optimizer.build(model.trainable_variables)
    checkpointer = backend.checkpointer()  # asynchronous: a resumed run continues, not bit-exact
    state = checkpointer.load(run_dir, model, optimizer, resume)
    start_epoch, step = schedule.start(state)
    watch = Watch(config.monitor, config.mode, config.early_stopping_patience, (state or {}).get("watch"))
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
    def worker_step(iterator, lr):
        def step_fn(x, y):
            # The coordinator computes each step's learning rate and sends it with the step; a step
            # that runs late on a busy worker may read the next one's, as asynchronous updates do.
            optimizer.learning_rate.assign(lr)
            with tf.GradientTape() as tape:
                loss = task.loss(y, model(x, training=True))
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
            return loss

        x, y = next(iterator)
        return strategy.run(step_fn, args=(x, y))

    steps_per_epoch = schedule.steps_per_epoch
    log = RunLog(run_dir, True, recipe.name, backend.name, backend.size)
    log.scalar_writer = tensorboard_writer(run_dir / "tensorboard")
    throughput, loss_value, tested = Throughput(), float("nan"), {}
    for epoch in range(start_epoch, config.epochs):
        began = time.perf_counter()
        lrs = [
            schedule.lr_of_step(schedule.at(epoch, taken), step + taken, log)
            for taken in range(steps_per_epoch)
        ]
        results = [
            coordinator.schedule(worker_step, args=(iterator, tf.constant(lr, tf.float32))) for lr in lrs
        ]
        coordinator.join()
        rate = throughput.add(schedule.global_samples_per_epoch, time.perf_counter() - began)
        step += steps_per_epoch
        loss_value = float(np.mean([r.fetch() for r in results]))
        tested = {f"test_{name}": None for name in task.metrics}
        if task.evaluate:
            # model.predict would distribute the data to the workers; the coordinator reads the
            # variables from the parameter servers and evaluates by itself.
            outputs = model(data.x_test, training=False).numpy()
            for name, metric in task.metrics.items():
                tested[f"test_{name}"] = metrics.finish(name, metric(outputs, data.y_test) / len(data.y_test))
        # the lr as the workers' steps left it on the ps
        record = {"loss": loss_value, **tested, "lr": float(np.asarray(optimizer.learning_rate))}
        log.epoch(epoch + 1, config.epochs, {**record, "samples_per_sec": rate, "world_size": backend.size})
        if end_epoch(config, checkpointer, watch, backend, log, record, model, epoch, step):
            break
    # One copy of every variable lives on the parameter servers: consistent by construction.
    finals = [rank_final(weights_digest(model))]
    return log.finish(
        throughput,
        finals,
        step,
        tested,
        loss_value,
        config.epochs,
        num_ps=len(cluster["ps"]),
        **watch.summary(),
    )

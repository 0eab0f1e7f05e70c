"""The baseline for `make bench`: a minimal hand-written TF loop with Horovod's DistributedGradientTape
over synthetic-tf's model and steps. Prints one JSON line."""

import argparse
import json
import os
import statistics
import time

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from hvdtrain.recipes.synthetic_tf import Config, build

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--batch-size", type=int, default=32)
args = parser.parse_args()

hvd.init()
tf.config.threading.set_intra_op_parallelism_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
tf.config.threading.set_inter_op_parallelism_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
keras.utils.set_random_seed(42)
task = build(Config())
model, loss_fn = task.model, task.loss
optimizer = keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9)
optimizer.build(model.trainable_variables)
hvd.broadcast_variables(model.variables + list(optimizer.variables), root_rank=0)


@tf.function
def train_step(xb, yb):
    with tf.GradientTape() as tape:
        loss = loss_fn(yb, model(xb, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return loss


x, y = task.data.x_train, task.data.y_train
rates = []
for epoch in range(args.epochs):
    order = np.random.default_rng(epoch).permutation(len(y))
    began = time.perf_counter()
    for step in range(args.steps):
        batch = order[step * args.batch_size : (step + 1) * args.batch_size]
        train_step(x[batch], y[batch])
    rates.append(args.steps * args.batch_size * hvd.size() / (time.perf_counter() - began))
if hvd.rank() == 0:
    print(json.dumps({"samples_per_sec": statistics.median(rates[1:] or rates)}))

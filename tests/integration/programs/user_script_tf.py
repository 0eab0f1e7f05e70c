"""A plain Horovod TF2 + Keras 3 script, written as Horovod's docs show, run unchanged by hvdtrain.

Custom loop with hvd.DistributedGradientTape and hvd.broadcast_variables, then model.fit with
horovod.tensorflow.keras' DistributedOptimizer and callbacks: all fail on Keras 3 without the
project's Horovod patches.
"""

import argparse
import json

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import keras
import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

hvd.init()
keras.utils.set_random_seed(hvd.rank())  # different inits on purpose: the broadcast must fix them
model = keras.Sequential(
    [
        keras.Input((4,)),
        keras.layers.Dense(8, activation="relu"),
        hvd.SyncBatchNormalization(),
        keras.layers.Dense(2),
    ]
)
optimizer = keras.optimizers.SGD(0.05 * hvd.size(), momentum=0.9)
optimizer.build(model.trainable_variables)
rng = np.random.default_rng(hvd.rank())
x = rng.standard_normal((64, 4)).astype("float32")
y = (x[:, 0] > 0).astype("int64")
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@tf.function
def step(xb, yb):
    with tf.GradientTape() as tape:
        loss = loss_fn(yb, model(xb, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return loss


hvd.broadcast_variables(model.variables, root_rank=0)
hvd.broadcast_variables(optimizer.variables, root_rank=0)
for i in range(args.steps):
    step(x[i * 8 : (i + 1) * 8], y[i * 8 : (i + 1) * 8])

model.compile(
    optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss=loss_fn, metrics=["accuracy"]
)
history = model.fit(
    x,
    y,
    batch_size=8,
    epochs=2,
    verbose=0,
    callbacks=[
        hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd_keras.callbacks.MetricAverageCallback(),
        hvd_keras.callbacks.LearningRateWarmupCallback(initial_lr=0.01, warmup_epochs=1, steps_per_epoch=8),
    ],
)
weights = np.concatenate([w.ravel() for w in model.get_weights()])
gathered = hvd.allgather(tf.constant(weights[None, :])).numpy()
print(
    json.dumps(
        {
            "rank": hvd.rank(),
            "steps": args.steps,
            "equal": bool((gathered == gathered[0]).all()),
            "accuracy": [float(a) for a in history.history["accuracy"]],
        }
    )
)

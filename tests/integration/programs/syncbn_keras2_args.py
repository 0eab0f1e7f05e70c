"""hvd.SyncBatchNormalization given Keras 2 arguments (patch 0011): dropped with one warning, refused
where dropping one would change the math. On N ranks each rank's output and the moving statistics
equal Keras' BatchNormalization over the whole batch, as Horovod's test_horovod_syncbn_cpu checks.
Prints one JSON line per rank."""

import json
import warnings

import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf

hvd.init()
rank, size = hvd.rank(), hvd.size()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    layers = [hvd.SyncBatchNormalization(axis=1, fused=False, virtual_batch_size=None) for _ in range(2)]
try:
    hvd.SyncBatchNormalization(axis=1, virtual_batch_size=4)
    refused = None
except ValueError as error:
    refused = str(error)

x = np.stack(
    [np.array([[r, r + 1], [r * 2, r * 2 + 1], [r * 3, r * 3 + 1], [r * 4, r * 4 + 1]]) for r in range(size)]
)
x = tf.convert_to_tensor(x, tf.float32)
reference = tf.keras.layers.BatchNormalization(axis=1)
expected = reference(x, training=True).numpy()[rank]
synced = layers[0](x[rank : rank + 1], training=True).numpy()[0]
moving = [
    (layers[0].moving_mean, reference.moving_mean),
    (layers[0].moving_variance, reference.moving_variance),
]
print(
    json.dumps(
        {
            "rank": rank,
            "size": size,
            "warnings": [str(w.message) for w in caught if "Keras 2 argument" in str(w.message)],
            "refused": refused,
            "output_error": float(np.abs(synced - expected).max()),
            "moving_error": max(float(np.abs(ours.numpy() - keras.numpy()).max()) for ours, keras in moving),
        }
    ),
    flush=True,
)

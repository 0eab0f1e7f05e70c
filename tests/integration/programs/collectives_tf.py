"""Exact Horovod collectives on TensorFlow tensors through Horovod's TF ops."""

import json

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

hvd.init()
rank, size = hvd.rank(), hvd.size()
x = tf.constant(np.arange(6, dtype=np.float64) + 10 * rank)
expected_sum = sum(np.arange(6, dtype=np.float64) + 10 * r for r in range(size))
total = hvd.allreduce(x, op=hvd.Sum, name="sum").numpy()
mean = hvd.allreduce(x, op=hvd.Average, name="avg").numpy()
gathered = hvd.allgather(tf.fill([rank + 1, 2], float(rank)), name="gather").numpy()
broadcast = hvd.broadcast(tf.constant([rank + 100.0]), root_rank=size - 1, name="bcast").numpy()
ints = hvd.allreduce(tf.constant([rank + 1], dtype=tf.int64), op=hvd.Sum, name="ints").numpy()
grouped = [t.numpy() for t in hvd.grouped_allreduce([tf.ones(3) * (rank + 1), tf.ones(2)], op=hvd.Sum)]

assert np.array_equal(total, expected_sum), total
assert np.array_equal(mean, expected_sum / size), mean
assert gathered.shape == (size * (size + 1) // 2, 2), gathered.shape
assert np.array_equal(gathered[:, 0], np.concatenate([np.full(r + 1, float(r)) for r in range(size)]))
assert broadcast[0] == size - 1 + 100.0
assert ints[0] == size * (size + 1) // 2
assert np.array_equal(grouped[0], np.full(3, size * (size + 1) / 2)) and np.array_equal(
    grouped[1], np.full(2, size)
)
print(
    json.dumps(
        {
            "framework": "tensorflow",
            "rank": rank,
            "size": size,
            "sum": total.tolist(),
            "avg": mean.tolist(),
            "gather_rows": int(gathered.shape[0]),
            "bcast": float(broadcast[0]),
        }
    )
)

"""Exact Horovod collectives on TensorFlow tensors through Horovod's TF ops."""

import json
import re
import shutil
import tempfile
from pathlib import Path

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

# A training step's gradient allreduce traces as Horovod wrote it (patch 0023), one tensor at a time and
# grouped (hvdtrain's num_groups=1): autograph converts the step but none of Horovod's functions (each
# conversion leaves its source in a temporary file), and outside elastic mode no tf.cond wraps it.
tempfile.tempdir = tempfile.mkdtemp()
weights = tf.Variable([1.0, 2.0])


def traced_step(num_groups: int):
    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(weights * float(rank + 1))
        return hvd.DistributedGradientTape(tape, num_groups=num_groups).gradient(loss, [weights])[0]

    return step


tape_grads, allreduce_ops, conditionals = [], [], 0
for groups in (0, 1):
    step = traced_step(groups)
    tape_grads.append(step().numpy().tolist())
    graph = step.get_concrete_function().graph.as_graph_def()
    ops = [node.op for node in graph.node] + [n.op for f in graph.library.function for n in f.node_def]
    allreduce_ops.append(sorted({op for op in ops if op.startswith("Horovod")}))
    conditionals += sum(op in ("If", "StatelessIf") for op in ops)
sources = [path.read_text() for path in Path(tempfile.tempdir).glob("*.py")]
converted = sorted(name for source in sources for name in re.findall(r"def (tf__\w+)", source))
shutil.rmtree(tempfile.tempdir, ignore_errors=True)
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
            "tape_grads": tape_grads,
            "allreduce_ops": allreduce_ops,
            "conditionals": conditionals,
            "autograph_converted": converted,
        }
    )
)

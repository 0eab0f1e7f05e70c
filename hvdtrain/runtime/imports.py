"""How a process of a job imports its framework before it trains or serves: with Python's garbage
collector off, and TensorFlow without Keras's extras. A rank (hvdtrain.worker), a parameter
server's process and torchrun's agent import this way."""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator

KERAS_EXTRAS = ("sklearn", "pandas", "matplotlib", "scipy")
"""What Keras imports wherever it is installed (mlflow brings them, the benchmarks matplotlib) and no
recipe trains with: scikit-learn and SciPy for its scikit-learn wrappers, pandas for fit on a
DataFrame (hvdtrain's loops feed arrays and tf.data), matplotlib for its image gallery, and SciPy's
sparse matrices for TensorFlow's own legacy Keras. Together about 2.5 s of every TensorFlow rank's
start."""


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """The imports inside with the garbage collector off: a framework's import makes hundreds of
    thousands of objects and next to no garbage, and the collector walked them over and over (a fifth
    of TensorFlow's and Keras' import CPU, an eighth of torch's, a third of torchrun's). What they
    made lives as long as the process, so it is then frozen out of the collections that follow. A
    collector the caller had off stays off."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
    gc.freeze()


def import_tensorflow_without_extras() -> None:
    """TensorFlow, and Keras with it, without KERAS_EXTRAS: Keras then takes them as missing. A
    recipe's own `import pandas` (or sklearn, matplotlib) afterwards loads it as usual."""
    if "tensorflow" in sys.modules:
        return
    blocked = [name for name in KERAS_EXTRAS if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]  # an import of it fails, quietly
    try:
        import tensorflow  # noqa: F401
    finally:
        for name in blocked:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]

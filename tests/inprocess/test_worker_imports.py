"""What a TensorFlow rank imports before it trains (hvdtrain.worker), in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
from hvdtrain.worker import KERAS_EXTRAS, import_tensorflow_without_extras
import_tensorflow_without_extras()
before = sorted(name for name in KERAS_EXTRAS if name in sys.modules)
import keras, numpy as np
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
model.fit(np.ones((4, 3)), np.ones((4, 1)), verbose=0)  # Keras without pandas fits arrays
import matplotlib, pandas, sklearn  # a recipe's own imports still work
print(json.dumps({"before": before, "tensorflow": "tensorflow" in sys.modules,
                  "after": [m.__name__ for m in (matplotlib, pandas, sklearn)]}))
"""


def test_a_tensorflow_rank_starts_without_kerass_extras_and_a_recipe_may_still_import_them():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"before": [], "tensorflow": True, "after": ["matplotlib", "pandas", "sklearn"]}, found

"""What a TensorFlow rank imports before it trains (hvdtrain.worker), in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
from hvdtrain.worker import import_tensorflow_without_sklearn
import_tensorflow_without_sklearn()
before = sorted(name for name in ("sklearn",) if name in sys.modules)
import sklearn  # a recipe's own import still works
print(json.dumps({"before": before, "tensorflow": "tensorflow" in sys.modules, "after": sklearn.__name__}))
"""


def test_a_tensorflow_rank_starts_without_scikit_learn_and_a_recipe_may_still_import_it():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"before": [], "tensorflow": True, "after": "sklearn"}, found

"""What a rank imports before it trains, in a fresh interpreter: TensorFlow without Keras's extras
(hvdtrain.worker), torch without torch._dynamo until something compiles (ddp's ranks too)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys
from hvdtrain.runtime.imports import KERAS_EXTRAS, import_tensorflow_without_extras
import_tensorflow_without_extras()
before = sorted(name for name in KERAS_EXTRAS if name in sys.modules)
import keras, numpy as np
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
model.fit(np.ones((4, 3)), np.ones((4, 1)), verbose=0)  # Keras without pandas fits arrays
import matplotlib, pandas, scipy.sparse, sklearn  # a recipe's own imports still work
print(json.dumps({"before": before, "tensorflow": "tensorflow" in sys.modules,
                  "after": [m.__name__ for m in (matplotlib, pandas, scipy.sparse, sklearn)]}))
"""


def test_a_tensorflow_rank_starts_without_kerass_extras_and_a_recipe_may_still_import_them():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    after = ["matplotlib", "pandas", "scipy.sparse", "sklearn"]
    assert found == {"before": [], "tensorflow": True, "after": after}, found


TWO_STEPS = """
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for _ in range(2):
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
"""
"""Two eager steps of `model`, momentum in the optimizer's state."""

TORCH_PROBE = (
    """
import json, sys
import torch
DEFER = {defer}
if DEFER:
    import hvdtrain.runtime.torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
"""
    + TWO_STEPS
    + """
stand_in = type(sys.modules.get("torch._dynamo")).__name__
eager = [round(float(p.sum()), 6) for p in model.parameters()]

@torch.compile(backend="eager")
def step(x):
    loss = model(x).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()

losses = [round(float(step(torch.ones(3, 4))), 6) for _ in range(2)]
breaks = dict(torch._dynamo.utils.counters["graph_break"])
print(json.dumps({{"before": stand_in, "real": type(torch._dynamo).__name__,
                   "eager": eager, "losses": losses, "breaks": sorted(breaks.items())}}))
"""
)


def _torch_probe(defer: bool) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", TORCH_PROBE.format(defer=defer)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_torch_rank_trains_without_torch_dynamo_and_compiles_as_torch_does_once_asked():
    deferred, plain = _torch_probe(True), _torch_probe(False)
    assert deferred["before"] == "_Deferred", deferred  # eager steps never imported torch._dynamo
    assert plain["before"] == "module", plain
    assert deferred["real"] == plain["real"] == "module"
    assert deferred["eager"] == plain["eager"] and deferred["losses"] == plain["losses"]
    # The optimizer's graph break and its "not while compiling" guards behave as torch's own.
    assert deferred["breaks"] == plain["breaks"] and deferred["breaks"], deferred["breaks"]


DDP_PROBE = (
    """
import json, sys, tempfile
import torch
import torch.distributed as dist
DEFER = {defer}
if DEFER:
    import hvdtrain.runtime.torch
dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
"""
    + TWO_STEPS
    + """
module = type(sys.modules.get("torch._dynamo")).__name__
mode = torch._dynamo.utils.get_optimize_ddp_mode()
dist.destroy_process_group()
print(json.dumps({{"module": module, "mode": mode, "python_reducer": model._use_python_reducer,
                   "weights": [round(float(p.sum()), 6) for p in model.parameters()]}}))
"""
)


def test_a_ddp_rank_trains_without_torch_dynamo_as_with_it():
    """DistributedDataParallel asks torch._dynamo which reducer to build and init_process_group has it
    empty its caches: the stand-in answers both as torch's own does under its default config."""
    from hvdtrain.runtime.torch.startup import DDP_MODE

    found = {}
    for defer in (True, False):
        done = subprocess.run(
            [sys.executable, "-c", DDP_PROBE.format(defer=defer)], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
        found[defer] = json.loads(done.stdout.strip().splitlines()[-1])
    assert found[True]["module"] == "_Deferred" and found[False]["module"] == "module", found
    assert found[True]["mode"] == found[False]["mode"] == DDP_MODE  # the answer is torch's default
    assert found[True]["python_reducer"] is found[False]["python_reducer"] is False
    assert found[True]["weights"] == found[False]["weights"]


SUBMODULE_FIRST = """
import json, sys, threading
import torch
import hvdtrain.runtime.torch
stand_in = sys.modules["torch._dynamo"]
errors = []

def use(i):  # threads that meet the stand-in while another imports the real module
    try:
        stand_in.graph_break() if i % 2 else stand_in.utils.counters
    except Exception as error:
        errors.append(repr(error))

import torch._dynamo.config as config  # a submodule first, as torch._inductor imports them
threads = [threading.Thread(target=use, args=(i,)) for i in range(6)]
[t.start() for t in threads]
[t.join() for t in threads]
import torch._dynamo.eval_frame as eval_frame
print(json.dumps({"one config": config is eval_frame.config is torch._dynamo.config,
                  "real": type(sys.modules["torch._dynamo"]).__name__, "errors": errors,
                  "all": "disable" in __import__("torch._dynamo", fromlist=["*"]).__all__}))
"""


def test_a_submodule_imported_first_or_from_threads_is_torchs_one_module():
    done = subprocess.run(
        [sys.executable, "-c", SUBMODULE_FIRST], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"one config": True, "real": "module", "errors": [], "all": True}, found


GC_PROBE = """
import gc, json, sys
from hvdtrain.worker import import_framework
collections = []
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
import_framework(sys.argv[1])
print(json.dumps({"collections": collections, "enabled": gc.isenabled(), "frozen": gc.get_freeze_count(),
                  "runtime": "hvdtrain.runtime." + sys.argv[1] in sys.modules}))
"""


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_a_rank_imports_its_framework_without_collecting_and_freezes_what_it_made(framework):
    """The collector walked the import's objects hundreds of times (a fifth of TensorFlow's import):
    none now, and what the import made stays out of training's collections."""
    done = subprocess.run(
        [sys.executable, "-c", GC_PROBE, framework], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["collections"] == [] and found["enabled"] and found["runtime"], found
    assert found["frozen"] > 100_000, found


def test_a_collector_the_caller_had_off_stays_off():
    import gc

    from hvdtrain.runtime.imports import collector_off

    gc.disable()
    try:
        with collector_off():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()  # this process's objects back to the collections

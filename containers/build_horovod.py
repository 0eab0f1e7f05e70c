#!/usr/bin/env python3
"""Build (or reuse) hvdtrain's patched Horovod wheel and install it, from a checkout: `make horovod`,
the images and the device check run this before hvdtrain is installed. The recipe is the package's
own (hvdtrain/building/horovod_wheel.py), which `hvdtrain setup` runs where hvdtrain was installed
from its wheel; both are standard library only."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hvdtrain.building import horovod_wheel  # noqa: E402

if __name__ == "__main__":
    horovod_wheel.exit_with(horovod_wheel.main)

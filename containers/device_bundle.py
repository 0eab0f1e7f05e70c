#!/usr/bin/env python3
"""`make device-bundle`: what an offline GPU machine needs from a package index to build Horovod and run
hvdtrain, fetched here into .device/ to travel with the repository: Horovod's PyPI sdist (for
`build_horovod.py --offline --sdist`) and wheels of hvdtrain's runtime dependencies that the machine's
image lacks. The patches are not copied: they are in the repository. Idempotent: what is there already
is kept. Standard library only, like build_horovod.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # hvdtrain's stdlib-only build modules, from the checkout

from hvdtrain.building import horovod_wheel as build_horovod  # noqa: E402

BUNDLE = ROOT / ".device"
LIMIT_MIB = 48
"""A device call carries at most 64 MiB, the repository included."""
WHEELS = {  # name -> why the GPU machine needs its wheel (its image has hvdtrain's other dependencies)
    "cffi": "Horovod's own runtime requirement (hvdtrain depends on it for that); not in the image",
    "pycparser": "cffi's dependency; pure Python",
    "setuptools": "builds hvdtrain's own wheel offline (pip's isolated build takes it from the bundle): "
    "the image's may predate the string licence field",
}
TARGET = [  # the GPU machine's interpreter: CPython 3.12 on manylinux x86_64
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    "--platform",
    "manylinux_2_28_x86_64",
    "--platform",
    "manylinux_2_17_x86_64",
    "--platform",
    "manylinux2014_x86_64",
]


def pip_download(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", *args], check=True)


def size_of(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def fill(bundle: Path = BUNDLE, download=pip_download) -> int:
    """Fetch what is missing from the bundle; return its size in bytes."""
    horovod = build_horovod.read_versions()["HOROVOD_VERSION"]
    wheels = bundle / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    if not (bundle / f"horovod-{horovod}.tar.gz").is_file():
        download("--no-binary", ":all:", f"horovod=={horovod}", "-d", str(bundle))
    for name in WHEELS:
        if not any(wheels.glob(f"{name}-*.whl")):
            download("--only-binary=:all:", *TARGET, "-d", str(wheels), name)
    size = size_of(bundle)
    if size > LIMIT_MIB * 2**20:
        raise build_horovod.BuildError(
            f"the device bundle {bundle} is {size / 2**20:.1f} MiB, over {LIMIT_MIB} MiB "
            "(a device call carries 64 MiB with the repository)"
        )
    return size


def main() -> int:
    size = fill()
    files = sorted(path.relative_to(ROOT) for path in BUNDLE.rglob("*") if path.is_file())
    print(f"hvdtrain: device bundle {BUNDLE.relative_to(ROOT)}/: {len(files)} files, {size / 2**20:.1f} MiB")
    for path in files:
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    build_horovod.exit_with(main)

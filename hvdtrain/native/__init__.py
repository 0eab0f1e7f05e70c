"""What hvdtrain compiles for itself on first use: the listener library preloaded into mpirun.

Open MPI's out-of-band listener binds every interface whatever `oob_tcp_if_include` says (Open MPI
4.1's ORTE and 5's PRRTE alike). `bindto.c`, preloaded with HVDTRAIN_BIND_INTERFACE=NAME, turns a
wildcard bind into one on NAME's address, and leaves the environment of what it starts as it was.
It is built once per source, with the C compiler that built Horovod, beside the interpreter (so every
host of a run finds it at the same path) or, where that is read-only, in hvdtrain's cache.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hvdtrain.paths import cache_dir

SOURCE = Path(__file__).with_name("bindto.c")
INTERFACE_VARIABLE = "HVDTRAIN_BIND_INTERFACE"


def _beside_interpreter() -> Path:
    return Path(sys.prefix) / "lib" / "hvdtrain"


def _target() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    beside = _beside_interpreter()
    writable = beside if os.access(beside if beside.exists() else beside.parent, os.W_OK) else None
    return (writable or cache_dir() / "native") / f"bindto-{digest}.so"


def bind_library() -> tuple[Path | None, str | None]:
    """(the library, None), built now if missing; or (None, why it cannot be built here)."""
    target = _target()
    if any(c in str(target) for c in ": "):  # LD_PRELOAD splits at both
        return None, f"hvdtrain's bind library cannot be preloaded from {target} (a ':' or space in the path)"
    if target.exists():
        return target, None
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    if not compiler[0] or not shutil.which(compiler[0]):
        return None, "no C compiler (cc) to build hvdtrain's bind library"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            argv = [*compiler, "-shared", "-fPIC", "-O2", "-o", str(built), str(SOURCE), "-ldl"]
            completed = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
            if completed.returncode != 0:
                last = (completed.stderr.strip().splitlines() or [f"exit code {completed.returncode}"])[-1]
                return None, f"{compiler[0]} could not build hvdtrain's bind library: {last}"
            os.replace(built, target)  # atomic: a concurrent build wins or loses whole
        if target.parent == _beside_interpreter():  # this install's own: an earlier source's goes
            for older in target.parent.glob("bindto-*.so"):  # (a running mpirun keeps its mapping)
                if older != target:
                    older.unlink(missing_ok=True)
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"cannot build hvdtrain's bind library in {target.parent}: {error}"
    return target, None


def preload_env(library: str, interface: str) -> dict[str, str]:
    """The variables that keep a launcher's listeners on interface (its children do not inherit them)."""
    return {"LD_PRELOAD": library, INTERFACE_VARIABLE: interface}

"""What the installed Horovod can do, in the terms `horovodrun --check-build` uses, plus versions."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hvdtrain.paths import cache_dir
from hvdtrain.runtime.common import atomic_write_bytes, read_json_object

FIX_COMMAND = "make horovod  (or: python containers/build_horovod.py --python <your python>)"
FRAMEWORKS = {"torch": "PyTorch", "tensorflow": "TensorFlow"}
CONTROLLERS = {"gloo": "Gloo", "mpi": "MPI"}
DEFAULT_REQUIRED = ("torch", "tensorflow", "gloo", "mpi")


@dataclass
class Report:
    versions: dict[str, str | None]
    frameworks: dict[str, bool] = field(default_factory=dict)
    controllers: dict[str, bool] = field(default_factory=dict)
    tensor_operations: dict[str, bool] = field(default_factory=dict)

    def built(self, component: str) -> bool:
        return {**self.frameworks, **self.controllers}.get(component, False)

    def missing(self, required: tuple[str, ...] | list[str]) -> list[str]:
        return [name for name in required if not self.built(name)]

    def to_dict(self) -> dict:
        return asdict(self)


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def mpi_version() -> str | None:
    if shutil.which("mpirun") is None:
        return None
    out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30)
    return out.stdout.splitlines()[0].strip() if out.stdout else None


def collect() -> Report:
    versions = {
        "python": platform.python_version(),
        "hvdtrain": installed_version("hvdtrain"),
        "horovod": installed_version("horovod"),
        "torch": installed_version("torch"),
        "tensorflow": installed_version("tensorflow-cpu") or installed_version("tensorflow"),
        "keras": installed_version("keras"),
        "mpi4py": installed_version("mpi4py"),
        "ray": installed_version("ray"),  # --launcher ray (hvdtrain[ray]); read without importing it
        "mpi": mpi_version(),
    }
    report = Report(versions=versions)
    if versions["horovod"] is None:
        report.frameworks = dict.fromkeys(FRAMEWORKS, False)
        report.controllers = dict.fromkeys(CONTROLLERS, False)
        return report
    # The same probes as `horovodrun --check-build`; each loads an extension in a child process,
    # so a framework that fails to import is reported as missing rather than crashing doctor.
    from horovod.common import util

    with _quiet_stderr():
        _probe(report, util)
    return report


def framework_built(framework: str) -> bool:
    """Whether Horovod's extension for `framework` loads. Probing imports the framework (seconds for
    TensorFlow), so the verdict is kept per identity of the extension and framework files: a run
    probes once per build, and a changed or shadowed framework (another PYTHONPATH) is probed anew."""
    key = _build_identity(framework)
    if key is None:
        return False
    verdicts = read_json_object(BUILD_VERDICTS) or {}
    if verdicts.get(key):
        return True
    from horovod.common.util import extension_available

    with _quiet_stderr():
        built = bool(extension_available(framework))
    if (
        built
    ):  # only a success is kept: a failure may be this environment's (LD_LIBRARY_PATH), not the build's
        with contextlib.suppress(OSError):  # a read-only cache only costs the next run a probe
            BUILD_VERDICTS.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(BUILD_VERDICTS, json.dumps({**verdicts, key: True}, indent=1).encode())
    return built


BUILD_VERDICTS = cache_dir() / "build-verdicts.json"


def _build_identity(framework: str) -> str | None:
    """The files the verdict depends on (path, size, mtime), found without importing anything."""
    horovod, package = importlib.util.find_spec("horovod"), importlib.util.find_spec(framework)
    if horovod is None or package is None or not horovod.origin or not package.origin:
        return None
    extensions = sorted(Path(horovod.origin).parent.glob(f"{framework}/mpi_lib*.so"))
    if not extensions:
        return None
    parts = [sys.executable]
    for path in (*extensions, Path(package.origin)):
        stat = path.stat()
        parts.append(f"{path}:{stat.st_size}:{stat.st_mtime_ns}")
    return "|".join(parts)


@contextlib.contextmanager
def _quiet_stderr():
    """The probes' child processes import TF, which logs a page at start-up; doctor shows its own lines."""
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _probe(report: Report, util) -> None:
    report.frameworks = {name: bool(util.extension_available(name)) for name in FRAMEWORKS}
    report.controllers = {"gloo": bool(util.gloo_built()), "mpi": bool(util.mpi_built())}
    report.tensor_operations = {
        "NCCL": bool(util.nccl_built()),
        "DDL": bool(util.ddl_built()),
        "CCL": bool(util.ccl_built()),
        "MPI": report.controllers["mpi"],
        "Gloo": report.controllers["gloo"],
    }


def render(report: Report, required: tuple[str, ...] | list[str]) -> str:
    def mark(ok: bool) -> str:
        return "[X]" if ok else "[ ]"

    lines = ["versions:"]
    lines += [f"    {name:<11}{value or 'not installed'}" for name, value in report.versions.items()]
    lines.append("Horovod frameworks:")
    lines += [f"    {mark(report.frameworks.get(k, False))} {label}" for k, label in FRAMEWORKS.items()]
    lines.append("Horovod controllers:")
    lines += [f"    {mark(report.controllers.get(k, False))} {label}" for k, label in CONTROLLERS.items()]
    if report.tensor_operations:
        lines.append("Horovod tensor operations:")
        lines += [f"    {mark(ok)} {name}" for name, ok in report.tensor_operations.items()]
    lines.append(verdict(report, required))
    return "\n".join(lines)


def verdict(report: Report, required: tuple[str, ...] | list[str]) -> str:
    missing = report.missing(required)
    if report.versions["horovod"] is None:
        return f"verdict: FAIL: Horovod is not installed; fix: {FIX_COMMAND}"
    if missing:
        names = ", ".join({**FRAMEWORKS, **CONTROLLERS}[m] for m in missing)
        return f"verdict: FAIL: Horovod was built without {names}; fix: {FIX_COMMAND}"
    return "verdict: OK: " + ", ".join({**FRAMEWORKS, **CONTROLLERS}[name] for name in required) + " built"

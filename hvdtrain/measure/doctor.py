"""What the installed Horovod can do, in the terms `horovodrun --check-build` uses, plus versions."""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.metadata
import importlib.util
import json
import platform
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hvdtrain import launchers, registry, strategies
from hvdtrain.paths import cache_dir
from hvdtrain.runtime.common import atomic_write_bytes, read_json_object

FIX_COMMAND = "hvdtrain setup  (in a checkout: make horovod)"
FRAMEWORKS = {"torch": "PyTorch", "tensorflow": "TensorFlow"}
CONTROLLERS = {"gloo": "Gloo", "mpi": "MPI"}
GPU_OPERATIONS = {"nccl": "NCCL"}
PARTS = {**FRAMEWORKS, **CONTROLLERS, **GPU_OPERATIONS}
"""Every part --require can name, with the name it is shown by."""


def default_required(report: Report, has_mpirun: bool) -> list[str]:
    """What this machine can use: the frameworks installed here (all of them where none is; a CUDA
    build, with NCCL, holds torch's ops alone), gloo, and MPI where mpirun is on PATH. An install with
    torch alone needs no TensorFlow ops, and one built `--controllers gloo` on a machine without MPI
    no MPI."""
    frameworks = [name for name in FRAMEWORKS if report.versions.get(name)] or list(FRAMEWORKS)
    if report.built("nccl"):
        frameworks = [name for name in frameworks if name == "torch"] or frameworks
    return [*frameworks, "gloo", *(["mpi"] if has_mpirun else [])]


@dataclass
class Report:
    versions: dict[str, str | None]
    frameworks: dict[str, bool] = field(default_factory=dict)
    controllers: dict[str, bool] = field(default_factory=dict)
    tensor_operations: dict[str, bool] = field(default_factory=dict)
    broken_plugins: dict[str, str] = field(default_factory=dict)
    """Installed plugins (recipes, strategies, launchers) that cannot be used: where -> why."""

    def built(self, component: str) -> bool:
        gpu = {name: self.tensor_operations.get(label, False) for name, label in GPU_OPERATIONS.items()}
        return {**self.frameworks, **self.controllers, **gpu}.get(component, False)

    def missing(self, required: tuple[str, ...] | list[str]) -> list[str]:
        return [name for name in required if not self.built(name)]

    def to_dict(self) -> dict:
        return asdict(self)


def broken_plugins() -> dict[str, str]:
    """Every installed plugin that cannot be used (where -> why): each left out, the rest work."""
    return {
        **registry.catalog().broken_plugins,
        **strategies.broken_plugins(),
        **launchers.broken_plugins(),
    }


def launcher_modules() -> list[str]:
    """The Python modules launchers need (ray), which doctor reports the versions of."""
    return sorted({launcher.module for launcher in launchers.all_launchers().values() if launcher.module})


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


def collect(fresh: bool = False) -> Report:
    """The verdicts are kept per build (see framework_built and build_features), so a second doctor
    takes well under a second; fresh=True probes anew and replaces what was kept."""
    versions = {
        "python": platform.python_version(),
        "hvdtrain": installed_version("hvdtrain"),
        "horovod": installed_version("horovod"),
        "torch": installed_version("torch"),
        "tensorflow": installed_version("tensorflow-cpu") or installed_version("tensorflow"),
        "keras": installed_version("keras"),
        "mpi4py": installed_version("mpi4py"),
        # the modules launchers need (ray, an extra), read without importing them
        **{module: installed_version(module) for module in launcher_modules()},
        "mpi": mpi_version(),
    }
    report = Report(versions=versions, broken_plugins=broken_plugins())
    if versions["horovod"] is None:
        report.frameworks = dict.fromkeys(FRAMEWORKS, False)
        report.controllers = dict.fromkeys(CONTROLLERS, False)
        return report
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # both wait on child processes
        reading = pool.submit(build_features, fresh)
        report.frameworks = frameworks_built(FRAMEWORKS, fresh)
        features = reading.result()
    report.controllers = {name: features.get(name, False) for name in CONTROLLERS}
    report.tensor_operations = {
        "NCCL": features.get("nccl", False),
        "DDL": features.get("ddl", False),
        "CCL": features.get("ccl", False),
        "MPI": report.controllers["mpi"],
        "Gloo": report.controllers["gloo"],
    }
    return report


def framework_built(framework: str, fresh: bool = False) -> bool:
    """Whether Horovod's extension for `framework` loads; see frameworks_built."""
    return frameworks_built([framework], fresh)[framework]


def frameworks_built(frameworks: Iterable[str], fresh: bool = False) -> dict[str, bool]:
    """Whether Horovod's extension for each framework loads (what `horovodrun --check-build` probes).
    Probing imports the framework (seconds for TensorFlow), so the verdict is kept per identity of
    the extension and framework files: a run probes once per build, and a changed or shadowed
    framework (another PYTHONPATH) is probed anew. fresh=True probes even so. The probes run side by
    side, each in a child process, so a framework that fails to import is reported, not fatal."""
    keys = {framework: _build_identity(framework) for framework in frameworks}
    probes = {
        framework: subprocess.Popen(
            [sys.executable, "-P", "-c", f"import horovod.{framework}"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,  # TensorFlow logs a page at start-up; doctor shows its own lines
        )
        for framework, key in keys.items()
        if key is not None and (fresh or not _cached(key))
    }
    built = {framework: keys[framework] is not None for framework in keys}
    for framework, probe in probes.items():
        try:
            built[framework] = probe.wait(timeout=PROBE_TIMEOUT) == 0
        except subprocess.TimeoutExpired:
            probe.kill()
            probe.wait()
            built[framework] = False
        # Only a success is kept: a failure may be this environment's (LD_LIBRARY_PATH), not the build's.
        _keep(keys[framework], True if built[framework] else None)
    return built


PROBE_TIMEOUT = 300
FEATURES = ("gloo", "mpi", "nccl", "ddl", "ccl")
"""Compiled into every extension of one build alike, as horovod_<name>_built() in the library."""
_READ_FEATURES = """
import ctypes, importlib, json, sys
path, framework, names = sys.argv[1], sys.argv[2], sys.argv[3:]
try:  # torch's extension finds its libraries by RUNPATH: no framework import, a fraction of a second
    lib = ctypes.CDLL(path)
    for name in names:
        getattr(lib, f"horovod_{name}_built").restype = ctypes.c_bool  # a C++ bool, not an int
    flags = {name: bool(getattr(lib, f"horovod_{name}_built")()) for name in names}
except OSError:  # TensorFlow's needs the framework loaded first
    extension = importlib.import_module("horovod." + framework)
    flags = {name: bool(getattr(extension, f"{name}_built")()) for name in names}
print(json.dumps(flags))
"""


def build_features(fresh: bool = False) -> dict[str, bool]:
    """gloo, mpi, nccl, ddl, ccl: read once per build from the first extension that loads, in a child
    process (a library that fails to load is a missing part, not a crashed doctor). Horovod's own
    gloo_built() and friends import TensorFlow in a new process for each of the five."""
    extensions = _extensions()
    if not extensions:
        return {}
    key = "features|" + "|".join(_file_identity(path) for _, path in extensions)
    if not fresh and isinstance(kept := _cached(key), dict):
        return kept
    for framework, path in extensions:
        try:
            done = subprocess.run(
                [sys.executable, "-c", _READ_FEATURES, str(path), framework, *FEATURES],
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT,
                stdin=subprocess.DEVNULL,
            )
            features = json.loads(done.stdout.splitlines()[-1]) if done.returncode == 0 else None
        except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError):
            features = None
        if isinstance(features, dict):
            _keep(key, features)
            return features
    _keep(key, None)
    return {}


BUILD_VERDICTS = cache_dir() / "build-verdicts.json"


def _build_identity(framework: str) -> str | None:
    """The files the verdict depends on (path, size, mtime), found without importing anything."""
    package = importlib.util.find_spec(framework)
    extensions = [path for name, path in _extensions() if name == framework]
    if package is None or not package.origin or not extensions:
        return None
    return "|".join([sys.executable, *map(_file_identity, (*extensions, Path(package.origin)))])


def _extensions() -> list[tuple[str, Path]]:
    """(framework, library) of each Horovod extension installed, torch's first (it loads by itself)."""
    horovod = importlib.util.find_spec("horovod")
    if horovod is None or not horovod.origin:
        return []
    root = Path(horovod.origin).parent
    return [
        (name, path)
        for name in ("torch", "tensorflow", "mxnet")
        for path in sorted(root.glob(f"{name}/mpi_lib*.so"))
    ]


def _file_identity(path: Path) -> str:
    stat = path.stat()
    return f"{path}:{stat.st_size}:{stat.st_mtime_ns}"


def _cached(key: str):
    return (read_json_object(BUILD_VERDICTS) or {}).get(key)


def _keep(key: str, value) -> None:
    """Keep (or with None forget) one verdict; a read-only cache only costs the next run a probe."""
    with _KEEPING:  # doctor probes frameworks and features side by side
        verdicts = read_json_object(BUILD_VERDICTS) or {}
        if verdicts.get(key) == value:
            return
        if value is None:
            verdicts.pop(key, None)
        else:
            verdicts[key] = value
        with contextlib.suppress(OSError):
            BUILD_VERDICTS.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(BUILD_VERDICTS, json.dumps(verdicts, indent=1).encode())


_KEEPING = threading.Lock()


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
    if report.broken_plugins:
        lines.append("Plugins left out:")
        lines += [f"    {where} {why}" for where, why in report.broken_plugins.items()]
    lines.append(verdict(report, required))
    return "\n".join(lines)


def verdict(report: Report, required: tuple[str, ...] | list[str]) -> str:
    missing = report.missing(required)
    if report.versions["horovod"] is None:
        return f"verdict: FAIL: Horovod is not installed; fix: {FIX_COMMAND}"
    if missing:
        names = ", ".join(PARTS[m] for m in missing)
        fix = f"HVDTRAIN_DEVICE=cuda {FIX_COMMAND}" if set(missing) & set(GPU_OPERATIONS) else FIX_COMMAND
        return f"verdict: FAIL: Horovod was built without {names}; fix: {fix}"
    return "verdict: OK: " + ", ".join(PARTS[name] for name in required) + " built"

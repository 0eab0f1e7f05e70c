"""What `hvdtrain setup` checks before it builds Horovod where hvdtrain was pip-installed: the
frameworks installed beside it (the build is for those), and the system's build tools, each missing
one named in one line with the apt and dnf lines that install it. Standard library only."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hvdtrain.building.steps import FRAMEWORK_DISTRIBUTIONS, pinned_frameworks


@dataclass(frozen=True)
class Tool:
    what: str
    commands: tuple[str, ...]
    """Any one of these on PATH will do."""
    apt: str
    dnf: str
    controller: str | None = None
    """Needed only for this controller's build (mpi)."""


TOOLS = (
    Tool("C++ compiler", ("c++", "g++"), "g++", "gcc-c++"),
    Tool("make", ("make",), "make", "make"),
    Tool("cmake", ("cmake",), "cmake", "cmake"),
    Tool("patch", ("patch",), "patch", "patch"),
    Tool("Open MPI's compiler wrapper", ("mpicxx", "mpic++"), "openmpi-bin libopenmpi-dev", "openmpi-devel",
         "mpi"),
)  # fmt: skip


def installed_frameworks(version_of: Callable[[str], str] | None = None) -> dict[str, str]:
    """framework -> its installed version, for the frameworks installed in this environment."""
    version_of = version_of or importlib.metadata.version
    found = {}
    for name, distributions in FRAMEWORK_DISTRIBUTIONS.items():
        for distribution in distributions:
            try:
                found[name] = version_of(distribution)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


def version_notes(found: Mapping[str, str], versions: Mapping[str, str]) -> list[str]:
    """One line for each framework whose release differs from the pinned one (versions.env), which
    the patches are tested with: the build may still work, and if it fails the line says why to
    look there first."""
    notes = []
    for name, version in found.items():
        pinned = pinned_frameworks(versions, name)[name]
        if _release(version) != _release(pinned):
            notes.append(
                f"{name} {version} is installed; hvdtrain's Horovod patches are tested with {name} "
                f"{pinned} (hvdtrain/building/versions.env), so the build may fail"
            )
    return notes


def _release(version: str) -> tuple[str, ...]:
    """major.minor: what a framework's C++ API follows (2.13.0+cpu and 2.13.1 build alike)."""
    return tuple(version.split("+")[0].split(".")[:2])


def missing(
    controllers: Iterable[str], which: Callable[[str], str | None], python_include: Path
) -> list[str]:
    """One line for each build tool that is not here, with the line that installs it."""
    controllers = set(controllers)
    lines = []
    for tool in TOOLS:
        if tool.controller is not None and tool.controller not in controllers:
            continue
        if not any(which(command) for command in tool.commands):
            where = f"no {' or '.join(tool.commands)} on PATH"
            lines.append(_line(f"{tool.what} missing ({where})", tool.apt, tool.dnf))
    if not (python_include / "Python.h").is_file():
        where = f"no {python_include}/Python.h"
        lines.append(_line(f"Python headers missing ({where})", "python3-dev", "python3-devel"))
    return lines


def python_tools(find: Callable[[str], object] | None = None) -> list[str]:
    """One line for each Python tool the build runs in this environment that is missing: pip (a uv
    venv has none), setuptools (a Python 3.12 venv has none; Horovod builds without isolation)."""
    find = find or importlib.util.find_spec
    lines = []
    if find("pip") is None:
        lines.append("pip missing in this environment: python -m ensurepip  (or: uv pip install pip)")
    if find("setuptools") is None:
        lines.append("setuptools missing in this environment: python -m pip install setuptools")
    return lines


def _line(what: str, apt: str, dnf: str) -> str:
    return f"{what}: sudo apt-get install -y {apt}  (or: sudo dnf install -y {dnf})"

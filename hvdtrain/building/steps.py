"""What every build step shares: the pins (versions.env), the wheel cache, the commands a build runs
in the target environment, and its errors as one line. Standard library only."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn

VERSIONS_FILE = Path(__file__).resolve().parent / "versions.env"
FRAMEWORK_DISTRIBUTIONS = {"torch": ("torch",), "tensorflow": ("tensorflow-cpu", "tensorflow")}
"""A framework Horovod builds ops for, and the distributions it is installed as."""


def pinned_frameworks(versions: Mapping[str, str], frameworks: str) -> dict[str, str]:
    """framework -> its pinned version (versions.env), for a comma-separated list of frameworks."""
    pins = {"torch": versions["TORCH_VERSION"], "tensorflow": versions["TENSORFLOW_VERSION"]}
    return {name: pins[name] for name in frameworks.split(",") if name}


def wheel_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where verified wheels are kept: HVDTRAIN_WHEEL_CACHE, else $XDG_CACHE_HOME/hvdtrain/wheels, else
    ~/.cache/hvdtrain/wheels. The one definition, so `make install` and `make image` share one cache."""
    environ = os.environ if environ is None else environ
    if environ.get("HVDTRAIN_WHEEL_CACHE"):
        return Path(environ["HVDTRAIN_WHEEL_CACHE"])
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hvdtrain" / "wheels"


class BuildError(RuntimeError):
    """A failure the user must see as one line, with what to do next."""


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    versions = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            versions[key.strip()] = value.strip().strip('"')
    return versions


def ask(python: str, code: str, *args: str) -> str:
    """What a line of code prints in the target interpreter."""
    return subprocess.run(
        [python, "-c", code, *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def installed_version(python: str, *distributions: str) -> str | None:
    """The version of the first of these distributions installed in that interpreter's environment."""
    code = (
        "import importlib.metadata as m, sys\n"
        "for name in sys.argv[1:]:\n"
        "    try: print(m.version(name)); break\n"
        "    except m.PackageNotFoundError: pass"
    )
    return ask(python, code, *distributions) or None


def run(
    cmd: list[str], log: Path | None = None, env: dict[str, str] | None = None, cwd: Path | None = None
) -> None:
    full_env = {**os.environ, **(env or {})}
    if log is None:
        subprocess.run(cmd, check=True, env=full_env, cwd=cwd)
        return
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=cwd)
    if result.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise BuildError(f"{tail}\n\nhorovod build step failed: {' '.join(cmd[:4])} ... (full log: {log})")


def exit_with(main: Callable[[], int]) -> NoReturn:
    """Run a script's main: a build error or a failed command ends it in one line and exit code 1."""
    try:
        sys.exit(main())
    except BuildError as error:
        print(f"hvdtrain: {error}", file=sys.stderr)
        sys.exit(1)
    except subprocess.CalledProcessError as error:
        print(
            f"hvdtrain: command failed ({error.returncode}): {' '.join(map(str, error.cmd))}", file=sys.stderr
        )
        sys.exit(1)

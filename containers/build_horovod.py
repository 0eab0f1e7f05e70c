#!/usr/bin/env python3
"""Build (or reuse) hvdtrain's patched Horovod wheel and install it into one Python environment.

Horovod 0.28.1 is the last release and does not build against current torch and TensorFlow as
released; the patches in containers/horovod/patches/ make it build. A build takes minutes, so the
verified wheel is cached outside the repo, keyed by everything that changes its bytes: Horovod,
Python, torch and TF versions, the patches and the build flags. `make install` and the container
images both run this script, so there is one build recipe. Standard library only: it runs before
anything else is installed.

Offline (--offline, with --sdist from `make device-bundle`) it installs nothing from a package index:
torch must already be a CUDA build, and the toolkit is the one at hand (HOROVOD_CUDA_HOME, PyPI's in
the environment, or the `nvcc` on PATH).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn

import cuda_toolkit

HERE = Path(__file__).resolve().parent
PATCH_DIR = HERE / "horovod" / "patches"
BUILD_SETTING_PREFIXES = (
    "HOROVOD_GPU",
    "HOROVOD_CPU_OPERATIONS",
    "HOROVOD_CUDA",
    "HOROVOD_NCCL",
    "HOROVOD_ROCM",
    "HOROVOD_BUILD_ARCH_FLAGS",
    "HOROVOD_DEBUG",
    "HOROVOD_WITH",
)
VERSIONS_FILE = HERE / "versions.env"
FRAMEWORK_DISTRIBUTIONS = {"torch": ("torch",), "tensorflow": ("tensorflow-cpu", "tensorflow")}
DEVICE_FRAMEWORKS = {"cpu": "torch,tensorflow", "cuda": "torch"}
"""What each device's build holds by default: Horovod's TensorFlow ops with CUDA need a CUDA build of
TensorFlow, and TensorFlow's own CUDA packages are CUDA 12 where torch's are CUDA 13."""
CONTROLLERS = ("gloo", "mpi")
"""What Horovod can be built to coordinate with; all by default. gloo alone builds where no MPI is."""


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


def build_env(
    frameworks: list[str], local_version: str, controllers: tuple[str, ...] | list[str] = CONTROLLERS
) -> dict[str, str]:
    """The environment Horovod's setup.py reads; anything here goes into the cache key."""
    env = {
        ("HOROVOD_WITH_" if name in controllers else "HOROVOD_WITHOUT_") + name.upper(): "1"
        for name in CONTROLLERS
    }
    env |= {
        "HOROVOD_WITHOUT_MXNET": "1",
        "HOROVOD_LOCAL_VERSION": local_version,
        # pip's cmake 4.x rejects gloo's cmake_minimum_required(2.8.12); Horovod's own CI sets this.
        "CMAKE_POLICY_VERSION_MINIMUM": "3.5",
    }
    for name in FRAMEWORK_DISTRIBUTIONS:
        flag = "HOROVOD_WITH_" if name in frameworks else "HOROVOD_WITHOUT_"
        env[flag + ("PYTORCH" if name == "torch" else "TENSORFLOW")] = "1"
    return env


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


def python_tag(python: str) -> str:
    """The interpreter the extensions are compiled against: its exact version and the libc it runs on,
    so a wheel built here is never reused by another system's cp311 (e.g. the image's Debian Python)."""
    code = (
        "import platform, sys; v = sys.version_info; "
        "print(f'cp{v[0]}{v[1]}', platform.python_version(), *platform.libc_ver())"
    )
    return ask(python, code)


def user_build_settings(environ: dict[str, str]) -> dict[str, str]:
    """HOROVOD_* build settings the user set (e.g. HOROVOD_GPU_OPERATIONS=NCCL): they change the wheel."""
    return {key: value for key, value in sorted(environ.items()) if key.startswith(BUILD_SETTING_PREFIXES)}


def parse_controllers(text: str) -> list[str]:
    controllers = [name for name in text.split(",") if name]
    unknown = sorted(set(controllers) - set(CONTROLLERS))
    if unknown or not controllers:
        raise BuildError(f"--controllers {text!r}: choose one or more of {','.join(CONTROLLERS)}")
    return [name for name in CONTROLLERS if name in controllers]


def key_settings(environ: dict[str, str], controllers: list[str]) -> dict[str, str]:
    """What of the build's settings goes into the cache key besides versions and patches. The
    controllers only where they are not all of them, so the wheels cached before --controllers keep
    their keys."""
    settings = user_build_settings(environ)
    if tuple(controllers) != CONTROLLERS:
        settings["controllers"] = ",".join(controllers)
    return settings


def cache_key(
    horovod: str,
    py_tag: str,
    framework_versions: dict[str, str],
    patches: list[Path],
    settings: dict[str, str] | None = None,
) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps([horovod, py_tag, sorted(framework_versions.items())]).encode())
    if settings:
        digest.update(json.dumps(sorted(settings.items())).encode())
    for patch in patches:
        digest.update(patch.name.encode())
        digest.update(patch.read_bytes())
    return digest.hexdigest()[:16]


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


def build_wheel(
    python: str,
    horovod: str,
    env: dict[str, str],
    patches: list[Path],
    workdir: Path,
    sdist: Path | None = None,
    offline: bool = False,
) -> Path:
    """Horovod's wheel from its sdist: PyPI's, or the local one given (which the caller checked)."""
    log = workdir / "build.log"
    print(
        f"hvdtrain: building horovod=={horovod} from {sdist or 'the PyPI sdist'} with {len(patches)} "
        f"patches (several minutes; log: {log})",
        flush=True,
    )
    if sdist is None:
        run(
            [
                python,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"horovod=={horovod}",
                "-d",
                str(workdir),
            ],
            log,
        )
        sdist = next(workdir.glob(f"horovod-{horovod}.tar.gz"))
    with tarfile.open(sdist) as archive:
        # The "data" filter refuses links and paths out of workdir (Python >= 3.11.4, not Debian 12).
        archive.extractall(workdir, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    source = workdir / f"horovod-{horovod}"
    for patch in patches:
        run(["patch", "-p1", "--forward", "--batch", "-i", str(patch)], log, cwd=source)
    jobs = str(os.cpu_count() or 2)
    run(
        [
            python,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            *(["--no-index"] if offline else []),
            "-w",
            str(workdir / "dist"),
            str(source),
        ],
        log,
        env={**env, "MAKEFLAGS": f"-j{jobs}"},
    )
    return next((workdir / "dist").glob("horovod-*.whl"))


def install_and_verify(python: str, wheel: Path, required: list[str], offline: bool = False) -> None:
    wheel_version = wheel.name.split("-")[1]
    if installed_version(python, "horovod") != wheel_version:
        no_index = ["--no-index"] if offline else []
        run(
            [
                python,
                "-m",
                "pip",
                "install",
                "--no-deps",
                *no_index,
                "--force-reinstall",
                "--quiet",
                str(wheel),
            ]
        )
    # doctor is the one place that knows what a complete build looks like; it fails loudly on a
    # missing framework or controller instead of Horovod's silent "extension has not been built".
    # --fresh probes this install (in child processes) and keeps the verdicts, so no `hvdtrain run`
    # start probes again.
    run([python, "-m", "hvdtrain", "doctor", "--fresh", "--require", ",".join(required)])


def device_of(choice: str) -> str:
    """cpu or cuda; auto is cuda where nvidia-smi lists a GPU."""
    if choice != "auto":
        return choice
    if shutil.which("nvidia-smi") is None:
        return "cpu"
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return "cuda" if listed.returncode == 0 and "GPU " in listed.stdout else "cpu"


def torch_requires(python: str) -> list[str]:
    return ask(
        python, "import importlib.metadata as m; print('\\n'.join(m.requires('torch') or []))"
    ).splitlines()


def nvcc_version(home: Path) -> str:
    """The last line of `nvcc --version` (e.g. "Build cuda_13.0.r13.0/compiler.36424714_0"), or
    "unknown" where that nvcc does not run."""
    try:
        out = subprocess.run([str(home / "bin" / "nvcc"), "--version"], capture_output=True, text=True)
    except OSError:
        return "unknown"
    lines = out.stdout.strip().splitlines()
    return lines[-1].strip() if out.returncode == 0 and lines else "unknown"


def offline_cuda_home(site: Path, environ: Mapping[str, str]) -> tuple[Path, str]:
    """The toolkit an offline build compiles with, and what kind it is: $HOROVOD_CUDA_HOME, else PyPI's
    toolkit in the environment (nvcc and cuda_runtime.h under nvidia/cuNN), else the toolkit of the
    `nvcc` on PATH."""
    if environ.get("HOROVOD_CUDA_HOME"):
        return Path(environ["HOROVOD_CUDA_HOME"]), "HOROVOD_CUDA_HOME"
    home = cuda_toolkit.cuda_home(site)
    if home is not None:
        return home, "pypi"
    nvcc = shutil.which("nvcc", path=environ.get("PATH", os.defpath))
    if nvcc is None:
        raise BuildError(
            f"offline: no CUDA toolkit: no nvcc with cuda_runtime.h under {site}/nvidia, no nvcc on "
            "PATH and no HOROVOD_CUDA_HOME"
        )
    home = Path(nvcc).resolve().parent.parent
    if not (home / "include" / "cuda_runtime.h").exists():
        raise BuildError(
            f"offline: the nvcc on PATH ({nvcc}) has no {home}/include/cuda_runtime.h; "
            "set HOROVOD_CUDA_HOME to a CUDA toolkit"
        )
    return home, "nvcc on PATH"


def nccl_root(site: Path, environ: Mapping[str, str]) -> Path:
    """The NCCL that torch loads (PyPI's, under nvidia/nccl), checked to hold the header Horovod compiles
    against; some releases of the pip package ship the library only. A NCCL the user named with
    HOROVOD_NCCL_* is theirs to vouch for."""
    root = site / "nvidia" / "nccl"
    if any(name.startswith("HOROVOD_NCCL_") for name in environ):
        return root
    if not (root / "include" / "nccl.h").exists():
        found = "has its library but no include/nccl.h" if (root / "lib").is_dir() else "is missing"
        raise BuildError(
            f"NCCL at {root} {found}; set HOROVOD_NCCL_HOME to a NCCL with include/nccl.h and lib/"
        )
    return root


def prepare_cuda(
    python: str, torch_version: str, offline: bool = False
) -> tuple[dict[str, str], dict[str, str]]:
    """Make the target environment's torch a CUDA build and install the toolkit that torch was built
    with, from PyPI; return the build's environment and what of it goes into the cache key. Offline,
    install nothing: torch must be a CUDA build already and the toolkit is the one at hand."""
    plan = cuda_toolkit.cuda_torch(torch_requires(python))
    if plan is None and offline:
        raise BuildError(f"offline: torch in {python} is not a CUDA build, and none can be installed")
    if plan is None:
        # `===` matches PyPI's own build only, never a local +cpu build of the same release.
        print(f"hvdtrain: installing the CUDA build of torch {torch_version} from PyPI", flush=True)
        run([python, "-m", "pip", "install", "--quiet", "--no-compile", f"torch==={torch_version}"])
        plan = cuda_toolkit.cuda_torch(torch_requires(python))
        if plan is None:
            raise BuildError(f"torch {torch_version} as pip installs it here is not a CUDA build")
    site = Path(ask(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])"))
    settings = {}
    if offline:
        home, kind = offline_cuda_home(site, os.environ)
        # An offline toolkit is not the one torch pins: the key says which it was, so an offline
        # wheel and an online one never stand in for each other.
        settings["cuda-home"] = f"{kind}: {nvcc_version(home)}"
        print(
            f"hvdtrain: CUDA {plan.major} toolkit for the build: {home} ({settings['cuda-home']})", flush=True
        )
    else:
        print(f"hvdtrain: CUDA {plan.major} toolkit for the build: {' '.join(plan.toolkit)}", flush=True)
        run([python, "-m", "pip", "install", "--quiet", "--no-compile", *plan.toolkit])
        home = (
            Path(os.environ["HOROVOD_CUDA_HOME"])
            if "HOROVOD_CUDA_HOME" in os.environ
            else cuda_toolkit.cuda_home(site)
        )
        if home is None:
            raise BuildError(
                f"no CUDA {plan.major} toolkit with nvcc and cuda_runtime.h under {site}/nvidia; "
                "set HOROVOD_CUDA_HOME to a CUDA toolkit"
            )
    nccl = nccl_root(site, os.environ)
    nccl_version = installed_version(python, plan.nccl) or "system"
    return cuda_toolkit.build_env(home, nccl, os.environ), plan.key(nccl_version) | settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="interpreter of the target environment")
    parser.add_argument("--cache-dir", type=Path, default=wheel_cache_dir())
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default=os.environ.get("HVDTRAIN_DEVICE") or "auto",
        help="cuda: NCCL against a CUDA build of torch; auto: cuda where nvidia-smi lists a GPU "
        "(default: $HVDTRAIN_DEVICE, else auto)",
    )
    parser.add_argument("--frameworks", help="comma-separated: torch, tensorflow (default: by device)")
    parser.add_argument(
        "--controllers",
        default=",".join(CONTROLLERS),
        help="comma-separated: gloo, mpi (default: both); gloo alone builds without MPI",
    )
    parser.add_argument(
        "--sdist", type=Path, help="a local horovod-<version>.tar.gz to build from instead of PyPI's"
    )
    parser.add_argument(
        "--offline",
        action="store_true",
        help="install nothing from a package index (needs --sdist unless the wheel is cached); "
        "with cuda, torch must be a CUDA build already",
    )
    parser.add_argument("--print-key", action="store_true", help="print the cache key and exit")
    args = parser.parse_args(argv)

    if args.sdist is not None and not args.sdist.is_file():
        raise BuildError(f"--sdist {args.sdist}: no such file")
    versions = read_versions()
    expected = f"horovod-{versions['HOROVOD_VERSION']}.tar.gz"
    if args.sdist is not None and args.sdist.name != expected:
        raise BuildError(f"--sdist {args.sdist}: expected {expected} (containers/versions.env)")
    controllers = parse_controllers(args.controllers)
    device = device_of(args.device)
    frameworks = [name for name in (args.frameworks or DEVICE_FRAMEWORKS[device]).split(",") if name]
    unknown = sorted(set(frameworks) - set(FRAMEWORK_DISTRIBUTIONS))
    if unknown:
        raise BuildError(f"unknown framework(s) {unknown}; choose from {sorted(FRAMEWORK_DISTRIBUTIONS)}")
    settings = key_settings(dict(os.environ), controllers)
    cuda_env, required = {}, [*frameworks, *controllers]
    if device == "cuda":
        cuda_env, cuda_settings = prepare_cuda(args.python, versions["TORCH_VERSION"], args.offline)
        settings |= cuda_settings
        required.append("nccl")
    framework_versions = {}
    for name in frameworks:
        version = installed_version(args.python, *FRAMEWORK_DISTRIBUTIONS[name])
        if version is None:
            raise BuildError(
                f"{FRAMEWORK_DISTRIBUTIONS[name][0]} is not installed in {args.python}; "
                "install the framework first (make install does)"
            )
        framework_versions[name] = version
    patches = sorted(PATCH_DIR.glob("*.patch"))
    key = cache_key(
        versions["HOROVOD_VERSION"], python_tag(args.python), framework_versions, patches, settings
    )
    if args.print_key:
        print(key)
        return 0

    cached = args.cache_dir / key
    wheels = sorted(cached.glob("horovod-*.whl"))
    if wheels:
        print(f"hvdtrain: reusing cached Horovod wheel {wheels[0]}", flush=True)
        install_and_verify(args.python, wheels[0], required, args.offline)
        return 0

    if args.offline and args.sdist is None:
        raise BuildError(f"offline: no cached wheel under {cached} and no --sdist to build from")
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    env = build_env(frameworks, f"hvdtrain.{key[:8]}", controllers) | cuda_env
    with tempfile.TemporaryDirectory(prefix="hvdtrain-horovod-", dir=args.cache_dir) as tmp:
        workdir = Path(tmp)
        try:
            wheel = build_wheel(
                args.python, versions["HOROVOD_VERSION"], env, patches, workdir, args.sdist, args.offline
            )
        except BuildError:
            kept = args.cache_dir / f"failed-build-{key}.log"
            shutil.copy(workdir / "build.log", kept)
            raise
        install_and_verify(args.python, wheel, required, args.offline)
        print(f"hvdtrain: built and verified {wheel.name}", flush=True)
        staged = workdir / "verified"
        staged.mkdir()
        shutil.move(str(wheel), staged / wheel.name)
        shutil.copy(workdir / "build.log", staged / "build.log")
        (staged / "build.json").write_text(
            json.dumps(
                {
                    "key": key,
                    "horovod": versions["HOROVOD_VERSION"],
                    "frameworks": framework_versions,
                    "patches": [p.name for p in patches],
                    "env": env,
                },
                indent=2,
            )
        )
        if cached.exists():  # a concurrent build won the race; both wheels are equivalent
            return 0
        staged.rename(cached)
    print(f"hvdtrain: cached the verified Horovod wheel under {cached}", flush=True)
    return 0


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


if __name__ == "__main__":
    exit_with(main)

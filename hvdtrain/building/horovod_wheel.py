"""Build (or reuse) hvdtrain's patched Horovod wheel and install it into one Python environment.

Horovod 0.28.1 is the last release and does not build against current torch and TensorFlow as
released; the patches in patches/ beside this file make it build. A build takes minutes, so the
verified wheel is cached outside the repo, keyed by everything that changes its bytes: Horovod,
Python, torch and TF versions, the patches and the build flags. `hvdtrain setup` (an installed
wheel), `make install`, the container images and the device check (containers/build_horovod.py,
from a checkout) all run this module, so there is one build recipe. Standard library only, and
hvdtrain's package __init__ too: it runs before anything else is installed.

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
import sys
import tarfile
import tempfile
from pathlib import Path

from hvdtrain.building.cuda_build import (  # noqa: F401 (the build's steps, by one name)
    device_of,
    nccl_root,
    nvcc_version,
    offline_cuda_home,
    prepare_cuda,
)
from hvdtrain.building.steps import (  # noqa: F401
    FRAMEWORK_DISTRIBUTIONS,
    VERSIONS_FILE,
    BuildError,
    ask,
    exit_with,
    installed_version,
    pinned_frameworks,
    read_versions,
    run,
    wheel_cache_dir,
)

HERE = Path(__file__).resolve().parent
PATCH_DIR = HERE / "patches"
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
DEVICE_FRAMEWORKS = {"cpu": "torch,tensorflow", "cuda": "torch"}
"""What each device's build holds by default: Horovod's TensorFlow ops with CUDA need a CUDA build of
TensorFlow, and TensorFlow's own CUDA packages are CUDA 12 where torch's are CUDA 13."""
CONTROLLERS = ("gloo", "mpi")
"""What Horovod can be built to coordinate with; all by default. gloo alone builds where no MPI is."""


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


def default_device() -> str:
    return os.environ.get("HVDTRAIN_DEVICE") or "auto"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="interpreter of the target environment")
    parser.add_argument("--cache-dir", type=Path, default=wheel_cache_dir())
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default=default_device(),
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
        raise BuildError(f"--sdist {args.sdist}: expected {expected} (hvdtrain/building/versions.env)")
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
    tag = python_tag(args.python)
    key = cache_key(versions["HOROVOD_VERSION"], tag, framework_versions, patches, settings)
    if args.print_key:
        print(key)
        return 0

    cached = args.cache_dir / key
    # a wheel built for more frameworks serves fewer (the others' ops are never loaded): the device's
    # whole build at the pins, which `make install` caches, spares a torch-only install its build
    wider = {**pinned_frameworks(versions, DEVICE_FRAMEWORKS[device]), **framework_versions}
    found = [cached]
    if wider != framework_versions:
        found.append(args.cache_dir / cache_key(versions["HOROVOD_VERSION"], tag, wider, patches, settings))
    wheels = [wheel for folder in found for wheel in sorted(folder.glob("horovod-*.whl"))]
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


if __name__ == "__main__":
    exit_with(main)

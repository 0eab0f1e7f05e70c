#!/usr/bin/env python3
"""`make image` and `make image-test`: build and test containers/Dockerfile.cpu with the engine this
machine has: docker where its daemon answers, else buildah (`--isolation chroot`, which builds and
runs images where containers cannot be started, as on the project's machines; installed with apt
when missing and root).

Where no image registry is reachable, the base image is made locally: `debootstrap` of Debian
bookworm, added to an empty buildah container and committed as localhost/hvdtrain-base:bookworm.
The Horovod wheel cache is mounted into the build, so an image build reuses `make install`'s wheel
when the Python, framework versions and patches agree (the key says so). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BASE = "docker.io/library/debian:bookworm-slim"
LOCAL_BASE = "localhost/hvdtrain-base:bookworm"
DEFAULT_TAG = "localhost/hvdtrain:cpu"
# hvdtrain is not installed in the python `make image` runs with: import it (stdlib-only modules) from
# the checkout.
sys.path[:0] = [str(ROOT)]

from hvdtrain.building.horovod_wheel import read_versions, wheel_cache_dir  # noqa: E402
from hvdtrain.launching.container import detect_engine, run_argv  # noqa: E402


def sh(*argv: str, check: bool = True, timeout: float | None = None, **kwargs) -> subprocess.CompletedProcess:
    print("+ " + " ".join(argv), flush=True)
    return subprocess.run(argv, check=check, timeout=timeout, **kwargs)


def engine() -> str:
    """hvdtrain's own choice, kept to the two engines this script builds with; buildah is installed
    where neither works."""
    try:
        return detect_engine(fallbacks=("buildah",))
    except ValueError:
        ensure_debian_packages("buildah")
        return "buildah"


def ensure_debian_packages(*packages: str) -> None:
    missing = [p for p in packages if shutil.which(p) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        sys.exit(f"hvdtrain: missing {', '.join(missing)}; run: sudo apt-get install -y {' '.join(missing)}")
    sh("apt-get", "update", "-qq")
    sh(
        "apt-get",
        "install",
        "-y",
        "-qq",
        "--no-install-recommends",
        *missing,
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
    )


def image_exists(tool: str, image: str) -> bool:
    probe = (
        [tool, "image", "inspect", image]
        if tool == "docker"
        else ["buildah", "inspect", "--type", "image", image]
    )
    return subprocess.run(probe, capture_output=True).returncode == 0


def debian_mirror() -> str:
    for source in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        if not source.is_file():
            continue
        for line in source.read_text().splitlines():
            words = line.split()
            if words[:1] == ["deb"] and "bookworm" in words:
                return next(w for w in words[1:] if w.startswith("http"))
            if line.startswith("URIs:") and "debian-security" not in line:
                return line.split()[1]
    return "http://deb.debian.org/debian"


def base_image(tool: str) -> str:
    """The public base where it can be pulled, else a local one made with debootstrap."""
    if os.environ.get("BASE_IMAGE"):
        return os.environ["BASE_IMAGE"]
    for candidate in (DEFAULT_BASE, LOCAL_BASE):
        if image_exists(tool, candidate):
            return candidate
    pull = [tool, "pull", DEFAULT_BASE]
    try:
        if sh(*pull, check=False, timeout=60, capture_output=True).returncode == 0:
            return DEFAULT_BASE
    except subprocess.TimeoutExpired:
        pass
    if tool != "buildah":
        sys.exit(f"hvdtrain: cannot pull {DEFAULT_BASE}; set BASE_IMAGE to a Debian bookworm image you have")
    print(f"hvdtrain: {DEFAULT_BASE} cannot be pulled here; making {LOCAL_BASE} with debootstrap", flush=True)
    ensure_debian_packages("debootstrap")
    with tempfile.TemporaryDirectory(prefix="hvdtrain-base-") as tmp:
        rootfs, tarball = Path(tmp) / "rootfs", Path(tmp) / "rootfs.tar"
        sh("debootstrap", "--variant=minbase", "bookworm", str(rootfs), debian_mirror())
        sh("tar", "-C", str(rootfs), "-cf", str(tarball), ".")
        container = sh("buildah", "from", "scratch", capture_output=True, text=True).stdout.strip()
        try:
            sh("buildah", "add", container, str(tarball), "/")
            sh("buildah", "config", "--cmd", "/bin/bash", "--env", "LANG=C.UTF-8", container)
            sh("buildah", "commit", "--rm", container, LOCAL_BASE)
        except subprocess.CalledProcessError:
            sh("buildah", "rm", container, check=False)
            raise
    return LOCAL_BASE


def stage_local_wheels() -> None:
    """pip's find-links wheels for the pinned torch (a CPU build lies on the project's machines,
    where the PyTorch CPU index is out of reach) go into the build context."""
    target = ROOT / "containers" / "wheels"
    target.mkdir(exist_ok=True)
    version = read_versions()["TORCH_VERSION"]
    for links in filter(None, os.environ.get("PIP_FIND_LINKS", "/opt/wheels").split()):
        for wheel in Path(links).glob(f"torch-{version}*cp311*.whl"):
            if not (target / wheel.name).exists():
                shutil.copy(wheel, target / wheel.name)


def host_pip_cert() -> str | None:
    """The CA bundle this machine's pip is told to trust (PIP_CERT or pip's config), if any."""
    if os.environ.get("PIP_CERT"):
        return os.environ["PIP_CERT"]
    found = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.cert"], capture_output=True, text=True
    )
    path = found.stdout.strip()
    return path if found.returncode == 0 and path and Path(path).is_file() else None


def build(tag: str) -> None:
    tool = engine()
    versions = read_versions()
    base = base_image(tool)
    stage_local_wheels()
    args = ["--build-arg", f"BASE_IMAGE={base}"]
    for name in ("HOROVOD_VERSION", "TORCH_VERSION", "TENSORFLOW_VERSION"):
        args += ["--build-arg", f"{name}={versions[name]}"]
    started = time.monotonic()
    if tool == "buildah":
        wheel_cache = wheel_cache_dir()
        wheel_cache.mkdir(parents=True, exist_ok=True)
        mounts = ["-v", f"{wheel_cache}:/hvdtrain-wheels"]
        host_ca = host_pip_cert()
        if host_ca:  # pip inside the build trusts what pip here trusts (a TLS-intercepting proxy's CA)
            mounts += ["-v", f"{host_ca}:/run/hvdtrain-host-ca.pem:ro"]
            args += ["--build-arg", "PIP_CERT=/run/hvdtrain-host-ca.pem"]
        sh(
            "buildah",
            "bud",
            "--isolation",
            "chroot",
            "--layers",
            "--network",
            "host",
            "-f",
            "containers/Dockerfile.cpu",
            "-t",
            tag,
            *args,
            "--build-arg",
            "HVDTRAIN_WHEEL_CACHE=/hvdtrain-wheels",
            *mounts,
            ".",
            cwd=ROOT,
        )
        size = subprocess.run(
            ["buildah", "images", "--format", "{{.Size}}", tag], capture_output=True, text=True
        ).stdout.strip()
    else:
        sh(tool, "build", "-f", "containers/Dockerfile.cpu", "-t", tag, *args, ".", cwd=ROOT)
        size = subprocess.run(
            [tool, "image", "inspect", "--format", "{{.Size}}", tag], capture_output=True, text=True
        ).stdout.strip()
    print(
        f"hvdtrain: built {tag} with {tool} in {time.monotonic() - started:.0f}s (base {base}, size {size})"
    )


def run_in_image(tool: str, tag: str, *argv: str, mounts: tuple[str, ...] = ()) -> None:
    """The same run argv as `hvdtrain run --image`; buildah's runner runs as root, docker and podman
    as the image's user."""
    user = "0:0" if tool == "buildah" else None
    sh(
        *run_argv(tool, tag, argv, mounts, str(ROOT), user),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test(tag: str) -> None:
    """Inside the image: doctor, the gloo integration tests, and digits-mlp-torch on 2 ranks."""
    tool = engine()
    run_dir = Path(tempfile.mkdtemp(prefix="hvdtrain-image-test-"))
    mounts = (str(ROOT), str(run_dir))
    run_in_image(tool, tag, "hvdtrain", "doctor", mounts=mounts)
    run_in_image(
        tool,
        tag,
        "python",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/integration/test_build.py",
        "-k",
        "gloo or doctor_reports",
        mounts=mounts,
    )
    run_in_image(
        tool,
        tag,
        "hvdtrain",
        "run",
        "digits-mlp-torch",
        "--np",
        "2",
        "--run-dir",
        str(run_dir / "digits"),
        mounts=mounts,
    )
    summary = json.loads((run_dir / "digits" / "summary.json").read_text())
    if summary["test_accuracy"] < 0.95 or not summary["weights_consistent"]:
        sys.exit(f"hvdtrain: image test failed: {summary}")
    print(f"hvdtrain: image test passed: test_accuracy {summary['test_accuracy']:.4f}, weights consistent")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["build", "test"])
    parser.add_argument("--tag", default=os.environ.get("IMAGE", DEFAULT_TAG))
    args = parser.parse_args()
    (build if args.action == "build" else test)(args.tag)


if __name__ == "__main__":
    main()

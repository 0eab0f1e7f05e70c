"""`hvdtrain run --image IMAGE`: the same launch command, run inside a container image.

`run_argv` is pure and is the one `docker run`/`podman run` argv, used by `hvdtrain run --image` (via
`in_image`) and by `make image-test` (containers/image.py): host network and IPC, the given paths
mounted at the same paths. Where containers cannot be started but buildah can run commands in an
image (`buildah run --isolation chroot`, as on the project's CI machines), it is this module's own
small runner, which makes a working container, runs the command in it and removes it.
`detect_engine` is the one choice of engine for both. Standard library only at import time:
containers/image.py imports it under a plain system python.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence

from hvdtrain.launching.spec import LaunchCommand

ENGINES = ("docker", "podman", "buildah")

# The OCI distribution reference grammar (github.com/distribution/reference), which docker, podman and
# buildah parse an image by: [HOST[:PORT]/]COMPONENT[/COMPONENT...][:TAG][@DIGEST].
NAME_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|[-]*)[a-z0-9]+)*")
DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
REGISTRY = re.compile(rf"(?:{DOMAIN_COMPONENT}(?:\.{DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?")
TAG = re.compile(r"[\w][\w.-]{0,127}", re.ASCII)
DIGEST_HEX_DIGITS = {"sha256": 64, "sha384": 96, "sha512": 128}
NAME_MAX = 255
"""The longest name (registry and components, without tag or digest) a registry accepts."""
IMAGE_EXAMPLE = "registry/hvdtrain:cpu"


def image_problem(reference: str) -> str | None:
    """What makes `reference` no image reference, naming the bad part; None where it is one. Checked
    before the engine gets it, which would fail only once the job starts."""
    if not reference.strip():
        return "it is blank"
    rest, at, digest = reference.partition("@")
    algorithm, _, hex_digits = digest.partition(":")
    if at and not (
        len(hex_digits) == DIGEST_HEX_DIGITS.get(algorithm) and re.fullmatch(r"[0-9a-f]+", hex_digits)
    ):
        return f"digest {digest!r} is not sha256:<64 hex digits>"
    name, colon, tag = rest.rpartition(":") if ":" in rest.rpartition("/")[2] else (rest, "", "")
    if colon and not TAG.fullmatch(tag):
        return f"tag {tag!r} is not 1 to 128 letters, digits, '_', '.' or '-', starting with no '.' or '-'"
    if len(name) > NAME_MAX:
        return f"the name is {len(name)} characters, more than {NAME_MAX}"
    registry, slash, path = name.partition("/")
    # as docker tells a registry from a first name component: a '.' or ':', localhost or capitals
    is_registry = any(c in registry for c in ".:") or registry == "localhost" or registry.lower() != registry
    if slash and is_registry and not REGISTRY.fullmatch(registry):
        return f"registry {registry!r} is not HOST or HOST:PORT"
    if not (slash and is_registry):
        path = name
    for component in path.split("/"):
        if not NAME_COMPONENT.fullmatch(component):
            return (
                f"name component {component!r} is not lowercase letters and digits joined by "
                "'.', '_', '__' or '-'"
            )
    return None


def check_image(reference: str, flag: str = "--image") -> None:
    """A ValueError of one line where `reference` is no image reference."""
    if problem := image_problem(reference):
        expected = f"expected an image reference such as {IMAGE_EXAMPLE}"
        raise ValueError(f"{flag} {reference!r}: {expected}; {problem}")


def run_argv(
    engine: str,
    image: str,
    argv: Sequence[str],
    mounts: Iterable[str],
    workdir: str,
    user: str | None = None,
    env_names: Iterable[str] = (),
) -> list[str]:
    """argv that runs `argv` in `image` with each mount at its own path; env_names are passed by name
    only, so the values come from the caller's environment. user None keeps the image's own user
    (docker/podman; the buildah runner needs one)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown container engine {engine!r}; choose one of {', '.join(ENGINES)}")
    volumes = [arg for path in dict.fromkeys(mounts) for arg in ("-v", f"{path}:{path}")]
    env = [arg for name in env_names for arg in ("-e", name)]
    if engine == "buildah":
        if user is None:
            raise ValueError("the buildah runner needs a user (uid:gid)")
        runner = [sys.executable, "-m", "hvdtrain.launching.container"]
        runner += ["--image", image, "--workdir", workdir]
        return [*runner, "--user", user, *volumes, *env, "--", *argv]
    engine_run = [engine, "run", "--rm", "--network", "host", "--ipc", "host"]
    engine_run += ["--user", user] if user is not None else []
    return [*engine_run, "-w", workdir, *volumes, *env, image, *argv]


def in_image(
    command: LaunchCommand,
    image: str,
    engine: str,
    mounts: list[str],
    workdir: str,
    user: str,
    env_names: Sequence[str] | None = None,
) -> LaunchCommand:
    """user is uid:gid, the host user's, so files in the mounted run directory stay theirs;
    env_names (default: the command's own variables) are passed into the container by name."""
    names = sorted(command.env) if env_names is None else env_names
    argv = run_argv(engine, image, command.argv, mounts, workdir, user, names)
    return LaunchCommand(argv, command.env)


def detect_engine(probe_daemon: bool = True, fallbacks: Sequence[str] = ("buildah", "podman")) -> str:
    """HVDTRAIN_CONTAINER_ENGINE, else docker where its daemon answers, else the first fallback on PATH.

    probe_daemon=False runs no subprocess (a --dry-run starts nothing): docker counts when it is on
    PATH. fallbacks lets `make image` keep to the engines it builds with (docker, buildah).
    """
    chosen = os.environ.get("HVDTRAIN_CONTAINER_ENGINE")
    if chosen:
        return chosen
    if shutil.which("docker") and (
        not probe_daemon or subprocess.run(["docker", "info"], capture_output=True).returncode == 0
    ):
        return "docker"
    for engine in fallbacks:
        if shutil.which(engine):
            return engine
    raise ValueError("--image needs docker, podman or buildah; none works here (make image installs buildah)")


def main(argv: list[str] | None = None) -> int:
    """buildah has no `run --rm IMAGE`: make a working container, run, remove it."""
    parser = argparse.ArgumentParser(prog="hvdtrain.launching.container")
    parser.add_argument("--image", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--user", required=True)
    parser.add_argument("-v", dest="volumes", action="append", default=[])
    parser.add_argument("-e", dest="env", action="append", default=[])
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    container = subprocess.run(
        ["buildah", "from", "--pull-never", args.image], capture_output=True, text=True
    )
    if container.returncode != 0:
        print(
            f"hvdtrain: buildah could not use image {args.image}: {container.stderr.strip()}", file=sys.stderr
        )
        return 2
    name = container.stdout.strip()
    try:
        run = ["buildah", "run", "--isolation", "chroot", "--network", "host", "--user", args.user]
        run += ["--workingdir", args.workdir]
        for volume in args.volumes:
            run += ["-v", volume]
        for variable in args.env:  # names only: the values come from this process's environment
            run += ["--env", f"{variable}={os.environ.get(variable, '')}"]
        return subprocess.run([*run, name, "--", *command]).returncode
    finally:
        subprocess.run(["buildah", "rm", name], capture_output=True)


if __name__ == "__main__":
    sys.exit(main())

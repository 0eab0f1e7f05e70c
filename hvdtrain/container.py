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
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence

from hvdtrain.launch import LaunchCommand

ENGINES = ("docker", "podman", "buildah")


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
        runner = [sys.executable, "-m", "hvdtrain.container", "--image", image, "--workdir", workdir]
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
    parser = argparse.ArgumentParser(prog="hvdtrain.container")
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

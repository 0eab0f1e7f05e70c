"""`hvdtrain run --image IMAGE`: the same launch command, run inside a container image.

`in_image` is pure: it wraps a LaunchCommand in `docker run`/`podman run` (host network and IPC, the
run directory and working directory mounted at the same paths), or, where containers cannot be
started but buildah can run commands in an image (`buildah run --isolation chroot`, as on the
project's CI machines), in this module's own small runner, which makes a working container, runs
the command in it and removes it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

from hvdtrain.launch import LaunchCommand

ENGINES = ("docker", "podman", "buildah")


def in_image(
    command: LaunchCommand, image: str, engine: str, mounts: list[str], workdir: str, user: str
) -> LaunchCommand:
    """user is uid:gid, the host user's, so files in the mounted run directory stay theirs."""
    if engine not in ENGINES:
        raise ValueError(f"unknown container engine {engine!r}; choose one of {', '.join(ENGINES)}")
    volumes = [arg for path in dict.fromkeys(mounts) for arg in ("-v", f"{path}:{path}")]
    env = [arg for name in sorted(command.env) for arg in ("-e", name)]
    if engine == "buildah":
        runner = [
            sys.executable,
            "-m",
            "hvdtrain.container",
            "--image",
            image,
            "--workdir",
            workdir,
            "--user",
            user,
        ]
        return LaunchCommand([*runner, *volumes, *env, "--", *command.argv], command.env)
    engine_run = [engine, "run", "--rm", "--network", "host", "--ipc", "host", "--user", user, "-w", workdir]
    return LaunchCommand([*engine_run, *volumes, *env, image, *command.argv], command.env)


def detect_engine() -> str:
    """HVDTRAIN_CONTAINER_ENGINE, else docker where its daemon answers, else buildah, else podman."""
    chosen = os.environ.get("HVDTRAIN_CONTAINER_ENGINE")
    if chosen:
        return chosen
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        return "docker"
    for engine in ("buildah", "podman"):
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

"""`hvdtrain setup`: the patched Horovod for this environment, where hvdtrain was pip-installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import click

from hvdtrain.cli.base import fail
from hvdtrain.errors import UserError


@click.command()
@click.option(
    "--controllers",
    default="gloo,mpi",
    show_default=True,
    help="What Horovod coordinates with: gloo, mpi or both (gloo alone needs no MPI).",
)
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default=None,
    help="cuda: NCCL against a CUDA build of torch. [default: $HVDTRAIN_DEVICE, else cuda where "
    "nvidia-smi lists a GPU]",
)
def setup(controllers: str, device: str | None) -> None:
    """Build the patched Horovod for the torch and TensorFlow installed in this environment (or reuse
    the cached build of the same versions), install it here and check it as `hvdtrain doctor` does.
    Missing build tools are named first, each with the line that installs it."""
    from hvdtrain.building import horovod_wheel, prerequisites

    found = prerequisites.installed_frameworks()
    if not found:
        raise UserError(
            f"neither torch nor tensorflow is installed in {sys.prefix}: Horovod is built for them; "
            "pip install 'hvdtrain[torch]' (or [tf]) first"
        )
    for line in prerequisites.version_notes(found, horovod_wheel.read_versions()):
        click.echo(f"hvdtrain: note: {line}", err=True)
    try:
        chosen = horovod_wheel.parse_controllers(controllers)
        device_kind = horovod_wheel.device_of(device or horovod_wheel.default_device())
    except horovod_wheel.BuildError as error:
        raise UserError(str(error)) from None
    frameworks = [name for name in found if name in horovod_wheel.DEVICE_FRAMEWORKS[device_kind].split(",")]
    if not frameworks:
        raise UserError(f"a {device_kind} build is for {horovod_wheel.DEVICE_FRAMEWORKS[device_kind]}: "
                        f"none is installed in {sys.prefix}")  # fmt: skip
    for name in sorted(set(found) - set(frameworks)):
        click.echo(f"hvdtrain: note: a {device_kind} build holds no {name} ops (Horovod's {name} with "
                   f"{device_kind} needs a {device_kind} build of it); it is left out", err=True)  # fmt: skip
    if device_kind == "cuda":
        from hvdtrain.building import cuda_build, cuda_toolkit

        if cuda_toolkit.cuda_torch(cuda_build.torch_requires(sys.executable)) is None:
            raise UserError(  # make's own venv may swap it; a user's environment is theirs
                f"torch {found['torch']} here is not a CUDA build: install one (pip install torch from "
                "PyTorch's CUDA index), or build for the CPU: hvdtrain setup --device cpu"
            )
    include = Path(sysconfig.get_paths()["include"])
    if missing := prerequisites.missing(chosen, shutil.which, include) + prerequisites.python_tools():
        for line in missing:
            click.echo(f"hvdtrain: setup: {line}", err=True)
        fail(f"setup: {len(missing)} build prerequisite(s) missing; nothing was built")
    argv = ["--python", sys.executable, "--frameworks", ",".join(frameworks)]
    argv += ["--controllers", ",".join(chosen), "--device", device_kind]
    try:
        horovod_wheel.main(argv)
    except horovod_wheel.BuildError as error:
        fail(str(error))
    except subprocess.CalledProcessError as error:
        fail(f"setup: command failed ({error.returncode}): {' '.join(map(str, error.cmd))}")

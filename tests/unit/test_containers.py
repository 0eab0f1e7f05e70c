"""The images are built from the same pins, script and patches as `make install`; --image wraps the
launch command. (The CPU image is built and run for real by `make image image-test`.)"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from hvdtrain.container import in_image
from hvdtrain.launch import LaunchCommand

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "containers"))

import build_horovod  # noqa: E402

DOCKERFILES = {name: (ROOT / "containers" / f"Dockerfile.{name}").read_text() for name in ("cpu", "gpu")}


def stages(text: str) -> list[str]:
    return re.split(r"^FROM ", text, flags=re.M)[1:]


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_pins_match_versions_env(name):
    versions = build_horovod.read_versions()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILES[name], flags=re.M))
    for key in ("HOROVOD_VERSION", "TORCH_VERSION", "TENSORFLOW_VERSION"):
        if key in args:
            assert args[key] == versions[key], f"Dockerfile.{name} pins {key}={args[key]}"
    assert {"TORCH_VERSION", "TENSORFLOW_VERSION"} <= args.keys()


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_same_build_steps_as_make_install(name):
    text = DOCKERFILES[name]
    build, runtime = stages(text)
    assert "containers/system-deps.sh" in build and "containers/build_horovod.py" in build
    assert "COPY containers/ containers/" in build, "the patches travel with the build script"
    assert "RUN hvdtrain doctor" in runtime, "a broken Horovod fails the image build"
    assert not re.search(r"\b(g\+\+|cmake|libopenmpi-dev)\b", runtime), "no build tools in the final stage"
    assert re.search(r"^USER hvdtrain$", runtime, flags=re.M)
    assert "COPY --from=build /opt/hvdtrain /opt/hvdtrain" in runtime


def test_gpu_image_builds_horovod_with_nccl():
    build = stages(DOCKERFILES["gpu"])[0]
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in build and "libnccl-dev" in build
    assert "nvidia/cuda" in DOCKERFILES["gpu"] and "cudnn-devel" in DOCKERFILES["gpu"]


COMMAND = LaunchCommand(["horovodrun", "-np", "2", "python", "train.py"], {"OMP_NUM_THREADS": "1"})


def test_docker_run_mounts_the_run_dir_and_shares_the_host_network():
    wrapped = in_image(COMMAND, "img:1", "docker", ["/runs/a", "/work", "/work"], "/work", "0:0")
    assert wrapped.argv == [
        "docker", "run", "--rm", "--network", "host", "--ipc", "host", "--user", "0:0", "-w", "/work",
        "-v", "/runs/a:/runs/a", "-v", "/work:/work", "-e", "OMP_NUM_THREADS", "img:1",
        "horovodrun", "-np", "2", "python", "train.py",
    ]  # fmt: skip
    assert wrapped.env == COMMAND.env


def test_buildah_goes_through_the_runner():
    wrapped = in_image(COMMAND, "img:1", "buildah", ["/runs/a"], "/work", "1000:1000")
    assert wrapped.argv[1:9] == [
        "-m",
        "hvdtrain.container",
        "--image",
        "img:1",
        "--workdir",
        "/work",
        "--user",
        "1000:1000",
    ]
    assert wrapped.argv[wrapped.argv.index("--") + 1 :] == COMMAND.argv
    with pytest.raises(ValueError, match="unknown container engine"):
        in_image(COMMAND, "img:1", "lxc", [], "/", "0:0")

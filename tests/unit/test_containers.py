"""The images are built from the same pins, script and patches as `make install`; --image wraps the
launch command. (The CPU image is built and run for real by `make image image-test`.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hvdtrain.launching import container
from hvdtrain.launching.container import detect_engine, in_image, run_argv
from hvdtrain.launching.spec import LaunchCommand

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "containers"))

import image  # noqa: E402

from hvdtrain.building import horovod_wheel as build_horovod  # noqa: E402

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
    assert {"TORCH_VERSION", *(["TENSORFLOW_VERSION"] if name == "cpu" else [])} <= args.keys()


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


def test_gpu_image_builds_horovod_with_nccl_from_pypis_cuda_packages():
    build, runtime = stages(DOCKERFILES["gpu"])
    assert "HVDTRAIN_DEVICE=cuda" in build and "--device cuda" in build
    assert '"torch===${TORCH_VERSION}"' in build, "PyPI's own (CUDA) build, never a local +cpu one"
    assert "doctor --require torch,gloo,mpi,nccl" in runtime
    for elsewhere in ("download.pytorch.org", "nvidia/cuda", "libnccl", "--extra-index-url"):
        assert elsewhere not in DOCKERFILES["gpu"], f"CUDA comes from PyPI, not {elsewhere}"


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
        "hvdtrain.launching.container",
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


def test_run_argv_is_the_one_engine_run_for_launches_and_image_test():
    assert run_argv("podman", "img:1", ["hvdtrain", "doctor"], ["/src", "/runs/a", "/src"], "/src") == [
        "podman", "run", "--rm", "--network", "host", "--ipc", "host", "-w", "/src",
        "-v", "/src:/src", "-v", "/runs/a:/runs/a", "img:1", "hvdtrain", "doctor",
    ]  # fmt: skip
    assert run_argv("buildah", "img:1", ["true"], ["/src"], "/src", "0:0", ["A"]) == [
        sys.executable, "-m", "hvdtrain.launching.container", "--image", "img:1", "--workdir", "/src",
        "--user", "0:0", "-v", "/src:/src", "-e", "A", "--", "true",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="needs a user"):
        run_argv("buildah", "img:1", ["true"], [], "/")


@pytest.mark.parametrize("tool, user", [("docker", None), ("buildah", "0:0")])
def test_image_test_runs_through_run_argv(monkeypatch, tool, user):
    ran = []
    monkeypatch.setattr(image, "sh", lambda *argv, **kwargs: ran.append(list(argv)))
    image.run_in_image(tool, "img:1", "hvdtrain", "doctor", mounts=("/runs/b",))
    root = str(image.ROOT)
    assert ran == [run_argv(tool, "img:1", ["hvdtrain", "doctor"], ["/runs/b"], root, user)]


@pytest.fixture
def machine(monkeypatch):
    """A machine with the given executables on PATH and a docker daemon that answers or not; every
    subprocess started is recorded."""
    state = {"path": set(), "daemon": True, "ran": []}

    def run(argv, **kwargs):
        state["ran"].append(argv)
        return subprocess.CompletedProcess(argv, 0 if state["daemon"] else 1)

    monkeypatch.delenv("HVDTRAIN_CONTAINER_ENGINE", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}" if name in state["path"] else None)
    monkeypatch.setattr(subprocess, "run", run)
    return state


@pytest.mark.parametrize(
    "path, daemon, expected",
    [
        ({"docker", "buildah", "podman"}, True, "docker"),
        ({"docker", "buildah", "podman"}, False, "buildah"),
        ({"docker", "podman"}, False, "podman"),
        ({"podman", "buildah"}, True, "buildah"),
    ],
)
def test_engine_choice(machine, path, daemon, expected):
    machine.update(path=path, daemon=daemon)
    assert detect_engine() == expected
    assert machine["ran"] == ([["docker", "info"]] if "docker" in path else [])


def test_engine_from_the_environment_wins_and_probes_nothing(machine, monkeypatch):
    machine["path"] = {"docker", "buildah"}
    monkeypatch.setenv("HVDTRAIN_CONTAINER_ENGINE", "podman")
    assert detect_engine() == "podman"
    assert machine["ran"] == []


def test_no_daemon_probe_when_asked(machine):
    """--dry-run: docker on PATH counts, and no subprocess is started."""
    machine.update(path={"docker", "buildah"}, daemon=False)
    assert detect_engine(probe_daemon=False) == "docker"
    machine["path"] = {"podman"}
    assert detect_engine(probe_daemon=False) == "podman"
    assert machine["ran"] == []


def test_no_engine_is_an_error_for_run_and_installs_buildah_for_make_image(machine, monkeypatch):
    machine["path"] = {"docker", "podman"}
    machine["daemon"] = False
    with pytest.raises(ValueError, match="none works here"):
        detect_engine(fallbacks=("buildah",))
    installed = []
    monkeypatch.setattr(image, "ensure_debian_packages", lambda *names: installed.extend(names))
    assert image.engine() == "buildah" and installed == ["buildah"]
    machine["path"] = {"docker", "buildah", "podman"}
    assert image.engine() == "buildah" and installed == ["buildah"]
    assert container.detect_engine is image.detect_engine


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({"HVDTRAIN_WHEEL_CACHE": "/w", "XDG_CACHE_HOME": "/x"}, "/w"),
        ({"XDG_CACHE_HOME": "/x"}, "/x/hvdtrain/wheels"),
        ({"HVDTRAIN_WHEEL_CACHE": "", "XDG_CACHE_HOME": ""}, "~/.cache/hvdtrain/wheels"),
        ({}, "~/.cache/hvdtrain/wheels"),
    ],
)
def test_wheel_cache_precedence(environ, expected):
    assert build_horovod.wheel_cache_dir(environ) == Path(expected).expanduser()


def test_one_wheel_cache_for_make_install_and_make_image(monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", "/x")
    monkeypatch.delenv("HVDTRAIN_WHEEL_CACHE", raising=False)
    assert image.wheel_cache_dir is build_horovod.wheel_cache_dir
    assert image.wheel_cache_dir() == Path("/x/hvdtrain/wheels")
    assert not hasattr(image, "WHEEL_CACHE") and not hasattr(build_horovod, "DEFAULT_CACHE")


def test_image_py_needs_only_the_standard_library():
    """`make image` runs containers/image.py with the system python, where hvdtrain (and psutil,
    click, ...) are not installed: hvdtrain.launching.container and hvdtrain.launching.spec must
    import without them."""
    code = (
        "import runpy, sys\n"
        "script, sys.argv, before = sys.argv[1], ['image.py', '--help'], set(sys.modules)\n"
        "try: runpy.run_path(script, run_name='__main__')\n"
        "except SystemExit: pass\n"
        "print(sorted({m.split('.')[0] for m in set(sys.modules) - before} - sys.stdlib_module_names))"
    )
    script = str(ROOT / "containers" / "image.py")
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, script], capture_output=True, text=True, cwd="/"
    )
    imported = out.stdout.strip().splitlines()[-1:]
    assert imported == ["['hvdtrain']"], out.stderr


DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize(
    ("reference", "problem"),
    [
        ("ubuntu", None),
        ("hvdtrain:cpu", None),
        ("localhost/hvdtrain:cpu", None),
        ("registry/hvdtrain:cpu", None),
        ("ghcr.io/team/sub/hvdtrain:v1.2-rc_3", None),
        ("registry.example.com:5000/team/hvdtrain", None),
        ("localhost:5000/hvdtrain", None),
        ("[::1]:5000/hvdtrain:cpu", None),
        ("Registry.Example.com/team/img", None),  # a registry host may have capitals, a name may not
        ("my_team/img__v2.a-b---c", None),
        (f"hvdtrain@{DIGEST}", None),
        (f"ghcr.io/team/hvdtrain:cpu@{DIGEST}", None),
        ("hvdtrain:" + "t" * 128, None),
        ("team/" + "a" * 250, None),  # 255 characters
        ("bad image name!!", "name component 'bad image name!!' is not lowercase letters and digits"),
        ("", "it is blank"),
        (" ", "it is blank"),
        ("Hvdtrain", "name component 'Hvdtrain' is not lowercase"),
        ("team/-img", "name component '-img' is not lowercase"),
        ("team/img_", "name component 'img_' is not lowercase"),
        ("team/a___b", "name component 'a___b' is not lowercase"),
        ("team//img", "name component '' is not lowercase"),
        ("registry.io/", "name component '' is not lowercase"),
        ("hvdtrain:", "tag '' is not 1 to 128 letters"),
        ("hvdtrain:-cpu", "tag '-cpu' is not 1 to 128 letters"),
        ("hvdtrain:c/pu", "registry 'hvdtrain:c' is not HOST or HOST:PORT"),
        ("hvdtrain:" + "t" * 129, "is not 1 to 128 letters"),
        ("hvdtrain@sha256:abc", "digest 'sha256:abc' is not sha256:<64 hex digits>"),
        (f"hvdtrain@{DIGEST.upper()}", "is not sha256:<64 hex digits>"),
        ("hvdtrain@md5:" + "0" * 32, "digest 'md5:"),
        ("my_registry.io:5000/img", "registry 'my_registry.io:5000' is not HOST or HOST:PORT"),
        ("registry.io:port/img", "registry 'registry.io:port' is not HOST or HOST:PORT"),
        ("team/" + "a" * 251, "the name is 256 characters, more than 255"),
    ],
)
def test_an_image_reference_follows_the_oci_distribution_grammar(reference, problem):
    found = container.image_problem(reference)
    assert found is None if problem is None else problem in found, found


def test_hvdtrain_run_and_k8s_refuse_a_bad_image_reference_with_the_same_line():
    from test_plan import facts

    from hvdtrain.job.plan import plan_run
    from hvdtrain.job.request import RunRequest
    from hvdtrain.launching.k8s import MPIJobSpec, mpijob

    line = (
        "--image 'bad image name!!': expected an image reference such as registry/hvdtrain:cpu; name "
        "component 'bad image name!!' is not lowercase letters and digits joined by '.', '_', '__' or '-'"
    )
    with pytest.raises(ValueError) as run_refused:
        plan_run(RunRequest("digits-mlp-torch", image="bad image name!!"), facts(container_engine="docker"))
    with pytest.raises(ValueError) as k8s_refused:
        mpijob(MPIJobSpec(recipe="digits-mlp-torch", np=2, image="bad image name!!"))
    assert str(run_refused.value) == str(k8s_refused.value) == line

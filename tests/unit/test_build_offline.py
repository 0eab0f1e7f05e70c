"""build_horovod.py for an offline GPU machine (--offline, --sdist, --controllers) and `make device-bundle`,
checked without building: toolkits and NCCL as folders in tmp_path, a fake nvcc on a PATH made here,
and torch's metadata on PYTHONPATH for the interpreter build_horovod asks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "containers"))

import device_bundle  # noqa: E402

from hvdtrain.building import cuda_toolkit  # noqa: E402
from hvdtrain.building import horovod_wheel as build_horovod  # noqa: E402
from hvdtrain.building.horovod_wheel import BuildError  # noqa: E402

NVCC_BUILD = "Build cuda_13.0.r13.0/compiler.36424714_0"
CUDA_TORCH = [  # a CUDA 13 torch's Requires-Dist, as on the offline machine
    "cuda-toolkit[cublas,cudart,nvrtc]==13.0.2; platform_system == 'Linux'",
    "nvidia-nccl-cu13==2.28.9; platform_system == 'Linux'",
]
HAS_TORCH = build_horovod.installed_version(sys.executable, "torch") is not None


def touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    return path


def toolkit(home: Path, build: str = NVCC_BUILD) -> Path:
    """A toolkit folder whose bin/nvcc answers --version as CUDA 13.0's does."""
    nvcc = home / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True, exist_ok=True)
    nvcc.write_text(
        "#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
        f"echo 'Cuda compilation tools, release 13.0, V13.0.88'\necho '{build}'\n"
    )
    nvcc.chmod(0o755)
    touch(home / "include" / "cuda_runtime.h")
    return home


def distribution(folder: Path, name: str, version: str, requires: list[str] = ()) -> None:
    info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"]
    (info / "METADATA").write_text("".join(lines + [f"Requires-Dist: {r}\n" for r in requires]))


def one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text, text
    return text


def test_gloo_alone_builds_without_mpi():
    env = build_horovod.build_env(["torch"], "hvdtrain.x", build_horovod.parse_controllers("gloo"))
    assert env["HOROVOD_WITHOUT_MPI"] == env["HOROVOD_WITH_GLOO"] == "1"
    assert "HOROVOD_WITH_MPI" not in env and "HOROVOD_WITHOUT_GLOO" not in env
    default = build_horovod.build_env(["torch"], "hvdtrain.x")
    assert default == build_horovod.build_env(
        ["torch"], "hvdtrain.x", build_horovod.parse_controllers("mpi,gloo")
    )
    assert default["HOROVOD_WITH_MPI"] == default["HOROVOD_WITH_GLOO"] == "1"
    for wrong in ("nccl", "", ","):
        with pytest.raises(BuildError) as error:
            build_horovod.parse_controllers(wrong)
        assert "gloo,mpi" in one_line(error)


def test_the_controllers_change_the_key_and_the_default_keeps_the_old_one(tmp_path):
    patch = tmp_path / "0001-x.patch"
    patch.write_text("reason\n")
    environ = {"HOROVOD_GPU_OPERATIONS": "NCCL", "PATH": "/x"}
    assert build_horovod.key_settings(environ, ["gloo", "mpi"]) == build_horovod.user_build_settings(environ)
    keys = {
        build_horovod.cache_key(
            "0.28.1", "cp312", {"torch": "2.11.0"}, [patch], build_horovod.key_settings(environ, controllers)
        )
        for controllers in (["gloo"], ["mpi"], ["gloo", "mpi"])
    }
    assert len(keys) == 3


@pytest.mark.skipif(not HAS_TORCH, reason="--print-key reads torch's version from this interpreter")
def test_print_key_offline_on_cpu_follows_the_controllers(capsys):
    argv = [
        "--print-key",
        "--offline",
        "--device",
        "cpu",
        "--frameworks",
        "torch",
        "--python",
        sys.executable,
    ]
    keys = []
    for controllers in ("gloo", "gloo,mpi"):
        assert build_horovod.main([*argv, "--controllers", controllers]) == 0
        keys.append(capsys.readouterr().out.strip())
    assert len(keys[0]) == 16 and keys[0] != keys[1]


@pytest.mark.skipif(not HAS_TORCH, reason="reads torch's version from this interpreter")
def test_offline_without_a_cached_wheel_or_an_sdist_stops_before_any_pip(tmp_path):
    argv = ["--offline", "--device", "cpu", "--frameworks", "torch", "--python", sys.executable]
    with pytest.raises(BuildError) as error:
        build_horovod.main([*argv, "--cache-dir", str(tmp_path)])
    assert "no --sdist" in one_line(error) and not list(tmp_path.iterdir())


def test_a_missing_sdist_fails_in_one_line_before_anything_else(tmp_path):
    # The interpreter does not exist either: had anything run before the check, that would fail first.
    argv = ["--device", "cuda", "--offline", "--python", str(tmp_path / "no-python")]
    with pytest.raises(BuildError) as error:
        build_horovod.main([*argv, "--sdist", str(tmp_path / "horovod-0.28.1.tar.gz")])
    assert "no such file" in one_line(error)
    other = touch(tmp_path / "horovod-0.27.0.tar.gz")
    with pytest.raises(BuildError) as error:
        build_horovod.main([*argv, "--sdist", str(other)])
    assert "expected horovod-0.28.1.tar.gz" in one_line(error)
    script = subprocess.run(
        [sys.executable, str(ROOT / "containers" / "build_horovod.py"), "--sdist", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
    )
    assert script.returncode == 1 and script.stderr.count("\n") == 1 and "no such file" in script.stderr


def test_offline_toolkit_search_order(tmp_path):
    site, empty = tmp_path / "site", tmp_path / "empty"
    site.mkdir(), empty.mkdir()
    with pytest.raises(BuildError) as error:
        build_horovod.offline_cuda_home(site, {"PATH": str(empty)})
    assert "no nvcc on PATH" in one_line(error)

    system = tmp_path / "cuda-13.0"
    toolkit(system).joinpath("include", "cuda_runtime.h").unlink()
    path = {"PATH": f"{empty}:{system / 'bin'}"}
    with pytest.raises(BuildError) as error:
        build_horovod.offline_cuda_home(site, path)
    assert "cuda_runtime.h" in one_line(error)

    touch(system / "include" / "cuda_runtime.h")
    assert build_horovod.offline_cuda_home(site, path) == (system, "nvcc on PATH")
    linked = tmp_path / "usr-bin"  # /usr/bin/nvcc -> the toolkit's: the toolkit is where it leads
    linked.mkdir()
    (linked / "nvcc").symlink_to(system / "bin" / "nvcc")
    assert build_horovod.offline_cuda_home(site, {"PATH": str(linked)}) == (system, "nvcc on PATH")

    pypi = toolkit(site / "nvidia" / "cu13")
    assert cuda_toolkit.cuda_home(site) == pypi
    assert build_horovod.offline_cuda_home(site, path) == (pypi, "pypi")
    mine = {**path, "HOROVOD_CUDA_HOME": "/opt/cuda"}
    assert build_horovod.offline_cuda_home(site, mine) == (Path("/opt/cuda"), "HOROVOD_CUDA_HOME")


def test_the_nvcc_version_is_its_last_line(tmp_path):
    assert build_horovod.nvcc_version(toolkit(tmp_path / "cuda")) == NVCC_BUILD
    assert build_horovod.nvcc_version(tmp_path / "nothing") == "unknown"


def test_nccl_must_bring_its_header_unless_the_user_names_one(tmp_path):
    root = tmp_path / "nvidia" / "nccl"
    with pytest.raises(BuildError) as error:
        build_horovod.nccl_root(tmp_path, {})
    assert "is missing" in one_line(error)
    touch(root / "lib" / "libnccl.so.2")
    with pytest.raises(BuildError) as error:
        build_horovod.nccl_root(tmp_path, {})
    assert "no include/nccl.h" in one_line(error) and "HOROVOD_NCCL_HOME" in str(error.value)
    assert build_horovod.nccl_root(tmp_path, {"HOROVOD_NCCL_HOME": "/opt/nccl"}) == root
    touch(root / "include" / "nccl.h")
    assert build_horovod.nccl_root(tmp_path, {}) == root


@pytest.fixture
def offline_machine(tmp_path, monkeypatch):
    """This interpreter as the offline machine's: torch's metadata from PYTHONPATH, a CUDA toolkit first
    on PATH, and pip refused any index, so an install it tried would fail rather than fetch."""
    metadata = tmp_path / "metadata"
    monkeypatch.setenv("PYTHONPATH", str(metadata))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("HOROVOD_CUDA_HOME", raising=False)
    system = toolkit(tmp_path / "cuda-13.0")
    monkeypatch.setenv("PATH", f"{system / 'bin'}{os.pathsep}{os.environ['PATH']}")
    return metadata, system


def test_offline_refuses_a_cpu_torch(offline_machine):
    metadata, _ = offline_machine
    distribution(metadata, "torch", "2.11.0", ["filelock", "sympy>=1.13.3"])
    with pytest.raises(BuildError) as error:
        build_horovod.prepare_cuda(sys.executable, "2.11.0", offline=True)
    assert "not a CUDA build" in one_line(error)


def test_offline_cuda_installs_nothing_and_keys_the_toolkit_it_found(offline_machine, monkeypatch):
    metadata, system = offline_machine
    distribution(metadata, "torch", "2.11.0", CUDA_TORCH)
    distribution(metadata, "nvidia-nccl-cu13", "2.28.9")
    site = Path(
        build_horovod.ask(sys.executable, "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    )
    if cuda_toolkit.cuda_home(site) is not None:
        pytest.skip(f"{site} holds PyPI's CUDA toolkit, which an offline build takes first")
    monkeypatch.setenv("HOROVOD_NCCL_HOME", "/opt/nccl")  # this site has no nvidia/nccl
    env, key = build_horovod.prepare_cuda(sys.executable, "2.13.0", offline=True)
    assert env["CUDA_HOME"] == env["HOROVOD_CUDA_HOME"] == str(system)
    assert key["cuda-home"] == f"nvcc on PATH: {NVCC_BUILD}"
    online = cuda_toolkit.cuda_torch(CUDA_TORCH).key("2.28.9")
    assert key == online | {"cuda-home": key["cuda-home"]}  # never the key of an online build


def test_the_device_bundle_keeps_what_it_has_and_refuses_over_48_mib(tmp_path):
    horovod = build_horovod.read_versions()["HOROVOD_VERSION"]
    (tmp_path / f"horovod-{horovod}.tar.gz").write_bytes(b"x" * 1000)
    for name in device_bundle.WHEELS:
        touch(tmp_path / "wheels" / f"{name}-1.0-py3-none-any.whl")

    def download(*args: str) -> None:
        raise AssertionError(f"downloaded again: {args}")

    assert device_bundle.fill(tmp_path, download) == 1000
    with (tmp_path / "wheels" / "big.whl").open("wb") as big:
        big.truncate(device_bundle.LIMIT_MIB * 2**20)
    with pytest.raises(BuildError) as error:
        device_bundle.fill(tmp_path, download)
    assert "over 48 MiB" in one_line(error)

"""The GPU build reads what to compile against from the CUDA torch wheel's own requirements."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from hvdtrain.building import horovod_wheel as build_horovod  # noqa: E402
from hvdtrain.building.cuda_toolkit import build_env, cuda_home, cuda_torch, requirements  # noqa: E402

TORCH_2_13 = [  # torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl, Requires-Dist
    "filelock",
    "typing-extensions>=4.10.0",
    "cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==13.0.3; "
    'platform_system == "Linux"',
    'cuda-bindings<14,>=13.0.3; platform_system == "Linux" and python_version < "3.15"',
    'nvidia-cudnn-cu13==9.20.0.48; platform_system == "Linux"',
    'nvidia-nccl-cu13==2.29.7; platform_system == "Linux"',
    'triton==3.7.1; platform_system == "Linux" and python_version < "3.15"',
    'optree>=0.13.0; extra == "optree"',
]
TORCH_2_7 = [  # a CUDA 12 build: each library pinned on its own
    'nvidia-cuda-nvrtc-cu12==12.6.77; platform_system == "Linux" and platform_machine == "x86_64"',
    'nvidia-cuda-runtime-cu12==12.6.77; platform_system == "Linux" and platform_machine == "x86_64"',
    'nvidia-nccl-cu12==2.26.2; platform_system == "Linux" and platform_machine == "x86_64"',
]
CPU_TORCH = ["filelock", "typing-extensions>=4.10.0", "sympy>=1.13.3", "networkx>=2.5.1"]


def test_requirements_are_read_with_their_pins_and_extras_skipped():
    found = requirements(TORCH_2_13)
    assert found["cuda-toolkit"] == "13.0.3" and found["nvidia-nccl-cu13"] == "2.29.7"
    assert found["filelock"] == "" and found["cuda-bindings"] == "" and "optree" not in found


def test_a_cuda_13_torch_names_its_toolkit_release_and_nccl():
    plan = cuda_torch(TORCH_2_13)
    assert plan.major == 13 and plan.nccl == "nvidia-nccl-cu13"
    assert plan.toolkit == ("cuda-toolkit[nvcc,cccl,cudart]==13.0.3",)
    assert plan.key("2.29.7")["nccl"] == "nvidia-nccl-cu13==2.29.7"


def test_a_cuda_12_torch_takes_the_per_library_packages_of_its_release():
    plan = cuda_torch(TORCH_2_7)
    assert plan.major == 12 and plan.nccl == "nvidia-nccl-cu12"
    assert plan.toolkit == (
        "nvidia-cuda-nvcc-cu12==12.6.*",
        "nvidia-cuda-runtime-cu12==12.6.*",
        "nvidia-cuda-cccl-cu12==12.6.*",
    )


def test_a_cpu_torch_is_no_cuda_build():
    assert cuda_torch(CPU_TORCH) is None


def test_the_toolkit_is_the_folder_with_nvcc_and_the_runtime_headers(tmp_path):
    assert cuda_home(tmp_path) is None
    (tmp_path / "nvidia" / "cuda_nvcc" / "bin").mkdir(parents=True)  # CUDA 12: nvcc apart from headers
    (tmp_path / "nvidia" / "cuda_nvcc" / "bin" / "nvcc").touch()
    assert cuda_home(tmp_path) is None
    home = tmp_path / "nvidia" / "cu13"
    for part in ("bin/nvcc", "include/cuda_runtime.h", "lib/libcudart_static.a"):
        (home / part).parent.mkdir(parents=True, exist_ok=True)
        (home / part).touch()
    assert cuda_home(tmp_path) == home


def test_the_build_env_points_nvcc_at_lib_and_keeps_the_users_nccl(tmp_path):
    (tmp_path / "lib").mkdir()
    env = build_env(tmp_path, Path("/site/nvidia/nccl"), {"NVCC_APPEND_FLAGS": "-lineinfo"})
    assert env["HOROVOD_GPU_OPERATIONS"] == "NCCL" and env["CUDA_HOME"] == env["HOROVOD_CUDA_HOME"]
    assert env["HOROVOD_NCCL_HOME"] == "/site/nvidia/nccl" and env["HOROVOD_NCCL_LINK"] == "SHARED"
    assert env["NVCC_APPEND_FLAGS"] == f"-lineinfo -L{tmp_path / 'lib'}"
    mine = build_env(tmp_path, Path("/site/nvidia/nccl"), {"HOROVOD_NCCL_HOME": "/opt/nccl"})
    assert "HOROVOD_NCCL_HOME" not in mine and "HOROVOD_NCCL_LINK" not in mine
    (tmp_path / "lib64").mkdir()  # a system toolkit: nvcc finds its libraries itself
    assert "NVCC_APPEND_FLAGS" not in build_env(tmp_path, Path("/n"), {})


def test_each_device_builds_its_frameworks_and_auto_is_cpu_without_nvidia_smi(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert build_horovod.device_of("auto") == "cpu" and build_horovod.device_of("cuda") == "cuda"
    assert build_horovod.DEVICE_FRAMEWORKS == {"cpu": "torch,tensorflow", "cuda": "torch"}

"""One source of truth for versions: hvdtrain/building/versions.env; pyproject.toml must agree."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from hvdtrain.building import horovod_wheel as build_horovod  # noqa: E402


def test_pyproject_pins_match_versions_env():
    versions = build_horovod.read_versions()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"torch=={versions['TORCH_VERSION']}" in extras["torch"]
    assert f"tensorflow-cpu=={versions['TENSORFLOW_VERSION']}" in extras["tf"]
    assert f"ray=={versions['RAY_VERSION']}" in extras["ray"]
    assert versions["HOROVOD_VERSION"] == "0.28.1"


def test_horovods_own_requirements_are_hvdtrains():
    """Horovod's wheel is installed with --no-deps (it is built here), so what it needs at run time
    has to come with hvdtrain, not through another package that may stop needing it."""
    from importlib import metadata

    from packaging.requirements import Requirement

    def name(text: str) -> str:
        return Requirement(text).name.lower().replace("_", "-")

    ours = {
        name(text) for text in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    }
    needed = [Requirement(text) for text in metadata.requires("horovod")]
    needed = {name(str(req)) for req in needed if req.marker is None or req.marker.evaluate({"extra": ""})}
    assert needed and needed <= ours, sorted(needed - ours)


def test_every_patch_says_why_in_its_first_line():
    patches = sorted(build_horovod.PATCH_DIR.glob("*.patch"))
    assert len(patches) >= 3
    for patch in patches:
        first = patch.read_text().splitlines()[0]
        assert first and not first.startswith(("---", "diff")), f"{patch.name} needs a one-line reason"


def test_cache_key_follows_versions_and_patch_bytes(tmp_path):
    patch = tmp_path / "0001-x.patch"
    patch.write_text("reason\n")
    key = build_horovod.cache_key("0.28.1", "cp311", {"torch": "2.13.0"}, [patch])
    assert key == build_horovod.cache_key("0.28.1", "cp311", {"torch": "2.13.0"}, [patch])
    assert key != build_horovod.cache_key("0.28.1", "cp311", {"torch": "2.14.0"}, [patch])
    assert key != build_horovod.cache_key("0.28.1", "cp312", {"torch": "2.13.0"}, [patch])
    patch.write_text("reason, changed\n")
    assert key != build_horovod.cache_key("0.28.1", "cp311", {"torch": "2.13.0"}, [patch])


def test_build_env_asks_for_each_framework_and_both_controllers():
    env = build_horovod.build_env(["torch"], local_version="hvdtrain.x")
    assert env["HOROVOD_WITH_PYTORCH"] == "1" and env["HOROVOD_WITHOUT_TENSORFLOW"] == "1"
    assert env["HOROVOD_WITH_MPI"] == env["HOROVOD_WITH_GLOO"] == "1"
    assert env["CMAKE_POLICY_VERSION_MINIMUM"] == "3.5"


def test_only_build_settings_change_the_key():
    settings = build_horovod.user_build_settings(
        {
            "HOROVOD_GPU_OPERATIONS": "NCCL",
            "HOROVOD_LOG_LEVEL": "debug",
            "HOROVOD_WITHOUT_MXNET": "1",
            "PATH": "/x",
        }
    )
    assert settings == {"HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_WITHOUT_MXNET": "1"}

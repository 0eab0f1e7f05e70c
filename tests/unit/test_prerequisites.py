"""What `hvdtrain setup` checks before it builds: the frameworks installed, their releases against
the pins, and each missing build tool in one line with the lines that install it."""

from __future__ import annotations

import importlib.metadata

from hvdtrain.building import prerequisites

PINS = {"TORCH_VERSION": "2.13.0", "TENSORFLOW_VERSION": "2.21.0"}


def versions(**found: str):
    def version_of(distribution: str) -> str:
        if distribution in found:
            return found[distribution]
        raise importlib.metadata.PackageNotFoundError(distribution)

    return version_of


def test_the_frameworks_found_are_the_installed_ones_by_any_distribution_name():
    found = prerequisites.installed_frameworks(versions(torch="2.13.0+cpu", **{"tensorflow-cpu": "2.21.0"}))
    assert found == {"torch": "2.13.0+cpu", "tensorflow": "2.21.0"}
    assert prerequisites.installed_frameworks(versions(tensorflow="2.21.1")) == {"tensorflow": "2.21.1"}
    assert prerequisites.installed_frameworks(versions()) == {}


def test_a_release_other_than_the_pinned_one_is_a_note_a_patch_release_is_not():
    assert prerequisites.version_notes({"torch": "2.13.1+cu130", "tensorflow": "2.21.0"}, PINS) == []
    (note,) = prerequisites.version_notes({"torch": "2.12.0"}, PINS)
    assert note.startswith(
        "torch 2.12.0 is installed; hvdtrain's Horovod patches are tested with torch 2.13.0"
    )


def test_each_missing_tool_is_one_line_and_mpi_only_for_the_mpi_controller(tmp_path):
    (tmp_path / "Python.h").write_text("")
    everything = prerequisites.missing(["gloo", "mpi"], lambda command: f"/usr/bin/{command}", tmp_path)
    assert everything == []
    only_gcc = prerequisites.missing(
        ["gloo", "mpi"], lambda command: "/x" if command == "g++" else None, tmp_path
    )
    assert [line.split(" missing")[0] for line in only_gcc] == [
        "make", "cmake", "patch", "Open MPI's compiler wrapper"
    ]  # fmt: skip
    assert only_gcc[-1] == (
        "Open MPI's compiler wrapper missing (no mpicxx or mpic++ on PATH): sudo apt-get install -y "
        "openmpi-bin libopenmpi-dev  (or: sudo dnf install -y openmpi-devel)"
    )
    gloo = prerequisites.missing(["gloo"], lambda command: None, tmp_path / "none")
    assert len(gloo) == 5 and gloo[-1].startswith(f"Python headers missing (no {tmp_path}/none/Python.h)")


def test_pip_and_setuptools_are_named_where_the_environment_lacks_them():
    assert prerequisites.python_tools(lambda name: object()) == []
    lines = prerequisites.python_tools(lambda name: None)
    assert lines == [
        "pip missing in this environment: python -m ensurepip  (or: uv pip install pip)",
        "setuptools missing in this environment: python -m pip install setuptools",
    ]

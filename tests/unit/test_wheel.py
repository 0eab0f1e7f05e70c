"""The wheel is the product: hvdtrain with its recipes as hvdtrain.recipes, and nothing of the test
rig, the tests or the benchmark suite."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv*", "runs", "build", "dist", "site", "*.egg-info", "*.whl", "__pycache__", ".*_cache"
)
TOOLING = ("tests", "benchmarks", "conftest")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Iterator[tuple[Path, zipfile.ZipFile]]:
    """(the source it was built from, the wheel): built from a copy of the checkout, so a stale build/
    here cannot leak old files into it and the build leaves nothing behind."""
    source = tmp_path_factory.mktemp("source") / "checkout"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE, symlinks=True)
    out = tmp_path_factory.mktemp("wheel")
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir"]
    done = subprocess.run([*argv, "--quiet", str(source), "-w", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = out.glob("hvdtrain-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        yield source, archive


def test_hvdtrain_is_the_only_top_level_package(built):
    _, wheel = built
    names = wheel.namelist()
    tops = {name.split("/")[0] for name in names}
    (info,) = [top for top in tops if top.endswith(".dist-info")]
    assert tops - {info} == {"hvdtrain"}, "no recipes, tests or benchmarks beside hvdtrain"
    assert wheel.read(f"{info}/top_level.txt").decode().split() == ["hvdtrain"]


def test_the_recipes_folder_is_hvdtrain_recipes(built):
    source, wheel = built
    shipped = {name for name in wheel.namelist() if name.startswith("hvdtrain/recipes/")}
    assert shipped == {f"hvdtrain/recipes/{path.name}" for path in (source / "recipes").glob("*.py")}
    assert "hvdtrain/recipes/digits_mlp_torch.py" in shipped


def test_every_file_of_the_package_is_in_it(built):
    """A subpackage missing from pyproject's packages list, or a data file without package-data, would
    be missing from the wheel while the checkout works."""
    source, wheel = built
    shipped = {name for name in wheel.namelist() if name.startswith("hvdtrain/")}
    here = {
        path.relative_to(source).as_posix()
        for path in (source / "hvdtrain").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    missing = sorted({Path(name).parent.as_posix().replace("/", ".") for name in here - shipped})
    assert missing == [], f"add to pyproject.toml's [tool.setuptools] packages (or package-data): {missing}"
    assert "hvdtrain/native/bindto.c" in shipped


def test_no_rig_or_root_only_code_is_inside(built):
    _, wheel = built
    names = wheel.namelist()
    assert [name for name in names if Path(name).name == "rig.py" or "/bench/" in name] == []
    mentions = [name for name in names if any(word in wheel.read(name) for word in (b"ip netns", b"nsenter"))]
    assert mentions == [], "the namespace rig is test tooling, not the product"


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return found


def test_the_library_imports_no_tooling_and_only_the_cli_imports_the_bench_code():
    imports = {
        path.relative_to(ROOT).as_posix(): _imported_modules(path)
        for path in (ROOT / "hvdtrain").rglob("*.py")
    }
    tooling = {name for name, found in imports.items() if any(m.split(".")[0] in TOOLING for m in found)}
    assert tooling == set(), "tests/ and benchmarks/ are not installed"
    bench = {name for name, found in imports.items() if "hvdtrain.measure.bench" in found}
    tune = {name for name, found in imports.items() if "hvdtrain.measure.tune" in found}
    assert bench == {"hvdtrain/cli/measure.py", "hvdtrain/measure/tune.py"}, "`hvdtrain bench` and its --tune"
    assert tune == {"hvdtrain/cli/measure.py"}, "`hvdtrain bench` is reached through the CLI only"


def test_the_metadata_a_registry_shows_and_one_version(built):
    """The version is written once (hvdtrain.__version__): the wheel's, the CLI's and the changelog's
    newest entry are it; the licence is the SPDX string with its file."""
    import email

    import hvdtrain

    _, wheel = built
    (info,) = {name.split("/")[0] for name in wheel.namelist() if name.split("/")[0].endswith(".dist-info")}
    metadata = email.message_from_bytes(wheel.read(f"{info}/METADATA"))
    assert metadata["Version"] == hvdtrain.__version__
    assert info == f"hvdtrain-{hvdtrain.__version__}.dist-info"
    assert metadata["License-Expression"] == "Apache-2.0" and metadata["License-File"] == "LICENSE"
    assert f"{info}/licenses/LICENSE" in wheel.namelist()
    classifiers = metadata.get_all("Classifier")
    assert "Topic :: System :: Distributed Computing" in classifiers and len(classifiers) >= 8
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    newest = next(line for line in (ROOT / "CHANGELOG.md").read_text().splitlines() if line.startswith("## "))
    assert newest.split()[1] == hvdtrain.__version__, newest
    from click.testing import CliRunner

    from hvdtrain.cli import main

    assert hvdtrain.__version__ in CliRunner().invoke(main, ["--version"]).output

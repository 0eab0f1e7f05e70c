"""Plugins from installed packages: tests/support/plugins/ holds two packages, installed here with
pip as a user installs any package (into a folder on PYTHONPATH). One declares a recipe, a strategy
and a launcher by entry point; hvdtrain lists, plans and runs each on 2 ranks with no edit to
hvdtrain. The other's entry points cannot be used: each is named in one line, and the rest works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import hvdtrain, summary

PLUGINS = Path(__file__).resolve().parents[1] / "support" / "plugins"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> dict[str, str]:
    """Both packages pip-installed (offline, with the venv's setuptools) into one folder, and the
    environment that puts it on every process's path, the ranks' too."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps"]
        + ["--no-build-isolation", "--target", str(target), str(PLUGINS / "demo"), str(PLUGINS / "broken")],
        check=True,
        capture_output=True,
        timeout=300,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    assert (target / "hvdtrain_demo_plugin-0.1.0.dist-info" / "entry_points.txt").is_file()
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))}


def test_list_shows_the_plugin_recipe_and_names_each_unusable_plugin_in_one_line(site):
    listed = hvdtrain("list", env=site)
    assert "plugin-digits" in listed.stdout and "digits-mlp-torch" in listed.stdout
    problems = [line for line in listed.stderr.splitlines() if line.startswith("hvdtrain: plugin ")]
    assert len(problems) == 3, listed.stderr
    assert any(
        "fails-to-import" in p and "ModuleNotFoundError" in p and "a_module_no_one" in p for p in problems
    )
    assert any("not-a-recipe" in p and "names a str, not a Recipe" in p for p in problems)
    assert any("takes-a-name" in p and "'gloo' is taken" in p for p in problems)
    assert all("hvdtrain-broken-plugin" in p and p.endswith("left out") for p in problems)
    doctor = hvdtrain("doctor", "--require", "torch,gloo", env=site)
    assert "Plugins left out:" in doctor.stdout and doctor.stdout.count("hvdtrain-broken-plugin") == 3
    assert doctor.stdout.rstrip().splitlines()[-1].startswith("verdict: OK")


def test_a_plugin_recipe_runs_by_name_on_two_ranks_as_a_built_in_one_does(site, tmp_path):
    hvdtrain("run", "plugin-digits", "--np", "2", "--launcher", "gloo", run_dir=tmp_path, env=site)
    done = summary(tmp_path)
    assert done["recipe"] == "plugin-digits" and done["world_size"] == 2
    assert done["weights_consistent"] is True and done["test_accuracy"] >= 0.9
    assert json.loads((tmp_path / "config.json").read_text())["hidden"] == 48  # the plugin's own default


def test_a_plugin_strategy_trains_with_its_communication_hook(site, tmp_path):
    hvdtrain(
        "run", "digits-mlp-torch", "--np", "2", "--strategy", "ddp-fp16-hook", run_dir=tmp_path, env=site
    )
    done = summary(tmp_path)
    assert done["strategy"] == "ddp" and done["world_size"] == 2 and done["weights_consistent"] is True
    assert done["test_accuracy"] >= 0.9
    for rank in (0, 1):
        counted = json.loads((tmp_path / f"rank{rank}-fp16-hook-calls.json").read_text())
        assert counted["buckets_compressed"] >= done["steps"]  # a bucket or more a step, on each rank


def test_a_plugin_launcher_plans_its_own_argv_and_runs(site, tmp_path):
    planned = hvdtrain(
        "run", "digits-mlp-torch", "--np", "2", "--launcher", "mpi-by-node", "--dry-run", env=site
    )
    assert "--map-by node" in planned.stdout and "--map-by slot" not in planned.stdout
    hvdtrain("run", "digits-mlp-torch", "--np", "2", "--launcher", "mpi-by-node", run_dir=tmp_path, env=site)
    done = summary(tmp_path)
    assert done["world_size"] == 2 and done["weights_consistent"] is True and done["test_accuracy"] >= 0.9

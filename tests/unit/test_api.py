"""The Python API: hvdtrain.run / hvdtrain.plan take the CLI's options as keywords and raise typed
errors for input refused before anything starts."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import hvdtrain
from hvdtrain.errors import UnknownRecipeError, UserError

PACKAGE = Path(hvdtrain.__file__).parent


def test_an_unknown_recipe_is_a_typed_error_naming_the_known_ones(tmp_path):
    with pytest.raises(UnknownRecipeError, match=r"unknown recipe 'nope'; known recipes: .*digits-mlp-torch"):
        hvdtrain.run("nope", run_dir=tmp_path / "run", console=False)
    assert not (tmp_path / "run").exists()
    assert issubclass(UnknownRecipeError, UserError) and issubclass(UserError, ValueError)


def test_an_unknown_keyword_lists_the_options():
    with pytest.raises(UserError, match=r"unknown option nprocs; options: .*min_np.*np.*num_ps"):
        hvdtrain.run("digits-mlp-torch", nprocs=2)


def test_strategy_options_are_keywords_named_like_the_cli_options():
    plan = hvdtrain.plan("digits-mlp-torch", np=2, launcher="gloo", stall_timeout=30, dry_run=True)
    assert plan.launcher == "gloo" and plan.strategy == "horovod"
    assert plan.command.argv[1:3] == ["-np", "2"]
    assert plan.command.env["HVDTRAIN_STALL_TIMEOUT"] == "30"
    assert plan.command.env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "90", "Horovod's own backstop"
    with pytest.raises(UserError, match=r"--num-ps does not apply to --strategy horovod"):
        hvdtrain.plan("digits-mlp-torch", np=2, num_ps=1, dry_run=True)


def test_overrides_as_a_mapping_or_as_set_pairs_plan_the_same_config():
    by_mapping = hvdtrain.plan("digits-mlp-torch", np=2, overrides={"epochs": 3, "lr": 0.05}, dry_run=True)
    by_pairs = hvdtrain.plan("digits-mlp-torch", np=2, overrides=["epochs=3", "lr=0.05"], dry_run=True)
    assert by_mapping.config == by_pairs.config
    assert (by_mapping.config.epochs, by_mapping.config.lr) == (3, 0.05)
    with pytest.raises(UserError, match=r"--set epoch: unknown key; valid keys: .*epochs"):
        hvdtrain.plan("digits-mlp-torch", overrides={"epoch": 3}, dry_run=True)


def test_hosts_may_be_a_list():
    plan = hvdtrain.plan("digits-mlp-torch", np=2, hosts=["localhost:2"], launcher="gloo", dry_run=True)
    assert plan.hosts[0].name == "localhost" and plan.hosts[0].slots == 2


def test_importing_hvdtrain_imports_no_framework_and_no_click():
    code = "import sys, hvdtrain; print(sorted({'click', 'torch', 'tensorflow'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_only_the_cli_imports_click():
    importers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(name == "click" or name.startswith("click.") for name in names):
                importers.append(path.relative_to(PACKAGE).as_posix())
    assert importers and all(importer.startswith("cli/") for importer in importers), importers


def test_no_submodule_shadows_the_run_function():
    for module in pkgutil.walk_packages([str(PACKAGE)], "hvdtrain."):
        assert module.name.split(".")[1] != "run", module.name
        if module.name.count(".") == 1 and not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    assert callable(hvdtrain.run) and callable(hvdtrain.plan)
    assert hvdtrain.RunResult.__name__ == "RunResult"


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"np": "2"}, r"np must be an int, got '2'"),
        ({"np": 2.0}, r"np must be an int, got 2.0"),
        ({"np": True}, r"np must be an int, got True"),
        ({"script_args": "--lr"}, r"script_args must be a list of strings"),
        ({"env": "PATH"}, r"env must be a list of strings"),
        ({"hosts": [("a", 2)]}, r"hosts must be 'HOST:SLOTS,...' or a list"),
        ({"overrides": "epochs=3"}, r"overrides must be a mapping of config fields"),
        ({"horovod_autotune": "false"}, r"horovod_autotune must be True or False"),
        ({"stall_timeout": "5"}, r"stall_timeout must be an int"),
        ({"launcher": "nope"}, r"launcher must be one of auto, elastic, gloo, mpi, ray, srun, got 'nope'"),
    ],
)
def test_a_keyword_of_the_wrong_kind_is_refused_before_anything_is_read(keywords, message):
    with pytest.raises(UserError, match=message):
        hvdtrain.plan("digits-mlp-torch", **keywords)


def test_run_is_never_a_dry_run(tmp_path):
    with pytest.raises(UserError, match=r"hvdtrain.plan\(...\) is the dry run"):
        hvdtrain.run("digits-mlp-torch", run_dir=tmp_path / "run", dry_run=True)
    assert not (tmp_path / "run").exists()

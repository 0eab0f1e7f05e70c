"""A user's own recipe, from a file or a module: planned like a built-in one, its ranks load it the same
way (`hvdtrain.worker --recipe SPEC`), and a file without RECIPE still runs as a script."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_plan import PYTHON, facts

from hvdtrain import registry, worker
from hvdtrain.job.plan import plan_run
from hvdtrain.job.request import RunRequest
from hvdtrain.job.resume import ResumeFacts

RECIPE_FILE = '''
from dataclasses import dataclass

from hvdtrain.config import TrainConfig, bounded
from hvdtrain.registry import Recipe


@dataclass(kw_only=True)
class Config(TrainConfig):
    epochs: int = 7
    width: int = bounded(16, minimum=1)
    """Units of the hidden layer."""


RECIPE = Recipe(
    name="my-mlp",
    framework="torch",
    dataset="digits",
    description="mine",
    config=Config,
    build=lambda config: None,
    variants={"debug": lambda config: Config(epochs=1)},
)
'''


@pytest.fixture
def recipe_file(tmp_path) -> Path:
    path = tmp_path / "my_recipe.py"
    path.write_text(RECIPE_FILE)
    return path


def plan_for(path: Path, text: str | None = None, **request):
    """The plan of `hvdtrain run my_recipe.py ...` run in the file's directory, on a machine with two
    GPUs (so that --strategy dp plans two devices as the others plan two ranks)."""
    text = path.read_text() if text is None else text
    return plan_run(RunRequest(path.name, **request), facts(cwd=path.parent, script_text=text, gpus=2))


def program_of(plan) -> list[str]:
    argv = plan.command.argv
    return argv[argv.index(PYTHON) :]


@pytest.mark.parametrize(
    ("text", "defines"),
    [
        ("RECIPE = Recipe(name='x')\n", True),
        ("RECIPE: Recipe = make()\n", True),
        ("from mypackage.recipes import RECIPE\n", True),
        ("from mypackage import MINE as RECIPE\n", True),
        ("RECIPE = Recipe(\n", True),  # a typo: still a recipe file, so loading it names the error
        ("import horovod.torch as hvd\nhvd.init()\n", False),
        ("def main():\n    RECIPE = 1\n", False),
        ("try:\n    import torch\nexcept ImportError:\n    pass\nelse:\n    RECIPE = make()\n", True),
        ("if True:\n    NAME, RECIPE = 'x', make()\n", True),
        ("# RECIPE = later\nprint('RECIPE = 1')\n", False),
    ],
)
def test_a_file_is_a_recipe_when_it_assigns_recipe_at_top_level(text, defines):
    assert registry.defines_recipe(text) is defines


@pytest.mark.parametrize("strategy", ["horovod", "ddp", "dp"])
def test_a_recipe_file_plans_like_a_builtin_and_its_ranks_get_the_file(recipe_file, strategy):
    plan = plan_for(recipe_file, np=2, strategy=strategy, overrides=("width=32",))
    assert (plan.recipe, plan.recipe_source, plan.framework) == ("my-mlp", str(recipe_file), "torch")
    assert plan.run_dir == Path("runs/my-mlp-20261130-120000")
    assert plan.config.width == 32 and plan.config.epochs == 7
    argv = plan.command.argv
    recipe_at = argv.index("--recipe")
    assert argv[recipe_at - 1 : recipe_at + 7] == [
        "hvdtrain.worker",
        "--recipe",
        str(recipe_file),
        "--run-dir",
        str(recipe_file.parent / plan.run_dir),
        "--strategy",
        strategy,
        "--config",
    ]
    assert json.loads(argv[recipe_at + 7])["width"] == 32


def test_a_recipe_files_variant_and_the_module_form(recipe_file, monkeypatch):
    assert plan_for(recipe_file, variant="debug").config.epochs == 1
    monkeypatch.chdir(recipe_file.parent)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "my_recipe", raising=False)
    plan = plan_run(RunRequest("module:my_recipe", np=2), facts())
    assert (plan.recipe, plan.recipe_source) == ("my-mlp", "module:my_recipe")
    assert program_of(plan)[3:5] == ["--recipe", "module:my_recipe"]
    sys.modules.pop("my_recipe", None)


def test_an_image_mounts_the_recipe_files_directory(recipe_file):
    plan = plan_run(
        RunRequest(str(recipe_file), np=2, image="hvdtrain:cpu", strategy_options={"launcher": "gloo"}),
        facts(container_engine="docker", script_text=RECIPE_FILE),
    )
    argv = plan.command.argv
    assert f"{recipe_file.parent}:{recipe_file.parent}" in argv[: argv.index("hvdtrain:cpu")]
    assert argv[argv.index("--recipe") + 1] == str(recipe_file)


def test_a_file_without_recipe_still_runs_as_a_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import horovod.torch as hvd\nhvd.init()  # RECIPE = none here\n")
    plan = plan_for(script, np=2, script_args=("--epochs", "1"))
    assert plan.config is None and plan.recipe is None and plan.recipe_source is None
    assert program_of(plan)[3:] == ["--script", "train.py", "--", "--epochs", "1"]
    with pytest.raises(ValueError, match=r"apply to recipes, not to scripts \(train.py defines no RECIPE\)"):
        plan_for(script, overrides=("epochs=1",))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "raise RuntimeError('no GPU here')\nRECIPE = None\n",
            "recipe file {path} failed to import: RuntimeError: no GPU here",
        ),
        ("RECIPE = Recipe(\n", "{path}:1: '(' was never closed"),  # compiled before it is imported
        ("import sys\nsys.exit(3)\nRECIPE = 1\n", "recipe file {path} failed to import: SystemExit: 3"),
        ("RECIPE = 3\n", "{path} has RECIPE of type int; a recipe defines RECIPE = hvdtrain.registry.Recipe"),
    ],
)
def test_a_recipe_file_that_fails_to_load_is_one_line_naming_it(tmp_path, text, message):
    path = tmp_path / "broken.py"
    path.write_text(text)
    with pytest.raises(ValueError, match=message.format(path=path).replace("(", r"\(")) as raised:
        plan_for(path, np=2)
    assert "\n" not in str(raised.value)
    if "failed to import" in message:
        loaded = [getattr(module, "__file__", None) for module in list(sys.modules.values())]
        assert str(path) not in loaded, "a failed import is not kept"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("import horovod.torch as hvd\nx = 1\ndef f(:\n    pass\n", "{path}:3: invalid syntax"),
        ("if True:\nprint(1)\n", "{path}:2: expected an indented block after 'if' statement on line 1"),
        ("RECIPE = Recipe(\n", "{path}:1: '(' was never closed"),
        ("x = 1\x00\n", "{path}: source code string cannot contain null bytes"),
        ("pattern = '\\d+'\nRECIPE = None\n", None),  # a warning of the script's own, not refused
    ],
)
def test_a_file_target_is_compiled_before_any_rank_starts_and_a_syntax_error_is_one_line(
    tmp_path, text, problem, recwarn
):
    path = tmp_path / "train.py"
    assert registry.syntax_problem(text, str(path)) == (problem and problem.format(path=path))
    assert not recwarn.list, "compiling shows none of the file's warnings"
    if problem is None:
        return
    path.write_text(text)
    with pytest.raises(ValueError) as refused:
        plan_for(path, np=2)
    assert str(refused.value) == problem.format(path=path)


def test_a_recipe_module_with_a_syntax_error_is_one_line_naming_its_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "typo_recipe.py").write_text("from hvdtrain.registry import Recipe\nRECIPE = Recipe(\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(ValueError) as refused:
        registry.load("module:typo_recipe")
    path = tmp_path / "typo_recipe.py"
    assert str(refused.value) == f"recipe module typo_recipe failed to import: {path}:2: '(' was never closed"


def test_set_on_a_recipe_files_own_fields_and_an_unknown_one_lists_them(recipe_file):
    assert plan_for(recipe_file, overrides=("width=8", "lr=0.2")).config.width == 8
    with pytest.raises(ValueError, match="width must be at least 1, got 0"):
        plan_for(recipe_file, overrides=("width=0",))
    with pytest.raises(
        ValueError, match=r"--set widht: unknown key; valid keys: .*, warmup_epochs, width, zero_stage$"
    ):
        plan_for(recipe_file, overrides=("widht=8",))


def resumable_of(source: str | None, recipe: str = "my-mlp") -> ResumeFacts:
    return ResumeFacts(
        Path("runs/my-mlp-1"),
        {"epochs": 2, "width": 16},
        recipe,
        {"checkpoint.pt": "ok"},
        recipe_source=source,
    )


def test_resume_checks_and_uses_the_recipe_the_run_was_made_with(recipe_file, tmp_path):
    made_with = resumable_of(str(recipe_file))
    resumed = plan_run(
        RunRequest(recipe_file.name, resume=True, overrides=("epochs=4",)),
        facts(cwd=tmp_path, script_text=RECIPE_FILE, resume=made_with),
    )
    assert resumed.config.epochs == 4 and program_of(resumed)[-1] == "--resume"
    by_name = plan_run(RunRequest("my-mlp", resume=True, overrides=("epochs=4",)), facts(resume=made_with))
    assert program_of(by_name)[3:5] == ["--recipe", str(recipe_file)]
    assert by_name.recipe_source == str(recipe_file)
    elsewhere = tmp_path / "copy" / "my_recipe.py"
    elsewhere.parent.mkdir()
    elsewhere.write_text(RECIPE_FILE)
    with pytest.raises(ValueError, match=f"is a run of {recipe_file}, not of {elsewhere}"):
        plan_run(
            RunRequest(str(elsewhere), resume=True, overrides=("epochs=4",)),
            facts(script_text=RECIPE_FILE, resume=made_with),
        )
    with pytest.raises(ValueError, match=f"is a run of the built-in my-mlp, not of {recipe_file}"):
        plan_run(
            RunRequest(recipe_file.name, resume=True),
            facts(cwd=tmp_path, script_text=RECIPE_FILE, resume=resumable_of(None)),
        )


def test_a_rank_that_cannot_load_its_recipe_says_so_in_one_line(tmp_path, capsys):
    missing = tmp_path / "gone.py"
    assert worker.main(["--recipe", str(missing), "--run-dir", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err == f"hvdtrain: error: recipe file {missing} not found\n"

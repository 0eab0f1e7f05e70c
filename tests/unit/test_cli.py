"""Bad input is one line and exit 2; --dry-run prints the command. No ranks start here."""

from __future__ import annotations

import sys

import pytest
from click.testing import CliRunner

from hvdtrain.cli import main


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "nope"], "unknown recipe 'nope'; known recipes: digits-mlp-tf"),
        (["run", "digits-mlp-torch", "--np", "0"], "--np must be at least 1, got 0"),
        (["run", "digits-mlp-torch", "--np", "-3"], "--np must be at least 1, got -3"),
        (["run", "digits-mlp-torch", "--set", "lr"], "expected key=value"),
        (["run", "digits-mlp-torch", "--set", "lrr=1"], "--set lrr: unknown key; valid keys:"),
        (["run", "digits-mlp-torch", "--set", "epochs=x"], "expected int"),
        (["run", "missing/train.py"], "script missing/train.py not found"),
        (["run", "digits-mlp-torch", "--variant", "huge"], "has no variant 'huge'"),
        (["run", "digits-mlp-torch", "--hosts", "a:0"], "bad host 'a:0'"),
        (["run", "digits-mlp-torch", "--np", "5", "--hosts", "a:2,b:2"], "exceeds the 4 slots"),
        (["run", "digits-mlp-torch", "--stall-timeout", "0"], "--stall-timeout must be at least 1"),
        (["run", "digits-mlp-torch", "--", "--x"], "arguments after -- are for scripts"),
        (["doctor", "--require", "mxnet"], "unknown part(s) mxnet"),
        (
            ["bench", "digits-mlp-torch", "--tune", "--strategies", "horovod,zero"],
            "--tune times the horovod and ddp strategies only; not horovod,zero",
        ),
        (["run", "digits-mlp-torch", "--strategy", "ps"], "strategies for torch: horovod, ddp, dp"),
        (["run", "digits-mlp-tf", "--strategy", "ddp"], "strategies for tensorflow: horovod, ps"),
        (["run", "digits-mlp-tf", "--strategy", "spark"], "unknown strategy 'spark'"),
        (
            ["run", "digits-mlp-tf", "--strategy", "ps", "--num-ps", "0"],
            "at least 1 worker and 1 parameter server",
        ),
        (["run", "digits-mlp-torch", "--threads-per-rank", "0"], "--threads-per-rank must be at least 1"),
        (
            ["run", "digits-mlp-torch", "--strategy", "dp", "--set", "reduce_op=adasum"],
            "reduce_op=adasum needs --strategy horovod",
        ),
        (["run", "digits-mlp-torch", "--set", "hidden=0"], "hidden must be at least 1, got 0"),
        (["run", "digits-mlp-torch", "--set", "lr=nan"], "lr must be a finite number"),
        (["run", "digits-mlp-torch", "--strategy", "ddp", "--launcher", "mpi"], "--launcher does not apply"),
        (
            ["run", "digits-mlp-torch", "--strategy", "ddp", "--stall-timeout", "9"],
            "--stall-timeout does not",
        ),
        (
            ["run", "digits-mlp-torch", "--horovod-autotune", "--strategy", "dp"],
            "--horovod-autotune does not",
        ),
        (["run", "digits-mlp-torch", "--num-ps", "2"], "--num-ps does not apply to --strategy horovod"),
        (["run", "digits-mlp-tf", "--strategy", "ps", "--set", "fp16_allreduce=1"], "ps has no allreduce"),
        (
            ["run", "digits-mlp-tf", "--strategy", "ps", "--set", "precision=fp16"],
            "precision=fp16 needs --strategy horovod",
        ),
        (["run", "digits-mlp-torch", "--set", "clip_grad_norm=0"], "clip_grad_norm must be greater than 0"),
        (["run", "digits-mlp-torch", "--set", "lr_schedule=step"], "lr_schedule=step needs lr_milestones"),
        (["bench", "digits-mlp-torch", "--np", "1,x"], "--np: expected comma-separated integers"),
        (["bench", "digits-mlp-torch", "--launchers", "ssh"], "--launchers: unknown ['ssh']"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("hvdtrain: error:")


def test_unknown_command_prints_usage_exit_2():
    result = invoke("bogus")
    assert result.exit_code == 2 and "Usage:" in result.output and "No such command 'bogus'" in result.output


def test_dry_run_prints_the_launch_command(tmp_path):
    result = invoke(
        "run",
        "digits-mlp-torch",
        "--np",
        "2",
        "--launcher",
        "mpi",
        "--run-dir",
        str(tmp_path / "r"),
        "--set",
        "epochs=1",
        "--dry-run",
    )
    assert result.exit_code == 0, result.output
    line = result.output.strip()
    assert (
        "mpirun" in line
        and "-np 2" in line
        and f"--recipe digits-mlp-torch --run-dir {tmp_path / 'r'}" in line
    )
    assert line.split()[-4:-2] == ["--strategy", "horovod"] and line.split()[-2] == "--config"
    assert '"epochs":1' in line.split()[-1], "the config travels in the command"
    assert not (tmp_path / "r").exists(), "a dry run writes nothing"


def test_dry_run_of_a_script_keeps_its_arguments(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import horovod.torch\n")
    result = invoke("run", str(script), "--np", "2", "--dry-run", "--", "--epochs", "1", "--tag", "a b")
    assert result.exit_code == 0
    assert result.output.strip().endswith(f"-m hvdtrain.worker --script {script} -- --epochs 1 --tag 'a b'")
    assert sys.executable in result.output


def test_run_help_lists_strategies_and_launchers_from_their_registries():
    result = invoke("run", "--help")
    text = " ".join(result.output.split())
    assert "horovod: batch-synchronous" in text and "ps: TensorFlow ParameterServerStrategy" in text
    assert "gloo: horovodrun with Gloo" in text and "mpi: mpirun (Open MPI)" in text
    assert "hvdtrain strategies" not in text


def test_a_broken_recipe_module_is_named_and_hides_no_other(tmp_path, monkeypatch):
    from hvdtrain import recipes

    (tmp_path / "broken_recipe.py").write_text("import no_such_module_here\n")
    monkeypatch.setattr(recipes, "__path__", [*recipes.__path__, str(tmp_path)])
    result = CliRunner().invoke(main, ["list"])
    assert result.exit_code == 0
    assert "digits-mlp-torch" in result.output
    assert "hvdtrain.recipes.broken_recipe failed to import: ModuleNotFoundError" in result.output
    missing = invoke("run", "nope")
    assert "hvdtrain.recipes.broken_recipe failed to import" in missing.output and missing.exit_code == 2


def test_list_shows_every_recipe_with_framework():
    result = invoke("list")
    assert result.exit_code == 0
    assert "digits-mlp-torch" in result.output and "tensorflow" in result.output

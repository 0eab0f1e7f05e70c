"""Bad input is one line and exit 2; --dry-run prints the command. No ranks start here."""

from __future__ import annotations

import os
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


def test_horovodruns_short_flags_and_hvdtrain_variables_give_the_same_command(tmp_path):
    """-np, -H, -p and -i spell --np, --hosts, --ssh-port and --ssh-identity-file; HVDTRAIN_RUN_X sets
    `hvdtrain run --x`, and a flag on the command line wins over the variable."""
    common = ["run", "digits-mlp-torch", "--run-dir", str(tmp_path / "r"), "--launcher", "mpi", "--dry-run"]
    long = invoke(
        *common,
        "--np",
        "3",
        "--hosts",
        "192.0.2.1:2,192.0.2.2:2",
        "--ssh-port",
        "2222",
        "--ssh-identity-file",
        "/k",
    )
    short = invoke(*common, "-np", "3", "-H", "192.0.2.1:2,192.0.2.2:2", "-p", "2222", "-i", "/k")
    assert long.exit_code == 0 and short.output == long.output, (long.output, short.output)
    assert "-np 3" in long.output and "192.0.2.1:2,192.0.2.2:2" in long.output and "2222" in long.output
    environ = {
        "HVDTRAIN_RUN_NP": "3",
        "HVDTRAIN_RUN_HOSTS": "192.0.2.1:2,192.0.2.2:2",
        "HVDTRAIN_RUN_SSH_PORT": "2222",
    }
    from_environ = CliRunner(env=environ).invoke(main, [*common, "-i", "/k"])
    assert from_environ.exit_code == 0 and from_environ.output == long.output, from_environ.output
    overridden = CliRunner(env={"HVDTRAIN_RUN_NP": "3"}).invoke(main, [*common, "-np", "2"])
    assert "-np 2" in overridden.output, overridden.output


def test_verbose_after_run_is_verbose_too(monkeypatch):
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    import hvdtrain

    seen = {}
    monkeypatch.setattr(hvdtrain, "plan", lambda target, **arguments: seen.update(arguments) or sys.exit(0))
    invoke("run", "digits-mlp-torch", "--verbose", "--dry-run")
    assert seen["verbose"] is True and "TF_CPP_MIN_LOG_LEVEL" not in os.environ
    invoke("run", "digits-mlp-torch", "--dry-run")
    assert seen["verbose"] is False and os.environ["TF_CPP_MIN_LOG_LEVEL"] == "2"


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


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        ("hvdtrain run digits-mlp-t", ["digits-mlp-tf", "digits-mlp-torch"]),
        ("hvdtrain run digits-mlp-torch --strategy ", ["ddp", "dp", "fsdp", "horovod", "ps", "zero"]),
        ("hvdtrain bench gpt", ["gpt-torch"]),
    ],
)
def test_the_shell_completes_recipe_and_strategy_names(words, expected):
    environ = {
        "_HVDTRAIN_COMPLETE": "bash_complete",
        "COMP_WORDS": words,
        "COMP_CWORD": str(len(words.split()) - (not words.endswith(" "))),
    }
    result = CliRunner().invoke(main, [], env=environ, prog_name="hvdtrain")
    assert [line.split(",", 1)[1] for line in result.output.splitlines()] == expected, result.output


def test_print_config_run_again_with_config_is_the_same_run_and_the_command_line_wins(tmp_path):
    run_dir = str(tmp_path / "r")
    given = ["digits-mlp-torch", "-np", "2", "--set", "epochs=3", "--set", "lr=0.07", "-x", "A=1"]
    printed = invoke("run", *given, "--run-dir", run_dir, "--print-config")
    assert printed.exit_code == 0, printed.output
    assert 'target = "digits-mlp-torch"\n' in printed.output and "\nnp = 2\n" in printed.output
    assert "\n[set]\nepochs = 3\n" in printed.output and "\nlr = 0.07\n" in printed.output
    assert "hidden = 128" in printed.output  # the recipe's whole config, defaults too
    path = tmp_path / "run.toml"
    path.write_text(printed.output)
    assert f'run_dir = "{run_dir}"' in printed.output
    assert invoke("run", "--config", str(path), "--print-config").output == printed.output
    from_file = invoke("run", "--config", str(path), "--dry-run")
    from_line = invoke("run", *given, "--run-dir", run_dir, "--dry-run")
    assert from_file.exit_code == 0 and from_file.output == from_line.output, from_file.output
    over = invoke("run", "--config", str(path), "-np", "3", "--set", "epochs=5", "--dry-run").output
    assert "-np 3" in over and '"epochs":5' in over and '"lr":0.07' in over, over


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("np = 2\nbogus = 1\n", "unknown key 'bogus'"),
        ("np = [\n", "not a TOML file"),
        ("set = 3\n", "set is a table of KEY = VALUE"),
        ("[launcher]\nx = 1\n", "launcher is a value, not a table"),
        ('target = "digits-mlp-torch"\n[set]\nlrr = 1\n', "--set lrr: unknown key"),
    ],
)
def test_a_bad_config_file_is_one_line_naming_it(tmp_path, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    result = invoke("run", "--config", str(path), "--dry-run")
    assert result.exit_code == 2 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    missing = invoke("run", "--config", str(tmp_path / "none.toml"), "digits-mlp-torch")
    assert missing.exit_code == 2 and "none.toml: No such file or directory" in missing.output


def test_a_module_runs_as_python_m_runs_it(tmp_path, monkeypatch):
    package = tmp_path / "mine"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text("import horovod.torch\n")
    (package / "__main__.py").write_text("import horovod.torch\n")
    monkeypatch.chdir(tmp_path)
    result = invoke("run", "-m", "mine.train", "--np", "2", "--dry-run", "--", "--epochs", "1")
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith("-m hvdtrain.worker --module mine.train -- --epochs 1")
    assert "/runs/train-" in result.output
    assert invoke("run", "--module", "mine", "--np", "2", "--dry-run").exit_code == 0
    (package / "broken.py").write_text("def f(:\n")
    broken = invoke("run", "-m", "mine.broken", "--dry-run")
    assert broken.exit_code == 2 and f"{package / 'broken.py'}:1:" in broken.output, broken.output
    for name in ("mine.nope", "nope.train", "not a name"):
        missing = invoke("run", "-m", name, "--dry-run")
        assert missing.exit_code == 2 and f"--module: no module named {name} here" in missing.output


def test_print_config_keeps_none_and_leaves_the_variants_fields_to_a_variant_given_over_it(tmp_path):
    path = tmp_path / "run.toml"
    printed = invoke("run", "gpt-torch", "--set", "clip_grad_norm=none", "--print-config")
    assert printed.exit_code == 0 and '\nclip_grad_norm = "none"\n' in printed.output, printed.output
    path.write_text(printed.output)
    assert '"clip_grad_norm":null' in invoke("run", "--config", str(path), "--dry-run").output
    path.write_text(invoke("run", "digits-mlp-torch", "--set", "lr=0.5", "--print-config").output)
    assert "\n# epochs = " in path.read_text() and "\nlr = 0.5\n" in path.read_text()
    debug = invoke("run", "--config", str(path), "--variant", "debug", "--dry-run").output
    assert '"epochs":8' in debug and '"lr":0.5' in debug, debug


def test_a_list_option_in_a_config_file_takes_a_list(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('target = "digits-mlp-torch"\nenv = "NCCL_DEBUG"\n')
    result = invoke("run", "--config", str(path), "--dry-run")
    assert result.exit_code == 2 and 'env takes a list, e.g. ["A=1"]' in result.output, result.output
    path.write_text('target = "digits-mlp-torch"\nnp = [2]\n')
    assert "np takes one value, not a list" in invoke("run", "--config", str(path), "--dry-run").output

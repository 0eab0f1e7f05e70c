"""Bad input, as a user or an operator meets it: one line, the right exit code, no rank started,
and nothing the user had changed. (tests/unit/test_cli.py has the simpler rows.)"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from hvdtrain.cli import main
from hvdtrain.recipes import digits_mlp_torch


def _run_dir(root: Path, name: str, recipe: str = "digits-mlp-torch", finished: bool = True) -> Path:
    """A run directory as hvdtrain leaves it (the checkpoint only needs to be a sound archive here)."""
    run_dir = root / name
    run_dir.mkdir()
    config = dataclasses.asdict(digits_mlp_torch.Config(epochs=3))
    (run_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (run_dir / "run.json").write_text(json.dumps({"recipe": recipe}) + "\n")
    with zipfile.ZipFile(
        run_dir / ("checkpoint.pt" if recipe.endswith("torch") else "checkpoint.keras"), "w"
    ) as z:
        z.writestr("data.pkl", b"weights")
    if finished:
        (run_dir / "summary.json").write_text(json.dumps({"epochs": 3, "test_accuracy": 0.97}) + "\n")
    return run_dir


TYPO = "import horovod.torch as hvd\n\ndef main(:\n    hvd.init()\n"
"""A Horovod script whose ranks would each fail on line 3."""


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-input")
    (root / "a-file").write_text("not a directory\n")
    (root / "empty").mkdir()
    (root / "hostfile").write_text("node1 slots=2\nthis is not a host line\n")
    (root / "typo.py").write_text(TYPO)
    (root / "typo_recipe.py").write_text("from hvdtrain.registry import Recipe\n\nRECIPE = Recipe(\n")
    _run_dir(root, "finished")
    _run_dir(root, "tf-run", recipe="digits-mlp-tf")
    corrupt = _run_dir(root, "corrupt", finished=False)
    (corrupt / "checkpoint.pt").write_bytes(b"torn write")
    read_only = root / "read-only"
    read_only.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(read_only)], check=True)
    yield root
    subprocess.run(["umount", str(read_only)], check=True)


RUN = ["run", "digits-mlp-torch"]
ROWS = [
    # (arguments with {root} for the fixture's folder, exit code, the one line's text)
    ([*RUN, "--resume", "--run-dir", "{root}/empty"], 2, "empty holds no run (no readable config.json)"),
    ([*RUN, "--resume", "--run-dir", "{root}/missing"], 2, "missing holds no run"),
    (
        [*RUN, "--resume", "--run-dir", "{root}/tf-run"],
        2,
        "is a run of digits-mlp-tf, not of digits-mlp-torch",
    ),
    (
        [*RUN, "--resume", "--run-dir", "{root}/corrupt"],
        2,
        "checkpoint.pt is corrupt (not a readable checkpoint)",
    ),
    (
        [*RUN, "--resume", "--run-dir", "{root}/finished", "--set", "hidden=256"],
        2,
        "hidden cannot change on resume",
    ),
    (
        [*RUN, "--resume", "--run-dir", "{root}/finished", "--set", "momentum=0.5"],
        2,
        "momentum cannot change on resume",
    ),
    (
        [*RUN, "--resume", "--run-dir", "{root}/finished", "--variant", "debug"],
        2,
        "--variant applies to a new run",
    ),
    ([*RUN, "--resume", "--run-dir", "{root}/finished"], 0, "already finished its 3 epochs; nothing changed"),
    ([*RUN, "--resume", "--run-dir", "{root}/finished", "--set", "epochs=2"], 0, "already finished its 3"),
    ([*RUN, "--run-dir", "{root}/a-file"], 2, "a-file is a file, not a directory"),
    ([*RUN, "--run-dir", "{root}/a-file/run"], 2, "a-file is a file, not a directory"),
    ([*RUN, "--run-dir", "{root}/read-only/run"], 2, "read-only is not writable"),
    ([*RUN, "--hostfile", "{root}/hostfile"], 2, "hostfile line 2 'this is not a host line'"),
    ([*RUN, "--hostfile", "{root}/nope"], 2, "--hostfile: No such file or directory"),
    ([*RUN, "--hosts", "localhost:1,localhost:1"], 2, "host localhost is listed twice"),
    ([*RUN, "--hosts", "a b"], 2, "bad host 'a b'"),
    ([*RUN, "--np", "1000"], 2, "--np 1000 puts 1000 ranks on this host's"),
    ([*RUN, "--env", "HVDTRAIN_NOT_SET_ANYWHERE"], 2, "--env HVDTRAIN_NOT_SET_ANYWHERE: not set"),
    ([*RUN, "--set", "lr=inf"], 2, "lr must be a finite number, got inf"),
    ([*RUN, "--set", "lr=-0.1"], 2, "lr must be greater than 0"),
    ([*RUN, "--set", "momentum=-1"], 2, "momentum must be at least 0"),
    ([*RUN, "--set", "batch_size=0"], 2, "batch_size must be at least 1"),
    ([*RUN, "--set", "warmup_epochs=-1"], 2, "warmup_epochs must be at least 0"),
    ([*RUN, "--set", "reduce_op=sum"], 2, "choose one of average, adasum"),
    (
        [*RUN, "--set", "monitor=test_perplexity"],
        2,
        "monitor=test_perplexity: recipe digits-mlp-torch reports loss, test_accuracy; monitor one of those",
    ),
    (["run", "synthetic-torch", "--set", "monitor=test_accuracy"], 2, "synthetic-torch reports loss;"),
    ([*RUN, "--set", "early_stopping_patience=3"], 2, "early_stopping_patience needs monitor"),
    ([*RUN, "--set", "early_stopping_patience=-1"], 2, "early_stopping_patience must be at least 0"),
    ([*RUN, "--set", "mode=up"], 2, "choose one of auto, min, max"),
    (["run", "gpt-torch", "--set", "heads=3"], 2, "width (128) must be a multiple of heads (3)"),
    (["run", "resnet-torch", "--set", "arch=resnet101"], 2, "choose one of resnet18, resnet34, resnet50"),
    (["run", "resnet-torch", "--set", "data=folder"], 2, "pass --set data_dir=DIR"),
    ([*RUN, "--mlflow", "htp://x:5000"], 2, "--mlflow 'htp://x:5000': unknown scheme htp"),
    ([*RUN, "--mlflow", "http://"], 2, "--mlflow 'http://': no host"),
    ([*RUN, "--mlflow", "http://h:port"], 2, "Port could not be cast to integer"),
    ([*RUN, "--mlflow", "sqlite://rel.db"], 2, "give sqlite:///PATH (relative) or sqlite:////ABSOLUTE/PATH"),
    ([*RUN, "--mlflow", "http://[::1"], 2, "--mlflow 'http://[::1': Invalid IPv6 URL"),
    ([*RUN, "--set", "checkpoint_every_steps=-5"], 2, "checkpoint_every_steps must be at least 0"),
    (
        [*RUN, "--set", "checkpoint=false", "--set", "checkpoint_every_steps=5"],
        2,
        "checkpoint_every_steps needs checkpoint=true",
    ),
    (
        ["run", "digits-mlp-tf", "--strategy", "ps", "--set", "checkpoint_every_steps=5"],
        2,
        "checkpoint_every_steps needs --strategy horovod (ps checkpoints at epochs' ends)",
    ),
    (["run", "resnet-tf", "--set", "sync_batch_norm=true"], 2, "sync_batch_norm: torch recipes only"),
    (["run", "digits-mlp-tf", "--set", "compile=true"], 2, "compile: torch recipes only"),
    (
        ["run", "resnet-torch", "--strategy", "dp", "--set", "sync_batch_norm=true"],
        2,
        "sync_batch_norm needs --strategy horovod or ddp",
    ),
    ([*RUN, "--set", "reduce_op=adasum", "--launcher", "gloo"], 2, "reduce_op=adasum needs --launcher mpi"),
    (["k8s", "digits-mlp-torch", "--np", "2", "--image", "i", "--name", "Bad_Name"], 2, "a Kubernetes name"),
    (
        ["k8s", "digits-mlp-torch", "--np", "2", "--image", "i", "--memory-per-worker", "4 GB"],
        2,
        "a quantity",
    ),
    (["k8s", "digits-mlp-torch", "--np", "2", "--image", " "], 2, "expected an image reference"),
    (
        ["k8s", "digits-mlp-torch", "--np", "2", "--image", "registry/hvdtrain:cpu!"],
        2,
        "--image 'registry/hvdtrain:cpu!': expected an image reference such as registry/hvdtrain:cpu; "
        "tag 'cpu!' is not 1 to 128 letters",
    ),
    ([*RUN, "--image", "bad image name!!"], 2, "name component 'bad image name!!' is not lowercase"),
    (
        [*RUN, "--launcher", "ray", "--ray-address", "nope:xx"],
        2,
        "--ray-address 'nope:xx': port 'xx' is not a port number (1-65535)",
    ),
    ([*RUN, "--launcher", "ray", "--ray-address", "head"], 2, "give the cluster's HOST:PORT (no port)"),
    (
        [*RUN, "--launcher", "ray", "--ray-address", "nope.invalid:6379"],
        2,
        "--ray-address 'nope.invalid:6379': host 'nope.invalid' does not resolve to an address",
    ),
    (["run", "{root}/typo.py"], 2, "typo.py:3: invalid syntax"),
    (["run", "{root}/typo_recipe.py"], 2, "typo_recipe.py:3: '(' was never closed"),
    ([*RUN, "--strategy", "dp", "--np", "1000"], 2, "--np 1000: --strategy dp is one process over"),
    (["runs", "--dir", "{root}/missing"], 2, "missing: no such folder"),
]


@pytest.mark.parametrize(("args", "code", "text"), ROWS, ids=[" ".join(row[0][1:]) for row in ROWS])
def test_bad_input_is_one_line_with_the_right_exit_code(places, args, code, text):
    before = {path: path.read_bytes() for path in places.rglob("*") if path.is_file()}
    result = CliRunner().invoke(main, [arg.format(root=places) for arg in args])
    lines = result.output.strip().splitlines()
    assert result.exit_code == code, result.output
    assert len(lines) == 1 and text in lines[0], result.output
    assert lines[0].startswith("hvdtrain: error:" if code == 2 else "hvdtrain: ")
    after = {path: path.read_bytes() for path in places.rglob("*") if path.is_file()}
    assert after == before, "a refused run changed files"


def test_launcher_missing_from_path_is_one_line(tmp_path):
    result = CliRunner(env={"PATH": str(tmp_path)}).invoke(main, [*RUN, "--launcher", "mpi", "--dry-run"])
    assert result.exit_code == 2
    assert result.output.strip() == (
        "hvdtrain: error: --launcher mpi needs mpirun on PATH; install Open MPI or use --launcher gloo"
    )


def test_a_bad_ddp_bucket_size_in_the_environment_is_one_line():
    result = CliRunner().invoke(
        main, [*RUN, "--strategy", "ddp", "--dry-run"], env={"HVDTRAIN_DDP_BUCKET_MB": "25MB"}
    )
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        "hvdtrain: error: HVDTRAIN_DDP_BUCKET_MB is DDP's gradient bucket size in MB, a positive number; "
        "got '25MB'"
    ]


ROOT = Path(__file__).resolve().parents[2]
REFUSED = [
    (
        ["run", "digits-mlp-torch", "--launcher", "ray", "--ray-address", "nope:xx"],
        "--ray-address 'nope:xx': port 'xx' is not a port number (1-65535)",
    ),
    (
        ["run", "digits-mlp-torch", "--image", "bad image name!!"],
        "--image 'bad image name!!': expected an image reference such as registry/hvdtrain:cpu; name "
        "component 'bad image name!!' is not lowercase letters and digits joined by '.', '_', '__' or '-'",
    ),
    (["run", "{tmp}/typo.py"], "{tmp}/typo.py:3: invalid syntax"),
    (
        ["run", "digits-mlp-torch", "--strategy", "dp", "--np", "2"],
        "--np 2: --strategy dp is one process over this host's GPUs, and none is visible; give --np 1 "
        "(the CPU is one device), or a strategy that runs 2 processes (horovod, ddp)",
    ),
    (["runs", "--dir", "/does/not/exist"], "--dir /does/not/exist: no such folder"),
]


@pytest.mark.parametrize(("args", "line"), REFUSED, ids=[" ".join(row[0][:3]) for row in REFUSED])
def test_the_command_refuses_with_one_line_on_stderr_and_exit_2_before_any_rank_starts(tmp_path, args, line):
    """The real process, on a machine whose GPUs are hidden: no traceback, nothing on stdout."""
    (tmp_path / "typo.py").write_text(TYPO)
    argv = [sys.executable, "-m", "hvdtrain", *(arg.format(tmp=tmp_path) for arg in args)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.splitlines() == [f"hvdtrain: error: {line.format(tmp=tmp_path)}"]

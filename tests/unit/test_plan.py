"""`plan_run` is pure: a request and the machine's facts in, every decision of `hvdtrain run` out."""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from pathlib import Path

import pytest

from hvdtrain.errors import NothingToDo
from hvdtrain.job.facts import Facts, visible_gpus
from hvdtrain.job.plan import plan_run
from hvdtrain.job.request import RunRequest
from hvdtrain.job.resume import ResumeFacts

PYTHON = "/venv/bin/python"


def facts(**changes) -> Facts:
    values = {
        "cores": 2,
        "python": PYTHON,
        "horovodrun": "/venv/bin/horovodrun",
        "executables": frozenset({"mpirun"}),
        "measured_launchers": {},
        "uid": 1000,
        "gid": 1000,
        "cwd": Path("/work"),
        "environ": {"PATH": "/usr/bin", "AWS_SECRET_ACCESS_KEY": "s3cr3t", "HOROVOD_CYCLE_TIME": "1"},
        "free_port": 40123,
        "timestamp": "20261130-120000",
        "local_addresses": frozenset({"127.0.0.1", "10.0.0.1"}),
        "host_addresses": {"a": "10.0.0.2", "b": "10.0.0.3", "me": "10.0.0.1", "localhost": "127.0.0.1"},
    }
    return Facts(**{**values, **changes})


def resumable(saved=None, recipe="digits-mlp-torch", files=None, **changes) -> ResumeFacts:
    """A run directory of digits-mlp-torch with a good checkpoint, as gather_facts reads it."""
    saved = {"epochs": 4, "hidden": 64} if saved is None else saved
    files = {"checkpoint.pt": "ok", **(files or {})}
    return ResumeFacts(Path("runs/digits-mlp-torch-1"), saved, recipe, files, **changes)


def worker(*args: str) -> list[str]:
    return [PYTHON, "-m", "hvdtrain.worker", *args]


@pytest.mark.parametrize(
    ("request_", "facts_", "expected"),
    [
        (  # a recipe with the defaults: np = cores, MPI (the measured default), a fresh run dir
            RunRequest("digits-mlp-torch"),
            facts(),
            {
                "run_dir": Path("runs/digits-mlp-torch-20261130-120000"),
                "launcher": "mpi",
                "argv[0]": "mpirun",
                "program[:8]": worker(
                    "--recipe",
                    "digits-mlp-torch",
                    "--run-dir",
                    "/work/runs/digits-mlp-torch-20261130-120000",
                    "--strategy",
                    "horovod",
                )[:8],
                "config_in_command": {"epochs": 15},
                "check_horovod_build": True,
            },
        ),
        (  # no mpirun here: auto falls back to gloo
            RunRequest("digits-mlp-torch", np=2, run_dir=Path("r")),
            facts(executables=frozenset()),
            {"launcher": "gloo", "argv[0]": "/venv/bin/horovodrun"},
        ),
        (  # measured here: gloo was faster for torch
            RunRequest("digits-mlp-torch", np=2, run_dir=Path("r")),
            facts(measured_launchers={"torch": {"gloo": 2.0, "mpi": 1.0}}),
            {"launcher": "gloo"},
        ),
        (  # a user's script keeps its arguments; no config
            RunRequest(
                "train.py", np=2, script_args=("--epochs", "1"), strategy_options={"launcher": "gloo"}
            ),
            facts(script_text="import horovod.torch as hvd\n"),
            {
                "config": None,
                "framework": "torch",
                "program": worker("--script", "train.py", "--", "--epochs", "1"),
                "run_dir": Path("runs/train-20261130-120000"),
            },
        ),
        (
            RunRequest("keras_train.py", np=1, strategy_options={"launcher": "gloo"}),
            facts(script_text="import tensorflow as tf\n"),
            {"framework": "tensorflow"},
        ),
        (  # resume: the saved config under --set; the run dir is the one resumed
            RunRequest("digits-mlp-torch", np=2, resume=True, overrides=("epochs=20",)),
            facts(resume=resumable()),
            {
                "run_dir": Path("runs/digits-mlp-torch-1"),
                "config.epochs": 20,
                "config.hidden": 64,
                "program[-1]": "--resume",
            },
        ),
        (  # ddp: torchrun on the free port, no Horovod build check, no HOROVOD_* variables
            RunRequest("digits-mlp-torch", np=2, strategy="ddp", run_dir=Path("r")),
            facts(),
            {
                "launcher": None,
                "argv[:3]": [PYTHON, "-m", "hvdtrain.launching.torchrun"],
                "port": "40123",
                "check_horovod_build": False,
                "no_horovod_env": True,
            },
        ),
        (
            RunRequest("digits-mlp-torch", np=3, strategy="dp", run_dir=Path("r")),
            facts(gpus=4),
            {
                "argv[:8]": worker(
                    "--recipe", "digits-mlp-torch", "--run-dir", "/work/r", "--strategy", "dp"
                )[:8]
            },
        ),
        (
            RunRequest(
                "digits-mlp-tf", np=2, strategy="ps", strategy_options={"num_ps": 2}, run_dir=Path("r")
            ),
            facts(),
            {"argv[:5]": [PYTHON, "-m", "hvdtrain.strategies.ps", "--workers", "2"], "num_ps": "2"},
        ),
        (  # an image: its own python and horovodrun, the run dir mounted, the engine from the facts
            RunRequest("digits-mlp-torch", np=2, image="hvdtrain:cpu", strategy_options={"launcher": "gloo"}),
            facts(container_engine="docker"),
            {
                "argv[:2]": ["docker", "run"],
                "mounted": "/work/runs/digits-mlp-torch-20261130-120000",
                "check_horovod_build": False,
                "image_program": ["horovodrun", "python"],
            },
        ),
    ],
)
def test_plan_table(request_, facts_, expected):
    plan = plan_run(request_, facts_)
    argv = plan.command.argv
    program_start = argv.index(PYTHON) if PYTHON in argv else None
    checks = {
        "run_dir": lambda: plan.run_dir,
        "launcher": lambda: plan.launcher,
        "argv": lambda: argv,
        "argv[0]": lambda: argv[0],
        "argv[:2]": lambda: argv[:2],
        "argv[:3]": lambda: argv[:3],
        "argv[:5]": lambda: argv[:5],
        "program": lambda: argv[program_start:],
        "program[:8]": lambda: argv[program_start:][:8],
        "argv[:8]": lambda: argv[:8],
        "config_in_command": lambda: {
            key: json.loads(argv[argv.index("--config") + 1])[key] for key in ("epochs",)
        },
        "program[-1]": lambda: argv[-1],
        "config": lambda: plan.config,
        "config.epochs": lambda: plan.config.epochs,
        "config.hidden": lambda: plan.config.hidden,
        "framework": lambda: plan.framework,
        "check_horovod_build": lambda: plan.check_horovod_build,
        "port": lambda: argv[argv.index("--master-port") + 1],
        "no_horovod_env": lambda: not any(k.startswith("HOROVOD_") for k in plan.command.env),
        "num_ps": lambda: argv[argv.index("--num-ps") + 1],
        "mounted": lambda: argv[argv.index("-v") + 1].split(":")[0],
        "image_program": lambda: [a for a in argv if a in ("horovodrun", "python")][:2],
    }
    for key, value in expected.items():
        assert checks[key]() == value, key


@pytest.mark.parametrize(
    ("request_", "facts_", "message"),
    [
        (
            RunRequest("digits-mlp-torch", strategy="dp", overrides=("reduce_op=adasum",)),
            facts(),
            "needs --strategy horovod",
        ),
        (
            RunRequest("digits-mlp-torch", strategy="dp", overrides=("fp16_allreduce=true",)),
            facts(),
            "DataParallel has no allreduce",
        ),
        (
            RunRequest("digits-mlp-torch", strategy="ddp", overrides=("reduce_op=adasum",)),
            facts(),
            "DDP averages",
        ),
        (
            RunRequest("digits-mlp-tf", strategy="ps", overrides=("fp16_allreduce=true",)),
            facts(),
            "ps has no allreduce",
        ),
        (
            RunRequest("digits-mlp-tf", strategy="ps", overrides=("backward_passes_per_step=2",)),
            facts(),
            "applies each worker",
        ),
        (
            RunRequest("digits-mlp-torch", strategy="ddp", strategy_options={"launcher": "gloo"}),
            facts(),
            "--launcher does not apply to --strategy ddp",
        ),
        (
            RunRequest("digits-mlp-torch", strategy="dp", strategy_options={"stall_timeout": 5}),
            facts(),
            "--stall-timeout does not apply",
        ),
        (
            RunRequest("digits-mlp-torch", strategy_options={"num_ps": 2}),
            facts(),
            "--num-ps does not apply to --strategy horovod; it is for --strategy ps",
        ),
        (
            RunRequest("digits-mlp-torch", overrides=("hidden=0",)),
            facts(),
            "hidden must be at least 1, got 0",
        ),
        (RunRequest("digits-mlp-torch", overrides=("lr=inf",)), facts(), "lr must be a finite number"),
        (RunRequest("digits-mlp-torch", overrides=("lr=0",)), facts(), "lr must be greater than 0"),
        (RunRequest("digits-mlp-torch", overrides=("momentum=2",)), facts(), "momentum must be at most 1"),
        (
            RunRequest("synthetic-torch", overrides=("image_size=2",)),
            facts(),
            "image_size must be at least 4",
        ),
        (RunRequest("digits-mlp-torch", resume=True), facts(), "no earlier run of digits-mlp-torch"),
        (
            RunRequest("digits-mlp-torch", resume=True, variant="debug"),
            facts(resume=resumable()),
            "--variant applies to a new run",
        ),
        (
            RunRequest("digits-mlp-torch", resume=True),
            facts(resume=resumable({"widht": 3})),
            "fields this recipe does not: widht",
        ),
        (
            RunRequest("digits-mlp-torch", resume=True),
            facts(resume=resumable(recipe="digits-mlp-tf")),
            "is a run of digits-mlp-tf, not of digits-mlp-torch",
        ),
        (
            RunRequest("digits-mlp-torch", resume=True),
            facts(resume=resumable(files={"checkpoint.pt": "missing"})),
            "checkpoint.pt is missing; nothing was changed",
        ),
        (
            RunRequest("digits-mlp-torch", resume=True),
            facts(resume=resumable(in_use_by=4242)),
            "is being trained right now by hvdtrain .pid 4242.",
        ),
        (
            RunRequest("digits-mlp-torch", resume=True),
            facts(resume=resumable(files={"checkpoint.pt": "corrupt (x)"})),
            "checkpoint.pt is corrupt (x)",
        ),
        (
            RunRequest("digits-mlp-tf", resume=True),
            facts(resume=resumable(recipe=None)),
            "checkpoint.keras is missing",
        ),
        (
            RunRequest("digits-mlp-torch", resume=True),
            facts(resume=ResumeFacts(Path("empty"))),
            "empty holds no run (no readable config.json)",
        ),
        (
            RunRequest("digits-mlp-torch", resume=True, overrides=("hidden=256", "epochs=9")),
            facts(resume=resumable()),
            "hidden cannot change on resume (the checkpoint was made with hidden=64); what may change: ep",
        ),
        (
            RunRequest("digits-mlp-torch", strategy_options={"launcher": "mpi"}),
            facts(executables=frozenset()),
            "needs mpirun on PATH",
        ),
        (RunRequest("digits-mlp-torch", hosts="a:1", hostfile="h"), facts(), "not both"),
        (
            RunRequest("digits-mlp-tf", strategy="zero"),
            facts(),
            "strategy 'zero' does not run tensorflow recipes; strategies for tensorflow: horovod, ps; "
            "zero runs digits-mlp-torch, gpt-torch,",
        ),
        (
            RunRequest("digits-mlp-torch", strategy="zero", overrides=("zero_stage=3",)),
            facts(),
            "--set zero_stage=3: choose one of 1, 2",
        ),
        (
            RunRequest("digits-mlp-torch", strategy="zero", overrides=("reduce_op=adasum",)),
            facts(),
            "reduce_op=adasum needs --strategy horovod (zero averages slices of the gradient)",
        ),
        (
            RunRequest("digits-mlp-torch", strategy="zero", overrides=("fp16_allreduce=true",)),
            facts(),
            "fp16_allreduce compresses allreduces; --strategy zero reduce-scatters",
        ),
        (
            RunRequest("digits-mlp-torch", strategy="zero", strategy_options={"num_ps": 1}),
            facts(),
            "--num-ps does not apply to --strategy zero; it is for --strategy ps",
        ),
        (
            RunRequest("digits-mlp-torch", strategy="zero", strategy_options={"launcher": "elastic"}),
            facts(),
            "--strategy zero runs on a fixed number of ranks",
        ),
        (
            RunRequest("digits-mlp-torch", strategy="fsdp", strategy_options={"launcher": "gloo"}),
            facts(),
            "--launcher does not apply to --strategy fsdp; it is for --strategy horovod, zero",
        ),
        (
            RunRequest("digits-mlp-tf", strategy="fsdp"),
            facts(),
            "strategy 'fsdp' does not run tensorflow recipes; strategies for tensorflow: horovod, ps; "
            "fsdp runs digits-mlp-torch, gpt-torch,",
        ),
        (
            RunRequest("digits-mlp-torch", strategy="fsdp", overrides=("reduce_op=adasum",)),
            facts(),
            "reduce_op=adasum needs --strategy horovod (FSDP averages)",
        ),
        (
            RunRequest("digits-mlp-torch", resume=True, strategy="ddp"),
            facts(resume=resumable(sharded_by="zero")),
            "--resume: the checkpoint in runs/digits-mlp-torch-1 is sharded by --strategy zero, which alone "
            "resumes it; `hvdtrain checkpoint consolidate runs/digits-mlp-torch-1` makes a whole one for "
            "--strategy ddp",
        ),
        (RunRequest("train.py"), facts(), "script train.py not found"),
        (
            RunRequest(
                "digits-mlp-torch", overrides=("reduce_op=adasum",), strategy_options={"launcher": "gloo"}
            ),
            facts(),
            "reduce_op=adasum needs --launcher mpi",
        ),
    ],
)
def test_plan_refuses_before_anything_starts(request_, facts_, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_run(request_, facts_)


DP_ON_CPU = (
    "--np 2: --strategy dp is one process over this host's GPUs, and none is visible; give --np 1 (the CPU "
    "is one device), or a strategy that runs 2 processes (horovod, ddp)"
)


@pytest.mark.parametrize(
    ("np", "gpus", "expected"),
    [
        (None, 0, 1),  # not given: every device it can use
        (None, 4, 4),
        (1, 0, 1),
        (2, 2, 2),
        (1, 8, 1),
        (2, 0, DP_ON_CPU),
        (
            3,
            2,
            "--np 3: --strategy dp is one process over this host's GPUs, and 2 are visible; give --np 2 or "
            "less, or a strategy that runs 3 processes (horovod, ddp)",
        ),
        (2, 1, "and 1 is visible; give --np 1 or less"),
    ],
)
def test_dp_runs_on_as_many_devices_as_it_has_here_and_refuses_more(np, gpus, expected):
    request = RunRequest("digits-mlp-torch", np=np, strategy="dp", run_dir=Path("r"))
    if isinstance(expected, int):
        plan = plan_run(request, facts(gpus=gpus))
        assert plan.command.env["HVDTRAIN_DP_DEVICES"] == str(expected)
        return
    with pytest.raises(ValueError) as refused:
        plan_run(request, facts(gpus=gpus))
    assert expected in str(refused.value)


@pytest.mark.parametrize(
    ("driver", "cuda_visible", "gpus"),
    [
        (0, None, 0),
        (4, None, 4),
        (4, "", 0),
        (4, "-1", 0),
        (4, "0,1", 2),
        (4, " 2 , 3 ", 2),
        (4, "1,7,2", 1),  # CUDA stops at the first index that names no GPU
        (2, "0,0", 1),
        (0, "0", 0),
        (2, "GPU-8a1c,GPU-77d2,GPU-0b3e", 2),
        (1, "MIG-4f2a", 1),
    ],
)
def test_the_gpus_a_run_may_use_are_the_drivers_that_cuda_visible_devices_names(driver, cuda_visible, gpus):
    assert visible_gpus(driver, cuda_visible) == gpus


def test_dry_run_command_is_the_plan_with_the_real_port():
    plan = plan_run(
        RunRequest("digits-mlp-torch", np=2, strategy="ddp", dry_run=True), facts(free_port=41999)
    )
    assert "--master-port 41999" in plan.command.render()


def test_hostfile_slots_become_the_hosts():
    request = RunRequest("digits-mlp-torch", np=3, hostfile="hosts", strategy_options={"launcher": "gloo"})
    plan = plan_run(request, facts(hostfile_text="a slots=2\nb\n"))
    argv = plan.command.argv
    assert argv[argv.index("-H") + 1] == "a:2,b:1" and "--network-interface" not in argv


def test_resuming_a_finished_run_says_so_and_plans_nothing():
    finished = facts(resume=resumable(finished_epochs=4))
    with pytest.raises(NothingToDo, match="already finished its 4 epochs; nothing changed"):
        plan_run(RunRequest("digits-mlp-torch", resume=True), finished)
    more = plan_run(RunRequest("digits-mlp-torch", resume=True, overrides=("epochs=6",)), finished)
    assert more.config.epochs == 6 and more.command.argv[-1] == "--resume"


def test_resume_facts_read_the_run_directory(tmp_path):
    import zipfile

    from hvdtrain.job.resume import resume_facts

    (tmp_path / "config.json").write_text(json.dumps({"epochs": 3}))
    (tmp_path / "run.json").write_text(json.dumps({"recipe": "digits-mlp-torch"}))
    with zipfile.ZipFile(tmp_path / "checkpoint.pt", "w") as archive:
        archive.writestr("data.pkl", b"x")
    (tmp_path / "checkpoint.keras").write_bytes(b"PK\x03\x04 torn")
    found = resume_facts(tmp_path)
    assert found.saved_config == {"epochs": 3} and found.recipe == "digits-mlp-torch"
    assert found.files["checkpoint.pt"] == "ok" and found.finished_epochs is None
    assert found.files["checkpoint.keras"].startswith("corrupt")
    (tmp_path / "summary.json").write_text(json.dumps({"epochs": 3}))
    assert resume_facts(tmp_path).finished_epochs == 3
    assert resume_facts(tmp_path / "nope").files["checkpoint.pt"] == "missing"


def test_only_the_allowlisted_environment_and_named_variables_reach_the_ranks():
    plan = plan_run(RunRequest("digits-mlp-torch", np=2, strategy_options={"launcher": "mpi"}), facts())
    progress = {"HVDTRAIN_PROGRESS_S": "15.0"}  # rank 0's progress lines, for a console that is no terminal
    assert plan.environment == {"PATH": "/usr/bin", "HOROVOD_CYCLE_TIME": "1", **progress}
    assert "s3cr3t" not in " ".join(plan.command.argv) and "AWS_SECRET_ACCESS_KEY" not in plan.command.argv
    named = plan_run(RunRequest("digits-mlp-torch", np=2, env=("AWS_SECRET_ACCESS_KEY",)), facts())
    assert named.environment["AWS_SECRET_ACCESS_KEY"] == "s3cr3t"
    argv = named.command.argv
    assert argv[argv.index("AWS_SECRET_ACCESS_KEY") - 1] == "-x", "mpirun forwards it by name"
    assert "s3cr3t" not in " ".join(argv)
    with pytest.raises(ValueError, match="--env NOPE: not set in this environment"):
        plan_run(RunRequest("digits-mlp-torch", env=("NOPE",)), facts())
    with pytest.raises(ValueError, match="--env '1X': expected NAME or NAME=VALUE"):
        plan_run(RunRequest("digits-mlp-torch", env=("1X=2",)), facts())
    given = plan_run(RunRequest("digits-mlp-torch", np=2, env=("NCCL_DEBUG=INFO", "A=b=c")), facts())
    assert given.environment["NCCL_DEBUG"] == "INFO" and given.environment["A"] == "b=c", "-x NAME=VALUE"
    argv = given.command.argv
    assert argv[argv.index("NCCL_DEBUG") - 1] == "-x" and "NCCL_DEBUG=INFO" not in argv
    cli_only = facts(environ={"PATH": "/usr/bin", "HVDTRAIN_RUN_NP": "2", "HVDTRAIN_VERBOSE": "1"})
    assert set(plan_run(RunRequest("digits-mlp-torch", np=2), cli_only).environment) == {
        "PATH",
        "HVDTRAIN_PROGRESS_S",
    }, "the command line's own variables stay here"
    on_terminal = plan_run(RunRequest("digits-mlp-torch", np=2), facts(terminal=True))
    assert on_terminal.environment["HVDTRAIN_PROGRESS_S"] == "0.5", "redrawn twice a second"
    own = facts(environ={"PATH": "/usr/bin", "HVDTRAIN_PROGRESS_S": "2"})
    assert plan_run(RunRequest("digits-mlp-torch", np=2), own).environment["HVDTRAIN_PROGRESS_S"] == "2"
    script = plan_run(RunRequest("train.py", np=2), facts(script_text="import horovod.torch as hvd\n"))
    assert "HVDTRAIN_PROGRESS_S" not in script.environment, "a user's script has no progress to report"


def test_ranks_beyond_the_cores_share_them_and_beyond_four_per_core_are_refused():
    shared = plan_run(RunRequest("digits-mlp-torch", np=4, run_dir=Path("r")), facts())
    assert shared.notes[0] == "hvdtrain: 4 ranks share this host's 2 cores"
    with pytest.raises(
        ValueError, match="--np 9 puts 9 ranks on this host's 2 cores .* pass --oversubscribe"
    ):
        plan_run(RunRequest("digits-mlp-torch", np=9), facts())
    with pytest.raises(ValueError, match="4 tensorflow ranks need about 3 GiB here and 1 GiB is free"):
        plan_run(RunRequest("digits-mlp-tf", np=4), facts(memory_available=1 << 30))
    assert plan_run(RunRequest("digits-mlp-torch", np=1000, oversubscribe=True), facts()).notes
    remote = RunRequest("digits-mlp-torch", np=16, hosts="a:8,b:8", strategy_options={"launcher": "gloo"})
    assert plan_run(remote, facts()).notes == (), "ranks on other hosts use their cores"


def test_mpirun_without_the_bind_library_runs_and_says_it_listens_everywhere():
    request = RunRequest("digits-mlp-torch", np=2, run_dir=Path("r"), strategy_options={"launcher": "mpi"})
    library = "/venv/lib/hvdtrain/bindto-0.so"
    kept = plan_run(request, facts(bind_library=library))
    assert kept.bind_library == library and kept.command.env["LD_PRELOAD"] == library
    assert not [note for note in kept.notes if "every interface" in note]
    why = "no C compiler (cc) to build hvdtrain's bind library"
    open_plan = plan_run(request, facts(bind_library_problem=why))
    assert open_plan.bind_library is None and "LD_PRELOAD" not in open_plan.command.env
    assert (
        f"hvdtrain: mpirun's out-of-band listener will answer on every interface ({why})" in open_plan.notes
    )
    several = replace(request, hosts="a:1,b:1")
    assert plan_run(several, facts(bind_library=library)).bind_library is None, "no interface named: unused"
    named = replace(several, network_interface="eth1")
    assert plan_run(named, facts(bind_library=library)).bind_library == library, "other hosts need it too"
    gloo = replace(request, strategy_options={"launcher": "gloo"})
    assert plan_run(gloo, facts(bind_library_problem=why)).notes == ()
    own = facts(bind_library=library, environ={"PATH": "/usr/bin", "LD_PRELOAD": "libjemalloc.so.2"})
    kept_own = plan_run(replace(request, env=("LD_PRELOAD",)), own)
    assert kept_own.command.env["LD_PRELOAD"] == f"{library}:libjemalloc.so.2", "the user's preload stays"


def test_sigterm_waits_for_the_ranks_to_stop_at_a_step_only_where_they_take_the_request():
    stopping = {
        "recipe": RunRequest("digits-mlp-torch", np=2, strategy_options={"launcher": "gloo"}),
        "zero": RunRequest("digits-mlp-torch", np=2, strategy="zero", strategy_options={"launcher": "gloo"}),
        "ddp": RunRequest("digits-mlp-torch", np=2, strategy="ddp"),
        "fsdp": RunRequest("digits-mlp-torch", np=2, strategy="fsdp"),
    }
    ending = {
        "script": RunRequest("train.py", np=2, strategy_options={"launcher": "gloo"}),
        "elastic": RunRequest(
            "digits-mlp-torch",
            np=2,
            strategy_options={"launcher": "elastic", "min_np": 1, "host_discovery_script": "/d.sh"},
        ),
        "ps": RunRequest("digits-mlp-tf", np=2, strategy="ps", strategy_options={"num_ps": 1}),
    }
    for name, request in {**stopping, **ending}.items():
        planned = plan_run(request, facts(script_text="import horovod.torch as hvd\n"))
        assert planned.stops_at_step is (name in stopping), name


def test_mpirun_gets_hvdtrains_allreduce_rules_except_in_an_image():
    from hvdtrain.launchers.mpi import ALLREDUCE_RULES

    request = RunRequest("digits-mlp-torch", np=2, run_dir=Path("r"), strategy_options={"launcher": "mpi"})
    argv = plan_run(request, facts()).command.argv
    at = argv.index("coll_tuned_dynamic_rules_filename")
    assert argv[at + 1] == str(ALLREDUCE_RULES) and argv[at - 3 : at - 1] == [
        "coll_tuned_use_dynamic_rules",
        "1",
    ]
    in_image = plan_run(replace(request, image="hvdtrain:cpu"), facts(container_engine="docker"))
    assert "coll_tuned_dynamic_rules_filename" not in in_image.command.argv, (
        "the host's path is not the image's"
    )
    gloo = plan_run(replace(request, strategy_options={"launcher": "gloo"}), facts())
    assert not any("coll_tuned" in arg for arg in gloo.command.argv)


def test_the_allreduce_rules_file_is_what_open_mpi_reads():
    """Open MPI's reader takes numbers in order (a '#' starts a comment): collectives, then for each
    its id, its communicator sizes, and for each size its message sizes, 4 numbers a message size."""
    from hvdtrain.launchers.mpi import ALLREDUCE_RULES

    numbers = [
        int(word) for line in ALLREDUCE_RULES.read_text().splitlines() for word in line.split("#")[0].split()
    ]
    collectives, allreduce, sizes, from_ranks, messages, *rules = numbers
    assert (collectives, allreduce, sizes, from_ranks) == (1, 2, 1, 2)  # allreduce is collective 2
    assert len(rules) == 4 * messages
    rows = [rules[i : i + 4] for i in range(0, len(rules), 4)]
    assert rows == [[0, 0, 0, 0], [32 << 20, 5, 0, 1 << 20]], "Open MPI's choice, then the segmented ring"


def test_a_recipes_measured_horovod_tuning_is_set_and_said_unless_the_user_or_autotune_decides():
    kept = {
        "horovod": {
            "digits-mlp-torch": {
                "setting": {"fusion_mb": 32, "cycle_ms": 5},
                "ratio_to_defaults": 1.06,
                "measured": "at np=2 over mpi on 2026-12-03",
            }
        }
    }
    request = RunRequest("digits-mlp-torch", np=2, run_dir=Path("r"), strategy_options={"launcher": "mpi"})
    machine = facts(measured_tuning=kept, environ={"PATH": "/usr/bin"})
    tuned = plan_run(request, machine)
    assert tuned.command.env["HOROVOD_FUSION_THRESHOLD"] == str(32 << 20)
    assert tuned.command.env["HOROVOD_CYCLE_TIME"] == "5"
    assert "-x" in tuned.command.argv and "HOROVOD_CYCLE_TIME" in tuned.command.argv
    assert (
        "hvdtrain: Horovod fusion 32 MB, cycle 5 ms for this recipe, 1.06x Horovod's defaults as measured "
        "at np=2 over mpi on 2026-12-03 (hvdtrain bench --tune)"
    ) in tuned.notes
    users = plan_run(
        request, facts(measured_tuning=kept, environ={"PATH": "/usr/bin", "HOROVOD_CYCLE_TIME": "2"})
    )
    assert "HOROVOD_FUSION_THRESHOLD" not in users.command.env, "the user's own setting decides"
    flagged = replace(request, strategy_options={"launcher": "mpi", "cycle_time_ms": 3.0})
    by_flag = plan_run(flagged, machine)
    assert by_flag.command.env["HOROVOD_CYCLE_TIME"] == "3", "--cycle-time-ms decides"
    assert "HOROVOD_FUSION_THRESHOLD" not in by_flag.command.env, "a kept setting is taken whole or not"
    autotuned = replace(request, strategy_options={"launcher": "mpi", "horovod_autotune": True})
    assert "HOROVOD_FUSION_THRESHOLD" not in plan_run(autotuned, machine).command.env
    for other in (
        replace(request, strategy="ddp", strategy_options={}),
        replace(request, target="synthetic-torch"),
    ):
        assert "HOROVOD_FUSION_THRESHOLD" not in plan_run(other, machine).command.env


def test_a_recipes_measured_ddp_bucket_size_is_set_and_said_on_one_host_and_across_hosts():
    entry = {"setting": {"bucket_mb": 5}, "ratio_to_defaults": 1.04, "measured": "at np=2 on 2026-12-04"}
    machine = facts(measured_tuning={"ddp": {"digits-mlp-torch": entry}}, environ={"PATH": "/usr/bin"})
    request = RunRequest("digits-mlp-torch", np=2, run_dir=Path("r"), strategy="ddp")
    line = (
        "hvdtrain: DDP buckets 5 MB for this recipe, 1.04x DDP's defaults as measured at np=2 on "
        "2026-12-04 (hvdtrain bench --tune)"
    )
    for planned in (plan_run(request, machine), plan_run(replace(request, hosts="a:1,b:1"), machine)):
        assert planned.command.env["HVDTRAIN_DDP_BUCKET_MB"] == "5" and line in planned.notes
    across = plan_run(replace(request, hosts="a:1,b:1"), machine).command.argv
    assert "HVDTRAIN_DDP_BUCKET_MB" in across, "mpirun passes it to the other host's torchrun"
    users = facts(
        measured_tuning={"ddp": {"digits-mlp-torch": entry}},
        environ={"PATH": "/usr/bin", "HVDTRAIN_DDP_BUCKET_MB": "50"},
    )
    assert not any("DDP buckets" in note for note in plan_run(request, users).notes)
    assert "HVDTRAIN_DDP_BUCKET_MB" not in plan_run(replace(request, strategy="horovod"), machine).command.env
    for bad in ("big", "0", "-5", "inf", "nan"):
        with pytest.raises(ValueError, match=f"a positive number; got '{bad}'"):
            plan_run(request, facts(environ={"PATH": "/usr/bin", "HVDTRAIN_DDP_BUCKET_MB": bad}))


@pytest.mark.parametrize(
    ("given", "variable", "threads"),
    [
        (None, None, "1"),  # two cores, two ranks
        (None, "3", "3"),  # the user's OMP_NUM_THREADS, as horovodrun or torchrun would take it
        (None, "4,2", "4"),  # OpenMP's nested form: the outermost level
        (2, "3", "2"),  # --threads-per-rank over it
    ],
)
def test_threads_per_rank_default_to_the_users_omp_num_threads(given, variable, threads):
    environ = {"PATH": "/usr/bin"} | ({"OMP_NUM_THREADS": variable} if variable else {})
    request = RunRequest("digits-mlp-torch", np=2, threads_per_rank=given, run_dir=Path("r"))
    env = plan_run(request, facts(environ=environ)).command.env
    assert env["OMP_NUM_THREADS"] == env["HVDTRAIN_THREADS_PER_RANK"] == threads
    for bad in ("0", "many", "-1"):
        refused = pytest.raises(ValueError, match=f"OMP_NUM_THREADS must be a number of threads.*got '{bad}'")
        with refused if given is None else contextlib.nullcontext():  # the flag rules; ranks get its value
            plan_run(request, facts(environ={"PATH": "/usr/bin", "OMP_NUM_THREADS": bad}))

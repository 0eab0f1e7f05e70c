"""Slurm as hvdtrain reads it, pure: host lists, task counts, the allocation, and what a run inside
one plans (hosts, np, threads, launcher, how other nodes are reached)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hvdtrain import launchers
from hvdtrain.job.plan import plan_run
from hvdtrain.job.request import RunRequest
from hvdtrain.launching import remote, slurm
from hvdtrain.launching.spec import Host, LaunchSpec
from tests.unit.test_plan import facts


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("h1", ["h1"]),
        ("h[1-2,4]", ["h1", "h2", "h4"]),
        ("node[08-11]", ["node08", "node09", "node10", "node11"]),
        ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("gpu[1-2]-ib", ["gpu1-ib", "gpu2-ib"]),
        ("n[3]", ["n3"]),
    ],
)
def test_host_lists_expand_as_slurm_writes_them(text, expected):
    assert slurm.expand_hostlist(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "is empty"),
        ("h[1-2", "unbalanced brackets"),
        ("h1-2]", "unbalanced brackets"),
        ("h[[1]]", "unbalanced brackets"),
        ("h[2-1]", "runs backwards"),
        ("h[a-b]", "is not N or N-M"),
        ("h[1-9999999]", "names more than"),
        ("a,,b", "an empty host name"),
        ("bad host", "is not a host name"),
    ],
)
def test_a_malformed_host_list_is_refused_naming_it(text, message):
    with pytest.raises(ValueError, match=message):
        slurm.expand_hostlist(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,2,3", [1, 2, 3]), ("16(x2)", [16, 16])],
)
def test_task_counts_expand(text, expected):
    assert slurm.expand_counts(text) == expected


@pytest.mark.parametrize("text", ["", "2(x)", "x2", "0", "2(x0)", "2(3)", "1,,2"])
def test_malformed_task_counts_are_refused(text):
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE"):
        slurm.expand_counts(text)


ALLOCATION = {
    "SLURM_JOB_ID": "41",
    "SLURM_JOB_NODELIST": "h[1-2]",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURMD_NODENAME": "h1",
}


def test_the_allocation_comes_from_slurms_variables():
    assert slurm.allocation_from({"PATH": "/bin"}) is None
    found = slurm.allocation_from({**ALLOCATION, "SLURM_CPUS_PER_TASK": "4", "SLURM_RESTART_COUNT": "2"})
    assert found == slurm.Allocation("41", ("h1", "h2"), (2, 2), 4, 2)
    assert found.tasks == 4 and found.hosts() == (Host("h1", 2), Host("h2", 2))
    assert found.describe() == "2 nodes h1,h2, 2 tasks each, 4 CPUs per task"
    only_nodes = slurm.allocation_from({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "h[1-3]"})
    assert only_nodes.tasks_per_node == (1, 1, 1), "a job that asked for no tasks has one a node"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"SLURM_JOB_NODELIST": "h[1-"}, "SLURM_JOB_NODELIST 'h\\[1-': unbalanced brackets"),
        ({"SLURM_TASKS_PER_NODE": "2(x3)"}, "gives 3 nodes' tasks for the 2 nodes"),
        ({"SLURM_TASKS_PER_NODE": "two"}, "SLURM_TASKS_PER_NODE 'two'"),
        ({"SLURM_JOB_NODELIST": "h1,h1"}, "names a node twice"),
        ({"SLURM_CPUS_PER_TASK": "0"}, "SLURM_CPUS_PER_TASK='0'"),
        ({"SLURM_RESTART_COUNT": "x"}, "SLURM_RESTART_COUNT='x'"),
    ],
)
def test_a_malformed_allocation_is_refused_in_one_line_before_anything_starts(changes, message):
    with pytest.raises(ValueError, match=message):
        slurm.allocation_from({**ALLOCATION, **changes})
    with pytest.raises(ValueError, match=message):
        plan_run(RunRequest("digits-mlp-torch"), facts(environ={**ALLOCATION, **changes}))


def test_srun_lists_its_mpi_plugins():
    listed = "srun: MPI types are...\nsrun: cray_shasta\nsrun: none\nsrun: pmi2\nsrun: pmix\nsrun: pmix_v4\n"
    assert slurm.mpi_plugins(listed) == {"cray_shasta", "pmi2", "pmix", "pmix_v4"}


def test_a_ranks_local_size_under_srun_is_its_nodes_count():
    step = {"SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_LOCALID": "0"}
    assert launchers.local_size({**step, "SLURM_NODEID": "0"}) == 3
    assert launchers.local_size({**step, "SLURM_NODEID": "1"}) == 1


PROGRAM = ["/venv/bin/python", "-m", "hvdtrain.worker"]


@pytest.mark.parametrize(
    ("hosts", "np", "log_dir", "expected"),
    [
        (
            (Host("h1", 2), Host("h2", 2)),
            4,
            None,
            ["srun", "--mpi=pmix", "--ntasks=4", "--nodes=2", "--nodelist=h1,h2", "--ntasks-per-node=2"],
        ),
        (
            (Host("h1", 2), Host("h2", 2)),
            2,
            None,
            ["srun", "--mpi=pmix", "--ntasks=2", "--nodes=1", "--nodelist=h1", "--ntasks-per-node=2"],
        ),
        ((), 2, None, ["srun", "--mpi=pmix", "--ntasks=2", "--nodes=1", "--kill-on-bad-exit=1"]),
    ],
)
def test_srun_argv(hosts, np, log_dir, expected):
    command = launchers.get("srun").build(
        LaunchSpec(program=PROGRAM, np=np, hosts=hosts, log_dir=log_dir), launchers.LaunchContext(), {}
    )
    assert command.argv[: len(expected)] == expected
    assert command.argv[-3:] == PROGRAM
    assert "--kill-on-bad-exit=1" in command.argv


def test_srun_keeps_each_ranks_output_on_its_node():
    command = launchers.get("srun").build(
        LaunchSpec(program=PROGRAM, np=2, log_dir="/run/logs"), launchers.LaunchContext(), {}
    )
    at = command.argv.index("bash")
    assert command.argv[at : at + 2] == ["bash", "-c"] and command.argv[at + 3 :] == ["/run/logs", *PROGRAM]
    assert 'tee "$0/rank.$SLURM_PROCID/stdout"' in command.argv[at + 2]


def test_a_ranks_lines_are_tagged_as_horovodrun_tags_them_and_kept_in_its_log(tmp_path):
    """srun's own --label (`3: `) could not be told from a rank printing "epoch 3: ..."."""
    import subprocess

    from hvdtrain.launchers.srun import rank_output
    from hvdtrain.launching.console import parse

    script = "import sys; print('epoch 3: done', flush=True); print('oops', file=sys.stderr)"
    done = subprocess.run(
        ["bash", "-c", rank_output(True), str(tmp_path), "python3", "-c", script],
        env={"SLURM_PROCID": "3", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0
    out, err = parse(done.stdout.splitlines()[0]), parse(done.stderr.splitlines()[0])
    assert (out.rank, out.stream, out.text) == (3, "stdout", "epoch 3: done")
    assert (err.rank, err.stream, err.text) == (3, "stderr", "oops")
    assert (tmp_path / "rank.3" / "stdout").read_text() == "epoch 3: done\n"


def inside(*changes, executables=frozenset({"mpirun", "srun"}), srun_mpi=frozenset({"pmix"}), **environ):
    probed = {"srun": srun_mpi}
    return facts(environ={**ALLOCATION, **environ}, executables=executables, probed=probed, hostname="h1")


def test_inside_an_allocation_the_hosts_np_and_launcher_come_from_it():
    planned = plan_run(RunRequest("digits-mlp-torch", run_dir=Path("r")), inside())
    assert planned.launcher == "srun" and planned.command.argv[:5] == [
        "srun",
        "--mpi=pmix",
        "--ntasks=4",
        "--nodes=2",
        "--nodelist=h1,h2",
    ]
    assert planned.hosts == (Host("h1", 2), Host("h2", 2)) and planned.rank_hosts == ("h1", "h1", "h2", "h2")
    assert planned.remote_hosts == ("h2",) and isinstance(planned.transport, remote.SlurmStep)
    assert planned.notes[0] == "hvdtrain: inside Slurm job 41: --np 4 on its 2 nodes h1,h2, 2 tasks each"
    assert "hvdtrain: --launcher auto chose srun (inside Slurm job 41)" in planned.notes
    assert planned.command.env["HVDTRAIN_THREADS_PER_RANK"] == "auto"
    assert planned.environment["HVDTRAIN_SIGTERM_STOPS"] == "1"  # Slurm's SIGTERM to a rank: stop at a step
    outside = plan_run(RunRequest("digits-mlp-torch", run_dir=Path("r")), facts())
    assert "HVDTRAIN_SIGTERM_STOPS" not in outside.environment  # a launcher's SIGTERM ends a rank at once


def test_cpus_per_task_become_each_ranks_threads():
    planned = plan_run(
        RunRequest("digits-mlp-torch", np=2, run_dir=Path("r")), inside(SLURM_CPUS_PER_TASK="3")
    )
    assert planned.command.env["OMP_NUM_THREADS"] == "3"


def test_one_node_allocation_runs_as_on_one_machine():
    one = inside(SLURM_JOB_NODELIST="h1", SLURM_TASKS_PER_NODE="2")
    planned = plan_run(
        RunRequest("digits-mlp-torch", run_dir=Path("r"), strategy_options={"launcher": "gloo"}), one
    )
    assert planned.hosts == (Host("localhost", 2),) and planned.remote_hosts == ()
    assert planned.command.argv[1:5] == ["-np", "2", "-H", "localhost:2"]
    srun = plan_run(RunRequest("digits-mlp-torch", run_dir=Path("r")), one)
    assert srun.command.argv[:5] == ["srun", "--mpi=pmix", "--ntasks=2", "--nodes=1", "--kill-on-bad-exit=1"]


def test_hosts_given_inside_an_allocation_must_be_within_it():
    request = RunRequest("digits-mlp-torch", hosts="h2:2", run_dir=Path("r"))
    assert plan_run(request, inside()).remote_hosts == ("h2",)
    for hosts, message in [
        ("h3:1", "--hosts: h3 is not a node of Slurm job 41 \\(h1,h2\\)"),
        ("h2:3", "--hosts: h2:3 is more than the 2 tasks Slurm job 41 has on h2"),
    ]:
        with pytest.raises(ValueError, match=message):
            plan_run(RunRequest("digits-mlp-torch", hosts=hosts, run_dir=Path("r")), inside())


@pytest.mark.parametrize(
    ("request_", "facts_", "message"),
    [
        (
            RunRequest("digits-mlp-torch", np=5, run_dir=Path("r")),
            inside(),
            "--np 5 is more than the 4 tasks of Slurm job 41 \\(2 nodes h1,h2, 2 tasks each\\)",
        ),
        (
            RunRequest("digits-mlp-torch", np=2, run_dir=Path("r"), strategy_options={"launcher": "srun"}),
            facts(executables=frozenset({"srun"})),
            "--launcher srun runs inside a Slurm allocation",
        ),
        (
            RunRequest("digits-mlp-torch", np=2, run_dir=Path("r"), strategy_options={"launcher": "srun"}),
            inside(srun_mpi=frozenset({"pmi2"})),
            "--launcher srun needs Slurm's pmix MPI plugin .*; srun --mpi=list has pmi2",
        ),
        (
            RunRequest("digits-mlp-torch", np=2, run_dir=Path("r"), strategy_options={"launcher": "srun"}),
            facts(executables=frozenset({"mpirun"}), environ=ALLOCATION),
            "--launcher srun needs Slurm's srun on PATH",
        ),
    ],
)
def test_slurm_bad_input_is_refused(request_, facts_, message):
    with pytest.raises(ValueError, match=message):
        plan_run(request_, facts_)


def test_staging_inside_an_allocation_takes_a_slurm_step_not_ssh():
    argv = remote.SlurmStep("srun").command("h2", "true")
    assert argv == [
        "srun",
        "--overlap",
        "--quiet",
        "--nodes=1",
        "--ntasks=1",
        "--nodelist=h2",
        "bash",
        "-c",
        "true",
    ]


def test_srun_gives_each_node_the_same_ranks_and_each_rank_its_cpus():
    planned = plan_run(
        RunRequest("digits-mlp-torch", np=2, run_dir=Path("r")), inside(SLURM_CPUS_PER_TASK="3")
    )
    assert "--cpus-per-task=3" in planned.command.argv, "srun does not inherit it since Slurm 22.05"
    assert "--ntasks-per-node=2" in planned.command.argv and "--nodelist=h1" in planned.command.argv
    with pytest.raises(ValueError, match="--launcher srun places the same number of ranks on each node"):
        plan_run(RunRequest("digits-mlp-torch", np=3, run_dir=Path("r")), inside())


def test_without_pmix_auto_inside_an_allocation_does_not_pick_srun():
    planned = plan_run(
        RunRequest("digits-mlp-torch", run_dir=Path("r")), inside(srun_mpi=frozenset({"pmi2"}))
    )
    assert planned.launcher == "mpi" and isinstance(planned.transport, remote.SlurmStep)


@pytest.mark.parametrize(
    ("lines", "stopped_by"),
    [
        (["*** STEP 4.1 ON h1 CANCELLED AT 2026-12-03T10:23:48 ***"], 15),  # scancel, a time limit
        (
            [
                "srun: error: h2: task 1: Exited with exit code 3",
                "*** STEP 4.1 ON h1 CANCELLED AT 2026-12-03T10:23:48 ***",  # srun ending the failed step
            ],
            None,
        ),
    ],
)
def test_a_job_slurm_cancels_is_stopped_and_a_failed_step_is_not(lines, stopped_by):
    from hvdtrain.launching.console import Console
    from hvdtrain.launching.runner import run_launch
    from hvdtrain.launching.spec import LaunchCommand

    script = "; ".join(f"echo '{line}' >&2" for line in lines) + "; exit 1"
    quiet = Console(open("/dev/null", "w"), live=False)  # noqa: SIM115
    result = run_launch(LaunchCommand(["bash", "-c", script], {}), {"PATH": "/usr/bin:/bin"}, console=quiet)
    assert result.stopped_by == stopped_by


def test_ddp_across_hosts_needs_this_host_by_name():
    with pytest.raises(ValueError, match="name this host by its name or address in --hosts, not localhost"):
        plan_run(
            RunRequest("digits-mlp-torch", strategy="ddp", hosts="localhost:1,a:1", run_dir=Path("r")),
            facts(),
        )

"""The launcher is a pure function: every flag is a row here."""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from hvdtrain import launchers, strategies
from hvdtrain.launching.rank_output import rank_stderr_tail
from hvdtrain.launching.spec import (
    Failure,
    Host,
    LaunchSpec,
    first_failure,
    parse_hostfile,
    parse_hosts,
    threads_per_rank,
)
from hvdtrain.strategies import LaunchContext

PROGRAM = ["python", "-m", "hvdtrain.worker", "--recipe", "r"]
HOROVOD_OPTIONS = {
    **{option.name: option.default for option in strategies.get("horovod", "torch").options},
    "launcher": "gloo",
}


STATIC_ENV = {
    "OMP_NUM_THREADS": "1",
    "HVDTRAIN_THREADS_PER_RANK": "1",
    "HOROVOD_GLOO_TIMEOUT_SECONDS": "360",  # well after the watchdog: a suspended job is no stall
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "240",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "360",
    "HVDTRAIN_STALL_TIMEOUT": "120",
    "HVDTRAIN_STATUS_DIR": "run/logs/status",
}
"""Every Horovod rank's environment on one host of 2 cores, 2 ranks, the default stall timeout."""


def build_launch(spec: LaunchSpec, context: LaunchContext | None = None, **options):
    """The horovod strategy's launch, as `hvdtrain run` plans it."""
    horovod = strategies.get("horovod", "torch")
    context = context or LaunchContext(cores_per_host=2, executables=frozenset({"mpirun"}))
    return horovod.launch(spec, {**HOROVOD_OPTIONS, **options}, context).command


def spec(**changes) -> LaunchSpec:
    return LaunchSpec(**{"program": PROGRAM, "np": 2, "log_dir": "run/logs", **changes})


def test_gloo_on_one_machine():
    command = build_launch(spec())
    assert command.argv == [
        "horovodrun",
        "-np",
        "2",
        "-H",
        "localhost:2",
        "--gloo",
        "--network-interface",
        "lo",
        "--output-filename",
        "run/logs",
        *PROGRAM,
    ]
    assert command.env == STATIC_ENV


def test_horovods_stall_check_warns_late_under_torch_and_is_the_stall_check_under_tensorflow():
    """torch's watchdog names stalls and tells a suspended job from one; Horovod's check counts the
    suspension, so under torch it warns only at two timeouts. TensorFlow has only Horovod's."""
    context = LaunchContext(cores_per_host=2, framework="tensorflow")
    tf = strategies.get("horovod", "tensorflow").launch(spec(), {**HOROVOD_OPTIONS}, context).command.env
    names = ("STALL_CHECK_TIME", "STALL_SHUTDOWN_TIME", "GLOO_TIMEOUT")
    assert [tf[f"HOROVOD_{name}_SECONDS"] for name in names] == ["60", "120", "120"]
    assert int(STATIC_ENV["HOROVOD_STALL_CHECK_TIME_SECONDS"]) > int(STATIC_ENV["HVDTRAIN_STALL_TIMEOUT"])


def test_mpi_as_root_forwards_the_environment():
    context = LaunchContext(cores_per_host=2, run_as_root=True, executables=frozenset({"mpirun"}))
    command = build_launch(spec(forward_env=("PATH", "PYTHONPATH")), context, launcher="mpi")
    assert command.argv == [
        "mpirun",
        "--allow-run-as-root",
        "-np",
        "2",
        "-H",
        "localhost:2",
        "--bind-to",
        "none",
        "--map-by",
        "slot",
        "--tag-output",
        "--mca",
        "mpi_yield_when_idle",
        "1",
        "--mca",
        "btl",
        "self,vader",
        "--mca",
        "oob_tcp_if_include",
        "lo",
        "--mca",
        "oob_tcp_disable_ipv6_family",
        "1",
        "--output-filename",
        "run/logs",
        "-x",
        "HOROVOD_GLOO_TIMEOUT_SECONDS",
        "-x",
        "HOROVOD_STALL_CHECK_TIME_SECONDS",
        "-x",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
        "-x",
        "HVDTRAIN_STALL_TIMEOUT",
        "-x",
        "HVDTRAIN_STATUS_DIR",
        "-x",
        "HVDTRAIN_THREADS_PER_RANK",
        "-x",
        "OMP_NUM_THREADS",
        "-x",
        "PATH",
        "-x",
        "PYTHONPATH",
        *PROGRAM,
    ]


def test_mpi_not_root_and_many_hosts_use_the_default_interface():
    hosts = (Host("a", 2), Host("b", 2))
    argv = build_launch(spec(np=4, hosts=hosts, log_dir=None, forward_env=()), launcher="mpi").argv
    assert "--allow-run-as-root" not in argv
    assert argv[argv.index("-H") + 1] == "a:2,b:2"
    assert "btl_tcp_if_include" not in argv
    assert argv[argv.index("plm_rsh_args") + 1] == (
        "-o BatchMode=yes -o StrictHostKeyChecking=accept-new -o LogLevel=ERROR -o ConnectTimeout=5 "
        "-o ServerAliveInterval=5 -o ServerAliveCountMax=3"
    )


def test_ssh_port_and_key_reach_both_launchers_and_threads_come_from_each_host():
    hosts = (Host("a", 2), Host("b", 1))
    remote = spec(np=3, hosts=hosts, ssh_port=2222, ssh_identity_file="/k/id")
    gloo = build_launch(remote, launcher="gloo")
    assert gloo.argv[gloo.argv.index("--ssh-port") + 1] == "2222"
    assert gloo.argv[gloo.argv.index("--ssh-identity-file") + 1] == "/k/id"
    assert gloo.env["HVDTRAIN_THREADS_PER_RANK"] == "auto" and "OMP_NUM_THREADS" not in gloo.env
    mpi = build_launch(remote, LaunchContext(executables=frozenset({"mpirun"})), launcher="mpi").argv
    assert mpi[mpi.index("plm_rsh_args") + 1].endswith("-p 2222 -i /k/id")


def test_explicit_interface_and_tuning_reach_the_ranks():
    context = LaunchContext(cores_per_host=2, horovodrun="/venv/bin/horovodrun")
    command = build_launch(spec(network_interface="eth0", env={"X": "y"}), context, horovod_autotune=True)
    assert command.argv[:1] == ["/venv/bin/horovodrun"]
    assert command.argv[command.argv.index("--network-interface") + 1] == "eth0"
    assert command.env["HOROVOD_AUTOTUNE"] == "1" and command.env["X"] == "y"
    assert command.env["HOROVOD_AUTOTUNE_LOG"] == "run/horovod-autotune.csv"
    assert "HOROVOD_TIMELINE" not in command.env
    traced = build_launch(spec(), context, timeline=True)
    assert traced.env["HOROVOD_TIMELINE"] == "run/horovod-timeline.json"


def test_mpi_args_come_last_before_the_program_and_only_on_mpirun():
    argv = build_launch(spec(), launcher="mpi", mpi_args="--mca btl_tcp_if_include 'eth 0' -x A=1").argv
    assert argv[-len(PROGRAM) - 5 : -len(PROGRAM)] == ["--mca", "btl_tcp_if_include", "eth 0", "-x", "A=1"]
    with pytest.raises(ValueError, match="--mpi-args applies to --launcher mpi"):
        build_launch(spec(), launcher="gloo", mpi_args="-x A")
    with pytest.raises(ValueError, match="--mpi-args: No closing quotation"):
        build_launch(spec(), launcher="mpi", mpi_args="'a")


def test_horovodruns_tuning_flags_set_horovods_variables():
    flags = {
        "fusion_threshold_mb": 1.5, "cycle_time_ms": 2.5, "hierarchical_allreduce": True,
        "log_level": "debug", "start_timeout": 90, "timeline_filename": "tl.json",
    }  # fmt: skip
    env = build_launch(spec(), timeline=True, **flags).env
    assert {name: env[name] for name in env if name.startswith("HOROVOD_") and "STALL" not in name} == {
        "HOROVOD_FUSION_THRESHOLD": str(3 * 2**19), "HOROVOD_CYCLE_TIME": "2.5",
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_LOG_LEVEL": "DEBUG", "HOROVOD_START_TIMEOUT": "90",
        "HOROVOD_TIMELINE": str(Path("tl.json").absolute()), "HOROVOD_GLOO_TIMEOUT_SECONDS": "360",
    }  # fmt: skip
    for name, bad in (("cycle_time_ms", -1.0), ("start_timeout", 0)):
        with pytest.raises(ValueError, match=f"--{name.replace('_', '-')} must be above 0"):
            build_launch(spec(), **{name: bad})
    with pytest.raises(ValueError, match="--fusion-threshold-mb must be 0 .no fusion. or more"):
        build_launch(spec(), fusion_threshold_mb=-1.0)
    assert build_launch(spec(), fusion_threshold_mb=0.0).env["HOROVOD_FUSION_THRESHOLD"] == "0"  # no fusion


@pytest.mark.parametrize(
    ("np_", "hosts", "cores", "threads"),
    [
        (2, (), 2, 1),
        (1, (), 2, 2),
        (4, (), 2, 1),
        (2, (Host("a", 1), Host("b", 1)), 8, 8),
        (2, (), 16, 8),
    ],
)
def test_threads_per_rank_fill_the_cores_without_oversubscribing(np_, hosts, cores, threads):
    assert threads_per_rank(np_, hosts, cores) == threads


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"np": 0}, "--np must be at least 1"),
        ({"np": 3, "hosts": (Host("a", 1), Host("b", 1))}, "exceeds the 2 slots"),
    ],
)
def test_bad_specs_are_value_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        build_launch(spec(**changes))


@pytest.mark.parametrize(
    ("options", "context", "message"),
    [
        ({"launcher": "ssh"}, None, "unknown launcher 'ssh'"),
        ({"launcher": "mpi"}, LaunchContext(), "--launcher mpi needs mpirun on PATH"),
        ({"stall_timeout": 0}, None, "--stall-timeout must be at least 1"),
    ],
)
def test_bad_horovod_options_are_value_errors(options, context, message):
    with pytest.raises(ValueError, match=message):
        build_launch(spec(), context, **options)


def test_render_is_a_copyable_shell_line():
    line = build_launch(spec(program=["python", "train.py", "--tag", "a b"])).render()
    assert line.startswith("HOROVOD_GLOO_TIMEOUT_SECONDS=360 HOROVOD_STALL_CHECK_TIME_SECONDS=240 ")
    assert line.endswith("python train.py --tag 'a b'")


def test_hosts_and_hostfile(tmp_path):
    assert parse_hosts("a:2, b") == (Host("a", 2), Host("b", 1))
    for bad in ("a:0", "a:x", ":2", ""):
        with pytest.raises(ValueError):
            parse_hosts(bad)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=4 max_slots=4\nnode2  # one slot\nnode_3.lan. slots=2\n")
    assert parse_hostfile(hostfile.read_text()) == (
        Host("node1", 4),
        Host("node2", 1),
        Host("node_3.lan.", 2),
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("localhost:1,localhost:1", "host localhost is listed twice"),
        ("localhost:1,127.0.0.1:1", "host 127.0.0.1 is listed twice (as localhost)"),
        ("a:1,A:2", "host A is listed twice"),
        ("a b:2", "bad host 'a b:2'"),
        ("-x:1", "bad host '-x:1'"),
    ],
)
def test_duplicate_and_malformed_hosts_are_refused(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_hosts(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("node1 slots=2\nthis is not a host line\n", "hostfile line 2 'this is not a host line'"),
        ("node1 slots=x\n", "bad host on hostfile line 1"),
        ("node1 cpus=2\n", "hostfile line 1 'node1 cpus=2': expected 'HOST slots=N'"),
        ("node1\nnode1 slots=2\n", "host node1 is listed twice"),
        ("# nothing\n", "no hosts given"),
    ],
)
def test_garbage_hostfile_lines_are_refused_with_their_line(text, message):
    with pytest.raises(ValueError, match=message):
        parse_hostfile(text)


@pytest.mark.parametrize(
    ("lines", "failure"),
    [
        (["Process 1 exit with status code 3."], Failure(1, 3)),
        (
            ["mpirun noticed that process rank 3 with PID 1234 on node vm exited on signal 9 (Killed)."],
            Failure(3, -9),
        ),
        (["  Process name: [[18929,1],0]", "  Exit code:    3"], Failure(0, 3)),
        (["epoch 3/15 loss 0.2"], None),
    ],
)
def test_failed_rank_and_its_exit_code_are_read_from_either_launcher(lines, failure):
    patterns = [p for launcher in launchers.all_launchers().values() for p in launcher.failed_rank_patterns]
    assert first_failure(lines, patterns) == failure


def test_rank_stderr_tail_finds_padded_and_mpi_layouts(tmp_path):
    (tmp_path / "1" / "rank.1").mkdir(parents=True)
    (tmp_path / "1" / "rank.1" / "stderr").write_text("a\n\nboom\n")
    (tmp_path / "rank.03").mkdir()
    (tmp_path / "rank.03" / "stderr").write_text("x\n" * 30)
    assert rank_stderr_tail(tmp_path, 1) == ["a", "boom"]
    assert len(rank_stderr_tail(tmp_path, 3)) == 15
    assert rank_stderr_tail(tmp_path, 7) == []


@pytest.mark.parametrize(
    ("measured", "mpirun_found", "chosen"),
    [
        ({}, True, "mpi"),
        ({}, False, "gloo"),
        ({"torch": {"gloo": 900.0, "mpi": 1100.0}}, True, "mpi"),
        ({"torch": {"gloo": 1200.0, "mpi": 1100.0}}, True, "gloo"),
        ({"torch": {"gloo": 900.0, "mpi": 1100.0}}, False, "gloo"),
        ({"tensorflow": {"gloo": 1.0}}, True, "mpi"),
    ],
)
def test_auto_launcher_picks_the_measured_fastest(measured, mpirun_found, chosen):
    available = {"gloo", "mpi"} if mpirun_found else {"gloo"}
    assert launchers.choose(measured, "torch", available) == chosen
    context = LaunchContext(
        executables=frozenset({"mpirun"} if mpirun_found else ()), measured_launchers=measured
    )
    horovod = strategies.get("horovod", "torch")
    launch = horovod.launch(spec(), {**HOROVOD_OPTIONS, "launcher": "auto"}, context)
    assert launch.launcher == chosen and launch.notes[0].startswith(
        f"hvdtrain: --launcher auto chose {chosen}"
    )


def test_threads_per_rank_override_and_ddp_launch():
    from hvdtrain.strategies import ddp, dp

    assert build_launch(spec(), LaunchContext(threads_per_rank=3)).env["OMP_NUM_THREADS"] == "3"
    context = LaunchContext(cores_per_host=2, free_port=1234)
    launch = ddp.launch(spec(program=["py", "-m", "hvdtrain.worker", "--recipe", "r"]), {}, context)
    command = launch.command
    assert command.argv == [
        "py",
        "-m",
        "hvdtrain.launching.torchrun",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        "1234",
        "--log-dir",
        "run/logs",
        "--tee",
        "3",
        "-m",
        "hvdtrain.worker",
        "--recipe",
        "r",
    ]
    assert command.env == {"OMP_NUM_THREADS": "1", "HVDTRAIN_THREADS_PER_RANK": "1"}, "no HOROVOD_* for DDP"
    torchrun = ["rank      : 0 (local_rank: 0)", "Root Cause (first observed failure):"]
    torchrun += ["  rank      : 1 (local_rank: 1)", "  exitcode  : 3 (pid: 7)"]
    assert first_failure(torchrun, launch.failed_rank_patterns) == Failure(1, 3)
    with pytest.raises(ValueError, match="ddp across hosts runs the same number of ranks on each"):
        ddp.launch(spec(np=3, hosts=(Host("a", 2), Host("b", 2))), {}, context)
    with pytest.raises(ValueError, match="starts torchrun on each host with Open MPI's mpirun"):
        ddp.launch(spec(hosts=(Host("a", 1), Host("b", 1))), {}, context)
    single = dp.launch(spec(np=4), {}, LaunchContext(cores_per_host=8)).command
    assert (
        single.argv == PROGRAM
        and single.env["HVDTRAIN_DP_DEVICES"] == "4"
        and single.env["OMP_NUM_THREADS"] == "8"
    )


def test_rank_json_records_survive_launcher_tags(tmp_path):
    from hvdtrain.launching.rank_output import rank_json_records

    (tmp_path / "1" / "rank.0").mkdir(parents=True)
    (tmp_path / "1" / "rank.0" / "stdout").write_text(
        '[1,0]<stdout>:{"rank": 0, "x": [1]}[1,0]<stdout>:\nnoise {\n'
    )
    (tmp_path / "rank.1").mkdir()
    (tmp_path / "rank.1" / "stdout").write_text('[1]<stdout>:epoch 1\n[1]<stdout>:{"rank": 1}\n')
    assert sorted(rank_json_records(tmp_path), key=lambda r: r["rank"]) == [
        {"rank": 0, "x": [1]},
        {"rank": 1},
    ]


def test_lines_open_mpi_tags_in_pieces_come_back_whole():
    from hvdtrain.launching.rank_output import WholeLines, piece_tag

    whole = WholeLines(piece_tag())
    got = [
        whole.feed("[1,1]<stderr>:half a[1,0]<stderr>:rank 0's line\n"),
        whole.feed("[1,1]<stderr>: line[1,1]<stderr>:\n"),
        whole.feed("mpirun: its own[1,0]<stdout>:one\n"),
        whole.feed("[1,0]<stdout>:two\n"),
        whole.feed("[0]<stderr>:horovodrun's tag is per line[0]<stderr>: as it reads\n"),
        whole.feed("[1,0]<stderr>:never ended[1,1]<stderr>:the last line"),
        whole.rest(),
    ]
    assert got == [
        ["[1,0]<stderr>:rank 0's line\n"],
        ["[1,1]<stderr>:half a line\n"],
        ["mpirun: its own\n", "[1,0]<stdout>:one\n"],
        ["[1,0]<stdout>:two\n"],
        ["[0]<stderr>:horovodrun's tag is per line[0]<stderr>: as it reads\n"],
        ["[1,1]<stderr>:the last line"],
        ["[1,0]<stderr>:never ended\n"],
    ]


def test_elastic_runs_horovodrun_between_min_and_max_with_a_cooldown_and_no_stall_shutdown():
    hosts = (Host("a", 1), Host("b", 1))
    command = build_launch(spec(hosts=hosts, network_interface="eth0"), launcher="auto", min_np=1, max_np=2)
    argv = command.argv
    assert argv[:8] == ["horovodrun", "-np", "2", "--min-np", "1", "--max-np", "2", "-H"]
    assert argv[argv.index("-H") + 1] == "a:1,b:1"
    assert argv[argv.index("--blacklist-cooldown-range") + 1 :][:2] == ["5", "30"]
    assert argv[argv.index("--network-interface") + 1] == "eth0"
    assert (
        command.env["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "120" and command.env["HVDTRAIN_COMMIT_EVERY"] == "10"
    )
    assert "HVDTRAIN_STALL_TIMEOUT" not in command.env, "a rank waiting through a reset is not stalled"
    assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" not in command.env
    script = build_launch(spec(np=1), launcher="elastic", min_np=1, max_np=4, host_discovery_script="/d.sh")
    assert script.argv[script.argv.index("--host-discovery-script") + 1] == "/d.sh"
    assert "-H" not in script.argv


@pytest.mark.parametrize(
    ("changes", "options", "message"),
    [
        ({}, {"min_np": 1}, "elastic training needs two or more hosts"),
        ({"hosts": (Host("a", 1), Host("b", 1))}, {"min_np": 3, "max_np": 4}, "--np 2 must lie between"),
        ({"hosts": (Host("a", 1), Host("b", 1))}, {"min_np": 2, "max_np": 1}, "need 1 <= min-np <= max-np"),
        ({"hosts": (Host("a", 1),)}, {"host_discovery_script": "/d"}, "not both"),
        ({}, {"min_np": 1, "launcher": "mpi"}, "not --launcher mpi"),
        ({"hosts": (Host("a", 1), Host("b", 1))}, {"min_np": 1, "commit_every": 0}, "--commit-every"),
    ],
)
def test_bad_elastic_requests_are_value_errors(changes, options, message):
    with pytest.raises(ValueError, match=message):
        build_launch(spec(**changes), **{"launcher": "auto", **options})


def test_elastic_refuses_keras_and_auto_never_picks_it():
    keras = strategies.get("horovod", "tensorflow")
    with pytest.raises(ValueError, match="elastic training runs torch recipes"):
        keras.launch(
            spec(),
            {**HOROVOD_OPTIONS, "min_np": 1, "launcher": "auto"},
            LaunchContext(framework="tensorflow"),
        )
    assert launchers.choose({}, "torch", {"elastic", "gloo"}) == "gloo"


def test_mpirun_and_its_daemons_keep_their_listeners_on_the_runs_interface():
    library = "/venv/lib/hvdtrain/bindto-0.so"
    context = LaunchContext(cores_per_host=2, executables=frozenset({"mpirun"}), bind_library=library)
    one_host = build_launch(spec(), context, launcher="mpi")
    assert one_host.env["LD_PRELOAD"] == library and one_host.env["HVDTRAIN_BIND_INTERFACE"] == "lo"
    assert "orte_launch_agent" not in one_host.argv, "no daemons on one host"
    assert "LD_PRELOAD" not in one_host.argv and not any("BIND_INTERFACE" in a for a in one_host.argv)
    hosts = (Host("a", 1), Host("b", 1))
    several = build_launch(spec(hosts=hosts, network_interface="eth1"), context, launcher="mpi")
    agent = f"env LD_PRELOAD={library} HVDTRAIN_BIND_INTERFACE=eth1 orted"
    assert several.argv[several.argv.index("orte_launch_agent") + 1] == agent
    assert [several.argv[i + 1] for i, a in enumerate(several.argv) if a == "-x"][:2] == [
        f"LD_PRELOAD={library}",
        "HVDTRAIN_BIND_INTERFACE=eth1",
    ], "the ranks' TCP BTL binds every interface too"
    unnamed = build_launch(spec(hosts=hosts), context, launcher="mpi")
    assert "LD_PRELOAD" not in unnamed.env, "no interface chosen: Open MPI's own choice"
    without = build_launch(spec(), LaunchContext(executables=frozenset({"mpirun"})), launcher="mpi")
    assert "LD_PRELOAD" not in without.env


def test_ddp_across_hosts_runs_torchrun_once_on_each_host():
    """Over ssh mpirun starts one torchrun a host (its rank is the node rank), untagged: torchrun tags
    each worker's line with its global rank; inside Slurm srun does, one task a node."""
    from hvdtrain.launching.slurm import Allocation
    from hvdtrain.strategies import ddp

    program = ["py", "-m", "hvdtrain.worker", "--recipe", "r"]
    hosts = (Host("a", 2), Host("b", 2))
    torchrun = ["py", "-m", "hvdtrain.launching.torchrun", "--nnodes", "2", "--nproc-per-node", "2"]
    torchrun += ["--master-addr", "a", "--master-port", "1234", "--tee", "3", "-m", "hvdtrain.worker"]
    context = LaunchContext(
        cores_per_host=4, free_port=1234, executables=frozenset({"mpirun"}), run_as_root=True,
        bind_library="/lib/bindto.so", allreduce_rules="/rules.conf",
    )  # fmt: skip
    over_ssh = ddp.launch(spec(np=4, hosts=hosts, program=program, network_interface="eth0"), {}, context)
    argv, env = over_ssh.command.argv, over_ssh.command.env
    assert argv[:6] == ["mpirun", "--allow-run-as-root", "-np", "2", "-H", "a:1,b:1"]
    assert "--tag-output" not in argv and "--output-filename" not in argv
    assert "LD_PRELOAD" not in env and "/rules.conf" not in " ".join(argv), "torchrun is not Horovod"
    at = argv.index("bash")
    assert argv[at + 1] == "-c" and argv[at + 3] == "run/logs" and argv[at + 4 :][: len(torchrun)] == torchrun
    shown = 'echo "$PET_NODE_RANK $PET_LOG_DIR"'
    for where, expected in [
        ({"OMPI_COMM_WORLD_RANK": "1"}, "1 /logs/ranks.2"),  # mpirun's task id follows -H
        (
            {"SLURMD_NODENAME": "c", "HVDTRAIN_DDP_NODES": "b,c,a"},
            "1 /logs/ranks.2",
        ),  # srun's order is Slurm's
    ]:
        given = {"PET_NPROC_PER_NODE": "2", "PATH": "/usr/bin:/bin", **where}
        done = subprocess.run(
            ["bash", "-c", argv[at + 2], "/logs", "sh", "-c", shown],
            env=given,
            capture_output=True,
            text=True,
        )
        assert done.stdout.strip() == expected, (where, done.stdout, done.stderr)
    assert env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == "[default${rank}]:"
    assert (env["OMP_NUM_THREADS"], env["PET_NPROC_PER_NODE"], env["GLOO_SOCKET_IFNAME"]) == (
        "2",
        "2",
        "eth0",
    )
    assert argv[argv.index("GLOO_SOCKET_IFNAME") - 1 :][:2] == ["-x", "GLOO_SOCKET_IFNAME"]
    inside = replace(context, allocation=Allocation("7", ("a", "b"), (2, 2), 3))
    in_slurm = ddp.launch(spec(np=4, hosts=hosts, program=program), {}, inside).command.argv
    assert in_slurm[:6] == [
        "srun",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--nodelist=a,b",
        "--cpus-per-task=6",
    ]

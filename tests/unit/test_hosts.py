"""Several hosts, planned without ssh: which hosts are other machines, how ssh reaches them, and what
is copied to and from them (the commands themselves run in tests/integration/test_multihost.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_plan import facts

from hvdtrain import native
from hvdtrain.job.plan import plan_run
from hvdtrain.job.request import RunRequest
from hvdtrain.launching import remote
from hvdtrain.launching.spec import Host
from hvdtrain.worker import threads_here


def gloo(**changes) -> RunRequest:
    return RunRequest("digits-mlp-torch", strategy_options={"launcher": "gloo"}, **changes)


def test_np_defaults_to_the_hosts_slots_and_other_hosts_are_the_non_local_ones():
    plan = plan_run(gloo(hosts="me:2,a:1,b:3"), facts())
    assert plan.command.argv[plan.command.argv.index("-np") + 1] == "6"
    assert plan.remote_hosts == ("a", "b"), "me resolves to an address of this machine"
    assert plan.rank_hosts == ("me", "me", "a", "b", "b", "b")
    assert plan.command.env["HVDTRAIN_THREADS_PER_RANK"] == "auto"
    assert plan.command.env["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "360"
    local = plan_run(gloo(hosts="localhost:2"), facts())
    assert local.remote_hosts == () and local.command.env["HVDTRAIN_THREADS_PER_RANK"] == "1"


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (gloo(hosts="a:1,nowhere:1"), "host nowhere does not resolve to an address"),
        (gloo(np=2, ssh_port=2222), "--ssh-port applies to runs on other hosts"),
        (gloo(np=2, ssh_identity_file="/k"), "--ssh-identity-file applies to runs on other hosts"),
        (gloo(hosts="a:1", ssh_port=0), "--ssh-port must be a port number"),
        (gloo(hosts="a:1,b:1", image="hvdtrain:cpu"), "--image runs on this host only"),
    ],
)
def test_bad_multi_host_requests_are_refused_before_anything_starts(request_, message):
    with pytest.raises(ValueError, match=message):
        plan_run(request_, facts(container_engine="docker"))


def test_ssh_options_go_with_a_discovery_script_whose_hosts_are_found_as_the_job_runs():
    discovered = RunRequest(
        "digits-mlp-torch",
        np=2,
        ssh_port=2222,
        strategy_options={"min_np": 2, "max_np": 3, "host_discovery_script": "/bin/discover"},
    )
    argv = plan_run(discovered, facts()).command.argv
    assert argv[argv.index("--ssh-port") + 1] == "2222" and "--host-discovery-script" in argv


def test_ranks_get_the_config_and_absolute_paths_not_a_shared_disk():
    plan = plan_run(gloo(hosts="a:1,b:1", overrides=("epochs=3",), run_dir=Path("r")), facts())
    argv = plan.command.argv
    assert json.loads(argv[argv.index("--config") + 1])["epochs"] == 3
    assert argv[argv.index("--run-dir") + 1] == "/work/r"
    assert argv[argv.index("--output-filename") + 1] == "/work/r/logs"


def test_ssh_options_keep_alive_and_never_prompt():
    argv = remote.Ssh(2222, "/k/id").command("h1", "true")
    assert argv[0] == "ssh" and argv[-2:] == ["h1", "true"]
    line = " ".join(argv)
    for option in ("BatchMode=yes", "ServerAliveInterval=5", "ServerAliveCountMax=3", "ConnectTimeout=5"):
        assert option in line
    assert "-p 2222 -i /k/id" in line
    assert "-p" not in remote.Ssh().args()


def test_rank_hosts_fill_each_hosts_slots_in_order():
    assert remote.rank_hosts((Host("a", 2), Host("b", 2)), 3) == ["a", "a", "b"]


def test_stage_and_collect_commands_round_trip_a_run_directory(tmp_path):
    """The remote halves run here through sh: what collect packs, stage unpacks, the marker left out."""
    source, target = tmp_path / "here", tmp_path / "there"
    (source / "logs").mkdir(parents=True)
    (source / "checkpoint.pt").write_bytes(b"weights")
    (source / "logs" / "rank.0").write_text("log")
    (source / remote.MARKER).write_text("token")
    packed = subprocess.run(["sh", "-c", remote.collect_command(source)], capture_output=True, check=True)
    subprocess.run(["sh", "-c", remote.stage_command(target)], input=packed.stdout, check=True)
    assert (target / "checkpoint.pt").read_bytes() == b"weights"
    assert (target / "logs" / "rank.0").read_text() == "log"
    assert not (target / remote.MARKER).exists()
    missing = subprocess.run(["sh", "-c", remote.collect_command(tmp_path / "nope")], capture_output=True)
    assert missing.returncode == 0 and missing.stdout == b""


def test_the_probe_reports_versions_and_whether_the_run_directory_is_shared(tmp_path):
    (tmp_path / remote.MARKER).write_text("t")
    found = subprocess.run(
        ["sh", "-c", remote.probe_command(sys.executable, tmp_path)], capture_output=True, check=True
    )
    answer = json.loads(found.stdout)
    assert answer["marker"] == "t" and answer["cores"] >= 1 and answer["hvdtrain"]
    assert "bind_library" not in answer, "built on a host only where mpirun will preload it"
    with_library = remote.probe_command(sys.executable, tmp_path, bind_library=True)
    answer = json.loads(subprocess.run(["sh", "-c", with_library], capture_output=True, check=True).stdout)
    assert answer["bind_library"] == str(native.bind_library()[0])


@pytest.mark.parametrize(
    ("environ", "threads"),
    [
        ({"HVDTRAIN_THREADS_PER_RANK": "auto", "HOROVOD_LOCAL_SIZE": "2"}, "4"),
        ({"HVDTRAIN_THREADS_PER_RANK": "auto", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, "2"),
        ({"HVDTRAIN_THREADS_PER_RANK": "auto", "HOROVOD_LOCAL_SIZE": "16"}, "1"),
        ({"HVDTRAIN_THREADS_PER_RANK": "3"}, None),
    ],
)
def test_each_rank_divides_its_own_hosts_cores(environ, threads):
    found = threads_here(environ, cores=8)
    assert found.get("OMP_NUM_THREADS") == threads and found.get("HVDTRAIN_THREADS_PER_RANK") == threads


def test_a_restart_resumes_the_same_run_without_the_lost_hosts(tmp_path):
    import zipfile

    from hvdtrain.job.restarts import restart_request
    from hvdtrain.launching.runner import LaunchResult

    request = gloo(
        hosts="a:1,b:1", overrides=("epochs=3",), variant="debug", run_dir=tmp_path, max_restarts=2
    )
    plan = plan_run(request, facts())
    lost = LaunchResult(1, None, [], 1.0, lost_hosts={"b": "host b did not answer over ssh within 20 s"})
    fresh = restart_request(request, plan, lost)
    assert (fresh.resume, fresh.overrides, fresh.variant) == (False, ("epochs=3",), "debug"), "no epoch saved"
    assert (fresh.hosts, fresh.np) == ("a:1", 1)
    with zipfile.ZipFile(tmp_path / "checkpoint.pt", "w") as archive:
        archive.writestr("data.pkl", b"x")
    resumed = restart_request(request, plan, lost)
    assert (resumed.resume, resumed.overrides, resumed.variant, resumed.run_dir) == (True, (), None, tmp_path)
    crashed = restart_request(request, plan, LaunchResult(1, None, [], 1.0))
    assert (crashed.hosts, crashed.np) == ("a:1,b:1", None), "a rank that failed on a host that answers"
    everyone = LaunchResult(1, None, [], 1.0, lost_hosts={"a": "x", "b": "y"})
    assert restart_request(request, plan, everyone).hosts == "a:1,b:1", "none left: try them all"


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (gloo(max_restarts=-1), "--max-restarts must be 0 or more"),
        (RunRequest("train.py", max_restarts=1), "--max-restarts apply to recipes, not to scripts"),
    ],
)
def test_bad_restart_requests(request_, message):
    with pytest.raises(ValueError, match=message):
        plan_run(request_, facts(script_text="import horovod.torch as hvd\n"))

"""--launcher ray: the argv of hvdtrain's Ray driver is a pure function of the plan; what Ray cannot run
is refused before anything starts; the driver's own pieces that need no cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from test_launch import STATIC_ENV  # noqa: E402

from hvdtrain import launchers, strategies
from hvdtrain.building.horovod_wheel import read_versions  # noqa: E402
from hvdtrain.job.facts import Facts, gather_facts
from hvdtrain.job.plan import plan_run
from hvdtrain.job.request import RunRequest
from hvdtrain.launchers import ray, ray_driver
from hvdtrain.launchers.ray import FAILED_RANK, NEEDS_RAY
from hvdtrain.launching.spec import Host, LaunchSpec, first_failure
from hvdtrain.measure import doctor
from hvdtrain.strategies import LaunchContext

PYTHON = "/venv/bin/python"
PROGRAM = [PYTHON, "-m", "hvdtrain.worker", "--recipe", "r"]
DRIVER = [PYTHON, "-m", "hvdtrain.launchers.ray_driver"]
RAY_HERE = LaunchContext(cores_per_host=2, modules=frozenset({"ray"}))


def passed_on(env) -> list[str]:
    return [arg for name in sorted(env) for arg in ("--env", name)]


def spec(**changes) -> LaunchSpec:
    return LaunchSpec(**{"program": PROGRAM, "np": 2, "log_dir": "run/logs", "forward_env": (), **changes})


def launch(spec_: LaunchSpec, context: LaunchContext = RAY_HERE, framework: str = "torch", **options):
    horovod = strategies.get("horovod", framework)
    defaults = {option.name: option.default for option in horovod.options}
    context = LaunchContext(**{**context.__dict__, "framework": framework})
    return horovod.launch(spec_, {**defaults, "launcher": "ray", **options}, context)


@pytest.mark.parametrize(
    ("spec_", "options", "argv"),
    [
        (  # a Ray started for the run: one CPU per rank (2 cores, 2 ranks), loopback
            spec(),
            {},
            [*DRIVER, "--np", "2", "--cpus-per-rank", "1", "--log-dir", "run/logs"],
        ),
        (  # an existing cluster, its NIC; threads per rank from the user
            spec(np=4, network_interface="eth0"),
            {"ray_address": "10.0.0.5:6379"},
            [*DRIVER, "--np", "4", "--cpus-per-rank", "1", "--address", "10.0.0.5:6379"]
            + ["--network-interface", "eth0", "--log-dir", "run/logs"],
        ),
        (  # elastic: --max-np defaults to --np
            spec(),
            {"min_np": 1},
            [*DRIVER, "--np", "2", "--cpus-per-rank", "1", "--min-np", "1", "--max-np", "2"]
            + ["--log-dir", "run/logs"],
        ),
        (
            spec(np=2, network_interface="hvd0"),
            {"min_np": 1, "max_np": 3, "ray_address": "10.77.0.2:6379"},
            [*DRIVER, "--np", "2", "--cpus-per-rank", "1", "--address", "10.77.0.2:6379"]
            + ["--min-np", "1", "--max-np", "3", "--network-interface", "hvd0", "--log-dir", "run/logs"],
        ),
    ],
)
def test_ray_argv_table(spec_, options, argv):
    command = launch(spec_, **options).command
    assert command.argv == [*argv, *passed_on(command.env), "--", *PROGRAM[1:]]


def test_static_ranks_get_the_horovod_env_and_elastic_ones_no_stall_shutdown():
    static = launch(spec())
    assert static.command.env == STATIC_ENV and static.launcher == "ray"
    assert static.failed_rank_patterns == (FAILED_RANK,)
    elastic = launch(spec(), min_np=1, commit_every=5).command.env
    assert elastic["HVDTRAIN_COMMIT_EVERY"] == "5" and elastic["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "120"
    assert "HVDTRAIN_STALL_TIMEOUT" not in elastic and "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" not in elastic


def test_threads_per_rank_are_ray_cpus_and_forwarded_variables_are_passed_on_but_rays_own():
    spec_ = spec(np=2, forward_env=("PATH", "RAY_AUTH_MODE", "HOROVOD_CYCLE_TIME"))
    command = launch(spec_, LaunchContext(cores_per_host=8, threads_per_rank=3, modules=frozenset({"ray"})))
    argv = command.command.argv
    assert argv[argv.index("--cpus-per-rank") + 1] == "3"
    names = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--env"]
    assert names == [*sorted(command.command.env), "PATH", "HOROVOD_CYCLE_TIME"]


@pytest.mark.parametrize(
    ("spec_", "options", "message"),
    [
        (spec(), {"launcher": "gloo", "ray_address": "a:1"}, "--ray-address applies to --launcher ray"),
        (spec(), {"launcher": "auto", "ray_address": "a:1"}, "--ray-address applies to --launcher ray"),
        (spec(), {"launcher": "mpi", "min_np": 1}, "not --launcher mpi"),
        (spec(hosts=(Host("a", 1), Host("b", 1))), {}, "give --ray-address, not --hosts"),
        (spec(), {"host_discovery_script": "/d.sh"}, "Ray finds its nodes itself"),
        (spec(), {"min_np": 3, "max_np": 4}, "--np 2 must lie between"),
        (spec(), {"min_np": 2, "max_np": 1}, "need 1 <= min-np <= max-np"),
        (
            spec(network_interface="eth0"),
            {},
            "--network-interface applies to --launcher ray with --ray-address",
        ),
        (
            spec(),
            {"min_np": 1, "ray_address": "10.0.0.5:1"},
            "elastic training on a Ray cluster needs --network",
        ),
        (spec(program=[PYTHON, "-m", "other"]), {}, "--launcher ray runs -m hvdtrain.worker"),
        (spec(), {"ray_address": "ray://head:10001"}, "Ray Client, ray://, is not supported"),
    ],
)
def test_what_ray_cannot_run_is_refused(spec_, options, message):
    with pytest.raises(ValueError, match=message):
        launch(spec_, **options)


RESOLVED = LaunchContext(
    cores_per_host=2, modules=frozenset({"ray"}), host_addresses={"head": "10.0.0.9", "nope": None}
)


@pytest.mark.parametrize(
    ("address", "problem"),
    [
        ("nope:xx", "port 'xx' is not a port number (1-65535)"),
        ("head:0", "port '0' is not a port number (1-65535)"),
        ("head:65536", "port '65536' is not a port number (1-65535)"),
        ("head:", "port '' is not a port number (1-65535)"),
        ("head", "give the cluster's HOST:PORT (no port)"),
        (":6379", "give the cluster's HOST:PORT (no host)"),
        ("nope:6379", "host 'nope' does not resolve to an address"),
        ("unlooked:6379", "host 'unlooked' does not resolve to an address"),
        ("ray://head:10001", "give the cluster's HOST:PORT (Ray Client, ray://, is not supported)"),
    ],
)
def test_a_ray_address_is_host_port_with_a_port_number_and_a_host_that_resolves(address, problem):
    with pytest.raises(ValueError) as refused:
        launch(spec(), RESOLVED, ray_address=address)
    assert str(refused.value) == f"--ray-address {address!r}: {problem}"


@pytest.mark.parametrize("address", ["head:6379", "10.0.0.5:1", "[::1]:65535", "auto"])
def test_a_ray_address_that_names_a_cluster_is_passed_on(address):
    argv = launch(spec(), RESOLVED, ray_address=address).command.argv
    assert argv[argv.index("--address") + 1] == address


def test_the_ray_address_host_is_a_fact_looked_up_before_planning_which_refuses_one_not_resolving():
    asked = {"launcher": "ray", "ray_address": "localhost:6379"}
    found = gather_facts(RunRequest("digits-mlp-torch", dry_run=True, strategy_options=asked))
    assert found.host_addresses == {"localhost": "127.0.0.1"}
    assert ray.named_hosts({"ray_address": "10.0.0.5:6379"}) == ray.named_hosts({"ray_address": "auto"}) == ()
    request = RunRequest("digits-mlp-torch", np=2, run_dir=Path("r"), strategy_options=asked)
    here = facts(modules=frozenset({"ray"}), host_addresses={"localhost": None})
    with pytest.raises(ValueError, match="--ray-address 'localhost:6379': host 'localhost' does not resolve"):
        plan_run(request, here)
    assert plan_run(request, replace(here, host_addresses=found.host_addresses)).launcher == "ray"


def test_elastic_on_ray_runs_torch_recipes_only():
    with pytest.raises(ValueError, match="elastic training runs torch recipes"):
        launch(spec(), framework="tensorflow", min_np=1)
    assert launch(spec(), framework="tensorflow").launcher == "ray"


def test_without_ray_installed_it_is_one_line():
    with pytest.raises(ValueError) as refused:
        launch(spec(), LaunchContext(cores_per_host=2))
    assert str(refused.value) == "--launcher ray needs Ray: pip install 'hvdtrain[ray]'" == NEEDS_RAY


def test_auto_never_picks_ray_even_when_measured_fastest():
    assert launchers.choose({}, "torch", {"ray", "gloo"}) == "gloo"
    assert launchers.choose({"torch": {"ray": 1e9, "gloo": 1.0}}, "torch", {"ray", "gloo"}) == "gloo"
    assert launch(spec(), launcher="auto").launcher != "ray"


def facts(**changes) -> Facts:
    values = {
        "cores": 2,
        "python": PYTHON,
        "horovodrun": "/venv/bin/horovodrun",
        "executables": frozenset(),
        "measured_launchers": {},
        "uid": 1000,
        "gid": 1000,
        "cwd": Path("/work"),
        "environ": {"PATH": "/usr/bin", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "s3cr3t"},
        "free_port": 40123,
        "timestamp": "20261130-120000",
    }
    return Facts(**{**values, **changes})


def test_the_plan_runs_the_driver_with_the_workers_argv_where_ray_is_importable():
    request = RunRequest("digits-mlp-torch", np=2, run_dir=Path("r"), strategy_options={"launcher": "ray"})
    plan = plan_run(request, facts(modules=frozenset({"ray"})))
    argv = plan.command.argv
    assert plan.launcher == "ray" and argv[:3] == DRIVER
    worker = argv[argv.index("--") + 1 :]
    assert worker[:6] == ["-m", "hvdtrain.worker", "--recipe", "digits-mlp-torch", "--run-dir", "/work/r"]
    assert json.loads(worker[worker.index("--config") + 1])["epochs"] == 15
    assert plan.environment["RAY_AUTH_MODE"] == "token", "the driver joins a cluster the user's way"
    assert "RAY_AUTH_TOKEN" not in plan.environment, "a token is passed on only when --env names it"
    with pytest.raises(ValueError, match=r"pip install 'hvdtrain\[ray\]'"):
        plan_run(request, facts())


def test_ray_being_importable_is_a_fact_found_without_importing_it():
    found = gather_facts(RunRequest("digits-mlp-torch", dry_run=True))
    assert found.modules == frozenset({"ray"})
    assert "ray" not in sys.modules


def test_the_driver_takes_the_workers_argv_after_its_own():
    args = ray_driver.parse_args(
        ["--np", "2", "--env", "A", "--env", "B", "--", "-m", "hvdtrain.worker", "--recipe", "r", "--np", "9"]
    )
    assert (args.np, args.env, args.worker_argv) == (2, ["A", "B"], ["--recipe", "r", "--np", "9"])
    with pytest.raises(SystemExit):
        ray_driver.parse_args(["--np", "2", "--", "-m", "something.else"])


def test_the_ranks_find_the_rendezvous_at_this_hosts_address_toward_the_cluster():
    """Not horovod.ray's guesses (Ray's default-route address; gethostbyname(gethostname()))."""
    assert ray_driver.rendezvous_address("127.0.0.1:6379") == "127.0.0.1"
    assert ray_driver.rendezvous_address("localhost:6379") == "127.0.0.1"
    assert ray_driver.rendezvous_address("auto") is None, "Horovod's choice stands"


def test_the_failed_rank_line_is_what_the_launcher_reads(capsys):
    ray_driver.report_failure(1, 3)
    line = capsys.readouterr().out
    assert first_failure([line], [FAILED_RANK]).rank == 1
    assert first_failure([line], [FAILED_RANK]).exit_code == 3


def test_the_driver_without_ray_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # what an environment without Ray imports
    monkeypatch.setenv(ray_driver.LOOPBACK_RAY, "1")  # restored after: later Ray tests must not see 0
    assert ray_driver.main(["--np", "1", "--", "-m", "hvdtrain.worker", "--recipe", "r"]) == 2
    assert capsys.readouterr().err.strip() == f"hvdtrain: {NEEDS_RAY}"
    assert os.environ[ray_driver.LOOPBACK_RAY] == "0", "one host: on loopback, whatever was set"
    monkeypatch.setenv(ray_driver.LOOPBACK_RAY, "1")
    joined = ["--np", "1", "--address", "10.0.0.1:6379", "--", "-m", "hvdtrain.worker", "--recipe", "r"]
    assert ray_driver.main(joined) == 2
    assert os.environ[ray_driver.LOOPBACK_RAY] == "1", "a cluster joined is left as it was started"


TEE_THEN_DIE = """
import os, sys
from pathlib import Path
from hvdtrain.launchers.ray_driver import tee_output
with tee_output(Path(sys.argv[1]), append=False, rank="1"):
    print("from python")
    os.write(2, b"from the C side\\n")
    print("hvdtrain: stall: the last line", file=sys.stderr)
    os._exit(75)
"""


def test_a_rank_that_dies_abruptly_still_leaves_its_last_lines_in_its_files(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", TEE_THEN_DIE, str(tmp_path / "rank.1")], capture_output=True, text=True
    )
    assert done.returncode == 75
    assert (tmp_path / "rank.1" / "stdout").read_text() == "from python\n"
    assert (tmp_path / "rank.1" / "stderr").read_text() == "from the C side\nhvdtrain: stall: the last line\n"
    assert "[1]<stderr>:hvdtrain: stall: the last line" in done.stderr, (
        "and, tagged, on the actor's own stream"
    )


def test_tee_output_restores_the_streams_and_appends_for_elastic_ranks(tmp_path, capfd):
    for word in (b"one\n", b"two\n"):
        with ray_driver.tee_output(tmp_path, append=True, rank="3"):
            os.write(1, word)
    os.write(1, b"after\n")
    assert (tmp_path / "stdout").read_text() == "one\ntwo\n"
    assert capfd.readouterr().out == "[3]<stdout>:one\n[3]<stdout>:two\nafter\n"


def test_doctor_reports_rays_version_without_importing_it(monkeypatch):
    real = doctor.installed_version  # with Horovod reported missing, doctor probes no extension
    monkeypatch.setattr(doctor, "installed_version", lambda name: None if name == "horovod" else real(name))
    monkeypatch.setattr(doctor, "mpi_version", lambda: None)
    report = doctor.collect()
    assert report.versions["ray"] == read_versions()["RAY_VERSION"]
    assert "ray" not in sys.modules
    report.versions["ray"] = None
    assert "    ray        not installed" in doctor.render(report, []).splitlines()

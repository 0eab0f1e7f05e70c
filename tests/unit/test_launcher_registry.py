"""A launcher is one module: its options, tags, rank logs, failure lines and local-size variable reach
the CLI, the console, the runner and the log readers through the registry alone."""

from __future__ import annotations

import re
import textwrap

import click
import pytest
from click.testing import CliRunner

from hvdtrain import launchers
from hvdtrain.cli import main
from hvdtrain.launching import console, rank_output
from hvdtrain.launching.spec import LaunchSpec
from hvdtrain.strategies import LaunchContext, get


def run_help() -> str:
    return " ".join(CliRunner().invoke(main, ["run", "--help"], terminal_width=400).output.split())


def test_launcher_choices_and_every_launcher_option_come_from_the_registry():
    command = main.commands["run"]
    choice = next(param for param in command.params if param.name == "launcher").type
    assert isinstance(choice, click.Choice)
    assert tuple(choice.choices) == (launchers.AUTO, *launchers.names())
    assert set(launchers.names()) >= {"elastic", "gloo", "mpi", "ray"}
    text = run_help()
    for name, (option, readers) in launchers.all_options().items():
        assert f"{option.flag} " in text, name
        assert f"[--launcher {', '.join(readers)}] {option.help}" in text
    assert launchers.all_options()["ray_address"][1] == ["ray"]
    assert launchers.all_options()["min_np"][1] == ["elastic", "ray"]


def test_an_option_of_another_launcher_is_refused_naming_its_readers():
    spec = LaunchSpec(program=["python", "-m", "hvdtrain.worker"], np=2)
    horovod = get("horovod", "torch")
    options = {option.name: option.default for option in horovod.options}
    context = LaunchContext(cores_per_host=2, executables=frozenset({"mpirun"}))
    with pytest.raises(ValueError, match=r"^--ray-address applies to --launcher ray$"):
        horovod.launch(spec, {**options, "launcher": "mpi", "ray_address": "h:1"}, context)
    assert launchers.own_options(launchers.get("ray"), {"ray_address": None}) == {
        "min_np": None,
        "max_np": None,
        "ray_address": None,
    }


@pytest.fixture
def extra_launcher(tmp_path, monkeypatch):
    """A launcher module of its own, found by the registry like the shipped ones."""
    (tmp_path / "toyrun.py").write_text(
        textwrap.dedent(
            """
            import re
            from hvdtrain.launching.spec import LaunchCommand, RankOutput
            from hvdtrain.launchers import Launcher
            from hvdtrain.options import Option

            LAUNCHER = Launcher(
                name="toyrun",
                description="a launcher of the test's",
                build=lambda spec, context, options: LaunchCommand(["toyrun", str(spec.np)], spec.env),
                output=RankOutput(
                    tag=r"<toy (?P<rank>\\d+) (?P<stream>out|err)>", logs="toy/*/{stream}.txt"
                ),
                failed_rank_patterns=(re.compile(r"toy rank (\\d+) died"),),
                job_failing=(re.compile(r"toy: giving up"),),
                local_env=("TOY_LOCAL_RANK", "TOY_LOCAL_SIZE"),
                options=(Option("toy_level", "--toy-level", 1, "How toy.", int),),
            )
            """
        )
    )
    monkeypatch.setattr(launchers, "__path__", [*launchers.__path__, str(tmp_path)])
    for cached in (launchers.all_launchers, rank_output.rank_outputs, rank_output.rank_tag):
        cached.cache_clear()
    yield launchers.get("toyrun")
    monkeypatch.undo()
    for cached in (launchers.all_launchers, rank_output.rank_outputs, rank_output.rank_tag):
        cached.cache_clear()


def test_a_new_launcher_module_is_all_it_takes(extra_launcher, tmp_path):
    assert "toyrun" in launchers.names() and "toyrun: a launcher of the test's" in launchers.help_text()
    assert launchers.all_options()["toy_level"][1] == ["toyrun"]
    assert launchers.own_options(extra_launcher, {"toy_level": 3}) == {"toy_level": 3}
    with pytest.raises(ValueError, match="--toy-level applies to --launcher toyrun"):
        launchers.own_options(launchers.get("gloo"), {"toy_level": 3})
    # the console's one tag parser reads its tag beside the others'
    assert console.parse("<toy 3 err>boom") == console.Line(3, "stderr", "boom")
    assert console.parse("[1,2]<stdout>:hi") == console.Line(2, "stdout", "hi")
    assert re.fullmatch(rank_output.rank_tag(), "<toy 0 out>")
    # its rank logs and its local-size variable
    (tmp_path / "logs" / "toy" / "r5").mkdir(parents=True)
    (tmp_path / "logs" / "toy" / "r5" / "stderr.txt").write_text("x\n")
    (tmp_path / "logs" / "toy" / "r6").mkdir()
    (tmp_path / "logs" / "toy" / "r6" / "stderr.txt").write_text("y\n")
    assert rank_output.rank_output_files(tmp_path / "logs", "stderr") == {}  # "r5" names no rank
    (tmp_path / "logs" / "toy" / "7").mkdir()
    (tmp_path / "logs" / "toy" / "7" / "stderr.txt").write_text("z\n")
    assert set(rank_output.rank_output_files(tmp_path / "logs", "stderr")) == {7}
    assert launchers.local_size({"TOY_LOCAL_SIZE": "4"}) == 4
    assert launchers.local_size({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}) == 3

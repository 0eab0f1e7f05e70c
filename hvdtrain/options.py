"""The options of `hvdtrain run`, each declared once. An option that only some strategies or
launchers read (`Option`) is declared by its owner; the options every run reads (`RunOption`) are
`COMMON` below. The CLI's flags and help, `hvdtrain.run`'s keywords, `RunRequest`'s fields and the
`hvdtrain run` line `hvdtrain submit` writes into its batch script all come from these declarations."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Option:
    name: str
    """The key in the options mapping its owner gets, click's parameter name, hvdtrain.run's keyword."""
    flag: str
    default: Any
    help: str
    type: Any = str
    """str, int, bool (a flag), or a tuple of choices."""


def readers_of(owners: Iterable[tuple[str, tuple[Option, ...]]]) -> dict[str, tuple[Option, list[str]]]:
    """option name -> (the option, the names of the owners that read it), in declaration order."""
    found: dict[str, tuple[Option, list[str]]] = {}
    for owner, options in owners:
        for option in options:
            found.setdefault(option.name, (option, []))[1].append(owner)
    return found


def given_over_defaults(options: Iterable[Option], given: Mapping[str, Any]) -> dict[str, Any]:
    """Each option's value: what was given (not None), else its default."""
    return {
        option.name: given[option.name] if given.get(option.name) is not None else option.default
        for option in options
    }


@dataclass(frozen=True)
class RunOption:
    """An option every run reads: a field of RunRequest, a keyword of hvdtrain.run, and (with a
    flag) an `hvdtrain run` option that `hvdtrain submit` writes back into its batch script."""

    name: str
    """RunRequest's field, hvdtrain.run's keyword, click's parameter name."""
    flag: str | None
    """The command-line flag; None for the API's own keywords (and TARGET's script arguments)."""
    default: Any
    help: str
    kind: str
    """What the API takes: int, str, bool (a flag), path, strings (a repeated flag), hosts
    ('HOST:SLOTS,...' or a list) or overrides (a mapping, or 'KEY=VALUE' strings)."""
    annotation: str
    """RunRequest's field type."""
    metavar: str | None = None
    show_default: bool = False
    aliases: tuple[str, ...] = ()
    """Other spellings of the flag: horovodrun's (-np, -H, -p, -i)."""


COMMON: tuple[RunOption, ...] = (
    RunOption(
        "script_args", None, (), "Arguments after `--`, for a Horovod script.", "strings", "tuple[str, ...]"
    ),
    RunOption(
        "np",
        "--np",
        None,
        "Number of ranks. [default: the hosts' slots, else the cores]",
        "int",
        "int | None",
        aliases=("-np",),
    ),
    RunOption(
        "hosts",
        "--hosts",
        None,
        "HOST:SLOTS,... [default: localhost]",
        "hosts",
        "str | None",
        aliases=("-H",),
    ),
    RunOption("hostfile", "--hostfile", None, "File of 'HOST slots=N' lines.", "path", "str | None"),
    RunOption(
        "module",
        "--module",
        False,
        "TARGET is a module: each rank runs it as `python -m TARGET` would (a plain script).",
        "bool",
        "bool",
        aliases=("-m",),
    ),
    RunOption("strategy", "--strategy", "horovod", "How the ranks train.", "str", "str", show_default=True),
    RunOption(
        "threads_per_rank",
        "--threads-per-rank",
        None,
        "Compute threads per rank. [default: $OMP_NUM_THREADS where set, else cores / ranks on the host]",
        "int",
        "int | None",
    ),
    RunOption("variant", "--variant", None, "A recipe variant, e.g. debug.", "str", "str | None"),
    RunOption(
        "overrides",
        "--set",
        (),
        "Override a config field.",
        "overrides",
        "tuple[str, ...]",
        metavar="KEY=VALUE",
    ),
    RunOption(
        "run_dir",
        "--run-dir",
        None,
        "Where metrics, checkpoints and logs go. [default: runs/RECIPE-TIMESTAMP]",
        "path",
        "Path | None",
    ),
    RunOption("resume", "--resume", False, "Continue from the run directory's checkpoint.", "bool", "bool"),
    RunOption(
        "resume_from",
        "--resume-from",
        None,
        "With --resume: continue from this step's checkpoint, not the newest (which then stays on disk).",
        "int",
        "int | None",
        metavar="STEP",
    ),
    RunOption(
        "max_restarts",
        "--max-restarts",
        0,
        "Relaunch a failed job from its last checkpoint up to N times, without hosts that were lost.",
        "int",
        "int",
        show_default=True,
    ),
    RunOption(
        "network_interface",
        "--network-interface",
        None,
        "NIC for gloo/MPI traffic. [default: lo on one host]",
        "str",
        "str | None",
    ),
    RunOption(
        "ssh_port",
        "--ssh-port",
        None,
        "ssh port of the other hosts. [default: ssh's]",
        "int",
        "int | None",
        aliases=("-p",),
    ),
    RunOption(
        "ssh_identity_file",
        "--ssh-identity-file",
        None,
        "ssh key for the other hosts. [default: ssh's]",
        "path",
        "str | None",
        aliases=("-i",),
    ),
    RunOption(
        "env",
        "--env",
        (),
        "Pass this variable to the ranks too (NAME as set here, or NAME=VALUE); by default they get only "
        "hvdtrain's, the frameworks' and the system's (PATH, HOME, ...).",
        "strings",
        "tuple[str, ...]",
        metavar="NAME[=VALUE]",
        aliases=("-x",),
    ),
    RunOption(
        "image",
        "--image",
        None,
        "Run the job inside this container image (make image builds one).",
        "str",
        "str | None",
    ),  # fmt: skip
    RunOption(
        "oversubscribe",
        "--oversubscribe",
        False,
        "Run more ranks than this host's cores or memory hold.",
        "bool",
        "bool",
    ),
    RunOption(
        "mlflow",
        "--mlflow",
        None,
        "Log the run to this MLflow tracking URI once the job ends. [default: $MLFLOW_TRACKING_URI]",
        "str",
        "str | None",
        metavar="URI",
    ),
    RunOption("verbose", "--verbose", False, "Show the frameworks' start-up logs too.", "bool", "bool"),
    RunOption("dry_run", None, False, "Plan only: nothing is written or started.", "bool", "bool"),
    RunOption(
        "console",
        None,
        True,
        "Show the job's output and hvdtrain's notes on this process's stdout and stderr.",
        "bool",
        "bool",
    ),
)
"""The options every run reads, in the order `hvdtrain run --help` shows them."""

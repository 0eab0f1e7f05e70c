"""What the user asked `hvdtrain run` (or `hvdtrain.run`) for, before anything is read from the machine."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import field, make_dataclass, replace
from pathlib import Path
from typing import Any

from hvdtrain import options, registry
from hvdtrain.errors import UserError
from hvdtrain.launching.spec import Host, parse_hostfile, parse_hosts

RUNS = Path("runs")
RUN_STAMP = re.compile(r"-\d{8}-\d{6}")
"""What a default run directory's name adds to the recipe's: runs/RECIPE-YYYYmmdd-HHMMSS."""


EXPECTED = {
    "int": "an int",
    "float": "a number",
    "bool": "True or False",
    "str": "a string",
    "path": "a path",
    "strings": "a list of strings",
    "hosts": "'HOST:SLOTS,...' or a list of 'HOST:SLOTS' strings",
    "overrides": "a mapping of config fields, or a list of 'KEY=VALUE' strings",
}


def fits(value: Any, kind: Any) -> bool:
    if isinstance(kind, tuple):
        return value in kind
    many = isinstance(value, Sequence) and not isinstance(value, str)
    return {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, int | float) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
        "path": isinstance(value, str | os.PathLike),
        "strings": many and all(isinstance(item, str) for item in value),
        "hosts": isinstance(value, str) or (many and all(isinstance(item, str) for item in value)),
        "overrides": isinstance(value, Mapping) or (many and all(isinstance(item, str) for item in value)),
    }[kind]


def from_keywords(target: str, keywords: Mapping[str, Any]) -> Any:
    """The RunRequest of the Python API's keywords (hvdtrain.run's); a keyword nobody reads, or a
    value of the wrong kind, is a UserError before anything is read from the machine."""
    from hvdtrain import strategies

    common = {option.name: option.kind for option in options.COMMON}
    strategy_options = strategies.all_options()
    named = {int: "int", float: "float", bool: "bool", str: "str"}
    kinds = {**common, **{name: named.get(option.type, option.type)
                          for name, (option, _) in strategy_options.items()}}  # fmt: skip
    if unknown := sorted(set(keywords) - set(kinds)):
        raise UserError(f"unknown option {', '.join(unknown)}; options: {', '.join(sorted(kinds))}")
    check_kinds(keywords, kinds)
    fields = {name: value for name, value in keywords.items() if name in common and value is not None}
    if isinstance(fields.get("overrides"), Mapping):
        fields["overrides"] = [f"{key}={value}" for key, value in fields["overrides"].items()]
    if not isinstance(fields.get("hosts", ""), str):
        fields["hosts"] = ",".join(fields["hosts"])
    for name in ("overrides", "script_args", "env"):
        fields[name] = tuple(fields.get(name, ()))
    for name in ("hostfile", "ssh_identity_file"):
        fields |= {name: str(fields[name])} if name in fields else {}
    fields |= {"run_dir": Path(fields["run_dir"])} if "run_dir" in fields else {}
    strategy_given = {name: keywords.get(name) for name in strategy_options}
    return RunRequest(target=str(target), strategy_options=strategy_given, **fields)


def check_kinds(values: Mapping[str, Any], kinds: Mapping[str, Any]) -> None:
    """A UserError for the first value given (not None) that is not of its kind: one of EXPECTED's
    names, or a tuple of the values allowed."""
    for name, value in values.items():
        kind = kinds[name]
        if value is not None and not fits(value, kind):
            expected = f"one of {', '.join(map(str, kind))}" if isinstance(kind, tuple) else EXPECTED[kind]
            raise UserError(f"{name} must be {expected}, got {value!r}")


def _run_request() -> type:
    """RunRequest: TARGET, a field for each of options.COMMON (its annotation and default), and the
    options only some strategies or launchers read."""
    fields: list[Any] = [("target", "str")]
    fields += [(option.name, option.annotation, field(default=option.default)) for option in options.COMMON]
    fields.append(("strategy_options", "dict[str, Any]", field(default_factory=dict)))
    namespace = {
        "__doc__": "What the user asked for (hvdtrain run's command line, or hvdtrain.run's keywords).",
        "is_path": property(lambda self: registry.is_path(self.target)),
    }
    made = make_dataclass("RunRequest", fields, frozen=True, namespace=namespace)
    made.__module__ = __name__  # where pickle finds it
    return made


RunRequest = _run_request()
"""target: a recipe name, module:pkg.mod, or a .py file (a recipe when it defines RECIPE, else a
script); strategy_options: the options only some strategies or launchers read (--launcher,
--num-ps, ...), None where not given; the rest: hvdtrain.options.COMMON."""


def recipe_spec(target: str, script_text: str | None, cwd: Path, module: bool = False) -> str | None:
    """What registry.load (and each rank's --recipe) takes for TARGET: the name, module:pkg.mod, or
    a file's absolute path where the file defines RECIPE; None for a Horovod script, run untouched
    (a file, or with --module a module run as `python -m` runs it)."""
    if module:
        return None
    if not registry.is_path(target):
        return target
    if script_text is not None and registry.defines_recipe(script_text):
        return os.path.normpath(cwd / target)
    return None


def script_file(target: str, module: bool, cwd: Path) -> Path | None:
    """The file TARGET runs: a path's, or with --module the one `python -m TARGET` in cwd would run
    (a package's __main__.py); None where there is none. Finding a submodule imports its packages,
    as `python -m` does."""
    if not module:
        path = cwd / target
        return path if registry.is_path(target) and path.is_file() else None
    if not MODULE_NAME.fullmatch(target) or target.endswith(".py"):  # not imported: a file's slip
        return None
    sys.path.insert(0, str(cwd))
    try:
        spec = importlib.util.find_spec(target)
    except Exception:  # a parent package that is missing, or fails to import: not found here
        return None
    finally:
        sys.path.remove(str(cwd))
    if spec is None or not spec.has_location or not spec.origin:
        return None
    if spec.submodule_search_locations:  # a package: python -m runs its __main__
        main = Path(spec.origin).parent / "__main__.py"
        return main if main.is_file() else None
    return Path(spec.origin) if spec.origin.endswith(".py") else None


def script_name(target: str, module: bool) -> str:
    """A script's name, as its default run directory takes it: the file's stem, a module's last part."""
    return target.rsplit(".", 1)[-1] if module else Path(target).stem


MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def requested_hosts(request: RunRequest, hostfile_text: str | None) -> tuple[Host, ...]:
    """The hosts of --hosts or --hostfile (the file's text read as a fact), or () for this one."""
    if request.hosts and request.hostfile:
        raise ValueError("give --hosts or --hostfile, not both")
    if request.hostfile:
        return parse_hostfile(hostfile_text or "")
    return parse_hosts(request.hosts) if request.hosts else ()


def requeued(request: RunRequest, environ: Mapping[str, str]) -> RunRequest:
    """A batch job Slurm requeued (SLURM_RESTART_COUNT above 0) runs its `hvdtrain run` line again:
    where that run directory holds a checkpoint, the run resumes from it (with its saved config, so
    the line's --variant is not applied again), whatever run.json says of the node it was on."""
    from hvdtrain.runtime import checkpoint

    restarts = environ.get("SLURM_RESTART_COUNT", "0").strip()
    if request.run_dir is None or not restarts.isdigit() or int(restarts) == 0:
        return request
    if request.resume:  # the line's --resume-from was the first start's: a requeue goes on from the latest
        return replace(request, resume_from=None)
    if checkpoint.latest(request.run_dir) is None:
        return request  # nothing to resume: the job starts the run again
    return replace(request, resume=True, variant=None)

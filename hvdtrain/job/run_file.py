"""A run's options in a TOML file, `hvdtrain run --config FILE`, and the file that says what a run
would do, `--print-config`: its options as given, and under [set] the recipe's whole config, so the
printed file run again is the same run.

    target = "digits-mlp-torch"
    np = 2
    launcher = "gloo"

    [set]
    epochs = 3
    lr = 0.05

Keys are `hvdtrain run`'s options by their long names (threads-per-rank or threads_per_rank),
target, script_args (a script's arguments, a list) and the [set] table. The command line wins over
the file, and its --set values over the file's [set].
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SET_TABLE = "set"


def read(path: Path, known: Mapping[str, bool]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The file's option values by parameter name (`known`: each name, and whether it takes a list),
    and its [set] table as KEY=VALUE overrides. A ValueError names the file and what is wrong."""
    try:
        values = tomllib.loads(path.read_text())
    except OSError as error:
        raise ValueError(f"--config {path}: {error.strerror or error}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"--config {path}: not a TOML file ({error})") from None
    lists = {name for name, many in known.items() if many}
    names = set(known) - {"overrides", "config"}
    options: dict[str, Any] = {}
    overrides: tuple[str, ...] = ()
    for key, value in values.items():
        name = key.replace("-", "_")
        if key == SET_TABLE:
            if not isinstance(value, dict):
                raise ValueError(f"--config {path}: {SET_TABLE} is a table of KEY = VALUE, as --set takes")
            overrides = tuple(f"{field}={override_text(v)}" for field, v in value.items())
        elif name not in names:
            raise ValueError(
                f"--config {path}: unknown key {key!r}; a key is an option of hvdtrain run "
                "(np, strategy, launcher, ...), target, or the [set] table"
            )
        elif isinstance(value, dict):
            raise ValueError(f"--config {path}: {key} is a value, not a table")
        elif (name in lists) != isinstance(value, list):
            want = 'a list, e.g. ["A=1"]' if name in lists else "one value, not a list"
            raise ValueError(f"--config {path}: {key} takes {want}")
        else:
            options[name] = value
    return options, overrides


def override_text(value: Any) -> str:
    """A TOML value as --set writes it: a string as it is, the rest as TOML writes it (--set reads
    true/false, numbers and lists so)."""
    return value if isinstance(value, str) else toml_value(value)


def text(target: str, options: Mapping[str, Any], config: Any = None, defaults: Any = None) -> str:
    """The file --config reads for this run: the options given (None left out), and the config's
    every field under [set], those equal to `defaults` (the recipe's, or its variant's) as comments,
    so a --variant given over the file still applies to them."""
    lines = [
        "# hvdtrain run --config FILE reads this; the command line wins over it",
        f"target = {toml_value(target)}",
    ]
    lines += [
        f"{name} = {toml_value(value)}"
        for name, value in options.items()
        if value not in (None, ()) and name != "overrides"
    ]
    if config is not None:
        lines += ["", f"[{SET_TABLE}]"]
        fields, default = dataclasses.asdict(config), dataclasses.asdict(defaults) if defaults else {}
        lines += [
            f"{'# ' if name in default and default[name] == value else ''}{name} = {toml_value(value)}"
            for name, value in fields.items()
        ]
    return "\n".join(lines) + "\n"


def toml_value(value: Any) -> str:
    if value is None:  # TOML has no null; --set reads "none" back as None
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))  # a JSON string is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML for {type(value).__name__}")

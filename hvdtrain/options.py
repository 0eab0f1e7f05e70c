"""An `hvdtrain run` option that only some strategies or launchers read. Its owner declares it; the
CLI's flags and help and the Python API's keywords come from those declarations."""

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

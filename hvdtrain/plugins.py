"""Things that come in kinds (recipes, strategies, launchers) are modules of a package that each
define one object; this finds them, so adding a kind is adding a module. Installed packages add
their own by entry point, as pytest's and mkdocs' plugins do: in the groups `hvdtrain.recipes`,
`hvdtrain.strategies` and `hvdtrain.launchers`, each entry point's value naming the object
(`mypkg.recipes:RECIPE`)."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

T = TypeVar("T")


def discover(
    package: ModuleType, attribute: str, kind: type[T], broken: dict[str, str] | None = None
) -> list[T]:
    """The `attribute` of every module of `package` that defines one of type `kind`. With `broken`
    given, a module that fails to import is recorded there (module -> error) instead of raising."""
    found = []
    for module_info in pkgutil.iter_modules(package.__path__):
        name = f"{package.__name__}.{module_info.name}"
        try:
            module = importlib.import_module(name)
        except Exception as error:  # a user's recipe file may raise anything while importing
            if broken is None:
                raise
            broken[name] = f"{type(error).__name__}: {error}"
            continue
        value = getattr(module, attribute, None)
        if isinstance(value, kind):
            found.append(value)
    return found


def named(package: ModuleType, name: str, attribute: str, kind: type[T]) -> T | None:
    """The `attribute` of the one module of `package` that `name` spells (digits-mlp-torch in
    digits_mlp_torch.py), without importing the others or reading entry points: a rank, or the CLI,
    needs one recipe or strategy. None where no such module defines a `kind` of that name, or it fails
    to import: the caller's full discovery then decides, and names what is wrong."""
    module_name = name.replace("-", "_")
    if not module_name.isidentifier() or not any(
        (Path(folder) / f"{module_name}.py").is_file() for folder in package.__path__
    ):
        return None
    try:
        module = importlib.import_module(f"{package.__name__}.{module_name}")
    except Exception:  # a module that fails to import is for discover to report
        return None
    value = getattr(module, attribute, None)
    return value if isinstance(value, kind) and getattr(value, "name", None) == name else None


GROUPS = ("hvdtrain.recipes", "hvdtrain.strategies", "hvdtrain.launchers")


@cache
def _loaded(group: str) -> tuple[tuple[str, Any], ...]:
    """(where, the object or the exception its loading raised) of each entry point in `group`, once
    per process: where names the entry point and the package that declares it."""
    import importlib.metadata  # here: a rank that finds its recipe and strategy by name reads no entry point

    found = []
    for point in sorted(importlib.metadata.entry_points(group=group), key=lambda point: point.name):
        package = point.dist.name if point.dist is not None else "an unnamed package"
        where = f"plugin {point.name} = {point.value} (group {group}, package {package})"
        try:
            found.append((where, point.load()))
        except (Exception, SystemExit) as error:  # a plugin's module may raise anything on import
            found.append((where, error))
    return tuple(found)


def installed(group: str, kind: type[T], taken: Iterable[str], broken: dict[str, str]) -> list[T]:
    """The objects of type `kind` that installed packages name in `group`. One that fails to import,
    is not a `kind`, or takes a name in `taken` (a built-in's, or an earlier plugin's) is left out
    and recorded in `broken` (where -> why): a broken plugin hides nothing else."""
    found: list[T] = []
    names = set(taken)
    for where, value in _loaded(group):
        if isinstance(value, BaseException):
            problem = f"failed to import: {type(value).__name__}: {value}"
        elif not isinstance(value, kind):
            problem = f"names a {type(value).__name__}, not a {kind.__name__}"
        elif value.name in names:
            problem = f"its name {value.name!r} is taken by another {kind.__name__.lower()}"
        else:
            found.append(value)
            names.add(value.name)
            continue
        broken[where] = problem
    return found

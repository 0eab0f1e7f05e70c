"""Things that come in kinds (recipes, strategies, launchers) are modules of a package that each
define one object; this finds them, so adding a kind is adding a module."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import TypeVar

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

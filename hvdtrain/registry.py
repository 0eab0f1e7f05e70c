"""Recipe name -> Recipe. Recipes are the modules of the `recipes` package that define RECIPE."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from hvdtrain.config import TrainConfig

Framework = Literal["torch", "tensorflow"]


@dataclass(frozen=True)
class Recipe:
    name: str
    framework: Framework
    dataset: str
    description: str
    config: type[TrainConfig]
    build: Callable[[Any], Any]
    """config -> the framework task (a runtime.torch.TorchTask or runtime.tensorflow.KerasTask)."""
    variants: dict[str, Callable[[Any], Any]] = field(default_factory=dict)
    """Small functions that change a field or two, e.g. `debug` finishes in seconds on CPU."""
    preflight: Callable[[Any], None] | None = None
    """Checks the CLI runs before any rank starts (e.g. that data files exist); raises ValueError."""

    def make_config(self, variant: str | None = None) -> TrainConfig:
        config = self.config()
        if variant is None:
            return config
        if variant not in self.variants:
            known = ", ".join(sorted(self.variants)) or "none"
            raise ValueError(f"recipe {self.name} has no variant {variant!r}; variants: {known}")
        return self.variants[variant](config)


def debug_variant(**changes: Any) -> Callable[[TrainConfig], TrainConfig]:
    return lambda config: dataclasses.replace(config, **changes)


def all_recipes() -> dict[str, Recipe]:
    import recipes

    found = {}
    for module_info in pkgutil.iter_modules(recipes.__path__):
        module = importlib.import_module(f"recipes.{module_info.name}")
        recipe = getattr(module, "RECIPE", None)
        if isinstance(recipe, Recipe):
            found[recipe.name] = recipe
    return dict(sorted(found.items()))


def get(name: str) -> Recipe:
    known = all_recipes()
    if name not in known:
        raise ValueError(f"unknown recipe {name!r}; known recipes: {', '.join(known)}")
    return known[name]

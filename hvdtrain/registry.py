"""Recipe name -> Recipe. Recipes are the modules of the `recipes` package that define RECIPE."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from hvdtrain.config import TrainConfig
from hvdtrain.plugins import discover

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


@dataclass(frozen=True)
class Catalog:
    recipes: dict[str, Recipe]
    broken: dict[str, str]
    """Recipe modules that failed to import -> the error, so one broken file hides no other recipe."""


def catalog() -> Catalog:
    import recipes

    broken: dict[str, str] = {}
    found = discover(recipes, "RECIPE", Recipe, broken)
    return Catalog({recipe.name: recipe for recipe in sorted(found, key=lambda recipe: recipe.name)}, broken)


def all_recipes() -> dict[str, Recipe]:
    return catalog().recipes


def get(name: str) -> Recipe:
    known = catalog()
    if name not in known.recipes:
        broken = "".join(f"; {module} failed to import ({error})" for module, error in known.broken.items())
        raise ValueError(f"unknown recipe {name!r}; known recipes: {', '.join(known.recipes)}{broken}")
    return known.recipes[name]

"""Recipe name -> Recipe. Recipes are the modules of the `hvdtrain.recipes` package (the repository's
recipes/ folder) that define RECIPE, or a user's own: a .py file, or an importable module
(`module:pkg.mod`), that defines RECIPE.

`load(spec)` is the one way a recipe is found, by `hvdtrain run` and by every rank's
`hvdtrain.worker --recipe SPEC`, so the ranks train the recipe the CLI planned.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib
import importlib.util
import os
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from hvdtrain.config import TrainConfig
from hvdtrain.errors import UnknownRecipeError
from hvdtrain.plugins import discover, installed, named

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
    metrics: tuple[str, ...] = ("accuracy",)
    """The evaluation metrics its task reports, as test_<name> (hvdtrain.runtime.metrics); empty for a
    recipe that does not evaluate. Declared here so that `monitor` is checked before any rank starts."""

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
    broken_plugins: dict[str, str]
    """Installed recipe plugins that cannot be used: where -> why."""


def recipes_package() -> ModuleType:
    """hvdtrain.recipes, which the wheel and an editable install map to the repository's recipes/ folder
    (pyproject's package-dir). Where a checkout's hvdtrain/ comes first on sys.path ahead of a plain
    install (`python -m hvdtrain.worker` started in the checkout), that folder is imported as it."""
    try:
        return importlib.import_module("hvdtrain.recipes")
    except ModuleNotFoundError as error:
        folder = Path(__file__).resolve().parent.parent / "recipes"
        if error.name != "hvdtrain.recipes" or not (folder / "__init__.py").is_file():
            raise
    spec = importlib.util.spec_from_file_location(
        "hvdtrain.recipes", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules["hvdtrain.recipes"] = package
    spec.loader.exec_module(package)
    sys.modules["hvdtrain"].recipes = package
    return package


PLUGIN_GROUP = "hvdtrain.recipes"


def catalog() -> Catalog:
    """The built-in recipes, and those installed packages declare (entry points in the group
    hvdtrain.recipes), which run by name as the built-in ones do."""
    broken: dict[str, str] = {}
    found = discover(recipes_package(), "RECIPE", Recipe, broken)
    broken_plugins: dict[str, str] = {}
    found += installed(PLUGIN_GROUP, Recipe, [recipe.name for recipe in found], broken_plugins)
    ordered = sorted(found, key=lambda recipe: recipe.name)
    return Catalog({recipe.name: recipe for recipe in ordered}, broken, broken_plugins)


def all_recipes() -> dict[str, Recipe]:
    return catalog().recipes


def get(name: str) -> Recipe:
    if (recipe := named(recipes_package(), name, "RECIPE", Recipe)) is not None:
        return recipe  # a built-in, from its own module alone
    known = catalog()
    if name not in known.recipes:
        broken = "".join(f"; {module} failed to import ({error})" for module, error in known.broken.items())
        known_names = ", ".join(known.recipes)
        raise UnknownRecipeError(f"unknown recipe {name!r}; known recipes: {known_names}{broken}")
    return known.recipes[name]


MODULE_PREFIX = "module:"
"""`module:pkg.mod`: the RECIPE of an importable module (from the current directory or PYTHONPATH)."""


def is_path(spec: str) -> bool:
    """A file: a recipe file when it defines RECIPE (see defines_recipe), else a Horovod script."""
    return not spec.startswith(MODULE_PREFIX) and (spec.endswith(".py") or os.sep in spec)


def source(spec: str) -> str | None:
    """Where a recipe that is not built in comes from (its file, or module:NAME); None for a name."""
    return spec if spec.startswith(MODULE_PREFIX) or is_path(spec) else None


def defines_recipe(text: str) -> bool:
    """Does this Python source assign RECIPE at its top level? Read, not run, so a Horovod script
    without one is never imported here (it runs as a script)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:  # a recipe file with a typo still counts, so loading it names the error
        return re.search(r"^RECIPE\s*[:=]", text, re.MULTILINE) is not None
    return any("RECIPE" in _assigned(node) for node in _top_level(tree.body))


def syntax_problem(text: str, path: str) -> str | None:
    """A file's first syntax error as `PATH:LINE: what`, found by compiling its text without running
    it, so that a typo is refused before any rank starts rather than by every rank; None: it compiles."""
    try:
        with warnings.catch_warnings():  # a script's own warnings (invalid escapes) are not ours to print
            warnings.simplefilter("ignore")
            compile(text, path, "exec", dont_inherit=True)
    except SyntaxError as error:
        return _syntax_line(error, path)
    except ValueError as error:  # null bytes, on some 3.11 releases
        return f"{path}: {error}"
    return None


def _syntax_line(error: SyntaxError, path: str | None = None) -> str:
    """`PATH:LINE: what` (a null byte has no line)."""
    where = error.filename or path
    return f"{where}:{error.lineno}: {error.msg}" if error.lineno else f"{where}: {error.msg}"


def _import_problem(error: BaseException) -> str:
    """One line for an import that failed; a syntax error as `PATH:LINE: what`."""
    if isinstance(error, SyntaxError):
        return _syntax_line(error)
    return f"{type(error).__name__}: {error}"


def _top_level(body: list[ast.stmt]):
    """The module's statements, also those inside a top-level if/try/with/for (not in functions)."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            for part in ("body", "orelse", "finalbody"):
                yield from _top_level(getattr(node, part, []))
            for handler in getattr(node, "handlers", []):
                yield from _top_level(handler.body)


def _assigned(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Assign):
        return [name.id for target in node.targets for name in ast.walk(target) if isinstance(name, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, ast.ImportFrom):
        return [alias.asname or alias.name for alias in node.names]
    return []


def load(spec: str) -> Recipe:
    """The recipe `spec` names: a built-in recipe's name, a recipe file's path, or module:pkg.mod.
    A file or module that fails to import, or whose RECIPE is not a Recipe, is one ValueError."""
    if spec.startswith(MODULE_PREFIX):
        name = spec[len(MODULE_PREFIX) :]
        if os.getcwd() not in sys.path:  # as `python -m` would find it, also from the console script
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(name)
        except (Exception, SystemExit) as error:  # a user's module may raise anything on import
            raise ValueError(f"recipe module {name} failed to import: {_import_problem(error)}") from None
        return _recipe_of(module, f"module {name}")
    if is_path(spec):
        path = Path(os.path.abspath(spec))
        return _recipe_of(_import_file(path), str(path))
    return get(spec)


def _import_file(path: Path):
    """The file as a module of its own name (so its dataclasses' type hints resolve), once per
    process; its directory goes on sys.path, as for a script, so it can import its neighbours."""
    stem = re.sub(r"\W", "_", path.stem)
    module_name = f"hvdtrain_recipe_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    if not path.is_file():
        raise ValueError(f"recipe file {path} not found")
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:  # a user's recipe file may raise anything on import
        del sys.modules[module_name]
        raise ValueError(f"recipe file {path} failed to import: {_import_problem(error)}") from None
    return module


def _recipe_of(module, where: str) -> Recipe:
    value = getattr(module, "RECIPE", None)
    if not isinstance(value, Recipe):
        what = "defines no RECIPE" if value is None else f"has RECIPE of type {type(value).__name__}"
        raise ValueError(f"{where} {what}; a recipe defines RECIPE = hvdtrain.registry.Recipe(...)")
    return value

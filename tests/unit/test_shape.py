"""The shape of hvdtrain/ as docs/architecture.md tells it, checked from the source: no import cycle
among its modules (imports inside functions count; those under `if TYPE_CHECKING:` do not), the
rank side (runtime/) imports nothing of the launching side, no module outside runtime/ names
another module's strategy or launcher (it asks the properties they declare), the top level holds
about ten modules and the rest is grouped, and no module is over 350 lines."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hvdtrain"
SHARED = {
    "hvdtrain",
    "hvdtrain.config",
    "hvdtrain.errors",
    "hvdtrain.data",
    "hvdtrain.paths",
    "hvdtrain.native",
}
SHARED_PACKAGES = ("hvdtrain.models",)
"""What both sides may import: typed configs, errors, data, paths, the native helper and the models."""


def module_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_of(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, tree: ast.AST) -> set[str]:
    """The hvdtrain modules a module imports anywhere in it, but under `if TYPE_CHECKING:`."""
    found, todo = set(), [tree]
    while todo:
        node = todo.pop()
        if (
            isinstance(node, ast.If)
            and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
        ):
            todo += node.orelse
            continue
        todo += ast.iter_child_nodes(node)
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1 more
                package = name.split(".") if MODULES[name].name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found |= {
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names
            }
    owners = set()
    for target in found:
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target and target != name and not name.startswith(target + "."):
            owners.add(target)
    return owners


GRAPH = {name: imported(name, ast.parse(path.read_text())) for name, path in MODULES.items()}


def cycles() -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_no_module_of_hvdtrain_imports_itself_back_round_a_cycle():
    assert len(GRAPH) > 50 and "hvdtrain.runtime.common" in GRAPH["hvdtrain.runtime.torch.loop"]
    assert cycles() == []


def test_the_rank_side_imports_nothing_of_the_launching_side():
    def allowed(target: str) -> bool:
        return target.startswith("hvdtrain.runtime") or target in SHARED or target.startswith(SHARED_PACKAGES)

    crossing = {
        (name, target)
        for name, targets in GRAPH.items()
        if name.startswith("hvdtrain.runtime")
        for target in targets
        if not allowed(target)
    }
    assert crossing == set()


def named_elsewhere() -> set[tuple[str, str]]:
    """(module, name) where a string literal, docstrings aside, names a strategy or launcher defined
    in another module: the default strategy, `auto`, and gloo and mpi (Horovod's controllers too)
    are not counted, nor is the rank side, which runs under one strategy it is told."""
    from hvdtrain import strategies

    owners = {}  # name -> the module that defines it
    for module in MODULES:
        if module.startswith(("hvdtrain.strategies.", "hvdtrain.launchers.")):
            defined = importlib.import_module(module)
            for kind in ("STRATEGY", "LAUNCHER"):
                if kind in vars(defined):
                    owners[vars(defined)[kind].name] = module
    assert {"zero", "ddp", "srun", "ray"} <= set(owners)
    for name in (next(iter(strategies.all_strategies())), "gloo", "mpi"):
        owners.pop(name)
    found = set()
    for module, path in MODULES.items():
        if module.startswith("hvdtrain.runtime"):
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        for node in ast.walk(tree):
            named = isinstance(node, ast.Constant) and node.value in owners and id(node) not in docstrings
            if named and owners[node.value] != module:
                found.add((module, node.value))
    return found


def test_no_strategy_or_launcher_is_named_outside_its_own_module():
    assert named_elsewhere() == set()


TOP_LEVEL = {
    "__init__.py", "__main__.py", "config.py", "errors.py", "options.py", "paths.py", "plugins.py",
    "registry.py", "worker.py",
}  # fmt: skip
"""The API, what both sides share (configs, errors, paths), how kinds are declared and found
(options, plugins, registry) and what each rank runs; every other module is in a package that says
what it groups (cli, data, job, launchers, launching, strategies, runtime, records, measure, ...)."""
LONGEST = 350
TABLES: dict[str, str] = {}
"""A module whose length is its content's, a table of data or of argv, with why."""


def test_the_top_level_holds_about_ten_modules_and_the_rest_is_grouped():
    top = {path.name for path in PACKAGE.glob("*.py")}
    assert top == TOP_LEVEL, "a new top-level module: does it belong in one of the packages?"
    packages = {path.parent.name for path in PACKAGE.glob("*/*.py")}
    assert {"cli", "data", "job", "launchers", "launching", "strategies", "runtime", "records"} <= packages


def test_no_module_is_over_350_lines_unless_it_is_a_table():
    long = {
        name: lines
        for name, path in MODULES.items()
        if (lines := len(path.read_text().splitlines())) > LONGEST and name not in TABLES
    }
    assert long == {}, "split it by subject: a package, or a module beside it"

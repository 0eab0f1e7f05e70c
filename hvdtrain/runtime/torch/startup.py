"""A rank's start without torch._dynamo where nothing compiles.

Eager torch asks torch._dynamo for two things on a Horovod rank's first steps: every optimizer's
`step` calls `torch._dynamo.graph_break()`, and the functions torch marks "not while compiling"
(the optimizer's `__init__` and `zero_grad`) call `torch._dynamo.disable(fn)` once to wrap
themselves. Both are no-ops until something compiles, yet the import behind them (torch._dynamo,
sympy under it) costs a rank about a CPU-second, most of what `import torch` costs: every rank
of every run, every elastic restart, every test.

`defer_dynamo_import` puts a stand-in for torch._dynamo in `sys.modules` that answers those two
calls while nothing has compiled and imports the real module on any other use (`torch.compile`,
`compile=true`, a user's own `torch._dynamo.config`). From then on every guard the stand-in
handed out defers to torch's own, so behaviour is torch's either way; only the import moves to
where it is needed. torch.distributed asks it two more things that have a fixed answer while
nothing compiles (_ANSWERS): ddp ranks start without it too. FSDP's sharded tensors make a
FakeTensorMode, which reads torch._dynamo's config: fsdp ranks import it there.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

NAME = "torch._dynamo"


_LOCK = threading.RLock()
"""One thread swaps the stand-in for the real module; another waits for it, as for any import."""


class _Deferred(types.ModuleType):
    """torch._dynamo until it is needed."""

    def _real(self) -> types.ModuleType:
        with _LOCK:
            if sys.modules.get(NAME) is self:
                del sys.modules[NAME]
                import torch

                if vars(torch).get("_dynamo") is self:
                    delattr(torch, "_dynamo")
                try:
                    importlib.import_module(NAME)
                except BaseException:
                    sys.modules.setdefault(NAME, self)
                    raise
        return importlib.import_module(NAME)  # waits while another thread imports it

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__") and name != "__all__":
            raise AttributeError(name)
        if name in _ANSWERED_SUBMODULES:
            return _Submodule(self, name)
        return getattr(self._real(), name)

    def graph_break(self, *args: Any, **kwargs: Any) -> None:
        if sys.modules.get(NAME) is not self:
            self._real().graph_break(*args, **kwargs)

    def disable(self, fn: Callable[..., Any] | None = None, recursive: bool = True, **options: Any) -> Any:
        # torch's own lazy guards (torch._disable_dynamo) ask with wrapping=False and nothing else;
        # any other use (torch.compiler.disable, a decorator) gets the real module's.
        if fn is None or options != {"wrapping": False}:
            return self._real().disable(fn, recursive, **options)
        return _guard(self, fn, recursive)


DDP_MODE = "ddp_optimizer"
"""torch._dynamo.utils.get_optimize_ddp_mode() under torch's default config (optimize_ddp=True),
which only an imported torch._dynamo can change."""

_ANSWERS: dict[tuple[str, str], Callable[..., Any]] = {
    # init_process_group empties caches of compile rules that only the real module fills
    ("trace_rules", "clear_lru_cache"): lambda: None,
    # DistributedDataParallel picks its reducer by the mode: the C++ one under the default
    ("utils", "get_optimize_ddp_mode"): lambda: DDP_MODE,
}
"""Calls into torch._dynamo's submodules that the stand-in answers while it stands in."""
_ANSWERED_SUBMODULES = {submodule for submodule, _ in _ANSWERS}


class _Submodule:
    """torch._dynamo.<name> read through the stand-in: the calls in _ANSWERS, made while the stand-in
    is in place, get its answer; any other name, or a call after the real import, is the real one."""

    def __init__(self, stand_in: _Deferred, name: str) -> None:
        self._stand_in, self._name = stand_in, name

    def __getattr__(self, attribute: str) -> Any:
        if attribute in ("_stand_in", "_name"):  # not set yet (copy makes one without __init__)
            raise AttributeError(attribute)
        answer = _ANSWERS.get((self._name, attribute))
        if answer is None:
            return getattr(getattr(self._stand_in._real(), self._name), attribute)
        stand_in, name = self._stand_in, self._name

        def call(*args: Any, **kwargs: Any) -> Any:
            if sys.modules.get(NAME) is stand_in:
                return answer(*args, **kwargs)
            return getattr(getattr(stand_in._real(), name), attribute)(*args, **kwargs)

        return call


def _guard(stand_in: _Deferred, fn: Callable[..., Any], recursive: bool) -> Callable[..., Any]:
    """`fn` called directly while torch._dynamo is not imported, through torch's own guard after."""
    real_guard: Callable[..., Any] | None = None

    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal real_guard
        if real_guard is None:
            module = sys.modules.get(NAME)
            if module is stand_in or not hasattr(module, "disable"):  # nothing can be compiling yet
                return fn(*args, **kwargs)
            real_guard = module.disable(fn, recursive, wrapping=False)  # type: ignore[union-attr]
        return real_guard(*args, **kwargs)

    return call


class _Existing(importlib.abc.Loader):
    """Hands the import system a submodule the real package's import already made, unchanged."""

    def __init__(self, module: types.ModuleType, spec: importlib.machinery.ModuleSpec | None) -> None:
        self.module, self.spec = module, spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self.module

    def exec_module(self, module: types.ModuleType) -> None:
        with contextlib.suppress(AttributeError):  # the import system set ours where the module lets it
            module.__spec__ = self.spec


class _SubmoduleFirst(importlib.abc.MetaPathFinder):
    """A submodule imported on its own (torch._inductor imports torch._dynamo.exc) is the real
    package's first use: import the package, then give the importer the submodule as the package
    left it (not a second copy: torch._dynamo.config must stay the one torch._dynamo reads)."""

    def find_spec(
        self, name: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        stand_in = sys.modules.get(NAME)
        if not name.startswith(NAME + ".") or not isinstance(stand_in, _Deferred):
            return None
        real = stand_in._real()
        existing = sys.modules.get(name)
        if existing is None:
            return importlib.machinery.PathFinder.find_spec(name, list(real.__path__))
        # Found in sys.modules, the import system would take the module's own spec and run its
        # file again: out of sys.modules until our loader puts it back, under the import's lock.
        del sys.modules[name]
        return importlib.util.spec_from_loader(name, _Existing(existing, getattr(existing, "__spec__", None)))


def defer_dynamo_import() -> bool:
    """Put the stand-in in place unless torch._dynamo is imported already; True when it was."""
    if NAME in sys.modules:
        return False
    import torch

    spec = importlib.machinery.PathFinder.find_spec(NAME, list(torch.__path__))
    if spec is None:
        return False
    stand_in = _Deferred(NAME)
    stand_in.__spec__ = spec
    stand_in.__path__ = list(spec.submodule_search_locations or [])
    stand_in.__file__ = spec.origin
    sys.modules[NAME] = stand_in
    if not any(isinstance(finder, _SubmoduleFirst) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SubmoduleFirst())
    return True

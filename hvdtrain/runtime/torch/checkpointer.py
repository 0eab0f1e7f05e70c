"""Saving and loading a torch run's state: model, optimizer, schedule position (the step, which the
learning rate follows), data position (the epoch, whose order derives from the seed) and each rank's
random state, in the run directory's checkpoint layout (hvdtrain.runtime.checkpoint).

Saving and loading are collective, so a backend whose state is sharded can write a file per rank
into the step directory. The default, `Rank0Checkpointer`, is Horovod's classic pattern: rank 0
writes the whole state, and on resume reads it and broadcasts it to every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hvdtrain.runtime import checkpoint, checkpoint_write, within

if TYPE_CHECKING:
    from hvdtrain.runtime.torch.backends import TorchBackend

FILE = "checkpoint.pt"
"""The one file of a Rank0Checkpointer step (and the older layout's name for it in the run directory)."""


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The recipe's model inside a DDP or DataParallel wrapper."""
    return getattr(model, "module", model)


class Checkpointer(Protocol):
    def save(
        self,
        run_dir: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        position: dict[str, Any],
        keep: int = 1,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Collective: every rank calls it at the same point. `position` has the epochs finished and
        the steps taken ("epoch", "step"), and what else the loop resumes from (the loss scale's
        "scaler"), all given back by load. The newest `keep` checkpoints stay. `then` runs on rank 0
        once the checkpoint is complete on disk (which, written in the background, is later)."""
        ...

    def flush(self) -> None:
        """Every rank: wait for a checkpoint being written in the background, if any; raises
        WriteFailed where it failed."""
        ...

    def load(
        self, run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, resume: bool
    ) -> dict[str, int] | None:
        """Collective: every rank ends with the same state, the newest checkpoint's when resuming,
        else rank 0's initial one. Returns the position a resumed run starts at, None for a new run."""
        ...

    def read(
        self, run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, int] | None:
        """This rank alone: the checkpoint into its model and optimizer where this rank holds one
        (elastic training, whose state sync then makes every rank agree)."""
        ...


class Rank0Checkpointer:
    def __init__(self, backend: TorchBackend) -> None:
        self.backend = backend
        self.writer: checkpoint_write.BackgroundWriter | None = None
        """Where checkpoints are written in the background (async_checkpoint), the thread's keeper."""

    def save(self, run_dir, model, optimizer, position, keep=1, then=None) -> None:
        backend = self.backend
        generators = random_states(backend)
        states = self.whole_states(model, optimizer)
        if backend.rank != 0:
            return
        state = {"model": states[0], "optimizer": states[1], **position, **generators}
        step, epoch = position["step"], position["epoch"]

        def write(state: dict[str, Any]) -> None:
            with checkpoint_write.writing(run_dir, step):
                checkpoint_write.write(
                    run_dir, step, epoch, backend.size, "torch", {FILE: partial(torch.save, state)}, keep=keep
                )
                if then is not None:  # checkpoints/best: a write that fails is the checkpoint's failure
                    then()

        if self.writer is None:
            write(state)
            return
        self.writer.wait()  # one write at a time, and one copy of the state in host memory
        copied = host_copy(state)
        self.writer.start(lambda: write(copied))

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.wait()

    def whole_states(self, model, optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        """Every rank: the model's and the optimizer's state dicts that rank 0 writes (collective
        where a rank holds only a shard of them)."""
        return unwrapped(model).state_dict(), optimizer.state_dict()

    def read(self, run_dir, model, optimizer) -> dict[str, Any] | None:
        if self.backend.rank != 0:
            return None
        found = checkpoint.latest(run_dir, "torch")
        if found is None or FILE not in found.files:
            raise FileNotFoundError(f"--resume: no checkpoint in {run_dir}")
        path = found.path(FILE)
        saved = torch.load(path, weights_only=True, map_location=self.backend.device)
        unwrapped(model).load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        print(f"resuming from {path} {within.where(saved)}", flush=True)
        return {key: value for key, value in saved.items() if key not in ("model", "optimizer")}

    def load(self, run_dir, model, optimizer, resume) -> dict[str, int] | None:
        backend = self.backend
        state = self.read(run_dir, model, optimizer) if resume else None
        return restore_random_states(backend, backend.broadcast_state(model, optimizer, state))


def per_element(key: str, value: Any) -> bool:
    """Whether an optimizer's state value holds one number per element of its parameter (momentum,
    Adam's moments), not one per parameter (Adam's step count, NAdam's mu_product): what a sharding
    strategy splits as it splits the parameter."""
    return torch.is_tensor(value) and key != "step" and value.dim() > 0


def host_copy(state: Any) -> Any:
    """The state with every tensor copied into host memory, which training then no longer changes.
    Tensors that share storage (tied weights; views) still share it in the copy, so the file
    torch.save writes of it is byte for byte the one it writes of the state itself."""
    copies: dict[int, torch.UntypedStorage] = {}
    containers: dict[int, Any] = {}  # one copy of a container met twice (param groups share betas)

    def copy(value: Any) -> Any:
        if isinstance(value, dict | list | tuple):
            if id(value) not in containers:
                containers[id(value)] = copy_container(value)
            return containers[id(value)]
        if not torch.is_tensor(value):
            return value
        storage = value.untyped_storage()
        if storage.data_ptr() not in copies:
            copies[storage.data_ptr()] = storage.cpu() if storage.device.type != "cpu" else storage.clone()
        return torch.empty(0, dtype=value.dtype).set_(
            copies[storage.data_ptr()], value.storage_offset(), value.size(), value.stride()
        )

    def copy_container(value: dict | list | tuple) -> Any:
        if isinstance(value, dict):  # a state_dict's OrderedDict keeps its _metadata (module versions)
            copied = type(value)((key, copy(item)) for key, item in value.items())
            if hasattr(value, "_metadata"):
                copied._metadata = value._metadata  # type: ignore[attr-defined]
            return copied
        return type(value)(copy(item) for item in value)

    return copy(state)


def random_states(backend: TorchBackend) -> dict[str, list[torch.Tensor]]:
    """Collective: every rank's own generators, the CPU's and the GPU's that dropout draws from."""
    cuda = torch.cuda.get_rng_state(backend.device) if backend.device.type == "cuda" else None
    cpu_states, cuda_states = zip(*backend.allgather_object((torch.get_rng_state(), cuda)), strict=True)
    return {"rng": list(cpu_states), **({"cuda_rng": list(cuda_states)} if cuda is not None else {})}


def restore_random_states(backend: TorchBackend, state: dict[str, Any] | None) -> dict[str, Any] | None:
    """This rank's generators from a resumed position (each rank's own, at the same world size); the
    position without them."""
    if state is None:
        return None
    cpu_states, cuda_states = state.pop("rng", None), state.pop("cuda_rng", None)
    if cpu_states and len(cpu_states) == backend.size:
        torch.set_rng_state(cpu_states[backend.rank].cpu())
    if cuda_states and len(cuda_states) == backend.size and backend.device.type == "cuda":
        torch.cuda.set_rng_state(cuda_states[backend.rank].cpu(), backend.device)
    return state

"""Sharded checkpoints of `--strategy zero`: every rank writes its own slice of the optimizer state,
rank 0 the model and the position, and the manifest, written last, names them all.

    checkpoints/<step>/model.pt           the model's state dict, the position, every rank's generators
    checkpoints/<step>/optimizer.<r>.pt   rank r's wrapped optimizer state (its slices) and the layout:
                                          each group's trainable parameters' shapes and places
    checkpoints/<step>/manifest.json      extra: {"sharded": "zero", "ranks": N, "zero_stage": S}

A resume at the same world size loads each rank's own file (bit for bit); at another, each rank puts
the whole state together from every file and keeps its new slice. `consolidate` writes the whole
state in the plain format (checkpoint.pt: "model", "optimizer", the position), which plain Horovod,
ddp and a user's own `torch.load` read, into checkpoints/<step>-consolidated/.
"""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hvdtrain.runtime import checkpoint, checkpoint_write, within
from hvdtrain.runtime.torch.checkpointer import (
    FILE,
    Rank0Checkpointer,
    per_element,
    random_states,
    restore_random_states,
    unwrapped,
)

if TYPE_CHECKING:
    from hvdtrain.runtime.torch.zero import ShardedOptimizer, ZeroTorch

MODEL = "model.pt"


def shard_name(rank: int) -> str:
    return f"optimizer.{rank}.pt"


def whole_state(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """The wrapped optimizer's state dict over the model's parameters (the plain format), from every
    rank's file: each per-element value is the ranks' slices end to end, without the padding."""
    layout = shards[0]["layout"]
    if any(shard["layout"] != layout for shard in shards) or layout["ranks"] != len(shards):
        raise ValueError("the checkpoint's optimizer files disagree on how the state is sharded")
    state: dict[int, dict[str, Any]] = {}
    param_groups, start = [], 0
    for index, (shapes, places, count) in enumerate(
        zip(layout["shapes"], layout["places"], layout["counts"], strict=True)
    ):
        numels = [torch.Size(shape).numel() for shape in shapes]
        saved = [shard["state"]["state"].get(index, {}) for shard in shards]
        indices = [start + place for place in places]
        per_param: dict[int, dict[str, Any]] = {i: {} for i in indices}
        for key, value in saved[0].items():
            if per_element(key, value):
                flat = torch.cat([part[key].reshape(-1) for part in saved])[: sum(numels)]
                for i, part, shape in zip(indices, flat.split(numels), shapes, strict=True):
                    per_param[i][key] = part.reshape(shape).clone()
            else:  # a per-group scalar (Adam's step): the same for every parameter
                for i in indices:
                    per_param[i][key] = value.clone() if torch.is_tensor(value) else value
        state.update({i: values for i, values in per_param.items() if values})
        group = shards[0]["state"]["param_groups"][index]
        param_groups.append({**group, "params": list(range(start, start + count))})
        start += count
    return {"state": state, "param_groups": param_groups}


def _load(path: Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    return torch.load(path, weights_only=True, map_location=device)


def _ranks(found: checkpoint.Checkpoint | None) -> int | None:
    """How many ranks wrote a zero checkpoint, a file each; None where it is not one."""
    if found is None or found.manifest is None or found.sharded_by != "zero":
        return None
    return found.manifest.extra["ranks"]


def _whole(found: checkpoint.Checkpoint, ranks: int) -> dict[str, Any]:
    """The whole optimizer state of a sharded checkpoint, on the CPU."""
    return whole_state([_load(found.path(shard_name(rank))) for rank in range(ranks)])


class ZeroCheckpointer:
    """Collective, like every checkpointer; a whole checkpoint (plain Horovod's, a consolidated one)
    resumes as under Rank0Checkpointer, each rank keeping its slice."""

    def __init__(self, backend: ZeroTorch) -> None:
        self.backend = backend
        self.whole = Rank0Checkpointer(backend)

    def flush(self) -> None:
        """Zero's checkpoints are written as they are taken (async_checkpoint is refused with it)."""

    def save(self, run_dir, model, optimizer: ShardedOptimizer, position, keep=1, then=None) -> None:
        backend, step = self.backend, position["step"]
        directory = checkpoint.step_dir(run_dir, step)
        # an elastic world may save a step again that is on disk; rank 0 makes the directory
        made_here = backend.rank == 0 and not directory.exists()
        name = shard_name(backend.rank)
        files: dict[str, Any] = {}
        # A rank's failed write is every rank's: each one writes (or fails) and then all agree, so no
        # rank removes the step directory while another still writes into it, and none commits it.
        failed = _failure(lambda: checkpoint_write.begin(run_dir, step), run_dir, step, backend.rank == 0)
        generators = random_states(backend)  # also: rank 0's begin() is done before any rank writes

        def write_shards() -> None:
            directory.mkdir(parents=True, exist_ok=True)  # a host that does not share the run directory
            files[name] = checkpoint_write.write_file(
                directory, name, partial(torch.save, optimizer.shard_state())
            )
            if backend.rank == 0:
                state = {"model": unwrapped(model).state_dict(), **position, **generators}
                files[MODEL] = checkpoint_write.write_file(directory, MODEL, partial(torch.save, state))

        failed = failed or _failure(write_shards, run_dir, step)
        written = backend.allgather_object(failed or files)
        _agree(written, failed, made_here, run_dir, step)
        every = {n: entry for part in written for n, entry in part.items()}

        def commit() -> None:
            extra = {checkpoint.SHARDED: "zero", "ranks": backend.size, "zero_stage": backend.stage}
            checkpoint_write.commit(
                run_dir, step, position["epoch"], backend.size, "torch", every, extra, keep
            )
            if then is not None:
                then()

        failed = _failure(commit, run_dir, step, backend.rank == 0)
        _agree(backend.allgather_object(failed), failed, made_here, run_dir, step)  # the manifest is written
        here = checkpoint.read_manifest(directory)
        if backend.rank != 0 and (here is None or here.files.get(name) != files[name]):
            # this host has its own copy of the run directory, collected when the job ends: it keeps
            # this step and the `keep - 1` before it of its own files, as rank 0's host does (a
            # later step staged from an earlier attempt is not this run's to remove)
            older = [n for n in checkpoint.step_names(run_dir) if checkpoint.step_of(n) < step]
            for gone in older[keep - 1 :]:
                shutil.rmtree(checkpoint.checkpoints_dir(run_dir) / gone, ignore_errors=True)

    def load(self, run_dir, model, optimizer: ShardedOptimizer, resume) -> dict[str, int] | None:
        backend = self.backend
        found = checkpoint.latest(run_dir, "torch") if resume and backend.rank == 0 else None
        # rank 0's choice for every rank: each one's own look at its disk could differ
        step = found.step if found is not None and _ranks(found) is not None else None
        step = backend.hvd.broadcast_object(step, root_rank=0, name="hvdtrain.zero.checkpoint")
        if step is None:
            return self.whole.load(run_dir, model, optimizer, resume)
        found = checkpoint.at(run_dir, step)
        if (ranks := _ranks(found)) is None:
            directory = checkpoint.step_dir(run_dir, step)
            raise FileNotFoundError(f"--resume: {directory} has no readable manifest on this host")
        position = self._read_model(found, model) if backend.rank == 0 else None
        if ranks == backend.size:
            optimizer.load_shard(_load(found.path(shard_name(backend.rank)), backend.device))
        else:
            optimizer.load_full(_whole(found, ranks))
        return restore_random_states(backend, backend.broadcast_state(model, optimizer, position))

    def read(self, run_dir, model, optimizer: ShardedOptimizer) -> dict[str, Any] | None:
        found = checkpoint.latest(run_dir, "torch")
        if (ranks := _ranks(found)) is None:
            return self.whole.read(run_dir, model, optimizer)
        assert found is not None
        optimizer.load_full(_whole(found, ranks))
        return self._read_model(found, model)

    def _read_model(self, found: checkpoint.Checkpoint, model) -> dict[str, Any]:
        saved = _load(found.path(MODEL), self.backend.device)
        unwrapped(model).load_state_dict(saved.pop("model"))
        print(f"resuming from {found.directory} {within.where(saved)}", flush=True)
        return saved


def consolidate(run_dir: Path, step: int | None = None) -> Path:
    """A sharded checkpoint of `run_dir` (the newest, or that of `step`) as one whole checkpoint in a
    new step directory; the sharded one stays. Raises ValueError in one line for what cannot be."""
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir} is not a run directory")
    found = checkpoint.latest(run_dir, "torch") if step is None else checkpoint.at(run_dir, step)
    if found is None:
        where = "no checkpoint" if step is None else f"no complete checkpoint of step {step}"
        steps = checkpoint.complete_steps(run_dir)
        listed = f" (steps: {', '.join(map(str, steps))})" if steps else ""
        raise ValueError(f"{run_dir} has {where}{listed}")
    for name, status in checkpoint.check(found).items():
        if status != "ok":
            raise ValueError(f"{found.path(name)} is {status}; nothing was written")
    if (ranks := _ranks(found)) is None:
        raise ValueError(f"{found.directory} is whole already: --resume and torch.load read it as it is")
    assert found.manifest is not None
    saved = _load(found.path(MODEL))
    optimizer = _whole(found, ranks)
    state = {"model": saved.pop("model"), "optimizer": optimizer, **saved}
    manifest = found.manifest
    directory = checkpoint_write.begin(run_dir, manifest.step, consolidated=True)
    entry = checkpoint_write.write_file(directory, FILE, partial(torch.save, state))
    newest = checkpoint.latest(run_dir, "torch")
    pointer = newest is None or newest.step is None or newest.step <= manifest.step
    extra = {"consolidated_from": found.directory.name, "ranks": ranks}
    checkpoint_write.commit(
        run_dir, manifest.step, manifest.epoch, manifest.world_size, "torch", {FILE: entry}, extra,
        keep=None, consolidated=True, pointer=pointer,
    )  # fmt: skip
    return directory


def _failure(write, run_dir: Path, step: int, here: bool = True) -> str | None:
    """What went wrong where this rank wrote its part of `step` (nothing where `here` is False)."""
    if not here:
        return None
    try:
        with checkpoint_write.writing(run_dir, step, remove=False):
            write()
    except checkpoint_write.WriteFailed as error:
        return str(error)
    return None


def _agree(reports: list[Any], failed: str | None, remove: bool, run_dir: Path, step: int) -> None:
    """Every rank, once all are done with the step directory: a failure anywhere ends each rank in
    WriteFailed, a rank that failed with its own line and the others with the first failure's;
    `remove`: this rank made the step directory, which without a manifest is no checkpoint."""
    failures = [report for report in reports if isinstance(report, str)]
    if not failures:
        return
    if remove:
        checkpoint_write.discard(run_dir, step)
    raise checkpoint_write.WriteFailed(failed or failures[0])

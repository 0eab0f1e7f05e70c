"""Saving and loading a Keras run's state, in the run directory's checkpoint layout
(hvdtrain.runtime.checkpoint): one .keras archive of the compiled model, so weights, optimizer
state and the layers' random state (Keras keeps it in variables) travel together, with the
schedule and data position (epochs finished, steps taken) inside it and in the manifest.

Collective like torch's: every rank calls save and load. The default, `KerasCheckpointer`, has
rank 0 write the archive, and on resume read it and broadcast the variables to every rank.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import keras

from hvdtrain.runtime import checkpoint, checkpoint_write, within
from hvdtrain.runtime.common import commit_file, tmp_path_for

if TYPE_CHECKING:
    from hvdtrain.runtime.tensorflow.backends import KerasBackend

FILE = "checkpoint.keras"
"""The archive of a step (and the older layout's name for it in the run directory)."""
STATE_MEMBER = "hvdtrain_state.json"
"""The position (epoch, step, the monitored metric's watch) inside the archive itself, so that the
file alone says where it was made; Keras ignores the extra member when it loads the model."""


def save_archive(path: Path, model: keras.Model, position: dict[str, Any]) -> checkpoint.FileEntry:
    """The model was compiled with its optimizer, so the archive holds the optimizer's state too and
    a resumed run continues exactly. Written atomically."""
    tmp = tmp_path_for(path)
    model.save(tmp)
    with zipfile.ZipFile(tmp, "a") as archive:
        archive.writestr(STATE_MEMBER, json.dumps(position))
    commit_file(tmp, path)
    return checkpoint.file_entry(path)


def load_archive(path: Path, model: keras.Model) -> dict:
    """Weights and optimizer state into the (compiled) model; returns the saved position."""
    model.load_weights(path)
    with zipfile.ZipFile(path) as archive:
        if STATE_MEMBER in archive.namelist():
            return json.loads(archive.read(STATE_MEMBER))
    return json.loads(path.with_name("checkpoint.state.json").read_text())  # run dirs of 0.1.0


class KerasCheckpointer:
    def __init__(self, backend: KerasBackend) -> None:
        self.backend = backend

    def save(self, run_dir: Path, model: keras.Model, position: dict[str, Any], keep: int = 1) -> None:
        """Collective: every rank calls it at the same point; rank 0 writes, and keeps the newest
        `keep` checkpoints."""
        backend = self.backend
        if backend.rank != 0:
            return
        step, epoch = position["step"], position["epoch"]
        with checkpoint_write.writing(run_dir, step):
            directory = checkpoint_write.begin(run_dir, step)
            entry = save_archive(directory / FILE, model, position)
            checkpoint_write.commit(
                run_dir, step, epoch, backend.size, "tensorflow", {FILE: entry}, keep=keep
            )

    def read(self, run_dir: Path, model: keras.Model) -> dict[str, Any] | None:
        """Rank 0 alone: the newest checkpoint into its model; the position it was made at."""
        if self.backend.rank != 0:
            return None
        found = checkpoint.latest(run_dir, "tensorflow")
        if found is None or FILE not in found.files:
            raise FileNotFoundError(f"--resume: no checkpoint in {run_dir}")
        path = found.path(FILE)
        state = load_archive(path, model)
        print(f"resuming from {path} {within.where(state)}", flush=True)
        return state

    def load(self, run_dir: Path, model: keras.Model, optimizer, resume: bool) -> dict[str, Any] | None:
        """Collective: every rank ends with the same variables (the checkpoint's when resuming, else
        rank 0's initial ones); returns the position a resumed run starts at, None for a new run."""
        state = self.read(run_dir, model) if resume else None
        state = self.backend.broadcast_object(state)
        self.backend.broadcast_variables(model.variables + list(optimizer.variables))
        return state

"""The checkpoint layout of a run directory, for every framework and strategy; imports neither.

    run_dir/checkpoints/<step>/     one or more files (one per rank, once state is sharded)
    run_dir/checkpoints/<step>/manifest.json   written last: each file's size and sha256, the step,
                                               epoch, world size, framework and format version
    run_dir/checkpoints/<step>-consolidated/   a sharded step's state in one file, written after the
                                               run (`hvdtrain checkpoint consolidate`)
    run_dir/checkpoints/latest      the name of the newest complete step directory
    run_dir/checkpoints/best/       with a monitored metric: the step directory of its best epoch
                                    (hard links) and best.json; never what a resume loads

Every file is written atomically (write, fsync, rename). A step directory without its manifest was
being written when its writer stopped: it is not a checkpoint, and `latest` never names it, because
the pointer is replaced only after the manifest. Resume checks and restarts read the manifest here,
before any rank starts, without a framework. Run directories of the older layout (one file,
run_dir/checkpoint.pt or run_dir/checkpoint.keras) still resume: where there is no step directory,
the reader falls back to that file.

Here: the layout's names, finding what a resume loads and checking that every file is whole, which
the launching side does too; writing, which only ranks do, is checkpoint_write.py.
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hvdtrain.runtime.common import atomic_write_bytes

FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
SHARDED = "sharded"
"""The manifest's extra key of a checkpoint a file a rank; its value names the strategy that reads it."""
CONSOLIDATED = "-consolidated"
STEP_DIR = re.compile(rf"(\d+)({CONSOLIDATED})?")
"""A step directory's name: the step, and whether it is a sharded step's consolidated copy."""
LEGACY_FILES = {"torch": "checkpoint.pt", "tensorflow": "checkpoint.keras"}
"""The one file per framework that rank 0 wrote into the run directory itself, before step directories."""
BEST = "best"
BEST_RECORD = "best.json"
UNREADABLE = "corrupt (not a readable checkpoint)"
WRITE_FAILED = "hvdtrain: checkpoint:"
"""How a rank's line about a checkpoint it could not write (checkpoint_write.WriteFailed) begins; the
launching hvdtrain shows that line as the job's failure."""


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    step: int
    """Optimizer steps taken when the checkpoint was written."""
    epoch: int
    """Epochs finished."""
    world_size: int
    framework: str
    files: dict[str, FileEntry]
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    """What a checkpointer adds (e.g. how its state is sharded), kept as written."""

    def to_json(self) -> bytes:
        value = {
            "format_version": self.format_version,
            "framework": self.framework,
            "step": self.step,
            "epoch": self.epoch,
            "world_size": self.world_size,
            "files": {name: {"size": e.size, "sha256": e.sha256} for name, e in sorted(self.files.items())},
            **({"extra": self.extra} if self.extra else {}),
        }
        return (json.dumps(value, indent=2) + "\n").encode()

    @classmethod
    def from_json(cls, text: bytes | str) -> Manifest:
        """Raises ValueError for anything but a manifest of a format this version reads."""
        try:
            value = json.loads(text)
            if (version := value["format_version"]) != FORMAT_VERSION:
                raise ValueError(f"format version {version}; this hvdtrain reads {FORMAT_VERSION}")
            files = {name: FileEntry(int(e["size"]), str(e["sha256"])) for name, e in value["files"].items()}
            return cls(
                step=int(value["step"]),
                epoch=int(value["epoch"]),
                world_size=int(value["world_size"]),
                framework=str(value["framework"]),
                files=files,
                extra=dict(value.get("extra", {})),
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as error:
            raise ValueError(f"not a checkpoint manifest ({type(error).__name__}: {error})") from None


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint found in a run directory: a step directory with its manifest, or the one file of
    the older layout (manifest None)."""

    directory: Path
    files: tuple[str, ...]
    manifest: Manifest | None = None

    def path(self, name: str) -> Path:
        return self.directory / name

    @property
    def step(self) -> int | None:
        return self.manifest.step if self.manifest else None

    @property
    def sharded_by(self) -> str | None:
        """The strategy whose ranks each wrote a file of it, and which alone resumes it; None where
        it is whole."""
        return self.manifest.extra.get(SHARDED) if self.manifest else None


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / CHECKPOINTS


def step_dir(run_dir: Path, step: int, consolidated: bool = False) -> Path:
    return checkpoints_dir(run_dir) / f"{step}{CONSOLIDATED if consolidated else ''}"


def file_entry(path: Path) -> FileEntry:
    """Size and digest of a file as it is on disk (read in blocks: shards can be large)."""
    sha = hashlib.sha256()
    with path.open("rb") as stream:
        while block := stream.read(1 << 20):
            sha.update(block)
    return FileEntry(path.stat().st_size, sha.hexdigest())


def _order(name: str) -> tuple[int, bool]:
    found = STEP_DIR.fullmatch(name)
    assert found is not None, name
    return int(found[1]), bool(found[2])


def step_names(run_dir: Path) -> list[str]:
    """The names of the step directories there are, complete or not, newest first (a consolidated
    copy before its step)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    names = [p.name for p in root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name)]
    return sorted(names, key=_order, reverse=True)


def step_of(name: str) -> int:
    """The step of a step directory's name."""
    return _order(name)[0]


def complete_steps(run_dir: Path) -> list[int]:
    """The steps of the complete step directories, oldest first, once each."""
    root = checkpoints_dir(run_dir)
    return sorted({step_of(name) for name in step_names(run_dir) if read_manifest(root / name)})


def at(run_dir: Path, step: int) -> Checkpoint | None:
    """The step directory of `step` itself (not a consolidated copy) where its manifest reads."""
    directory = step_dir(run_dir, step)
    manifest = read_manifest(directory)
    return None if manifest is None else Checkpoint(directory, tuple(sorted(manifest.files)), manifest)


def read_manifest(directory: Path) -> Manifest | None:
    try:
        return Manifest.from_json((directory / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return None


def _pointed(run_dir: Path) -> str | None:
    """The step directory `latest` names."""
    try:
        text = (checkpoints_dir(run_dir) / LATEST).read_text().strip()
    except OSError:
        return None
    return text if STEP_DIR.fullmatch(text) else None


def latest(run_dir: Path, framework: str | None = None) -> Checkpoint | None:
    """What a resume loads: the step directory `latest` names, else the newest one with a manifest (a
    crash between a manifest and the pointer, or a step being written again), else the older layout's
    file of `framework` (either framework's when None), else None. Where only an incomplete directory
    is named, it is returned without files, so that check() refuses it by its manifest. Finding is not
    checking: see check()."""
    pointed = _pointed(run_dir)
    candidates = ([pointed] if pointed is not None else []) + step_names(run_dir)
    for name in candidates:
        directory = checkpoints_dir(run_dir) / name
        if (manifest := read_manifest(directory)) is not None:
            return Checkpoint(directory, tuple(sorted(manifest.files)), manifest)
    if pointed is not None:
        return Checkpoint(checkpoints_dir(run_dir) / pointed, ())
    for name in [LEGACY_FILES[framework]] if framework else LEGACY_FILES.values():
        if (run_dir / name).is_file():
            return Checkpoint(run_dir, (name,))
    return None


def _check_zip(path: Path) -> str:
    """The older layout's check: torch and Keras checkpoints are zip files."""
    if not path.is_file():
        return "missing"
    try:
        if not zipfile.is_zipfile(path):
            return UNREADABLE
        with zipfile.ZipFile(path) as archive:
            if archive.testzip() is not None:
                return UNREADABLE
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        return f"corrupt ({error})"
    return "ok"


def _check_entry(path: Path, entry: FileEntry) -> str:
    if not path.is_file():
        return "missing"
    try:
        found = file_entry(path)
    except OSError as error:
        return f"corrupt ({error})"
    if found.size != entry.size:
        return f"corrupt ({found.size} bytes, the manifest says {entry.size})"
    if found.sha256 != entry.sha256:
        return "corrupt (its sha256 differs from the manifest's)"
    return "ok"


def check(checkpoint: Checkpoint) -> dict[str, str]:
    """Each file of a checkpoint -> "ok", "missing" or "corrupt (why)", by name within its directory.
    A step directory is checked against its manifest (presence, size, digest), which is itself one of
    the files; an older layout's file by reading it as a zip archive."""
    if checkpoint.manifest is None and not checkpoint.files:  # the pointer names it; no manifest reads
        manifest_path = checkpoint.path(MANIFEST)
        try:
            Manifest.from_json(manifest_path.read_bytes())
        except FileNotFoundError:
            return {MANIFEST: "missing"}
        except (OSError, ValueError) as error:
            return {MANIFEST: f"corrupt ({error})"}
        return {MANIFEST: "corrupt (it changed while it was read)"}
    if checkpoint.manifest is None:
        return {name: _check_zip(checkpoint.path(name)) for name in checkpoint.files}
    statuses = {MANIFEST: "ok"}
    for name, entry in sorted(checkpoint.manifest.files.items()):
        statuses[name] = _check_entry(checkpoint.path(name), entry)
    return statuses


def inspect(run_dir: Path, step: int | None = None) -> dict[str, str]:
    """What --resume would load from a run directory (the checkpoint of `step`, else the latest),
    checked before any rank starts: each file, relative to run_dir -> "ok", "missing" or "corrupt
    (why)". Without any checkpoint, the older layout's files of both frameworks, "missing" (which
    one a recipe needs: resume_problem)."""
    if step is not None:
        found = at(run_dir, step)
        if found is None:
            return {f"{CHECKPOINTS}/{step}/{MANIFEST}": "missing"}
        return {f"{CHECKPOINTS}/{step}/{name}": status for name, status in check(found).items()}
    found = latest(run_dir)
    if found is None or (found.manifest is None and found.directory == run_dir):
        return {name: _check_zip(run_dir / name) for name in LEGACY_FILES.values()}
    prefix = found.directory.relative_to(run_dir).as_posix()
    return {f"{prefix}/{name}": status for name, status in check(found).items()}


def newest_intact(run_dir: Path, below: int | None = None) -> int | None:
    """The newest step (below `below`, where given) whose checkpoint passes its manifest."""
    for step in reversed(complete_steps(run_dir)):
        found = at(run_dir, step)
        if (below is None or step < below) and found and all(s == "ok" for s in check(found).values()):
            return step
    return None


def point_latest(run_dir: Path, step: int) -> None:
    """`latest` names this step's checkpoint: what every rank's checkpointer then loads."""
    atomic_write_bytes(checkpoints_dir(run_dir) / LATEST, f"{step_dir(run_dir, step).name}\n".encode())


def resume_problem(files: Mapping[str, str], framework: str) -> tuple[str, str] | None:
    """The first file (relative to the run directory) that stops a resume, with its status, from what
    inspect() found; None where the run can resume."""
    if any(name.startswith(f"{CHECKPOINTS}/") for name in files):
        return next(((name, status) for name, status in files.items() if status != "ok"), None)
    name = LEGACY_FILES[framework]
    status = files.get(name, "missing")
    return None if status == "ok" else (name, status)

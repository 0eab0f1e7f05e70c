"""Framework-free pieces of a run: the run directory, metrics, summary, learning-rate schedule."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

EXIT_INCONSISTENT_WEIGHTS = 3
CHECKPOINT_FILES = {"torch": ("checkpoint.pt",), "tensorflow": ("checkpoint.keras",)}
"""What rank 0 writes after every epoch, per framework; --resume checks them before any rank starts."""
RUN_RECORD = "run.json"
"""Which recipe, framework and strategy a run directory holds."""


def rank_final(parameter_digest: str) -> tuple[str, str]:
    """What each rank contributes to the summary: its weights' digest and the host it ran on."""
    return parameter_digest, socket.gethostname()


def digest(chunks: Iterable[bytes]) -> str:
    sha = hashlib.sha256()
    for chunk in chunks:
        sha.update(chunk)
    return sha.hexdigest()


TMP_MARK = ".hvdtrain-tmp-"
"""In the name of every file written before its atomic rename; a crash can leave one behind."""


def tmp_path_for(path: Path) -> Path:
    return path.with_name(f"{TMP_MARK}{os.getpid()}-{path.name}")


def commit_file(tmp: Path, path: Path) -> None:
    """Make a finished temporary file the real one: on disk first (fsync), then renamed over it in
    one step, then the rename itself made durable. A reader sees the old file or the new, never part."""
    with tmp.open("rb+") as stream:
        os.fsync(stream.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = tmp_path_for(path)
    tmp.write_bytes(data)
    commit_file(tmp, path)


def read_json_object(path: Path) -> dict | None:
    """A JSON object from a file, or None where it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def remove_stale_tmp_files(run_dir: Path) -> list[Path]:
    """The temporary files a killed writer left in a run directory."""
    removed = []
    for stale in run_dir.glob(f"{TMP_MARK}*"):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
            removed.append(stale)
    return removed


@dataclass
class Throughput:
    """Samples per second, per epoch and overall; `steady` leaves out the first epoch (tracing,
    Horovod's first negotiation), which benchmarks compare."""

    samples: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def add(self, samples: int, seconds: float) -> float:
        self.samples.append(samples)
        self.seconds.append(seconds)
        return samples / seconds

    @property
    def overall(self) -> float | None:
        return sum(self.samples) / sum(self.seconds) if self.seconds else None

    @property
    def steady(self) -> float | None:
        rates = [n / t for n, t in zip(self.samples, self.seconds, strict=True)]
        return statistics.median(rates[1:] if len(rates) > 1 else rates) if rates else None


@dataclass
class RunLog:
    """Rank 0's record of a run: metrics.jsonl, TensorBoard scalars and the final summary.json."""

    run_dir: Path
    is_chief: bool
    recipe: str
    strategy: str
    world_size: int
    started: float = field(default_factory=time.monotonic)
    scalar_writer: Callable[[str, float, int], None] | None = None
    """The framework's TensorBoard writer (name, value, step); set by the runtime on rank 0."""
    _pending: list[dict] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.is_chief:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            remove_stale_tmp_files(self.run_dir)

    def step_lr(self, step: int, lr: float) -> None:
        """A per-step learning rate (warmup), written with the next epoch's record."""
        if self.is_chief:
            self._pending.append({"step": step, "lr": lr})

    def epoch(self, epoch: int, epochs: int, metrics: dict[str, float | None]) -> None:
        if not self.is_chief:
            return
        records, self._pending = [*self._pending, {"epoch": epoch, **metrics}], []
        with (self.run_dir / "metrics.jsonl").open("a") as stream:
            stream.write("".join(json.dumps(record) + "\n" for record in records))
        self._write_tensorboard(epoch, metrics)
        shown = "  ".join(f"{k} {v:.4g}" for k, v in metrics.items() if isinstance(v, float))
        print(f"epoch {epoch}/{epochs}  {shown}", flush=True)

    def _write_tensorboard(self, epoch: int, metrics: dict[str, float | None]) -> None:
        if self.scalar_writer is None:
            return
        for name, value in metrics.items():
            if isinstance(value, float):
                self.scalar_writer(name, value, epoch)

    def finish(
        self, throughput: Throughput, finals: list[tuple[str, str]], steps: int, **values: object
    ) -> dict:
        """The summary every strategy writes: each rank's rank_final, allgathered from every rank."""
        digests = [digest for digest, _ in finals]
        return self.summary(
            hosts=[host for _, host in finals],
            samples_per_sec=throughput.overall,
            steady_samples_per_sec=throughput.steady,
            train_seconds=sum(throughput.seconds),
            steps=steps,
            weights_consistent=len(set(digests)) == 1,
            parameter_digest=digests[0],
            **values,
        )

    def summary(self, **values: object) -> dict:
        summary = {
            "recipe": self.recipe,
            "strategy": self.strategy,
            "world_size": self.world_size,
            "wall_seconds": time.monotonic() - self.started,
            "run_dir": str(self.run_dir),
            **values,
        }
        if self.is_chief:
            atomic_write_bytes(self.run_dir / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())
        return summary

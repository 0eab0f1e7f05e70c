"""Framework-free pieces of a run: the run directory, metrics, summary, learning-rate schedule."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import socket
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hvdtrain.runtime.progress import PROGRESS_ENV, human, progress_record

if TYPE_CHECKING:
    from hvdtrain.config import TrainConfig

BUCKET_VARIABLE = "HVDTRAIN_DDP_BUCKET_MB"
"""DDP's gradient bucket size in MB, which planning sets for the ddp backend (torch has no variable of
its own for it): here, where both sides read it, since the rank side imports nothing of planning."""

COMPRESSION_VARIABLE = "HVDTRAIN_COMPRESSION"
"""Horovod's gradient compression, `fp16` or `none`, where `hvdtrain bench --tune` kept fp16 for a
recipe's link; `fp16_allreduce=true` asks for it too."""
COMPRESSIONS = ("none", "fp16")


def fp16_allreduce(config: TrainConfig) -> bool:
    """Whether Horovod compresses this run's gradients to fp16 on the wire."""
    return bool(config.fp16_allreduce) or os.environ.get(COMPRESSION_VARIABLE) == "fp16"


RUN_RECORD = "run.json"
"""Which recipe, framework and strategy a run directory holds."""


def rank_final(parameter_digest: str) -> tuple[str, str, float]:
    """What each rank contributes to the summary: its weights' digest, the host it ran on and its
    peak resident memory in MiB (the rank's own process; Linux reports KiB)."""
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return parameter_digest, socket.gethostname(), round(peak_mib, 1)


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
    """The temporary files a killed writer left in a run directory, its checkpoints' too."""
    removed = []
    for stale in run_dir.rglob(f"{TMP_MARK}*"):
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


def progress_interval(value: str | None) -> float | None:
    """HVDTRAIN_PROGRESS_S as seconds; None (no progress records) when unset or not a number >= 0."""
    try:
        seconds = float(value) if value else None
    except ValueError:
        return None
    return seconds if seconds is not None and seconds >= 0 else None


def epoch_line(epoch: int, epochs: int, metrics: dict[str, float | None]) -> str:
    """`epoch 3/8  loss 0.2205  test_accuracy 0.9378  lr 0.1  23,970 samples/s`: no exponents."""
    shown = [
        f"{key} {human(value)}"
        for key, value in metrics.items()
        if isinstance(value, float) and key != "samples_per_sec"
    ]
    if isinstance(rate := metrics.get("samples_per_sec"), float):
        shown.append(f"{human(rate)} samples/s")
    return "  ".join([f"epoch {epoch}/{epochs}", *shown])


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
    progress_every: float | None = field(
        default_factory=lambda: progress_interval(os.environ.get(PROGRESS_ENV))
    )
    """Seconds between progress records within an epoch (HVDTRAIN_PROGRESS_S); None: none."""
    _pending: list[dict] = field(default_factory=list, init=False, repr=False)
    _last_progress: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.is_chief:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            remove_stale_tmp_files(self.run_dir)

    def step_lr(self, step: int, lr: float) -> None:
        """A per-step learning rate (warmup), written with the next epoch's record; `time` is when
        the step was, which the launching process gives MLflow as the point's time."""
        if self.is_chief:
            self._pending.append({"step": step, "lr": lr, "time": time.time()})

    def progress(
        self,
        epoch: int,
        epochs: int,
        step: int,
        steps: int,
        samples: int,
        elapsed: float,
        loss: float | Callable[[], float | None] | None,
    ) -> None:
        """Rank 0, within an epoch (0-based here): `step` of `steps` done, `samples` over all ranks in
        `elapsed` seconds. Cheap enough for every step: prints at most every `progress_every` s.
        `loss` may be a function, called only for a record that is printed (a framework's loss
        tensor costs a device sync to read, a mean over the epoch's losses grows with the epoch)."""
        if not self.is_chief or self.progress_every is None or not 0 < step < steps:
            return
        now = time.monotonic()
        if elapsed < self.progress_every or now - self._last_progress < self.progress_every:
            return
        self._last_progress = now
        eta = elapsed / step * (steps - step)
        loss = loss() if callable(loss) else loss
        print(progress_record(epoch + 1, epochs, step, steps, samples / elapsed, loss, eta), flush=True)

    def flush_steps(self) -> None:
        """The per-step records so far, written now: after a step checkpoint, whose resume starts
        after them."""
        if self.is_chief and self._pending:
            records, self._pending = self._pending, []
            with (self.run_dir / "metrics.jsonl").open("a") as stream:
                stream.write("".join(json.dumps(record) + "\n" for record in records))

    def epoch(self, epoch: int, epochs: int, metrics: dict[str, float | None]) -> None:
        if not self.is_chief:
            return
        records, self._pending = [*self._pending, {"epoch": epoch, **metrics, "time": time.time()}], []
        with (self.run_dir / "metrics.jsonl").open("a") as stream:
            stream.write("".join(json.dumps(record) + "\n" for record in records))
        self._write_tensorboard(epoch, metrics)
        print(epoch_line(epoch, epochs, metrics), flush=True)

    def _write_tensorboard(self, epoch: int, metrics: dict[str, float | None]) -> None:
        if self.scalar_writer is None:
            return
        for name, value in metrics.items():
            if isinstance(value, float):
                self.scalar_writer(name, value, epoch)

    def finish(
        self,
        throughput: Throughput,
        finals: list[tuple[str, str, float]],
        steps: int,
        tested: dict[str, object],
        final_loss: float,
        epochs: int,
        **values: object,
    ) -> dict:
        """The summary every loop writes: each rank's rank_final (allgathered from every rank), the
        last evaluation's test_<metric> values, the final loss."""
        digests = [final[0] for final in finals]
        return self.summary(
            **tested,
            final_loss=final_loss,
            epochs=epochs,
            hosts=[final[1] for final in finals],
            peak_rss_mib=[final[2] for final in finals],
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

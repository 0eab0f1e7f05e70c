"""`make bench` section: the training time a checkpoint costs, written as the step waits
(synchronous) against written in the background (async_checkpoint), on the GPT and ResNet-50 of
the workloads section: one rank on one core, the other core free for the writer, as a GPU node's
cores are while its GPUs train (rank 0 alone writes, so one rank shows the cost). Each mode trains
the same steps with checkpoints every CHECKPOINT_EVERY steps inside its epochs (the epoch's own
checkpoint is not in the timed part) and without any; the time lost per checkpoint is the
difference in training time over the checkpoints taken. The two modes' checkpoints are compared
byte for byte."""

from __future__ import annotations

import filecmp
import json
import statistics
from pathlib import Path

from benchmarks.workloads import WORKLOADS
from hvdtrain.measure.bench import BenchError, hvdtrain_run
from hvdtrain.runtime import checkpoint

RECIPES = ("gpt-torch", "resnet-torch")
EPOCHS, STEPS, CHECKPOINT_EVERY, REPEATS = 2, 12, 2, 3
"""Two epochs of 12 steps, a checkpoint every 2 (a background write takes less than a step): 5
inside each epoch, 10 timed in all; three times, as a checkpoint costs a fraction of a second and a
run's time varies by more than that."""
CHECKPOINTING = (
    *("--set", "checkpoint=true", "--set", f"checkpoint_every_steps={CHECKPOINT_EVERY}"),
    *("--set", "keep_checkpoints=2"),
)
MODES: dict[str, tuple[str, ...]] = {
    "none": ("--set", "checkpoint=false"),
    "sync": CHECKPOINTING,
    "async": (*CHECKPOINTING, "--set", "async_checkpoint=true"),
}
GOAL = 5.0
"""The synchronous checkpoint's lost time over the background one's, at least."""


def timed_checkpoints() -> int:
    return EPOCHS * len(range(CHECKPOINT_EVERY, STEPS, CHECKPOINT_EVERY))


def train_seconds(recipe: str, mode: str, run_dir: Path) -> float:
    _, batch, settings = WORKLOADS[recipe]
    hvdtrain_run(
        recipe,
        "--np",
        "1",
        "--threads-per-rank",
        "1",
        "--set",
        f"batch_size={batch}",
        "--set",
        f"epochs={EPOCHS}",
        "--set",
        f"steps_per_epoch={STEPS}",
        *settings,
        *MODES[mode],
        run_dir=run_dir,
    )
    return float(json.loads((run_dir / "summary.json").read_text())["train_seconds"])


def same_bytes(sync_dir: Path, async_dir: Path) -> bool:
    """Every checkpoint both runs kept holds the same files with the same bytes."""
    steps = checkpoint.complete_steps(sync_dir)
    if not steps or steps != checkpoint.complete_steps(async_dir):
        return False
    for step in steps:
        ours, theirs = checkpoint.step_dir(sync_dir, step), checkpoint.step_dir(async_dir, step)
        names = sorted(p.name for p in ours.iterdir())
        if names != sorted(p.name for p in theirs.iterdir()):
            return False
        if not all(filecmp.cmp(ours / name, theirs / name, shallow=False) for name in names):
            return False
    return True


def checkpoint_bytes(run_dir: Path) -> int:
    found = checkpoint.latest(run_dir)
    if found is None or found.manifest is None:
        raise BenchError(f"no checkpoint in {run_dir}")
    return sum(entry.size for entry in found.manifest.files.values())


def main(out: Path) -> None:
    print(
        f"{'recipe':<14} {'checkpoint':>11} {'none s':>8} {'sync s':>8} {'async s':>8} "
        f"{'lost sync':>10} {'lost async':>11} {'ratio':>7}  same bytes",
        flush=True,
    )
    for recipe in RECIPES:
        seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
        for repeat in range(REPEATS):  # interleaved: the machine's drift falls on every mode alike
            for mode in MODES:
                seconds[mode].append(
                    train_seconds(recipe, mode, out / f"checkpoints-{recipe}-{mode}-{repeat}")
                )
        median = {mode: statistics.median(values) for mode, values in seconds.items()}
        lost = {mode: (median[mode] - median["none"]) / timed_checkpoints() for mode in ("sync", "async")}
        ratio = lost["sync"] / lost["async"] if lost["async"] > 0 else float("inf")
        same = same_bytes(out / f"checkpoints-{recipe}-sync-0", out / f"checkpoints-{recipe}-async-0")
        size = checkpoint_bytes(out / f"checkpoints-{recipe}-sync-0") / 2**20
        print(
            f"{recipe:<14} {size:>8.0f} MiB {median['none']:>8.2f} {median['sync']:>8.2f} "
            f"{median['async']:>8.2f} {lost['sync'] * 1000:>7.0f} ms {lost['async'] * 1000:>8.0f} ms "
            f"{ratio:>6.1f}x  {'yes' if same else 'NO'}",
            flush=True,
        )
        met = "met" if ratio >= GOAL and same else "MISSED"
        print(
            f"  goal: {recipe} loses >= {GOAL:.0f}x less per checkpoint in the background, same bytes: {met}"
        )

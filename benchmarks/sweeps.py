"""`make bench` section sweeps: the same hvdtrain sweep of digits-mlp-torch (lr and width, np=2,
one seed, one budget) without pruning and with it, side by side: the trial-epochs each spent, the
best test accuracy each found. TPE's first 10 trials are its seeded random start-up, so both sweeps
try the same params, and pruning can only save epochs or lose the best trial."""

from __future__ import annotations

import time
from pathlib import Path

import hvdtrain

RECIPE = "digits-mlp-torch"
PARAMS = ["lr=log:1e-4:0.3", "hidden=int:16:256"]
TRIALS, SEED = 10, 0
PRUNED = "halving"
GOALS = "goals: best >= 0.97; pruning >= 40% fewer trial-epochs and the same best"


def one(out: Path, pruner: str) -> tuple[int, float, int, int, float]:
    """trial-epochs, best test accuracy, its trial, pruned trials, seconds."""
    began = time.monotonic()
    result = hvdtrain.sweep(
        RECIPE, PARAMS, trials=TRIALS, seed=SEED, pruner=pruner, sweep_dir=out / f"sweep-{pruner}",
        np=2, launcher="gloo", console=False,
    )  # fmt: skip
    seconds = time.monotonic() - began
    if result.best is None:
        raise RuntimeError(f"the sweep with pruner {pruner} completed no trial; see {result.sweep_dir}")
    epochs = sum(row.epochs for row in result.trials)
    pruned = sum(row.state == "pruned" for row in result.trials)
    return epochs, result.best.value, result.best.number, pruned, seconds


def main(out: Path) -> None:
    rows = {pruner: one(out, pruner) for pruner in ("none", PRUNED)}
    full = rows["none"][0]
    for pruner, (epochs, best, number, pruned, seconds) in rows.items():
        saved = f"{1 - epochs / full:+.0%}".replace("+", "-") if pruner != "none" else "    "
        print(
            f"pruner {pruner:<8} {TRIALS} trials ({pruned} pruned)  {epochs:4d} trial-epochs {saved:>5}  "
            f"best test_accuracy {best:.4f} (trial {number})  {seconds:5.0f} s"
        )
    same = rows[PRUNED][1] == rows["none"][1]
    fewer = 1 - rows[PRUNED][0] / full
    print(f"{GOALS}: best {rows['none'][1]:.4f}, {fewer:.0%} fewer, same best: {'yes' if same else 'no'}")

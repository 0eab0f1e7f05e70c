"""`make bench` section `tune-link`: `hvdtrain bench --tune` learning the link. gpt-torch (the scaling
section's settings) at np=2, one rank on each of two namespace hosts, both links held to each rate in
turn; at each rate --tune times Horovod's settings (fp16 compression among them) and its autotune
across the two hosts, as `hvdtrain bench gpt-torch --tune --hosts ...` does, into a tuning file of
the section's own. What it keeps at each rate is printed, with the goal: fp16 compression kept where
the link bounds the step, and not where the compute does (on a CPU the casts cost more than the
halved bytes save)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks.scaling import BRIDGE, EPOCHS, RECIPES, STEPS, SUBNET, _batch, rate_label

RECIPE = "gpt-torch"
RATES: tuple[float | None, ...] = (100.0, None)
"""Mbit/s: where the scaling section found the link bounds gpt-torch's step, and unshaped."""


def settings() -> tuple[str, ...]:
    """The arguments of every run after the hosts: the scaling section's settings, no checkpoint."""
    recipe, arguments = RECIPES[RECIPE]
    assert recipe == RECIPE, "the tuning file keeps the choice under the recipe's name"
    return (*arguments, "--set", "checkpoint=false")


def main(out: Path) -> dict[str, str]:
    from hvdtrain.measure import tune, tuning
    from tests.support.rig import Rig, rig_host_args

    out.mkdir(parents=True, exist_ok=True)
    kept_file = out / "tuning.json"
    kept: dict[str, str] = {}
    extra = settings()
    with Rig(hosts=2, bridge=BRIDGE, subnet=SUBNET) as rig:
        hosts = rig_host_args(rig, 1, 2)
        for rate in RATES:
            rig.limit_links(rate)
            label = rate_label(rate)
            table = tune.tune_and_keep(
                RECIPE,
                ["horovod"],
                [2],
                ["mpi"],
                STEPS,
                EPOCHS,
                _batch(RECIPE),
                out / label.replace(" ", "").replace("/", ""),
                path=kept_file,
                extra=(*hosts, *extra),
                hosts=f"2 namespace hosts ({label} links)",
            )
            print(table, flush=True)
            setting = json.loads(kept_file.read_text())["horovod"][RECIPE]["setting"]
            kept[label] = tuning.Tuning.from_json(setting).label()
    for label, setting in kept.items():
        print(f"--tune kept at {label}: {setting}")
    bound, free = (kept[rate_label(rate)] for rate in RATES)
    met = "fp16" in bound and "fp16" not in free
    print(
        f"--tune learns the link: fp16 compression kept at {rate_label(RATES[0])} and not unshaped  "
        f"(goal: {'met' if met else 'not met'})"
    )
    return kept


if __name__ == "__main__":
    main(Path(os.environ.get("OUT", "runs/bench-tune-link")))

"""Naming a rank that holds the others up.

In synchronous training every rank's wall step time is the slowest rank's: the others wait for it in
the gradients' average. So what tells a slow rank is how long each takes before it is *ready* to
average: its time to ready, from the start of its step (the first batch fetched) to the moment its
gradients are all computed, which is data loading, forward and backward, and nothing of a collective.
A rank waiting in the average for a slower one is then as fast as it really is.

Where the loop marks ready is the backend's matter (hvdtrain.runtime.torch.training): under Horovod
(and zero) the allreduces started during backward are only waited for in `optimizer.synchronize()`,
so ready is that call's entry; under DDP the wait is at the end of backward itself, so ready is
when backward produced its last gradient. A backend whose forward is collective (fsdp's gathers of
parameters) has no time to ready a wait would not blur, and is not watched. On a GPU the clock reads
when the work was queued: a rank held up by its input or its host is named, a slow GPU is not.

Each rank adds its steps' times to ready; every `every` steps (but the first `every` after a start,
the warm-up) the ranks exchange their means over those steps in one small collective (a sum of a
vector of one slot a rank) and each decides alike (`judge`): a rank whose mean exceeds `factor`
times the median of the other ranks', and exceeds it by at least MIN_EXCESS_S, is slow at that
check; slow at `checks` checks in a row, it is named, once, by rank 0 in one line (`slow rank N on
HOST: ...`), and in summary.json's `slow_ranks`, beside every rank's percentiles of its times to
ready and of its steps (`rank_step_times`).
"""

from __future__ import annotations

import math
import socket
import statistics
from array import array
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass
from typing import Any

MARK = "slow rank"
"""What rank 0's line starts with, after `hvdtrain: `."""
MIN_EXCESS_S = 0.001
"""Seconds a step by which a slow rank's mean time to ready must also exceed the others' median:
below a millisecond a step, a ratio is the timer's and the scheduler's noise, not a slow rank."""
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Named:
    """A rank named slow, as summary.json's `slow_ranks` lists it."""

    rank: int
    host: str
    step: int
    """The step of the check that named it."""
    ready_s: float
    """Its mean time to ready a step, over the steps since the check before."""
    others_median_s: float
    """The median of the other ranks' means."""
    checks: int
    """Checks in a row at which it was slow."""

    def line(self) -> str:
        ratio = self.ready_s / self.others_median_s if self.others_median_s > 0 else math.inf
        return (
            f"hvdtrain: {MARK} {self.rank} on {self.host}: {self.ready_s * 1000:.1f} ms a step before it is "
            f"ready to average gradients, the other ranks' median {self.others_median_s * 1000:.1f} ms "
            f"({ratio:.1f}x), at {self.checks} checks in a row up to step {self.step}; "
            "every rank waits for it"
        )


def slow_at_check(ready_s: Sequence[float], factor: float) -> list[tuple[int, float]]:
    """The ranks slow at one check, each with the median of the others' means: their mean time to
    ready above `factor` times that median and above it by MIN_EXCESS_S. One rank has no others."""
    found = []
    for rank, mine in enumerate(ready_s):
        others = [value for other, value in enumerate(ready_s) if other != rank]
        if not others:
            continue
        median = statistics.median(others)
        if mine > factor * median and mine - median >= MIN_EXCESS_S:
            found.append((rank, median))
    return found


def judge(
    ready_s: Sequence[float],
    streaks: Sequence[int],
    factor: float,
    checks: int,
    named_before: Collection[int] = (),
) -> tuple[list[int], list[tuple[int, float]]]:
    """One check: each rank's streak of checks in a row at which it was slow, and the ranks named now
    (with the others' median): those whose streak reached `checks`, once a run (not `named_before`):
    a rank slow on and off is one rank to look at, not a line every few checks."""
    slow = dict(slow_at_check(ready_s, factor))
    updated = [streak + 1 if rank in slow else 0 for rank, streak in enumerate(streaks)]
    named = [
        (rank, slow[rank])
        for rank, streak in enumerate(updated)
        if streak >= checks and rank not in named_before
    ]
    return updated, named


def percentiles(values: Sequence[float]) -> dict[str, float] | None:
    """p50, p90, p99 (linear between the nearest ranks, as numpy's default) and max; None for none."""
    if not values:
        return None
    ordered = sorted(values)
    found = {}
    for q in PERCENTILES:
        position = (len(ordered) - 1) * q / 100
        low = math.floor(position)
        high = min(low + 1, len(ordered) - 1)
        found[f"p{q}"] = ordered[low] + (ordered[high] - ordered[low]) * (position - low)
    found["max"] = ordered[-1]
    return found


class Stragglers:
    """One run's watch for a slow rank. Every rank calls after_step after each step with its time to
    ready and its step's time; the check every `every` steps is collective, so every rank calls it at
    the same steps (the loops' step numbers are the same on every rank)."""

    def __init__(
        self,
        factor: float,
        checks: int,
        every: int,
        rank: int,
        size: int,
        total: Callable[[list[float], str], list[float]],
        gather: Callable[[Any], list[Any]],
    ) -> None:
        """`total`: the backend's sum over ranks; `gather`: its allgather of an object."""
        self.factor, self.checks, self.every = factor, checks, every
        self.total, self.gather = total, gather
        self.named: list[Named] = []
        self.ready_s, self.step_s = array("d"), array("d")
        """Every step's times on this rank, for its percentiles at the end."""
        self.reset(rank, size)

    def reset(self, rank: int, size: int) -> None:
        """A new world (elastic): streaks, hosts and names are of the old one; a step's times stay."""
        self.rank, self.size, self.is_chief = rank, size, rank == 0
        self.streaks = [0] * size
        self.window, self.in_window = 0.0, 0
        self.warmed_up = False
        """The first check's steps, after a start or a reset, are not compared: they hold the warm-up
        (first allocations, first kernels, the first batches read), which ranks pay unevenly."""
        self.hosts: list[str] | None = None
        self.named_ranks: set[int] = set()
        """The ranks of this world named already."""

    @property
    def enabled(self) -> bool:
        return self.every > 0 and self.size > 1

    def after_step(self, step: int, ready_s: float | None, step_s: float) -> None:
        """`ready_s` None: this step had no time to ready (the backend is not watched)."""
        if ready_s is None:
            return
        self.ready_s.append(ready_s)
        self.step_s.append(step_s)
        if not self.enabled:
            return
        self.window += ready_s
        self.in_window += 1
        if step % self.every == 0:
            self._check(step)

    def _check(self, step: int) -> None:
        if not self.warmed_up:  # the same step on every rank: no rank enters the collective alone
            self.window, self.in_window, self.warmed_up = 0.0, 0, True
            return
        mine = [0.0] * self.size
        mine[self.rank] = self.window / max(1, self.in_window)
        means = self.total(mine, "hvdtrain.stragglers")
        self.window, self.in_window = 0.0, 0
        self.streaks, named = judge(means, self.streaks, self.factor, self.checks, self.named_ranks)
        if not named:
            return
        if self.hosts is None:  # every rank decided alike: this gather is collective
            self.hosts = list(self.gather(socket.gethostname()))
        for rank, median in named:
            found = Named(rank, self.hosts[rank], step, means[rank], median, self.checks)
            self.named.append(found)
            self.named_ranks.add(rank)
            if self.is_chief:
                print(found.line(), flush=True)

    def summary(self) -> dict[str, Any]:
        """Collective, at the run's end: what summary.json says of its ranks' step times."""
        if not self.enabled:
            return {}
        mine = (socket.gethostname(), percentiles(self.ready_s), percentiles(self.step_s), len(self.ready_s))
        ranks = [
            {"rank": rank, "host": host, "steps": steps, "ready_s": ready, "step_s": whole}
            for rank, (host, ready, whole, steps) in enumerate(self.gather(mine))
        ]
        return {"slow_ranks": [asdict(named) for named in self.named], "rank_step_times": ranks}

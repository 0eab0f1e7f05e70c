"""Naming a slow rank: which ranks are slow at a check, when a streak of checks names one, the
percentiles summary.json gives, and the watch as one rank runs it between real collectives' answers."""

from __future__ import annotations

import math

import pytest

from hvdtrain.config import TrainConfig, apply, parse_overrides
from hvdtrain.runtime.stragglers import Named, Stragglers, judge, percentiles, slow_at_check

MS = 0.001


@pytest.mark.parametrize(
    ("ready_ms", "factor", "slow"),
    [
        ([10, 10], 1.5, []),
        ([10, 16], 1.5, [(1, 10 * MS)]),  # two ranks: the other's time is the median
        ([10, 15], 1.5, []),  # not above factor x median
        ([10, 10, 10, 40], 1.5, [(3, 10 * MS)]),
        ([10, 11, 12, 40], 1.5, [(3, 11 * MS)]),  # the median of the other three
        ([40, 10, 10, 10], 1.5, [(0, 10 * MS)]),  # rank 0 is named like any other
        ([10, 40, 40, 10], 1.5, [(1, 10 * MS), (2, 10 * MS)]),  # each slow one's others: 10, 10, 40
        ([10, 40, 40, 40], 1.5, []),  # most are this slow: it is the job's pace, no one rank's
        ([10, 40, 40, 10, 10], 1.5, [(1, 10 * MS), (2, 10 * MS)]),
        ([0.1, 0.5], 1.5, []),  # 5x, but by less than MIN_EXCESS_S a step: noise
        ([0.1, 1.2], 1.5, [(1, 0.1 * MS)]),
        ([0, 0], 1.5, []),
        ([10, 25], 3.0, []),
        ([10, 31], 3.0, [(1, 10 * MS)]),
        ([10], 1.5, []),  # one rank: no others to be slower than
    ],
)
def test_slow_at_one_check(ready_ms, factor, slow):
    found = slow_at_check([value * MS for value in ready_ms], factor)
    assert [(rank, pytest.approx(median)) for rank, median in found] == slow


@pytest.mark.parametrize(
    ("checks_ms", "checks", "named_at"),
    [
        ([[10, 30]] * 3, 3, {2: [1]}),  # the third check in a row names it
        ([[10, 30]] * 2, 3, {}),
        ([[10, 30], [10, 30], [10, 10], [10, 30], [10, 30]], 3, {}),  # a check between breaks the streak
        ([[10, 30], [10, 30], [10, 10], [10, 30], [10, 30], [10, 30]], 3, {5: [1]}),
        ([[10, 30]] * 6, 3, {2: [1]}),  # named once a run, however long it stays slow
        ([[10, 30]], 1, {0: [1]}),
        ([[10, 10, 30, 30, 10], [10, 10, 30, 10, 10]], 2, {1: [2]}),
        ([[30, 10, 10, 10], [10, 30, 10, 10], [30, 10, 10, 10]], 2, {}),  # slow by turns: nobody
    ],
)
def test_a_streak_of_slow_checks_names_a_rank_once(checks_ms, checks, named_at):
    streaks, named_before, found = [0] * len(checks_ms[0]), set(), {}
    for index, ready_ms in enumerate(checks_ms):
        streaks, named = judge([v * MS for v in ready_ms], streaks, 1.5, checks, named_before)
        if named:
            found[index] = [rank for rank, _ in named]
            named_before |= set(found[index])
    assert found == named_at


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], None),
        ([5.0], {"p50": 5.0, "p90": 5.0, "p99": 5.0, "max": 5.0}),
        ([1.0, 2.0], {"p50": 1.5, "p90": 1.9, "p99": 1.99, "max": 2.0}),
        ([3.0, 1.0, 2.0], {"p50": 2.0, "p90": 2.8, "p99": 2.98, "max": 3.0}),  # unordered
        (list(range(1, 102)), {"p50": 51.0, "p90": 91.0, "p99": 100.0, "max": 101.0}),
    ],
)
def test_percentiles_as_numpy_gives_them(values, expected):
    found = percentiles([float(v) for v in values])
    if expected is None:
        assert found is None
        return
    assert found == {key: pytest.approx(value) for key, value in expected.items()}
    numpy = pytest.importorskip("numpy")
    assert [found["p50"], found["p90"], found["p99"]] == pytest.approx(numpy.percentile(values, [50, 90, 99]))


def test_the_line_names_rank_host_times_and_step():
    line = Named(2, "hvdhost3", 60, 0.1688, 0.007, 3).line()
    assert line == (
        "hvdtrain: slow rank 2 on hvdhost3: 168.8 ms a step before it is ready to average gradients, "
        "the other ranks' median 7.0 ms (24.1x), at 3 checks in a row up to step 60; every rank waits for it"
    )
    assert "(infx)" in Named(1, "h", 10, 0.01, 0.0, 3).line()


class World:
    """What the collectives of rank `rank` answer: the other ranks' mean times to ready at each check,
    given; the hosts by rank."""

    def __init__(self, others_ms: list[float], hosts: list[str]) -> None:
        self.others_ms, self.hosts, self.checks, self.gathers = others_ms, hosts, 0, 0

    def total(self, mine: list[float], name: str) -> list[float]:
        assert name == "hvdtrain.stragglers"
        self.checks += 1
        return [m if m else other * MS for m, other in zip(mine, self.others_ms, strict=True)]

    def gather(self, value):
        self.gathers += 1
        if isinstance(value, str):
            return self.hosts
        return [value if rank == 1 else (host, None, None, 0) for rank, host in enumerate(self.hosts)]


def test_one_rank_checks_every_few_steps_and_names_itself_once(capsys):
    world = World([10, 0, 10], ["a", "b", "c"])
    watch = Stragglers(1.5, 3, 5, 1, 3, world.total, world.gather)
    for step in range(1, 31):
        watch.after_step(step, 0.030, 0.032)
    assert world.checks == 5, "at steps 10, 15, ... 30: steps 1 to 5 are the warm-up"
    assert [(n.rank, n.host, n.step, n.checks) for n in watch.named] == [(1, "b", 20, 3)]
    assert watch.named[0].ready_s == pytest.approx(0.030) and watch.named[0].others_median_s == pytest.approx(
        0.01
    )
    assert world.gathers == 1, "the hosts are gathered once, when one is first named"
    assert capsys.readouterr().out == "", "only rank 0 prints"
    summary = watch.summary()
    assert summary["slow_ranks"] == [
        {
            "rank": 1,
            "host": "b",
            "step": 20,
            "ready_s": pytest.approx(0.03),
            "others_median_s": pytest.approx(0.01),
            "checks": 3,
        }
    ]
    mine = summary["rank_step_times"][1]
    assert mine["steps"] == 30 and mine["ready_s"]["p50"] == pytest.approx(0.03)
    assert mine["step_s"]["max"] == pytest.approx(0.032)


def test_rank_zero_prints_the_line_and_a_mean_over_the_checks_steps_decides(capsys):
    world = World([0, 10], ["a", "b"])
    watch = Stragglers(1.5, 2, 4, 0, 2, world.total, world.gather)
    times = [1.0] * 4 + [0.010, 0.010, 0.010, 0.050] * 2  # then one slow step in four: 20 ms on average
    for step, ready in enumerate(times, start=1):
        watch.after_step(step, ready, ready)
    out = capsys.readouterr().out
    assert out.startswith("hvdtrain: slow rank 0 on a: 20.0 ms a step") and "up to step 12" in out
    assert out.count("\n") == 1


def test_the_first_checks_steps_after_a_start_or_a_reset_are_the_warm_up():
    world = World([0, 10], ["a", "b"])
    watch = Stragglers(1.5, 1, 1, 0, 2, world.total, world.gather)
    watch.after_step(1, 0.030, 0.03)
    assert world.checks == 0 and not watch.named
    watch.after_step(2, 0.030, 0.03)
    watch.after_step(3, 0.030, 0.03)
    assert [n.step for n in watch.named] == [2], "named once"
    watch.reset(0, 2)  # an elastic world anew: streaks, names and hosts are the old world's
    watch.after_step(4, 0.030, 0.03)
    watch.after_step(5, 0.030, 0.03)
    assert [n.step for n in watch.named] == [2, 5]
    assert world.checks == 3 and world.gathers == 2


def test_one_rank_or_every_steps_zero_checks_nothing():
    world = World([0], ["a"])
    for watch in (
        Stragglers(1.5, 1, 1, 0, 1, world.total, world.gather),
        Stragglers(1.5, 1, 0, 0, 2, world.total, world.gather),
    ):
        for step in range(1, 5):
            watch.after_step(step, 1.0, 1.0)
        assert world.checks == 0 and watch.summary() == {}


@pytest.mark.parametrize(
    ("pair", "message"),
    [
        ("slow_rank_factor=1", "slow_rank_factor must be greater than 1, got 1.0"),
        ("slow_rank_factor=0.5", "slow_rank_factor must be greater than 1, got 0.5"),
        ("slow_rank_factor=nan", "slow_rank_factor must be a finite number, got nan"),
        ("slow_rank_checks=0", "slow_rank_checks must be at least 1, got 0"),
        ("slow_rank_every_steps=-1", "slow_rank_every_steps must be at least 0, got -1"),
    ],
)
def test_bad_settings_are_refused_in_one_line(pair, message):
    with pytest.raises(ValueError) as error:
        apply(TrainConfig(), parse_overrides(TrainConfig, [pair]))
    assert str(error.value) == message


def test_the_defaults():
    config = TrainConfig()
    assert (config.slow_rank_factor, config.slow_rank_checks, config.slow_rank_every_steps) == (1.5, 3, 10)
    assert math.isfinite(config.slow_rank_factor)

"""Horovod's own elastic driver (with patch 0019), in this process: a host whose cooldown ends while
the workers reset for another is told to them again until they take it in. Only the driver's two
edges to the workers are stand-ins: the rendezvous it hands its assignments to, and rank 0's
notification client, which records what reaches it."""

from __future__ import annotations

import time

import pytest
from horovod.runner.elastic.discovery import FixedHosts
from horovod.runner.elastic.driver import ElasticDriver

POLL_S = 1.0
"""Horovod's discovery poll (DISCOVER_HOSTS_FREQUENCY_SECS)."""


class Rendezvous:
    def init(self, host_assignments_list) -> None:
        self.world = [slot.hostname for slot in host_assignments_list]

    def stop(self) -> None:
        pass


class RankZero:
    """What rank 0's notification service is sent: (timestamp, update) pairs."""

    def __init__(self) -> None:
        self.told: list[tuple[float, int]] = []

    def notify_hosts_updated(self, timestamp, update_res) -> None:
        self.told.append((timestamp, update_res))


class Driver(ElasticDriver):
    def __init__(self, rank_zero: RankZero, **keywords) -> None:
        self.rank_zero = rank_zero
        super().__init__(**keywords)

    def get_coordinator_info(self):
        return "rank 0"

    def get_worker_client(self, slot_info):
        return self.rank_zero


def wait_until(condition, what: str, timeout: float = 10 * POLL_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not seen in {timeout:.0f} s")
        time.sleep(0.05)


def end_cooldown(driver: ElasticDriver, host: str) -> None:
    driver._host_manager._hosts_state[host]._cooldown_period_end_ts = time.time() - 1


def test_a_host_back_while_the_workers_reset_for_another_is_told_again_until_it_is_taken_in():
    rank_zero, rendezvous = RankZero(), Rendezvous()
    driver = Driver(
        rank_zero, rendezvous=rendezvous, discovery=FixedHosts({"a": 1, "b": 1, "c": 1}),
        min_num_proc=1, max_num_proc=3, cooldown_range=(5, 30),
    )  # fmt: skip
    try:
        manager = driver._host_manager
        wait_until(lambda: manager.current_hosts.count_available_slots() == 3, "the first discovery")
        driver._update_host_assignments(manager.current_hosts)  # the job starts on a, b and c
        assert sorted(rendezvous.world) == ["a", "b", "c"]

        manager.blacklist("b")  # b and c fail at once: the job goes on at a
        manager.blacklist("c")
        wait_until(lambda: manager.current_hosts.count_available_slots() == 1, "b and c left out")
        driver._update_host_assignments(manager.current_hosts)
        assert rendezvous.world == ["a"]

        told = len(rank_zero.told)
        end_cooldown(driver, "b")
        wait_until(lambda: len(rank_zero.told) > told, "b's return told to rank 0")
        driver._update_host_assignments(manager.current_hosts)  # the workers reset and take b in
        assert sorted(rendezvous.world) == ["a", "b"]

        # c's cooldown ends seconds later; rank 0 drops what reaches it while it resets for b
        told = len(rank_zero.told)
        end_cooldown(driver, "c")
        wait_until(lambda: len(rank_zero.told) >= told + 3, "c's return told again at each poll")
        driver._update_host_assignments(manager.current_hosts)  # a reset that takes c in
        assert sorted(rendezvous.world) == ["a", "b", "c"]
        time.sleep(POLL_S)  # a poll that began before c was taken in may still report it
        told = len(rank_zero.told)
        time.sleep(2.5 * POLL_S)
        assert len(rank_zero.told) == told, "nothing more to tell once every host has a rank"
    finally:
        driver.stop()

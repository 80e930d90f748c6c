"""The shadow rounds' pacing, on a fake clock: the pause's limits and floor (`RoundPacer`), what a
round costs the training threads (`RoundCost`), the floor and the gap warning enforced in steps
(`RoundSchedule`). The floor under real CPU contention: tests/test_runtime.py."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from shadowgba import SyncConfig
from shadowgba.metrics import SyncMetrics
from shadowgba.shadow.cycle_budget import CycleBudget
from shadowgba.shadow.pacing import RoundPacer
from shadowgba.shadow.round_cost import RoundCost
from shadowgba.shadow.schedule import RoundSchedule


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_pacer_waits_for_the_later_of_interval_ms_and_the_fastest_ranks_steps() -> None:
    clock = FakeClock()
    pacer = RoundPacer(interval_ms=40.0, interval_steps=10, clock=clock)
    assert pacer.round_started(step=7) == 7  # this rank's steps since its previous round
    pacer.round_ended(fastest_steps=7)  # one round: no step time yet
    clock.now += 0.02
    assert pacer.pause_s() == pytest.approx(0.02)  # interval_ms alone
    clock.now += 0.08
    assert pacer.round_started(step=12) == 5
    pacer.round_ended(fastest_steps=20)  # the fastest rank took 20 steps in 0.1 s: 5 ms per step
    assert pacer.fastest_step_s == pytest.approx(0.005)
    clock.now += 0.01
    assert pacer.pause_s() == pytest.approx(0.04) and pacer.limit == "interval_steps"  # 10 steps of 5 ms, 10 gone
    pacer.interval_s = 0.2  # a live change
    assert pacer.pause_s() == pytest.approx(0.19) and pacer.limit == "interval_ms"
    pacer.interval_steps = 0
    pacer.interval_s = 0.0
    assert pacer.pause_s() == 0.0


def test_the_pacer_keeps_the_rounds_within_their_share_of_the_wall_time() -> None:
    """The durations are what the rounds carry (each round: the least of the ranks' times for the
    round before it), not this rank's own time, which includes its wait for the others."""
    clock = FakeClock()
    pacer = RoundPacer(interval_ms=50.0, interval_steps=0, max_round_share=0.25, clock=clock)
    assert pacer.pause_s() == pytest.approx(0.05)  # no round yet: interval_ms alone

    def round_(own_s: float, previous_cost_s: float) -> None:
        pacer.round_started(step=0)
        clock.now += own_s
        pacer.round_ended(fastest_steps=0, previous_cost_s=previous_cost_s)

    round_(2.0, 0.0)  # this rank waited 2 s for a peer: that is no cost of the round
    assert pacer.own_last_s == 2.0 and pacer.pause_s() == 0.0  # interval_ms alone: 2 s of it gone
    for cost in (0.1, 0.1, 3.0):  # a slow link's rounds, one of them stalled
        round_(0.1, cost)
    # the median duration (0.1 s) may take a quarter of the time: 0.4 s start to start, 0.1 s of it gone
    assert pacer.pause_s() == pytest.approx(0.3) and pacer.limit == "max_round_share"
    pacer.max_round_share = 1.0  # a live change: no share limit, interval_ms alone
    assert pacer.pause_s() == 0.0
    for _ in range(RoundPacer.RECENT_ROUNDS):  # rounds of a fast link: interval_ms is what paces them
        round_(0.001, 0.001)
    pacer.max_round_share = 0.25
    assert pacer.pause_s() == pytest.approx(0.049)


def test_the_pacer_keeps_the_rounds_cost_within_its_share_of_the_steps_and_the_floor_caps_it() -> None:
    """Rounds 2 s apart in which the fastest rank took 10 steps: 0.2 s a step, a floor of 20 steps
    is 4 s. A round that costs the training threads 30 ms at a 2% share: 1.5 s start to start. The
    floor caps the share limits, which the pacing sets by itself, not the user's interval_ms and
    interval_steps."""
    clock = FakeClock()
    pacer = RoundPacer(interval_ms=200.0, interval_steps=0, max_round_share=0.1, max_step_cost=0.02,
                       max_gap_steps=20, clock=clock)
    for _ in range(2):
        pacer.round_started(step=0)
        clock.now += 0.05
        pacer.round_ended(fastest_steps=10, previous_cost_s=0.05)  # 50 ms without waiting: 0.5 s at 10%
        pacer.cost_measured(0.03)
        clock.now += 1.95
    assert pacer.fastest_step_s == pytest.approx(0.2)
    assert pacer.start_to_start_s() == pytest.approx(1.5) and pacer.limit == "max_step_cost"
    for cost in (0.2, 0.2, 0.2):  # dearer rounds: 10 s by their cost, but 20 steps are 4 s
        pacer.cost_measured(cost)
    assert pacer.start_to_start_s() == pytest.approx(4.0) and pacer.limit == "max_gap_steps"
    pacer.interval_steps = 30  # the user's limits stand: the floor caps the cost limits alone
    assert pacer.start_to_start_s() == pytest.approx(6.0) and pacer.limit == "interval_steps"
    pacer.interval_steps, pacer.interval_s = 0, 5.0
    assert pacer.start_to_start_s() == pytest.approx(5.0) and pacer.limit == "interval_ms"
    clock.now = 1000.0
    assert pacer.least_pause_s() == 0.0
    pacer.interval_s, pacer.max_gap_steps = 0.2, 0  # no floor: the dearest limit
    assert pacer.start_to_start_s() == pytest.approx(10.0) and pacer.limit == "max_step_cost"


def test_the_share_limits_wait_until_the_floor_can_be_put_in_time() -> None:
    """The job's first round holds the start-up (here 8 s of waiting for a slower group, which its
    cost and duration count): before a second round has measured the fastest rank's pace, the floor
    has no time to cap the share limits with, so they do not apply and the next round starts after
    interval_ms; without a floor configured, they do."""
    clock = FakeClock()
    pacer = RoundPacer(interval_ms=200.0, interval_steps=0, max_round_share=0.1, max_step_cost=0.02,
                       max_gap_steps=10, clock=clock)
    pacer.round_started(step=50)
    clock.now += 8.0
    pacer.round_ended(fastest_steps=50, previous_cost_s=0.0)
    pacer.cost_measured(2.0)
    assert pacer.fastest_step_s is None and pacer.floor_s() is None
    assert pacer.start_to_start_s() == pytest.approx(0.2) and pacer.limit == "interval_ms"
    pacer.max_gap_steps = 0
    assert pacer.start_to_start_s() == pytest.approx(100.0) and pacer.limit == "max_step_cost"
    pacer.max_gap_steps = 10
    pacer.round_started(step=60)  # the second round: the pace is measured, and the floor caps the cost limit
    clock.now += 0.05
    pacer.round_ended(fastest_steps=10, previous_cost_s=0.05)
    assert pacer.fastest_step_s == pytest.approx(0.8) and pacer.floor_s() == pytest.approx(8.0)
    assert pacer.start_to_start_s() == pytest.approx(8.0) and pacer.limit == "max_gap_steps"


def test_a_rounds_cost_is_the_steps_slowdown_while_it_is_in_flight() -> None:
    """Steps of 100 ms, 150 ms while a round is in flight; each round spans two steps: 100 ms of the
    training threads' time a round. Before enough steps of both kinds, the CPU it took from busy
    cores alone."""
    cost = RoundCost()
    now = 0.0
    cost.step_ended(now)
    assert cost.round_ran(-1.0, -0.5, cpu_s=0.02, idle_s=0.005) == pytest.approx(0.015)  # no steps seen yet
    for _ in range(6):
        for _ in range(4):  # off
            now += 0.1
            cost.step_ended(now)
        start = now + 0.01
        for _ in range(2):  # on
            now += 0.15
            cost.step_ended(now)
        assert cost.round_ran(start, now - 0.01, cpu_s=0.01, idle_s=0.1) is not None
    assert cost.slowdown_s() == pytest.approx(0.1)
    assert cost.round_ran(now + 0.01, now + 0.02, cpu_s=0.5, idle_s=0.1) == pytest.approx(0.4)  # busy cores: its CPU
    now += 9.0  # a step stalled (an evaluation) while the last round ran: it counts as 3 medians, 0.3 s
    cost.step_ended(now)
    assert cost.slowdown_s() == pytest.approx((12 * 0.15 + 0.3 - 13 * 0.1) / 7)


def test_no_slowdown_means_a_free_round() -> None:
    cost = RoundCost()
    now = 0.0
    for index in range(40):
        now += 0.1
        cost.step_ended(now)
        if index % 4 == 3:
            assert cost.round_ran(now - 0.05, now + 0.05) >= 0.0
    assert cost.slowdown_s() == 0.0


def schedule_for(**fields: object) -> RoundSchedule:
    return RoundSchedule(SyncConfig(**{"first_round_after": 0, **fields}), SyncMetrics(), "rank 0")


def test_the_training_thread_wakes_a_paused_round_at_the_floor_in_its_own_steps() -> None:
    schedule = schedule_for(interval_ms=0.0, max_gap_steps=20, warn_gap_steps=0)
    stop = threading.Event()
    schedule.round_begins()
    schedule.snapshot_taken(step=10)
    schedule.round_finished()
    for _ in range(RoundPacer.RECENT_ROUNDS):  # rounds that cost a minute each: an hour's pause at 2%
        schedule.pacer.cost_measured(60.0)
    schedule.pacer.fastest_step_s = 60.0  # the pace measured: the floor in time, 20 minutes, caps nothing sooner
    for step in range(11, 29):
        schedule.step_ended(step)
    waiter = threading.Thread(target=schedule.wait, args=(stop,))
    waiter.start()
    waiter.join(timeout=0.3)
    assert waiter.is_alive()  # 18 steps in: nothing due yet
    started = time.monotonic()
    schedule.priority = seen = PriorityCalls()
    schedule.step_ended(29)  # the next snapshot, at step 30, is the floor's
    waiter.join(timeout=10)
    assert not waiter.is_alive() and time.monotonic() - started < 5
    assert seen.calls == ["restore"]  # the round the floor started runs at the training threads' priority
    schedule.snapshot_taken(step=30)
    schedule.round_finished()
    schedule.round_begins()  # a round the pacer starts: at the low priority again
    assert seen.calls == ["restore", "lower"]


class PriorityCalls:
    """Stands for `RoundPriority`: what the schedule asked of it, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def lower(self) -> None:
        self.calls.append("lower")

    def restore(self) -> None:
        self.calls.append("restore")


def test_a_gap_past_warn_gap_steps_is_warned_about_once_until_a_round_arrives(caplog: pytest.LogCaptureFixture) -> None:
    schedule = schedule_for(warn_gap_steps=5, max_gap_steps=0)
    caplog.set_level(logging.WARNING, logger="shadowgba")
    for step in range(1, 9):
        schedule.step_ended(step)
        schedule.metrics.record_step(0.0, step)
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and "for 6 steps" in warnings[0] and "interval_ms limit" in warnings[0], warnings
    assert schedule.metrics.summary()["sync_gap_steps"] == 8
    schedule.metrics.record_applied(8)
    schedule.applied(8)
    for step in range(9, 14):
        schedule.step_ended(step)
    assert len(caplog.records) == 1  # 5 steps since the round at step 8: not over 5 yet
    schedule.step_ended(14)
    assert len(caplog.records) == 2 and "for 6 steps" in caplog.records[1].getMessage()
    schedule.metrics.record_applied(15)
    summary = schedule.metrics.summary()  # the first round came 8 steps in, the second 7 after it
    assert (summary["sync_gap_steps_max"], summary["sync_gap_steps_max_between_rounds"]) == (8, 7), summary


def test_live_settings_change_the_cost_limit_the_floor_and_the_gap_warning(caplog: pytest.LogCaptureFixture) -> None:
    """What a control file carries (`LiveSettings`), as `RoundSchedule.apply_live` takes it: the floor
    from the next snapshot on, the warning from the last round applied; a value out of range is
    refused as at start-up."""
    from shadowgba.config import ConfigError
    from shadowgba.shadow.control import LiveSettings

    schedule = schedule_for(warn_gap_steps=0, max_gap_steps=10)
    caplog.set_level(logging.WARNING, logger="shadowgba")
    schedule.apply_live(LiveSettings(max_step_cost=0.5, max_gap_steps=4, warn_gap_steps=3))
    assert (schedule.pacer.max_step_cost, schedule.pacer.max_gap_steps) == (0.5, 4)
    schedule.round_begins()
    schedule.snapshot_taken(step=0)
    for step in range(1, 4):
        schedule.step_ended(step)
    assert schedule._due.is_set() and not caplog.records  # the floor's step (4) is next: woken one before
    schedule.step_ended(4)
    assert len(caplog.records) == 1 and "for 4 steps" in caplog.records[0].getMessage()
    schedule.apply_live(LiveSettings(warn_gap_steps=0))
    schedule.step_ended(20)
    assert len(caplog.records) == 1
    for bad in ({"max_step_cost": 0.0}, {"max_gap_steps": -1}, {"warn_gap_steps": -2}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            LiveSettings(**bad)


def test_a_table_cycle_ends_within_its_bound_in_steps_within_the_links_byte_budget() -> None:
    """Fragments of 1 MiB, a bound of 100 steps, dense rounds every 10 steps of the fastest rank: a
    cycle of 50 fragments is spread over the 10 dense rounds before its deadline (5 a round); one of
    1,000 fragments is held to the budget (4 MiB a step: 40 a round) and takes 250 steps, its bytes
    over the budget; `cycle_steps` 0 takes one a round."""

    def cycle(budget: CycleBudget, fragments: int, every: int = 10) -> tuple[list[int], int]:
        counts, left = [], fragments
        while left > 0:
            counts.append(budget.fragments_now(every, left, started=left == fragments))
            budget.averaged(counts[-1], left, counts[-1])
            left -= counts[-1]
        return counts, budget.last_cycle_steps

    fragment_numel = 2**20 // 4
    counts, steps = cycle(CycleBudget(100, 4.0, fragment_numel), 50)
    assert counts == [5] * 10 and steps == 90, (counts, steps)
    counts, steps = cycle(CycleBudget(100, 4.0, fragment_numel), 1000)
    assert max(counts) == 40 and steps == pytest.approx(1000 / 4, abs=10), (counts, steps)
    counts, steps = cycle(CycleBudget(0, 4.0, fragment_numel), 7)
    assert counts == [1] * 7 and steps == 60
    budget = CycleBudget(100, 4.0, fragment_numel)
    for fragments in (50, 30, 80):  # cycle after cycle, at a pace that changes: every one within its bound
        for every in (3, 17):
            assert cycle(budget, fragments, every)[1] <= 100 + every, (fragments, every)
    assert budget.longest_cycle_steps <= 117


def replay_table_group(budget: CycleBudget, spacing: int, left: int, started: bool, cost: int) -> int:
    """The table rounds after one dense round, `spacing` steps after the last, replayed on `budget`
    with fragments that take `cost` steps of the fastest partner each (`TableRounds.run`): how many
    fragments of the cycle's `left` they averaged. Each fragment's trailer carries the steps taken
    before it since they began."""
    planned = budget.fragments_now(spacing, left, started=started)
    done = 0
    while done < planned:
        done += 1
        if budget.stop((done - 1) * cost, done):
            break
    budget.averaged(done, left, planned)
    return done


def test_the_table_rounds_stop_for_the_dense_round_behind_them_so_it_keeps_its_floor() -> None:
    """Fragments that cost the cores 2 steps of the fastest rank each (4 ranks on 2 shared cores),
    against a budget that assumed 4 a step: without `group_steps`, a late dense round credits many
    steps' budget, its fragments make the next one later still, and the dense rounds starve (a gap
    past 100 steps); stopping the table rounds before a fragment forecast to end past 5 steps (half
    a floor of 10) keeps every dense round within 3 + 2 fragments' 4 steps of the last, and the
    cycles still end. Fragments of 4 steps (a 3x straggler's: each waits for the slow partner's step
    boundary): by the steps alone a group runs 3 (the third starts at 4 steps, under 5), 12 steps;
    by the forecast, one, and every `FORECAST_GROUPS`-th group measures their cost again with 2."""

    def run(group_steps: int, dense_rounds: int = 60, fragments: int = 168, cost: int = 2,
            forecast_groups: int = CycleBudget.FORECAST_GROUPS) -> tuple[list[int], int]:
        budget = CycleBudget(100, 4.0, 2**20 // 4, group_steps=group_steps)
        budget.FORECAST_GROUPS = forecast_groups  # 0: no forecast, the steps alone
        gaps, left, gap, cycles = [], fragments, 3, 0
        for _ in range(dense_rounds):
            done = replay_table_group(budget, gap, left, left == fragments, cost)
            left -= done
            if not left:
                left, cycles = fragments, cycles + 1
            gap = 3 + done * cost  # the dense round and its pause, then these fragments
            gaps.append(gap)
        return gaps, cycles

    starved, _ = run(group_steps=0)
    assert max(starved) > 100, starved
    gaps, cycles = run(group_steps=5, dense_rounds=100)
    assert max(gaps) == 3 + 2 * 2 and cycles >= 1, (gaps, cycles)
    by_steps, _ = run(group_steps=5, cost=4, forecast_groups=0)
    assert set(by_steps) == {3 + 3 * 4}, by_steps
    forecast, _ = run(group_steps=5, cost=4)
    assert forecast == [3 + 2 * 4 if group % CycleBudget.FORECAST_GROUPS == 0 else 3 + 4
                        for group in range(len(forecast))], forecast


def test_a_cycle_is_held_to_the_bound_its_link_was_measured_to_allow_and_an_overrun_is_counted() -> None:
    """The replay above with the stop (fragments of 2 steps each, groups stopped before a fragment
    forecast to end past 5 partner steps, so 2 fragments in each dense spacing of 3 + 4 steps): the
    config's bound (max(100, 168 / 4) + spacing) cannot hold, and the job's first cycle, stated from
    the config, is stated again once the groups that stopped span 100 steps (15 of them after the
    job's first, which is not measured): the steps so far plus its 136 fragments left at the
    measured 2 / 7 a step plus the spacing (112 + 476 + 7). Every cycle after it is stated at its
    start from the capacity (168 / (2 / 7) + 7 = 595) and ends within it (84 groups, 83 spacings of
    7 steps after the first). Then the cores slow to 3 steps a fragment, so a group
    takes 1 (spacing 6), and every eighth 2 (spacing 9), as it measures their cost again: the cycle
    that starts then, stated from the old capacity, overruns its bound and is counted; the capacity
    is measured over the latest cycle's length of groups (9 fragments in 51 steps), so the cycles
    after it are stated from the slower one and meet theirs: 168 * 51 / 9 + 9 at the mean, and a
    few percent more, the capacity taken two standard errors lower for the groups' spread (where
    every group was alike, above, the bound is the mean's)."""

    budget = CycleBudget(100, 4.0, 2**20 // 4, group_steps=5)
    fragments, left, gap = 168, 168, 3
    bounds: list[tuple[int, int, int]] = []  # (cycle steps, its bound, the cost a fragment had at its end)

    def dense_rounds(count: int, cost: int) -> None:
        nonlocal left, gap
        for _ in range(count):
            done = replay_table_group(budget, gap, left, left == fragments, cost)
            left -= done
            if not left:
                left = fragments
                bounds.append((budget.last_cycle_steps, budget.last_cycle_bound, cost))
            gap = 3 + done * cost

    dense_rounds(84 * 3, cost=2)
    assert budget.capacity == pytest.approx(2 / 7), budget.capacity
    assert len(bounds) == 3 and budget.over_bound == 0, bounds
    assert bounds[0][1] == 112 + 476 + 7 and all(steps <= bound for steps, bound, _ in bounds), bounds
    assert bounds[1][1] == bounds[2][1] == 588 + 7, bounds
    dense_rounds(150 * 4, cost=3)
    assert budget.capacity == pytest.approx(9 / 51, rel=0.01), budget.capacity
    over = [cycle for cycle in bounds[3:] if cycle[0] > cycle[1]]
    assert budget.over_bound == len(over) == 1 and bounds[3] == over[0], bounds
    assert budget.overrun_max == over[0][0] - over[0][1] > 0, (budget.overrun_max, over)
    slower = 168 * 51 / 9 + 9  # at the mean capacity: the bound is wider by the groups' spread
    assert all(steps <= bound and slower < bound <= 1.05 * slower for steps, bound, _ in bounds[4:]), bounds
    assert len(bounds) >= 6, bounds
    assert budget.timed_cycles == len(bounds)

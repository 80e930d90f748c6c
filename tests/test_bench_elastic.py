"""bench_elastic's figures, read from a constructed timeline (the jobs themselves are `make bench-elastic`'s)."""

from __future__ import annotations

import pytest

from bench_elastic import BATCH, KILLED, TRAINERS, WARMUP_S, figures


def timeline(kill: float | None, restart: float | None, end: float = 60.0) -> list[tuple[int, int, int, int, float]]:
    """Every trainer steps 10 times a second from t=0; trainer KILLED stops at `kill` and a second
    process of it starts stepping 2 s after `restart`. The global step is the step count / 4."""
    steps = []
    for trainer in range(TRAINERS):
        for tick in range(int(end * 10)):
            at = tick / 10
            if trainer == KILLED and kill is not None and kill <= at < restart + 2.0:
                continue
            incarnation = 2 if trainer == KILLED and restart is not None and at >= restart else 1
            steps.append((trainer, incarnation, tick, 0, at))
    steps.sort(key=lambda step: step[4])
    return [(trainer, incarnation, index, count // TRAINERS, at)
            for count, (trainer, incarnation, index, _, at) in enumerate(steps)]


def result(steps: list, restarted_at: float | None) -> dict:
    kills = [] if restarted_at is None else [{"trainer": KILLED, "restarted_at": restarted_at, "incarnation": 2}]
    return {"steps": steps, "kills": kills, "auc": 0.7, "log_loss": 0.5, "global_step": 100,
            "cpu_s": 12.0, "departures": [], "exit_codes": [0] * (TRAINERS + 1)}


def test_the_outage_is_read_against_the_whole_job_before_it_and_the_rejoin_from_the_restart() -> None:
    interrupted = figures(result(timeline(20.0, 40.0), 40.0), 20.0, 20.0, kill_at_step=0)
    assert interrupted["samples_per_s_before"] == pytest.approx(TRAINERS * 10 * BATCH)
    assert interrupted["survivors_samples_per_s_outage"] == pytest.approx((TRAINERS - 1) * 10 * BATCH)
    assert interrupted["outage_ratio"] == pytest.approx((TRAINERS - 1) / TRAINERS)
    assert interrupted["rejoin_s"] == pytest.approx(2.0)
    assert interrupted["cpu_s_per_1k_samples"] == pytest.approx(1000 * 12.0 / (len(timeline(20.0, 40.0)) * BATCH))
    # the uninterrupted run is read in the window where the other was killed: the same 3 trainers' rate
    whole = timeline(None, None)
    kill_step = next(step[3] for step in whole if step[4] >= 20.0)
    uninterrupted = figures(result(whole, None), None, 20.0, kill_at_step=kill_step)
    assert uninterrupted["outage_ratio"] == pytest.approx((TRAINERS - 1) / TRAINERS)
    assert uninterrupted["rejoin_s"] is None and WARMUP_S < 20.0

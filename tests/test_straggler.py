"""Straggler injection: how long each trainer sleeps, validation, and the sleep itself."""

from __future__ import annotations

import time

import pytest

from shadowgba.config import ConfigError, from_dict
from ctrkit.straggler import Straggler, StragglerConfig

pytestmark = pytest.mark.timeout(30)


def test_measured_mode_slows_only_the_chosen_trainers_by_the_factor_plus_the_delay() -> None:
    config = StragglerConfig(trainers=[1], factor=3.0, delay_ms=5.0)
    assert Straggler(config, 0, 2).sleep_s(0.010) == 0.0
    assert Straggler(config, 1, 2).sleep_s(0.010) == pytest.approx(2 * 0.010 + 0.005)


def test_simulated_mode_pads_compute_to_the_budget_and_the_slowed_one_to_factor_times_it() -> None:
    config = StragglerConfig(trainers=[0], factor=3.0, step_ms=20.0, delay_ms=4.0)
    fast, slow = Straggler(config, 1, 4), Straggler(config, 0, 4)
    assert fast.sleep_s(0.005) == pytest.approx(0.015)  # 5 ms of real work, padded to 20
    assert slow.sleep_s(0.005) == pytest.approx(0.055 + 0.004)  # to 60, plus the fixed delay
    assert fast.sleep_s(0.5) == 0.0  # work beyond the budget is not padded (the step overruns)
    assert slow.sleep_s(0.5) == pytest.approx(0.004)


def test_the_default_slows_nobody() -> None:
    straggler = Straggler(StragglerConfig(), 0, 1)
    straggler.step()
    assert straggler.sleep_s(1.0) == 0.0 and straggler.slept_s == 0.0


def test_step_sleeps_factor_minus_one_times_the_compute_since_begin_step() -> None:
    straggler = Straggler(StragglerConfig(trainers=[0], factor=2.0), 0, 1)
    time.sleep(0.2)  # between steps (e.g. evaluation): not measured
    straggler.begin_step()
    time.sleep(0.05)  # one step's own work
    started = time.perf_counter()
    straggler.step()
    slept = time.perf_counter() - started
    assert 0.045 <= slept < 0.2
    assert straggler.slept_s == pytest.approx(slept, abs=0.01)


def test_steps_whose_real_work_outlasts_the_simulated_budget_are_counted() -> None:
    """A fast trainer with a 20 ms budget: one step within it, two beyond (the slowed trainer's
    budget is 3x, 60 ms, so the same 30 ms of work is within it)."""
    config = StragglerConfig(trainers=[1], factor=3.0, step_ms=20.0)
    fast, slow = Straggler(config, 0, 2), Straggler(config, 1, 2)
    for work_s in (0.001, 0.030, 0.030):
        for straggler in (fast, slow):
            straggler.begin_step()
            time.sleep(work_s)
            straggler.step()
    assert (fast.steps, fast.overrun_steps, slow.overrun_steps) == (3, 2, 0)
    assert fast.overrun_fraction == pytest.approx(2 / 3) and slow.overrun_fraction == 0.0
    measured = Straggler(StragglerConfig(trainers=[0], factor=3.0), 0, 1)
    measured.step()
    assert measured.budget_s is None and measured.overrun_fraction == 0.0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"factor": 0.5}, "factor must be >= 1"),
        ({"delay_ms": -1}, "delay_ms must be >= 0"),
        ({"step_ms": -1}, "step_ms must be >= 0"),
        ({"trainers": [-1]}, "trainers must be trainer indices >= 0"),
        ({"trainers": [1, 1]}, "trainers must be distinct"),
        ({"trainers": "0"}, "trainers: expected a list"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_dict(StragglerConfig, options)


def test_a_slowed_trainer_outside_the_job_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"trainers: \[3\] out of range; the job has 3 trainers"):
        Straggler(StragglerConfig(trainers=[3], factor=2.0), 0, 3)

"""Straggler injection: how long each trainer sleeps, validation, and the sleep itself."""

from __future__ import annotations

import time

import pytest

from shadowgba.config import ConfigError, from_dict
from shadowgba.straggler import Straggler, StragglerConfig

pytestmark = pytest.mark.timeout(30)


def test_measured_mode_slows_only_the_chosen_trainers_by_the_factor_plus_the_delay() -> None:
    config = StragglerConfig(trainers=[1], factor=3.0, delay_ms=5.0)
    assert Straggler(config, 0, 2).sleep_s(0.010) == 0.0
    assert Straggler(config, 1, 2).sleep_s(0.010) == pytest.approx(2 * 0.010 + 0.005)


def test_simulated_mode_makes_every_trainer_sleep_and_the_slowed_one_factor_times_longer() -> None:
    config = StragglerConfig(trainers=[0], factor=3.0, step_ms=20.0)
    assert Straggler(config, 1, 4).sleep_s(0.5) == pytest.approx(0.020)  # real step time is ignored
    assert Straggler(config, 0, 4).sleep_s(0.5) == pytest.approx(0.060)


def test_the_default_slows_nobody() -> None:
    straggler = Straggler(StragglerConfig(), 0, 1)
    straggler.step()
    assert straggler.sleep_s(1.0) == 0.0 and straggler.slept_s == 0.0


def test_step_sleeps_factor_minus_one_times_the_time_since_the_previous_step() -> None:
    straggler = Straggler(StragglerConfig(trainers=[0], factor=2.0), 0, 1)
    straggler.step()  # measures from construction: next to nothing
    time.sleep(0.05)  # one step's own work
    started = time.perf_counter()
    straggler.step()
    slept = time.perf_counter() - started
    assert 0.045 <= slept < 0.2
    assert straggler.slept_s == pytest.approx(slept, abs=0.01)


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

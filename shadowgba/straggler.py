"""Straggler injection: make chosen trainers slow, on purpose, for tests and benchmarks.

GBA's claim is about stragglers (Su et al. 2022: >= 2.4x sync all-reduce when some workers are
slow), so its tests and benchmarks need a slow trainer on demand. The training loop calls
`Straggler.step()` once per step, at the point where the step's compute is done (after backward,
before the gradient leaves the trainer), and the call sleeps:

- measured mode (`step_ms == 0`): a slowed trainer sleeps `(factor - 1) x` the time the loop spent
  since the previous call returned (everything it did in one step, the injected sleep excluded),
  so its steps take `factor` times as long as they would;
- simulated-compute mode (`step_ms > 0`): every trainer sleeps `step_ms`, a slowed one
  `factor x step_ms`, on top of its real (small) work. On a machine with fewer cores than trainers
  this shows the scheduling effect without the trainers fighting for CPU: a sleeping trainer uses
  none;
- either way a slowed trainer also sleeps `delay_ms`.

Sleeping before the gradient is handed over (rather than after) keeps staleness realistic: the
slow trainer's gradient arrives as late as it would if its compute were really slow.
"""

from __future__ import annotations

import dataclasses
import time

from shadowgba.config import ConfigError


@dataclasses.dataclass
class StragglerConfig:
    """Which trainers are slowed, and how."""

    trainers: list[int] = dataclasses.field(default_factory=list)
    """Indices (among the trainers, 0-based) of the slowed trainers; empty slows nobody."""
    factor: float = 1.0
    """Slowed trainers' steps take this many times as long: the measured step time, or `step_ms` in
    simulated-compute mode; >= 1."""
    delay_ms: float = 0.0
    """Fixed extra sleep per step of each slowed trainer, in milliseconds; >= 0."""
    step_ms: float = 0.0
    """Simulated compute (benchmarks): when > 0, every trainer sleeps this many milliseconds per
    step and a slowed one `factor` times as long; 0 measures the real step time instead."""

    def __post_init__(self) -> None:
        if any(isinstance(index, bool) or not isinstance(index, int) or index < 0 for index in self.trainers):
            raise ConfigError(f"trainers must be trainer indices >= 0, got {self.trainers}")
        if len(set(self.trainers)) != len(self.trainers):
            raise ConfigError(f"trainers must be distinct, got {self.trainers}")
        if self.factor < 1.0:
            raise ConfigError(f"factor must be >= 1, got {self.factor}")
        if self.delay_ms < 0.0:
            raise ConfigError(f"delay_ms must be >= 0, got {self.delay_ms}")
        if self.step_ms < 0.0:
            raise ConfigError(f"step_ms must be >= 0, got {self.step_ms}")

    def check(self, num_trainers: int) -> None:
        """Refuse slowed trainers that a job of `num_trainers` trainers does not have."""
        outside = [index for index in self.trainers if index >= num_trainers]
        if outside:
            raise ConfigError(f"trainers: {outside} out of range; the job has {num_trainers} trainers")


class Straggler:
    """One trainer's injected slowness; call `step()` once per training step."""

    def __init__(self, config: StragglerConfig, trainer_index: int, num_trainers: int) -> None:
        config.check(num_trainers)
        self.config = config
        self.slowed = trainer_index in config.trainers
        self.slept_s = 0.0
        """Total time this trainer slept in `step()`."""
        self._last_return = time.perf_counter()

    def sleep_s(self, measured_s: float) -> float:
        """How long to sleep after a step whose own work took `measured_s` seconds."""
        config = self.config
        if config.step_ms > 0.0:
            simulated_s = config.step_ms / 1e3
            return (config.factor * simulated_s + config.delay_ms / 1e3) if self.slowed else simulated_s
        if not self.slowed:
            return 0.0
        return (config.factor - 1.0) * measured_s + config.delay_ms / 1e3

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` the loop spent outside training (e.g. evaluating) out of the next measured step."""
        self._last_return += seconds

    def step(self) -> None:
        """Sleep for this step (see the module docstring); the next step is measured from the return."""
        seconds = self.sleep_s(time.perf_counter() - self._last_return)
        if seconds > 0.0:
            time.sleep(seconds)
            self.slept_s += seconds
        self._last_return = time.perf_counter()

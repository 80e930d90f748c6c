"""Straggler injection: make chosen trainers slow, on purpose, for tests and benchmarks.

GBA's claim is about stragglers (Su et al. 2022: >= 2.4x sync all-reduce when some workers are
slow), so its tests and benchmarks need a slow trainer on demand. The training loop calls
`Straggler.begin_step()` when a step starts and `Straggler.step()` where the step's compute is done
(after backward, before the gradient leaves the trainer); that call sleeps:

- measured mode (`step_ms == 0`): a slowed trainer sleeps `(factor - 1) x` the time since
  `begin_step()`, so its compute takes `factor` times as long as it would;
- simulated-compute mode (`step_ms > 0`): every trainer's compute lasts `step_ms`, a slowed one's
  `factor x step_ms`: the call sleeps what the real (small) work since `begin_step()` left of that
  budget (nothing, if the work overran it). The compute of a slowed trainer is thus exactly `factor`
  times a fast one's, as the benchmarks' ideal ratios assume; adding the sleep on top of the real
  work instead would leave the slowed trainer less than `factor` times slower. On a machine with
  fewer cores than trainers this shows the scheduling effect without the trainers fighting for CPU:
  a sleeping trainer uses none. Steps whose real work alone outlasts the budget are counted
  (`overrun_steps`): on those the simulation did not hold, and `benchmarks/bench_gba.py` warns;
- either way a slowed trainer also sleeps `delay_ms`.

What happens after `step()` (handing the gradient over, the optimizer step, a collective's wait for
its peers) is not compute and never padded: a trainer waiting for a slow peer does not also sleep.
Sleeping before the gradient is handed over (rather than after) keeps staleness realistic: the
slow trainer's gradient arrives as late as it would if its compute were really slow.
"""

from __future__ import annotations

import dataclasses
import time

from shadowgba.errors import ConfigError


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
    """Simulated compute (benchmarks): when > 0, every trainer's compute per step lasts this many
    milliseconds (the real work's time is padded up to it) and a slowed one's `factor` times as long;
    0 slows by the measured compute time instead."""

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
        self.steps = 0
        """Calls of `step()`."""
        self.overrun_steps = 0
        """Simulated-compute mode: steps whose real work alone outlasted this trainer's budget, so
        it ran slower than simulated (on a slow or crowded machine: raise `step_ms`)."""
        self._step_start = time.perf_counter()

    @property
    def budget_s(self) -> float | None:
        """This trainer's simulated compute per step, or None in measured mode."""
        if self.config.step_ms <= 0.0:
            return None
        return self.config.step_ms / 1e3 * (self.config.factor if self.slowed else 1.0)

    @property
    def overrun_fraction(self) -> float:
        """Share of this trainer's steps that overran the simulated budget (0 in measured mode)."""
        return self.overrun_steps / self.steps if self.steps else 0.0

    def sleep_s(self, measured_s: float) -> float:
        """How long to sleep after a step whose own compute took `measured_s` seconds."""
        config = self.config
        delay_s = config.delay_ms / 1e3 if self.slowed else 0.0
        budget_s = self.budget_s
        if budget_s is not None:
            return max(budget_s - measured_s, 0.0) + delay_s
        return (config.factor - 1.0) * measured_s + delay_s if self.slowed else 0.0

    def begin_step(self) -> None:
        """Mark the start of a step's compute (before fetching its batch)."""
        self._step_start = time.perf_counter()

    def step(self) -> None:
        """Sleep for this step's compute so far (see the module docstring)."""
        measured_s = time.perf_counter() - self._step_start
        seconds = self.sleep_s(measured_s)
        self.steps += 1
        budget_s = self.budget_s
        if budget_s is not None and measured_s > budget_s:
            self.overrun_steps += 1
        if seconds > 0.0:
            time.sleep(seconds)
            self.slept_s += seconds

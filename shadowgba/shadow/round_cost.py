"""What a shadow round costs the training threads, in seconds of their time (`RoundCost`).

Two measures, the larger one counts:

- **The steps' slowdown.** The training thread stamps the end of each step; the shadow thread notes
  each round's span, from its snapshot request to its last table fragment. A step that overlaps a
  round is *on*, the others *off*. Over the recent window, the time the rounds cost the steps is
  the on-steps' time beyond what as many off-steps take: `(sum(on) - n_on * mean(off)) / rounds`
  per round. It sees every way a round slows a step: the CPU it takes, the link it shares with
  the embedding all-to-all, the snapshot copy and the write-back at the step boundary, memory
  bandwidth. It sees nothing where nothing is slowed: on an idle link with free cores a round is
  free, and the rounds come as often as the other limits let them. A step time beyond three
  times the window's median (an evaluation, a checkpoint) counts as three times the median.
- **The CPU it took from busy cores.** A round's threads (the shadow thread, its group's gloo
  threads) ran `cpu` seconds while the cores this process may use stood idle `idle` seconds; what
  the idle time could not hold, `cpu - idle`, came out of other work, the steps' first. On a
  CPU-bound host this is about what the steps lose, known from the first round on, and steady
  where the step times are noisy.

The arithmetic takes timestamps and CPU readings as arguments, so a test drives it with a fake clock;
the readings come from `shadowgba.cpu_time` (`shadowgba.shadow.schedule`).
"""

from __future__ import annotations

import collections
import statistics


class RoundCost:
    """One trainer's rounds and step ends, and the cost they imply. `step_ended` is called by the
    training thread(s) (a deque append), the rest by the shadow thread."""

    WINDOW_STEPS = 256
    """Steps the slowdown is measured over."""
    WINDOW_ROUNDS = 16
    """Rounds the slowdown is measured over (the spans a step may overlap)."""
    MIN_STEPS = 3
    """On-steps and off-steps each needed before the slowdown counts."""
    OUTLIER = 3.0
    """A step time beyond this many times the window's median counts as this many."""

    def __init__(self) -> None:
        self._step_ends: collections.deque[float] = collections.deque(maxlen=self.WINDOW_STEPS)
        self._rounds: collections.deque[tuple[float, float]] = collections.deque(maxlen=self.WINDOW_ROUNDS)

    def step_ended(self, at: float) -> None:
        """A training step ended at time `at`."""
        self._step_ends.append(at)

    def round_ran(self, start: float, end: float, cpu_s: float = 0.0, idle_s: float = 0.0) -> float:
        """A round ran from `start` to `end`, its threads taking `cpu_s` of CPU while the cores had
        `idle_s` idle: record it and return what a round costs the training threads now."""
        self._rounds.append((start, end))
        return max(self.slowdown_s() or 0.0, cpu_s - idle_s, 0.0)

    def slowdown_s(self) -> float | None:
        """The training time a round costs, from the steps' times with and without one in flight
        (module docstring); None until the window holds enough of both."""
        ends, rounds = list(self._step_ends), list(self._rounds)
        if len(ends) < 2 or not rounds:
            return None
        # only rounds the window saw whole, and steps that no round before them can have overlapped
        counted = [span for span in rounds if span[0] >= ends[0]]
        since = max([ends[0]] + [end for start, end in rounds if start < ends[0]])
        steps = [(begin, end) for begin, end in zip(ends, ends[1:]) if begin >= since]
        if not counted or not steps:
            return None
        cap = self.OUTLIER * statistics.median(end - begin for begin, end in steps)
        on: list[float] = []
        off: list[float] = []
        for begin, end in steps:
            overlaps = any(start < end and stop > begin for start, stop in counted)
            (on if overlaps else off).append(min(end - begin, cap))
        if len(on) < self.MIN_STEPS or len(off) < self.MIN_STEPS:
            return None
        return max(0.0, sum(on) - len(on) * statistics.fmean(off)) / len(counted)

"""When a GBA trainer waits for fresh parameters (`GBAConfig.fresh_wait`), and for how long.

Without waiting, a trainer installs whatever parameters it has at the end of its step, so its next
gradient is computed on the global step before the one its last gradient entered: with equal-speed
trainers every gradient is one global step stale (docs/gba.md, "Quality: what one step of staleness
costs"). Waiting for that global step's apply makes the next gradient fresh, as sync all-reduce's
are, at the price of the wait.

The wait pays only when the peers complete the global batch soon. Under a straggler the batch often
waits for gradients nobody is about to push: the wait runs to its bound, or ends late, when the
next round of the fast trainers' gradients completes it. So the policy keeps two moving averages:
how often a wait ended with the fresh parameters in time, and the share of the compute time spent
waiting (0 for a step that did not wait). Once most waits time out, or the waits take more than a
budget (`GBAConfig.fresh_wait_budget`) of the compute time, it stops waiting; it probes again every
`PROBE_EVERY` steps, and the share spent decays with every step that does not wait, so waiting
resumes by itself: under a straggler the waits take about the budget, and where peers answer
within a sliver of the step they never reach it (on cores shared by more ranks than cores, equal
trainers' waits can reach it too: docs/gba.md, "Quality"). The bound of one wait is a share of the trainer's own compute time per step (a moving
average), so a wait never costs more than that share of a step, whatever the model's size or the
machine's speed.

Which waits to take. Under the budget, the waits worth taking are the short ones: every wait that
succeeds buys the same thing (one fresh gradient), so a wait of a tenth of a step is worth as much
as one of a whole step at a tenth of the price. Once the push is answered the trainer knows how
much of its global batch is still missing (`Admission.buffered_samples`), and so, at the pace the
global steps come (a moving average of the installed global step), how long the batch should take
to complete. It waits only when that prediction is at most `longest_s`: with pushes arriving
evenly over a global step of `g` seconds, taking every wait up to `L` costs `L^2 / (2 g)` per step,
which the budget (a share `b` of the compute time `c`) bounds at `L = sqrt(2 b c g)`. The prediction
is scaled by how long the batches actually took to complete after a push's answer against that
prediction (a moving average over every push, waited for or not): trainers that push together
(equal speeds) see their batches complete within moments of a prediction of most of a global step,
and would otherwise skip waits that cost nothing.
"""

from __future__ import annotations

import math

PROBE_EVERY = 10
"""While waits are futile, one step in this many still waits, to notice when they pay again."""
USEFUL_BELOW = 0.5
"""Waits stop when fewer than this share of recent ones brought fresh parameters in time."""
SMOOTHING = 0.2
"""Weight of the newest observation in the moving averages (about the last 5 to 10 steps)."""
LONGEST_CALIBRATION = 4.0
"""The most, as a multiple of the calibration, that one batch's time against its prediction counts:
a batch held up once (a pause, a restart) does not stop the waits for long."""


class FreshWaitPolicy:
    """One trainer's decision, each GBA step, whether to wait for fresh parameters and how long.
    Training thread only."""

    def __init__(self, share: float, budget: float) -> None:
        """`share` (`GBAConfig.fresh_wait`): the longest wait as a share of the trainer's compute time
        per step; 0 never waits. `budget` (`GBAConfig.fresh_wait_budget`): waits stop while they take
        more than this share of the compute time (a moving average)."""
        self.share = share
        self.budget = budget
        self.compute_s: float | None = None
        """The trainer's compute time per step (forward and backward: from one step's end to the
        next step's hook), a moving average."""
        self.useful = 1.0
        """Moving average of the waits' outcomes: 1 for fresh parameters in time, 0 for a timeout."""
        self.spent = 0.0
        """Moving average, over the steps, of the time waited as a share of the compute time."""
        self.calibration = 1.0
        """Moving average of the batches' time to complete over its prediction (`calibrate`)."""
        self._steps = 0
        self._pace: tuple[float, float] | None = None
        """Moving averages of the seconds and the global steps between installs that advanced the
        global step: their ratio is the seconds per global step."""
        self._last_step: tuple[int, float] | None = None
        """The newest installed global step and when it was first seen installed."""

    def bound_s(self, compute_s: float) -> float | None:
        """After a step that computed for `compute_s` seconds: how long to wait now, or None (not
        this step: waiting is off, or futile and this is no probe step)."""
        self.compute_s = compute_s if self.compute_s is None else (1 - SMOOTHING) * self.compute_s + SMOOTHING * compute_s
        self._steps += 1
        futile = self.useful < USEFUL_BELOW or self.spent > self.budget
        if self.share <= 0 or (futile and self._steps % PROBE_EVERY):
            self.spent *= 1 - SMOOTHING  # a step that does not wait
            return None
        return self.share * self.compute_s

    def observe_global_step(self, step: int, now: float) -> None:
        """The trainer's installed parameters are of global step `step` at time `now` (seconds)."""
        if self._last_step is not None and step > self._last_step[0]:
            seconds, steps = now - self._last_step[1], step - self._last_step[0]
            self._pace = (seconds, steps) if self._pace is None else (
                (1 - SMOOTHING) * self._pace[0] + SMOOTHING * seconds, (1 - SMOOTHING) * self._pace[1] + SMOOTHING * steps)
        if self._last_step is None or step != self._last_step[0]:
            self._last_step = (step, now)

    @property
    def seconds_per_step(self) -> float | None:
        """The pace of the global steps as this trainer sees them; None before two were seen."""
        return None if self._pace is None else self._pace[0] / self._pace[1]

    def predicted_s(self, missing: float) -> float | None:
        """How long the global batch should take to complete with `missing` of it (a share) still to
        come, calibrated by the batches timed so far; None while the pace is unknown."""
        pace = self.seconds_per_step
        return None if pace is None else self.calibration * missing * pace

    @property
    def longest_s(self) -> float | None:
        """The longest predicted wait worth taking (module docstring); None while the pace is unknown."""
        pace = self.seconds_per_step
        if pace is None or self.compute_s is None:
            return None
        return min(self.share, math.sqrt(2 * self.budget * pace / self.compute_s)) * self.compute_s

    def worth_waiting(self, missing: float) -> bool:
        """Whether to wait, now that the push is answered with `missing` of its global batch still to come."""
        predicted, longest = self.predicted_s(missing), self.longest_s
        return predicted is None or longest is None or predicted <= longest

    def calibrate(self, missing: float, seconds: float) -> None:
        """A push's global batch, `missing` of it (a share > 0) still to come at the push's answer,
        completed `seconds` later."""
        predicted = self.predicted_s(missing)
        if predicted:
            ratio = min(LONGEST_CALIBRATION * self.calibration, seconds * self.calibration / predicted)
            self.calibration = (1 - SMOOTHING) * self.calibration + SMOOTHING * ratio

    def record(self, fresh: bool | None, waited_s: float) -> None:
        """A wait of `waited_s` seconds ended: `fresh`, the parameters came within the bound; False,
        it timed out; None, it ended once the push was answered, the rest not worth waiting for."""
        if fresh is not None:
            self.useful = (1 - SMOOTHING) * self.useful + SMOOTHING * float(fresh)
        share = waited_s / self.compute_s if self.compute_s else 0.0
        self.spent = (1 - SMOOTHING) * self.spent + SMOOTHING * share

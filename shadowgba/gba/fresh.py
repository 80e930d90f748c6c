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
"""

from __future__ import annotations

PROBE_EVERY = 10
"""While waits are futile, one step in this many still waits, to notice when they pay again."""
USEFUL_BELOW = 0.5
"""Waits stop when fewer than this share of recent ones brought fresh parameters in time."""
SMOOTHING = 0.2
"""Weight of the newest observation in the moving averages (about the last 5 to 10 steps)."""


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
        self._steps = 0

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

    def record(self, fresh: bool, waited_s: float) -> None:
        """A wait of `waited_s` seconds ended: `fresh`, the parameters came within the bound; else it
        timed out."""
        self.useful = (1 - SMOOTHING) * self.useful + SMOOTHING * float(fresh)
        share = waited_s / self.compute_s if self.compute_s else 0.0
        self.spent = (1 - SMOOTHING) * self.spent + SMOOTHING * share

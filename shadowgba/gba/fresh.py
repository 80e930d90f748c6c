"""When a GBA trainer waits for fresh parameters (`GBAConfig.fresh_wait`), and for how long.

Without waiting, a trainer installs whatever parameters it has at the end of its step, so its next
gradient is computed on the global step before the one its last gradient entered: with equal-speed
trainers every gradient is one global step stale (docs/gba.md, "Quality: what one step of staleness
costs"). Waiting for that global step's apply makes the next gradient fresh, as sync all-reduce's
are, at the price of the wait.

The wait pays only when the peers complete the global batch soon. Under a straggler the batch often
waits for gradients nobody is about to push, and the wait runs to its bound, step after step: pure
loss of throughput. So the policy keeps a moving average of how often a wait ended with the fresh
parameters in time; once most waits time out it stops waiting, and it probes again every
`PROBE_EVERY` steps, so that it resumes when the straggler is gone. The bound of a wait is a share of
the trainer's own compute time per step (a moving average), so a wait never costs more than that
share of a step, whatever the model's size or the machine's speed.
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

    def __init__(self, share: float) -> None:
        """`share` (`GBAConfig.fresh_wait`): the longest wait as a share of the trainer's compute time
        per step; 0 never waits."""
        self.share = share
        self.compute_s: float | None = None
        """The trainer's compute time per step (forward and backward: from one step's end to the
        next step's hook), a moving average."""
        self.useful = 1.0
        """Moving average of the waits' outcomes: 1 for fresh parameters in time, 0 for a timeout."""
        self._steps = 0

    def bound_s(self, compute_s: float) -> float | None:
        """After a step that computed for `compute_s` seconds: how long to wait now, or None (not
        this step: waiting is off, or futile and this is no probe step)."""
        self.compute_s = compute_s if self.compute_s is None else (1 - SMOOTHING) * self.compute_s + SMOOTHING * compute_s
        self._steps += 1
        if self.share <= 0 or (self.useful < USEFUL_BELOW and self._steps % PROBE_EVERY):
            return None
        return self.share * self.compute_s

    def record(self, fresh: bool) -> None:
        """A wait ended: `fresh`, the parameters came within the bound; else it timed out."""
        self.useful = (1 - SMOOTHING) * self.useful + SMOOTHING * float(fresh)

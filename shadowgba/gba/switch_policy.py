"""Automatic switching between sync all-reduce and GBA from measured step times (with hysteresis).

A straggler makes synchronous training run at its pace; GBA lets the others go on. The signal is
the ratio of the slowest to the median trainer *compute* time (time in the training loop, not
waiting on sync). Above `to_gba_ratio` for `window` consecutive global steps: go to GBA. Below
`to_sync_ratio` for `window` steps while in GBA: go back to sync. The gap between the two ratios
and the window keep it from flapping. Decisions are pure functions of the observations, so every
trainer that observes the same numbers (sync mode: they arrive in the all-reduce) decides the same
thing at the same step, with no extra agreement round.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from typing import Sequence

from shadowgba.errors import ConfigError
from shadowgba.serialized import check_count, check_entries

logger = logging.getLogger("shadowgba")


@dataclasses.dataclass
class SwitchPolicyConfig:
    """When to switch automatically between sync all-reduce and GBA, from measured step times."""

    enabled: bool = False
    """Switch automatically; the API call `switch_mode` works either way."""
    to_gba_ratio: float = 1.5
    """Switch to GBA when slowest / median trainer compute time stays above this ... (with two
    trainers the median is the mean, so the ratio never reaches 2: keep it below)."""
    to_sync_ratio: float = 1.2
    """... and back to sync when it stays below this (hysteresis: must be < to_gba_ratio)."""
    window: int = 50
    """... for this many consecutive global steps."""

    def __post_init__(self) -> None:
        if not 1.0 <= self.to_sync_ratio < self.to_gba_ratio:
            raise ConfigError(
                f"need 1 <= to_sync_ratio < to_gba_ratio, got {self.to_sync_ratio} and {self.to_gba_ratio}"
            )
        if self.window < 1:
            raise ConfigError(f"window must be >= 1, got {self.window}")


class SwitchPolicy:
    """Feeds on per-global-step compute times; returns the mode to switch to when it fires."""

    def __init__(self, config: SwitchPolicyConfig) -> None:
        self.config = config
        self._streak = 0

    def state_dict(self) -> dict[str, int]:
        """What the policy has seen so far: the current streak of out-of-band observations."""
        return {"streak": self._streak}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore `state_dict()` output; `ValueError` on anything else, with nothing changed."""
        self._streak = check_count(check_entries(state, "switch policy state", ("streak",))["streak"],
                                   "switch policy state's streak")

    def observe(self, mode: str, compute_times: Sequence[float]) -> str | None:
        """One global step's compute times (one per trainer) in `mode`; a new mode or None."""
        if not self.config.enabled or len(compute_times) < 2:
            return None
        median = statistics.median(compute_times)
        ratio = max(compute_times) / median if median > 0 else 1.0
        unhealthy = mode == "sync" and ratio > self.config.to_gba_ratio
        healthy = mode == "gba" and ratio < self.config.to_sync_ratio
        self._streak = self._streak + 1 if unhealthy or healthy else 0
        if self._streak < self.config.window:
            return None
        self._streak = 0
        target = "gba" if unhealthy else "sync"
        logger.warning(
            "shadowgba: switch policy fired: slowest/median compute time %.2f for %d steps -> %s",
            ratio, self.config.window, target,
        )
        return target

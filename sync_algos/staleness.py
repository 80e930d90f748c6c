"""Staleness decay for GBA: how much a gradient computed on old parameters still counts.

A pushed gradient carries the token (global step) its parameters came from; its staleness is
`k_now - token`. Up to `threshold` it counts fully; beyond, the configured `kind` decides:

    drop:           w = 0
    exponential:    w = rate ** (staleness - threshold)
    inverse_power:  w = (1 + staleness - threshold) ** -power
    none:           w = 1 (plain asynchronous aggregation, for comparison)

and anything staler than `max_staleness` is dropped whatever the kind. The GBA paper's exact
function could not be verified from public text, so the function is pluggable. The default halves
a gradient's weight for every global step of staleness (exponential, threshold 0, rate 0.5): with
the trainers' fresh waits most gradients are fresh, and halving the stale ones (a fast trainer's
that missed its wait, the straggler's) is what brought GBA within 0.002 of sync at the production
preset under a straggler, where dropping beyond 2 steps left it 0.002-0.006 below (docs/gba.md,
"Quality").
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Literal, Mapping


@dataclasses.dataclass
class StalenessDecayConfig:
    """The decay applied to stale gradients on the parameter server."""

    kind: Literal["drop", "exponential", "inverse_power", "none"] = "exponential"
    """What happens beyond `threshold`: drop, exponential, inverse_power, or none (no decay)."""
    threshold: int = 0
    """Staleness (in global steps) up to which a gradient counts fully; >= 0."""
    rate: float = 0.5
    """exponential: weight multiplier per step of staleness beyond the threshold, in (0, 1]."""
    power: float = 1.0
    """inverse_power: exponent, > 0."""
    max_staleness: int = 32
    """Gradients staler than this are dropped whatever the kind; >= threshold."""

    def __post_init__(self) -> None:
        if self.threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {self.threshold}")
        if not 0.0 < self.rate <= 1.0:
            raise ValueError(f"rate must be in (0, 1], got {self.rate}")
        if self.power <= 0.0:
            raise ValueError(f"power must be > 0, got {self.power}")
        if self.max_staleness < self.threshold:
            raise ValueError(f"max_staleness ({self.max_staleness}) must be >= threshold ({self.threshold})")

    def weight(self, staleness: int) -> float:
        """The factor a gradient of this staleness is multiplied by; 0 means dropped."""
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        if staleness > self.max_staleness:
            return 0.0
        excess = staleness - self.threshold
        if excess <= 0 or self.kind == "none":
            return 1.0
        if self.kind == "drop":
            return 0.0
        if self.kind == "exponential":
            return self.rate**excess
        return (1.0 + excess) ** -self.power


class StalenessCounts:
    """What was seen of the staleness of pushes: a histogram and the decayed / dropped counts.

    The one place that classifies a decay weight (0: dropped, strictly between 0 and 1: decayed),
    for the servers (which know each push's staleness: `add`) and the trainers (which only learn
    the weight their push got back: `count_weight`). Not thread-safe: the owner holds its own lock.
    """

    BUCKETS = 16
    """The histogram keeps exact counts for 0..15 and one bucket, "16+", for 16 or more."""

    def __init__(self) -> None:
        self._histogram: collections.Counter[int] = collections.Counter()
        self.decayed = 0
        """Pushes with 0 < weight < 1."""
        self.dropped = 0
        """Pushes with weight 0."""

    def add(self, staleness: int, weight: float) -> None:
        """Count one push of this staleness that the decay weighted by `weight`."""
        self._histogram[min(staleness, self.BUCKETS)] += 1
        self.count_weight(weight)

    def count_weight(self, weight: float) -> None:
        """Count one push the decay weighted by `weight`, its staleness unknown here (not in the histogram)."""
        self.dropped += weight == 0.0
        self.decayed += 0.0 < weight < 1.0

    def state_dict(self) -> dict[str, object]:
        """The counts as plain data (a checkpoint's part; `load_state_dict` takes it back)."""
        return {"histogram": dict(self._histogram), "decayed": self.decayed, "dropped": self.dropped}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the counts with a `state_dict()`'s."""
        self._histogram = collections.Counter(state["histogram"])
        self.decayed, self.dropped = state["decayed"], state["dropped"]

    def summary(self) -> dict[str, object]:
        """decayed, dropped and staleness_histogram (string keys "0".."15", "16+")."""
        return {
            "decayed": self.decayed,
            "dropped": self.dropped,
            "staleness_histogram": {
                (f"{k}+" if k == self.BUCKETS else str(k)): v for k, v in sorted(self._histogram.items())
            },
        }

"""GBA, global-batch gradient aggregation (Su et al., NeurIPS 2022): configuration and server rule.

GBA aggregates *gradients*, not models, so it does not fit the snapshot -> target interface of
`SyncAlgorithm`; its trainer runtime is `shadowgba.gba.GBASync` and its servers the dense shards
of `shadowgba.ps`. What is GBA-specific lives here, free of any transport:

- a token is the global step k that a trainer's parameters came from; a pushed gradient's
  staleness is `k_now - token`; a token from the future is refused;
- each push adds `w(staleness) * num_samples * g` to a buffer (g: the trainer's mean gradient over
  its local batch). Once the buffer holds one *global batch* of samples (the sync-mode global
  batch: trainers x local batch) the server applies `buffer / samples` with the one optimizer,
  whose learning rate follows a schedule indexed by k, and advances k;
- dropped gradients (w = 0) do not fill the global batch; decayed ones count fully, so their
  smaller weight lowers the mean.

With zero staleness and equal-speed trainers each global step is the sample-weighted mean of one
gradient per trainer: exactly synchronous all-reduce training with the same optimizer.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import torch

from sync_algos.registry import register
from sync_algos.staleness import StalenessDecayConfig


@dataclasses.dataclass
class LRSchedule:
    """Learning rate as a function of the global step k: linear warm-up, then step decay."""

    warmup_steps: int = 0
    """Global steps of linear warm-up from lr/warmup_steps to lr; 0 disables."""
    decay_every: int = 0
    """Multiply the learning rate by decay_gamma every this many global steps; 0 disables."""
    decay_gamma: float = 1.0
    """Step-decay factor, in (0, 1]."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.decay_every < 0:
            raise ValueError("warmup_steps and decay_every must be >= 0")
        if not 0.0 < self.decay_gamma <= 1.0:
            raise ValueError(f"decay_gamma must be in (0, 1], got {self.decay_gamma}")

    def factor(self, global_step: int) -> float:
        """Multiplier of the base learning rate at global step k."""
        warmup = min(1.0, (global_step + 1) / self.warmup_steps) if self.warmup_steps else 1.0
        decay = self.decay_gamma ** (global_step // self.decay_every) if self.decay_every else 1.0
        return warmup * decay


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
            raise ValueError(
                f"need 1 <= to_sync_ratio < to_gba_ratio, got {self.to_sync_ratio} and {self.to_gba_ratio}"
            )
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")


@dataclasses.dataclass
class GBAConfig:
    """Knobs of GBA and of its synchronous twin."""

    initial_mode: Literal["gba", "sync"] = "gba"
    """Mode at start: gba (asynchronous, parameter server) or sync (dense all-reduce every step)."""
    aggregation: Literal["global_batch", "none"] = "global_batch"
    """global_batch: GBA proper. none: apply every gradient on arrival (plain asynchronous PS
    training, the baseline GBA improves on)."""
    decay: StalenessDecayConfig = dataclasses.field(default_factory=StalenessDecayConfig)
    """What a stale gradient still counts (see sync_algos.staleness)."""
    schedule: LRSchedule = dataclasses.field(default_factory=LRSchedule)
    """Learning-rate schedule by global step, identical in both modes."""
    queue_size: int = 2
    """Gradients the training thread may hand to the shadow thread before it drops the oldest
    (it never waits); >= 1."""
    switch_policy: SwitchPolicyConfig = dataclasses.field(default_factory=SwitchPolicyConfig)
    """Automatic sync <-> GBA switching."""

    def __post_init__(self) -> None:
        if self.queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {self.queue_size}")


class GlobalBatchAggregator:
    """The GBA buffer of one flat parameter shard. Not thread-safe: its owner holds a lock."""

    def __init__(self, config: GBAConfig, numel: int, dtype: torch.dtype, global_batch: int) -> None:
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1 sample, got {global_batch}")
        self.config = config
        self.global_batch = global_batch
        self.buffer = torch.zeros(numel, dtype=dtype)
        self.buffered_samples = 0
        self.global_step = 0

    def staleness(self, token: int) -> int:
        """`k_now - token`; refuses a token from the future."""
        if token > self.global_step:
            raise ValueError(f"token {token} is from the future (global step is {self.global_step})")
        if token < 0:
            raise ValueError(f"token must be >= 0, got {token}")
        return self.global_step - token

    def add(self, gradient: torch.Tensor, token: int, num_samples: int) -> tuple[int, float, torch.Tensor | None]:
        """Buffer one gradient; returns (staleness, weight, mean gradient to apply or None)."""
        staleness = self.staleness(token)
        weight = self.config.decay.weight(staleness)
        if weight == 0.0:
            return staleness, weight, None
        self.buffer.add_(gradient, alpha=weight * num_samples)
        self.buffered_samples += num_samples
        full = self.config.aggregation == "none" or self.buffered_samples >= self.global_batch
        if not full:
            return staleness, weight, None
        mean = self.buffer / self.buffered_samples
        self.buffer.zero_()
        self.buffered_samples = 0
        self.global_step += 1
        return staleness, weight, mean

    def discard(self) -> int:
        """Drop a partly filled global batch (at a mode switch); returns the samples dropped."""
        dropped, self.buffered_samples = self.buffered_samples, 0
        self.buffer.zero_()
        return dropped


@register
class GlobalBatchAggregation:
    """Registry entry: `sync.algo: gba` selects GBA and validates `sync.options` as GBAConfig."""

    name = "gba"
    kind: ClassVar[str] = "gradient"
    Config = GBAConfig

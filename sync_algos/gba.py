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
class AggregationConfig:
    """The server-side rule: how pushed gradients are aggregated and how much a stale one counts."""

    aggregation: Literal["global_batch", "none"] = "global_batch"
    """global_batch: GBA proper. none: apply every gradient on arrival (plain asynchronous PS
    training, the baseline GBA improves on)."""
    decay: StalenessDecayConfig = dataclasses.field(default_factory=StalenessDecayConfig)
    """What a stale gradient still counts (see sync_algos.staleness)."""


class GlobalBatchAggregator:
    """The GBA buffer of one flat parameter shard. Not thread-safe: its owner holds a lock."""

    def __init__(self, config: AggregationConfig, numel: int, dtype: torch.dtype, global_batch: int) -> None:
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
    """Registry entry: `sync.algo: gba` selects GBA; its trainer runtime is `shadowgba.gba.GBASync`."""

    name = "gba"
    kind: ClassVar[str] = "gradient"
    Config = AggregationConfig

"""GBA, global-batch gradient aggregation (Su et al., NeurIPS 2022): configuration and server rule.

GBA aggregates *gradients*, not models, so it does not fit the snapshot -> target interface of
`SyncAlgorithm`; its trainer runtime is `shadowgba.gba.runtime.GBASync` and its servers the dense shards
and embedding shards of `shadowgba.ps`. The rule they all run lives here, once, free of any
transport (`GlobalBatchRule`; `GlobalBatchAggregator` adds the buffer of a flat dense slice, the
embedding shards a sparse buffer of rows):

- a token is the global step k that a trainer's parameters came from; a pushed gradient's
  staleness is `k_now - token`; a token from the future (or a negative one) is refused;
- each push adds `w(staleness) * num_samples * g` to a buffer (g: the trainer's mean gradient over
  its local batch). Once the buffer holds one *global batch* of samples (the sync-mode global
  batch: trainers x local batch) the server applies `buffer / samples` with the one optimizer,
  whose learning rate follows a schedule indexed by k, and advances k;
- dropped gradients (w = 0) do not fill the global batch; decayed ones count fully, so their
  smaller weight lowers the mean.

A push to a dense vector split over several shards is decided once, by shard 0's rule
(`GlobalBatchAggregator.decide`); the other shards `follow` that decision in shard 0's order, so
every shard counts the same samples and advances the same global step k.

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
    """What a stale dense gradient still counts (see sync_algos.staleness)."""
    row_decay: StalenessDecayConfig = dataclasses.field(default_factory=lambda: StalenessDecayConfig(kind="none"))
    """What a stale push of PS-hosted table rows still counts. By default rows count fully up to
    `max_staleness` (kind none): the delay that makes a stale dense gradient dangerous acts through
    Adam's momentum (docs/gba.md, "The cause"), which the rows' row-wise Adagrad does not have, and a
    push's token overstates a row's staleness (most rows of a large table are untouched from one
    global step to the next). Halving stale row pushes as the dense ones cost AUC where the rows
    learn fast (docs/gba.md, "The rows' decay")."""


@dataclasses.dataclass(frozen=True)
class Admission:
    """What the rule decided about one push."""

    staleness: int
    """`k_now - token`, in global steps."""
    weight: float
    """The decay weight; 0 means dropped: the push's gradient must not enter the buffer."""
    scale: float
    """What the push's gradient is multiplied by as it enters the buffer: weight x its samples."""
    completed_samples: int
    """0, or, when this push completes a global step, the samples of that global batch: the owner
    applies `buffer / completed_samples` (the sample-weighted mean) and clears the buffer."""
    buffered_samples: int = 0
    """Samples counted toward the next global batch once this push is decided (0 when it completed
    one): how much of the batch its gradient waits for, which tells a trainer whether waiting for
    that batch's apply is short (`shadowgba.gba.fresh`)."""

    @property
    def dropped(self) -> bool:
        return self.weight == 0.0


class GlobalBatchRule:
    """GBA's rule on one server, whatever it buffers (a dense slice, embedding rows).

    It owns the server's global step k and the samples counted toward the current global batch;
    the owner keeps the buffer of weighted gradient sums, adds `Admission.scale * g` to it and
    applies it when `admit` says a global step is complete. Not thread-safe: its owner holds a lock.
    """

    def __init__(self, config: AggregationConfig, global_batch: int) -> None:
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1 sample, got {global_batch}")
        self.config = config
        self.global_batch = global_batch
        self.global_step = 0
        self.buffered_samples = 0

    def staleness(self, token: int) -> int:
        """`k_now - token`; refuses a token from the future or a negative one."""
        if token > self.global_step:
            raise ValueError(f"token {token} is from the future (global step is {self.global_step})")
        if token < 0:
            raise ValueError(f"token must be >= 0, got {token}")
        return self.global_step - token

    def admit(self, token: int, num_samples: int) -> Admission:
        """Decide one push of `num_samples` samples computed on parameters of `token`: its weight,
        and whether it completes a global step (then k has advanced). A refused token raises
        `ValueError` with nothing changed; a dropped push changes nothing."""
        staleness = self.staleness(token)
        weight = self.config.decay.weight(staleness)
        if weight == 0.0:
            return Admission(staleness, weight, 0.0, 0, self.buffered_samples)
        self.buffered_samples += num_samples
        completed = 0
        if self.config.aggregation == "none" or self.buffered_samples >= self.global_batch:
            completed, self.buffered_samples = self.buffered_samples, 0
            self.global_step += 1
        return Admission(staleness, weight, weight * num_samples, completed, self.buffered_samples)

    def follow(self, admission: Admission, num_samples: int) -> None:
        """Take a decision another server's rule made about the same push (`admit` there), so
        that every server holding a part of one push counts the same samples and the same global
        step k. Raises `RuntimeError` when the decision cannot be this rule's (the two diverged)."""
        if admission.dropped:
            return
        buffered = self.buffered_samples + num_samples
        if admission.completed_samples and admission.completed_samples != buffered:
            raise RuntimeError(f"a decision completing a global batch of {admission.completed_samples} samples "
                               f"arrived with {buffered} samples counted here: the servers' global steps diverged")
        if admission.completed_samples:
            self.buffered_samples = 0
            self.global_step += 1
        else:
            self.buffered_samples = buffered

    def discard(self) -> int:
        """Forget a partly counted global batch; returns its samples."""
        dropped, self.buffered_samples = self.buffered_samples, 0
        return dropped


class GlobalBatchAggregator:
    """The GBA buffer of one flat parameter shard, under `GlobalBatchRule`. Not thread-safe: its
    owner holds a lock.

    The buffer is written, not zeroed and added to, by the first gradient of a global batch, and
    the mean is computed in place: one pass over the values per push and one per global step, no
    allocation. So the mean returned by `decide` / `follow` is the buffer itself, valid until the
    next call: the owner applies it at once."""

    def __init__(self, config: AggregationConfig, numel: int, dtype: torch.dtype, global_batch: int) -> None:
        self.rule = GlobalBatchRule(config, global_batch)
        self.buffer = torch.zeros(numel, dtype=dtype)
        self._empty = True
        """No gradient entered the buffer since the last global step: its values are stale."""

    @property
    def global_step(self) -> int:
        """The shard's k; set when the shard takes over an optimizer already at some step."""
        return self.rule.global_step

    @global_step.setter
    def global_step(self, step: int) -> None:
        self.rule.global_step = step

    @property
    def buffered_samples(self) -> int:
        return self.rule.buffered_samples

    def staleness(self, token: int) -> int:
        """`k_now - token`; refuses a token from the future."""
        return self.rule.staleness(token)

    def add(self, gradient: torch.Tensor, token: int, num_samples: int) -> tuple[int, float, torch.Tensor | None]:
        """Buffer one gradient; returns (staleness, weight, mean gradient to apply or None)."""
        admission, mean = self.decide(gradient, token, num_samples)
        return admission.staleness, admission.weight, mean

    def decide(self, gradient: torch.Tensor, token: int, num_samples: int) -> tuple[Admission, torch.Tensor | None]:
        """`add`, returning the whole decision (to be `follow`ed by the other shards of the push)."""
        admission = self.rule.admit(token, num_samples)
        return admission, self._take(gradient, admission)

    def follow(self, gradient: torch.Tensor | None, admission: Admission, num_samples: int) -> torch.Tensor | None:
        """Buffer one gradient under a decision taken by another shard's rule (`GlobalBatchRule.follow`);
        returns the mean gradient to apply or None. `gradient` None contributes nothing but still
        counts the decision's samples (a part refused here: k must stay the deciding shard's)."""
        self.rule.follow(admission, num_samples)
        return self._take(gradient, admission)

    def _take(self, gradient: torch.Tensor | None, admission: Admission) -> torch.Tensor | None:
        """Add the admitted gradient to the buffer; the mean (the buffer itself) when the decision
        completes a global step. A gradient of a narrower dtype than the buffer's (bf16 pushes)
        is accumulated in the buffer's."""
        if not admission.dropped and gradient is not None:
            if self._empty and gradient.dtype == self.buffer.dtype:
                torch.mul(gradient, admission.scale, out=self.buffer)
            elif self._empty:  # widened first, so the product is rounded in the buffer's dtype
                self.buffer.copy_(gradient).mul_(admission.scale)
            else:
                self.buffer.add_(gradient, alpha=admission.scale)
            self._empty = False
        if not admission.completed_samples:
            return None
        if self._empty:  # every part of this global batch was refused here: nothing to apply but zeros
            self.buffer.zero_()
        self._empty = True
        return self.buffer.div_(admission.completed_samples)

    def discard(self) -> int:
        """Drop a partly filled global batch (at a mode switch); returns the samples dropped."""
        self._empty = True
        return self.rule.discard()


@register
class GlobalBatchAggregation:
    """Registry entry: `sync.algo: gba` selects GBA; its trainer runtime is `shadowgba.gba.runtime.GBASync`."""

    name = "gba"
    kind: ClassVar[str] = "gradient"
    Config = AggregationConfig

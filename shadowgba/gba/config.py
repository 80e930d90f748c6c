"""`GBAConfig`: the `sync.gba` section, read by `GBASync` on the trainers and by the dense shards."""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from shadowgba.errors import ConfigError
from shadowgba.flat_optimizer import LRSchedule
from shadowgba.gba.switch_policy import SwitchPolicyConfig
from sync_algos.gba import AggregationConfig


@dataclasses.dataclass
class GBAConfig(AggregationConfig):
    """Knobs of GBA and of its synchronous twin (the aggregation rule's fields, `aggregation` and
    `decay`, come from `sync_algos.gba.AggregationConfig`)."""

    initial_mode: Literal["gba", "sync"] = "gba"
    """Mode at start: gba (asynchronous, parameter server) or sync (dense all-reduce every step)."""
    schedule: LRSchedule = dataclasses.field(default_factory=LRSchedule)
    """Learning-rate schedule by global step, identical in both modes."""
    queue_size: int = 2
    """Gradients the training thread may hand to the shadow thread before it drops the oldest
    (it never waits); >= 1."""
    switch_policy: SwitchPolicyConfig = dataclasses.field(default_factory=SwitchPolicyConfig)
    """Automatic sync <-> GBA switching."""
    push_dtype: Literal["float32", "bfloat16"] | None = None
    """The dtype in which trainers push gradients to the dense shards (and queue them): None, the
    dense parameters' own. bfloat16 halves the bytes of every push and of the trainer's queued
    gradients, at 8 bits of mantissa; the shards still accumulate, step and serve the parameters in
    their own dtype (fp32's range is kept, so no gradient overflows)."""
    params_dtype: Literal["float32", "bfloat16"] | None = None
    """The dtype in which the shards send each new global step's parameters to the trainers (watch
    and push replies): None, their own. bfloat16 halves that traffic, and the trainers then compute
    their gradients on the parameters rounded to bf16 (the shards keep and step their own); the
    pulls that start and end a GBA phase stay exact, so every replica ends at the shards' values."""
    fresh_wait: float = 1.0
    """After pushing a gradient, a trainer waits at most this share of its own compute time per step
    for the global step that gradient entered to be applied, so that its next gradient is computed
    on fresh parameters (staleness 0) whenever its peers complete the global batch within that time.
    Equal-speed trainers then train as sync does; under a straggler the fast trainers' batches
    often complete among themselves. A trainer waits only where its batch is predicted to complete
    soon (the share of it still missing at the push's answer, at the pace of the global steps), and
    once most waits time out it stops waiting and probes one step in 10 (`shadowgba.gba.fresh`).
    0: never wait (every gradient about one global step stale); >= 0. Plain async (`aggregation:
    none`) never waits. Measured: docs/gba.md, "Quality"."""
    fresh_wait_budget: float = 0.25
    """The fresh waits stop while they take more than this share of the trainer's compute time (a
    moving average over the steps), and resume as it decays: the most throughput they may cost;
    within it the trainer takes the waits predicted shortest (`shadowgba.gba.fresh`). A quarter
    keeps GBA's speed under a straggler; larger budgets cost that speed and bought no AUC there
    (docs/gba.md, "Quality"). In (0, 1]."""
    lookahead: float = 1.0
    """Weight prediction: each trainer computes its gradients on the parameters extrapolated by
    this multiple of its recent staleness (global steps) at their velocity over the last global
    steps, so that a gradient applied s steps late was computed about where it is applied
    (`shadowgba.gba.lookahead`). 0: on the parameters received. >= 0; GBA's global-batch
    aggregation only (plain async keeps the parameters it received). Costs three extra copies of
    the dense parameters on each trainer and a few vector operations per install."""
    lockstep_every: int | None = None
    """When the trainers take every step together anyway (TorchRec-sharded tables: each step's
    all-to-all pairs them), they agree on leaving GBA every this many GBA steps, else one trainer's
    switch barrier would meet a peer's next all-to-all. None: inferred (20 with TorchRec-sharded
    tables, 0 otherwise); 0: trainers step independently (PS-hosted tables)."""

    def push_torch_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype of a push for parameters of `param_dtype` (`push_dtype`): the one rule that the
        trainers' queue and the shards' check of every push share."""
        return _torch_dtype(self.push_dtype, param_dtype)

    def params_torch_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the parameters in a shard's watch and push replies (`params_dtype`)."""
        return _torch_dtype(self.params_dtype, param_dtype)

    def __post_init__(self) -> None:
        if self.queue_size < 1:
            raise ConfigError(f"queue_size must be >= 1, got {self.queue_size}")
        if not self.fresh_wait >= 0:
            raise ConfigError(f"fresh_wait must be >= 0 (a share of the step's compute time), got {self.fresh_wait}")
        if not 0 < self.fresh_wait_budget <= 1:
            raise ConfigError(f"fresh_wait_budget must be in (0, 1] (a share of the compute time), got "
                              f"{self.fresh_wait_budget}")
        if not self.lookahead >= 0:
            raise ConfigError(f"lookahead must be >= 0 (a multiple of the staleness), got {self.lookahead}")
        if self.lockstep_every is not None and self.lockstep_every < 0:
            raise ConfigError(f"lockstep_every must be >= 0 or null, got {self.lockstep_every}")


def _torch_dtype(setting: str | None, param_dtype: torch.dtype) -> torch.dtype:
    """A dtype setting of `GBAConfig` as a torch dtype; None: the parameters' own."""
    return param_dtype if setting is None else getattr(torch, setting)

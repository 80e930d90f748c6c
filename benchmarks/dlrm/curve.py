"""Held-out AUC vs samples seen during training (`train.eval_every_samples`), for learning-curve plots.

Samples seen count over all trainers. With TorchRec tables the trainers are in lockstep (and the
forward pass is itself collective): samples seen are step x batch x trainers, and every trainer
evaluates at the same step, each scoring its share of the held-out set, as the final evaluation.
In a 2D job only a sharding group's ranks pair their steps: each group evaluates its own replica,
among its own ranks (an evaluation over every trainer would make a fast group wait for the slow
one at every point, so that both end with the same steps), at the job's samples seen, the
`train.job_samples` counter its decider read at its last stop decision (`StopRule.job_samples_seen`).
Without lockstep (tables on the PS) trainers step independently, so they must not meet in a
collective: trainer 0 alone scores the whole held-out set with its replica (under GBA every
trainer pulls the same parameters; `DenseSync.evaluating` shows the received ones, not the
lookahead's prediction) and counts the samples applied by the GBA global step; without a
global step (S-EASGD) it counts its own steps x batch x trainers, exact only while trainers keep
pace. The last point is the final evaluation, so curves of different algorithms end at equal
samples seen.

Time spent evaluating is left out of the training clock (the loop shifts its step times by it):
`elapsed_s` is training time since the common start, and the throughput window is unaffected. An
evaluating trainer pauses; without lockstep the others keep training meanwhile.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import torch
from torch import nn

from dlrm.config import ExperimentConfig
from dlrm.job import applied_samples
from dlrm.loop import StopRule, evaluate
from ctrkit.ctr_data import CTRData
from shadowgba.interface import DenseSync
from shadowgba.ps import transport

SYNC_PROGRESS = {
    "rounds": "sync_rounds", "sync_gap_steps_mean": "sync_gap_steps_mean",
    "stale_dropped": "gba_stale_dropped", "decayed": "gba_decayed",
}
"""Counters of the sync's `metrics.summary()` copied into each point (those it has): summary key -> point key."""


class HeldoutCurve:
    """The points `{samples_seen, auc, log_loss, elapsed_s, sync_rounds, ...}`, one each time the samples
    seen cross a multiple of `every_samples` (0: none), plus the final evaluation."""

    def __init__(
        self,
        every_samples: int,
        samples_seen: Callable[[int], int],
        evaluate_now: Callable[[], dict[str, float]],
        sync_metrics: Any | None,
    ) -> None:
        self.every_samples = every_samples
        self.points: list[dict[str, float]] = []
        self.eval_s = 0.0
        """Time this trainer spent evaluating during training."""
        self._samples_seen = samples_seen
        self._evaluate_now = evaluate_now
        self._sync_metrics = sync_metrics
        self._next = every_samples
        self._seen = 0

    def after_step(self, step: int, elapsed_s: float) -> float:
        """Called after every step (the last included): evaluates when due; returns the seconds it spent."""
        self._seen = self._samples_seen(step)
        if not self.every_samples or self._seen < self._next:
            return 0.0
        started = time.perf_counter()
        self._record(self._evaluate_now(), elapsed_s)
        self._next = (self._seen // self.every_samples + 1) * self.every_samples
        spent = time.perf_counter() - started
        self.eval_s += spent
        return spent

    def finish(self, quality: dict[str, float], elapsed_s: float) -> None:
        """Add the final evaluation at the samples seen after the last step (when the curve is on); it
        replaces a point taken at the last step itself (the final one follows the sync's close)."""
        if not self.every_samples:
            return
        if self.points and self.points[-1]["samples_seen"] == self._seen:
            self.points.pop()
        self._record(quality, elapsed_s)

    def _record(self, quality: dict[str, float], elapsed_s: float) -> None:
        summary = self._sync_metrics.summary() if self._sync_metrics is not None else {}
        progress = {name: summary[key] for key, name in SYNC_PROGRESS.items() if key in summary}
        self.points.append({"samples_seen": self._seen, **quality, "elapsed_s": elapsed_s, **progress})


def heldout_curve(
    config: ExperimentConfig,
    model: nn.Module,
    data: CTRData,
    roles: transport.Roles,
    device: torch.device,
    sync: Any | None,
    stop: StopRule,
) -> HeldoutCurve:
    """This trainer's curve: evaluating on the trainers `stop` pairs (every trainer in lockstep, a
    2D job's sharding group), else on trainer 0 alone."""
    num_trainers = len(roles.trainer_ranks)
    alone = not config.lockstep
    every = config.train.eval_every_samples if not alone or roles.trainer_index == 0 else 0

    def evaluate_now() -> dict[str, float]:
        with sync.evaluating() if isinstance(sync, DenseSync) else contextlib.nullcontext():  # GBA: the shards' model
            quality = evaluate(model, data, roles, device, alone=alone, group=stop.group)
        model.train()
        return quality

    count = applied_samples(sync, config) if alone and config.algo == "gba" else None
    if config.lockstep and config.train.job_samples:
        count = lambda: stop.job_samples_seen  # noqa: E731 (the same on every rank that evaluates together)

    def samples_seen(step: int) -> int:
        return count() if count is not None else step * config.data.batch_size * num_trainers

    return HeldoutCurve(every, samples_seen, evaluate_now, getattr(sync, "metrics", None))

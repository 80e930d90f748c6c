"""The example's training loop and what is measured around it, on the trainers only.

One step: forward, backward, the injected straggler sleep (`ctrkit.straggler`; before the
gradients leave the trainer, so a slow trainer's gradients arrive late), the PS row-gradient push
(PS tables), `optimizer.step()` (where ShadowSync / GBASync act).

Stopping (`StopRule`): after `train.steps`, or `duration_s` after this trainer's warm-up, or once
the dense parameters hold `global_samples` samples (GBA's global step), or once all trainers
together have computed `job_samples` samples (a counter in the job's store that each decider adds
its trainers' samples to). When trainers must take equal step counts (TorchRec tables: the
all-to-all pairs their steps) one of them decides and broadcasts its decision every
`stop_check_every` steps; with PS tables a trainer step has no collective and each trainer decides
alone, so a fast trainer never waits for a slow one.

Timing: every trainer measures from a common start (a barrier on the trainer group before the first
step); time spent between steps outside training (held-out evaluation, `dlrm.curve`) is left out of
its clock, as if it had been paused. Throughput counts every trainer's samples over one window of
those clocks shared by all: from the moment the last trainer finished its warm-up to the moment the
first trainer finished its last step.
Only the trainer group is used; server ranks never see these collectives.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.modules.mlp import Perceptron

from dlrm.config import TrainConfig
from dlrm.model import BuiltModel
from dlrm.progress import progress
from ctrkit.ctr_data import CTRData
from ctrkit.evaluation import all_gather_rows, log_loss, roc_auc
from shadowgba.ps import transport
from shadowgba.job.rendezvous import restart_count
from ctrkit.straggler import Straggler, StragglerConfig


@dataclasses.dataclass
class TrainStats:
    """What the training loop measured on this trainer (times in seconds since the common start)."""

    steps: int
    """The step the loop ended at: steps since the job's start, warm-up included (a resumed run
    counts the steps before its checkpoint too)."""
    warmup_end_s: float
    """When the warm-up steps were done."""
    step_end_s: list[float]
    """When each step ended."""
    step_end_at: list[float]
    """When each step ended, wall clock (`time.time()`, pauses included): to place the steps
    beside events outside the job (a replica group killed and restarted)."""
    global_steps: tuple[int, int] | None
    """GBA jobs: the global step k this trainer held at the end of its warm-up and at its last step."""
    straggler_sleep_s: float
    """Time this trainer slept in straggler injection."""
    straggler_overrun_fraction: float
    """Simulated compute: share of this trainer's steps whose real work overran the budget."""


class StopRule:
    """Decides, after each step, whether this trainer leaves the loop (see the module docstring)."""

    JOB_SAMPLES_KEY = "dlrm/job_samples"
    """The store key of the samples every trainer has computed (`train.job_samples`)."""

    def __init__(
        self,
        config: TrainConfig,
        lockstep: bool,
        roles: transport.Roles,
        device: torch.device,
        applied_samples: Callable[[], int] | None,
        paired: tuple[dist.ProcessGroup, int] | None = None,
        batch_size: int = 0,
    ) -> None:
        """`paired`: the group of trainers whose steps pair every step (they must stop at the same
        one; `dlrm.job.paired_trainers`) and the global rank that decides for them; default every
        trainer, trainer 0 deciding. `batch_size`: per trainer, to count samples for `job_samples`
        (from step 0: a run with a checkpoint directory refuses `job_samples`)."""
        if config.global_samples and applied_samples is None:
            raise ValueError("train.global_samples needs a counter of applied samples (GBA)")
        if config.job_samples and batch_size <= 0:
            raise ValueError("train.job_samples needs the per-trainer batch size")
        self.config = config
        self.lockstep = lockstep
        self.roles = roles
        self.group, self.source = paired or (roles.trainer_group, roles.trainer_ranks[0])
        self.device = device
        self.applied_samples = applied_samples
        self.samples_per_step = batch_size * (dist.get_world_size(self.group) if lockstep else 1)
        """Samples one step of this decider's trainers computes (all of its paired group's)."""
        self.counted_step = 0
        self.job_samples_seen = 0
        """`job_samples`: the job's counter at this trainer's last stop decision, the same on every
        trainer of its paired group (the decider's, broadcast with the decision)."""

    def __call__(self, step: int, since_warmup_s: float) -> bool:
        config = self.config
        if not any(config.stop_limits):
            return step >= config.steps  # the same step on every trainer
        timed_steps = step - config.warmup_steps
        if timed_steps <= 0 or (self.lockstep and timed_steps % config.stop_check_every):
            return False
        if self.lockstep and self.roles.rank != self.source:
            stop = False  # the decider's broadcast overwrites it
        elif config.duration_s:
            stop = since_warmup_s >= config.duration_s
        elif config.global_samples:
            stop = self.applied_samples() >= config.global_samples
        else:
            self.job_samples_seen = self._job_samples(step)
            stop = self.job_samples_seen >= config.job_samples
        if not self.lockstep:
            return stop
        decision = torch.tensor([float(stop), float(self.job_samples_seen)], dtype=torch.float64, device=self.device)
        dist.broadcast(decision, src=self.source, group=self.group)
        self.job_samples_seen = int(decision[1].item())
        return bool(decision[0].item())

    def _job_samples(self, step: int) -> int:
        """Adds the samples this decider's trainers computed since its last count to the job's
        counter; the counter's new value. The default group's store is the job's (torchrun's agent
        store), so no trainer waits for another to count."""
        counted = self.samples_per_step * (step - self.counted_step)
        self.counted_step = step
        key = f"{self.JOB_SAMPLES_KEY}/attempt_{restart_count()}"
        return dist.distributed_c10d._get_default_store().add(key, counted)


def train(
    model: BuiltModel,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[Batch],
    config: TrainConfig,
    stop: StopRule,
    straggler_config: StragglerConfig,
    global_step: Callable[[], int] | None,
    device: torch.device,
    between_steps: Callable[[int, float], float],
    start_step: int = 0,
) -> TrainStats:
    """Local training steps until `stop` says so. `between_steps(step, elapsed_s)` runs after each step
    (the last included) and returns the seconds it spent, which are left out of the step times.
    `start_step`: the step a resumed run continues from (steps count from the job's start; a run
    resumed past its warm-up times every step it takes)."""
    roles = stop.roles
    model.module.train()
    bar = progress(total=None if any(config.stop_limits) else config.steps, initial=start_step,
                   enabled=roles.trainer_index == 0 and config.progress)
    dist.barrier(group=roles.trainer_group)  # the common start
    origin = time.perf_counter()
    straggler = Straggler(straggler_config, roles.trainer_index, len(roles.trainer_ranks))
    step, warmup_end, step_ends, step_ends_at = start_step, 0.0, [], []
    warmup_global_step = global_step() if global_step else 0
    while True:
        straggler.begin_step()
        batch: Batch = next(batches).to(device)
        loss, _ = model.module(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        straggler.step()
        if model.ps_embeddings is not None:
            model.ps_embeddings.push_gradients()
        optimizer.step()
        step += 1
        now = time.perf_counter() - origin
        step_ends.append(now)
        step_ends_at.append(time.time())
        if step == config.warmup_steps:
            warmup_end = now
            warmup_global_step = global_step() if global_step else 0
        bar.update()
        if step % config.stop_check_every == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
        paused = between_steps(step, now)
        origin += paused
        if stop(step, now - warmup_end):
            break
    bar.close()
    global_steps = (warmup_global_step, global_step()) if global_step else None
    return TrainStats(steps=step, warmup_end_s=warmup_end, step_end_s=step_ends, step_end_at=step_ends_at,
                      global_steps=global_steps,
                      straggler_sleep_s=straggler.slept_s, straggler_overrun_fraction=straggler.overrun_fraction)


def common_window(stats: TrainStats, batch_size: int, roles: transport.Roles, device: torch.device) -> dict[str, float]:
    """All trainers' samples per second over the window every trainer was training in, after warm-up.

    Returns window_s (0 when the trainers' timed phases do not overlap), steps_in_window_by_trainer,
    samples_in_window (all trainers) and samples_per_s_total."""
    bounds = torch.tensor([stats.warmup_end_s, -stats.step_end_s[-1]], dtype=torch.float64, device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=roles.trainer_group)
    start, end = bounds[0].item(), -bounds[1].item()
    mine = torch.tensor([sum(1 for ended in stats.step_end_s if start < ended <= end)], device=device)
    steps = all_gather_rows(mine, roles.trainer_group).tolist()
    samples = sum(steps) * batch_size
    window = max(end - start, 0.0)
    return {
        "window_s": window, "steps_in_window_by_trainer": steps, "samples_in_window": samples,
        "samples_per_s_total": samples / window if window else 0.0,
    }


def global_steps_per_s(stats: TrainStats) -> float | None:
    """Rate of the global step k seen by this trainer between its warm-up end and its last step."""
    if stats.global_steps is None:
        return None
    first, last = stats.global_steps
    elapsed = stats.step_end_s[-1] - stats.warmup_end_s
    return (last - first) / elapsed if elapsed > 0 else 0.0


@torch.no_grad()
def evaluate(
    model: nn.Module, data: CTRData, roles: transport.Roles, device: torch.device, alone: bool = False,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Held-out AUC and log loss over the whole set; each trainer of `group` (default every trainer;
    a 2D job's sharding group during training: its replica, evaluated while the other groups train
    on) scores its share with its replica (collective), or with `alone` this trainer scores all of
    it, with no collective (PS tables only: a TorchRec-sharded forward is itself collective)."""
    model.eval()
    group = roles.trainer_group if group is None else group
    logits, labels = [], []
    share = (0, 1) if alone else (group.rank(), group.size())
    with DeadUnits(model) as dead:
        for batch in data.heldout_batches(*share):
            _, (_, batch_logits, batch_labels) = model(batch.to(device))
            logits.append(batch_logits)
            labels.append(batch_labels)
    all_logits, all_labels = torch.cat(logits), torch.cat(labels)
    if not alone:
        all_logits, all_labels = all_gather_rows(all_logits, group), all_gather_rows(all_labels, group)
    return {"auc": roc_auc(all_logits, all_labels), "log_loss": log_loss(all_logits, all_labels),
            "dead_unit_share": dead.share()}


class DeadUnits:
    """While entered, the hidden units of the model's MLPs (TorchRec `Perceptron`s, ReLU) that never
    fire: a unit whose output is 0 on every held-out sample this trainer scores is dead, and nothing
    more is learnt through it. Reported beside the AUC to tell a collapsed run from one whose units
    died; healthy runs have dead units too (docs/gba.md, "A stable baseline")."""

    def __init__(self, model: nn.Module) -> None:
        self._layers = [module for module in model.modules() if isinstance(module, Perceptron)]
        self._fired: dict[int, torch.Tensor] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> "DeadUnits":
        for index, layer in enumerate(self._layers):
            self._hooks.append(layer.register_forward_hook(
                lambda _module, _inputs, output, index=index: self._record(index, output)))
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()

    def _record(self, index: int, output: torch.Tensor) -> None:
        fired = (output.detach() > 0).any(dim=0)
        self._fired[index] = fired | self._fired[index] if index in self._fired else fired

    def share(self) -> float:
        """Dead units / hidden units over every MLP layer (0 when the model has none)."""
        units = sum(fired.numel() for fired in self._fired.values())
        return sum(int((~fired).sum()) for fired in self._fired.values()) / units if units else 0.0


def replica_spread(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> float:
    """Max over the ranks of `group` and the elements of `tensors` of |w - mean over the ranks of w|:
    0 when every rank of `group` holds the same values (the dense replicas over the trainers; a 2D
    job's table shards over their replica group). One tensor at a time, so that the check holds
    no copy of all of them (a run's peak memory is measured after it)."""
    largest = 0.0
    for tensor in tensors:
        mean = tensor.detach().to(torch.float64, copy=True)
        dist.all_reduce(mean, group=group)
        if mean.numel():
            largest = max(largest, (tensor.detach() - mean / dist.get_world_size(group)).abs().max().item())
    spread = torch.tensor(largest, dtype=torch.float64, device=tensors[0].device)
    dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=group)
    return spread.item()


def sum_over_trainers(value: float, roles: transport.Roles, device: torch.device) -> float:
    """Sum of a per-trainer number over all trainers."""
    total = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(total, group=roles.trainer_group)
    return total.item()

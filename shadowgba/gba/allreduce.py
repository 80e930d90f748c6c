"""Sync mode's one collective per step: an all-reduce that carries the gradient and the control flags.

Each trainer step in sync mode is exactly one `all_reduce` (SUM) over the trainer group of one flat
buffer, laid out as

    [ gradient (numel) | contributors (1) | stop (1) | switch (1) | compute time (1 per trainer)
      | non-finite (1 per trainer) ]

- gradient: this trainer's gradient, or zeros when it does not contribute (its closing round, or
  a gradient with NaN / Inf values: those never enter the sum);
- contributors: 1 from each trainer that contributed, so the sum is the divisor of the mean;
- stop: 1 from a trainer that is closing: its peers stop issuing collectives (`mode.Mode.LOCAL`);
- switch: 1 from a trainer that was asked (`switch_mode("gba")`) to switch to GBA;
- compute time: each trainer writes only its own slot, so the sum is every trainer's time;
- non-finite: 1 in its own slot from a trainer whose gradient was not finite, so every trainer
  learns who, after the same step, and applies the same rule (`runtime`: skip or fail).

Folding the flags and the times into the gradient's all-reduce is what makes sync mode need no
agreement round: every trainer receives the same sums after the same step, so every trainer takes
the same decision there (stop, switch, or what the switch policy says about the times), and no
second collective can be left unmatched. The buffer is allocated once; its fields are named views
of it (`torch.split`), so the layout is written down in one place, `SyncAllReduce.__init__`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class SyncRound:
    """What one sync all-reduce brought back (the same on every trainer)."""

    mean_gradient: torch.Tensor | None
    """The mean of the contributed gradients, or None when this trainer did not contribute or
    nobody did: a view of the round's buffer (divided in place), valid until the next round."""
    stopped: bool
    """A trainer is closing: no more collectives until `close()`."""
    switch_to_gba: bool
    """A trainer was asked to switch to GBA."""
    compute_times: list[float]
    """Every trainer's compute time of this step, in trainer order (for the switch policy)."""
    nonfinite: list[int]
    """The trainers (indices) whose gradient of this step was not finite and was left out."""


class SyncAllReduce:
    """One trainer's side of the sync-mode all-reduce; see the module docstring for the layout."""

    def __init__(self, numel: int, num_trainers: int, trainer_index: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self._buffer = torch.zeros(numel + 3 + 2 * num_trainers, dtype=dtype, device=device)
        self._gradient, self._control = self._buffer.split([numel, 3 + 2 * num_trainers])
        """The gradient field, and everything after it (read back in one device-to-host copy)."""
        self._contributors, self._stop, self._switch, self._compute_times, self._nonfinite = self._control.split(
            [1, 1, 1, num_trainers, num_trainers])
        self._num_trainers = num_trainers
        self._trainer_index = trainer_index

    @property
    def buffer(self) -> torch.Tensor:
        """The one buffer every round reuses: [gradient | control]."""
        return self._buffer

    @property
    def gradient(self) -> torch.Tensor:
        """The gradient field: a caller may write its gradient here and pass it to `round`, which
        then sends it where it is, without a copy (and without a gradient buffer of the caller's)."""
        return self._gradient

    def round(self, group: dist.ProcessGroup | None, gradient: torch.Tensor | None, stop: bool, switch_to_gba: bool,
              compute_s: float, finite: bool = True) -> SyncRound:
        """All-reduce this trainer's `gradient` (None: contribute nothing and apply nothing) and flags
        over `group`; blocking, collective. `finite` False: the gradient is left out and flagged, and
        this trainer still gets the mean of the others' (the replicas stay identical). `gradient`
        may be the `gradient` field itself. The group is the caller's, not kept here: destroying it
        must free it."""
        self._control.zero_()
        if gradient is not None and finite:
            if gradient is not self._gradient:
                self._gradient.copy_(gradient)
            self._contributors.fill_(1.0)
        else:
            self._gradient.zero_()
            if gradient is not None:
                self._nonfinite[self._trainer_index] = 1.0
        self._stop.fill_(float(stop))
        self._switch.fill_(float(switch_to_gba))
        self._compute_times[self._trainer_index] = compute_s
        dist.all_reduce(self._buffer, group=group)
        contributors, stopped, switch, *per_trainer = self._control.tolist()
        compute_times, nonfinite = per_trainer[:self._num_trainers], per_trainer[self._num_trainers:]
        takes_part = gradient is not None and contributors > 0
        return SyncRound(
            mean_gradient=self._gradient.div_(contributors) if takes_part else None,
            stopped=stopped > 0,
            switch_to_gba=switch > 0,
            compute_times=compute_times,
            nonfinite=[index for index, flag in enumerate(nonfinite) if flag > 0],
        )

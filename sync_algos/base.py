"""The small interface every synchronization algorithm implements, and the machinery they share.

An algorithm sees the dense parameters of one trainer as a single flat tensor (the *snapshot* `s`)
and returns a *target* `t` for the round; the runtime then writes `w <- w + (t - s)` back into the
live parameters, so local progress made while the round was in flight survives. Algorithms never
touch the live parameters themselves, which keeps them testable on plain tensors.

Stop protocol (why ranks that finish at different steps cannot hang): every round performs exactly
one collective on the algorithm's process group, and that collective carries a *stop flag* in its
last element (summed over ranks). A rank that wants to stop raises its flag in its next round; all
ranks see the sum in the same round and leave their loops after it. Because every rank performs the
same sequence of collectives up to and including that round, nobody is left waiting in a collective
that its peers will never enter.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, Mapping

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class RoundResult:
    """What one round produced."""

    target: torch.Tensor
    """Flat target `t`; the runtime writes back `w <- w + (t - s)`."""
    stop: bool
    """True when some rank raised its stop flag in this round: every rank leaves after it."""
    bytes_moved: int
    """Bytes this rank sent in the round's collective (payload plus flag)."""


class FlaggedAllReduce:
    """A sum all-reduce of a flat payload with the stop flag riding in one extra element.

    The buffer is allocated once; `sum` returns a view into it that the next call overwrites, so
    callers copy what they keep.
    """

    def __init__(self, group: dist.ProcessGroup | None, like: torch.Tensor) -> None:
        self._group = group
        self._buffer = torch.empty(like.numel() + 1, dtype=like.dtype, device=like.device)

    @property
    def bytes_per_call(self) -> int:
        return self._buffer.numel() * self._buffer.element_size()

    def sum(self, payload: torch.Tensor, stop: bool) -> tuple[torch.Tensor, bool]:
        """All-reduce (sum) `payload` over the group; return the sum and whether any rank stopped."""
        self._buffer[:-1].copy_(payload)
        self._buffer[-1] = 1.0 if stop else 0.0
        dist.all_reduce(self._buffer, op=dist.ReduceOp.SUM, group=self._group)
        return self._buffer[:-1], bool(self._buffer[-1].item() > 0)


class SyncAlgorithm(abc.ABC):
    """One synchronization algorithm bound to a process group.

    Subclasses set `name` and `Config` (a dataclass validating itself in `__post_init__` with
    `ValueError`s), keep their state as flat tensors named in `state_names`, and implement `round`.
    """

    name: ClassVar[str]
    kind: ClassVar[str] = "model"
    uses_collectives: ClassVar[bool] = True
    """False for algorithms that only talk to a parameter server: no lockstep, no shadow group."""
    Config: ClassVar[type]
    state_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Any, group: dist.ProcessGroup | None, initial: torch.Tensor) -> None:
        """`initial` is the flat dense parameters, already identical on every rank."""
        self.config = config
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.allreduce = FlaggedAllReduce(group, initial)
        self.started = False  # until the first round (or a restored state) has placed the state

    def sync(self, snapshot: torch.Tensor, stop: bool) -> RoundResult:
        """The round the runtime runs: `round`, except that the job's first round is a consensus start.

        The replicas train alone for `first_round_after` steps before the first round, so by then the
        initial weights that EASGD's centre and BMUF's global model hold are stale: an EASGD round
        would pull every replica alpha of the way back to them, and BMUF would read the whole warm-up
        as one block and push past it with momentum. On the synthetic quality benchmark each sent one
        seed in three to a basin 0.007-0.013 AUC lower for 6M samples. So the first round averages
        the replicas and starts the algorithm's state there (`start_at`), as fairseq's BMUF does after
        its warm-up; from the second round on the algorithm runs its own formula. A state restored
        from a checkpoint is already placed and is kept. Algorithms without collectives (S-EASGD on
        the PS) have no average to start from and run `round` from the first round on.
        """
        if self.started or not self.uses_collectives:
            return self.round(snapshot, stop)
        result = self.averaging_round(snapshot, stop)
        self.start_at(result.target)
        self.started = True
        return result

    @abc.abstractmethod
    def round(self, snapshot: torch.Tensor, stop: bool) -> RoundResult:
        """Run one round from the flat snapshot `s`; raise the stop flag when `stop` is true."""

    def start_at(self, consensus: torch.Tensor) -> None:
        """Place the algorithm's state at `consensus`, the replicas' average (nothing to place for MA)."""

    def average(self, snapshot: torch.Tensor, stop: bool) -> tuple[torch.Tensor, bool]:
        """`allreduce(s) / n` with the stop flag: the building block of MA and BMUF."""
        total, any_stop = self.allreduce.sum(snapshot, stop)
        return total / self.world_size, any_stop

    def averaging_round(self, snapshot: torch.Tensor, stop: bool) -> RoundResult:
        """A round whose target is the replicas' average: MA's every round, every algorithm's first."""
        average, any_stop = self.average(snapshot, stop)
        return RoundResult(average.clone(), any_stop, self.allreduce.bytes_per_call)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The algorithm's state (centre, global model, momentum ...) as cloned flat tensors."""
        return {name: getattr(self, name).clone() for name in self.state_names}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore state saved by `state_dict`; refuse, touching nothing, if it does not fit."""
        missing = set(self.state_names) - set(state)
        unexpected = set(state) - set(self.state_names)
        if missing or unexpected:
            raise ValueError(
                f"{self.name} state_dict mismatch: missing {sorted(missing)}, "
                f"unexpected {sorted(unexpected)}; expected keys {list(self.state_names)}"
            )
        for name in self.state_names:
            current: torch.Tensor = getattr(self, name)
            value = state[name]
            if not isinstance(value, torch.Tensor) or value.shape != current.shape:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                raise ValueError(
                    f"{self.name} state '{name}' has shape {shape}, expected "
                    f"{tuple(current.shape)} (was the checkpoint made for another model?)"
                )
        for name in self.state_names:
            getattr(self, name).copy_(state[name])
        self.started = True

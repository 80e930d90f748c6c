"""The dense (replicated) parameters of a model: which they are, and a flat view of them.

Which: all trainable parameters of a plain module; for a TorchRec `DistributedModelParallel`,
minus its sharded tables (`shadowgba.integrations.torchrec.dense_named_parameters`).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shadowgba.errors import SetupError
from sync_algos.base import FlaggedAllReduce, Reduced


def trainable_named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Every parameter of `model` that requires grad (nothing trains the others, so nothing syncs them)."""
    for name, param in model.named_parameters():
        if param.requires_grad:
            yield name, param


class DenseParams:
    """The dense parameters viewed as one flat vector (all must share dtype and device)."""

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]]) -> None:
        if not named:
            raise SetupError("no dense parameters to synchronize (are all parameters sharded or frozen?)")
        self.names = [name for name, _ in named]
        self.params = [param for _, param in named]
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) > 1:
            raise SetupError(
                f"dense parameters must share one dtype and device to be synchronized as one buffer, "
                f"found {sorted(str(k) for k in kinds)}"
            )
        self.dtype, self.device = kinds.pop()
        self.numel = sum(p.numel() for p in self.params)

    def empty(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new uninitialised flat buffer of the right size (in `dtype`, default the parameters')."""
        return torch.empty(self.numel, dtype=dtype or self.dtype, device=self.device)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [piece.view_as(p) for piece, p in zip(flat.split([p.numel() for p in self.params]), self.params)]

    def copy_to(self, flat: torch.Tensor) -> None:
        """flat <- w."""
        for view, param in zip(self._views(flat), self.params):
            view.copy_(param.data)

    def copy_from(self, flat: torch.Tensor, start: int = 0) -> None:
        """w <- flat; with `start`, only `w[start : start + len(flat)] <- flat` (one shard's slice,
        installed without assembling the whole vector first)."""
        end, offset = start + flat.numel(), 0
        for param in self.params:
            low, high = max(start, offset), min(end, offset + param.numel())
            if low < high:
                param.data.view(-1)[low - offset:high - offset].copy_(flat[low - start:high - start])
            offset += param.numel()

    def copy_grads_to(self, flat: torch.Tensor) -> None:
        """flat <- dL/dw (zeros where a parameter has no gradient)."""
        for view, param in zip(self._views(flat), self.params):
            if param.grad is None:
                view.zero_()
            else:
                view.copy_(param.grad)

    def average_(self, group: dist.ProcessGroup | None, flat: torch.Tensor | None = None,
                 allreduce: FlaggedAllReduce | None = None, heal: bool = False) -> Reduced:
        """w <- mean of the finite w over the ranks of `group` (blocking collective).

        The rounds' rule (`sync_algos.base`): a rank whose w holds NaN / Inf contributes nothing
        and, with `heal` (`Reduced.heals`), takes the others' mean too, else keeps its own w; the
        others average without it. Returns the collective's `Reduced` (`nonfinite_ranks`: group
        ranks, the same on every rank), for the caller to warn about or fail on. `flat` (a flat
        buffer) and `allreduce` (one over `group`): a runtime's own, reused rather than allocated anew."""
        flat = self.empty() if flat is None else flat
        self.copy_to(flat)
        allreduce = FlaggedAllReduce(group, flat) if allreduce is None else allreduce
        reduced = allreduce.sum(flat, stop=False, exact=True)  # the replicas meet in full precision
        if reduced.own_counted or (heal and reduced.heals):
            self.copy_from(reduced.mean_())
        return reduced

    def add_(self, flat_delta: torch.Tensor) -> None:
        """w <- w + delta."""
        for view, param in zip(self._views(flat_delta), self.params):
            param.data.add_(view)

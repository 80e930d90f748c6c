"""The check of `dense_sync(..., local_batch_size=n)` against the batch the model is actually given.

GBA's global batch is trainers x `local_batch_size` (the shards apply an update once that many samples
have been pushed), and PS-hosted tables under GBA use the same number, so a wrong value changes the
training without any error. The library never sees the user's batches, only the model's forward:
`check_first_batch` reads the batch size of the first forward's input and logs a warning when it
differs. Only the first forward is read (one look, then the hook removes itself): a smaller last
batch of an epoch is normal, and a per-step check would cost every step.

The batch size of an input, by the first rule that applies to the forward's first argument:
- a tensor: its first dimension;
- TorchRec's `KeyedJaggedTensor` (anything with a `stride()` method): `stride()`;
- an object whose fields hold tensors (TorchRec's `Batch`: dense_features, sparse_features, labels):
  the first such tensor's first dimension.
Anything else is not checked.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

logger = logging.getLogger("shadowgba")


def batch_size_of(inputs: Any) -> int | None:
    """The number of samples in a forward's first argument, or None if it cannot be told (module docstring)."""
    if isinstance(inputs, torch.Tensor):
        return int(inputs.shape[0]) if inputs.dim() > 0 else None
    stride = getattr(inputs, "stride", None)
    if callable(stride):
        return int(stride())
    fields = getattr(inputs, "__dict__", None)
    if isinstance(fields, dict):
        first = next((value for value in fields.values() if isinstance(value, torch.Tensor) and value.dim() > 0), None)
        return int(first.shape[0]) if first is not None else None
    return None


def check_first_batch(model: nn.Module, local_batch_size: int) -> RemovableHandle:
    """Warn once if the first batch `model` is run on holds other than `local_batch_size` samples."""
    handle: RemovableHandle | None = None

    def check(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        handle.remove()
        inputs = args[0] if args else next(iter(kwargs.values()), None)
        seen = batch_size_of(inputs)
        if seen is not None and seen != local_batch_size:
            logger.warning(
                "shadowgba: dense_sync(local_batch_size=%d), but the first batch this trainer's model ran on holds "
                "%d samples; GBA's global batch is trainers x local_batch_size: pass the samples per trainer step",
                local_batch_size, seen,
            )

    handle = model.register_forward_pre_hook(check, with_kwargs=True)
    return handle

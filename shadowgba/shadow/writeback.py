"""How a round's snapshot leaves, and its result reaches, the live dense parameters.

The delta rule `w <- w + (t - s)` keeps the local progress made while a round was in flight. Where
it is applied matters (docs/design.md, "Write-back"): an in-place write while the training thread sits between
forward and backward breaks autograd ("... modified by an inplace operation"). Two strategies:

- `HandoffWriteBack` (default): the shadow thread never touches the parameters. It asks for a
  snapshot and posts deltas; the training thread serves both at its step boundary (after
  `optimizer.step()`), when no autograd graph holds the weights. Exact: every snapshot contains every
  delta posted before it was asked for, because a boundary applies pending deltas first.
- `DirectWriteBack`: the caller reads and writes `.data` itself. From the shadow thread this is
  Hogwild (lock-free, racy, no version-counter bump so no autograd error); from the training
  thread at a step boundary (foreground mode) it is exact.

Writes go through `.data` so that Hogwild training threads, whose module replicas share storage,
never see a version-counter bump on the tensors their graphs saved.
"""

from __future__ import annotations

import abc
import threading
from typing import Any, Callable

import torch

from shadowgba.dense import DenseParams


def wait_for_device(device: torch.device) -> None:
    """Make work queued on this thread's current CUDA stream visible to other streams and threads."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def write(params: DenseParams | Any, flat: torch.Tensor, replace: bool) -> None:
    """`params <- flat` when `replace`, else `params += flat`."""
    if replace:
        params.copy_from(flat)
    else:
        params.add_(flat)


class WriteBack(abc.ABC):
    """Moves snapshots out of and deltas into the live parameters (`params`: anything with
    `copy_to`, `add_` and `copy_from` of a flat buffer: `DenseParams`, `TableFragments`).
    `on_applied(replaced)` runs where a delta (False) or a replacement (True) reached them."""

    def __init__(self, params: DenseParams | Any, on_applied: Callable[[bool], None]) -> None:
        self.params = params
        self._on_applied = on_applied

    @abc.abstractmethod
    def snapshot(self, out: torch.Tensor) -> bool:
        """Fill `out` with a snapshot `s` of the live parameters (may wait for a step boundary);
        False when `cancel()` ended the wait first (`out` is then not a snapshot)."""

    @abc.abstractmethod
    def apply(self, delta: torch.Tensor, replace: bool = False) -> None:
        """Bring `delta = t - s` into the live parameters (now, or at the next step boundary); with
        `replace`, `delta` is `t` itself and replaces them (a healed replica: its own held NaN / Inf,
        and so does any progress made since its snapshot).

        `delta` stays the caller's buffer, unchanged until the next `snapshot()` returns (which
        applies it first): the runtime reuses one buffer for snapshot and delta."""

    def on_step_boundary(self) -> None:
        """Called by a training thread after each optimizer step; serves pending requests."""

    def cancel(self) -> None:
        """No step boundary will come any more (the rank is aborting): end any wait for one."""


class DirectWriteBack(WriteBack):
    """Read and write the parameters immediately, from whichever thread calls."""

    def snapshot(self, out: torch.Tensor) -> bool:
        self.params.copy_to(out)
        return True

    def apply(self, delta: torch.Tensor, replace: bool = False) -> None:
        write(self.params, delta, replace)
        self._on_applied(replace)


class HandoffWriteBack(WriteBack):
    """The shadow thread posts requests; a training thread serves them at its step boundary."""

    def __init__(self, params: DenseParams, on_applied: Callable[[], None]) -> None:
        super().__init__(params, on_applied)
        self._lock = threading.Lock()
        self._pending_delta: torch.Tensor | None = None
        self._pending_replaces = False
        self._snapshot_request: torch.Tensor | None = None
        self._snapshot_served = threading.Event()
        self._cancelled = False

    def snapshot(self, out: torch.Tensor) -> bool:
        with self._lock:
            if self._cancelled:
                return False
            self._snapshot_request = out
            self._snapshot_served.clear()
        self._snapshot_served.wait()
        with self._lock:
            return self._snapshot_request is None  # served, not cancelled

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            self._snapshot_served.set()

    def apply(self, delta: torch.Tensor, replace: bool = False) -> None:
        wait_for_device(self.params.device)
        with self._lock:
            if self._pending_delta is not None:
                raise RuntimeError("a delta is still pending: snapshot() must come between two apply() calls")
            self._pending_delta, self._pending_replaces = delta, replace

    def on_step_boundary(self) -> None:
        with self._lock:
            if self._pending_delta is not None:
                write(self.params, self._pending_delta, self._pending_replaces)
                self._pending_delta = None
                self._on_applied(self._pending_replaces)
            if self._snapshot_request is not None:
                self.params.copy_to(self._snapshot_request)
                wait_for_device(self.params.device)
                self._snapshot_request = None
                self._snapshot_served.set()

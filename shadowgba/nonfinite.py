"""One trainer's guard against NaN / Inf: values caught on the rank that computed them, before they
leave it, and its steps skipped, or the job ended, naming that rank.

The rounds, all-reduces and pushes of the dense parameters keep a bad contribution out of every
peer (`sync_algos.base`, `shadowgba.gba`), but other values leave a trainer too: the gradient of its
pooled embeddings, which TorchRec's backward all-to-all sends to the ranks that own the table shards
(where the fused optimizer applies it inside backward, before any step), and the row gradients a
trainer pushes to PS-hosted tables. One rank whose weights or batch turn non-finite would otherwise
poison every rank's tables, and from them every replica. So whatever sends such a value asks the
guard first, on the rank that computed it:

    guard.clean(gradient, "embedding gradients of t0, t1")  # the tensor, or zeros of its shape
    guard.check(rows, "row gradients of PS tables")          # whether it is finite

Both record what was not finite for the current step (`caught`); a collective still runs (`clean`
sends zeros, so no peer waits and none receives NaN). At the step boundary the runtime leaves this
trainer's update out of the step (its weights stay as they were; `ShadowSync` skips the optimizer,
`GBASync` leaves its gradient out of the all-reduce or push) and calls `end_step()`, which applies
`sync.on_nonfinite`: `fail` raises `SyncError` naming this trainer and what was caught, at the step
where it began; `skip` counts the step (`skipped_steps`) and warns once per run of bad steps, and
ends the job with `SyncError` once `max_skipped_steps` steps in a row were skipped: a trainer whose
every step is skipped trains nothing, and saying so beats a job that ends "well" with a dead model.

The guard is the runtime's (one per trainer) and holds no tensor. Its step record is plain
attributes, not thread-local: TorchRec's backward may run on autograd's device threads. Hogwild
training threads of one trainer therefore share it (a value caught in one thread's step also skips
the sibling step that ends next), which errs on the safe side.
"""

from __future__ import annotations

import logging
import threading
from typing import Iterable, Mapping

import torch

from shadowgba.errors import ConfigError, SyncError
from sync_algos.base import all_finite, is_finite

logger = logging.getLogger("shadowgba")

ON_NONFINITE = ("skip", "fail")
"""The values of `sync.on_nonfinite`."""
DEFAULT_ON_NONFINITE = "skip"
"""What NaN / Inf does unless the config says otherwise, wherever it is found: left out and counted."""


def check_on_nonfinite(policy: str) -> str:
    """`policy` if it is one of `ON_NONFINITE`, else `ConfigError`."""
    if policy not in ON_NONFINITE:
        raise ConfigError(f"sync.on_nonfinite must be one of {list(ON_NONFINITE)}, got {policy!r}")
    return policy


def nonfinite_failure(policy: str, what: str) -> str | None:
    """The one non-finite rule, applied wherever NaN / Inf is found (a trainer's step, a round's
    flags, a GBA step, a dense or table shard's push): under `fail`, the job's failure, `what` as
    every rank and server reports it; under `skip`, None: the caller leaves the value out and counts it."""
    return f"{what} (sync.on_nonfinite: fail)" if check_on_nonfinite(policy) == "fail" else None


class NonFiniteGuard:
    """Catches NaN / Inf on this trainer before it leaves, and applies `sync.on_nonfinite` to its steps."""

    def __init__(self, name: str, on_nonfinite: str = DEFAULT_ON_NONFINITE, max_skipped_steps: int = 100) -> None:
        """`name` says which trainer this is in every message ("trainer 1 (rank 1)"); `on_nonfinite`
        and `max_skipped_steps` are `sync.on_nonfinite` and `sync.max_skipped_steps`."""
        check_on_nonfinite(on_nonfinite)
        if isinstance(max_skipped_steps, bool) or not isinstance(max_skipped_steps, int) or max_skipped_steps < 1:
            raise ConfigError(f"max_skipped_steps must be an integer >= 1, got {max_skipped_steps!r}")
        self.name = name
        self.on_nonfinite = on_nonfinite
        self.max_skipped_steps = max_skipped_steps
        self.enabled = True
        """False once the runtime that owns the guard has ended: hooks left on a model then do nothing."""
        self.steps = 0
        """Steps ended so far (`end_step`)."""
        self.skipped_steps = 0
        """Steps of this trainer skipped because something in them was not finite (skip)."""
        self.streak = 0
        """Skipped steps in a row, up to the last one ended."""
        self._caught: list[str] = []
        self._lock = threading.Lock()

    @property
    def caught(self) -> str | None:
        """What was not finite in the current step ("embedding gradients of t0; dense gradients"), or None."""
        with self._lock:
            return "; ".join(self._caught) or None

    def check(self, tensor: torch.Tensor, what: str) -> bool:
        """Whether `tensor` is finite (`sync_algos.base.is_finite`); if not, `what` is recorded for this step."""
        finite = is_finite(tensor)
        if not finite:
            self.note(what)
        return finite

    def check_all(self, tensors: Iterable[torch.Tensor], what: str) -> bool:
        """`check` over several tensors (a model's gradients), recording `what` once."""
        finite = all_finite(tensors)
        if not finite:
            self.note(what)
        return finite

    def clean(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """`tensor` when finite; else `what` is recorded and zeros of its shape go in its place: what a
        collective that must still run (every peer takes part in it) sends instead."""
        if not self.enabled or self.check(tensor, what):
            return tensor
        return torch.zeros_like(tensor)

    def note(self, what: str) -> None:
        """Record that `what` was not finite in this step (a check made elsewhere)."""
        with self._lock:
            if what not in self._caught:
                self._caught.append(what)

    @property
    def step_finite(self) -> bool:
        """Nothing non-finite was caught in the current step so far."""
        with self._lock:
            return not self._caught

    def discard_step(self) -> None:
        """Forget what was caught in the current step without judging it: the runtime has raised for
        that step itself (its own `on_nonfinite: fail` error, naming this trainer)."""
        with self._lock:
            self._caught = []

    def end_step(self) -> bool:
        """End this trainer's step: True when it was clean. Else, under `fail`, raise `SyncError`
        naming this trainer and what was caught; under `skip`, count it (the caller has left its
        update out), warn at the first of a run of bad steps, and raise `SyncError` once
        `max_skipped_steps` steps in a row were skipped."""
        with self._lock:
            caught, self._caught = "; ".join(self._caught), []
            self.steps += 1
            if not caught:
                self.streak = 0
                return True
            if self.on_nonfinite == "skip":
                self.skipped_steps += 1
                self.streak += 1
        where = f"{self.name}: NaN / Inf in its {caught} at its step {self.steps}"
        failure = nonfinite_failure(self.on_nonfinite, f"{where}; caught before any of it left this trainer")
        if failure is not None:
            raise SyncError(failure)
        if self.streak >= self.max_skipped_steps:
            raise SyncError(f"{where}: {self.streak} of its steps in a row skipped, so it trains nothing "
                            f"(sync.max_skipped_steps: {self.max_skipped_steps}; its weights or data are probably "
                            "broken for good)")
        if self.streak == 1:
            logger.warning("shadowgba: %s; its update is skipped and no peer or server receives any of it "
                           "(sync.on_nonfinite: skip)", where)
        return False


def gradients(optimizer: object) -> list[torch.Tensor]:
    """The gradients a step of `optimizer` would apply: every `.grad` of its parameter groups (a torch
    optimizer, or TorchRec's keyed / combined one; tables whose optimizer runs in backward have none)."""
    return [param.grad for group in getattr(optimizer, "param_groups", ()) for param in group["params"]
            if isinstance(param, torch.Tensor) and param.grad is not None]


def restart_state(optimizer: object, params: Iterable[torch.Tensor]) -> int:
    """Drop `optimizer`'s state for `params` (momentum, Adam's moments and step ...), so that its next
    step builds it anew, as for a parameter it never stepped; returns for how many parameters it
    held any. What a healed replica (its weights replaced by the healthy replicas' consensus) does
    to its own optimizer: that state comes from the steps that diverged, and finite is not sound.
    Momentum or moments of 1e18 left by a burst of huge gradients (a skipped step never reaches the
    state, but a step whose finite gradients exploded it does) would throw the healed weights 1e17
    away at the next step (SGD's momentum), which the next round would bring to every replica, or
    step against the gradient for thousands of steps (Adam's moments). The healthy replicas' state
    is not at hand (the rounds move weights only), so the healed replica restarts its optimizer:
    its next step is the one a new optimizer takes from the healed weights. Works on any optimizer
    whose `state` maps parameters to dicts and that builds a parameter's state at its first step,
    as torch's do (TorchRec's keyed and combined optimizers hand out the same dicts, emptied in place)."""
    wanted = {id(param) for param in params}
    state = getattr(optimizer, "state", None)
    if not isinstance(state, Mapping):
        return 0
    restarted = 0
    for param, values in state.items():
        if id(param) in wanted and isinstance(values, dict) and values:
            values.clear()
            restarted += 1
    return restarted

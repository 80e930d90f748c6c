"""The dense shards' protocol, trainer side: the messages a push, pull or watch carries, and
`DenseShardClient`, one typed method per `DenseShard` method (`shadowgba.gba.server`, whose
docstring states the invariants: one decision per push taken by shard 0, voids for a departed
trainer's decisions, one published copy of the parameters per global step)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import torch

from shadowgba.flat_optimizer import (
    OptimizerSpec,
    concat_exports,
    shard_bounds,
    slice_export,
)
from shadowgba.gba.config import GBAConfig
from shadowgba.nonfinite import DEFAULT_ON_NONFINITE
from shadowgba.ps.trainer_end import TrainerTransport
from sync_algos.gba import Admission

DENSE_SERVICE = "dense"
"""The transport service name the dense shards are served under."""
SERVING_POLL_S = 0.05
"""How often a trainer joining an elastic job asks whether the shards serve yet."""
SNAPSHOT_TIMEOUT_S = 30.0
"""Longest `DenseShardClient.snapshot` retries for a cut in which every shard is at the same k."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """Shard 0's decision about one kept push, which every other shard applies in `seq` order."""

    seq: int
    """How many kept pushes shard 0 decided before this one since it was configured."""
    admission: Admission
    """GBA's rule's verdict (staleness, weight, whether it completes a global batch)."""


@dataclasses.dataclass(frozen=True)
class Void:
    """A kept decision of a trainer that departed: the other shards count its samples without its gradient."""

    seq: int
    admission: Admission
    num_samples: int


@dataclasses.dataclass(frozen=True)
class PushRequest:
    """One trainer's gradient for one shard's slice: what `DenseShard.push` takes."""

    trainer: int
    """Index of the pushing trainer (its compute time and push count are kept per trainer)."""
    start: int
    end: int
    """The slice [start, end) of the flat dense vector the gradient is for (must be the shard's)."""
    gradient: torch.Tensor
    """The trainer's mean gradient over its local batch, for that slice."""
    token: int
    """The global step the trainer's parameters came from (the oldest of its slices'; the same for
    every shard of one push: staleness = k - token, decided by shard 0)."""
    num_samples: int
    """Samples the gradient was computed on (its weight in the global batch): an integer >= 1."""
    compute_s: float
    """The trainer's last compute time, seen by the shard's switch policy."""
    finite: bool = True
    """The trainer's check of its whole gradient (every shard's slice): False keeps it out of all."""
    decision: Decision | None = None
    """None for shard 0, which decides; shard 0's decision for every other shard."""
    reply_params: bool = True
    """Whether the reply should carry the shard's parameters when k has passed `token`; False
    when the trainer's watcher brings them (module docstring)."""
    voided: tuple["Void", ...] = ()
    """For the other shards: shard 0's voids (`ShardReply.voided`), taken before the decision."""

    def check_for(self, start: int, end: int, num_trainers: int, dtype: torch.dtype, shape: torch.Size) -> None:
        """Refuse (ValueError) a push the shard of slice [start, end) cannot apply: another slice, an
        unknown trainer, a gradient of another dtype or shape, a bad sample count or decision (the
        aggregator checks the token)."""
        prefix = f"push refused by dense shard [{start}, {end})"
        if (self.start, self.end) != (start, end):
            raise ValueError(f"{prefix}: unknown parameter slice [{self.start}, {self.end})")
        if not 0 <= self.trainer < num_trainers:
            raise ValueError(f"{prefix}: unknown trainer {self.trainer} (have {num_trainers})")
        gradient, num_samples = self.gradient, self.num_samples
        if not isinstance(gradient, torch.Tensor):
            raise ValueError(f"{prefix}: gradient must be a tensor, got {type(gradient).__name__}")
        if gradient.dtype != dtype:
            raise ValueError(f"{prefix}: gradient dtype {gradient.dtype}, expected {dtype} "
                             "(sync.gba.push_dtype must be the same on every trainer and shard)")
        if gradient.shape != shape:
            raise ValueError(f"{prefix}: gradient shape {tuple(gradient.shape)}, expected {tuple(shape)}")
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"{prefix}: num_samples must be an integer >= 1, got {num_samples!r}")
        if self.decision is not None and not isinstance(self.decision, Decision):
            raise ValueError(f"{prefix}: decision must be shard 0's Decision, got {type(self.decision).__name__}")


@dataclasses.dataclass(frozen=True)
class ShardReply:
    """What a push, pull or watch returns."""

    params: torch.Tensor | None
    """The shard's parameters at `token`, or None when the caller already holds them (module
    docstring: a push without `reply_params`, or a watch that timed out)."""
    token: int
    requested_mode: str | None
    weight: float = 1.0
    """Decay weight the pushed gradient got (0: dropped); 1 for pulls."""
    decision: Decision | None = None
    """Shard 0's reply to a kept push: the decision the other shards must follow."""
    voided: tuple["Void", ...] = ()
    """Shard 0's reply to any push: departed trainers' decisions the other shards may never receive
    (module docstring), handed to them with the push's parts (or its pulls, when it was dropped)."""


class DenseShardClient:
    """The trainer side of the dense shards: one typed method per `DenseShard` method.

    The flat dense vector of `numel` elements is split over `num_shards` shards by `shard_bounds`
    (shard i on server i). Each method calls every shard that has a part in it, in parallel, and
    returns the replies in shard order; a shard's exception is raised here with its own type and
    message (`TrainerTransport.call_async`). A push goes to shard 0 first, which decides it for all
    (module docstring). Switch and close requests go to shard 0 alone: one place decides them,
    under one lock (`DenseShard.begin_close`). With no shards (a job without servers)
    the client is empty and every fan-out returns nothing.
    """

    def __init__(self, numel: int, transport: TrainerTransport | None) -> None:
        self.transport = transport
        """The trainer's transport to the shards' servers; None in a job without servers."""
        num_shards = transport.roles.num_servers if transport is not None else 0
        self.bounds: list[tuple[int, int]] = shard_bounds(numel, num_shards) if num_shards else []
        """The [start, end) slice of each shard, in shard order."""

    def configure(self, num_trainers: int, spec: OptimizerSpec, exported: dict[str, Any], config: GBAConfig,
                  global_batch: int, on_nonfinite: str = DEFAULT_ON_NONFINITE, if_idle: bool = False) -> None:
        """Load a whole-vector optimizer `export()`, sliced, into the shards (they start serving GBA),
        every shard at the export's global step; `if_idle`: only the shards not serving yet."""
        self._fan_out("configure", [
            (start, end, num_trainers, spec, slice_export(exported, start, end), config, global_batch, index,
             on_nonfinite, if_idle)
            for index, (start, end) in enumerate(self.bounds)
        ])

    def await_serving(self, timeout_s: float) -> None:
        """Wait until every shard serves GBA (configured by another trainer); `TimeoutError` after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not all(self._fan_out("serving")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the dense shards were not configured within {timeout_s:g} s (trainer 0 "
                                   "configures them when it starts)")
            time.sleep(SERVING_POLL_S)

    def push(self, trainer: int, gradient: torch.Tensor, token: int, num_samples: int, compute_s: float,
             finite: bool = True, reply_params: bool = True) -> list[ShardReply]:
        """Push the whole-vector `gradient`, computed on parameters of global step `token`: shard 0
        decides, then every other shard gets its slice with that decision (in parallel). A push
        shard 0 dropped goes no further: the other shards' replies are then pulls, carrying shard
        0's weight (0: no shard applied it). `reply_params`
        False: the replies carry tokens only (the trainer's watcher brings new parameters)."""
        (start, end), *others = self.bounds
        first = self._shard0("push", PushRequest(trainer, start, end, gradient[start:end], token, num_samples,
                                                 compute_s, finite, reply_params=reply_params))
        if not others:
            return [first]
        if first.decision is None:  # the others only answer with their parameters, at shard 0's weight (dropped)
            pulled = self._fan_out("pull", [(reply_params, first.voided)] * len(others), first_shard=1)
            return [first, *(dataclasses.replace(reply, weight=first.weight) for reply in pulled)]
        return [first, *self._fan_out("push", [
            (PushRequest(trainer, start, end, gradient[start:end], token, num_samples, compute_s, True,
                         first.decision, reply_params, first.voided),)
            for start, end in others
        ], first_shard=1)]

    def pull(self) -> list[ShardReply]:
        """Every shard's parameters and token, now."""
        return self._fan_out("pull")

    def watch(self, tokens: list[int], timeout_s: float) -> list[ShardReply | None]:
        """Long-poll each shard for a global step past its token (`DenseShard.watch`)."""
        return self._fan_out("watch", [(token, timeout_s) for token in tokens])

    def export(self) -> dict[str, Any]:
        """Take the shards' optimizer state back as one whole-vector export; the shards go idle."""
        self.settle()
        return concat_exports(self._fan_out("export"))

    def snapshot(self, timeout_s: float = SNAPSHOT_TIMEOUT_S) -> dict[str, Any]:
        """The shards' state as one whole-vector export while they keep serving: retried until every
        shard is at the same global step (a push's parts can be on their way between shards)."""
        deadline = time.monotonic() + timeout_s
        while True:
            parts = self._fan_out("snapshot")
            steps = sorted({part["global_step"] for part in parts})
            if len(steps) == 1:
                return concat_exports(parts)
            self.settle()
            if time.monotonic() > deadline:
                raise TimeoutError(f"dense shards stayed at different global steps {steps} for {timeout_s}s")
            time.sleep(0.002)

    def settle(self) -> None:
        """Hand the other shards the voids of departed trainers' decisions (with a pull): what
        closes a gap in their order when no later decision carries the voids (the end of a job)."""
        if len(self.bounds) > 1:
            voided = self._shard0("voided")
            if voided:
                self._fan_out("pull", [(False, voided)] * (len(self.bounds) - 1), first_shard=1)

    def begin_close(self) -> bool:
        """Ask shard 0 to close in GBA mode (`DenseShard.begin_close`): False while a switch is pending."""
        return self._shard0("begin_close")

    def fail(self, reason: str) -> None:
        """Tell shard 0 this trainer's job failed: its server refuses every later call with `reason`,
        naming this trainer's rank (none for a client without a transport)."""
        self._shard0("fail", reason, [] if self.transport is None else [self.transport.roles.rank])

    def request_mode(self, mode: str) -> bool:
        """Ask shard 0 to carry a switch to `mode` to every trainer; False once a trainer is closing."""
        return self._shard0("request_mode", mode)

    def stats(self) -> list[dict[str, Any]]:
        """Each shard's `DenseShard.stats()`."""
        return self._fan_out("stats")

    def _fan_out(self, method: str, args_by_shard: Sequence[tuple[Any, ...]] | None = None,
                 first_shard: int = 0) -> list[Any]:
        """Call `method` on shard `first_shard + i` with `args_by_shard[i]` (default: no arguments),
        on every shard from `first_shard` on, all at once; the results in shard order."""
        if args_by_shard is None:
            args_by_shard = [()] * (len(self.bounds) - first_shard)
        if not args_by_shard:  # a job without servers
            return []
        return self._require_transport().call_each(DENSE_SERVICE, method, args_by_shard, first_shard)

    def _shard0(self, method: str, *args: Any) -> Any:
        """`method(*args)` on shard 0, which decides pushes, switches and closing for all."""
        return self._require_transport().call(0, DENSE_SERVICE, method, *args)

    def _require_transport(self) -> TrainerTransport:
        if self.transport is None:
            raise RuntimeError("the dense shards need the job's transport to its servers (job.transport)")
        return self.transport

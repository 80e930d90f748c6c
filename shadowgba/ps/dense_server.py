"""One parameter-server rank's slice of the dense parameters under GBA.

The flat dense vector is split into contiguous slices (`shard_bounds`), one per PS rank. Each
`DenseShard` owns its slice, the one authoritative optimizer over it (`FlatOptimizer`), its global
step k and the GBA buffer (`sync_algos.gba.GlobalBatchAggregator`). Trainers push a gradient slice
with the token they pulled; the reply carries fresh parameters and token, so a push is also a pull.

Invariants:
- One lock guards everything; RPC threads call concurrently. Memory is bounded: one parameter
  slice, its optimizer state and one buffer of the same size, whatever the number of trainers.
- A malformed push (wrong shape or dtype, a slice this shard does not own, a token from the future,
  no samples) is refused with a `ValueError` *before* anything changes.
- Each shard advances k on its own; a trainer keeps one token per shard. With equal-speed
  trainers and no staleness every shard steps on the same gradients, which is sync training.
- The shard also relays mode switches: a request (API or policy) is stored here and carried in
  every reply until the trainers have switched.
- `watch(token)` is a long poll: it answers once k has passed `token` (or after a timeout), so a
  trainer's watcher thread holds the newest parameters without polling. At most `WATCHERS` calls
  wait at once, each holding one of the server's RPC threads for at most its timeout; further
  ones are answered at once, so watches can never starve pushes of threads.

Trainers never name the service's methods as strings: `DenseShardClient` (below) has one typed
method per `DenseShard` method, fans it out over every shard in parallel and returns the shards'
replies in shard order. `serve_dense_shard()` is the server rank's side of the same service name.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any, Sequence

import torch

from shadowgba.flat_optimizer import FlatOptimizer, OptimizerSpec, concat_exports, shard_bounds, slice_export
from shadowgba.gba.config import GBAConfig
from shadowgba.gba.switch_policy import SwitchPolicy
from shadowgba.ps import transport
from sync_algos.gba import GlobalBatchAggregator
from sync_algos.staleness import StalenessCounts

WATCHERS = 8
"""At most this many `watch` calls wait on one shard at the same time (TensorPipe serves with 16
RPC threads by default); the rest are answered at once."""
WATCH_MAX_S = 1.0
"""Longest one `watch` call may wait, whatever timeout it asks for."""
DENSE_SERVICE = "dense"
"""The transport service name the dense shards are served under."""


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
    """The shard's global step the trainer's parameters came from (staleness = k - token)."""
    num_samples: int
    """Samples the gradient was computed on (its weight in the global batch)."""
    compute_s: float
    """The trainer's last compute time, seen by the shard's switch policy."""


@dataclasses.dataclass(frozen=True)
class ShardReply:
    """What a push or pull returns."""

    params: torch.Tensor
    token: int
    requested_mode: str | None
    weight: float = 1.0
    """Decay weight the pushed gradient got (0: dropped); 1 for pulls."""


class DenseShard:
    """A thread-safe GBA server for the flat slice [start, end) of the dense parameters."""

    def __init__(self) -> None:
        """Empty until a trainer `configure`s it: a server rank does not know the model."""
        self.start = self.end = self.num_trainers = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        """Notified when k advances or the shard stops serving GBA (wakes `watch`)."""
        self._watchers = 0
        self._optimizer: FlatOptimizer | None = None
        self._aggregator: GlobalBatchAggregator | None = None
        self._policy: SwitchPolicy | None = None
        self._requested_mode: str | None = None
        self._closing = False
        self._compute_s: list[float] = []
        self._dropped_samples_at_switch = 0
        self._in_flight = 0
        self._max_in_flight = 0
        self._staleness = StalenessCounts()
        self._pushes_by_trainer = collections.Counter()
        self._pushes = 0
        self._steps_at_configure = 0
        self._configured_at = time.monotonic()

    # -------------------------------------------------------------------------------- mode changes
    def configure(self, start: int, end: int, num_trainers: int, spec: OptimizerSpec, exported: dict[str, Any],
                  config: GBAConfig, global_batch: int) -> None:
        """Own slice [start, end): take over its parameters, optimizer state and global step
        (at start, or at a switch to GBA)."""
        numel = end - start
        if exported["param"].shape != (numel,):
            raise ValueError(f"shard [{start}, {end}) cannot load {tuple(exported['param'].shape)} values")
        optimizer = FlatOptimizer(spec, exported["param"])
        optimizer.load(exported)
        aggregator = GlobalBatchAggregator(config, numel, exported["param"].dtype, global_batch)
        aggregator.global_step = optimizer.global_step
        with self._lock:
            self.start, self.end, self.num_trainers = start, end, num_trainers
            self._compute_s = [0.0] * num_trainers
            self._optimizer, self._aggregator = optimizer, aggregator
            self._policy = SwitchPolicy(config.switch_policy)
            self._requested_mode = None
            self._closing = False
            self._steps_at_configure = optimizer.global_step
            self._configured_at = time.monotonic()
            self._changed.notify_all()

    def export(self) -> dict[str, Any]:
        """Hand parameters, optimizer state and k back (switch to sync); the shard goes idle.

        A partly filled global batch is discarded (counted in `dropped_samples_at_switch`): its
        gradients belong to no step the synchronous side will take.
        """
        with self._lock:
            optimizer, aggregator = self._require_configured()
            self._dropped_samples_at_switch = aggregator.discard()
            exported = optimizer.export()
            self._optimizer = self._aggregator = None
            self._changed.notify_all()
            return exported

    def request_mode(self, mode: str) -> bool:
        """Ask every trainer to switch to `mode`, carried in replies until they do. Refused (False)
        once a trainer has begun closing: a switch then could not be completed by every trainer."""
        if mode not in ("sync", "gba"):
            raise ValueError(f"unknown mode '{mode}'; allowed: ['gba', 'sync']")
        with self._lock:
            if self._closing:
                return False
            self._requested_mode = mode
            return True

    def begin_close(self) -> bool:
        """A trainer wants to finish in GBA mode. True: no switch can start from now on. False: a
        switch is pending, and the trainer must take part in it before it closes.

        Deciding both under one lock is what keeps trainers from pairing a close barrier with a
        switch barrier."""
        with self._lock:
            if self._requested_mode is not None:
                return False
            self._closing = True
            return True

    # ----------------------------------------------------------------------------- push and pull
    def pull(self) -> ShardReply:
        with self._lock:
            self._require_configured()
            return self._reply()

    def watch(self, token: int, timeout_s: float) -> ShardReply | None:
        """Long poll: the parameters once the global step has passed `token`, or, after
        `timeout_s`, whatever the shard holds; None when the shard is not serving GBA (the trainers
        are switching to sync mode). Answered at once when `WATCHERS` calls already wait."""
        with self._changed:
            if self._watchers < WATCHERS:
                self._watchers += 1
                try:
                    self._changed.wait_for(
                        lambda: self._aggregator is None or self._aggregator.global_step > token,
                        min(max(timeout_s, 0.0), WATCH_MAX_S),
                    )
                finally:
                    self._watchers -= 1
            return None if self._aggregator is None else self._reply()

    def push(self, request: PushRequest) -> ShardReply:
        """Add one trainer's gradient slice; step the optimizer when a global batch is complete."""
        with self._lock:
            self._in_flight += 1
            self._max_in_flight = max(self._max_in_flight, self._in_flight)
        try:
            with self._lock:
                optimizer, aggregator = self._require_configured()
                self._validate(request)
                staleness, weight, mean = aggregator.add(request.gradient, request.token, request.num_samples)
                self._pushes += 1
                self._pushes_by_trainer[request.trainer] += 1
                self._staleness.add(staleness, weight)
                self._compute_s[request.trainer] = request.compute_s
                if mean is not None:
                    optimizer.step(mean)
                    self._changed.notify_all()
                    target = self._policy.observe("gba", self._compute_s)
                    if target is not None and not self._closing:
                        self._requested_mode = target
                return self._reply(weight)
        finally:
            with self._lock:
                self._in_flight -= 1

    # ---------------------------------------------------------------------------------- metrics
    def stats(self) -> dict[str, Any]:
        """Staleness histogram, decayed / dropped counts, global steps per second, queue depth."""
        with self._lock:
            global_step = self._aggregator.global_step if self._aggregator else None
            elapsed = max(time.monotonic() - self._configured_at, 1e-9)
            steps = (global_step or self._steps_at_configure) - self._steps_at_configure
            return {
                "global_step": global_step,
                "global_steps_per_s": steps / elapsed,
                "pushes": self._pushes,
                "pushes_by_trainer": dict(sorted(self._pushes_by_trainer.items())),
                **self._staleness.summary(),
                "queue_depth": self._in_flight,
                "queue_depth_max": self._max_in_flight,
                "buffered_samples": self._aggregator.buffered_samples if self._aggregator else 0,
                "dropped_samples_at_switch": self._dropped_samples_at_switch,
            }

    # --------------------------------------------------------------------------------- internals
    def _reply(self, weight: float = 1.0) -> ShardReply:
        """The shard's parameters, token and pending mode request (the lock held, configured)."""
        return ShardReply(self._optimizer.param.detach().clone(), self._aggregator.global_step, self._requested_mode, weight)

    def _require_configured(self) -> tuple[FlatOptimizer, GlobalBatchAggregator]:
        if self._optimizer is None or self._aggregator is None:
            raise RuntimeError(f"dense shard [{self.start}, {self.end}) is not serving GBA (sync mode or not configured)")
        return self._optimizer, self._aggregator

    def _validate(self, request: PushRequest) -> None:
        """Refuse (ValueError) a push this shard cannot apply; the aggregator checks the token."""
        prefix = f"push refused by dense shard [{self.start}, {self.end})"
        if (request.start, request.end) != (self.start, self.end):
            raise ValueError(f"{prefix}: unknown parameter slice [{request.start}, {request.end})")
        if not 0 <= request.trainer < self.num_trainers:
            raise ValueError(f"{prefix}: unknown trainer {request.trainer} (have {self.num_trainers})")
        gradient, num_samples = request.gradient, request.num_samples
        if not isinstance(gradient, torch.Tensor):
            raise ValueError(f"{prefix}: gradient must be a tensor, got {type(gradient).__name__}")
        param = self._optimizer.param
        if gradient.dtype != param.dtype:
            raise ValueError(f"{prefix}: gradient dtype {gradient.dtype}, expected {param.dtype}")
        if gradient.shape != param.shape:
            raise ValueError(f"{prefix}: gradient shape {tuple(gradient.shape)}, expected {tuple(param.shape)}")
        if num_samples < 1:
            raise ValueError(f"{prefix}: num_samples must be >= 1, got {num_samples}")
        if not torch.isfinite(gradient).all():
            raise ValueError(f"{prefix}: gradient has NaN or inf values")


def serve_dense_shard() -> None:
    """On a server rank: host an (unconfigured) dense shard; trainers configure it."""
    transport.serve(DENSE_SERVICE, DenseShard())


class DenseShardClient:
    """The trainer side of the dense shards: one typed method per `DenseShard` method.

    The flat dense vector of `numel` elements is split over `num_shards` shards by `shard_bounds`
    (shard i on server i). Each method calls every shard that has a part in it, in parallel, and
    returns the replies in shard order; a shard's exception is raised here with its own type and
    message (`transport.call_async`). Switch and close requests go to shard 0 alone: one place
    decides them, under one lock (`DenseShard.begin_close`). With no shards (a job without servers)
    the client is empty and every fan-out returns nothing.
    """

    def __init__(self, numel: int, num_shards: int) -> None:
        self.bounds: list[tuple[int, int]] = shard_bounds(numel, num_shards) if num_shards else []
        """The [start, end) slice of each shard, in shard order."""

    def configure(self, num_trainers: int, spec: OptimizerSpec, exported: dict[str, Any], config: GBAConfig,
                  global_batch: int) -> None:
        """Load a whole-vector optimizer `export()`, sliced, into the shards (they start serving GBA)."""
        self._fan_out("configure", [
            (start, end, num_trainers, spec, slice_export(exported, start, end), config, global_batch)
            for start, end in self.bounds
        ])

    def push(self, trainer: int, gradient: torch.Tensor, tokens: list[int], num_samples: int,
             compute_s: float) -> list[ShardReply]:
        """Push each shard its slice of the whole-vector `gradient`, with that shard's token."""
        return self._fan_out("push", [
            (PushRequest(trainer, start, end, gradient[start:end], token, num_samples, compute_s),)
            for (start, end), token in zip(self.bounds, tokens)
        ])

    def pull(self) -> list[ShardReply]:
        """Every shard's parameters and token, now."""
        return self._fan_out("pull")

    def watch(self, tokens: list[int], timeout_s: float) -> list[ShardReply | None]:
        """Long-poll each shard for a global step past its token (`DenseShard.watch`)."""
        return self._fan_out("watch", [(token, timeout_s) for token in tokens])

    def export(self) -> dict[str, Any]:
        """Take the shards' optimizer state back as one whole-vector export; the shards go idle."""
        return concat_exports(self._fan_out("export"))

    def begin_close(self) -> bool:
        """Ask shard 0 to close in GBA mode (`DenseShard.begin_close`): False while a switch is pending."""
        return transport.call(0, DENSE_SERVICE, "begin_close")

    def request_mode(self, mode: str) -> bool:
        """Ask shard 0 to carry a switch to `mode` to every trainer; False once a trainer is closing."""
        return transport.call(0, DENSE_SERVICE, "request_mode", mode)

    def stats(self) -> list[dict[str, Any]]:
        """Each shard's `DenseShard.stats()`."""
        return self._fan_out("stats")

    def _fan_out(self, method: str, args_by_shard: Sequence[tuple[Any, ...]] | None = None) -> list[Any]:
        """Call `method` on shard i with `args_by_shard[i]` (default: no arguments), all at once;
        the results in shard order."""
        if args_by_shard is None:
            args_by_shard = [()] * len(self.bounds)
        return torch.futures.wait_all([
            transport.call_async(index, DENSE_SERVICE, method, *args) for index, args in enumerate(args_by_shard)
        ])

"""`DenseSync`: the one interface every synchronization runtime implements.

Whatever `sync.algo` says (ma, easgd, bmuf in shadow or foreground mode, easgd_ps, gba in GBA,
sync all-reduce or plain async mode), the user's loop is the same:

    with shadowgba.dense_sync(model, optimizer, config.sync, job) as sync:
        for batch in batches:
            ...
            optimizer.step()        # the step boundary: the runtime's per-step work hooks in here
    print(sync.metrics.summary())

Lifecycle and the closing rule:

- `start()` (or entering the `with`) is collective over the trainers: it makes the dense replicas
  identical and starts the runtime's threads.
- `close()` is the normal end, collective over the trainers: every trainer must call it; ranks
  that finish at different steps do not hang (each runtime's stop protocol), and with
  `sync.final_sync` the replicas end identical. It raises the runtime's own failure, if any.
- Leaving the `with` block by an exception calls `abort()` instead: no final sync and no collective
  a peer might not meet; this rank's threads are stopped and joined and its groups released. The
  user's exception is what propagates; an error while aborting is logged and attached to it as a
  note, never raised in its place. A job (`shadowgba.dense_sync`) is told around it
  (`call_on_failure`): the peers and servers learn which rank failed and why, and this rank leaves
  the job without waiting for any of them. The same happens when `close()` itself raises.
- Neither leaves a thread behind, whatever raises.

`state_dict()` / `load_state_dict()` work in every mode and follow torch's `Stateful` protocol, so
a runtime composes with `torch.distributed.checkpoint`. A state that does not fit is refused with
`CheckpointError`, changing nothing.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import types
from typing import Any, Callable, ClassVar

from shadowgba.errors import ConfigError
from shadowgba.reporting import MetricsReporter

logger = logging.getLogger("shadowgba")


class DenseSync(abc.ABC):
    """Keeps one trainer's dense parameters in sync with its peers'; see the module docstring."""

    modes: ClassVar[tuple[str, ...]] = ()
    """The modes `switch_mode` accepts; empty when the algorithm has none."""

    mode: str | None = None
    """The current mode (one of `modes`), or None for an algorithm without modes."""

    metrics: Any
    """Counters of this trainer's rounds / pushes, latency, bytes and training-thread cost
    (`metrics.summary()` is a flat dict)."""

    joined_running_job: bool = False
    """True once `start()` let this trainer into a job whose other trainers were already training and
    gave it their current replica (a lost 2D replica group rejoining, `sync.replica_jobs`). A
    checkpoint this trainer saved before is older than that replica: resume only its position from
    it (step, data position, RNG streams), not its weights or optimizer state."""

    reporter: MetricsReporter | None = None
    """Where `metrics` go at an interval and at the end (`shadowgba.reporting`: the log, TensorBoard);
    `shadowgba.dense_sync` sets it. The runtime calls `_report_step()` at every step boundary and
    `_end_report()` when it closes or aborts."""

    def evaluating(self) -> contextlib.AbstractContextManager[None]:
        """Wrap an evaluation (or an export) in the middle of training, on the training thread between
        steps: inside, the model's dense parameters are the synchronized ones this trainer holds.
        Most algorithms train on those already; GBA with `sync.gba.lookahead` computes its gradients
        on a prediction of where they are going, and shows the shards' values here instead."""
        return contextlib.nullcontext()

    def __enter__(self) -> "DenseSync":
        self.start()
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: types.TracebackType | None) -> None:
        if exc is None:
            try:
                self.close()
            except BaseException as error:  # close() released this rank's part; the job is told why
                replacement = self._fail(error)
                if replacement is not None:
                    raise replacement from error
                raise
            for finish in self.__dict__.pop("_after_exit", ()):
                finish()
            return
        replacement = self._fail(exc, abort=True)
        if replacement is not None:  # a peer's failure: the user sees whose, the transport's words as its cause
            raise replacement from exc

    def call_after_exit(self, finish: Callable[[], None]) -> None:
        """Run `finish` once a `with` block over this sync has closed it normally (not after an
        exception: then peers may still wait in collectives, and only this rank's part is ended)."""
        self.__dict__.setdefault("_after_exit", []).append(finish)

    def call_on_failure(self, announce: Callable[[BaseException], BaseException | None],
                        leave: Callable[[], None]) -> None:
        """When a `with` block over this sync ends by an exception (the user's, or `close()`'s):
        `announce(error)` before this rank's sync is aborted (tell the peers, while this rank's
        groups still exist: a peer whose collective fails once they are gone finds the reason
        posted), then `leave()` after it. Neither may wait for a peer. What `announce` returns, if
        anything, is raised in place of the error, chaining it (`Job.announce_failure`: a `PeerLost`
        naming the peer that failed first)."""
        self.__dict__.setdefault("_on_failure", []).append((announce, leave))

    def _fail(self, error: BaseException, abort: bool = False) -> BaseException | None:
        """The failure path of `__exit__`: announce, abort (when `abort`), leave; returns the error to
        raise in place of `error` (`call_on_failure`), if any. Raises nothing: what goes wrong here
        is logged and attached to `error` as a note."""
        hooks = self.__dict__.pop("_on_failure", ())
        replacements = [_attach_failure(error, announce, error) for announce, _ in hooks]
        if abort:
            _attach_failure(error, self.abort)
        for _, leave in hooks:
            _attach_failure(error, leave)
        return next((replacement for replacement in replacements if replacement is not None), None)

    @abc.abstractmethod
    def start(self) -> None:
        """Collective over the trainers: identical replicas, then the runtime's threads."""

    @abc.abstractmethod
    def close(self) -> None:
        """The normal end on every trainer (collective); raises the runtime's failure, if any."""

    @abc.abstractmethod
    def abort(self) -> None:
        """End this rank's part without any collective: stop and join threads, release groups."""

    def switch_mode(self, mode: str) -> None:
        """Ask every trainer to switch to `mode` at an agreed step (algorithms with `modes`)."""
        raise ConfigError(f"{type(self).__name__} has no modes to switch; '{mode}' needs sync.algo gba")

    def _report_step(self) -> None:
        if self.reporter is not None:
            self.reporter.on_step()

    def _end_report(self) -> None:
        if self.reporter is not None:
            self.reporter.close()

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume this runtime, as tensors and plain values (Stateful)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output; refuses (`CheckpointError`) a state of another setup."""


def _attach_failure(error: BaseException, action: Callable[..., Any], *args: Any) -> Any:
    """Run a clean-up `action` after `error` and return what it returns; a failure of its own is
    logged and attached to `error` as a note, never raised in its place (the user's exception wins)."""
    try:
        return action(*args)
    except BaseException as failure:
        logger.exception("shadowgba: cleaning up after %r failed", error)
        error.add_note(f"shadowgba: while aborting the sync after this error: {failure!r}")
        return None

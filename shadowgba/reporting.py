"""Where a runtime's metrics go without user code: standard sinks, at an interval and at the end.

- Python logging: every `sync.log_interval_s` seconds one INFO line on the `shadowgba` logger
  (`metrics.format()`), so a job's log shows the sync's progress wherever its handlers write.
- TensorBoard: every counter of `metrics.summary()` as a scalar `shadowgba/<name>` against this
  trainer's step count, at the same interval and once at the end, into the `SummaryWriter` given to
  `dense_sync(summary_writer=...)` or one created in `sync.tensorboard_dir/trainer<i>` (TensorBoard
  is optional: `shadowgba[tensorboard]`).

The runtime calls `on_step()` at every step boundary (one clock read unless a report is due) and
`close()` when it closes or aborts; reports never raise into the training loop's step."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from shadowgba import optional
from shadowgba.metrics import SyncMetrics

logger = logging.getLogger("shadowgba")


def summary_writer(directory: str | Path, trainer_index: int) -> Any:
    """A TensorBoard `SummaryWriter` in `directory/trainer<trainer_index>` (`sync.tensorboard_dir`)."""
    optional.require("tensorboard", "sync.tensorboard_dir")
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(Path(directory) / f"trainer{trainer_index}"))


class MetricsReporter:
    """Sends `metrics` to the log every `interval_s` seconds (0: never) and to `writer` (anything with
    TensorBoard's `add_scalar` and `flush`) at the same interval and at `close()`; closes `writer`
    too when `owns_writer` (one it created)."""

    def __init__(self, metrics: SyncMetrics, interval_s: float, writer: Any = None, owns_writer: bool = False) -> None:
        self.metrics = metrics
        self.interval_s = interval_s
        self.writer = writer
        self._owns_writer = owns_writer
        self._due = time.monotonic() + interval_s
        self._lock = threading.Lock()
        """Held by the one thread reporting (Hogwild training threads all reach the step boundary)."""
        self._closed = False

    def on_step(self) -> None:
        """At a step boundary: report if the interval has passed since the last report."""
        if not self.interval_s or time.monotonic() < self._due or not self._lock.acquire(blocking=False):
            return
        try:
            self._due = time.monotonic() + self.interval_s
            logger.info("shadowgba: %s", self.metrics.format())
            self._write()
        except Exception:  # a sink's failure is reported, never raised into the user's optimizer.step()
            logger.exception("shadowgba: writing the metrics to %r failed", self.writer)
        finally:
            self._lock.release()

    def close(self) -> None:
        """The last values into the writer, flushed (and closed if it was created here); idempotent."""
        with self._lock:
            if self._closed or self.writer is None:
                self._closed = True
                return
            self._closed = True
            self._write()
            self.writer.flush()
            if self._owns_writer:
                self.writer.close()

    def _write(self) -> None:
        if self.writer is None:
            return
        summary = self.metrics.summary()
        for name, value in summary.items():
            self.writer.add_scalar(f"shadowgba/{name}", value, global_step=int(summary["steps"]))

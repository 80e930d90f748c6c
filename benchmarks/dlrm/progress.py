"""Progress of the training loop on trainer 0, readable wherever its output goes.

On a terminal: tqdm's bar, redrawn in place. Anywhere else (`make run > log`, CI, a cluster's log
collector) a redrawn bar is thousands of carriage-return updates in one line; `LineProgress` writes
one plain line every `every_s` seconds instead (steps, of how many, steps per second, the last loss)
and one at the end."""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO

from tqdm import tqdm

LINE_EVERY_S = 5.0
"""Seconds between two progress lines outside a terminal."""


class LineProgress:
    """tqdm's `update` / `set_postfix` / `close`, as a line every `every_s` seconds to `stream`."""

    def __init__(self, total: int | None, initial: int, stream: TextIO, every_s: float = LINE_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.steps = initial
        self.stream = stream
        self.every_s = every_s
        self.clock = clock
        self._started = self._last_line = clock()
        self._started_steps = initial
        self._postfix = ""

    def update(self, steps: int = 1) -> None:
        self.steps += steps
        if self.clock() - self._last_line >= self.every_s:
            self._line()

    def set_postfix(self, refresh: bool = False, **values: Any) -> None:
        self._postfix = " ".join(f"{name}={value}" for name, value in values.items())

    def close(self) -> None:
        self._line()

    def _line(self) -> None:
        now = self._last_line = self.clock()
        rate = (self.steps - self._started_steps) / max(now - self._started, 1e-9)
        of = f"/{self.total}" if self.total is not None else ""
        self.stream.write(f"step {self.steps}{of} ({rate:.1f} steps/s) {self._postfix}".rstrip() + "\n")
        self.stream.flush()


def progress(total: int | None, initial: int, enabled: bool, stream: TextIO | None = None) -> Any:
    """A progress display: tqdm's bar on a terminal, `LineProgress` elsewhere, nothing if not `enabled`."""
    stream = stream or sys.stderr
    if enabled and not stream.isatty():
        return LineProgress(total, initial, stream)
    return tqdm(total=total, initial=initial, unit="step", disable=not enabled, file=stream)

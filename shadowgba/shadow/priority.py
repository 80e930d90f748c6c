"""The shadow rounds' CPU priority (`RoundPriority`): low while nothing is late, the training threads'
own for a round that is.

On a CPU-bound host a round's copies and reduction come out of the steps whichever thread runs them;
at the lowest priority (niceness 19) they take only the CPU the training threads leave (while a
step waits on its data, its all-to-all, a straggler), which saved 2-4% of the steps' throughput
on loopback (docs/benchmarks.md). As a fixed setting it starved the rounds where other work keeps
the cores busy too: simulated hosts or 2D ranks sharing 2 cores made 4 rounds in 200 steps. So the
priority adapts (`sync.rounds_nice: null`, the default): every round starts low, and a round still
in flight when the floor on the round rate draws near (`shadowgba.shadow.schedule`) gets the
training threads' priority back, as does the round after it.

Going back up needs the right to lower a niceness (root with CAP_SYS_NICE, or an RLIMIT_NICE that
allows it): the start tries it on a thread of its own. Where it is refused, the rounds keep the
training threads' priority throughout (a priority that could not come back would starve them). A
fixed `sync.rounds_nice` is set once and never changed.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Iterable

from shadowgba.threads import renice

logger = logging.getLogger("shadowgba")

LOW_NICE = 19
"""The niceness of the rounds while nothing is late."""


@functools.cache
def can_raise_priority() -> bool:
    """Whether a thread of this process may get back a priority it gave up (tried once, on a thread
    that ends right after)."""
    allowed: list[bool] = []

    def attempt() -> None:
        thread = threading.get_native_id()
        try:
            normal = os.getpriority(os.PRIO_PROCESS, thread)
            if normal >= LOW_NICE:
                return
            os.setpriority(os.PRIO_PROCESS, thread, normal + 1)
            os.setpriority(os.PRIO_PROCESS, thread, normal)
            allowed.append(True)
        except (OSError, AttributeError):
            pass

    prober = threading.Thread(target=attempt, name="shadowgba-nice-probe", daemon=True)
    prober.start()
    prober.join()
    return bool(allowed)


class RoundPriority:
    """The niceness of the rounds' threads. `nice`: `sync.rounds_nice` (None: adaptive). `lower` and
    `restore` may be called from the shadow and training threads alike."""

    def __init__(self, nice: int | None) -> None:
        self.fixed = nice
        self._threads: set[int] = set()
        self._normal = 0
        self.adaptive = False
        """Whether the priority changes with the rounds' lateness (decided at `start`)."""
        self.low = False
        """Whether the rounds' threads run at `LOW_NICE` now."""
        self.restored = 0
        """Late rounds given the training threads' priority back."""
        self._lock = threading.Lock()

    def start(self, threads: Iterable[int]) -> None:
        """The rounds run on `threads` (native ids) from now on; called by the shadow thread, whose
        niceness is the training threads' (a thread starts with its creator's)."""
        self._threads = set(threads)
        if self.fixed is not None:
            if self.fixed:
                renice(self._threads, self.fixed)
            return
        self._normal = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) if hasattr(os, "getpriority") else 0
        self.adaptive = self._normal < LOW_NICE and can_raise_priority()
        if not self.adaptive:
            logger.info("shadowgba: the shadow rounds keep the training threads' priority: this process may not "
                        "raise a thread's priority again once lowered (sync.rounds_nice: null)")

    def lower(self) -> None:
        """The rounds take only the CPU the training threads leave."""
        with self._lock:
            if self.adaptive and not self.low:
                renice(self._threads, LOW_NICE)
                self.low = True

    def restore(self) -> None:
        """The rounds run at the training threads' priority (a late round)."""
        with self._lock:
            if self.adaptive and self.low:
                renice(self._threads, self._normal)
                self.low = False
                self.restored += 1

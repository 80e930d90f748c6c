"""Events from child processes that the harness may SIGKILL: one pipe per child.

A `multiprocessing.Queue` shared by several writers serializes them with one lock that a writer's
feeder thread holds while it writes. A child SIGKILLed while holding it never releases it, and every
other child's events then wait forever in their own feeder threads: the harness sees a job that
stopped, although every process goes on (a kill test that timed out about once in ten runs was
exactly this). With one pipe per child, a killed child can only lose its own events.
"""

from __future__ import annotations

import collections
import multiprocessing.connection
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any, Callable


class Events:
    """The harness's end: `start(target, args)` starts a child as `target(*args, send)`, where
    `send(event)` hands the harness one picklable event; `receive(timeout_s)` returns what arrived.
    One child's events keep their order."""

    def __init__(self, context: BaseContext) -> None:
        self._context = context
        self._readers: list[Connection] = []
        self._ready: collections.deque[Any] = collections.deque()

    def start(self, target: Callable[..., None], args: tuple[Any, ...]) -> BaseProcess:
        """Start a daemon child on a pipe of its own (its `send` blocks only while the harness does
        not read)."""
        reader, writer = self._context.Pipe(duplex=False)
        child = self._context.Process(target=target, args=(*args, writer.send), daemon=True)
        child.start()
        writer.close()  # the child holds the only writing end: its exit reads as the pipe's end
        self._readers.append(reader)
        return child

    def receive(self, timeout_s: float) -> Any | None:
        """The next event of any child, or None if none came within `timeout_s`. A child's pipe is
        dropped once the child is gone and its events are read."""
        if not self._ready:
            for reader in multiprocessing.connection.wait(self._readers, timeout_s):
                try:
                    while reader.poll():
                        self._ready.append(reader.recv())
                except (EOFError, OSError):
                    self._readers.remove(reader)
                    reader.close()
        return self._ready.popleft() if self._ready else None

"""This process's threads as the OS sees them (Linux's /proc), and their scheduling priority.

Two parts of the library lower a priority: a same-host PS channel's gloo loop thread
(`shadowgba.ps.same_host`) and the shadow rounds (`sync.rounds_nice`: the shadow thread and the
gloo threads of its process group). Where /proc or `setpriority` is unavailable, nothing is found
and nothing changes.
"""

from __future__ import annotations

import os
from typing import Iterable


def thread_ids() -> set[int]:
    """Ids of this process's threads (empty where /proc cannot tell)."""
    try:
        return {int(task) for task in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def threads_named(name: str) -> set[int]:
    """Ids of this process's threads called `name`."""
    found = set()
    for task in thread_ids():
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                if comm.read().strip() == name:
                    found.add(task)
        except OSError:  # ended meanwhile
            pass
    return found


def renice(threads: Iterable[int], nice: int) -> None:
    """Give each of `threads` the niceness `nice` (Linux: a thread id names the thread); one that
    ended, or may not be changed, keeps its priority."""
    for thread in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, thread, nice)
        except OSError:
            pass

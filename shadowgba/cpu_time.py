"""CPU time as Linux's /proc reports it: what given threads of this process ran, and how long the
cores this process may run on stood idle.

The shadow rounds' pacing (`shadowgba.shadow.round_cost`) measures with them what a round took from
the cores: its threads' CPU time (the shadow thread's and its process group's gloo threads'), and
the idle time the cores had to give meanwhile. Where /proc cannot tell (another OS, a thread that
ended), a reading counts nothing, and the pacing goes by the steps' slowdown alone.
"""

from __future__ import annotations

import os
from typing import Iterable

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
"""The unit of /proc/stat's times (USER_HZ: 10 ms on Linux)."""


def thread_cpu_s(threads: Iterable[int]) -> float:
    """CPU seconds the threads `threads` (native ids of this process's) have run so far: the
    scheduler's own count in nanoseconds (`schedstat`), else user plus system time in ticks."""
    total = 0.0
    for thread in threads:
        try:
            with open(f"/proc/self/task/{thread}/schedstat") as schedstat:
                total += int(schedstat.read().split()[0]) / 1e9
            continue
        except (OSError, ValueError, IndexError):
            pass
        try:
            with open(f"/proc/self/task/{thread}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) * TICK_S  # utime, stime
        except (OSError, ValueError, IndexError):
            pass
    return total


def idle_cpu_s() -> float:
    """Idle seconds (idle plus I/O wait) so far of the cores this process may run on, summed."""
    try:
        allowed = os.sched_getaffinity(0)
        with open("/proc/stat") as stat:
            lines = stat.read().splitlines()
    except (OSError, AttributeError):
        return 0.0
    total = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in allowed:
            fields = rest.split()
            total += int(fields[3]) + int(fields[4])
    return total * TICK_S

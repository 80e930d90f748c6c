"""What a benchmark process reads of itself and its host: its CPU clock, its peak memory, a free port.

Standard library only, so that a script can import it before it chooses which checkout's
`shadowgba` its processes load (`bench_ps.py --trees`).
"""

from __future__ import annotations

import resource
import socket

MiB = 2**20


def cpu_seconds() -> float:
    """User + system CPU seconds this process has used so far, all its threads included (steal time
    does not inflate it)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (Linux reports `ru_maxrss` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MiB


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago, for a spawned group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

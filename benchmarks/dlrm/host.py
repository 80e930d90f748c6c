"""What a benchmark process reads of itself and its host: its CPU clock, its peak memory, a free port.

Standard library only, so that a script can import it before it chooses which checkout's
`shadowgba` its processes load (`bench_ps.py --trees`).
"""

from __future__ import annotations

import random
import resource
import socket
from pathlib import Path

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
    """A TCP port on loopback, free a moment ago, for a spawned group's rendezvous or store.

    Drawn below the kernel's ephemeral range: a port the kernel hands out for `bind(0)` is also one
    it hands to outgoing connections, so between this call and the server's bind a client (a
    trainer retrying its connection to this very store, say) may take it, and the server then fails
    with EADDRINUSE. No outgoing connection is given a port below the range."""
    low = _ephemeral_low()
    if low <= 10_000:  # a host whose range leaves no room below: take what the kernel gives
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    draw = random.Random()  # seeded from the OS: processes forked from one parent draw differently
    for _ in range(200):
        port = draw.randrange(10_000, low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port on loopback in [10000, {low})")


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux's default 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768

"""Which network interface a process's gloo groups use, which processes share a host, and joining
torch.distributed across hosts.

    shadowgba.init_process_group()      # instead of dist.init_process_group(), on every rank

Why: gloo listens on the interface `GLOO_SOCKET_IFNAME` names, else on the address the host's
name resolves to, and tells its peers that address. On many hosts (Debian's and Ubuntu's
/etc/hosts among them) the name resolves to 127.0.0.1: a job within one host runs, and a job
across hosts fails in `init_process_group`, a rank on one host refused by its own loopback while
the rank it tried to reach waits for it until torch's timeout (30 minutes by default).

So before any process group of the job exists, `use_interface_to_master()` sets
`GLOO_SOCKET_IFNAME`, unless the user has, to the interface of the local address that routes to
MASTER_ADDR: loopback within one host, the NIC that faces the master across hosts (on a host with
several, the one its route to the master takes). Every gloo group reads the variable when it is
created, so the default group, the library's own groups (trainers, replica and sharding groups of
the 2D layout, the shadow thread's, the checkpoints') and the parameter-server channels all follow.
`shadowgba.join` (when it creates the default group) and the PS transport call it themselves; a
user who creates the default group calls `init_process_group` here instead of torch's, or sets
`GLOO_SOCKET_IFNAME` by hand. A user's own setting is kept, and one that names no interface of
this host is refused, naming the host's.

Store accesses under a partition: a torch store client whose server's host is cut off (not gone:
no connection reset arrives) blocks in a system call for minutes, whatever its timeout says. The
few accesses a failure path needs (who else failed, is a session newer) go through `bounded`,
which gives up after a time and leaves the blocked thread behind, so a rank cut off from the
store still ends, and says so.

Same host: two processes share a host for the parameter-server's shared-memory path only if they
share the kernel (its boot id) and the network namespace (`host_identity`). Different network
namespaces are different hosts to gloo (their loopbacks are apart), and the same-host path must
agree: otherwise processes of two containers, or two simulated hosts on one machine, would move
their tensors through memory while the job's TCP traffic crossed a link.
"""

from __future__ import annotations

import fcntl
import functools
import os
import socket
import struct
import threading
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from shadowgba.errors import SetupError

SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
"""The variable gloo reads, at each group's creation, for the interface it listens on."""

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address

T = TypeVar("T")


class StoreUnreachable(RuntimeError):
    """A store access failed or did not return in time (`bounded`); `thread` is the one left behind
    still blocked in it (None when it failed)."""

    def __init__(self, message: str, thread: threading.Thread | None) -> None:
        super().__init__(message)
        self.thread = thread


def bounded(operation: Callable[[], T], timeout_s: float) -> T:
    """`operation()`'s result, run on a daemon thread of its own; `StoreUnreachable` when it raised
    or had not returned after `timeout_s` (then its thread is left behind, blocked)."""
    outcome: list[tuple[T]] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append((operation(),))
        except Exception as error:  # noqa: BLE001 (reported to the caller)
            failure.append(error)

    thread = threading.Thread(target=run, name="shadowgba-store-access", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if outcome:
        return outcome[0][0]
    if failure:
        raise StoreUnreachable(f"the store failed: {failure[0]!r}", None) from failure[0]
    raise StoreUnreachable(f"the store did not answer within {timeout_s:g} s", thread)


def route_address(master_addr: str) -> str:
    """The IPv4 address this host uses to reach `master_addr`: where the job's other hosts reach it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((master_addr, 9))  # a UDP connect sends nothing; it only picks the route
        except OSError as error:
            raise SetupError(
                f"no IPv4 route to MASTER_ADDR {master_addr} ({error}); set "
                f"{SOCKET_IFNAME} to the interface this host's ranks should listen on"
            ) from None
        return probe.getsockname()[0]


def listen_interface(master_addr: str) -> str:
    """Name of the network interface whose IPv4 address this host uses to reach `master_addr`."""
    local_address = route_address(master_addr)
    for _, interface in socket.if_nameindex():
        if _ipv4_address(interface) == local_address:
            return interface
    raise SetupError(
        f"no network interface holds {local_address}, the address that reaches MASTER_ADDR {master_addr}; "
        f"set {SOCKET_IFNAME} to the interface this host's ranks should listen on"
    )


def _ipv4_address(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as query:
        try:
            reply = fcntl.ioctl(query.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        except OSError:  # the interface has no IPv4 address
            return None
    return socket.inet_ntoa(reply[20:24])  # struct ifreq: 16-byte name, then sockaddr_in


def use_interface_to_master() -> str:
    """Set `GLOO_SOCKET_IFNAME` for this process, unless it is set, to the interface that reaches
    MASTER_ADDR; the interface in use. A value set by the user must name an interface of this host
    with an IPv4 address."""
    chosen = os.environ.get(SOCKET_IFNAME)
    if chosen:
        interfaces = [name for _, name in socket.if_nameindex()]
        for name in chosen.split(","):  # gloo takes a comma-separated list
            if name not in interfaces or _ipv4_address(name) is None:
                raise SetupError(
                    f"{SOCKET_IFNAME}={chosen}: this host has no interface {name!r} with an IPv4 address "
                    f"(its interfaces: {', '.join(interfaces)}); name one of them, or unset {SOCKET_IFNAME} "
                    "and shadowgba picks the one that reaches MASTER_ADDR"
                )
        return chosen
    master_addr = os.environ.get("MASTER_ADDR")
    if not master_addr or not os.environ.get("MASTER_PORT"):
        raise SetupError("MASTER_ADDR and MASTER_PORT are not set: start the job with torchrun "
                         "(or set both to the address and port of rank 0's store)")
    os.environ[SOCKET_IFNAME] = listen_interface(master_addr)
    return os.environ[SOCKET_IFNAME]


def init_process_group(backend: str | None = None, **kwargs: Any) -> None:
    """`torch.distributed.init_process_group(backend, **kwargs)` from torchrun's environment, with
    gloo on the interface that reaches MASTER_ADDR (`use_interface_to_master`), so that a job runs
    across hosts whatever their names resolve to."""
    use_interface_to_master()
    dist.init_process_group(backend, **kwargs)


@functools.cache
def host_identity() -> str:
    """What two processes of one host (one kernel, one network namespace) share, and processes of
    two hosts, or of two network namespaces of one machine, do not."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            kernel = boot.read().strip()
    except OSError:
        kernel = socket.gethostname()
    try:
        network = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        network = 0
    return f"{kernel}/{network}"

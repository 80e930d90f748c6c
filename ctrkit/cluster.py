"""A simulated cluster on one machine: hosts as network namespaces on one switch, links shaped by rate.

    with Cluster(2, rate="1gbit") as cluster:             # host 0 at 10.71.0.1, host 1 at 10.71.0.2
        jobs = cluster.torchrun(["benchmarks/train_dlrm.py", "--config", "ma.yaml"], nproc_per_host=1)
        cluster.set_rate(1, "10mbit")                      # while the job runs
        cluster.link_down(1); ...; cluster.link_up(1)
        codes = [job.wait() for job in jobs]

Why namespaces: every test and figure of a multi-process job on one machine otherwise runs over
loopback or shared memory, where a dense all-reduce costs almost nothing and a link never fails.
Each host here is a network namespace with its own `lo`, its own `eth0` and its own routes, so a
process on it sees what a process on a real host sees: its host name resolves to loopback (as on
many Debian-style hosts), MASTER_ADDR is another machine's address, and bytes to a peer cross a
link that has a rate and can go down.

Layout and invariants:
- One more namespace, the switch, holds a Linux bridge (`br0`) and the far end of every host's veth
  pair (`h<i>`). No interface of the cluster is in the machine's own namespace, and its addresses
  (`NETWORK`, a private range) exist only inside the cluster's namespaces: nothing a process in a
  host can reach lies outside the cluster, and nothing outside can reach it.
- A host's rate shapes both directions of its link (`tbf` on its `eth0`, for what it sends, and on
  the switch's `h<i>`, for what it receives), and can change while processes run.
- `link_down(i)` sets the switch's end down: the host keeps its address and routes (as when a
  cable or a top-of-rack port fails), and frames in either direction are dropped.
- `extra_interface` gives those hosts an `eth1` on a second, isolated bridge (`EXTRA_NETWORK`),
  created before `eth0` so that it comes first in the host's interface list: the NIC a naive
  "first interface" choice would take, and one from which no peer of the job can be reached.
- Every name starts with `sgba<pid>-` (the pid of the process that made it). `close()` kills every
  process left in the cluster's namespaces and removes them (the switch's removal takes the
  bridges and the veth pairs with it); a new `Cluster` first removes the namespaces of owners that
  are no longer alive, so a crashed run's leftovers never outlive the next one.

Built on pyroute2 (netlink from Python: namespaces, links, addresses and `tc` qdiscs without
spawning `ip` or `tc`). Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN): `unavailable_reason()` says
why not, for a test to skip on.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

NETWORK = ipaddress.ip_network("10.71.0.0/24")
"""The cluster's own network: host i is its (i + 1)-th address."""

EXTRA_NETWORK = ipaddress.ip_network("10.71.1.0/24")
"""The network of the hosts' second interfaces (`extra_interface`), joined to none of the job's peers."""

PREFIX = "sgba"
"""Every namespace of a cluster is named `<PREFIX><owner pid>-<role>`."""

_OWNED = re.compile(rf"^{PREFIX}(\d+)-")

_TC_H_ROOT = 0xFFFFFFFF
"""The root of an interface's qdisc tree (where its one `tbf` sits)."""

_TBF_LATENCY_MS = 20
"""How long a packet may wait in a shaped link's queue before it is dropped (as `tc tbf latency`)."""


_CAPABILITIES = {"CAP_NET_ADMIN": 12, "CAP_SYS_ADMIN": 21}
"""The capabilities a cluster needs (links and qdiscs; namespaces), by bit in the effective set."""


def _missing_capabilities() -> list[str]:
    """Which of `_CAPABILITIES` this process lacks (root in a container may hold none of them)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return list(_CAPABILITIES)
    effective = int(re.search(r"^CapEff:\s*([0-9a-f]+)$", status, re.MULTILINE).group(1), 16)
    return [name for name, bit in _CAPABILITIES.items() if not effective >> bit & 1]


def unavailable_reason() -> str | None:
    """Why a cluster cannot be made here (None when it can): not root, root without the
    capabilities (no network namespaces), or no pyroute2."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, veth pairs and tc)"
    missing = _missing_capabilities()
    if missing:
        return (f"simulated hosts need {' and '.join(missing)} (network namespaces, veth pairs and tc), which this "
                "root process lacks")
    try:
        import pyroute2  # noqa: F401
    except ImportError:
        return "simulated hosts need pyroute2 (pip install pyroute2)"
    return None


def rate_bits(rate: str | int) -> int:
    """A link rate in bits per second, from an int or a string such as "1gbit", "100mbit", "500kbit"."""
    if isinstance(rate, int):
        return rate
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)bit", rate.strip().lower())
    if match is None:
        raise ValueError(f"link rate {rate!r}: write it as <number>[k|m|g]bit, e.g. 1gbit")
    return int(float(match.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[match.group(2)])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove every cluster namespace whose owner process is gone, killing what still runs in it;
    the names removed."""
    from pyroute2 import netns

    stale = [name for name in netns.listnetns()
             if (match := _OWNED.match(name)) and not _alive(int(match.group(1)))]
    _kill_and_remove(stale)
    return stale


def _kill_and_remove(names: Sequence[str]) -> None:
    """SIGKILL every process in the namespaces `names`, wait for them to go, then remove them."""
    from pyroute2 import netns

    if not names:
        return
    deadline = time.monotonic() + 10.0
    while True:
        pids = [pid for name, in_ns in netns.ns_pids().items() if name in names for pid in in_ns]
        if not pids or time.monotonic() > deadline:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    for name in names:
        try:
            netns.remove(name)
        except OSError:
            pass


class Cluster:
    """`num_hosts` simulated hosts on one switch, each link at `rate` (None: unshaped). A context
    manager: leaving it (however) tears everything down."""

    def __init__(self, num_hosts: int, rate: str | int | None = None,
                 extra_interface: Sequence[int] = ()) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        if not 1 <= num_hosts <= 200:
            raise ValueError(f"num_hosts {num_hosts}: between 1 and 200")
        from pyroute2 import NetNS, netns

        remove_stale()
        self.num_hosts = num_hosts
        self._owner = f"{PREFIX}{os.getpid()}-"
        self.switch_ns = f"{self._owner}sw"
        self.host_ns = [f"{self._owner}h{i}" for i in range(num_hosts)]
        self._processes: list[subprocess.Popen] = []
        self._closed = False
        self._rates: dict[int, int | None] = {}
        try:
            for name in [self.switch_ns, *self.host_ns]:
                netns.create(name)
            with NetNS(self.switch_ns) as switch:
                for bridge in ("br0", "br1") if extra_interface else ("br0",):
                    switch.link("add", ifname=bridge, kind="bridge")
                    switch.link("set", index=switch.link_lookup(ifname=bridge)[0], state="up")
                for i in range(num_hosts):
                    if i in extra_interface:  # first: the host lists it before eth0
                        self._wire(switch, i, f"x{i}", "br1", "eth1", EXTRA_NETWORK)
                    self._wire(switch, i, f"h{i}", "br0", "eth0", NETWORK)
            for i in range(num_hosts):
                self.set_rate(i, rate)
        except BaseException:
            self.close()
            raise

    def _wire(self, switch: Any, host: int, port: str, bridge: str, nic: str,
              network: ipaddress.IPv4Network) -> None:
        """Host `host`'s interface `nic`, the far end of switch port `port` on `bridge`, addressed in
        `network`; every link up, the host's `lo` too."""
        from pyroute2 import NetNS

        switch.link("add", ifname=port, kind="veth", peer={"ifname": nic, "net_ns_fd": self.host_ns[host]})
        index = switch.link_lookup(ifname=port)[0]
        switch.link("set", index=index, master=switch.link_lookup(ifname=bridge)[0], state="up")
        with NetNS(self.host_ns[host]) as ns:
            nic_index = ns.link_lookup(ifname=nic)[0]
            ns.addr("add", index=nic_index, address=str(network[host + 1]), prefixlen=network.prefixlen)
            ns.link("set", index=nic_index, state="up")
            ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")

    # ----------------------------------------------------------------------------------- addresses
    def address(self, host: int) -> str:
        """Host `host`'s address on the cluster network (its `eth0`)."""
        return str(NETWORK[host + 1])

    # ------------------------------------------------------------------------------------ the links
    def set_rate(self, host: int, rate: str | int | None) -> None:
        """Shape host `host`'s link to `rate` in both directions (None: unshaped); allowed while
        processes run."""
        from pyroute2 import NetNS

        bits = None if rate is None else rate_bits(rate)
        for ns_name, ifname in ((self.host_ns[host], "eth0"), (self.switch_ns, f"h{host}")):
            with NetNS(ns_name) as ns:
                index = ns.link_lookup(ifname=ifname)[0]
                if bits is None:
                    if self._rates.get(host) is not None:
                        ns.tc("del", index=index, parent=_TC_H_ROOT)
                else:
                    # a burst of 4 ms at the rate (at least 64 KB) lets TCP reach the rate
                    burst = max(bits // 8 // 250, 64 * 1024)
                    ns.tc("replace", "tbf", index=index, rate=f"{bits}bit", burst=burst,
                          latency=f"{_TBF_LATENCY_MS}ms")
        self._rates[host] = bits

    def rate(self, host: int) -> int | None:
        """Host `host`'s link rate in bits per second (None: unshaped)."""
        return self._rates.get(host)

    def link_down(self, host: int) -> None:
        """Cut host `host` off: its switch port goes down; its address and routes stay."""
        self._port(host, "down")

    def link_up(self, host: int) -> None:
        """Reconnect host `host` (undoes `link_down`)."""
        self._port(host, "up")

    def _port(self, host: int, state: str) -> None:
        from pyroute2 import NetNS

        with NetNS(self.switch_ns) as switch:
            switch.link("set", index=switch.link_lookup(ifname=f"h{host}")[0], state=state)

    def wire_bytes(self, host: int, nic: str = "eth0") -> tuple[int, int]:
        """(received, sent) bytes on host `host`'s interface `nic` so far: what crossed that link."""
        from pyroute2 import NetNS

        with NetNS(self.host_ns[host]) as ns:
            link = ns.get_links(ns.link_lookup(ifname=nic)[0])[0]
        stats = link.get_attr("IFLA_STATS64")
        return stats["rx_bytes"], stats["tx_bytes"]

    # ------------------------------------------------------------------------------------ processes
    def popen(self, host: int, argv: Sequence[str], env: dict[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen:
        """Start `argv` on host `host` (in its namespace, in a session of its own); it is killed at
        `close()` if still running."""
        fd = os.open(f"/run/netns/{self.host_ns[host]}", os.O_RDONLY)
        try:
            process = subprocess.Popen(list(argv), env=env, start_new_session=True,
                                       preexec_fn=lambda: _enter(fd), pass_fds=(fd,), **kwargs)
        finally:
            os.close(fd)
        self._processes.append(process)
        return process

    def torchrun(self, script: Sequence[str], nproc_per_host: int | Sequence[int], hosts: Sequence[int] | None = None,
                 port: int = 29500, env: dict[str, str] | None = None, torchrun_args: Sequence[str] = (),
                 log_dir: Path | None = None, capture: bool = False) -> list[subprocess.Popen]:
        """One multi-node torchrun agent per host of `hosts` (default: all), meeting at the first
        one's address (`--nnodes len(hosts) --node-rank i`, static rendezvous), each starting
        `nproc_per_host` ranks of `script` (a path and its arguments). Agent i's output (stdout and
        stderr) goes to `log_dir/host<i>.log` with `log_dir`, to a text pipe with `capture`."""
        hosts = list(range(self.num_hosts)) if hosts is None else list(hosts)
        nprocs = [nproc_per_host] * len(hosts) if isinstance(nproc_per_host, int) else list(nproc_per_host)
        agents = []
        for node_rank, host in enumerate(hosts):
            argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(hosts)}",
                    f"--node-rank={node_rank}", f"--nproc-per-node={nprocs[node_rank]}",
                    f"--master-addr={self.address(hosts[0])}", f"--master-port={port}", *torchrun_args, *script]
            output: Any = subprocess.PIPE if capture else None
            if log_dir is not None:
                log_dir.mkdir(parents=True, exist_ok=True)
                output = open(log_dir / f"host{host}.log", "wb")
            try:
                agents.append(self.popen(host, argv, env=env, stdout=output, text=capture or None,
                                         stderr=None if output is None else subprocess.STDOUT))
            finally:
                if log_dir is not None:
                    output.close()
        return agents

    # ---------------------------------------------------------------------------------- tearing down
    def close(self) -> None:
        """Kill every process in the cluster and remove its namespaces, links and bridges."""
        if self._closed:
            return
        self._closed = True
        for process in self._processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        _kill_and_remove([self.switch_ns, *self.host_ns])
        for process in self._processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_CLONE_NEWNET = 0x40000000
_LIBC = ctypes.CDLL(None, use_errno=True)
"""Loaded here, not in the child: a child between fork and exec must not load a library."""


def _enter(fd: int) -> None:
    """In a child between fork and exec: move into the network namespace open at `fd`."""
    if _LIBC.setns(fd, _CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns into a simulated host failed")


def enter(namespace: str) -> None:
    """Move the calling process onto the host whose namespace is `namespace` (`Cluster.host_ns[i]`).
    Call it first thing in a freshly started child (a `multiprocessing` one), before it creates a
    thread or a socket, so that all of them live on that host; `Cluster.close()` kills it with the
    rest of the cluster."""
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        _enter(fd)
    finally:
        os.close(fd)

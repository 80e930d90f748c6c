"""The job's own store: where its notice board and its survivors' groups live when the store its
ranks met at would go with one of them.

    python -m shadowgba.job.store        # started by rank 0 at `join`, never by hand

Ranks started by hand meet at a TCPStore served by a thread of rank 0's process (`env://`); the
ranks of a multi-node torchrun job at the one its first agent serves, and an agent ends at once
when one of its workers fails. Either store goes with that process, and with it every survivor's
access to what the job decided: who failed first (`shadowgba.job.blame`), which replica groups
are lost, and the groups rebuilt without them (`shadowgba.job.survivors`). So when the ranks met at
such a store, `job_store` (every trainer, at `join`) has rank 0 start this module as a
process of its own, beside itself, and every trainer connects to it:

- it runs in a session of its own: torchrun's agent ends a worker's process group, not it;
- each trainer holds a lease there, a counter a daemon thread of its process advances every
  `LEASE_INTERVAL_S` while the process lives (whatever the job's state: a rank that left the job
  still evaluates on the survivors' groups);
- it serves until no lease advanced for `LEASE_LOST_S`: every trainer's process ended, was killed
  or is stopped. It outlives the last rank, and no one has to stop it.

The stores that already outlive every rank are kept: a single torchrun agent's (it outlives every
worker it started), the replica store of a torchrun job per replica group (`shadowgba.replica_store`)
and the servers' store of the elastic layout. This store is on rank 0's host: it outlives the loss
of any rank's process, not the loss of that host (a job that must survive it keeps its store on a
host of its own: `sync.replica_jobs`).

Imports: torch, `shadowgba.errors`, `shadowgba.network` and this package only.
"""

from __future__ import annotations

import datetime
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from shadowgba.errors import SetupError
from shadowgba.job.rendezvous import attempt_namespace, store_hosted_elsewhere
from shadowgba.network import route_address

LEASES = "shadowgba/leases"
"""The counter every trainer's lease advances (one for all: the store only asks whether any lives)."""
LEASE_INTERVAL_S = 1.0
"""How often a trainer's process advances the lease."""
LEASE_LOST_S = 30.0
"""How long the store serves after the lease last advanced: far above a process descheduled on a
busy host, and what a finished job's store lingers."""
START_TIMEOUT_S = 60.0
"""How long rank 0 waits for the store's process to listen (a Python that imports torch)."""
ERROR = "error: "
"""The start of the address rank 0 publishes when the store's process did not start: why."""


class Lease:
    """A trainer process's lease on the job's store: a daemon thread that advances `LEASES` every
    `LEASE_INTERVAL_S` until the process ends (or the store stops answering)."""

    def __init__(self, store: dist.Store) -> None:
        self._store = store
        self._thread = threading.Thread(target=self._hold, name="shadowgba-store-lease", daemon=True)
        self._thread.start()

    def _hold(self) -> None:
        while True:
            try:
                self._store.add(LEASES, 1)
            except RuntimeError:  # the store is gone: nothing left to keep alive
                return
            time.sleep(LEASE_INTERVAL_S)


def job_store(rank: int, world_size: int, job: str, timeout_s: float) -> dist.Store | None:
    """Collective over the trainers (rank 0 among them) of job `job`, right after they met at the
    default group's store: a client of the job's own store, whose process rank 0 starts, with this
    process's `Lease` on it; None where the store they met at outlives every rank. The address
    goes through the default store (every rank reaches it at the start); `SetupError` on every
    trainer, naming why, when the store's process does not start."""
    if not _needed(world_size):
        return None
    default = dist.distributed_c10d._get_default_store()
    key = f"shadowgba/{attempt_namespace()}/{job}/job_store"
    if rank == 0:
        try:
            address = f"{route_address(os.environ['MASTER_ADDR'])}:{_start()}"
        except SetupError as error:
            default.set(key, f"{ERROR}{error}")
            raise
        default.set(key, address)
    else:
        address = default.get(key).decode()
        if address.startswith(ERROR):
            raise SetupError(f"rank 0 could not start the job's store: {address.removeprefix(ERROR)}")
    host, _, port = address.rpartition(":")
    try:
        store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as error:
        raise SetupError(f"the job's store at {address} (started by rank 0) did not answer within {timeout_s:g} s "
                         "(sync.timeout_s)") from error
    Lease(store)
    return store


def _needed(world_size: int) -> bool:
    """Whether the store a job of `world_size` ranks met at (`env://`, MASTER_ADDR:MASTER_PORT) goes
    with one of its processes: ranks started by hand (rank 0's process serves it), or several
    torchrun agents (the first one's serves it, `GROUP_WORLD_SIZE` > 1). A single agent's store
    outlives its workers; a job of one rank has no survivor to keep it for; a default group made
    from another `init_method` names no address the other hosts reach rank 0's by (its own store
    is kept)."""
    if world_size < 2 or "MASTER_ADDR" not in os.environ:
        return False
    return not store_hosted_elsewhere() or int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1


def _start() -> int:
    """Start the store's process beside this one (in a session of its own); the port it serves on."""
    checkout = str(Path(__file__).resolve().parents[2])  # this code, whatever the child's path says
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [checkout, os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, "-m", "shadowgba.job.store"], stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], START_TIMEOUT_S)
    line = process.stdout.readline().decode().strip() if ready else ""
    process.stdout.close()
    if not line.isdigit():
        process.kill()
        raise SetupError(f"the job's store (python -m shadowgba.job.store) did not start within {START_TIMEOUT_S:g} s "
                         f"(exit code {process.poll()})")
    return int(line)


def serve() -> None:
    """Serve a store on a free port of every interface, print the port, and return once no lease
    advanced for `LEASE_LOST_S`."""
    store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=LEASE_INTERVAL_S * 10))
    print(store.port, flush=True)
    leases, alive_at = store.add(LEASES, 0), time.monotonic()
    while time.monotonic() - alive_at < LEASE_LOST_S:
        time.sleep(LEASE_INTERVAL_S)
        now = store.add(LEASES, 0)
        if now != leases:
            leases, alive_at = now, time.monotonic()


if __name__ == "__main__":
    serve()

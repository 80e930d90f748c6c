"""The replica store: where the torchrun jobs of one 2D job meet, one job per replica group.

    python -m shadowgba.replica_store --port 29700        # on one host, before the groups

Each replica group of a job under `sync.replica_jobs.store` is a torchrun job of its own, so its
agent can restart it alone. The groups cannot meet in any of their agents' stores, since each of
those ends with its group; they meet in this one, a TCPStore served by a process that belongs to no
group and outlives them all. It holds the job's notice board (who was lost, who asks to join, the
membership decisions) and the rendezvous keys of the groups across the jobs
(`shadowgba.job.survivors`). It holds no model state, computes nothing, and can serve several
jobs (`sync.replica_jobs.name` keeps their keys apart). Stop it with Ctrl-C or SIGTERM once every
group has finished.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import signal
import threading
from typing import Sequence

import torch.distributed as dist

logger = logging.getLogger("shadowgba")


def serve(host: str, port: int, stop: threading.Event) -> None:
    """Serve the store on `host:port` until `stop` is set."""
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    logger.warning("shadowgba replica store serving on %s:%d", host, store.port)
    stop.wait()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: every interface)")
    parser.add_argument("--port", type=int, required=True, help="port to listen on")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    serve(args.host, args.port, stop)


if __name__ == "__main__":
    main()

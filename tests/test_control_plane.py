"""The control plane at scale (docs/scaling.md, "The control plane"): what the job's store carries.

- Reading the board for lost peers costs the store a bounded number of requests, whatever the
  number of peers: the beats in one batched read per poll, the aborts listed under one key. (Read
  one key at a time, a thousand survivors looking up a lost rank at once sent the store millions of
  requests, and the heartbeats queued behind them.)
- A 16-rank job (`benchmarks/bench_control_plane.py`, flat ma, simulated compute) with one rank
  SIGKILLed: every survivor names it within `sync.timeout_s` + 10 s, the rounds ran before it, and a
  rank's steady load on the store is its heartbeat.
"""

from __future__ import annotations

import argparse
import threading
import time

import pytest
import torch.distributed as dist

from bench_control_plane import StoreOps, run_job
from shadowgba.job.notices import BEAT_INTERVAL_S, NoticeBoard

PEERS = 500
JOB_RANKS = 16
TIMEOUT_S = 20.0
"""`sync.timeout_s` of the 16-rank job."""


def test_reading_many_peers_costs_the_store_a_few_requests_not_a_few_per_peer() -> None:
    board = NoticeBoard("job", dist.HashStore(), attempt=0)
    for rank in range(PEERS):
        board.beat(rank, "1")
    board.post_abort(3, "trainer 3 aborted: ValueError('boom')")

    def the_others_beat() -> None:  # every peer but 7 (silent) and 3 (aborted) beats again
        time.sleep(BEAT_INTERVAL_S / 2)
        for rank in range(PEERS):
            if rank not in (3, 7):
                board.beat(rank, "2")

    beating = threading.Thread(target=the_others_beat)
    with StoreOps() as ops:
        beating.start()
        silent, aborted = board.silent_peers(range(PEERS), within_s=2.0), board.aborted_peers(range(PEERS))
        beating.join()
    reads = ops.total() - (PEERS - 2)  # less the other peers' beats, written meanwhile
    assert silent == [3, 7] and aborted == {3: "trainer 3 aborted: ValueError('boom')"}
    assert reads <= 2 * (2.0 / (BEAT_INTERVAL_S / 4) + 2) + 3, reads  # a check and a multi_get per poll; the list and a reason


@pytest.mark.timeout(240)
def test_a_16_rank_job_names_a_killed_rank_on_every_survivor_within_the_timeout() -> None:
    options = argparse.Namespace(steps=400, step_ms=200.0, kill_rank=5, kill_step=25, timeout_s=TIMEOUT_S,
                                 deadline_s=180.0)
    job = run_job(JOB_RANKS, "flat", options)
    assert not job["broken"], job["broken"]
    assert job["survivors"] == job["named_by"] == JOB_RANKS - 1, job
    assert job["named_s_max"] <= TIMEOUT_S + 10, job
    assert job["rounds_median"] >= 1, job
    assert job["steady_ops_per_s_per_rank"] <= 2 / BEAT_INTERVAL_S, job  # the heartbeat's set, and little else

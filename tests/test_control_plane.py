"""The control plane at scale (docs/scaling.md, "The control plane"): what the job's store carries.

- Reading the board for lost peers costs the store a bounded number of requests, whatever the
  number of peers: the beats in one batched read per poll, the aborts listed under one key. (Read
  one key at a time, a thousand survivors looking up a lost rank at once sent the store millions of
  requests, and the heartbeats queued behind them.)
- When every survivor fails at once, only the first `LOOKERS` to ask look the lost rank up; the
  others read their decision, and look for themselves only when the lookers found nothing or were
  lost too.
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
from shadowgba.job.blame import LOOKERS, LOOKERS_PATIENCE_S, Blame, found_nothing
from shadowgba.job.notices import BEAT_INTERVAL_S, HEARTBEAT_SILENT_S, NoticeBoard

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


SURVIVORS = 100
KILLED = 7


def gloo_error() -> RuntimeError:
    return RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4242")


class Beating:
    """Every rank of `ranks` but `KILLED` beating on `store` every half beat, as their `Heartbeat`s would."""

    def __init__(self, store: dist.Store, ranks: int) -> None:
        self.board, self.ranks = NoticeBoard("job", store, attempt=0), ranks
        self.ended = threading.Event()
        self.thread = threading.Thread(target=self._beat)

    def __enter__(self) -> Beating:
        for rank in range(self.ranks):
            self.board.beat(rank, "0")
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.ended.set()
        self.thread.join()

    def _beat(self) -> None:
        count = 0
        while not self.ended.wait(BEAT_INTERVAL_S / 2):
            count += 1
            for rank in range(self.ranks):
                if rank != KILLED:
                    self.board.beat(rank, str(count))


def judge_all(blames: list[Blame]) -> list[tuple[int, ...]]:
    """Every blame's culprits, judged at once from threads of their own (ranks failing together)."""
    culprits: list[tuple[int, ...]] = [()] * len(blames)

    def judge(index: int) -> None:
        culprits[index] = blames[index].judge(gloo_error()).culprits

    threads = [threading.Thread(target=judge, args=(index,)) for index in range(len(blames))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return culprits


@pytest.mark.timeout(120)
def test_survivors_failing_at_once_leave_the_look_up_to_the_first_two_and_read_their_decision() -> None:
    """100 ranks whose collectives all fail when rank 7 is killed (a TorchRec all-to-all pairs every rank
    with it): every one names rank 7, and the heartbeats are read by the lookers alone: at most
    `LOOKERS` look-ups of a batched read per poll, not one look-up per rank."""
    store = dist.HashStore()
    ranks = SURVIVORS + 1
    blames = [Blame(NoticeBoard("job", store, attempt=0), rank, [peer for peer in range(ranks) if peer != rank],
                    str) for rank in range(ranks) if rank != KILLED]
    with Beating(store, ranks), StoreOps() as ops:
        culprits = judge_all(blames)
    assert culprits == [(KILLED,)] * SURVIVORS
    polls = HEARTBEAT_SILENT_S / (BEAT_INTERVAL_S / 4) + 2
    assert 1 <= ops.counts["multi_get"] <= LOOKERS * polls, ops.counts  # per rank: >= SURVIVORS
    assert NoticeBoard("job", store, attempt=0).count("cause_lookers", 0) == SURVIVORS  # each asked once


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lookers", ["lost", "found_nothing"])
def test_a_rank_looks_for_itself_when_the_lookers_were_lost_or_found_nothing(lookers: str) -> None:
    """The first two to ask were lost before they decided: the next rank waits `LOOKERS_PATIENCE_S`
    for their decision, then looks up itself and names the silent rank. When a looker says it found
    nothing, the next rank looks at once."""
    store = dist.HashStore()
    board = NoticeBoard("job", store, attempt=0)
    assert board.count("cause_lookers", 0, add=LOOKERS) == LOOKERS  # the lookers' tickets, taken
    if lookers == "found_nothing":
        found_nothing(board, "cause", 0)
    blame = Blame(NoticeBoard("job", store, attempt=0), 0, [1, 2, KILLED], str)
    with Beating(store, KILLED + 1):
        started = time.monotonic()
        verdict = blame.judge(gloo_error())
        took = time.monotonic() - started
    assert verdict.culprits == (KILLED,), verdict
    waited = LOOKERS_PATIENCE_S if lookers == "lost" else 0.0
    assert waited <= took <= waited + HEARTBEAT_SILENT_S + 2, took


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

"""`shadowgba.job.blame` in one process: verdicts over a notice board in a `HashStore`, ranks simulated.

The spawned-rank tests (`tests/test_two_d.py`: a rank killed, raising or stopped; `tests/test_nonfinite.py`:
NaN under `fail`) check what every survivor raises; these check the rule itself, case by case.
"""

from __future__ import annotations

import torch.distributed as dist

from shadowgba.job.blame import Blame, gone_peers, is_peer_failure
from shadowgba.errors import PeerLost, SyncError
from shadowgba.job.notices import HEARTBEAT_LEFT, NoticeBoard


def describe(rank: int) -> str:
    return f"trainer {rank} (rank {rank})"


def judges(store: dist.Store, ranks: int = 3) -> list[Blame]:
    return [Blame(NoticeBoard("job", store, attempt=0), rank, [peer for peer in range(ranks) if peer != rank],
                  describe) for rank in range(ranks)]


def beat(board: NoticeBoard, rank: int, value: str) -> None:
    board.beat(rank, value)  # what a `Heartbeat` of `rank` writes


def gloo_error() -> RuntimeError:
    return RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4242")


def test_the_first_own_failure_is_the_cause_every_later_rank_names() -> None:
    first, second, third = judges(dist.HashStore())
    own = first.judge(ValueError("boom"))
    assert own.own and own.culprits == (0,) and own.replacement is None and own.earlier is None
    assert own.why == "trainer 0 (rank 0) aborted: ValueError('boom')"
    try:  # a peer whose collective failed afterwards: PeerLost naming rank 0, gloo's error as its cause
        raise SyncError("shadow thread failed") from gloo_error()
    except SyncError as error:
        seen = second.judge(error)
    assert not seen.own and seen.culprits == (0,) and seen.why == own.why
    assert isinstance(seen.replacement, PeerLost) and seen.replacement.ranks == (0,)
    later = third.judge(KeyError("its own, but later"))  # its own exception stays; the earlier one is noted
    assert later.own and later.replacement is None and later.earlier == own.why


def test_a_silent_rank_is_named_and_one_that_left_or_posted_is_not() -> None:
    store = dist.HashStore()
    survivor, killed, left = judges(store)
    beat(survivor.board, 1, "7")  # rank 1's beat stops at 7: killed
    beat(survivor.board, 2, HEARTBEAT_LEFT)  # rank 2 left normally
    verdict = survivor.judge(gloo_error())
    assert verdict.culprits == (1,) and isinstance(verdict.replacement, PeerLost)
    assert str(verdict.replacement).startswith("trainer 1 (rank 1) stopped its heartbeat")
    assert "rank 2" not in verdict.why

    store = dist.HashStore()
    survivor, posted, _ = judges(store)
    beat(survivor.board, 1, "3")
    beat(survivor.board, 2, "5")
    survivor.board.post_abort(1, "trainer 1 (rank 1) ... ended after it")  # silent, but it said why it left
    survivor.board.post_abort(2, "trainer 2 (rank 2) ... ended after it")
    unknown = survivor.judge(gloo_error())
    assert unknown.culprits == () and isinstance(unknown.replacement, PeerLost)
    assert "unknown" in unknown.why and "rank 1" not in unknown.why and "rank 2" not in unknown.why


def test_gone_peers_is_the_one_rule_blame_and_the_survivors_share() -> None:
    """A peer that posted why it left is gone (aborted), one silent without a notice is gone (silent),
    one that left normally or still beats is not: the rule `Blame` and `SurvivingGroups.agree` both read."""
    board = NoticeBoard("job", dist.HashStore(), attempt=0)
    for rank, value in ((1, "4"), (2, "9"), (3, HEARTBEAT_LEFT)):
        beat(board, rank, value)  # ranks 1 and 2 stopped beating, rank 3 left normally
    board.post_abort(2, "trainer 2 (rank 2) aborted: ValueError('boom')")
    gone = gone_peers(board, [1, 2, 3])
    assert gone.silent == (1,) and set(gone.aborted) == {2} and gone.ranks == (1, 2)


def test_named_culprits_are_the_cause_and_a_rank_that_named_itself_never_says_unknown() -> None:
    bad, healthy, _ = judges(dist.HashStore())
    flagged = SyncError("rank 0 sent NaN / Inf weights to a round (sync.on_nonfinite: fail)", ranks=[0])
    own = bad.judge(flagged)
    assert own.own and own.replacement is None and "unknown" not in own.why
    seen = healthy.judge(flagged)
    assert seen.culprits == (0,) and isinstance(seen.replacement, PeerLost) and seen.replacement.ranks == (0,)


def test_a_server_named_by_the_transport_is_kept_and_only_transport_words_count_as_a_peers_failure() -> None:
    trainer, _, _ = judges(dist.HashStore())
    for rank in (1, 2):
        beat(trainer.board, rank, HEARTBEAT_LEFT)
    refused = PeerLost("server 0 (ps0, rank 3) failed dense.push for trainer0: connection closed")
    verdict = trainer.judge(refused)  # nobody on the board: the transport's own words stand
    assert verdict.replacement is None and verdict.why == str(refused) and not verdict.own
    assert is_peer_failure(gloo_error()) and not is_peer_failure(RuntimeError("my loader timed out"))


def test_a_cause_on_the_board_that_shadowgba_did_not_write_is_named_as_such_and_judge_never_raises() -> None:
    """A store value of another process's making (not JSON, or JSON of other keys) never makes
    `judge` raise in place of the error it judges: the cause says what the board held."""
    store = dist.HashStore()
    first, second, _ = judges(store)
    first.board.decide("cause", 0, "\x80 not json")  # what a process that reaches the store could write
    verdict = second.judge(gloo_error())
    assert verdict.culprits == () and not verdict.own, verdict
    assert "the job's cause on the notice board (cause 0) is not one shadowgba writes: '\\x80 not json'" in verdict.why
    other = judges(dist.HashStore())
    other[0].board.decide("cause", 0, '{"ranks": "all", "why": 7}')
    assert other[1].judge(ValueError("its own")).own  # its own failure, the crafted cause noted as earlier


class GoneStore(dist.Store):
    """A store whose host is gone: every access fails, as a client's does once its server ended."""

    def _gone(self, *args: object) -> None:
        raise RuntimeError("Connection reset by peer: the store's host is gone")

    set = get = check = add = compare_set = delete_key = _gone


def test_with_the_board_unreachable_the_transports_naming_of_a_server_wins_and_only_then_the_store_is_blamed() -> None:
    """The board cannot be read (the store's host ended after another trainer had named the server):
    the transport's own words, naming ps0, are what this trainer says, not "could not reach the job's
    store"; a failure that names nobody is then the store's, as that is all this rank knows."""
    trainer = Blame(NoticeBoard("job", GoneStore(), attempt=0), 0, [1, 2], describe)
    refused = PeerLost("server 0 (ps0, rank 3) failed dense.push for trainer0: connection closed")
    verdict = trainer.judge(refused)
    assert not trainer.board.reachable  # the fault fired: every access failed
    assert "Connection reset by peer" in trainer.board.unreachable_why, trainer.board.unreachable_why  # what errors quote
    assert verdict.replacement is None and verdict.why == str(refused) and not verdict.own, verdict
    unknown = trainer.judge(gloo_error())
    assert isinstance(unknown.replacement, SyncError) and unknown.culprits == ()
    assert unknown.why.startswith("this rank (rank 0) could not reach the job's store"), unknown.why

"""`shadowgba.job.roster.Roster`, a server's one failure record, in one process: every refusal names
the ranks the failure names, so a trainer that reads it blames them and never itself."""

from __future__ import annotations

from shadowgba.errors import PeerLost
from shadowgba.job.roster import Roster


def test_a_lost_trainer_under_fail_is_the_failure_and_every_refusal_names_its_rank() -> None:
    roster = Roster(3, on_lost="fail")
    assert roster.refusal("ps0 refuses dense.push") is None
    roster.lose(2, 1, "trainer 2 (rank 2) stopped answering for 30 s")
    roster.fail("a later failure", [0])  # only the first one counts
    refusal = roster.refusal("ps0 refuses dense.push")
    assert isinstance(refusal, PeerLost) and refusal.ranks == (2,)
    assert str(refusal) == "ps0 refuses dense.push: the job failed: trainer 2 (rank 2) stopped answering for 30 s"
    assert roster.missing("stop") == ([0, 1, 2], "trainer 2 (rank 2) stopped answering for 30 s", (2,))


def test_an_abort_notice_names_the_cause_its_trainer_gives_not_the_trainer() -> None:
    """Trainer 1 ended after trainer 0 was found dead: its notice names rank 0, and so does the roster."""
    roster = Roster(2, on_lost="continue")
    roster.join(1, 1)
    roster.abort(1, 1, "trainer 0 (rank 0) stopped its heartbeat (trainer 1 (rank 1) ended after it)", [0])
    assert roster.failed == (0,) and roster.refusal("ps0 refuses centre.exchange").ranks == (0,)


def test_a_departure_under_continue_is_no_failure() -> None:
    roster = Roster(2, on_lost="continue")
    roster.join(0, 1)
    assert roster.lose(0, 1, "killed") and roster.refusal("ps0 refuses dense.push") is None
    assert roster.missing("stop") == ([1], None, ())

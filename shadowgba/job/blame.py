"""Blame: which rank's failure ended the job, decided once and read alike by every trainer, and the
one rule by which any rank finds its lost peers on the notice board (`gone_peers`).

A trainer whose `with` block ends by an exception asks `Blame.judge` what to tell the job and the
user. The error is one of three kinds:

- **It names its culprits** (`SyncError.ranks`: a round's NaN flags, a server that stopped
  answering). They are the cause; this rank is one of them when it named itself.
- **A peer's failure that names nobody**: a collective or channel failed (gloo / NCCL's own error,
  somewhere in its chain), or a round saw a peer abort. The peer that failed first is looked up on
  the job's notice board: the cause a peer already decided, else the peers whose heartbeat stopped
  without a word (killed, stuck, cut off: `gone_peers`). Only when neither exists is the cause unknown.
- **This rank's own failure** (the user's code or data, a config error, the library's own check):
  this rank is the cause.

The cause is one compare-and-set entry on the board (`NoticeBoard.decide`): the first verdict
posted wins, and every later one reads it, so every rank names the same first failure.

Invariants (why a healthy rank is never named):
- A rank posts its verdict before it aborts (`Job.announce_failure` runs before the runtime's
  abort and before its groups are destroyed), and its peers learn of its failure only from that
  abort or from its process ending; so a peer that failed first-hand has claimed the cause before
  any other rank looks it up.
- A rank that leaves after it learned of a failure posts a notice and marks its heartbeat left; one
  that leaves normally marks it left. Neither is ever silent, so neither is ever named: only a rank
  that went away without a word (killed, stopped, cut off) is.
- Every lookup of lost peers on the board goes through `gone_peers`: the trainers' verdict here and
  the surviving replica groups' decisions (`shadowgba.job.survivors`) name the same ranks.
- Only the first `LOOKERS` ranks to ask look up for one decision (`decided_by_lookers`); the others
  read the decision they post, and look for themselves only when a looker found nothing or none
  decided within `LOOKERS_PATIENCE_S`. When every rank fails at once (an all-to-all that pairs
  every rank with the lost one), the store then answers two look-ups, each a few batched reads of
  every peer's beat, and two reads per rank and poll, instead of a look-up per rank (at 4,096
  ranks 16.8M key reads, up to minutes of one store's CPU with the heartbeats queued behind them:
  docs/scaling.md, "The control plane").

Imports: `shadowgba.errors` and this package only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import traceback
from typing import Callable, Iterator, Sequence

import torch.distributed as dist

from shadowgba.errors import PeerLost, SyncError
from shadowgba.job.notices import BEAT_INTERVAL_S, HEARTBEAT_SILENT_S, NOTICE_TIMEOUT_S, NoticeBoard

logger = logging.getLogger("shadowgba")

CAUSE = "cause"
"""The board's kind of the job's cause (`NoticeBoard.decide`): `{"ranks": [...], "why": "..."}`."""

TRANSPORT_FAILURES = (
    "gloo", "nccl", "connection closed by peer", "connection reset by peer", "pair closure", "timed out waiting",
)
"""Words of a failed collective or connection in a `RuntimeError`'s text, as gloo and NCCL write
them (torch raises most of their failures as plain `RuntimeError`, not `torch.distributed.DistError`):
specific enough that a user's own `RuntimeError` is never taken for a peer's failure."""
LOOKERS = 2
"""How many ranks look up the lost peers on the board for one decision (`decided_by_lookers`): two,
so that one looker lost in the middle of its look-up does not leave every other rank waiting."""
LOOKERS_PATIENCE_S = HEARTBEAT_SILENT_S + 2 * BEAT_INTERVAL_S
"""How long a rank that is not a looker waits for the lookers' decision before it looks itself: the
longest a look-up waits for a heartbeat to stop, and two beats."""
DECISION_POLL_S = BEAT_INTERVAL_S / 2
"""How often a rank waiting for the lookers reads the decision, and whether a looker found nothing:
two requests each time."""
COLLECTIVE_CODE = ("/torch/distributed/", "/torchrec/distributed/")
"""Where a plain `RuntimeError` raised by a collective surfaces in Python (a work's `wait()`, TorchRec's
all-to-all awaitables), whatever gloo's words (e.g. "Timed out waiting 6000ms for recv operation")."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What `Blame.judge` found for one failure."""

    culprits: tuple[int, ...]
    """The global ranks named as the cause (empty: not known, or a server named in the error's text)."""
    own: bool
    """Whether this rank is among the cause (its own failure, or it named itself)."""
    why: str
    """One sentence naming the cause, as every rank reports it."""
    earlier: str | None = None
    """When this rank failed on its own after another failure was decided as the cause: that one."""
    replacement: BaseException | None = None
    """The error to raise in place of the one judged (a `PeerLost` naming the culprits, the judged
    error as its cause), or None to raise that one as it is."""


class Blame:
    """This trainer's judge of failures, on the job's notice board (see the module docstring).

    `peers`: the other trainers' global ranks; `describe(rank)`: how a rank is named in messages;
    `cause_number`: which decision of the board holds the cause (a 2D job under
    `on_group_lost: continue` decides one per membership epoch)."""

    def __init__(self, board: NoticeBoard, rank: int, peers: Sequence[int], describe: Callable[[int], str],
                 cause_number: Callable[[], int] = lambda: 0) -> None:
        self.board = board
        self.rank = rank
        self.peers = tuple(peers)
        self.describe = describe
        self.cause_number = cause_number

    def judge(self, error: BaseException) -> Verdict:
        """The verdict on `error`, this rank's failure; claims the cause on the board when this rank
        found one first. Never raises; waits at most about `LOOKERS_PATIENCE_S` and
        `HEARTBEAT_SILENT_S`, plus the board's `NOTICE_TIMEOUT_S` per access."""
        named = _named_ranks(error)
        if not named and not is_peer_failure(error):  # the user's code or data, a config, the library's check
            named = (self.rank,)
        if named:
            own = f"{self.describe(self.rank)} aborted: {error!r}"
            first = self._claim(named, own if self.rank in named else _text(error))
            if self.rank in named:
                return Verdict(named, True, own, earlier=None if first[0] == named else first[1])
            return self._peer_lost(first, error)
        decided = decided_by_lookers(self.board, CAUSE, self.cause_number())
        first = None if decided is None else _parse(decided, self.cause_number())
        if first is None:
            silent = self._silent()
            if silent:
                first = self._claim(silent, "; ".join(
                    f"{self.describe(rank)} stopped its heartbeat: it probably died, is stuck, or is cut off from "
                    "the network" for rank in silent))
            else:
                first = self._decided()  # a peer may have posted while the heartbeats were read
                if first is None:
                    found_nothing(self.board, CAUSE, self.cause_number())
        if first is not None:
            return self._peer_lost(first, error)
        if _chain_has(error, PeerLost):  # the transport's own words name the peer (a server), board or not
            return Verdict((), False, _text(error))
        if not self.board.reachable:
            why = (f"this rank (rank {self.rank}) could not reach the job's store within {NOTICE_TIMEOUT_S:.0f} s: "
                   "it is cut off from the other hosts (a network partition), or the store's host is down")
            return Verdict((), False, why, replacement=SyncError(why))
        why = ("a peer failed, but none posted a failure and every peer's heartbeat is alive: "
               f"the lost rank is unknown ({_text(error)})")
        return Verdict((), False, why, replacement=PeerLost(why))

    def _peer_lost(self, first: tuple[tuple[int, ...], str], error: BaseException) -> Verdict:
        culprits, why = first
        if self.rank in culprits:  # this rank's own failure was decided first (it failed twice)
            return Verdict(culprits, True, why)
        return Verdict(culprits, False, why, replacement=PeerLost(why, ranks=culprits))

    def _claim(self, culprits: tuple[int, ...], why: str) -> tuple[tuple[int, ...], str]:
        """Post (`culprits`, `why`) as the job's cause unless one was decided: the decided one."""
        proposal = json.dumps({"ranks": list(culprits), "why": why})
        decided = self.board.decide(CAUSE, self.cause_number(), proposal)
        return _parse(decided, self.cause_number()) if decided else (culprits, why)

    def _decided(self) -> tuple[tuple[int, ...], str] | None:
        value = self.board.decision(CAUSE, self.cause_number())
        return _parse(value, self.cause_number()) if value else None

    def _silent(self) -> tuple[int, ...]:
        """The peers gone without a word: a stopped heartbeat, no notice of their own."""
        return gone_peers(self.board, self.peers).silent


@dataclasses.dataclass(frozen=True)
class Gone:
    """The peers gone from the job as the notice board shows them (`gone_peers`)."""

    aborted: dict[int, str]
    """The peers that posted why they left (`NoticeBoard.post_abort`), with their reasons."""
    silent: tuple[int, ...]
    """The peers whose heartbeat stopped and that posted nothing: killed, stuck, or cut off."""

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every peer gone, either way, in rank order."""
        return tuple(sorted({*self.aborted, *self.silent}))


def gone_peers(board: NoticeBoard, peers: Sequence[int]) -> Gone:
    """The one rule for which of `peers` are gone: those that posted an abort, and those whose heartbeat
    stopped without a notice. A peer that left normally (its heartbeat marked left) is neither. Waits
    about `BEAT_INTERVAL_S` with live peers, at most `HEARTBEAT_SILENT_S` plus the board's
    `NOTICE_TIMEOUT_S` per access; an unreachable board shows what was read before it stopped answering."""
    silent = board.silent_peers(peers)
    aborted = board.aborted_peers(peers)
    return Gone(aborted, tuple(rank for rank in silent if rank not in aborted))


def decided_by_lookers(board: NoticeBoard, kind: str, number: int) -> str | None:
    """Decision `number` of `kind` on `board` if it was made, or once it is made by the ranks that look
    up the lost peers for it: the first `LOOKERS` ranks to ask (a counter on the board). Returns None
    at once to a looker (it looks up itself, then decides, or says it `found_nothing`), and to any
    rank once a looker found nothing, after `LOOKERS_PATIENCE_S` without a decision (the lookers were
    lost), or when the board cannot be reached: it then looks for itself."""
    decided = board.decision(kind, number)
    if decided is not None:
        return decided
    ticket = board.count(f"{kind}_lookers", number, add=1)
    if ticket is None or ticket <= LOOKERS:
        return None
    deadline = time.monotonic() + LOOKERS_PATIENCE_S
    while board.reachable and time.monotonic() < deadline:
        time.sleep(DECISION_POLL_S)
        decided = board.decision(kind, number)
        if decided is not None or board.count(_found_nothing_kind(kind), number):
            return decided
    return None


def found_nothing(board: NoticeBoard, kind: str, number: int) -> None:
    """A looker's look-up for decision `number` of `kind` found no lost peer: the ranks waiting for
    its decision (`decided_by_lookers`) stop waiting and look for themselves."""
    board.count(_found_nothing_kind(kind), number, add=1)


def _found_nothing_kind(kind: str) -> str:
    """The board's counter of the lookers of `kind`'s decisions that found nothing (`found_nothing`)."""
    return f"{kind}_found_nothing"


def is_peer_failure(error: BaseException) -> bool:
    """Whether `error` is a peer's failure seen from here: a `PeerLost`, or a failed collective or
    connection (torch's `DistError`, or gloo / NCCL's words in a `RuntimeError`), anywhere in its chain."""
    for link in _chain(error):
        if isinstance(link, PeerLost) or isinstance(link, getattr(dist, "DistError", ())):
            return True
        if type(link) is RuntimeError and (any(word in str(link).lower() for word in TRANSPORT_FAILURES)
                                           or _raised_in_collective(link)):
            return True
    return False


def _raised_in_collective(error: BaseException) -> bool:
    """Whether `error` was raised in torch's or TorchRec's distributed code (its innermost frame)."""
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ is not None else []
    return bool(frames) and any(part in frames[-1].filename.replace("\\", "/") for part in COLLECTIVE_CODE)


def _named_ranks(error: BaseException) -> tuple[int, ...]:
    """The culprits the first `SyncError` in `error`'s chain that names any (`SyncError.ranks`)."""
    for link in _chain(error):
        if isinstance(link, SyncError) and link.ranks:
            return link.ranks
    return ()


def _chain_has(error: BaseException, kind: type) -> bool:
    return any(isinstance(link, kind) for link in _chain(error))


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _text(error: BaseException) -> str:
    return str(error) if isinstance(error, SyncError) else repr(error)


def _parse(value: str, number: int) -> tuple[tuple[int, ...], str]:
    """The cause decided as `value` (`_claim`'s JSON). A value shadowgba does not write (another
    process wrote the store) is a cause of unknown culprits that says so, and is logged: `judge`
    never raises."""
    try:
        decided = json.loads(value)
        ranks, why = decided["ranks"], decided["why"]
        if type(ranks) is list and all(type(rank) is int for rank in ranks) and type(why) is str:
            return tuple(ranks), why
    except (ValueError, TypeError, KeyError, RecursionError):  # not JSON, or not a mapping of these keys
        pass
    why = f"the job's cause on the notice board ({CAUSE} {number}) is not one shadowgba writes: {value[:80]!r}"
    logger.warning("shadowgba: %s", why)
    return (), why

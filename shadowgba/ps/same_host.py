"""The PS channels' same-host fast path, in one place: every step of it that rests on the OS.

A trainer and a server on one host need not send tensors through TCP loopback. Each step below is
taken only once both ends found they share a host (the peer's offer names this host:
`network.host_identity`, the kernel's boot id and the network namespace), and none at all under
`sync.ps.same_host: false` (the transport's `lane_bytes` 0); otherwise the channel stays plain gloo
TCP, the path between hosts. What each step saves is measured in docs/benchmarks.md ("The parameter
server alone").

- **Lanes** (`shadowgba.ps.lane`): a shared-memory ring per direction, a file in /dev/shm that the
  peer maps; a message's large tensors are written there and read by the peer (two plain copies,
  against kernel copies and system calls on TCP). Its positions are published under the send lock
  and read after the frame that names them arrived, which orders them on x86 and on any CPU whose
  locks and socket calls are full barriers (the lane's module docstring).
- **Lent requests** (`IncomingLane.lend`): a server's services get a request's tensors as views of
  the lane, one copy fewer; a view's room is released when the tensor is garbage-collected (a
  weakref finalizer), never while a view is alive.
- **The board** (`shadowgba.ps.board`): what a server sends every trainer (its parameters), written
  once into a memfd that the trainers of its host map through `/proc/<pid>/fd/<fd>`; a frame names
  its place instead of carrying it.
- **gloo's loop thread at the lowest priority**: found by name in `/proc/self/task/*/comm`
  (`loop_threads`) when a channel's group is built, and reniced once both lanes are mapped
  (`lower_loop_priority`): it then only reads frames of a few hundred bytes.
"""

from __future__ import annotations

from typing import Iterable

from shadowgba.network import host_identity
from shadowgba.ps.board import Board, BoardView
from shadowgba.ps.lane import IncomingLane, OutgoingLane
from shadowgba.ps.wire import LaneOffer
from shadowgba.threads import renice, threads_named

LOOP_NICE = 19
"""Niceness given to a same-host channel's gloo event-loop thread once both lanes are mapped (the
lowest priority: it still runs every scheduling period, far inside any timeout here).

gloo's loop skips a ready socket whose pair another thread has locked (a send or a posted receive
of ours, a system call under the pair's lock) and polls again at once: while that thread is
preempted, as it often is with more busy threads than cores, the loop spins, and takes the core
from it. Between processes of one host the loop only reads frames of a few hundred bytes (the
tensors go through the lanes), so it loses nothing by yielding to every other thread; across hosts
it reads the tensors themselves and keeps its priority. Measured against RPC and against nice 10
in docs/benchmarks.md ("The gloo loop's priority lowered on same-host channels")."""

GLOO_LOOP_THREAD = "gloo_tcp_loop"
"""The name gloo gives the event-loop thread of each of its TCP devices (one per process group)."""


def loop_threads() -> set[int]:
    """Ids of this process's gloo event-loop threads (none where /proc cannot tell)."""
    return threads_named(GLOO_LOOP_THREAD)


def offer(lane: OutgoingLane | None, board: Board | None) -> LaneOffer:
    """What a channel side offers its peer at the start: this host, its outgoing lane and its board."""
    return LaneOffer(host_identity(), None if lane is None else lane.offer, None if board is None else board.offer)


def accept(offered: LaneOffer) -> tuple[IncomingLane | None, BoardView | None]:
    """The peer's lane and board mapped, each None when not offered, not on this host, or not openable."""
    if offered.host != host_identity():  # another network namespace sees the same files, yet is another host
        return None, None
    lane, board = offered.lane, offered.board
    return (None if lane is None else IncomingLane.open(*lane)), (None if board is None else BoardView.open(*board))


def lower_loop_priority(threads: Iterable[int]) -> None:
    """Renice gloo's loop threads `threads` to `LOOP_NICE`."""
    renice(threads, LOOP_NICE)

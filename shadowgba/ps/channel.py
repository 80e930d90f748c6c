"""A `Channel`: the link between one trainer and one server, a 2-rank gloo process group of its own.

    group = dist.ProcessGroupGloo(dist.PrefixStore(session_prefix, store), rank, 2, timeout)
    channel = Channel(group, rank, "ps0", on_request=serve, on_lost=forget)  # server rank 0, trainer 1
    reply = channel.request(body)              # a Future of the peer's `channel.reply(request_id, value)`

Built per trainer-server session (`shadowgba.ps.sessions`), as torchft's parameter server does: the
group carries nothing but this pair's messages, so it can be created and dropped with the session
while every other rank carries on. Only maintained torch.distributed primitives are used: a
ProcessGroupGloo over a PrefixStore, and its send / recv.

Framing (`shadowgba.ps.wire`): a message is a typed dataclass (`wire.MESSAGES`), one frame of at
most `FRAME_BYTES` holding its JSON header and small tensors; larger ones go through the same-host
lane, a staged receive buffer, or sends of their own, and a tensor on this side's board is named by
its place, not sent. Nothing is pickled: a value without a rule in `shadowgba.ps.codec` is refused
when it is sent, and a frame this wire did not write is refused when it arrives.

Invariants:
- Ordering: gloo matches sends and receives of one tag in posting order. Each side posts the parts
  of a message under one lock per direction (`_send_lock`), so parts of two messages never
  interleave on a tag; the receiver thread (one per side) posts the next frame's receive before it
  waits for the current message's tensors, so the next message never waits for a posted receive.
  Lane positions are taken under the same lock, so they grow in the order the frames are posted.
- Every send is waited for (a gloo send holds its buffer, and reports completion, only once
  waited): a request or reply by its sender, right after posting; a frame-only message that must
  not block (heartbeat, lane and close frames) once the peer's frames say they received it, when
  the wait returns at once. So a stopped peer blocks no pulse, and nothing is held for ever.
- A board tensor a frame names is kept by the channel until the peer's frames count that frame as
  decoded (a frame's count is sent back only after its tensors were copied out), so its region is
  never reused while the peer may read it; a channel that died drops them, and a peer that decodes
  such a frame late finds out (`board.StaleBoard`) and fails its channel.
- Several requests can be in flight: each carries an id, and a reply completes the future of its
  id, whatever the order the peer answers in (one reply message may answer several; the owner
  decides where a request runs: see `shadowgba.ps.transport`).
- Liveness: both sides send a heartbeat frame when they have sent nothing for `beat_s` (at most
  `PING_INTERVAL_S`, and a quarter of the peer's timeout; `pulse()`, driven by the owner's
  thread), so a receive that sees nothing for the group's timeout (`timeout_s`) means the peer is
  stopped or stuck; a killed peer's sockets close, and the receive fails at once. Either way the
  channel is dead: `on_lost` is called once and every pending future fails with `ChannelLost` naming the peer. A dead channel is never reused.
- Refusal: a message that is not this wire's (`wire.Malformed`: a foreign frame, a header that is
  not JSON, a spec that does not match, a value without a rule) is refused before anything in it is
  built or run: the channel fails with a `ChannelLost` whose `refused` is set and whose message
  names the peer and why, and tells the peer (CLOSE), whose pending requests then fail at once.
  The receiver thread ends normally; the owner's other channels are untouched.
- Closing: `close()` sends a CLOSE frame; the peer answers with its own and both receivers end
  (a gloo receive cannot be cancelled, only answered, failed by the peer, or timed out). A peer
  that is gone ends the receiver by failing it.
- Devices: payloads are CPU tensors and the channel stays gloo on CPU. With NCCL the same framing
  would need one NCCL communicator per pair and a CUDA stream per direction, and control frames
  would still want gloo: the parameter server's state is on the host, so it would only add copies.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from shadowgba.errors import PeerLost
from shadowgba.ps.board import Board, BoardView
from shadowgba.ps import same_host
from shadowgba.ps.lane import IncomingLane, OutgoingLane
from shadowgba.ps import wire
from shadowgba.ps.wire import (
    CLOSE, FRAMES_POSTED, HEADER_TAG, HEARTBEAT, LANE_ANSWER, LANE_OFFER, REPLY, REQUEST, STAGED_TAG, Answer, Close,
    Frame, Heartbeat, LaneAnswer, LaneOffer, Malformed, Reply, Request, Unencodable, as_bytes, encode,
)

PING_INTERVAL_S = 1.0
"""A side that sent nothing for this long sends a heartbeat (`pulse()`), or for a quarter of the
peer's silence limit if that is shorter (`Channel.beat_s`)."""
class ChannelLost(PeerLost):
    """The channel to a peer failed (its connection closed, it sent nothing for the timeout, or it
    sent a message this side refused)."""

    def __init__(self, message: str, timed_out: bool, refused: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out
        """Whether the peer fell silent (stopped or stuck) rather than closed its connection (gone)."""
        self.refused = refused
        """Whether this side closed the channel because the peer sent a message it refused."""


class Channel:
    """One side of a trainer-server link (see the module docstring): requests out, replies matched by
    id, requests in handed to `on_request(channel, request_id, body)`; `on_lost(channel, error)`
    once when the link fails (never after `close()`)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, peer: str,
                 on_request: Callable[["Channel", int, Any], None] | None = None,
                 on_lost: Callable[["Channel", ChannelLost], None] | None = None,
                 timeout_s: float = 60.0, peer_timeout_s: float = 60.0, lanes: bool = True,
                 loop_threads: Sequence[int] = (), lane_bytes: int | None = None, lend: bool = False,
                 board: Board | None = None) -> None:
        self.group, self.rank, self.peer = group, rank, peer
        """`peer`: how the other side is named in errors (e.g. `ps0` or `trainer 1 (rank 1)`)."""
        self._loop_threads = tuple(loop_threads)
        """Ids of the gloo event-loop threads of `group` (`sessions.session_group`), lowered to
        `same_host.LOOP_NICE` once both lanes are mapped."""
        self.timeout_s = timeout_s
        """How long this side's receive waits for any frame (the group's timeout)."""
        self.beat_s = min(PING_INTERVAL_S, peer_timeout_s / 4)
        """How long this side stays silent at most: a quarter of the peer's `timeout_s`, at most `PING_INTERVAL_S`."""
        self._on_request, self._on_lost = on_request, on_lost
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._pending: dict[int, torch.futures.Future] = {}
        self._ids = itertools.count()
        self._last_sent = time.monotonic()
        self.last_heard = time.monotonic()
        """When the last frame (message or heartbeat) arrived from the peer."""
        self._unsettled: collections.deque[tuple[int, Any]] = collections.deque()
        """(frame number, send) of the frames posted without waiting (heartbeats, lane and close
        frames: a stopped peer must not block the pulse). A gloo send is complete only once waited
        for, and holds its buffer until then; each is waited for (at once) when the peer's frames
        say it has arrived. Guarded by `_send_lock`."""
        self._frames_sent = 0
        """Frames posted to the peer; guarded by `_send_lock`."""
        self._frames_heard = 0
        """Frames received from the peer, a message's once decoded (sent back on every frame)."""
        self._peer_heard = 0
        """How many of this side's frames the peer has said it received."""
        self.failure: ChannelLost | None = None
        """Why the channel died; None while it is alive or was closed."""
        self._closing = False
        self._closed = threading.Event()
        """Set once the receiver has ended (the peer answered CLOSE, or the link failed)."""
        self._lane_out: OutgoingLane | None = OutgoingLane.create(lane_bytes) if lanes else None
        """This side's lane to the peer (`lane_bytes`; None: `LANE_BYTES`), offered at once; used once
        the peer has mapped it."""
        self._lane_in: IncomingLane | None = None
        """The peer's lane, once mapped (its offer came and the file was on this host)."""
        self._lend = lend
        """Whether the tensors that come through the peer's lane are handed over as views of it
        (`IncomingLane.lend`) instead of copies: for an owner that mostly reads them once and drops
        them (a server's services); one it keeps holds ring room, never a wrong value."""
        self._released_told = 0
        """The last `released` of the peer's lane sent on a frame; guarded by `_send_lock`."""
        self._board = board if lanes else None
        """This side's board (`shadowgba.ps.board`, a server's), offered at once: the tensors of
        this side's messages that lie on it are named, not sent, once the peer has mapped it."""
        self._board_accepted = False
        self._held: collections.deque[tuple[int, torch.Tensor]] = collections.deque()
        """(frame number, tensor) of the board tensors this side named, kept (so their region is not
        reused) until the peer's frames say it decoded that frame."""
        self._board_in: BoardView | None = None
        """The peer's board, once mapped."""
        self._receiver = threading.Thread(target=self._receive_loop, name=f"shadowgba-channel-{peer}", daemon=True)
        self._receiver.start()
        if self._lane_out is not None or self._board is not None:
            try:
                self._transmit(same_host.offer(self._lane_out, self._board), wait=False)
            except RuntimeError as error:
                self._fail(error)

    @property
    def lanes(self) -> tuple[bool, bool]:
        """Whether tensors travel through shared memory (this side's lane, the peer's): same host."""
        return self._lane_out is not None and self._lane_out.accepted, self._lane_in is not None

    def lane_buffers(self) -> dict[str, torch.Tensor]:
        """The shared memory this channel maps ("out": its own lane, "in": the peer's, "board": the
        peer's board), for memory accounts."""
        mapped = {"out": self._lane_out, "in": self._lane_in, "board": self._board_in}
        return {name: part.buffer for name, part in mapped.items() if part is not None}

    @property
    def alive(self) -> bool:
        """Whether messages can still be sent (not failed, not closing)."""
        return self.failure is None and not self._closing

    def request(self, body: Any) -> torch.futures.Future:
        """Send `body` as a request; a Future of the peer's reply value (`ChannelLost` if the channel dies)."""
        future: torch.futures.Future = torch.futures.Future()
        with self._state_lock:
            if not self.alive:
                future.set_exception(self._refusal())
                return future
            request_id = next(self._ids)
            self._pending[request_id] = future
        try:
            self._send(Request(request_id, body))
        except ChannelLost as error:
            self._settle(request_id, error)
        except Unencodable:  # nothing was sent: the caller learns why at once
            with self._state_lock:
                self._pending.pop(request_id, None)
            raise
        return future

    def reply(self, request_id: int, value: Any, *more: tuple[int, Any]) -> None:
        """Answer request `request_id` with `value`, and each (request id, value) of `more` in the
        same message; dropped when the channel is dead (the peer retries)."""
        try:
            self._send(Reply((Answer(request_id, value), *(Answer(*answer) for answer in more))))
        except ChannelLost:
            pass

    def pulse(self) -> None:
        """Send a heartbeat if nothing was sent for `beat_s` (the owner calls this often)."""
        if not self.alive or time.monotonic() - self._last_sent < self.beat_s:
            return
        try:
            self._transmit(Heartbeat(), wait=False)
        except RuntimeError as error:
            self._fail(error)

    def is_receiver_thread(self) -> bool:
        """Whether the calling thread is this channel's receiver (the one `on_request` runs on)."""
        return threading.current_thread() is self._receiver

    def pending(self) -> int:
        """How many requests wait for their reply."""
        with self._state_lock:
            return len(self._pending)

    def wait_closed(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the receiver to end (the peer closed, or the link failed).

        Waits for its thread to return, not only for the flag: the thread's last lines free gloo
        works, whose destructor takes the GIL, and a thread that takes the GIL while the interpreter
        exits aborts the whole process."""
        deadline = time.monotonic() + timeout_s
        if not self._closed.wait(timeout_s):
            return False
        if threading.current_thread() is not self._receiver:
            self._receiver.join(max(deadline - time.monotonic(), 0.0))
        return not self._receiver.is_alive() or threading.current_thread() is self._receiver

    def close(self, wait_s: float = 0.0) -> None:
        """End the channel: no new requests; CLOSE is sent, and the receiver ends when the peer answers
        (or fails). Waits up to `wait_s` for that; pending requests fail with `ChannelLost`."""
        with self._state_lock:
            if self._closing or self.failure is not None:
                already = True
            else:
                already, self._closing = False, True
        if not already:
            self._send_close()
        self._fail_pending(self._refusal())
        self.wait_closed(wait_s)

    def _refusal(self) -> ChannelLost:
        if self.failure is not None:
            return self.failure
        return ChannelLost(f"the channel to {self.peer} is closed", timed_out=False)

    def _send(self, message: Request | Reply) -> None:
        try:
            try:
                self._transmit(message)
            except Unencodable as error:  # an unencodable reply: the caller gets why, not a hang
                if not isinstance(message, Reply):
                    raise
                if len(message.answers) > 1:  # alone, only the unencodable one is answered with why
                    for answer in message.answers:
                        self._send(Reply((answer,)))
                    return
                [answer] = message.answers
                self._transmit(Reply((Answer(answer.request_id, RuntimeError(f"unencodable reply: {error}")),)))
        except RuntimeError as error:
            raise self._fail(error) from error

    def _transmit(self, message: Any, wait: bool = True) -> None:
        """Encode a message and post every part of it, under the send lock: parts of two messages
        never interleave, and lane positions are taken in posting order. Then wait until it is
        sent, or (`wait` False: a frame-only message) leave it to `_unsettled`."""
        peer = 1 - self.rank
        with self._send_lock:
            while self._unsettled and self._unsettled[0][0] < self._peer_heard:  # arrived: the wait returns at once
                self._unsettled.popleft()[1].wait()
            lane_in = self._lane_in
            released = 0 if lane_in is None else lane_in.released
            encoded = encode(message, self._lane_out, released, self._frames_heard,
                             self._board if self._board_accepted else None)
            self._released_told = released
            self._held.extend((self._frames_sent, tensor) for tensor in encoded.held)
            works = [self.group.send([encoded.frame], peer, 0)]
            if encoded.header is not None:
                works.append(self.group.send([encoded.header], peer, HEADER_TAG))
            works.extend(self.group.send([tensor], peer, tag) for tensor, tag in encoded.sends)
            self._last_sent = time.monotonic()
            if not wait:
                self._unsettled.extend((self._frames_sent, work) for work in works)
            self._frames_sent += 1
        if wait:
            for work in works:
                work.wait()

    def _receive_loop(self) -> None:
        peer = 1 - self.rank
        buffers = [torch.empty(wire.FRAME_BYTES, dtype=torch.uint8) for _ in range(FRAMES_POSTED + 1)]  # read now
        views = {id(buffer): as_bytes(buffer) for buffer in buffers}
        posted = collections.deque((buffer, self.group.recv([buffer], peer, 0)) for buffer in buffers[:-1])
        spare = buffers[-1]
        staged = torch.empty(wire.STAGED_BYTES, dtype=torch.uint8)
        staged_work = self.group.recv([staged], peer, STAGED_TAG)
        try:
            while True:
                frame, work = posted.popleft()
                work.wait()
                self.last_heard = time.monotonic()
                current = Frame.read(views[id(frame)], self.peer)
                if current.kind not in (REQUEST, REPLY):
                    self._frames_heard += 1
                self._peer_heard = max(self._peer_heard, current.heard)
                while self._held and self._held[0][0] < self._peer_heard:  # decoded: their regions may be reused
                    self._held.popleft()
                if self._lane_out is not None:
                    self._lane_out.release(current.released)
                header = None
                if current.kind in (REQUEST, REPLY) and not current.header_in_frame:
                    header = torch.empty(current.header_length, dtype=torch.uint8)
                    self.group.recv([header], peer, HEADER_TAG).wait()
                if current.kind == CLOSE:
                    break
                posted.append((spare, self.group.recv([spare], peer, 0)))  # before this message's tensors
                spare = frame  # free again once this frame is read, when the next one is taken
                if current.kind == HEARTBEAT:
                    continue
                if current.kind in (LANE_OFFER, LANE_ANSWER):
                    self._settle_lanes(current.decode(current.header_bytes(header), None, self._receive_apart))
                    continue
                if current.staged >= 0:  # this message's first large tensor is in the staged buffer
                    staged_work.wait()
                message = current.decode(current.header_bytes(header), staged, self._receive_apart, self._lane_in,
                                         self._lend, self._board_in)
                self._frames_heard += 1  # counted once decoded: the peer then frees what it named on its board
                if current.staged >= 0:  # copied out: the buffer takes the next one
                    staged_work = self.group.recv([staged], peer, STAGED_TAG)
                self.last_heard = time.monotonic()
                self._deliver(message)
                message = None  # lent tensors the owner did not keep return to the lane now
                if self._lend and self._lane_in is not None and self._lane_in.worth_telling(self._released_told):
                    self._transmit(Heartbeat(), wait=False)
        except Malformed as error:  # the peer's bytes, not this wire's: nothing of them was built
            self._fail(error)
            self._send_close()  # the peer's pending requests fail at once, not after its timeout
            return
        except Exception as error:  # noqa: BLE001 (gloo raises RuntimeError; a service's callback anything)
            self._fail(error)
            return
        finally:
            if self._lane_out is not None:  # an offer the peer never mapped leaves no file behind
                self._lane_out.close()
            self._held.clear()  # the peer reads no more
            self._closed.set()
        with self._state_lock:  # the peer closed: answer once, unless this side closed first
            answered, self._closing = self._closing, True
        if not answered:
            self._send_close()
        self._fail_pending(self._refusal())

    def _send_close(self) -> None:
        """Post CLOSE without waiting (a peer that is gone fails the receiver instead)."""
        try:
            self._transmit(Close(), wait=False)
        except RuntimeError:
            pass

    def _settle_lanes(self, message: LaneOffer | LaneAnswer) -> None:
        """The peer offered its lane and board (map them, answer whether that worked) or answered
        this side's offer."""
        if isinstance(message, LaneOffer):
            self._lane_in, self._board_in = same_host.accept(message)
            self._transmit(LaneAnswer(self._lane_in is not None, self._board_in is not None), wait=False)
        else:
            lane_mapped, self._board_accepted = message.lane, message.board
            if self._lane_out is not None and lane_mapped:
                self._lane_out.accepted = True
            elif self._lane_out is not None:  # another host: tensors stay on gloo
                self._lane_out.close()
                self._lane_out = None
        if self.lanes == (True, True):  # each side settles once: the loop only reads frames now
            same_host.lower_loop_priority(self._loop_threads)

    def _receive_apart(self, tensors: list[tuple[torch.Tensor, int]]) -> None:
        peer = 1 - self.rank
        works = [self.group.recv([tensor], peer, tag) for tensor, tag in tensors]
        for work in works:
            work.wait()

    def _deliver(self, message: Request | Reply) -> None:
        if isinstance(message, Reply):
            for answer in message.answers:
                with self._state_lock:
                    future = self._pending.pop(answer.request_id, None)
                if future is not None:
                    future.set_result(answer.value)
            return
        if self._on_request is not None:
            self._on_request(self, message.request_id, message.body)

    def _settle(self, request_id: int, error: ChannelLost) -> None:
        with self._state_lock:
            future = self._pending.pop(request_id, None)
        if future is not None:
            future.set_exception(error)

    def _fail(self, error: BaseException) -> ChannelLost:
        """The link failed with `error`: mark the channel dead (once), fail every pending request, tell the owner."""
        with self._state_lock:
            first = self.failure is None and not self._closing
            if first and isinstance(error, Malformed):
                self.failure = ChannelLost(f"{first_line(error)}; the channel to {self.peer} is closed", False, True)
            elif first:
                timed_out = "timed out" in str(error).lower() or "timeout" in str(error).lower()
                self.failure = ChannelLost(
                    f"{self.peer} {'sent nothing for ' + format(self.timeout_s, 'g') + ' s' if timed_out else 'closed its connection'}"
                    f" ({first_line(error)})", timed_out)
            failure = self._refusal()
        self._fail_pending(failure)
        if first and self._on_lost is not None:
            self._on_lost(self, failure)
        return failure

    def _fail_pending(self, error: ChannelLost) -> None:
        with self._state_lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(error)


def first_line(error: BaseException) -> str:
    """The first line of an error's message (gloo's carry C++ context after it), or its type."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__

"""The PS channel's wire format: how one message becomes a frame and the tensors sent beside it.

A message is one uint8 frame of at most `FRAME_BYTES` (a few int64
words: kind, header length, tensor count, which tensor is staged, and two acknowledgements; then
the pickled header, whose tensors are placeholders with their dtype, shape and place; then the
tensors of up to `INLINE_TENSOR_BYTES` each, copied in). Larger tensors go, in this order of
preference: through the same-host lane (`shadowgba.ps.lane`: a shared-memory ring each side offers
the other when the channel opens; the peer maps it only if it is on the same host), the first one
of up to `STAGED_BYTES` into a receive buffer the peer posted in advance, the rest on a tag each,
received straight into their own memory once the frame has arrived. Why: gloo sends a message only
once its receive is posted, so a tensor whose receive is posted after the frame arrived costs a
round trip of wake-ups (gloo's loop thread, then the waiting one) on top of its bytes; a copy is
cheaper below a few MB, the round trip above; and between processes of one host, shared memory
costs two plain copies where TCP loopback costs kernel copies and system calls. A small call is a
single gloo message each way. A header too long for the frame is sent apart too. A side built with
`lend` (a server's: its services read a request's tensors once) takes the tensors of the peer's
lane as views of it, one copy fewer, each held in the lane until dropped (`IncomingLane.lend`).
A tensor that lies on this side's board (`shadowgba.ps.board`: a server's parameters, the same
for every trainer) is not copied at all once the peer has mapped the board: the frame names its place.

Decoding reads only the frame's own header and the places it names: `Frame.read`, then
`Frame.decode`, which the channel's receiver thread drives (`shadowgba.ps.channel`).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import struct
from typing import Any, Callable

import torch

from shadowgba.ps.board import Board, BoardView
from shadowgba.ps.lane import IncomingLane, OutgoingLane

FRAME_BYTES = 256 << 10
"""The most a frame holds; `FRAMES_POSTED` receive buffers of this size per channel side are posted
in advance and reused, and one more is read meanwhile."""
INLINE_TENSOR_BYTES = 64 << 10
"""A tensor up to this size rides in its message's frame (copied in and out: cheaper than a send of
its own, whose receive is posted only once the frame has arrived, a round trip of wake-ups)."""
STAGED_BYTES = 4 << 20
"""The receive buffer posted in advance for each message's first large tensor up to this size, so
that it needs no round trip before it is sent; copied out into a tensor of its own (a view would
keep, and `torch.save` would write, the whole buffer) and posted again. One per channel side.
Larger tensors are received straight into their own memory: past a few MB the copy costs more
than the round trip (measured with benchmarks/bench_ps.py)."""
_WORDS = 6
"""int64 words at the start of a frame: kind, header length, tensor count, index of the staged tensor
(-1: none), how far the sender has read the receiver's lane (`IncomingLane.released`), and how many
frames the sender has received (its sends that are known to have arrived)."""
_WORDS_FORMAT = struct.Struct(f"<{_WORDS}q")
_HEAD_BYTES = _WORDS_FORMAT.size
_ALIGN = 16
"""Inline tensors start at offsets that are multiples of this (any dtype's element size divides it)."""
FRAMES_POSTED = 2
"""Frame receives a side keeps posted: one more than the frame being read, so that a peer that
sends two messages at once (a push and a watch) finds a receive for each."""
HEADER_TAG, STAGED_TAG, FIRST_APART_TAG = 1, 2, 3
INLINE, STAGED, APART, SHARED, BOARD = range(5)
"""Where a tensor of a message travels: in the frame, into the staged buffer, in a send of its own,
through the same-host lane (`shadowgba.ps.lane`), or not at all: it lies on the sender's board
(`shadowgba.ps.board`), which the peer maps."""

HEARTBEAT, REQUEST, REPLY, CLOSE, LANE_OFFER, LANE_ANSWER = range(6)
"""Frame kinds. A side offers its outgoing lane and its board (if it has them) once, at the start,
with its `host_identity`; the peer maps them only on the same host, and answers whether it mapped each."""


class Unencodable(Exception):
    """A message could not be encoded (its cause says why): nothing of it was sent."""


class _Pickler(pickle.Pickler):
    """Pickles a header, replacing each tensor by its index in `tensors` (sent as itself)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []

    def persistent_id(self, obj: Any) -> int | None:
        if not isinstance(obj, torch.Tensor):
            return None
        if obj.device.type != "cpu" or obj.layout != torch.strided:
            raise TypeError(f"the PS channel carries dense CPU tensors, got one on {obj.device} ({obj.layout})")
        self.tensors.append(obj.detach().contiguous())
        return len(self.tensors) - 1


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, index: int) -> torch.Tensor:
        return self.tensors[index]


@dataclasses.dataclass
class Encoded:
    """One message ready to send: its frame, its header when not in the frame, and (tensor, tag) of
    every tensor sent apart from the frame."""

    frame: torch.Tensor
    header: torch.Tensor | None
    sends: list[tuple[torch.Tensor, int]]
    held: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Tensors named on the sender's board: to be kept until the peer has decoded the message."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def encode(kind: int, body: Any, lane: OutgoingLane | None = None, released: int = 0, heard: int = 0,
           board: Board | None = None) -> Encoded:
    """The parts of a message of `kind` carrying `body` (any picklable object holding CPU tensors);
    tensors too large for the frame and lying on `board` (the peer maps it) are named by their
    place there, others go into `lane` where it has room (written here: call under the send lock,
    in posting order). `released`, `heard`: how far this side has read the peer's lane, and how many
    of its frames it has decoded."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(body)
    tensors = pickler.tensors
    header_room = FRAME_BYTES - _HEAD_BYTES
    body_bytes = buffer.getvalue()
    # where each tensor goes: the frame's room is known once the header is, and the header holds
    # the places, so small tensors are placed against the room left by a header with every place
    places, positions, staged, room = [], [-1] * len(tensors), -1, header_room - len(body_bytes) - 80 * (len(tensors) + 1)
    held = []
    for index, tensor in enumerate(tensors):
        nbytes = _nbytes(tensor)
        if nbytes <= INLINE_TENSOR_BYTES and _aligned(nbytes) <= room:
            places.append(INLINE)
            room -= _aligned(nbytes)
        elif board is not None and (position := board.position_of(tensor)) is not None:
            places.append(BOARD)
            positions[index] = position
            held.append(tensor)
        elif lane is not None and nbytes and (position := lane.reserve(nbytes)) is not None:
            places.append(SHARED)
            positions[index] = position
            lane.write(position, tensor)
        elif staged < 0 and nbytes <= STAGED_BYTES:
            places.append(STAGED)
            staged = index
        else:
            places.append(APART)
    header = _header(tensors, places, positions, body_bytes)
    size = _aligned(_HEAD_BYTES + len(header))
    inline = [tensor for tensor, place in zip(tensors, places) if place == INLINE]
    if size + sum(_aligned(_nbytes(tensor)) for tensor in inline) > FRAME_BYTES:  # the estimate fell short
        places = [APART if place == INLINE else place for place in places]
        header, inline = _header(tensors, places, positions, body_bytes), []
    header_in_frame = len(header) <= header_room
    size = _aligned(_HEAD_BYTES + len(header)) if header_in_frame else _HEAD_BYTES
    # the frame is built as bytes (struct and buffer copies): torch ops on tiny tensors would cost
    # more than the rest of a small call's framing
    frame = bytearray(size + sum(_aligned(_nbytes(tensor)) for tensor in inline))
    _WORDS_FORMAT.pack_into(frame, 0, kind, len(header), len(tensors), staged, released, heard)
    if header_in_frame:
        frame[_HEAD_BYTES:_HEAD_BYTES + len(header)] = header
    offset = size
    for tensor in inline:
        nbytes = _nbytes(tensor)
        if nbytes:
            frame[offset:offset + nbytes] = as_bytes(tensor)
        offset += _aligned(nbytes)
    sends = [(tensor, STAGED_TAG if place == STAGED else FIRST_APART_TAG + index)
             for index, (tensor, place) in enumerate(zip(tensors, places)) if place in (STAGED, APART) and _nbytes(tensor)]
    header_tensor = None if header_in_frame else torch.frombuffer(bytearray(header), dtype=torch.uint8)
    return Encoded(torch.frombuffer(frame, dtype=torch.uint8), header_tensor, sends, held)


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes as a buffer (a view of its memory, no copy; any dtype)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _header(tensors: list[torch.Tensor], places: list[int], positions: list[int], body: bytes) -> bytes:
    """A message's header: each tensor's dtype, shape, place and lane position, then the pickled body."""
    specs = [(tensor.dtype, tuple(tensor.shape), place, position)
             for tensor, place, position in zip(tensors, places, positions)]
    return pickle.dumps(specs, protocol=pickle.HIGHEST_PROTOCOL) + body


@dataclasses.dataclass
class Frame:
    """A received frame, read: what else to receive for its message, and how to rebuild it."""

    frame: memoryview
    """The frame's bytes (a view of the receive tensor)."""
    kind: int
    header_length: int
    count: int
    staged: int
    """Index of the tensor received into the staged buffer; -1 when none is."""
    released: int
    """How far the sender has read this side's lane."""
    heard: int
    """How many of this side's frames the sender has received."""

    @classmethod
    def read(cls, frame: torch.Tensor | memoryview) -> "Frame":
        """`frame`: the received tensor, or a buffer view of it (the receiver keeps one per buffer)."""
        view = as_bytes(frame) if isinstance(frame, torch.Tensor) else frame
        return cls(view, *_WORDS_FORMAT.unpack_from(view, 0))

    @property
    def header_in_frame(self) -> bool:
        return self.header_length <= FRAME_BYTES - _HEAD_BYTES

    def header_bytes(self, header: torch.Tensor | None) -> bytes:
        if header is None:
            return bytes(self.frame[_HEAD_BYTES:_HEAD_BYTES + self.header_length])
        return bytes(as_bytes(header))

    def decode(self, header: bytes, staged: torch.Tensor | None,
               receive: Callable[[list[tuple[torch.Tensor, int]]], None], lane: IncomingLane | None = None,
               lend: bool = False, board: BoardView | None = None) -> Any:
        """The message's body: inline tensors copied out of the frame, the staged one out of `staged`
        (its receive buffer), shared ones out of `lane` (`lend`: views of it, no copy), those on the
        peer's board out of `board`, the others received by `receive([(tensor, tag), ...])`."""
        stream = io.BytesIO(header)
        specs: list[tuple[torch.dtype, tuple[int, ...], int, int]] = pickle.load(stream)
        tensors, apart = [], []
        offset = _aligned(_HEAD_BYTES + self.header_length)
        for index, (dtype, shape, place, position) in enumerate(specs):
            if place == SHARED and lane is None:
                raise RuntimeError("the peer sent a tensor through a lane this side never mapped")
            if place == SHARED and lend:
                tensors.append(lane.lend(position, dtype, shape))
                continue
            tensor = torch.empty(shape, dtype=dtype)
            nbytes = _nbytes(tensor)
            if place == SHARED:
                lane.read(position, tensor)
            elif place == BOARD:
                if board is None:
                    raise RuntimeError("the peer named a tensor on a board this side never mapped")
                board.read(position, tensor)
            elif place == STAGED and nbytes:
                tensor.reshape(-1).view(torch.uint8).copy_(staged[:nbytes])
            elif place == INLINE:
                if nbytes:
                    as_bytes(tensor)[:] = self.frame[offset:offset + nbytes]
                offset += _aligned(nbytes)
            elif place == APART and nbytes:
                apart.append((tensor, FIRST_APART_TAG + index))
            tensors.append(tensor)
        receive(apart)
        return _Unpickler(stream, tensors).load()

"""The PS channel's wire format: how one typed message becomes a frame and the tensors sent beside it.

A message is one of the dataclasses of `MESSAGES` (a request, a reply, a heartbeat ...), and nothing
else. It travels as one uint8 frame of at most `FRAME_BYTES`: a few int64 words (`MAGIC`,
`WIRE_VERSION`, its kind, header length, tensor count, which tensor is staged, two
acknowledgements); then its header, JSON: `[specs, fields]`, each tensor's spec `[dtype, shape,
place, position]` and the message's fields encoded by `shadowgba.ps.codec` (tensors named by their
index, never pickled: a frame's bytes can build data, never run code); then the tensors of up to
`INLINE_TENSOR_BYTES` each, copied in. Larger tensors go, in this order of
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

Decoding reads only the frame's own header and the places it names: `Frame.read` (the words: a
foreign magic or another version is refused), `Frame.specs` (the JSON and every tensor spec checked
before any tensor is received), then `Frame.decode`, which the channel's receiver thread drives
(`shadowgba.ps.channel`). Anything that is not what this module writes raises `Malformed` naming
the peer it came from; the channel then closes, and nothing the message carried was built.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any, Callable

import torch

from shadowgba.ps import codec
from shadowgba.ps.board import Board, BoardView
from shadowgba.ps.codec import Malformed, Unencodable
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
MAGIC = int.from_bytes(b"sgbawire", "little")
"""The first word of every frame: a frame that does not start with it is not this wire's."""
WIRE_VERSION = 3
"""The frame layout and message fields this side speaks (2: the fields by name, each tagged; 1: a
pickled header); a frame of another version is refused, naming both."""
_WORDS = 8
"""int64 words at the start of a frame: `MAGIC`, `WIRE_VERSION`, kind, header length, tensor count,
index of the staged tensor (-1: none), how far the sender has read the receiver's lane
(`IncomingLane.released`), and how many frames the sender has received (its sends that are known
to have arrived)."""
_WORDS_FORMAT = struct.Struct(f"<{_WORDS}q")
_HEAD_BYTES = _WORDS_FORMAT.size
_ALIGN = 16
"""Inline tensors start at offsets that are multiples of this (any dtype's element size divides it)."""
MAX_HEADER_BYTES = 256 << 20
"""The longest header a frame may announce (one too long for the frame is received apart, into
memory of that size): far above any message's, and a bound on what a peer's word can allocate."""
FRAMES_POSTED = 2
"""Frame receives a side keeps posted: one more than the frame being read, so that a peer that
sends two messages at once (a push and a watch) finds a receive for each."""
HEADER_TAG, STAGED_TAG, FIRST_APART_TAG = 1, 2, 3
INLINE, STAGED, APART, SHARED, BOARD = range(5)
"""Where a tensor of a message travels: in the frame, into the staged buffer, in a send of its own,
through the same-host lane (`shadowgba.ps.lane`), or not at all: it lies on the sender's board
(`shadowgba.ps.board`), which the peer maps."""


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """Nothing to say: the sender is alive (and its words acknowledge the peer's frames)."""


@dataclasses.dataclass(frozen=True)
class Request:
    """A call: `body` (any value the codec encodes) for the peer's owner, answered by `request_id`."""

    request_id: int
    body: Any


@dataclasses.dataclass(frozen=True)
class Answer:
    """The value that answers request `request_id`."""

    request_id: int
    value: Any


@dataclasses.dataclass(frozen=True)
class Reply:
    """One or more answers, in one message."""

    answers: tuple[Answer, ...]


@dataclasses.dataclass(frozen=True)
class Close:
    """The sender ends the channel; the peer answers with its own."""


@dataclasses.dataclass(frozen=True)
class LaneOffer:
    """The sender's host (`network.host_identity`), outgoing lane (path, size, token) and board
    (pid, fd, size, token), each None when it has none: sent once, at the start (`shadowgba.ps.same_host`)."""

    host: str
    lane: tuple[str, int, bytes] | None
    board: tuple[int, int, int, bytes] | None


@dataclasses.dataclass(frozen=True)
class LaneAnswer:
    """Whether the sender mapped the peer's lane and its board."""

    lane: bool
    board: bool


HEARTBEAT, REQUEST, REPLY, CLOSE, LANE_OFFER, LANE_ANSWER = range(6)
"""Frame kinds. A side offers its outgoing lane and its board (if it has them) once, at the start,
with its `host_identity`; the peer maps them only on the same host, and answers whether it mapped each."""
MESSAGES: dict[int, type] = {HEARTBEAT: Heartbeat, REQUEST: Request, REPLY: Reply, CLOSE: Close,
                             LANE_OFFER: LaneOffer, LANE_ANSWER: LaneAnswer}
"""The message kinds that may travel, by frame kind: a frame of any other kind is refused."""
_KINDS = {cls: kind for kind, cls in MESSAGES.items()}
_json = json.JSONEncoder(separators=(",", ":")).encode
"""Compact JSON, by one encoder made once (`json.dumps` with options builds one per call)."""


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


def encode(message: Any, lane: OutgoingLane | None = None, released: int = 0, heard: int = 0,
           board: Board | None = None) -> Encoded:
    """The parts of `message` (an instance of one of `MESSAGES`, whose values hold CPU tensors);
    tensors too large for the frame and lying on `board` (the peer maps it) are named by their
    place there, others go into `lane` where it has room (written here: call under the send lock,
    in posting order). `released`, `heard`: how far this side has read the peer's lane, and how many
    of its frames it has decoded. `Unencodable` (nothing was written) for a value without a rule."""
    kind = _KINDS[type(message)]
    tensors: list[torch.Tensor] = []
    fields = _json(codec.encode_fields(message, tensors))
    header_room = FRAME_BYTES - _HEAD_BYTES
    # where each tensor goes: the frame's room is known once the header is, and the header holds
    # the places, so small tensors are placed against the room left by a header with every place
    places, positions, staged = [], [-1] * len(tensors), -1
    room = header_room - len(fields) - 80 * (len(tensors) + 1)
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
    header = _header(tensors, places, positions, fields)
    size = _aligned(_HEAD_BYTES + len(header))
    inline = [tensor for tensor, place in zip(tensors, places) if place == INLINE]
    if size + sum(_aligned(_nbytes(tensor)) for tensor in inline) > FRAME_BYTES:  # the estimate fell short
        places = [APART if place == INLINE else place for place in places]
        header, inline = _header(tensors, places, positions, fields), []
    header_in_frame = len(header) <= header_room
    size = _aligned(_HEAD_BYTES + len(header)) if header_in_frame else _HEAD_BYTES
    # the frame is built as bytes (struct and buffer copies): torch ops on tiny tensors would cost
    # more than the rest of a small call's framing
    frame = bytearray(size + sum(_aligned(_nbytes(tensor)) for tensor in inline))
    _WORDS_FORMAT.pack_into(frame, 0, MAGIC, WIRE_VERSION, kind, len(header), len(tensors), staged, released, heard)
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


def _header(tensors: list[torch.Tensor], places: list[int], positions: list[int], fields: str) -> bytes:
    """A message's header: JSON of each tensor's dtype, shape, place and lane position, then its
    fields (`fields`: their JSON already)."""
    specs = [[codec.dtype_name(tensor.dtype), list(tensor.shape), place, position]
             for tensor, place, position in zip(tensors, places, positions)]
    return f"[{_json(specs)},{fields}]".encode()


@dataclasses.dataclass(frozen=True)
class Spec:
    """Where one tensor of a received message is, and what it is (checked: `Frame.specs`)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    place: int
    position: int

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


@dataclasses.dataclass
class Frame:
    """A received frame, read: what else to receive for its message, and how to rebuild it."""

    frame: memoryview
    """The frame's bytes (a view of the receive tensor)."""
    source: str
    """Who sent it (the peer's name in errors)."""
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
    def read(cls, frame: torch.Tensor | memoryview, source: str) -> "Frame":
        """`frame`: the received tensor, or a buffer view of it (the receiver keeps one per buffer);
        `source` names the sender. `Malformed` for a frame this wire did not write (magic, version,
        kind, counts, or a header longer than `MAX_HEADER_BYTES`)."""
        view = as_bytes(frame) if isinstance(frame, torch.Tensor) else frame
        magic, version, *words = _WORDS_FORMAT.unpack_from(view, 0)
        if magic != MAGIC:
            raise Malformed(f"refused a frame from {source}: it does not start with this wire's magic "
                            f"(0x{magic & (1 << 64) - 1:016x}), so it is no shadowgba PS message")
        if version != WIRE_VERSION:
            raise Malformed(f"refused a frame from {source}: wire version {version}, this side speaks {WIRE_VERSION} "
                            "(run the same shadowgba on every rank)")
        read = cls(view, source, *words)
        if read.kind not in MESSAGES or not 0 <= read.header_length <= MAX_HEADER_BYTES or read.count < 0 \
                or not -1 <= read.staged < read.count:
            raise Malformed(f"refused a frame from {source}: kind {read.kind}, header of {read.header_length} bytes, "
                            f"{read.count} tensors, staged {read.staged}")
        return read

    @property
    def header_in_frame(self) -> bool:
        return self.header_length <= FRAME_BYTES - _HEAD_BYTES

    def header_bytes(self, header: torch.Tensor | None) -> bytes:
        if header is None:
            return bytes(self.frame[_HEAD_BYTES:_HEAD_BYTES + self.header_length])
        return bytes(as_bytes(header))

    def specs(self, header: bytes) -> tuple[list[Spec], Any]:
        """The header parsed: every tensor's spec, checked against the frame (count, places, sizes),
        and the message's fields, still encoded. `Malformed` naming the source for anything else."""
        try:
            parsed = json.loads(header)
        except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
            raise Malformed(f"refused a message from {self.source}: its header is not JSON ({str(error)[:80]})") from None
        if type(parsed) is not list or len(parsed) != 2 or type(parsed[0]) is not list or len(parsed[0]) != self.count:
            raise Malformed(f"refused a message from {self.source}: its header is not [specs of its {self.count} "
                            "tensors, fields]")
        specs = [self._spec(index, spec) for index, spec in enumerate(parsed[0])]
        inline = [_aligned(spec.nbytes) for spec in specs if spec.place == INLINE]
        if inline and _aligned(_HEAD_BYTES + self.header_length) + sum(inline) > FRAME_BYTES:
            raise Malformed(f"refused a message from {self.source}: its inline tensors overrun the frame")
        return specs, parsed[1]

    def _spec(self, index: int, spec: Any) -> Spec:
        try:
            name, shape, place, position = spec
            checked = Spec(codec.dtype_named(name), tuple(shape), place, position)
        except (TypeError, ValueError) as error:
            raise Malformed(f"refused a message from {self.source}: tensor {index}'s spec {spec!r:.80} ({error})") from None
        sizes_ok = all(type(size) is int and size >= 0 for size in checked.shape)
        where_ok = type(place) is int and place in (INLINE, STAGED, APART, SHARED, BOARD) and type(position) is int \
            and (position >= 0 if place in (SHARED, BOARD) else position == -1)
        staged_ok = (place == STAGED) == (index == self.staged) and (place != STAGED or checked.nbytes <= STAGED_BYTES)
        if not (sizes_ok and where_ok and staged_ok):
            raise Malformed(f"refused a message from {self.source}: tensor {index}'s spec {spec!r:.80} does not match "
                            "the frame (shape, place, position or staged index)")
        return checked

    def decode(self, header: bytes, staged: torch.Tensor | None,
               receive: Callable[[list[tuple[torch.Tensor, int]]], None], lane: IncomingLane | None = None,
               lend: bool = False, board: BoardView | None = None) -> Any:
        """The message: inline tensors copied out of the frame, the staged one out of `staged`
        (its receive buffer), shared ones out of `lane` (`lend`: views of it, no copy), those on the
        peer's board out of `board`, the others received by `receive([(tensor, tag), ...])`; then
        its fields decoded (`shadowgba.ps.codec`). `Malformed` naming the source for a header that
        is not this wire's, before any tensor is received."""
        specs, fields = self.specs(header)
        if any(spec.place == SHARED for spec in specs) and lane is None:
            raise Malformed(f"refused a message from {self.source}: a tensor in a lane this side never mapped")
        if any(spec.place == BOARD for spec in specs) and board is None:
            raise Malformed(f"refused a message from {self.source}: a tensor on a board this side never mapped")
        tensors, apart = [], []
        offset = _aligned(_HEAD_BYTES + self.header_length)
        for index, spec in enumerate(specs):
            if spec.place == SHARED and lend:
                tensors.append(lane.lend(spec.position, spec.dtype, spec.shape))
                continue
            tensor = torch.empty(spec.shape, dtype=spec.dtype)
            nbytes = _nbytes(tensor)
            if spec.place == SHARED:
                lane.read(spec.position, tensor)
            elif spec.place == BOARD:
                board.read(spec.position, tensor)
            elif spec.place == STAGED and nbytes:
                tensor.reshape(-1).view(torch.uint8).copy_(staged[:nbytes])
            elif spec.place == INLINE:
                if nbytes:
                    as_bytes(tensor)[:] = self.frame[offset:offset + nbytes]
                offset += _aligned(nbytes)
            elif spec.place == APART and nbytes:
                apart.append((tensor, FIRST_APART_TAG + index))
            tensors.append(tensor)
        receive(apart)
        return codec.decode_fields(MESSAGES[self.kind], fields, tensors, self.source)

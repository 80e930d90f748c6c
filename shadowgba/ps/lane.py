"""Shared-memory lanes: a `Channel`'s large tensors between two processes of one host, without TCP.

    lane = OutgoingLane.create()                 # the writer: a ring in /dev/shm, offered to the peer
    peer_lane = IncomingLane.open(*lane.offer)   # the reader, if it sees the same file: maps it
    position = lane.reserve(nbytes)              # writer, under its send lock: where the tensor goes
    lane.write(position, tensor); ...            # then the frame naming `position` is sent
    peer_lane.read(position, out)                # reader, once that frame arrived; its later
    lane.release(peer_lane.released)             #   frames carry `released` back to the writer
    view = peer_lane.lend(position, dtype, shape)  # or: no copy, the bytes stay the reader's until
                                                   #   `view` (and every view of it) is dropped

Why: between two processes of one host, gloo's TCP loopback costs a kernel copy on each side,
system calls and wake-ups of gloo's loop threads per tensor: at 1 MB more than twice the two
plain copies into and out of shared memory (TensorPipe, the transport under PyTorch's RPC, has the same
shortcut). Across hosts the file is not there, the peer refuses the offer, and the channel's
tensors keep going over gloo; so does any tensor that does not fit in the ring's free space.

A lane is a ring of `LANE_BYTES` in a file of its own under `/dev/shm`, mapped by both processes
(`torch.from_file(shared=True)`), written by one side only and read by the other. Invariants:
- Positions are monotonic byte counts (the ring offset is `position % ring`); the writer assigns
  them in the order its frames are posted (under the channel's send lock), and the reader reads in
  frame order, so "released up to p" frees every byte before p. A tensor that would cross the
  ring's end starts at the next turn instead (the skipped bytes are freed with it).
- A tensor the reader *lends* (`lend`: a view of the ring instead of a copy) stays the reader's
  until the last tensor sharing its memory is freed, however long a service keeps it or a view
  of it: `released` stops at the oldest region still lent, so the writer never overwrites bytes
  someone can read. A region kept long only costs ring room (the writer's tensors go over gloo
  while the ring is full), never a wrong value.
- Nothing here needs atomics or memory fences: the position of a tensor reaches the reader in a
  gloo frame sent after the tensor was written, and the released count reaches the writer in a
  frame sent after the tensor was read; each send and receive is a system call, which orders the
  memory accesses around it.
- The writer never waits for room: `reserve` returns None when the ring is full (the reader has
  not released yet, e.g. no frame came back) and the tensor goes over gloo.
- The file lives only until the reader has mapped it: the reader unlinks it at once, the writer
  when the offer is refused or never answered (`close`). Space is reserved up front
  (`posix_fallocate`), so a full /dev/shm (containers often give it 64 MB) refuses the lane instead
  of killing the process with SIGBUS on a later write.
"""

from __future__ import annotations

import math
import os
import secrets
import weakref

import torch

LANE_BYTES = 32 << 20
"""Size of one lane (one direction of one channel): the most bytes in flight in shared memory."""
LANE_DIR = "/dev/shm"
"""Where lanes are created (tmpfs: memory, not disk)."""
LANE_PREFIX = "shadowgba-lane-"
"""How the name of every lane's file starts."""
TOKEN_BYTES = 16
DATA_START = 64
"""The ring's bytes start after the token that proves the reader mapped the writer's file."""
_ALIGN = 64


def aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def ring_position(written: int, released: int, ring: int, nbytes: int) -> int | None:
    """Where the next tensor of `nbytes` goes in a ring of `ring` bytes written up to `written`
    and free before `released` (positions as in the module docstring), or None: larger than half
    the ring, or no room before the oldest byte still in use. A tensor that would cross the ring's
    end starts at the next turn."""
    if nbytes > ring // 2:
        return None
    position = written
    if position % ring + nbytes > ring:
        position = (position // ring + 1) * ring
    return None if position + aligned(nbytes) - released > ring else position


class Loans:
    """Regions of a mapped ring handed out as tensors without a copy, each held until the last
    tensor sharing its memory is freed (however long its holder keeps it, or a view of it).

    No lock: a region returns on whichever thread freed its last tensor, possibly inside a garbage
    collection that interrupted another method here, so each method is one dictionary operation
    or one assignment (atomic under the GIL), and the order of `lend`'s two steps keeps
    `free_before` conservative whatever interleaves."""

    def __init__(self, buffer: torch.Tensor, ring: int) -> None:
        self._bytes = buffer.numpy()
        """The mapping as an array: each loan is built on a slice of it, an object of its own that
        lives exactly as long as some tensor shares the slice's memory (torch.from_numpy keeps it)."""
        self._ring = ring
        self._out: dict[int, None] = {}
        """Positions of the regions lent and not yet returned."""
        self._end = 0
        """The end of the last region read or lent."""

    @property
    def free_before(self) -> int:
        """Every byte before this position is free: the oldest region still lent, else the end of the last."""
        return min(self._out, default=self._end)  # one C call over a few positions: no thread switch inside

    def passed(self, end: int) -> None:
        """A region up to `end` was read (copied out) and is free at once."""
        self._end = end

    def lend(self, position: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor at `position` as a view of the ring, held until it and its views are freed."""
        nbytes = math.prod(shape) * dtype.itemsize
        start = DATA_START + position % self._ring
        region = self._bytes[start:start + nbytes]
        self._out[position] = None  # held before the end moves past it
        self._end = position + aligned(nbytes)
        weakref.finalize(region, self._out.pop, position, None)
        return torch.from_numpy(region).view(dtype).reshape(shape)


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def copy_out(buffer: torch.Tensor, ring: int, position: int, tensor: torch.Tensor) -> int:
    """Copy the bytes at `position` of the ring mapped as `buffer` into `tensor` (contiguous, its
    shape and dtype from the frame); returns how many."""
    start = DATA_START + position % ring
    nbytes = tensor.numel() * tensor.element_size()
    _flat_bytes(tensor).copy_(buffer[start:start + nbytes])
    return nbytes


class OutgoingLane:
    """The writing side of a lane (see the module docstring)."""

    def __init__(self, path: str, buffer: torch.Tensor, token: bytes) -> None:
        self.path, self.buffer, self._token = path, buffer, token
        """`buffer`: the mapped file, header and ring (what the lane holds in memory)."""
        self._ring = buffer.numel() - DATA_START
        self.accepted = False
        """Set once the peer has mapped the lane; until then (and if it refuses) nothing is written."""
        self._written = 0
        self._released = 0

    @classmethod
    def create(cls, nbytes: int | None = None) -> "OutgoingLane | None":
        """A new lane of `nbytes` (default `LANE_BYTES`), or None where shared memory is unavailable
        (no /dev/shm, or no room)."""
        nbytes = LANE_BYTES if nbytes is None else nbytes
        token = secrets.token_bytes(TOKEN_BYTES)
        path = os.path.join(LANE_DIR, f"{LANE_PREFIX}{os.getpid()}-{token.hex()[:12]}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return None
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
                os.pwrite(fd, token, 0)
            finally:
                os.close(fd)
            buffer = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        except (OSError, RuntimeError):
            _unlink(path)
            return None
        return cls(path, buffer, token)

    @property
    def offer(self) -> tuple[str, int, bytes]:
        """What the peer needs to map the lane: (path, size, token)."""
        return self.path, self.buffer.numel(), self._token

    def reserve(self, nbytes: int) -> int | None:
        """The position for a tensor of `nbytes`, or None (not accepted, too large, or no room now).
        Called under the channel's send lock, in the order the frames are posted."""
        position = ring_position(self._written, self._released, self._ring, nbytes) if self.accepted else None
        if position is not None:
            self._written = position + aligned(nbytes)
        return position

    def write(self, position: int, tensor: torch.Tensor) -> None:
        """Copy `tensor` (contiguous) to `position` (from `reserve`)."""
        start = DATA_START + position % self._ring
        nbytes = tensor.numel() * tensor.element_size()
        self.buffer[start:start + nbytes].copy_(_flat_bytes(tensor))

    def release(self, released: int) -> None:
        """The reader has read everything before `released` (carried by its frames)."""
        if released > self._released:
            self._released = released

    def close(self) -> None:
        """Remove the file if the reader never did (refused, or gone before mapping it)."""
        self.accepted = False
        _unlink(self.path)


class IncomingLane:
    """The reading side of a lane (see the module docstring)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        """The peer's mapped file, header and ring (what the lane holds in memory)."""
        self._ring = buffer.numel() - DATA_START
        self._loans = Loans(buffer, self._ring)

    @property
    def released(self) -> int:
        """Every byte before this position is free for the writer (sent back on each frame): the
        oldest region still lent, else the end of the last one read."""
        return self._loans.free_before

    def worth_telling(self, told: int) -> bool:
        """Whether the writer, last told `told` (a `released` sent on a frame), would gain a quarter of
        the ring from a frame now: lent regions return after the reply that could have carried them."""
        return self.released - told >= self._ring // 4

    @classmethod
    def open(cls, path: str, nbytes: int, token: bytes) -> "IncomingLane | None":
        """Map the peer's lane, or None if it is not on this host (no such file, or another token),
        or `path` is not a lane's (this side unlinks the file it maps: only a lane may be named)."""
        if os.path.dirname(path) != LANE_DIR or not os.path.basename(path).startswith(LANE_PREFIX):
            return None
        buffer = map_checked(path, nbytes, token)
        if buffer is None:
            return None
        _unlink(path)  # mapped: the memory lives as long as the two mappings
        return cls(buffer)

    def read(self, position: int, tensor: torch.Tensor) -> None:
        """Copy the tensor at `position` into `tensor` (its shape and dtype from the frame's header)."""
        nbytes = copy_out(self.buffer, self._ring, position, tensor)
        self._loans.passed(position + aligned(nbytes))

    def lend(self, position: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor at `position` as a view of the ring, no copy: its region is held until it and
        every tensor sharing its memory are freed (module docstring)."""
        return self._loans.lend(position, dtype, shape)


def map_checked(path: str, nbytes: int, token: bytes) -> torch.Tensor | None:
    """The file at `path` mapped shared, if it holds `nbytes` and starts with `token` (the writer's
    proof that this is its file: the same path on another host names another file, or none); None
    if not, or if it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != nbytes or os.pread(fd, len(token), 0) != token:
            return None
    finally:
        os.close(fd)
    try:
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    except RuntimeError:
        return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

"""A `Board`: tensors that one process sends to many peers of its host, written once in shared memory.

    board = Board.create(nbytes)                  # a server rank's, at start: a ring in a memfd
    params = board.copy(param, torch.float32)     # a global step's parameters, once (None: no room)
    position = board.position_of(params)          # a channel sending them: where they lie
    view = BoardView.open(*board.offer)           # a trainer of the same host, once: maps the board
    view.read(position, out)                      # copies the tensor out of the board

Why: a server answers every trainer's watch with the same tensor each global step (the shard's
new parameters). Through the lanes (`shadowgba.ps.lane`) that costs the server one copy per
trainer, into each trainer's lane; on the board it costs one copy, whatever the number of
trainers, and each trainer copies out its own (as TensorPipe's cross-memory attach does for RPC).

Invariants:
- A copy's region is held until the last tensor sharing its memory is freed (`lane.Loans`): the
  service's own reference (the shard's published copy) and every channel that sent it, which
  keeps it until the peer's frames say it decoded that message. So no byte is overwritten while
  a peer may still read it. When the held copies leave no room, `copy` returns None and the caller
  makes a plain copy, which the lanes carry as before.
- A channel given up on (its peer stopped past the timeout) drops what it held, and the peer may
  still decode its last frames once it runs again. So the reader checks after each copy that it
  read old enough bytes: positions are monotonic byte counts as in a lane, the board's header holds
  how far the ring is reserved, stored before a copy's bytes are written, and a tensor at position
  p was intact if no reservation had passed p + ring when the copy had ended; otherwise the read
  raises `StaleBoard` and the reader's channel fails (it reconnects, as after any loss). The
  order argument (a store before stores, a load after loads) is x86's; elsewhere the check
  narrows the window without closing it.
- The memory is a memfd: it lives only while a process maps it, so a crash leaves nothing behind
  in /dev/shm. A peer opens it through /proc/<pid>/fd/<fd> and checks the random token at its
  start, so a process of another host (where that path names something else, or nothing) refuses
  it, and so does one that may not open it; its channel then keeps the lanes.
- Peers only read the board; only its owner writes it, each region once, before any channel
  names it.
"""

from __future__ import annotations

import os
import secrets
import threading

import torch

from shadowgba.errors import PeerLost
from shadowgba.ps import lane
from shadowgba.ps.lane import DATA_START, TOKEN_BYTES, Loans, aligned, copy_out, map_checked, ring_position

_RESERVED_AT = TOKEN_BYTES
"""Where the header holds how far the ring is reserved (an int64, after the token)."""


class StaleBoard(PeerLost):
    """A board tensor was read after its region had been reused: the writer gave this side up."""


def _reserved_word(buffer: torch.Tensor) -> torch.Tensor:
    return buffer[_RESERVED_AT:_RESERVED_AT + 8].view(torch.int64)


class Board:
    """The writing side (see the module docstring): one per server process."""

    def __init__(self, fd: int, buffer: torch.Tensor, token: bytes) -> None:
        self._fd, self.buffer, self._token = fd, buffer, token
        """`buffer`: the mapped memfd, token and ring (what the board holds in memory)."""
        self._ring = buffer.numel() - DATA_START
        self._loans = Loans(buffer, self._ring)
        self._written = 0
        self._reserved = _reserved_word(buffer)
        """The header's copy of `_written`, for the readers' check (module docstring)."""
        self._lock = threading.Lock()
        """Guards `_written`: services copy from their own threads."""
        self._start = buffer.data_ptr() + DATA_START

    @classmethod
    def create(cls, nbytes: int | None = None) -> "Board | None":
        """A board of `nbytes` (default: a lane's, `lane.LANE_BYTES`), or None where shared memory is
        unavailable (no memfd, or no room)."""
        nbytes = lane.LANE_BYTES if nbytes is None else nbytes
        token = secrets.token_bytes(TOKEN_BYTES)
        try:
            fd = os.memfd_create("shadowgba-board", os.MFD_CLOEXEC)
        except (AttributeError, OSError):
            return None
        try:
            os.posix_fallocate(fd, 0, nbytes)  # a full /dev/shm refuses here, not with SIGBUS later
            os.pwrite(fd, token, 0)
            buffer = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
        except (OSError, RuntimeError):
            os.close(fd)
            return None
        return cls(fd, buffer, token)

    @property
    def offer(self) -> tuple[int, int, int, bytes]:
        """What a peer needs to map the board: (pid, fd, size, token)."""
        return os.getpid(), self._fd, self.buffer.numel(), self._token

    def copy(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """A copy of `tensor` in `dtype` on the board, or None if it has no room for it now."""
        nbytes = tensor.numel() * dtype.itemsize
        if nbytes == 0:
            return None
        with self._lock:
            position = ring_position(self._written, self._loans.free_before, self._ring, nbytes)
            if position is None:
                return None
            self._written = position + aligned(nbytes)
            self._reserved[0] = self._written  # before the bytes: a late reader sees it (module docstring)
            copy = self._loans.lend(position, dtype, tuple(tensor.shape))
        copy.copy_(tensor)
        return copy

    def position_of(self, tensor: torch.Tensor) -> int | None:
        """The position of `tensor` (contiguous, held: a copy or a view of one), or None if it is not
        on the board. A held region lies in the last ring's worth of positions before the write head."""
        offset = tensor.data_ptr() - self._start
        nbytes = tensor.numel() * tensor.element_size()
        if not (0 <= offset and offset + nbytes <= self._ring and nbytes):
            return None
        with self._lock:
            head = self._written
        return head - 1 - (head - 1 - offset) % self._ring

    def close(self) -> None:
        """Close the memfd; the memory lives on while mapped (copies still held, peers' views)."""
        try:
            os.close(self._fd)
        except OSError:
            pass


class BoardView:
    """The reading side: a peer's board, mapped by a process of the same host."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        """The writer's mapped board (what the view holds in memory)."""
        self._ring = buffer.numel() - DATA_START
        self._reserved = _reserved_word(buffer)

    @classmethod
    def open(cls, pid: int, fd: int, nbytes: int, token: bytes) -> "BoardView | None":
        """Map the writer's board, or None if it is not on this host or may not be opened."""
        buffer = map_checked(f"/proc/{pid}/fd/{fd}", nbytes, token)
        return None if buffer is None else cls(buffer)

    def read(self, position: int, tensor: torch.Tensor) -> None:
        """Copy the tensor at `position` into `tensor` (its shape and dtype from the frame);
        `StaleBoard` if its region was reused meanwhile (module docstring)."""
        copy_out(self.buffer, self._ring, position, tensor)
        reserved = int(self._reserved[0])
        if reserved > position + self._ring:
            raise StaleBoard(f"a board tensor was overwritten before it was read (reserved up to {reserved}, "
                             f"the tensor at {position}): its writer gave this side up")

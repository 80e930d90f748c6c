"""The EASGD centre on the parameter server: ShadowSync's S-EASGD.

Each trainer's shadow thread sends its snapshot slice; the server computes the elastic pull
`d = alpha * (s - c)`, moves the centre `c <- c + d` and returns `d`, which the trainer subtracts
(`t = s - d`). There is no collective: trainers talk to the centre one at a time, under its lock, so
a slow trainer slows nobody. Each server rank holds the centre slice given by `shard_bounds`.
"""

from __future__ import annotations

import threading

import torch

CENTER_SERVICE = "easgd_center"


class ElasticCenter:
    """A thread-safe centre slice [start, end), set by the first trainer that asks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._center: torch.Tensor | None = None
        self._bounds = (0, 0)
        self.rounds = 0

    def init(self, start: int, end: int, initial: torch.Tensor) -> None:
        """Start the centre from the (broadcast, identical) initial weights; later calls are no-ops
        if they agree, refused if they name another slice."""
        with self._lock:
            if self._center is None:
                if initial.shape != (end - start,):
                    raise ValueError(f"centre slice [{start}, {end}) cannot start from {tuple(initial.shape)} values")
                self._center, self._bounds = initial.clone(), (start, end)
            elif self._bounds != (start, end):
                raise ValueError(f"centre holds slice [{self._bounds[0]}, {self._bounds[1]}), not [{start}, {end})")

    def pull(self, start: int, end: int, snapshot: torch.Tensor, alpha: float) -> torch.Tensor:
        """One elastic exchange: returns `d = alpha * (s - c)` after moving the centre by it."""
        with self._lock:
            if self._center is None or self._bounds != (start, end):
                raise ValueError(f"no EASGD centre for slice [{start}, {end}) on this server")
            if snapshot.shape != self._center.shape or snapshot.dtype != self._center.dtype:
                raise ValueError(
                    f"snapshot {tuple(snapshot.shape)} {snapshot.dtype} does not match the centre "
                    f"{tuple(self._center.shape)} {self._center.dtype}"
                )
            pull = alpha * (snapshot - self._center)
            self._center += pull
            self.rounds += 1
            return pull

    def center(self) -> torch.Tensor:
        with self._lock:
            if self._center is None:
                raise ValueError("the EASGD centre has not been initialised")
            return self._center.clone()

    def round_count(self) -> int:
        with self._lock:
            return self.rounds

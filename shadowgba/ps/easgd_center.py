"""The EASGD centre on the parameter servers (ShadowSync's S-EASGD): the server slices and the client.

The flat centre is split into contiguous slices by `shard_bounds`, one per server rank, each an
`ElasticCenter` served under `CENTER_SERVICE`. A trainer's `CenterClient` is the `Centre` that
`sync_algos.easgd_ps.ElasticAveragingPS` exchanges with: it sends each server its slice of the
snapshot, all calls in flight at once; the server computes the elastic pull `d = alpha * (s - c)`
(`sync_algos.easgd.elastic_pull`), moves its slice `c <- c + d` and returns `d`. There is no
collective: trainers talk to each slice one at a time, under its lock, so a slow trainer slows nobody.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from shadowgba.flat_optimizer import shard_bounds
from shadowgba.ps import transport
from sync_algos.base import is_finite
from sync_algos.easgd import elastic_pull
from sync_algos.easgd_ps import Centre

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
            if not is_finite(snapshot):  # trainers never send one (easgd_ps); a centre shared by all never takes one
                raise ValueError(f"snapshot for slice [{start}, {end}) holds NaN or Inf values; the centre refuses it")
            pull = elastic_pull(snapshot, self._center, alpha)
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


class CenterClient(Centre):
    """The trainer side of the centre: the whole flat vector over `num_servers` `ElasticCenter` slices.

    Needs the PS transport started (`shadowgba.ps.transport`) and every server serving an
    `ElasticCenter` under `service`. Holds no state: the slices follow from the vector's length by
    `shard_bounds`, as on every trainer; a server refuses a slice that is not the one it holds.
    """

    def __init__(self, num_servers: int, service: str = CENTER_SERVICE) -> None:
        if num_servers < 1:
            raise ValueError(f"the S-EASGD centre needs at least one server, got num_servers={num_servers}")
        self.num_servers = num_servers
        self.service = service

    def init(self, initial: torch.Tensor) -> None:
        self._call_each_slice("init", initial)

    def exchange(self, snapshot: torch.Tensor, alpha: float) -> torch.Tensor:
        return torch.cat(self._call_each_slice("pull", snapshot, alpha))

    def _call_each_slice(self, method: str, whole: torch.Tensor, *extra: Any) -> list[Any]:
        """`method(start, end, whole[start:end], *extra)` on every server at once; results in slice
        order. Slices are cloned: sending a view would send the whole vector's storage."""
        return transport.call_each(self.service, method, [
            (start, end, whole[start:end].clone(), *extra) for start, end in shard_bounds(whole.numel(), self.num_servers)
        ])

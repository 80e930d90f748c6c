"""The EASGD centre on the parameter servers (ShadowSync's S-EASGD): the server slices and the client.

The flat centre is split into contiguous slices by `shard_bounds`, one per server rank, each an
`ElasticCenter` served under `CENTER_SERVICE`. A trainer's `CenterClient` is the `Centre` that
`sync_algos.easgd_ps.ElasticAveragingPS` exchanges with: it sends each server its slice of the
snapshot, all calls in flight at once; the server computes the elastic pull `d = alpha * (s - c)`
(`sync_algos.easgd.elastic_pull`), moves its slice `c <- c + d` and returns `d`. There is no
collective: trainers talk to each slice one at a time, under its lock, so a slow trainer slows nobody.
The centre is in the job's checkpoints through its client (`CenterClient.state_dict`, a `Stateful`):
no other checkpointed object holds it, the algorithm's own state included. In the elastic layout
each server also saves its own slice (`ElasticCenter.on_checkpoint`, `shadowgba.ps.server_state`),
and a new process of it resumes from there: the slices are independent (each trainer exchanges with
each on its own), so a server, or all of them at once, can come back at an older centre, and a
trainer sends the exchange that was in flight at the restart again to the new process
(`CenterClient`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Mapping

import torch

from shadowgba.errors import CheckpointError, ServerRestarted, SetupError
from shadowgba.serialized import check_entries
from shadowgba.flat_optimizer import shard_bounds
from shadowgba.ps.channel import first_line
from shadowgba.ps.server_state import OfferSchedule
from shadowgba.ps.trainer_end import TrainerTransport
from sync_algos.base import is_finite
from sync_algos.easgd import elastic_pull
from sync_algos.easgd_ps import Centre

CENTER_SERVICE = "easgd_center"

logger = logging.getLogger("shadowgba")


class ElasticCenter:
    """A thread-safe centre slice [start, end), set by the first trainer that asks (or a checkpoint)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._center: torch.Tensor | None = None
        self._bounds = (0, 0)
        self.rounds = 0
        """Exchanges this slice has taken since it started (a restored slice: since the job's)."""
        self._checkpoint: OfferSchedule | None = None
        """When the slice is offered: after every `every`-th exchange (`on_checkpoint`)."""
        self._restored_at: int | None = None
        """The exchange count this process was restored at (`restore`); None: started by a trainer."""

    def init(self, start: int, end: int, initial: torch.Tensor) -> torch.Tensor:
        """Start the centre from the first trainer's initial weights; later calls change nothing if
        they name the same slice, and are refused if they name another. Returns the slice as it is
        then: where the calling trainer starts (a trainer joining a running job starts at the centre)."""
        with self._lock:
            if self._center is None:
                self._center, self._bounds = self._accepted(start, end, initial), (start, end)
                self._offer_checkpoint(force=True)
            else:
                self._require_slice(start, end)
            return self._center.clone()

    def load(self, start: int, end: int, centre: torch.Tensor, unless_moved: bool = False) -> bool:
        """Replace the slice with `centre` (a checkpoint's); with `unless_moved`, only if no exchange
        has moved it yet (a trainer that rejoins a running job must not roll the job's centre back).
        Returns whether it was replaced. Refused (ValueError, nothing changed): another slice than
        the one held, or values that `slice_problem` names (of another shape or dtype than the slice
        held, NaN / Inf). On a centre not yet initialised it starts the slice (a later `init` then
        keeps it)."""
        with self._lock:
            if self._center is not None:
                self._require_slice(start, end)
            accepted = self._accepted(start, end, centre)
            if unless_moved and self.rounds:
                return False
            self._center, self._bounds = accepted, (start, end)
            self._offer_checkpoint(force=True)
            return True

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
            self._offer_checkpoint()
            return pull

    def on_checkpoint(self, every: int, offer: Callable[[int, dict[str, Any]], None]) -> None:
        """Offer the slice's state (what `restore` takes) to `offer(exchanges, state)` now (if
        started), whenever a trainer or a checkpoint sets it, and after every `every`-th exchange
        (`shadowgba.ps.server_state`); called under the slice's lock, so `offer` must only hand the
        state over. Memory: one copy of the slice per offer, until the writer has saved it."""
        with self._lock:
            self._checkpoint = OfferSchedule(every, offer)
            self._offer_checkpoint(force=True)

    def restore(self, state: Mapping[str, Any]) -> None:
        """Serve again from a state `on_checkpoint` offered (a new server process, before it serves).
        Refused (ValueError) like `load`; a slice restored after exchanges counts as moved
        (`load(unless_moved)` keeps it)."""
        start, end = state["start"], state["end"]
        with self._lock:
            self._center, self._bounds = self._accepted(start, end, state["centre"]), (start, end)
            self.rounds = self._restored_at = int(state["rounds"])

    def center(self) -> torch.Tensor:
        with self._lock:
            if self._center is None:
                raise ValueError("the EASGD centre has not been initialised")
            return self._center.clone()

    def round_count(self) -> int:
        with self._lock:
            return self.rounds

    def stats(self) -> dict[str, int | None]:
        """The slice's exchanges, and the count it was restored at (None: never restored)."""
        with self._lock:
            return {"rounds": self.rounds, "restored_at": self._restored_at}

    def _offer_checkpoint(self, force: bool = False) -> None:
        """Offer the slice to the checkpoint writer at a multiple of its interval, or now if `force`
        (the lock held, the slice started)."""
        if self._checkpoint is None or self._center is None:
            return
        start, end = self._bounds
        self._checkpoint.offer_at(self.rounds, lambda: {
            "start": start, "end": end, "centre": self._center.clone(), "rounds": self.rounds}, force)

    def _require_slice(self, start: int, end: int) -> None:
        if self._bounds != (start, end):
            raise CheckpointError(f"centre holds slice [{self._bounds[0]}, {self._bounds[1]}), not [{start}, {end})")

    def _accepted(self, start: int, end: int, values: torch.Tensor) -> torch.Tensor:
        """A copy of `values` as the slice [start, end), or ValueError naming what `slice_problem` finds."""
        problem = slice_problem(start, end, values, None if self._center is None else self._center.dtype)
        if problem is not None:
            raise CheckpointError(problem)
        return values.clone()


def slice_problem(start: int, end: int, values: object, dtype: torch.dtype | None = None) -> str | None:
    """Why `values` cannot be the centre slice [start, end) (None if it can): not a tensor of shape
    `(end - start,)`, not of `dtype` (when one is given: the slice already held), or holding NaN /
    Inf. One rule for the servers' `init` / `load` and the trainers' `CenterClient.load_state_dict`."""
    if not isinstance(values, torch.Tensor):
        return f"centre slice [{start}, {end}) must be a tensor, got {type(values).__name__}"
    if values.shape != (end - start,) or (dtype is not None and values.dtype != dtype):
        wanted = f"{end - start} values" + ("" if dtype is None else f" of {dtype}")
        return f"centre slice [{start}, {end}) holds {wanted}, got {tuple(values.shape)} of {values.dtype}"
    if not is_finite(values):
        return f"centre slice [{start}, {end}) refuses NaN or Inf values"
    return None


class CenterClient(Centre):
    """The trainer side of the centre: the whole flat vector over `num_servers` `ElasticCenter` slices.

    Needs the job's PS transport (`TrainerTransport`) and every server serving an
    `ElasticCenter` under `service`. Holds no state but the length and dtype `init` started the
    centre with (what a checkpoint must match): the slices follow from the length by `shard_bounds`,
    as on every trainer; a server refuses a slice that is not the one it holds.

    A `Stateful` (torch.distributed.checkpoint), as the PS tables (`PSEmbeddingBagCollection`): the
    centre lives on the servers, so every trainer would save the same thing; trainer 0 alone gathers
    it on save and loads it on load, the other trainers' `state_dict()` is empty and their load
    changes nothing. It is one consistent centre when no round runs during the save (foreground
    rounds; in shadow mode the other trainers' exchanges race with the gather by design).
    """

    def __init__(self, transport: TrainerTransport, service: str = CENTER_SERVICE) -> None:
        num_servers = transport.roles.num_servers
        if num_servers < 1:
            raise SetupError(f"the S-EASGD centre needs at least one server, got num_servers={num_servers}")
        self.transport = transport
        self.num_servers = num_servers
        self.service = service
        self._layout: tuple[int, torch.dtype] | None = None
        """Length and dtype of the flat centre, set by `init`."""

    def init(self, initial: torch.Tensor) -> torch.Tensor:
        centre = torch.cat(self._call_each_slice("init", initial))
        self._layout = (initial.numel(), initial.dtype)
        return centre

    def exchange(self, snapshot: torch.Tensor, alpha: float) -> torch.Tensor:
        return torch.cat(self._call_each_slice("pull", snapshot, alpha))

    def read(self) -> torch.Tensor:
        return torch.cat(self._call_each("center", [()] * self.num_servers))

    def state_dict(self) -> dict[str, Any]:
        """On trainer 0 the whole centre, gathered from every server's slice, and the server count; {} elsewhere."""
        self._require_layout()
        if not self._saving_trainer():
            return {}
        return {"num_servers": self.num_servers, "centre": self.read()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()` output onto the servers (trainer 0; the others have nothing to do).
        Refuses (`CheckpointError`, before any server changed) a state that is not one, or one of
        another server count or dense layout (length, dtype), or holding NaN / Inf. In the elastic
        layout, where the servers outlive the trainers, a slice that exchanges have moved already is
        kept: trainer 0 rejoining a running job resumes its own replica, not the job's centre."""
        length, dtype = self._require_layout()
        if not self._saving_trainer():
            return
        check_entries(state, "S-EASGD centre state", ("centre", "num_servers"), exact=True)
        if state["num_servers"] != self.num_servers:
            raise CheckpointError(f"the S-EASGD centre was saved from {state['num_servers']} parameter servers, "
                                  f"this job has {self.num_servers}")
        problem = slice_problem(0, length, state["centre"], dtype)
        if problem is not None:
            raise CheckpointError(f"the S-EASGD centre of this job's dense layout cannot be loaded: {problem}")
        kept = self._call_each_slice("load", state["centre"], self.transport.roles.elastic).count(False)
        if kept:
            logger.info("shadowgba: the S-EASGD centre kept its running values on %d of %d servers instead of this "
                        "checkpoint's (the job is running: this trainer rejoined it)", kept, self.num_servers)

    def _require_layout(self) -> tuple[int, torch.dtype]:
        if self._layout is None:
            raise SetupError("the S-EASGD centre has not been started: checkpoint it after the sync's start()")
        return self._layout

    def _saving_trainer(self) -> bool:
        return self.transport.roles.trainer_index == 0

    def _call_each_slice(self, method: str, whole: torch.Tensor, *extra: Any) -> list[Any]:
        """`method(start, end, whole[start:end], *extra)` on every server at once; results in slice
        order. Slices are cloned: sending a view would send the whole vector's storage."""
        return self._call_each(method, [
            (start, end, whole[start:end].clone(), *extra) for start, end in shard_bounds(whole.numel(), self.num_servers)
        ])

    def _call_each(self, method: str, args_by_server: list[tuple[Any, ...]]) -> list[Any]:
        """`method(*args_by_server[i])` on server i, all in flight at once; a call that a server's
        restart cut (`ServerRestarted`) is sent again to its new process (again if that one restarts
        too: each try needs a new process, which the transport waits for at most
        `server_restart_s`). Safe for every method of the slice: `init`, `load` and `center` change
        nothing twice, and an exchange the dead process took is gone with it, or (saved after it)
        pulled once more, which an elastic pull tolerates (it moves both sides towards each other)."""
        futures = [self.transport.call_async(server, self.service, method, *args)
                   for server, args in enumerate(args_by_server)]
        results = []
        for server, future in enumerate(futures):
            while True:
                try:
                    results.append(future.wait())
                    break
                except ServerRestarted as restarted:
                    logger.warning("shadowgba: the S-EASGD centre sends the %s that a restart cut to the new process "
                                   "of server %d, restored from its checkpoint (%s)", method, server, first_line(restarted))
                    future = self.transport.call_async(server, self.service, method, *args_by_server[server])
        return results

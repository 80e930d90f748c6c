"""The servers' own checkpoints: a server saves what it serves on a schedule, and a new process of it
resumes from there while the trainers wait (the elastic layout, `sync.ps.checkpoint_dir`).

    checkpoints = ServerCheckpoints(directory, server_index=0)
    saved = checkpoints.latest()          # at start: None, or (step, {"dense": ..., "embedding": ...})
    writer = CheckpointWriter(checkpoints, "dense", others)  # a thread; the dense shard offers it its states
    shard.on_checkpoint(every, writer.offer)
    ...
    writer.close()                        # writes what is pending, then ends

Invariants:
- What is saved is each service's own state. One service sets the schedule by offering its state:
  under GBA the dense shard (its slice's parameters, optimizer state and global step k, with what
  it was configured with: `DenseShard.on_checkpoint`), taken under the shard's lock right after
  the step that brought k to a multiple of `checkpoint_every` (and when it is configured), so no
  partly filled global batch is part of it; under S-EASGD the centre slice
  (`ElasticCenter.on_checkpoint`: every `checkpoint_every` exchanges, the files numbered by them).
  The others are taken when the file is written: the PS-hosted tables'
  (`EmbeddingShard.export_state`: rows, Adagrad accumulators, buffered row gradients). The tables
  need no cut with the dense shard: a row's next gradient is computed on whatever the trainer
  looked up, and GBA's rule decides it by its own token.
- The offering service's calls never wait for the disk: it hands over a copy (one slice, and the
  dense shard's optimizer state), and at most one waits: a newer state replaces one the writer has
  not taken.
  The tables are copied under their own lock when the file is written (their pushes and lookups
  wait for that memory copy, not for the disk). Memory: while a checkpoint is pending or being
  written, one copy of the dense slice with its optimizer state and one of the tables.
- The trainers' format (`shadowgba.serialized`): a folder `step_<k>` with the state in `STATE_FILE`
  and the manifest, written as `.tmp-step_<k>`, sealed and renamed, so a crash at any point leaves
  the previous checkpoint whole. The newest `KEEP_LAST` are kept. One that fails its manifest's
  checks or does not load is skipped, naming why, for the one before it.
- GBA: one server only (`sync.ps.server_restart_s` refuses more): the dense shards of several
  servers would have to go back to one common k together, and the others keep serving. S-EASGD:
  any number, one at a time or all at once (a torchrun job of the servers restarts them together):
  the centre's slices need no common cut, each is an elastic average of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from shadowgba.serialized import TMP_PREFIX, commit_folder, load_state_file, step_folders, verify_folder

logger = logging.getLogger("shadowgba")

KEEP_LAST = 2
"""Checkpoints kept per server."""
STATE_FILE = "state.pt"
"""A server checkpoint's data: every service's state, one `torch.save` file of tensors and plain data."""


@dataclasses.dataclass(frozen=True)
class OfferSchedule:
    """When a service hands its state to the writer (its `on_checkpoint`): at each of its steps
    that is a multiple of `every`, and whenever the service forces it (set, configured, loaded)."""

    every: int
    offer: Callable[[int, dict[str, Any]], None]

    def offer_at(self, step: int, state: Callable[[], dict[str, Any]], force: bool = False) -> None:
        """Hand `state()` over at `step` when the schedule says so (built only then: it is a copy)."""
        if force or step % self.every == 0:
            self.offer(step, state())


class ServerCheckpoints:
    """One server's checkpoint files, in `directory/ps{server_index}/`."""

    def __init__(self, directory: str | os.PathLike, server_index: int) -> None:
        self.folder = Path(directory) / f"ps{server_index}"
        self.setup = {"server": server_index}
        """What the manifest says wrote it (a checkpoint of another server index is not this one's)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob(f"{TMP_PREFIX}*"):  # a save a crash cut short
            shutil.rmtree(stale, ignore_errors=True)

    def steps(self) -> list[int]:
        """The global steps saved, oldest first."""
        return [step for step, _ in step_folders(self.folder)]

    def path_of(self, step: int) -> Path:
        """The folder of global step `step`'s checkpoint."""
        return self.folder / f"step_{step:010d}"

    def save(self, step: int, state: Mapping[str, Any]) -> Path:
        """Write `state` as the checkpoint of step `step` (global step or exchanges), atomically; keep
        the newest `KEEP_LAST`."""
        path = self.path_of(step)
        tmp = self.folder / f"{TMP_PREFIX}{path.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        with open(tmp / STATE_FILE, "wb") as file:
            torch.save(dict(state), file)
            file.flush()
            os.fsync(file.fileno())
        commit_folder(tmp, path, step, self.setup, KEEP_LAST)
        return path

    def latest(self) -> tuple[int, dict[str, Any]] | None:
        """(its step, its state) of the newest checkpoint that verifies and loads, or None if there is none."""
        for step in reversed(self.steps()):
            path = self.path_of(step)
            try:
                verify_folder(path, lambda setup: None if setup == self.setup else f"written by {setup}, not "
                                                                                    f"{self.setup}")
                return step, load_state_file(path / STATE_FILE)
            except Exception as error:  # noqa: BLE001 (truncated, corrupted or crafted: the one before it)
                logger.warning("shadowgba: server checkpoint %s does not load (%s); trying the one before", path, error)
        return None


class CheckpointWriter:
    """A thread that writes the states one service offers (`offer`), saved under its name
    `offered_as`, each with the other services' states (`extra`: name -> a function returning its
    state) taken at writing time."""

    def __init__(self, checkpoints: ServerCheckpoints, offered_as: str, extra: Mapping[str, Callable[[], Any]]) -> None:
        self._checkpoints, self._offered_as, self._extra = checkpoints, offered_as, dict(extra)
        self._pending: tuple[int, Any] | None = None
        self._changed = threading.Condition()
        self._closing = False
        self.saved: list[int] = []
        """The global steps written so far."""
        self._thread = threading.Thread(target=self._run, name="shadowgba-server-checkpoints", daemon=True)
        self._thread.start()

    def offer(self, step: int, state: Any) -> None:
        """The offering service's state at its step `step`, to be written (replacing one not yet taken)."""
        with self._changed:
            self._pending = (step, state)
            self._changed.notify()

    def close(self) -> None:
        """Write what is pending, then end the thread."""
        with self._changed:
            self._closing = True
            self._changed.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._pending is not None or self._closing)
                pending, self._pending = self._pending, None
                if pending is None:
                    return
            step, offered = pending
            try:
                self._checkpoints.save(step, {self._offered_as: offered,
                                              **{name: state() for name, state in self._extra.items()}})
                self.saved.append(step)
            except Exception:  # noqa: BLE001 (a full disk must not end the server; the next step tries again)
                logger.exception("shadowgba: the server checkpoint of global step %d was not written", step)

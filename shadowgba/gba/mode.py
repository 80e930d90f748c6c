"""Where a GBA trainer's dense update happens (`Mode`), and how the trainers switch between modes.

Switching (carries parameters, optimizer state, global step and global batch; nothing is retuned):
- sync -> GBA, at the same step on every trainer: trainer 0 loads its flat optimizer, sliced, into
  the shards and broadcasts the outcome; everyone pulls.
- GBA -> sync: a request (API or the policy on shard 0) is carried back in every push reply. Each
  trainer stops feeding the queue, waits for its in-flight pushes, and enters a barrier; trainer 0
  takes the shards' state and broadcasts it, and the trainers continue in lockstep. A partly filled
  global batch is dropped (counted on the shard). Trainers whose steps are paired anyway
  (TorchRec-sharded tables) first agree on the step (`lockstep_every`), else one trainer's barrier
  would meet another's embedding all-to-all.
"""

from __future__ import annotations

import enum
from typing import Any, Callable

import torch.distributed as dist

from shadowgba.errors import SyncError


class Mode(enum.StrEnum):
    """Where a trainer's dense update happens; the value is what `GBASync.mode` compares equal to.

    States:
    - SYNC: every step all-reduces the gradient over the trainers and steps this trainer's flat
      optimizer with the mean (as DDP). The state at construction.
    - GBA: every step queues the gradient for the shards and installs the newest parameters they
      sent; the optimizer state lives on the shards.
    - LOCAL: after a trainer raised the stop flag in a sync all-reduce (a peer is closing, or this
      trainer's own close): no more collectives until `close()`; each step applies this trainer's
      own gradient to its own flat optimizer, as a ShadowSync trainer trains between rounds.
      `switch_mode` is ignored; `close()` averages the parameters once over the trainers.

    Transitions (all taken in the training thread, at a step boundary or in start / close):
    - start():  SYNC -> GBA when `initial_mode` is gba (not counted as a switch).
    - SYNC -> GBA: a sync all-reduce whose switch flag is set (`switch_mode("gba")` on any trainer)
      or after which the policy fires on the trainers' compute times: the same step everywhere.
    - GBA -> SYNC: a push reply carried shard 0's request (`switch_mode("sync")` on any trainer, or
      shard 0's policy): at once, or at the next agreement step with `lockstep_every`; also in
      `close()` when shard 0 refuses to close because such a switch is pending.
    - SYNC -> LOCAL: a sync all-reduce whose stop flag is set (not counted as a switch).
    - close(): GBA ends with a drain, a barrier (through the servers) and a pull; SYNC goes through LOCAL;
      LOCAL ends with the average. No transition leaves LOCAL.
    """

    SYNC = "sync"
    GBA = "gba"
    LOCAL = "local"


class ModeSwitches:
    """The switch protocols of `GBASync` (mixed into it; the module docstring): what trainer 0 does
    for every trainer, and the sync -> GBA and GBA -> sync switches at a step boundary."""

    def _on_trainer0(self, action: Callable[[], Any], what: str) -> Any:
        """Run `action` on trainer 0 and give every trainer its result (one broadcast, collective).
        If it raised there, every trainer raises the same `SyncError`: no peer is left waiting in a
        collective trainer 0 will not reach."""
        outcome: list[Any] = [None]
        error: BaseException | None = None
        if self.roles.trainer_index == 0:
            try:
                outcome = [(True, action())]
            except Exception as failure:
                error, outcome = failure, [(False, f"{what} failed on trainer 0: {failure!r}")]
        with self._collective(f"the broadcast of {what}"):
            dist.broadcast_object_list(outcome, src=self.roles.trainer_ranks[0], group=self._group())
        ok, value = outcome[0]
        if not ok:
            raise SyncError(value, ranks=[self.roles.trainer_ranks[0]]) from error
        return value

    def _configure_shards(self, exported: dict[str, Any], if_idle: bool = False) -> None:
        """Trainer 0: every dense shard takes its slice of `exported`, all at its global step (`if_idle`:
        only the shards not serving yet)."""
        self._shards.configure(self.num_trainers, self.spec, exported, self.config, self.global_batch,
                               self.on_nonfinite, if_idle)

    def _join_shards(self) -> None:
        """The elastic layout's start, with no collective: trainer 0 configures the shards unless they
        serve already (a restarted trainer 0 joins a running job and must not reset it); every
        trainer waits (up to `timeout_s`) until they serve, then installs their parameters
        (`_enter_gba`), so a trainer that rejoins trains on the current ones."""
        if self.roles.trainer_index == 0:
            self._configure_shards(self._flat.export(), if_idle=True)
        self._shards.await_serving(self._require_transport().timeout_s)

    def _enter_gba(self, initial: bool = False) -> None:
        """sync -> GBA at the same step on every trainer (at start when `initial`: not a switch)."""
        if self.roles.elastic:
            self._join_shards()
        else:
            self._on_trainer0(lambda: self._configure_shards(self._flat.export()), "configuring the dense shards")
        self._gba_requested = False
        self._gba_steps = 0
        self._client.enter()
        self._switch_to(Mode.GBA, counted=not initial)

    def _leave_gba(self) -> None:
        """GBA -> sync: quiesce this trainer's pushes, agree, take the servers' state."""
        self._client.leave()
        self._barrier("gba-leave")  # every trainer's pushes have reached every shard
        self._load(self._on_trainer0(self._shards.export, "taking the dense shards' state back"))
        self._switch_to(Mode.SYNC)

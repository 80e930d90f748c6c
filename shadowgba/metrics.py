"""Counters the shadow runtime keeps about itself, readable at any time and logged periodically.

Written by the shadow thread (rounds) and the training thread(s) (steps, write-backs, time spent in
sync code); every update and read holds one small lock, so a summary is a consistent cut.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Mapping

import torch

from shadowgba.nonfinite import NonFiniteGuard
from sync_algos.staleness import StalenessCounts

HeldTensors = Callable[[], Mapping[str, torch.Tensor]]
"""A runtime's account of the dense-sized tensors it holds of its own, by name (not the model's
parameters, nor the user's optimizer state)."""

TableCounters = Callable[[], Mapping[str, float]]
"""A 2D runtime's account of its table replicas: cycles done and the fragments' age in steps."""


LANE_PREFIX = "lane_"
"""How `memory()` names the shared memory of the transport's same-host lanes (`Transport.lane_buffers`)."""


def held_bytes(tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """The bytes behind each named tensor; a storage named twice (views of one buffer) counts once,
    under its first name."""
    seen: set[int] = set()
    sizes: dict[str, int] = {}
    for name, tensor in tensors.items():
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            sizes[name] = storage.nbytes()
    return sizes


class SyncMetrics:
    """Rounds, rounds per step, round latency, sync gap (steps between two rounds reaching the dense
    weights, and since the last one now), bytes moved, the shadow rounds' cost to the training
    threads and the training thread's own time in sync code."""

    def __init__(self, held: HeldTensors | None = None, guard: NonFiniteGuard | None = None,
                 tables: TableCounters | None = None) -> None:
        """`held`: the runtime's account of its dense-sized tensors (`memory`), read when asked;
        `guard`: the runtime's non-finite guard, whose skipped steps the summary reports;
        `tables`: a 2D runtime's table counters, read when asked (table rounds are counted here)."""
        self._lock = threading.Lock()
        self._held = held
        self._guard = guard
        self._tables = tables
        self.table_rounds = 0
        self.table_round_time_total_s = 0.0
        self.table_bytes_moved = 0
        self._started = time.monotonic()
        self.rounds = 0
        self.round_time_total_s = 0.0
        self.round_time_max_s = 0.0
        self.bytes_moved = 0
        self.steps = 0
        self.applied_rounds = 0
        self.sync_gap_total_steps = 0
        self.sync_gap_max_steps = 0
        self.between_rounds_gap_max_steps = 0
        """The longest gap between two applied rounds: what the pacing controls (the gap before the
        first is `first_round_after`'s, by config)."""
        self.training_sync_s = 0.0
        self.nonfinite_rounds_skipped = 0
        """Rounds (and final averages) that left some rank's NaN / Inf contribution out
        (`sync.on_nonfinite: skip`); counted on every rank, the bad one included."""
        self.replica_groups_lost = 0
        """2D jobs under `sync.on_group_lost: continue`: replica groups this rank trained on without."""
        self.replica_groups_joined = 0
        """2D jobs with a torchrun job per replica group: replica groups let back in while this rank
        trained (each took a member's replica)."""
        self.nonfinite_replicas_healed = 0
        """Times this rank's NaN / Inf weights (dense, or a table fragment) were replaced by the
        healthy replicas' consensus (`sync.on_nonfinite: skip`); counted on the healed rank."""
        self._last_applied_step = 0
        self._last_step = 0
        self.round_cost_total_s = 0.0
        """Shadow rounds: what they cost the training threads, summed (`shadowgba.shadow.round_cost`)."""
        self.round_cpu_total_s = 0.0
        """Shadow rounds: the CPU time of their threads, summed."""
        self.costed_rounds = 0

    def record_round(self, seconds: float, bytes_moved: int) -> None:
        """One round finished its communication."""
        with self._lock:
            self.rounds += 1
            self.round_time_total_s += seconds
            self.round_time_max_s = max(self.round_time_max_s, seconds)
            self.bytes_moved += bytes_moved

    def record_table_round(self, seconds: float, bytes_moved: int, fragment: bool = True) -> None:
        """One table fragment was averaged on the replica group (`fragment`), or the partners'
        touched-row masks of a cycle were summed (its bytes count, not as a round)."""
        with self._lock:
            self.table_rounds += int(fragment)
            self.table_round_time_total_s += seconds if fragment else 0.0
            self.table_bytes_moved += bytes_moved

    def record_applied(self, step: int) -> None:
        """A round's result reached the live weights at training step `step`."""
        with self._lock:
            gap = step - self._last_applied_step
            self._last_applied_step = step
            self.applied_rounds += 1
            self.sync_gap_total_steps += gap
            self.sync_gap_max_steps = max(self.sync_gap_max_steps, gap)
            if self.applied_rounds > 1:
                self.between_rounds_gap_max_steps = max(self.between_rounds_gap_max_steps, gap)

    def record_round_cost(self, cost_s: float, cpu_s: float) -> None:
        """A shadow round cost the training threads `cost_s` of their time; its threads ran `cpu_s`."""
        with self._lock:
            self.costed_rounds += 1
            self.round_cost_total_s += cost_s
            self.round_cpu_total_s += cpu_s

    def record_nonfinite_skip(self) -> None:
        """A round or final average left a rank's NaN / Inf contribution out."""
        with self._lock:
            self.nonfinite_rounds_skipped += 1

    def record_groups_lost(self, count: int) -> None:
        """The rounds now go on without `count` more replica groups."""
        with self._lock:
            self.replica_groups_lost += count

    def record_groups_joined(self, count: int) -> None:
        """`count` replica groups rejoined the rounds and took a member's replica."""
        with self._lock:
            self.replica_groups_joined += count

    def record_heal(self) -> None:
        """This rank's non-finite weights (or a fragment of them) took the healthy replicas' consensus."""
        with self._lock:
            self.nonfinite_replicas_healed += 1

    def record_step(self, sync_seconds: float, step: int | None = None) -> None:
        """A training step ended; `sync_seconds` of it were spent in shadowgba code; `step`: the
        runtime's step count now, which `record_applied` counts in (default: the steps recorded)."""
        with self._lock:
            self.steps += 1
            self._last_step = self.steps if step is None else step
            self.training_sync_s += sync_seconds

    def memory(self) -> dict[str, int]:
        """Bytes of each dense-sized tensor the runtime holds (snapshot, all-reduce buffer, algorithm
        state and scratch, GBA queue ...): what it adds to a trainer's resident memory beyond the
        model and its optimizer, allocated once and reused."""
        return held_bytes(self._held()) if self._held is not None else {}

    def summary(self) -> dict[str, float]:
        """A consistent snapshot of every counter plus derived rates, and `memory_bytes`, the sum of
        `memory()`, of which `lane_bytes` is the transport's same-host shared-memory lanes (sized by
        `sync.ps.lane_mb` per channel and direction, not by the model)."""
        memory = self.memory()
        memory_bytes = sum(memory.values())
        tables = dict(self._tables()) if self._tables is not None else None
        with self._lock:
            elapsed = max(time.monotonic() - self._started, 1e-9)
            if tables is not None:
                tables.update(table_rounds=self.table_rounds, table_bytes_moved=self.table_bytes_moved,
                              table_round_latency_ms_mean=1e3 * self.table_round_time_total_s / max(self.table_rounds, 1))
            return (tables or {}) | {
                "rounds": self.rounds,
                "rounds_per_s": self.rounds / elapsed,
                "round_latency_ms_mean": 1e3 * self.round_time_total_s / max(self.rounds, 1),
                "round_latency_ms_max": 1e3 * self.round_time_max_s,
                "bytes_moved": self.bytes_moved,
                "steps": self.steps,
                "applied_rounds": self.applied_rounds,
                "sync_gap_steps_mean": self.sync_gap_total_steps / max(self.applied_rounds, 1),
                "sync_gap_steps_max": self.sync_gap_max_steps,
                "sync_gap_steps_max_between_rounds": self.between_rounds_gap_max_steps,
                "sync_gap_steps": max(0, self._last_step - self._last_applied_step),
                "rounds_per_step": self.rounds / max(self.steps, 1),
                "round_cost_ms_mean": 1e3 * self.round_cost_total_s / max(self.costed_rounds, 1),
                "round_cpu_ms_mean": 1e3 * self.round_cpu_total_s / max(self.costed_rounds, 1),
                "training_sync_s": self.training_sync_s,
                "nonfinite_rounds_skipped": self.nonfinite_rounds_skipped,
                "nonfinite_replicas_healed": self.nonfinite_replicas_healed,
                "replica_groups_lost": self.replica_groups_lost,
                "replica_groups_joined": self.replica_groups_joined,
                "nonfinite_steps_skipped": self._guard.skipped_steps if self._guard is not None else 0,
                "memory_bytes": memory_bytes,
                "lane_bytes": sum(size for name, size in memory.items() if name.startswith(LANE_PREFIX)),
                "elapsed_s": elapsed,
            }

    def format(self) -> str:
        """One log line."""
        s = self.summary()
        return (
            f"rounds={s['rounds']} ({s['rounds_per_s']:.1f}/s, {s['round_latency_ms_mean']:.1f} ms mean, "
            f"{s['round_latency_ms_max']:.1f} ms max) steps={s['steps']} "
            f"rounds_per_step={s['rounds_per_step']:.3f} sync_gap={s['sync_gap_steps_mean']:.1f} steps "
            f"(max {s['sync_gap_steps_max']}, now {s['sync_gap_steps']}) "
            f"moved={s['bytes_moved'] / 2**20:.1f} MiB training_sync={s['training_sync_s']:.3f}s "
            f"held={s['memory_bytes'] / 2**20:.1f} MiB"
            + (f" round_cost={s['round_cost_ms_mean']:.1f} ms (cpu {s['round_cpu_ms_mean']:.1f} ms)"
               if s["round_cost_ms_mean"] or s["round_cpu_ms_mean"] else "")
            + (f" nonfinite_skipped={s['nonfinite_rounds_skipped']}" if s["nonfinite_rounds_skipped"] else "")
            + (f" own_steps_skipped={s['nonfinite_steps_skipped']}" if s["nonfinite_steps_skipped"] else "")
            + (f" healed={s['nonfinite_replicas_healed']}" if s["nonfinite_replicas_healed"] else "")
            + (f" table_rounds={s['table_rounds']} table_cycles={s['table_cycles']} "
               f"fragment_age={s['fragment_age_steps_mean']:.1f} steps (max {s['fragment_age_steps_max']})"
               if "table_rounds" in s else "")
        )


class GBAMetrics(SyncMetrics):
    """SyncMetrics plus what is particular to GBA: queue drops, decayed / dropped pushes, switches."""

    def __init__(self, held: HeldTensors | None = None, guard: NonFiniteGuard | None = None) -> None:
        super().__init__(held, guard)
        self.queue_dropped = 0
        self.push_weights = StalenessCounts()
        """The decay weights this trainer's pushes got back from the shards (decayed / dropped)."""
        self.mode_switches = 0
        self.nonfinite_skipped = 0
        """Non-finite (NaN / Inf) gradients left out under on_nonfinite skip: in sync mode every
        trainer counts every trainer's; in GBA and local mode each counts its own."""
        self.server_restarts = 0
        """Times this trainer found a server restored from its checkpoint and took its parameters again."""
        self.pushes_lost_to_restart = 0
        """Gradients in flight or queued when a server restarted: computed on newer parameters than
        the restored ones, never applied."""
        self.fresh_waits = 0
        """GBA steps that waited for the global step their gradient entered (`GBAConfig.fresh_wait`)."""
        self.fresh_wait_s = 0.0
        """The training thread's time spent in those waits."""
        self.fresh_timeouts = 0
        """Waits that ended at their bound: the next gradient was computed on older parameters."""
        self.fresh_skipped = 0
        """Waits that ended with the push's answer: the rest of its global batch was predicted to take
        longer than a wait worth taking (`shadowgba.gba.fresh`)."""

    def record_fresh_wait(self, seconds: float, fresh: bool | None) -> None:
        """A GBA step waited `seconds` for the global step its gradient entered; `fresh`: it came in
        time (False: timed out; None: not waited for past the push's answer)."""
        with self._lock:
            self.fresh_waits += 1
            self.fresh_wait_s += seconds
            self.fresh_timeouts += int(fresh is False)
            self.fresh_skipped += int(fresh is None)

    def record_push(self, weight: float) -> None:
        """A shard answered a push with the decay weight it gave the gradient (0: dropped)."""
        with self._lock:
            self.push_weights.count_weight(weight)

    def record_queue_drop(self) -> None:
        with self._lock:
            self.queue_dropped += 1

    def record_switch(self) -> None:
        with self._lock:
            self.mode_switches += 1

    def record_nonfinite_skipped(self, count: int = 1) -> None:
        with self._lock:
            self.nonfinite_skipped += count

    def record_server_restart(self, pushes_lost: int, restarted: bool) -> None:
        """Gradients lost to a server's restart; `restarted`: one this trainer had not counted yet."""
        with self._lock:
            self.server_restarts += int(restarted)
            self.pushes_lost_to_restart += pushes_lost

    def summary(self) -> dict[str, float]:
        summary = super().summary()
        with self._lock:
            summary.update(
                queue_dropped=self.queue_dropped, decayed=self.push_weights.decayed,
                stale_dropped=self.push_weights.dropped, mode_switches=self.mode_switches,
                nonfinite_skipped=self.nonfinite_skipped, server_restarts=self.server_restarts,
                pushes_lost_to_restart=self.pushes_lost_to_restart, fresh_waits=self.fresh_waits,
                fresh_wait_s=self.fresh_wait_s, fresh_timeouts=self.fresh_timeouts, fresh_skipped=self.fresh_skipped,
            )
        return summary

    def format(self) -> str:
        """One log line: the common counters, then GBA's (non-finite gradients left out only when any were)."""
        s = self.summary()
        return (
            f"{super().format()} queue_dropped={s['queue_dropped']} decayed={s['decayed']} "
            f"stale_dropped={s['stale_dropped']} mode_switches={s['mode_switches']}"
            + (f" nonfinite_skipped={s['nonfinite_skipped']}" if s["nonfinite_skipped"] else "")
            + (f" server_restarts={s['server_restarts']} pushes_lost_to_restart={s['pushes_lost_to_restart']}"
               if s["server_restarts"] else "")
        )

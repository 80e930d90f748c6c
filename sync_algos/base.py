"""The small interface every synchronization algorithm implements, and the machinery they share.

An algorithm sees the dense parameters of one trainer as a single flat tensor (the *snapshot* `s`)
and computes a *target* `t` for the round; the runtime then writes `w <- w + (t - s)` back into the
live parameters, so local progress made while the round was in flight survives. Algorithms never
touch the live parameters themselves, which keeps them testable on plain tensors.

A round turns the snapshot's buffer, in place, into that *delta* `t - s`: the delta needs a
dense-sized buffer and the snapshot is not needed once the delta is known, so the runtime keeps one
buffer for both. With the all-reduce buffer also holding each round's intermediate values (EASGD's
pull, BMUF's block update and target), an algorithm holds its state, the snapshot and the
all-reduce buffer, and nothing else dense-sized: MA 2 dense sizes, EASGD 3, BMUF 4.

Stop protocol (why ranks that finish at different steps cannot hang): every round performs exactly
one collective on the algorithm's process group, and that collective carries a *stop flag* in its
last element (summed over ranks). A rank that wants to stop raises its flag in every round from then
on; all ranks see the sum in the same round, and once it counts every rank (`RoundResult.last`) all
of them leave their loops after that round. Because every rank performs the same sequence of
collectives up to and including that round, nobody is left waiting in a collective that its peers
will never enter; and a rank that finished early keeps averaging its last weights with the ranks
still training, instead of leaving them to train apart until the end.

The same collective carries, after the stop flag, one *status* element per rank, written by that
rank alone (so the sum is exact): whether its contribution was left out of the round because it
held NaN / Inf (`NONFINITE`), or because the rank is aborting (`ABORTED`, always with its stop
flag). A third bit, `JOINING`, counts nothing out: the rank saw a replica group waiting to join
the job (`FlaggedAllReduce.joining`, set by the runtime); once every rank saw one in the same round
(`Reduced.joins_seen`), they all let it in after that round, alike (`shadowgba.job.survivors`).
The non-finite rule lives here, once: each rank checks its own contribution before it is
sent, a bad one is sent as zeros, and the average / centre / block update uses only the counted
ranks (`n_good` in place of `n`; no counted rank: the round changes nothing). A rank whose own
contribution was left out takes nothing from the round (`RoundResult.kept_local`): no value from
it reaches a peer. A rank left out because its own weights are non-finite has nothing to keep,
though: when some rank counted, the round gives it the consensus the others reached (MA's and
BMUF's target, EASGD's centre) to take in place of its weights (`RoundResult.healed`): one round
heals a diverged replica, and whether it takes the cure is the runtime's policy. Every rank sees the
same statuses in the same round, so what to do about them (skip or fail, leave after an abort) is
decided alike everywhere.

Last in the trailer, one *steps* element per rank: the training steps that rank took since its
previous round (`FlaggedAllReduce.steps`, set by the runtime). It is not part of any algorithm's
maths; it tells every rank how fast the fastest one steps, so that a runtime can pace its rounds
in steps of the fastest rank (`sync.interval_steps`) without a collective of its own. A count, not
a total since the start, so that a bfloat16 trailer keeps it to within a few percent. After them,
one *cost* element per rank: how long its previous round took it, in milliseconds
(`FlaggedAllReduce.previous_ms`). Each rank's time includes its wait for the ranks that came to the
collective after it; the least of them is the round's own cost, as the last rank to come, which
waited for nobody, paid it (`Reduced.round_cost_ms`): what pacing by cost (`sync.max_round_share`)
needs, without counting as cost the time a rank spent waiting for its peers' pacing.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from typing import Any, ClassVar, ContextManager, Iterable, Mapping

import torch
import torch.distributed as dist

from sync_algos.compressed import CompressedSum


NONFINITE = 1
"""Status bit: this rank's contribution held NaN / Inf and was sent as zeros."""
ABORTED = 2
"""Status bit: this rank is aborting (its user's loop raised); it contributed nothing and stops."""
JOINING = 4
"""Status bit: this rank saw a replica group waiting to join; its contribution counts as usual."""
LEFT_OUT = NONFINITE | ABORTED
"""The status bits that leave a rank's contribution out of the round."""


def is_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of `tensor` is finite (no NaN, no +-Inf): `all_finite` of one tensor."""
    return all_finite((tensor,))


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every value of every one of `tensors` is finite (no NaN, no +-Inf): the test every
    contribution passes, and every step's gradients.

    It runs on every gradient of every step and every push of millions of values, so it is one
    read-only reduction per tensor, the cheapest there is: the sum. A NaN or an infinity anywhere
    makes a sum NaN or infinite, so finite sums prove every value finite. The sums are added up
    and read once: a step's dozens of gradients cost one wait of the host for the device, and on
    CPU one test in place of dozens (the check is most of what the shadow runtime costs a training
    thread a step, docs/benchmarks.md). Only finite values that overflow a sum, or the sum of the
    sums, make it infinite too; that rare case falls back to the exact test of each tensor, the
    minimum and maximum (NaN propagates into both, and -Inf / +Inf become them).
    `isfinite(tensor).all()` would first write a mask as large as the tensor, about ten times slower
    on CPU; the minimum and maximum alone are two to five times slower than the sum."""
    checked = [tensor for tensor in tensors if tensor.is_floating_point() and tensor.numel() > 0]
    if not checked:
        return True
    sums = [tensor.sum() for tensor in checked]
    device = sums[0].device
    total = sums[0] if len(sums) == 1 else torch.stack([value.to(device=device, dtype=torch.float32)
                                                        for value in sums]).sum()
    if bool(torch.isfinite(total)):
        return True
    for tensor in checked:
        low, high = torch.aminmax(tensor)
        if not bool(torch.isfinite(low) & torch.isfinite(high)):
            return False
    return True


@dataclasses.dataclass(frozen=True)
class RoundResult:
    """What one round produced, besides the delta it left in the snapshot's buffer."""

    stop: bool
    """True when some rank raised its stop flag in this round."""
    bytes_moved: int
    """Bytes this rank sent in the round's collective (payload plus flags)."""
    nonfinite_ranks: tuple[int, ...] = ()
    """Ranks (in the algorithm's group) whose contribution held NaN / Inf and was left out."""
    aborted_ranks: tuple[int, ...] = ()
    """Ranks that aborted in this round (contributed nothing, raised their stop flag)."""
    kept_local: bool = False
    """True when this rank takes nothing from the round (its own contribution was left out, or no
    rank's counted): the delta is zero and there is nothing to write back, unless `healed`."""
    healed: bool = False
    """True when this rank's own weights held NaN / Inf and other ranks' counted (`kept_local` is
    then True too): the snapshot's buffer holds the round's consensus itself, not a delta, which a
    runtime that heals puts in place of the weights (`s + (t - s)` would stay NaN)."""
    last: bool = False
    """True when every rank raised its stop flag in this round (for an algorithm without
    collectives, this trainer): the rounds end after it, on every rank alike."""
    fastest_steps: int = 0
    """The most training steps a rank took since its previous round (for an algorithm without
    collectives, this trainer's): what a runtime paces its rounds by."""
    previous_cost_ms: float = 0.0
    """What the previous round cost, without any rank's wait for the others (`Reduced.round_cost_ms`;
    for an algorithm without collectives, this trainer's own time); 0 before any."""
    joins_seen: bool = False
    """True when every rank saw a replica group waiting to join (`Reduced.joins_seen`)."""


@dataclasses.dataclass(frozen=True)
class Reduced:
    """One flagged all-reduce, decoded: the sum over the counted ranks and every rank's status."""

    total: torch.Tensor
    """Sum of the counted ranks' payloads (a view the next call overwrites)."""
    stop: bool
    """Whether any rank raised its stop flag."""
    last: bool
    """Whether every rank raised it: the last round."""
    counted: int
    """How many ranks' payloads are in `total` (n_good)."""
    own_counted: bool
    """Whether this rank's payload is one of them."""
    nonfinite_ranks: tuple[int, ...]
    aborted_ranks: tuple[int, ...]
    fastest_steps: int = 0
    """The most training steps any rank took since its previous round."""
    round_cost_ms: float = 0.0
    """The least of the ranks' times for their previous round (module docstring); 0 before any."""
    own_nonfinite: bool = False
    """Whether this rank's payload held NaN / Inf (and was left out)."""
    joins_seen: bool = False
    """Whether every rank saw a replica group waiting to join (`JOINING`)."""

    @property
    def heals(self) -> bool:
        """Whether this rank's non-finite payload can be replaced by the round's consensus: its own
        was left out for NaN / Inf, and at least one rank's counted."""
        return self.own_nonfinite and self.counted > 0

    def mean_(self) -> torch.Tensor | None:
        """`total / n_good`, divided in place in `total` (no dense-sized temporary per round), or
        None when no rank's payload counted (the round must change nothing)."""
        return self.total.div_(self.counted) if self.counted else None


class FlaggedAllReduce:
    """A sum all-reduce of a flat payload with the round's flags riding in a trailer:
    `[payload | stop | status of rank 0 ... rank n-1 | steps of rank 0 ... rank n-1]` (see the
    module docstring).

    The buffer is allocated once; `Reduced.total` is a view into it (`payload`) that the next call
    overwrites, so callers copy what they keep. A caller may also compute its payload into `payload`
    directly and pass that: it is then summed where it is, without a copy.
    """

    def __init__(self, group: dist.ProcessGroup | None, like: torch.Tensor, compress: str = "none") -> None:
        """`group` None: the default group, or, where torch.distributed is not initialised, this
        process alone (a one-rank sum, with no collective): S-EASGD's trainers in a job without a
        trainer group. `compress` (bf16, int8): the payload goes as a `CompressedSum` (error
        feedback, fp32 sums) after an exact all-reduce of the trailer alone, unless a call asks for
        an exact sum."""
        self._group = group
        self._local = group is None and not dist.is_initialized()
        own = None if self._local else (group if group is not None else dist.group.WORLD)
        # the group's own rank and size: a group made from a store (`shadowgba.groups`) is one torch
        # does not register, and `dist.get_rank(group)` would refuse it
        self.rank = 0 if own is None else own.rank()
        self._size = like.numel()
        self._ranks = 1 if own is None else own.size()
        self._buffer = torch.empty(self._size + 1 + 3 * self._ranks, dtype=like.dtype, device=like.device)
        self.payload = self._buffer[: self._size]
        """The payload part of the buffer: where `sum` sums, and `Reduced.total` is."""
        self.steps = 0
        """This rank's training steps since its previous round, sent in the next call's trailer
        (set by the runtime before each round; pacing only, see the module docstring)."""
        self.previous_ms = 0.0
        """This rank's time for its previous round, in ms, sent in the next call's trailer (set by
        the runtime before each round; pacing only)."""
        self.joining = False
        """Whether this rank saw a replica group waiting to join, sent as `JOINING` in the next call
        (set by the runtime before each round)."""
        self.compressed = None if compress == "none" or self._local else CompressedSum(
            compress, group, self._size, self._ranks, like.device, like.dtype)
        self.bytes_per_call = self._buffer.numel() * self._buffer.element_size()
        """Bytes of the last call's payload and trailer as sent (before any call: an exact one's)."""

    @property
    def buffer(self) -> torch.Tensor:
        """The one buffer every call reuses: `[payload | stop | statuses]`."""
        return self._buffer

    @property
    def ranks(self) -> int:
        """How many ranks the sum runs over."""
        return self._ranks

    def sum(self, payload: torch.Tensor | None, stop: bool, aborted: bool = False, exact: bool = False) -> Reduced:
        """All-reduce (sum) `payload` over the group, unless it holds NaN / Inf: then zeros go in its
        place and this rank is flagged. `payload=None` (with `aborted`) contributes nothing;
        `payload` may be `self.payload`, filled in place by the caller. `exact`: in full precision
        even where `compressed` (every rank must ask alike)."""
        if payload is None and not aborted:
            raise ValueError("only an aborting rank may contribute no payload")
        body, trailer = self.payload, self._buffer[self._size :]
        status = (ABORTED if aborted else 0) | (JOINING if self.joining else 0)
        if payload is not None and payload is not body:
            body.copy_(payload)
        if payload is None or not is_finite(body):
            body.zero_()
            if payload is not None:
                status |= NONFINITE
        trailer.zero_()
        trailer[0] = 1.0 if stop or aborted else 0.0
        trailer[1 + self.rank] = float(status)
        trailer[1 + self._ranks + self.rank] = float(self.steps)
        trailer[1 + 2 * self._ranks + self.rank] = float(self.previous_ms)
        if self._local:
            pass
        elif self.compressed is None or exact:
            dist.all_reduce(self._buffer, op=dist.ReduceOp.SUM, group=self._group)
            self.bytes_per_call = self._buffer.numel() * self._buffer.element_size()
        else:  # the flags first, exactly; the payload in fewer bytes
            dist.all_reduce(trailer, op=dist.ReduceOp.SUM, group=self._group)
            self.compressed.sum_(body, contributes=not status & LEFT_OUT)
            self.bytes_per_call = self.compressed.bytes_per_call + trailer.numel() * trailer.element_size()
        any_stop, *flags = (int(value) for value in trailer.tolist())
        statuses, steps, costs = flags[: self._ranks], flags[self._ranks : 2 * self._ranks], flags[2 * self._ranks :]
        return Reduced(
            total=body,
            stop=any_stop > 0,
            last=any_stop == len(statuses),
            counted=sum(1 for value in statuses if not value & LEFT_OUT),
            own_counted=not statuses[self.rank] & LEFT_OUT,
            nonfinite_ranks=tuple(r for r, value in enumerate(statuses) if value & NONFINITE),
            aborted_ranks=tuple(r for r, value in enumerate(statuses) if value & ABORTED),
            fastest_steps=max(steps),
            round_cost_ms=float(min(costs)),
            own_nonfinite=bool(statuses[self.rank] & NONFINITE),
            joins_seen=all(value & JOINING for value in statuses),
        )


class SyncAlgorithm(abc.ABC):
    """One synchronization algorithm bound to a process group.

    Subclasses set `name` and `Config` (a dataclass validating itself in `__post_init__` with
    `ValueError`s), keep their state as flat tensors named in `state_names`, and implement `round`.
    """

    name: ClassVar[str]
    kind: ClassVar[str] = "model"
    uses_collectives: ClassVar[bool] = True
    """False for algorithms that only talk to a parameter server: no lockstep, no shadow group."""
    averages_snapshots: ClassVar[bool] = True
    """Whether its rounds average the snapshots (`average`), which compressed rounds send as their
    difference from `reference`; False where only the consensus start does (EASGD sums pulls)."""
    Config: ClassVar[type]
    state_names: ClassVar[tuple[str, ...]] = ()
    state_guard: ContextManager[Any] = contextlib.nullcontext()
    """Held whenever the state changes: by a round only after its collective (never across one),
    by `start_at` and `load_state_dict`; `state_dict` copies under it. A runtime that reads the
    state from another thread than the rounds' puts a lock here, so a checkpoint gets a state no
    round is halfway through changing and waits at most for those few vector operations, never
    for a round that waits in its collective (a peer may be waiting for this rank's checkpoint)."""

    def __init__(self, config: Any, group: dist.ProcessGroup | None, initial: torch.Tensor,
                 compress: str = "none") -> None:
        """`initial` is the flat dense parameters, already identical on every rank. `compress`
        (bf16, int8; `sync_algos.compressed`): the rounds' sums go in fewer bytes, and what the
        replicas average is their difference from `reference`, a vector every rank holds alike."""
        self.config = config
        self.group = group
        self.compress = compress
        self.allreduce = FlaggedAllReduce(group, initial, compress)
        self.world_size = self.allreduce.ranks
        self.rank = self.allreduce.rank
        self.started = False  # until the first round (or a restored state) has placed the state
        self.reference = initial.clone() if compress != "none" and self.averages_snapshots else None
        """Compressed rounds of an algorithm that `averages_snapshots`: the last round's consensus, the
        same on every rank, from which the replicas send their difference (a small one, whose
        rounding costs a fraction of itself). None otherwise: every average runs exact."""
        self.reference_agreed = False
        """Whether `reference` is the last round's consensus on every rank; until then (the first
        round, after a restore or a regroup) an average runs exact, in full precision."""

    def regroup(self, group: dist.ProcessGroup) -> None:
        """Go on over `group`, the ranks that survived the loss of others: a new flagged all-reduce
        over it, and the next round a consensus start at their average (`sync`), since the round that
        failed may have left the state unequal and constants derived from the rank count change
        (`fit_to_group`)."""
        self.group = group
        self.allreduce = FlaggedAllReduce(group, self.allreduce.payload, self.compress)
        self.world_size = self.allreduce.ranks
        self.rank = self.allreduce.rank
        self.started = False
        self.reference_agreed = False
        self.fit_to_group()

    def fit_to_group(self) -> None:
        """Derive what depends on the group's rank count (at the start and after `regroup`)."""

    def sync(self, snapshot: torch.Tensor, stop: bool) -> RoundResult:
        """The round the runtime runs: `round`, except that the job's first round is a consensus start.
        Either way `snapshot` holds the round's delta `t - s` on return (zero when `kept_local`).

        The replicas train alone for `first_round_after` steps before the first round, so by then the
        initial weights that EASGD's centre and BMUF's global model hold are stale: an EASGD round
        would pull every replica alpha of the way back to them, and BMUF would read the whole warm-up
        as one block and push past it with momentum. On the synthetic quality benchmark each sent one
        seed in three to a basin 0.007-0.013 AUC lower for 6M samples. So the first round averages
        the replicas and starts the algorithm's state there (`start_at`), as fairseq's BMUF does after
        its warm-up; from the second round on the algorithm runs its own formula. A state restored
        from a checkpoint is already placed and is kept. Algorithms without collectives (S-EASGD on
        the PS) have no average to start from and run `round` from the first round on.
        """
        if self.started or not self.uses_collectives:
            return self.round(snapshot, stop)
        average, reduced = self.average(snapshot, stop)
        if average is not None:  # a round in which no rank counted places nothing
            with self.state_guard:
                self.start_at(average)
            self.started = True
        return self.result(snapshot, reduced, average)

    @abc.abstractmethod
    def round(self, snapshot: torch.Tensor, stop: bool) -> RoundResult:
        """Run one round from the flat snapshot `s`, turning `snapshot` into the delta `t - s` (zero
        when `kept_local`); raise the stop flag when `stop` is true."""

    def start_at(self, consensus: torch.Tensor) -> None:
        """Place the algorithm's state at `consensus`, the replicas' average (nothing to place for MA)."""

    def average(self, snapshot: torch.Tensor, stop: bool) -> tuple[torch.Tensor | None, Reduced]:
        """The average of the finite snapshots, `allreduce(s) / n_good` (None if none was finite),
        with the round's flags: the building block of MA and BMUF. Compressed: `reference +
        allreduce(s - reference) / n_good`, once the reference is agreed."""
        if self._average_exact:
            reduced = self.allreduce.sum(snapshot, stop, exact=True)
            return reduced.mean_(), reduced
        difference = torch.sub(snapshot, self.reference, out=self.allreduce.payload)
        reduced = self.allreduce.sum(difference, stop)
        mean = reduced.mean_()
        return (None if mean is None else mean.add_(self.reference)), reduced

    def averaging_round(self, snapshot: torch.Tensor, stop: bool) -> RoundResult:
        """A round whose target is the replicas' average: MA's every round, every algorithm's first."""
        average, reduced = self.average(snapshot, stop)
        return self.result(snapshot, reduced, average)

    def result(self, snapshot: torch.Tensor, reduced: Reduced, target: torch.Tensor | None = None,
               consensus: torch.Tensor | None = None) -> RoundResult:
        """This rank's `RoundResult`, with `snapshot` made the delta: `target - snapshot` when
        `target` is given, else `snapshot` already holds it (EASGD computes it before its collective).
        A rank whose own contribution was left out (no rank counted, or not this one) takes nothing
        from the round: its delta is zero; if it was left out for NaN / Inf while others counted,
        `snapshot` holds the round's `consensus` instead (default `target`; `RoundResult.healed`)."""
        kept_local = not reduced.own_counted
        consensus = target if consensus is None else consensus
        if self.reference is not None and consensus is not None and reduced.counted:
            self.reference.copy_(consensus)  # the same on every rank: the next round's reference
            self.reference_agreed = True
        healed = kept_local and reduced.heals and consensus is not None
        if healed:
            snapshot.copy_(consensus)
        elif kept_local:
            snapshot.zero_()
        elif target is not None:
            torch.sub(target, snapshot, out=snapshot)
        return RoundResult(reduced.stop, self.allreduce.bytes_per_call, reduced.nonfinite_ranks,
                           reduced.aborted_ranks, kept_local=kept_local, healed=healed, last=reduced.last,
                           fastest_steps=reduced.fastest_steps, previous_cost_ms=reduced.round_cost_ms,
                           joins_seen=reduced.joins_seen)

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every dense-sized tensor the algorithm holds, by name: its all-reduce buffer and its state.
        A round allocates none beyond these and the snapshot: its intermediate values live in the
        all-reduce buffer's payload, its result in the snapshot's buffer."""
        held = {"allreduce": self.allreduce.buffer, **{name: getattr(self, name) for name in self.state_names}}
        if self.reference is not None:
            held["reference"] = self.reference
        if self.allreduce.compressed is not None:
            held["residual"] = self.allreduce.compressed.residual
        return held

    @property
    def _average_exact(self) -> bool:
        """Whether an average runs exact (`average`): no reference, or none agreed yet."""
        return self.reference is None or not self.reference_agreed

    def abort_round(self) -> None:
        """This rank's last round when it aborts: no payload, the stop flag with the aborted marker.
        It pairs with its peers' next round, so they leave after it knowing who aborted; so it sums
        as that round does, exact or compressed (alike on every rank): exact where it is an average
        (`sync`'s first round, MA's and BMUF's every round) before the reference is agreed. A
        compressed abort against an exact round is a collective mismatch: gloo ended the aborting
        process (SIGABRT) and the peer failed naming no one. Nothing to tell without collectives
        (S-EASGD): each trainer's rounds are its own."""
        if self.uses_collectives:
            exact = (self.averages_snapshots or not self.started) and self._average_exact
            self.allreduce.sum(None, stop=True, aborted=True, exact=exact)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The algorithm's state (centre, global model, momentum ...) as cloned flat tensors."""
        with self.state_guard:
            return {name: getattr(self, name).clone() for name in self.state_names}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore state saved by `state_dict`; refuse, touching nothing, if it does not fit or holds
        NaN / Inf (a replicated centre or global model would spread it to every replica)."""
        if not isinstance(state, Mapping):
            raise ValueError(f"{self.name} state must be a mapping of {list(self.state_names)}, got {type(state).__name__}")
        missing = set(self.state_names) - set(state)
        unexpected = set(state) - set(self.state_names)
        if missing or unexpected:
            raise ValueError(
                f"{self.name} state_dict mismatch: missing {sorted(missing)}, "
                f"unexpected {sorted(unexpected)}; expected keys {list(self.state_names)}"
            )
        for name in self.state_names:
            current: torch.Tensor = getattr(self, name)
            value = state[name]
            if not isinstance(value, torch.Tensor) or value.shape != current.shape:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                raise ValueError(
                    f"{self.name} state '{name}' has shape {shape}, expected "
                    f"{tuple(current.shape)} (was the checkpoint made for another model?)"
                )
            if not is_finite(value):
                raise ValueError(f"{self.name} state '{name}' holds NaN or Inf values")
        with self.state_guard:
            for name in self.state_names:
                getattr(self, name).copy_(state[name])
        self.started = True
        self.reference_agreed = False  # the replicas come back apart: the next average is exact

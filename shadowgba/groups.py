"""Process groups the library makes, registered with torch or made from a store of its own.

Most of the library's groups are `dist.new_group`s of the job's default group. A 2D job launched as
one torchrun job per replica group (`shadowgba.job.survivors`) has no default group over every
rank: each torchrun job's default group is its own sharding group, and the groups across them (the
dense rounds, the replica groups) are made here from the store the jobs share, one set per epoch
of the membership. torch does not register such a group, so `dist.get_rank(group)`,
`dist.get_global_rank` and `dist.destroy_process_group` refuse it; the library asks this module
instead, which answers for both kinds:

- `members(group)`: the job-wide ranks of a group's members, in group-rank order (what logs name);
- `duplicate(group)`: a new group of the same members (a runtime's own traffic apart from the user's);
- `release(group)`: destroy a group made either way.

Collectives themselves (`dist.all_reduce(..., group=g)`, `dist.broadcast(..., group_src=i)`)
accept both kinds alike, so the algorithms and the runtime never tell them apart.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import weakref
from typing import Sequence

import torch
import torch.distributed as dist



@dataclasses.dataclass(frozen=True)
class _Made:
    """How `from_store` made a group: what `members` and `duplicate` need of it."""

    store: dist.Store
    prefix: str
    ranks: tuple[int, ...]
    rank: int
    timeout_s: float
    device: torch.device
    copies: itertools.count = dataclasses.field(default_factory=lambda: itertools.count(1), compare=False)


_MADE: weakref.WeakKeyDictionary[dist.ProcessGroup, _Made] = weakref.WeakKeyDictionary()
"""The groups `from_store` made (torch knows the others')."""


def from_store(store: dist.Store, prefix: str, ranks: Sequence[int], rank: int, timeout_s: float,
               device: torch.device) -> dist.ProcessGroup:
    """Collective over `ranks` (job-wide, each calling with its own `rank`): a group of exactly them,
    rendezvousing under `prefix` in `store` (unique per group: a prefix used twice would meet the
    earlier group's keys). Gloo, or NCCL for a CUDA `device`. Its collectives time out after
    `timeout_s`, and so does its making when a member never comes."""
    ranks = tuple(ranks)
    timeout = datetime.timedelta(seconds=timeout_s)
    scoped = dist.PrefixStore(f"{prefix}/", store)
    group_rank, size = ranks.index(rank), len(ranks)
    group = dist.ProcessGroup(scoped, group_rank, size)
    if device.type == "cuda":  # the same code path, ready for a GPU (not exercised on CPU-only CI)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend = dist.ProcessGroupNCCL(scoped, group_rank, size, options)
        kind = dist.ProcessGroup.BackendType.NCCL
    else:
        backend = dist.ProcessGroupGloo(scoped, group_rank, size, timeout)
        kind = dist.ProcessGroup.BackendType.GLOO
    group._set_default_backend(kind)
    group._register_backend(device, kind, backend)
    if device.type != "cpu":
        group._register_backend(torch.device("cpu"), kind, backend)
    _MADE[group] = _Made(store, prefix, ranks, rank, timeout_s, device)
    return group


def members(group: dist.ProcessGroup) -> tuple[int, ...]:
    """The job-wide ranks of `group`'s members, member `i` at index `i`."""
    made = _MADE.get(group)
    return made.ranks if made is not None else tuple(dist.get_process_group_ranks(group))


def duplicate(group: dist.ProcessGroup | None, timeout_s: float, backend: str) -> dist.ProcessGroup:
    """Collective over `group`'s members (None: every rank): a new group of exactly them, whose
    collectives time out after `timeout_s`. Every member duplicates a group the same number of times."""
    made = _MADE.get(group) if group is not None else None
    if made is None:
        ranks = None if group is None else list(members(group))
        return dist.new_group(ranks=ranks, backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return from_store(made.store, f"{made.prefix}/copy{next(made.copies)}", made.ranks, made.rank, timeout_s,
                      made.device)


def release(group: dist.ProcessGroup) -> None:
    """Destroy `group`, however it was made."""
    if group in _MADE:
        group.shutdown()
    else:
        dist.destroy_process_group(group)

"""The one authoritative dense optimizer of sync and GBA mode, over a flat parameter vector.

Sync all-reduce mode runs it on every trainer over the whole flat vector; GBA runs it on the
parameter servers, each over its contiguous slice. Because the supported optimizers are
elementwise (SGD with momentum, Adagrad, Adam, AdamW), a slice of the whole-vector state *is* the
state of the slice, so switching modes moves parameters and optimizer state by slicing and
concatenating, exactly, with nothing to retune. The learning rate follows a schedule indexed by the
global step, which travels with the state.

The step runs torch's fused kernel (one pass over parameters, gradient and state; on CPU about 3x
faster than the single-tensor loop, and on the servers the optimizer is most of a global step's
cost). A fused kernel computes the last few elements of a vector (fewer than a SIMD loop's width)
by a scalar path whose rounding may differ by an ulp, so slices step bit-identically to the
whole vector only if every slice but the last starts and ends on a multiple of that width:
`shard_bounds` cuts on multiples of `SHARD_ALIGN` elements for that reason (vectors too short to
give every shard `SHARD_ALIGN` elements are cut anywhere, and are then equal only to an ulp).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch import nn

from shadowgba.errors import CheckpointError, ConfigError, SetupError
from shadowgba.serialized import check_count, check_entries


@dataclasses.dataclass
class LRSchedule:
    """Learning rate as a function of the global step k: linear warm-up, then step decay."""

    warmup_steps: int = 0
    """Global steps of linear warm-up from lr/warmup_steps to lr; 0 disables."""
    decay_every: int = 0
    """Multiply the learning rate by decay_gamma every this many global steps; 0 disables."""
    decay_gamma: float = 1.0
    """Step-decay factor, in (0, 1]."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.decay_every < 0:
            raise ConfigError("warmup_steps and decay_every must be >= 0")
        if not 0.0 < self.decay_gamma <= 1.0:
            raise ConfigError(f"decay_gamma must be in (0, 1], got {self.decay_gamma}")

    def factor(self, global_step: int) -> float:
        """Multiplier of the base learning rate at global step k."""
        warmup = min(1.0, (global_step + 1) / self.warmup_steps) if self.warmup_steps else 1.0
        decay = self.decay_gamma ** (global_step // self.decay_every) if self.decay_every else 1.0
        return warmup * decay


SUPPORTED: dict[str, type[torch.optim.Optimizer]] = {
    "SGD": torch.optim.SGD,
    "Adagrad": torch.optim.Adagrad,
    "Adam": torch.optim.Adam,
    "AdamW": torch.optim.AdamW,
}


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer, with which hyperparameters: what a trainer sends a server to build it."""

    name: str
    defaults: dict[str, Any]
    schedule: LRSchedule

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, schedule: LRSchedule) -> "OptimizerSpec":
        """The spec of a user's optimizer: same type, same hyperparameters."""
        name = type(optimizer).__name__
        if name not in SUPPORTED:
            raise SetupError(f"optimizer {name} is not supported for sync/GBA modes; supported: {sorted(SUPPORTED)}")
        if len(optimizer.param_groups) != 1:
            raise SetupError("sync/GBA modes need a dense optimizer with exactly one param group")
        group = optimizer.param_groups[0]
        accepted = inspect.signature(SUPPORTED[name]).parameters  # defaults may hold more (AdamW)
        defaults = {key: group[key] for key in optimizer.defaults if key in group and key in accepted and key != "params"}
        return cls(name, defaults, schedule)


class FlatOptimizer:
    """An optimizer over one flat vector, stepped with a given gradient; tracks the global step."""

    def __init__(self, spec: OptimizerSpec, initial: torch.Tensor) -> None:
        self.spec = spec
        self.param = nn.Parameter(initial.detach().clone())
        defaults = {**spec.defaults, "foreach": None, "fused": True} if not spec.defaults.get("differentiable") \
            else dict(spec.defaults)
        self.optimizer = SUPPORTED[spec.name]([self.param], **defaults)
        self.base_lr = float(spec.defaults["lr"])
        self.global_step = 0

    def step(self, gradient: torch.Tensor) -> None:
        """One optimizer step with `gradient` at the scheduled learning rate; advances k."""
        self.optimizer.param_groups[0]["lr"] = self.base_lr * self.spec.schedule.factor(self.global_step)
        self.param.grad = gradient
        self.optimizer.step()
        self.param.grad = None
        self.global_step += 1

    def export(self) -> dict[str, Any]:
        """Parameters, optimizer state and global step, as plain tensors."""
        state = self.optimizer.state.get(self.param, {})
        return {
            "param": self.param.detach().clone(),
            "state": {key: value.clone() if torch.is_tensor(value) else value for key, value in state.items()},
            "global_step": self.global_step,
        }

    def load(self, exported: dict[str, Any]) -> None:
        """Take over `export()` output (possibly sliced or concatenated); refuses a size mismatch."""
        param = exported["param"]
        if param.shape != self.param.shape or param.dtype != self.param.dtype:
            raise CheckpointError(
                f"optimizer state for {tuple(param.shape)} {param.dtype} cannot load into "
                f"{tuple(self.param.shape)} {self.param.dtype}"
            )
        with torch.no_grad():
            self.param.copy_(param)
        self.optimizer.state[self.param] = {
            key: value.clone() if torch.is_tensor(value) else value for key, value in exported["state"].items()
        }
        self.global_step = int(exported["global_step"])


def state_keys(spec: OptimizerSpec, dtype: torch.dtype) -> set[str]:
    """The keys of `spec`'s optimizer state once it has stepped (e.g. Adam: step, exp_avg, exp_avg_sq)."""
    probe = FlatOptimizer(spec, torch.zeros(1, dtype=dtype))
    probe.step(torch.zeros(1, dtype=dtype))
    return set(probe.export()["state"])


def check_export(exported: Any, spec: OptimizerSpec, numel: int, dtype: torch.dtype, what: str) -> dict[str, Any]:
    """`exported` if it is an export of `spec`'s optimizer (`FlatOptimizer.export`) over `numel`
    values of `dtype`: its parameters, a state of that optimizer's keys whose per-element tensors
    have the same length, everything finite, a global step that is an integer >= 0. Else
    `CheckpointError` naming `what`: the one check of such a state before it is loaded, by a
    trainer (its checkpoint) and by a dense shard (its slice). Reads only."""
    exported = check_entries(exported, what, ("param", "state", "global_step"))
    param, state = exported["param"], exported["state"]
    check_count(exported["global_step"], f"{what}'s global_step")
    if not torch.is_tensor(param) or param.shape != (numel,) or param.dtype != dtype:
        got = f"{tuple(param.shape)} {param.dtype}" if torch.is_tensor(param) else type(param).__name__
        raise CheckpointError(f"{what} holds {got} parameter values, not ({numel},) {dtype}")
    expected = state_keys(spec, dtype)
    if not isinstance(state, dict) or (state and set(state) != expected):
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{what}'s optimizer state {keys} is not {spec.name}'s {sorted(expected)}")
    tensors = {"param": param, **{key: value for key, value in state.items() if torch.is_tensor(value)}}
    for key, value in tensors.items():
        if value.dim() > 0 and value.shape != (numel,):
            raise CheckpointError(f"{what}'s optimizer state '{key}' has shape {tuple(value.shape)}, expected ({numel},)")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"{what}'s '{key}' has NaN or Inf values")
    return exported


def _per_element(value: Any, numel: int) -> bool:
    """Whether an optimizer state entry holds one value per element of a vector of `numel` (Adam's
    moments), rather than one for the whole vector (its scalar `step`, which a 1-element vector's
    moments would otherwise be mistaken for): what `slice_export` slices and `concat_exports` joins."""
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == numel


def slice_export(exported: dict[str, Any], start: int, end: int) -> dict[str, Any]:
    """The part of an `export()` that belongs to elements [start, end)."""
    numel = exported["param"].numel()
    return {
        "param": exported["param"][start:end].clone(),
        "state": {
            key: value[start:end].clone() if _per_element(value, numel) else value
            for key, value in exported["state"].items()
        },
        "global_step": exported["global_step"],
    }


def concat_exports(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Reassemble slices made by `slice_export` (in order) into one whole-vector export."""
    steps = {part["global_step"] for part in parts}
    if len(steps) != 1:
        raise ValueError(f"slices come from different global steps {sorted(steps)}")
    first = parts[0]["state"]
    state: dict[str, Any] = {}
    for key, value in first.items():
        if _per_element(value, parts[0]["param"].numel()):
            state[key] = torch.cat([part["state"][key] for part in parts])
        else:
            state[key] = value
    return {"param": torch.cat([part["param"] for part in parts]), "state": state, "global_step": steps.pop()}


SHARD_ALIGN = 256
"""Shard edges fall on multiples of this many elements (module docstring): a multiple of every
CPU SIMD loop width of the fused kernels (AVX-512: 16 float32, unrolled up to 4 times)."""


def shard_bounds(numel: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal [start, end) slices of a flat vector, one per shard, the inner edges
    on multiples of `SHARD_ALIGN` when every shard can have that many elements."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    align = SHARD_ALIGN if numel >= SHARD_ALIGN * num_shards else 1
    edges = [round(numel * index / num_shards / align) * align for index in range(num_shards)] + [numel]
    return list(zip(edges[:-1], edges[1:]))

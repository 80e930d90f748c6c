"""TorchRec integration: every TorchRec internal shadowgba relies on, in one place.

- `ShadowDataParallelWrapper` keeps the dense part of a `DistributedModelParallel` out of DDP.
  TorchRec's default `DataParallelWrapper` wraps every unsharded parameter in DDP, which all-reduces
  dense gradients inside backward: exactly the blocking sync shadowgba removes. This wrapper only
  places the module on its device, leaving the dense replicas to the sync runtime. The same code
  path serves gloo on CPU and NCCL on GPUs.
- `dense_named_parameters`: a DMP's parameters minus its sharded tables.
- `refuse_dense_ddp`: a DMP built without `dmp_kwargs` has its dense part in TorchRec's DDP, which
  all-reduces every gradient inside backward; with a sync on top the job pays both, silently. Refused.
- `dmp_kwargs` / `ShardingGuard`: with parameter-server ranks in the job, TorchRec must shard
  over the trainers only; a DMP over the whole world would wait forever for the servers in its
  planner's collectives and all-to-all, so its construction is refused, naming the fix. In a 2D
  job (`shadowgba.layout`) it shards over the rank's sharding group, and the guard gives every
  group the same plan (`group_plan`).
- `fused_table_shards`: the rows of the tables a rank holds and their fused optimizer state, as
  views into FBGEMM's kernels, for the 2D runtime to average across replica groups.
- `dense_optimizer`: the torch optimizer of the dense parameters inside TorchRec's
  `KeyedOptimizerWrapper` / `CombinedOptimizer` (GBA mirrors its type and hyperparameters).
- `give_lazy_state`: TorchRec's `KeyedOptimizer.load_state_dict` refuses a saved state for an
  optimizer that has not stepped yet (torch's optimizers create their state at the first step),
  which is every optimizer of a job resuming from a checkpoint; this creates those entries first.
- `BatchCheck` / `check_batches`: a malformed batch (unknown or missing feature keys, ids outside a
  table, lengths that do not add up to the values) is refused on the rank that got it, naming the
  feature, the table and the bad value, before a sharded `EmbeddingBagCollection`'s input
  distribution sees it. TorchRec validates only the first batch (and an id beyond a table only with
  a warning); FBGEMM's CPU kernels then read out of bounds silently or crash, and a rank that fails
  inside the all-to-all leaves its peers waiting in it. `ShardingGuard` installs the check on every
  DMP the trainers of a job with servers build; `check_batches(model)` installs it on any DMP.
- `guard_tables(model, guard)`: the gradient of a sharded `EmbeddingBagCollection`'s pooled
  embeddings is checked on the rank that computed it, before TorchRec's backward all-to-all (or
  reduce-scatter) carries it to the ranks owning the shards, whose fused optimizer applies it
  inside backward. A NaN / Inf one is replaced by zeros (the collective still runs: every peer
  waits for this rank's part) and recorded in the guard (`shadowgba.nonfinite`), which skips or
  fails this rank's step: no peer's shard ever receives it.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.remote_device import _remote_device
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import ShardingEnv, ShardingPlan, ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from shadowgba.errors import BatchError, SetupError
from shadowgba.layout import ReplicaLayout
from shadowgba.nonfinite import NonFiniteGuard
from shadowgba.ps.embedding import PSEmbeddingBagCollection
from shadowgba.ps.embedding_shard import id_out_of_range, ids_outside
from shadowgba.shadow.tables import TableShard

__all__ = [
    "BatchCheck", "ShadowDataParallelWrapper", "ShardingGuard", "check_batches", "dense_named_parameters",
    "dense_optimizer", "dmp_kwargs", "fused_table_shards", "give_lazy_state", "group_plan", "guard_tables",
    "has_sharded_tables", "refuse_dense_ddp",
]

FUSED_KERNELS = ("fused", "fused_uvm")
"""Compute kernels whose rows and optimizer state live in FBGEMM's own storage, where a 2D job's
table averaging reads and writes them (`fused_table_shards`). Any other kernel is refused in 2D."""


class ShadowDataParallelWrapper(DataParallelWrapper):
    """A `DataParallelWrapper` that applies no data parallelism to the dense part."""

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        dmp._dmp_wrapped_module = dmp._dmp_wrapped_module.to(device)


def dmp_kwargs(group: dist.ProcessGroup) -> dict[str, Any]:
    """`DistributedModelParallel` keyword arguments: shard over `group` (the trainers, or a 2D job's
    sharding group), no dense DDP."""
    return {"env": ShardingEnv.from_process_group(group), "data_parallel_wrapper": ShadowDataParallelWrapper()}


def group_plan(module: nn.Module, sharders: Sequence[Any], plan: ShardingPlan | None, layout: ReplicaLayout,
               trainer_group: dist.ProcessGroup, device: torch.device) -> ShardingPlan:
    """The plan of a 2D job's DMP on this rank: the same shards at the same positions in every
    replica group (what makes partners' shards replicas of each other), with fused kernels.

    Without a `plan`, TorchRec's planner plans for one group's k ranks, every table on a fused
    kernel, on the trainers' first rank and broadcasts it to every trainer (TorchRec's own default
    would plan on the sharding group's first rank and broadcast from global rank 0, which groups
    past the first do not hold; and it may pick a non-fused kernel for a small table). A given
    plan is checked to be the same on every trainer. Either way the shards' placements are made to
    name the global ranks of this rank's group, as `ShardedTensor` requires, while `ranks` stay
    positions in the group, as the sharding environment counts them."""
    if plan is None:
        topology = Topology(world_size=layout.group_size, compute_device=device.type,
                            local_world_size=min(layout.group_size, int(os.environ.get("LOCAL_WORLD_SIZE",
                                                                                        layout.group_size))))
        tables = [config.name for collection in module.modules() if isinstance(collection, EmbeddingBagCollection)
                  for config in collection.embedding_bag_configs()]
        tables += [config.name for collection in module.modules() if isinstance(collection, EmbeddingCollection)
                   for config in collection.embedding_configs()]
        # data-parallel tables have no fused kernel: leaving them out spares the planner a warning per table
        sharded = [kind.value for kind in ShardingType if kind != ShardingType.DATA_PARALLEL]
        constraints = {table: ParameterConstraints(compute_kernels=list(FUSED_KERNELS[:1]), sharding_types=sharded)
                       for table in tables}
        planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
        plan = planner.collective_plan(module, list(sharders), trainer_group)
    else:
        plan = copy.deepcopy(plan)
        signatures: list[Any] = [None] * dist.get_world_size(trainer_group)
        dist.all_gather_object(signatures, _plan_signature(plan), group=trainer_group)
        if any(signature != signatures[0] for signature in signatures):
            raise SetupError("the DMP plan differs between trainers; a 2D job needs the same plan in every replica "
                             "group (plan once and broadcast it, e.g. planner.collective_plan over all trainers)")
    for module_path, module_plan in plan.plan.items():
        for name, sharding in module_plan.items():
            if sharding.compute_kernel not in FUSED_KERNELS:
                raise SetupError(
                    f"table {module_path}.{name} has compute kernel '{sharding.compute_kernel}'; a 2D job averages the "
                    f"rows and optimizer state of fused kernels only: pin compute_kernels={list(FUSED_KERNELS[:1])} "
                    "in its ParameterConstraints"
                )
            for shard in getattr(sharding.sharding_spec, "shards", None) or ():
                position = shard.placement.rank()
                if position >= layout.group_size:
                    raise SetupError(f"table {module_path}.{name} is placed on rank {position}, outside a sharding "
                                     f"group of {layout.group_size}: plan for sync.sharding_group_size ranks")
                shard.placement = _remote_device(f"rank:{layout.global_rank(position)}/{shard.placement.device()}")
    return plan


def _plan_signature(plan: ShardingPlan) -> list[tuple[Any, ...]]:
    """What must agree between the trainers' plans: every table's sharding, kernel, positions and shapes."""
    return sorted(
        (path, name, sharding.sharding_type, sharding.compute_kernel, tuple(sharding.ranks or ()),
         tuple((tuple(shard.shard_offsets), tuple(shard.shard_sizes))
               for shard in getattr(sharding.sharding_spec, "shards", None) or ()))
        for path, module_plan in plan.plan.items() for name, sharding in module_plan.items()
    )


def fused_table_shards(model: nn.Module, optimizer_state: bool = True) -> list[TableShard]:
    """Every table shard of `model`'s sharded embedding collections on this rank, in module order:
    its rows (views into the FBGEMM kernel's weights) and the kernel's per-row optimizer state
    (row-wise Adagrad's sum, Adam's moments ...), averaged with the rows with `optimizer_state`,
    else left out of the rounds (`TableShard.state_left_out`), and where its kernel's training
    forwards announce the rows they look up (`TableShard.watch`). Refuses a table whose kernel is not
    fused: its rows or state would not be where this reads them."""
    shards = []
    for path, module in model.named_modules():
        if not isinstance(module, (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)):
            continue
        for lookup in module._lookups:
            lookup = getattr(lookup, "module", lookup)  # a DDP-wrapped (data-parallel) lookup
            for kernel in getattr(lookup, "_emb_modules", ()):
                fbgemm = getattr(kernel, "_emb_module", None)
                names = [table.name for table in kernel.config.embedding_tables]
                if fbgemm is None or not hasattr(fbgemm, "get_optimizer_state"):
                    raise SetupError(f"tables {names} of {path} use {type(kernel).__name__}, not a fused kernel; a "
                                     f"2D job averages fused kernels only (compute_kernels={list(FUSED_KERNELS[:1])})")
                lookups = KernelLookups(kernel, f"tables {names} of {path}")
                for table, (name, weights, state) in enumerate(
                        zip(names, fbgemm.split_embedding_weights(), fbgemm.get_optimizer_state())):
                    rows = tuple(value for value in state.values()
                                 if value.dim() >= 1 and value.shape[0] == weights.shape[0])
                    tensors, left_out = ((weights, *rows), ()) if optimizer_state else ((weights,), rows)
                    shards.append(TableShard(f"{path}.{name}", tensors, left_out,
                                             functools.partial(lookups.watch, table)))
    return shards


class KernelLookups:
    """The rows each training forward of one fused kernel looks up, by table: what its optimizer
    updates in backward, handed to whoever watches the table (`TableShard.watch`). One forward
    pre-hook on the kernel while anyone watches; a forward without gradients (an evaluation) updates
    nothing and is left out."""

    def __init__(self, kernel: nn.Module, what: str) -> None:
        self.kernel = kernel
        self.what = what
        self.feature_tables = [table for table, config in enumerate(kernel.config.embedding_tables)
                               for _ in config.feature_names]
        """The table of each feature of the kernel's input, in order (FBGEMM's feature_table_map)."""
        self.watchers: dict[int, Callable[[torch.Tensor], None]] = {}
        self._handle: Any = None

    def watch(self, table: int, looked_up: Callable[[torch.Tensor], None]) -> Callable[[], None]:
        """Call `looked_up(ids)` with the rows of table `table` each training forward looks up;
        returns the function that stops it."""
        self.watchers[table] = looked_up
        if self._handle is None:
            self._handle = self.kernel.register_forward_pre_hook(self._looked_up)
        return functools.partial(self._unwatch, table)

    def _unwatch(self, table: int) -> None:
        self.watchers.pop(table, None)
        if not self.watchers and self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _looked_up(self, _: nn.Module, args: tuple[Any, ...]) -> None:
        if not torch.is_grad_enabled():
            return
        features: KeyedJaggedTensor = args[0]
        if len(features.keys()) != len(self.feature_tables):
            raise SetupError(f"{self.what}: the kernel's input holds features {features.keys()}, its tables "
                             f"{len(self.feature_tables)}: which rows it updates cannot be told "
                             "(sync.tables.touched_rows: false averages every row)")
        for table, ids in zip(self.feature_tables, features.values().split(features.length_per_key())):
            looked_up = self.watchers.get(table)
            if looked_up is not None:
                looked_up(ids)


def _sharded_names(model: nn.Module) -> set[str]:
    if not isinstance(model, DistributedModelParallel):
        return set()
    return set(DistributedModelParallel._sharded_parameter_names(model._dmp_wrapped_module))


def dense_named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The replicated parameters of `model`: for a DMP, all trainable parameters minus the sharded ones."""
    sharded = _sharded_names(model)
    for name, param in model.named_parameters():
        if name not in sharded and param.requires_grad:
            yield name, param


def has_sharded_tables(model: nn.Module) -> bool:
    """Whether `model` is a DMP with sharded tables (whose per-step all-to-all pairs the trainers)."""
    return bool(_sharded_names(model))


def refuse_dense_ddp(model: nn.Module) -> None:
    """Raise `SetupError` if `model` is a DMP whose dense part TorchRec wrapped in DDP (its default
    `DataParallelWrapper`): the sync would run on top of an all-reduce in every backward."""
    if isinstance(model, DistributedModelParallel) and isinstance(model._dmp_wrapped_module, DistributedDataParallel):
        raise SetupError(
            "this DistributedModelParallel wraps its dense part in DDP (TorchRec's default data_parallel_wrapper), "
            "which all-reduces every dense gradient in backward; shadowgba's sync would run on top of it. Build it "
            "as DistributedModelParallel(..., **job.dmp_kwargs()) to leave the dense replicas to shadowgba"
        )


class BatchCheck:
    """Refuses a malformed batch of a set of tables with `ValueError` "batch refused: ..." naming the
    feature, its table and the bad value: keys that are not exactly the tables' features, lengths
    that are negative, not one per sample and feature, or do not add up to the values, and ids
    outside their table (`shadowgba.ps.embedding_shard.ids_outside`, the rule PS tables apply). A few
    vector operations over the lengths and the ids (the search for the culprit only on a refusal);
    reads the batch, never changes it."""

    def __init__(self, tables: Sequence[EmbeddingBagConfig]) -> None:
        self.table_of = {feature: table for table in tables for feature in (table.feature_names or [table.name])}
        self._sizes: dict[tuple[str, ...], torch.Tensor] = {}
        """Per key order seen: the table size of each key, for every id of a batch at once."""

    def __call__(self, features: KeyedJaggedTensor) -> None:
        keys = features.keys()
        self._check_keys(keys)
        lengths, values = features.lengths(), features.values()
        strides = features.stride_per_key()
        if lengths.numel() != sum(strides):
            raise BatchError(f"batch refused: {lengths.numel()} lengths, not one per sample of each feature "
                             f"(features {list(keys)}, samples {strides})")
        if lengths.numel() and int(lengths.min()) < 0:
            key, part = next((key, part) for key, part in zip(keys, lengths.split(strides)) if int(part.min()) < 0)
            raise BatchError(f"{self._refused(key)}: negative length {int(part.min())}")
        if features.variable_stride_per_key():
            counts = torch.stack([part.sum() for part in lengths.split(strides)])
        else:
            counts = lengths.view(len(keys), features.stride()).sum(1)
        if int(counts.sum()) != values.numel():
            per_feature = ", ".join(f"'{key}': {count}" for key, count in zip(keys, counts.tolist()))
            raise BatchError(f"batch refused: the lengths count {int(counts.sum())} ids ({per_feature}) but the "
                             f"batch holds {values.numel()} values")
        sizes = self._sizes.get(tuple(keys))
        if sizes is None:
            sizes = self._sizes[tuple(keys)] = torch.tensor([self.table_of[key].num_embeddings for key in keys])
        if bool(ids_outside(values, sizes.to(values.device).repeat_interleave(counts.to(values.device))).any()):
            for key, ids in zip(keys, values.split(counts.tolist())):
                problem = id_out_of_range(ids, self.table_of[key].num_embeddings)
                if problem:
                    raise BatchError(f"{self._refused(key)}: {problem}")

    def _check_keys(self, keys: Sequence[str]) -> None:
        unknown = [key for key in keys if key not in self.table_of]
        if unknown:
            raise BatchError(f"batch refused: unknown feature '{unknown[0]}'; the tables' features are "
                             f"{sorted(self.table_of)}")
        if len(keys) != len(self.table_of) or len(set(keys)) != len(keys):  # one is missing or repeated
            missing = [feature for feature in self.table_of if feature not in keys]
            named, problem = (missing[0], "missing") if missing else (
                next(key for index, key in enumerate(keys) if key in keys[:index]), "given more than once")
            raise BatchError(f"{self._refused(named)}: {problem} (keys {list(keys)})")

    def _refused(self, feature: str) -> str:
        return f"batch refused: feature '{feature}' of table '{self.table_of[feature].name}'"


class _CheckedInputDist:
    """A sharded EBC's `input_dist` that runs a `BatchCheck` on the features first (TrainPipelineSparseDist
    calls `input_dist` directly, a plain forward through `ShardedModule.forward`: both pass here)."""

    def __init__(self, input_dist: Any, check: BatchCheck) -> None:
        self.input_dist = input_dist
        self.check = check

    def __call__(self, ctx: Any, features: KeyedJaggedTensor, *args: Any, **kwargs: Any) -> Any:
        if isinstance(features, KeyedJaggedTensor):
            self.check(features)
        return self.input_dist(ctx, features, *args, **kwargs)


def check_batches(model: nn.Module) -> int:
    """Give every sharded `EmbeddingBagCollection` in `model` the `BatchCheck` of its tables (once:
    calling it again changes nothing); returns how many have it."""
    checked = 0
    for module in model.modules():
        if isinstance(module, ShardedEmbeddingBagCollection):
            if not isinstance(module.__dict__.get("input_dist"), _CheckedInputDist):
                module.input_dist = _CheckedInputDist(module.input_dist, BatchCheck(module._embedding_bag_configs))
            checked += 1
    return checked


class _GuardedOutputDist:
    """A sharded EBC's `compute_and_output_dist` or `output_dist` (every pipeline and a plain forward
    call one of them, feature-processed and managed-collision EBCs the second) whose result, the
    pooled embeddings, gets a gradient hook: the guard's `clean`, run on this rank before autograd
    hands the gradient to the output distribution's backward, the collective that sends it to the
    shards' owners."""

    def __init__(self, dist: Any, guard: NonFiniteGuard, what: str) -> None:
        self.dist = dist
        self.guard = guard
        self.what = what

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        awaitable = self.dist(*args, **kwargs)
        awaitable.callbacks.append(self._hook)
        return awaitable

    def _hook(self, pooled: KeyedTensor) -> KeyedTensor:
        values = pooled.values()
        if values.requires_grad:
            values.register_hook(lambda gradient: self.guard.clean(gradient, self.what))
        return pooled


def guard_tables(model: nn.Module, guard: NonFiniteGuard) -> int:
    """Give every table module in `model` this trainer's `guard`: a sharded `EmbeddingBagCollection`
    checks (and under NaN / Inf zeroes) the gradient of its pooled embeddings before TorchRec's backward
    sends it to a peer (`_GuardedOutputDist`), a `PSEmbeddingBagCollection` its row gradients before a
    push. A module guarded before (an earlier sync of the same model) takes the new guard. Returns how
    many are guarded."""
    guarded = 0
    for module in model.modules():
        if isinstance(module, PSEmbeddingBagCollection):
            module.guard = guard
            guarded += 1
        elif isinstance(module, ShardedEmbeddingBagCollection):
            what = f"embedding gradients of tables {', '.join(config.name for config in module._embedding_bag_configs)}"
            for name in ("compute_and_output_dist", "output_dist"):
                current = module.__dict__.get(name)
                if isinstance(current, _GuardedOutputDist):
                    current.guard = guard
                else:
                    setattr(module, name, _GuardedOutputDist(getattr(module, name), guard, what))
            guarded += 1
    return guarded


class ShardingGuard:
    """While installed, a `DistributedModelParallel` that would shard over other ranks than the job
    needs is refused at construction (before its planner's first collective, which the servers or
    the other replica groups never enter), naming the fix, and one that is built gets the batch
    check (`check_batches`). In a 2D job it also gets the group's plan (`group_plan`).
    `shadowgba.join` installs it on the trainers of a job with parameter servers or replica groups
    and `Job.close()` removes it."""

    def __init__(self, trainer_group: dist.ProcessGroup, num_servers: int, layout: ReplicaLayout | None = None) -> None:
        self.trainer_group = trainer_group
        self.trainers = dist.get_world_size(trainer_group)
        self.num_servers = num_servers
        self.layout = layout
        self._original: Any = None

    def install(self) -> None:
        original = DistributedModelParallel.__init__
        signature = inspect.signature(original)
        guard = self

        @functools.wraps(original)
        def checked_init(dmp: DistributedModelParallel, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(dmp, *args, **kwargs)
            env = bound.arguments.get("env")
            guard.check(dist.get_world_size() if env is None else env.world_size)
            if guard.layout is not None:
                arguments = bound.arguments
                arguments["plan"] = group_plan(
                    arguments["module"], arguments.get("sharders") or get_default_sharders(), arguments.get("plan"),
                    guard.layout, guard.trainer_group, arguments.get("device") or torch.device("cpu"))
            original(*bound.args, **bound.kwargs)
            check_batches(dmp)

        self._original = original
        DistributedModelParallel.__init__ = checked_init

    def remove(self) -> None:
        if self._original is not None:
            DistributedModelParallel.__init__ = self._original
            self._original = None

    def check(self, sharded_over: int) -> None:
        if self.layout is not None and sharded_over != self.layout.group_size:
            raise SetupError(
                f"this DistributedModelParallel would shard its tables over {sharded_over} ranks, but "
                f"sync.sharding_group_size is {self.layout.group_size}: each replica group shards its own copy "
                "of the tables; build it with DistributedModelParallel(..., **job.dmp_kwargs())"
            )
        if self.layout is None and sharded_over != self.trainers:
            raise SetupError(
                f"this DistributedModelParallel would shard its tables over {sharded_over} ranks, but only "
                f"{self.trainers} train ({self.num_servers} are parameter servers and never join TorchRec's "
                "collectives, so it would wait for them forever); build it with "
                "DistributedModelParallel(..., **job.dmp_kwargs())"
            )


def dense_optimizer(optimizer: Any, dense_params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    """The torch optimizer that steps `dense_params`, found inside TorchRec's keyed / combined
    optimizers (a plain torch optimizer is returned as it is)."""
    candidates = _torch_optimizers(optimizer)
    dense = {id(param) for param in dense_params}
    for candidate in candidates:
        stepped = {id(param) for group in candidate.param_groups for param in group["params"]}
        if dense <= stepped:
            return candidate
    names = [type(candidate).__name__ for candidate in candidates]
    raise SetupError(
        f"none of the optimizers inside {type(optimizer).__name__} ({names}) steps every dense parameter; "
        "GBA needs one dense optimizer over all of them"
    )


def give_lazy_state(optimizer: Any, saved: Any) -> None:
    """Before `optimizer.load_state_dict(saved)`: every parameter of a TorchRec `KeyedOptimizer`
    (a `CombinedOptimizer`'s parts included) that has no state yet but has some in `saved` gets a
    copy of the saved entries, which the load then overwrites in place.

    TorchRec's own `init_state()` would run a dummy step instead: that step moves parameters under
    weight decay and runs whatever hooks `step` (shadowgba's step boundary among them). Tensors go
    to the parameter's device and floating dtype, except `step`, as torch's optimizers load them.
    Anything else (a torch optimizer, a malformed `saved`) is left to `load_state_dict` to judge.
    """
    if isinstance(optimizer, KeyedOptimizer) and isinstance(saved, dict) and isinstance(saved.get("state"), dict):
        _give_lazy_state(optimizer, saved["state"], "")


def _give_lazy_state(optimizer: KeyedOptimizer, saved: dict[str, Any], prefix: str) -> None:
    if isinstance(optimizer, CombinedOptimizer):
        for name, part in optimizer.optimizers:
            _give_lazy_state(part, saved, f"{prefix}{name}." if name else prefix)
        return
    for key, param in optimizer.params.items():
        entry = saved.get(prefix + key)
        if param not in optimizer.state and isinstance(entry, dict):
            optimizer.state[param] = {name: _like_param(name, value, param) for name, value in entry.items()}


def _like_param(name: str, value: Any, param: torch.Tensor) -> Any:
    if not isinstance(value, torch.Tensor):
        return copy.deepcopy(value)
    if name == "step":
        return value.clone()
    dtype = param.dtype if value.is_floating_point() else value.dtype
    return value.to(device=param.device, dtype=dtype, copy=True)


def _torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    if isinstance(optimizer, CombinedOptimizer):
        return [inner for _, keyed in optimizer.optimizers for inner in _torch_optimizers(keyed)]
    if isinstance(optimizer, KeyedOptimizerWrapper):
        return [optimizer._optimizer]
    return [optimizer]

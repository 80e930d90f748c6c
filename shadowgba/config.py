"""Configuration: YAML files (safe-loaded) mapped strictly onto dataclasses, plus dotted overrides.

Every config is a tree of dataclasses whose fields carry a docstring and a default. Loading is
strict: an unknown key, a value of the wrong type, a float that is NaN or infinite (for any float
field: `.inf` / `.nan` would slip past every `< 0` check) or a value out of range fails at start-up with a
`ConfigError` that names the full dotted key and what is allowed, long before any process group
exists. Overrides come from the command line as `--sync.algo bmuf` or `--sync.interval_ms=50`;
values are parsed as YAML scalars (`true`, `1e-3`, `null`).

`SyncConfig` is the part shadowgba itself reads; applications nest it in their own dataclasses
(see `benchmarks/train_dlrm.py`).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping, Sequence, TypeVar

import yaml

import sync_algos
from shadowgba.errors import ConfigError
from shadowgba.gba.config import GBAConfig
from shadowgba.nonfinite import DEFAULT_ON_NONFINITE
from shadowgba.job.config import PSConfig
from shadowgba.job.survivors import ReplicaJobsConfig
from shadowgba.shadow.tables import TableSyncConfig
from sync_algos.bmuf import BMUFConfig
from sync_algos.easgd import EASGDConfig
from sync_algos.ma import MAConfig

T = TypeVar("T")


@dataclasses.dataclass
class SyncConfig:
    """How dense parameters are synchronized: the `sync` section of a job's config.

    `algo` picks the algorithm; its options live in the section of the same name (`easgd_ps` reads
    `easgd`), so changing `sync.algo` on the command line never leaves another algorithm's options
    behind. The shadow runtime's fields (mode ... control_file) are read by ma, easgd, bmuf and
    easgd_ps and ignored by gba, which has its own section; `timeout_s` and `ps` serve every algorithm.
    """

    algo: str = "ma"
    """Algorithm name from the `sync_algos` registry: ma, easgd, bmuf, easgd_ps or gba."""
    mode: Literal["shadow", "foreground"] = "shadow"
    """shadow: a background thread syncs continuously; foreground: the training thread syncs every
    `foreground_every` steps (the FR-* baselines of ShadowSync). Ignored by gba."""
    writeback: Literal["handoff", "hogwild"] = "handoff"
    """How the shadow thread's result reaches the live weights. handoff: the training thread takes
    the snapshot and applies the delta at its next optimizer step (exact, no race); hogwild: the
    shadow thread reads and writes `.data` itself, lock-free and racy (ShadowSync's semantics).
    Ignored by gba."""
    interval_ms: float = 200.0
    """Shadow mode pacing: the least time between the starts of two rounds, unless the floor on the
    round rate (`max_gap_steps`) needs one sooner; 0 runs them as often as the other limits let
    them. Can be changed while the job runs. Ignored by gba."""
    interval_steps: int = 0
    """Shadow mode pacing in steps: when > 0, a round also waits until the fastest rank has taken
    about this many training steps since the last one started (its step time is carried in the
    rounds), so the round rate follows the steps whatever a step costs, as TorchRec's sync every N
    batches does. 0: the other limits alone. Can be changed while the job runs. Ignored by gba."""
    max_round_share: float = 0.1
    """Shadow mode pacing by the link: the most of the wall time the rounds may take. After rounds
    that took d seconds (the median of the last few), the next starts no sooner than d /
    max_round_share after the last one started. A round's duration is long where the link is slow
    (a step's embedding all-to-all crosses the same link), so the rounds space out there by
    themselves. 1: no such limit. Can be changed while the job runs. Ignored by gba."""
    max_step_cost: float = 0.02
    """Shadow mode pacing by what the rounds cost the training threads: the most share of their time
    the rounds may take from them. A round's cost is measured, not set (`shadowgba.shadow.round_cost`):
    the steps' slowdown while it is in flight, or the CPU its threads took from cores that had none
    idle, whichever is larger; after rounds that cost c seconds (the median of the last few), the
    next starts no sooner than c / max_step_cost after the last one started. On a CPU-bound host
    the rounds then space out by the CPU they take from the steps (the floor, `max_gap_steps`,
    keeps them coming); where a round is nearly free (a GPU's host cores idle, a fast link) they
    come as often as `interval_ms` lets them. 1: no such limit. Ignored by gba."""
    max_gap_steps: int = 10
    """The floor on the shadow round rate: a round starts at most this many steps of the fastest rank
    after the last one started, however dear the cost limits (`max_round_share`, `max_step_cost`)
    find the rounds; `interval_ms` and `interval_steps`, the user's, stand. 10: never rarer than PMA's
    every 10 steps, whose AUC matched DDP's (docs/benchmarks.md). A round still in flight half
    this many steps after it started gets the training threads' CPU priority back
    (`rounds_nice`). A round slower than this many steps makes the gap larger (`warn_gap_steps`).
    0: no floor. Ignored by gba and in foreground mode."""
    warn_gap_steps: int = 100
    """A rank that goes more than this many steps without a round reaching its dense weights logs a warning
    naming what held the rounds back (the replicas drift apart meanwhile), once until a round
    arrives again; `metrics` reports the gap (`sync_gap_steps`) and the rounds per step either way.
    0: no warning. Ignored by gba and in foreground mode."""
    rounds_nice: int | None = None
    """Shadow mode: the CPU priority of the shadow thread and of the gloo threads of the process
    group it makes for its rounds (flat layout; in a 2D job the shadow thread only; Linux). null
    (default): adaptive (`shadowgba.shadow.priority`): a round runs at niceness 19, taking only the
    CPU the training threads leave, and gets the training threads' priority back when it is late
    for the floor (`max_gap_steps`), as does the round after it; where this process may not raise a
    thread's priority again (no CAP_SYS_NICE, RLIMIT_NICE), the rounds keep the training threads'
    priority. 0-19: that niceness throughout (0: the training threads' priority, never lowered).
    Ignored by gba and in foreground mode."""
    foreground_every: int = 10
    """Foreground mode: training steps between two synchronous rounds. Ignored by gba."""
    first_round_after: int = 50
    """Training steps a rank takes before rounds start: its shadow thread's first (shadow mode), or
    the first multiple of `foreground_every` from this step on (foreground mode). The optimizers'
    first steps are large and sign-like (Adam's bias correction, Adagrad's near-empty
    accumulators): replicas averaged every step or two while they take them can end in a worse
    basin. Measured: after 1 step in the flat layout, after 10 in the 2D one (one seed in three,
    every time, 0.019 AUC below at 4M samples), and foreground rounds every step from the first
    (0.018 below); from 40 steps on every seed was level (docs/benchmarks.md, "Near convergence"
    and "Replica groups"). Replicas that start at the same weights train apart that long at no
    measured cost; the benchmarks' timed windows start after it (their warm-up). 0 starts at once
    (ShadowSync's foreground baselines as published). Ignored by gba."""
    final_sync: bool = True
    """On close, average the dense replicas once more (blocking) so every rank ends identical.
    Ignored by gba, whose trainers always end identical."""
    timeout_s: float = 300.0
    """Timeout of every collective the library issues and of the trainer group TorchRec's all-to-all
    runs on (`job.trainer_group`, with or without servers): a dead or stuck peer fails the round after
    this. With servers also how long a call that timed out on a live server is retried.
    With servers, the order the timeouts must respect is rpc_timeout_s <= timeout_s <=
    trainer_timeout_s (`sync.ps`): a call fails before a collective gives up on a peer, and both
    before a server gives up on a trainer, so the error a user sees names the cause."""
    on_nonfinite: Literal["skip", "fail"] = DEFAULT_ON_NONFINITE
    """A round, all-reduce or push that would bring NaN / Inf into other replicas or the servers is
    refused either way, and so are embedding gradients bound for a peer's table shards and row
    pushes to PS-hosted tables (`shadowgba.nonfinite`). skip: leave that rank's contribution and
    step out, warn and count it in the metrics (one bad batch does not stop a days-long job), and
    heal a replica whose weights went non-finite with the healthy replicas' consensus at its next
    round; fail: raise `SyncError` naming the rank where it began."""
    max_skipped_steps: int = 100
    """Under on_nonfinite skip: after this many of a trainer's steps in a row were skipped for NaN /
    Inf (in its loss's gradients, dense or embedding; `shadowgba.nonfinite`), it raises `SyncError`
    naming itself and the job ends. A trainer whose every step is skipped trains nothing (no healthy
    replica heals it, or no round comes); one bad batch now and then stays far below this."""
    log_interval_s: float = 30.0
    """Seconds between reports of the runtime's metrics (`shadowgba.reporting`): an INFO line on the
    `shadowgba` logger and, with a TensorBoard writer, its scalars; 0 disables them (TensorBoard then
    gets the last values only). Both runtimes, through `dense_sync`."""
    tensorboard_dir: str | None = None
    """A directory for TensorBoard: each trainer writes the metrics' scalars (`shadowgba/<name>`) into
    `<dir>/trainer<i>` every `log_interval_s` and at the end. Needs `shadowgba[tensorboard]`; a
    `SummaryWriter` passed to `dense_sync(summary_writer=...)` takes its place."""
    control_file: str | None = None
    """Optional YAML file polled while the job runs; it may change the pacing (interval_ms, interval_steps,
    max_round_share, max_step_cost, max_gap_steps), warn_gap_steps and foreground_every live (see
    shadowgba.shadow.control). Ignored by gba."""
    ma: MAConfig = dataclasses.field(default_factory=MAConfig)
    """Options of `ma` (none)."""
    easgd: EASGDConfig = dataclasses.field(default_factory=EASGDConfig)
    """Options of `easgd` and `easgd_ps`: beta, alpha."""
    bmuf: BMUFConfig = dataclasses.field(default_factory=BMUFConfig)
    """Options of `bmuf`: block_lr, block_momentum, nesterov."""
    gba: GBAConfig = dataclasses.field(default_factory=GBAConfig)
    """Options of `gba`: initial mode, aggregation, staleness decay, schedule, switch policy."""
    ps: PSConfig = dataclasses.field(default_factory=PSConfig)
    """Parameter-server ranks (gba, easgd_ps)."""
    sharding_group_size: int = 0
    """The 2D layout (`shadowgba.layout`): trainers per replica group. TorchRec shards the tables
    over the k ranks of a group only (its all-to-all pairs no rank outside it), every group holds
    replicas of the same shards, and the shadow runtime averages those replicas across groups in
    the background, one fragment at a time (`tables`), with the dense parameters as usual. 0: the
    flat layout, tables sharded over every trainer. Needs ma, easgd or bmuf and no servers."""
    tables: TableSyncConfig = dataclasses.field(default_factory=TableSyncConfig)
    """2D jobs: how the table replicas are averaged (fragment size, optimizer state)."""
    compress: Literal["none", "bf16", "int8"] = "none"
    """ma, easgd, bmuf: the dense rounds' payload in fewer bytes, for links where bandwidth is what
    a round waits for (`sync_algos.compressed`): bf16 (2 bytes a value) or int8 with a scale per
    256 values (about 1). The replicas send their difference from the last round's consensus, with
    error feedback, and sums are taken in fp32; the first round, the first after a restore and the
    final average run in full precision. Costs two more dense-sized buffers (the reference, ma and
    bmuf only, and the residual). Table fragments (2D) go uncompressed."""
    on_group_lost: Literal["continue", "fail"] = "fail"
    """2D jobs: what a lost rank (killed, stopped past `timeout_s`, or its loop raised) does to the
    others. fail: every rank ends naming it. continue: its replica group drops out (its ranks end,
    naming it) and the other groups train on without a restart, their rounds rebuilt over the
    survivors (`shadowgba.job.survivors`); nothing they hold is rolled back. Pays off where a lost
    group's processes end without taking the others down: a launcher per group, or the tests'
    processes; under one torchrun job for all groups, its agent restarts every group anyway."""
    replica_jobs: ReplicaJobsConfig = dataclasses.field(default_factory=ReplicaJobsConfig)
    """2D jobs launched as one torchrun job per replica group, meeting at a store that outlives
    them: a lost group's agent restarts it alone, and it rejoins the others, taking a partner's
    replica (`shadowgba.job.survivors`). Needs `on_group_lost: continue`."""
    registered: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Options of the algorithms registered outside this package (`sync_algos.register` in the user's
    own script), by name: each is read from the section of its name, `sync.<name>` in the YAML and
    `--sync.<name>.<key>` on the command line, into the algorithm's own `Config`, as the built-in
    ones are into the fields above (`open_sections`). Not a key of its own in a config file."""

    OPEN_SECTIONS: ClassVar[str] = "registered"
    """The field into which `from_dict` reads the sections `open_sections` names."""

    @classmethod
    def open_sections(cls) -> dict[str, type]:
        """Sections beyond the fields: each registered algorithm without a field of its own, and its
        `Config` (read when the config is, so registering must come first)."""
        fields = {field.name for field in dataclasses.fields(cls)}
        return {name: sync_algos.get_algorithm(name).Config for name in sync_algos.algorithm_names()
                if name not in fields and name not in SECTION_OF}

    def __post_init__(self) -> None:
        allowed = sync_algos.algorithm_names()
        if self.algo not in allowed:
            raise ConfigError(f"algo: unknown algorithm '{self.algo}'; allowed: {allowed} (an algorithm of your "
                              "own: register it with sync_algos.register before the config is read)")
        if self.section in self.open_sections():
            kind = sync_algos.get_algorithm(self.algo).kind
            if kind != "model":
                raise ConfigError(f"algo: '{self.algo}' is a {kind} algorithm; an algorithm registered outside "
                                  "shadowgba must be a model algorithm (a SyncAlgorithm whose round maps a "
                                  "snapshot to a target), which the shadow runtime runs")
            self.registered.setdefault(self.section, self.open_sections()[self.section]())
        check_live_fields(self, LIVE_FIELDS)
        if self.rounds_nice is not None and not 0 <= self.rounds_nice <= 19:
            raise ConfigError(f"rounds_nice must be in [0, 19], got {self.rounds_nice} (null: adaptive)")
        if self.first_round_after < 0:
            raise ConfigError(f"first_round_after must be >= 0, got {self.first_round_after}")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.max_skipped_steps < 1:
            raise ConfigError(f"max_skipped_steps must be >= 1, got {self.max_skipped_steps}")
        if self.log_interval_s < 0:
            raise ConfigError(f"log_interval_s must be >= 0, got {self.log_interval_s}")
        if self.tensorboard_dir is not None and (not isinstance(self.tensorboard_dir, str) or not self.tensorboard_dir):
            raise ConfigError(f"tensorboard_dir must be a directory path or null, got {self.tensorboard_dir!r}")
        if self.algo == "easgd_ps" and not self.ps.num_servers:
            raise ConfigError("ps.num_servers: sync.algo easgd_ps keeps the EASGD centre on the servers; needs >= 1")
        if self.algo == "gba" and self.gba.initial_mode == "gba" and not self.ps.num_servers:
            raise ConfigError("ps.num_servers: sync.gba.initial_mode gba needs at least one parameter server")
        if self.ps.num_servers and not self.ps.rpc_timeout_s <= self.timeout_s <= self.ps.trainer_timeout_s:
            raise ConfigError(
                f"timeout_s: with parameter servers need ps.rpc_timeout_s ({self.ps.rpc_timeout_s:g}) <= timeout_s "
                f"({self.timeout_s:g}) <= ps.trainer_timeout_s ({self.ps.trainer_timeout_s:g})"
            )
        if self.sharding_group_size < 0:
            raise ConfigError(f"sharding_group_size must be >= 0 (0: the flat layout), got {self.sharding_group_size}")
        if self.sharding_group_size and self.algo in PS_ALGOS:
            raise ConfigError(f"sharding_group_size: the 2D layout keeps table replicas in sync with ma, easgd or bmuf "
                              f"on the trainers alone, not with sync.algo '{self.algo}' (parameter servers); set "
                              "sharding_group_size: 0 for it")
        if self.sharding_group_size and self.ps.num_servers:
            raise ConfigError(f"ps.num_servers: the 2D layout (sharding_group_size {self.sharding_group_size}) runs on "
                              f"the trainers alone, with no parameter servers; got ps.num_servers "
                              f"{self.ps.num_servers} (set it to 0)")
        if self.compress not in ("none", "bf16", "int8"):
            raise ConfigError(f"compress must be 'none', 'bf16' or 'int8', got {self.compress!r}")
        if self.compress != "none" and self.algo in PS_ALGOS:
            raise ConfigError(f"compress: sync.algo '{self.algo}' has no collective round to compress (its trainers "
                              "talk to the parameter servers); use it with ma, easgd or bmuf")
        if self.on_group_lost not in ("continue", "fail"):
            raise ConfigError(f"on_group_lost must be 'continue' or 'fail', got {self.on_group_lost!r}")
        if self.on_group_lost == "continue" and not self.sharding_group_size:
            raise ConfigError("on_group_lost: continue needs the 2D layout (sharding_group_size >= 1): in the flat "
                              "layout TorchRec's all-to-all spans every trainer, so none trains on without a lost one")
        if self.replica_jobs.store is not None and (not self.sharding_group_size or self.on_group_lost != "continue"):
            raise ConfigError("replica_jobs.store: a torchrun job per replica group needs the 2D layout "
                              "(sharding_group_size >= 1) and on_group_lost: continue (a lost group drops out, then "
                              f"rejoins); got sharding_group_size {self.sharding_group_size}, on_group_lost "
                              f"{self.on_group_lost}")
        if self.ps.checkpoint_dir and self.algo not in PS_ALGOS:
            raise ConfigError(f"ps.checkpoint_dir: the servers' own checkpoints hold GBA's dense shards or the S-EASGD "
                              f"centre, and the PS-hosted tables; sync.algo '{self.algo}' has none of them")
        if self.ps.server_restart_s and self.algo == "gba" and self.ps.num_servers != 1:
            raise ConfigError(f"ps.server_restart_s > 0 under gba needs exactly one server, got {self.ps.num_servers}: "
                              "the dense shards of several servers would have to go back to one global step together")
        if self.ps.num_servers and self.algo not in PS_ALGOS:
            raise ConfigError(
                f"ps.num_servers: parameter servers need sync.algo gba or easgd_ps, not '{self.algo}' "
                "(servers host GBA's dense shards or the S-EASGD centre; for this algorithm they would idle)"
            )

    def check_world_size(self, world_size: int) -> None:
        """Refuse (`ConfigError`) what cannot run on a job of `world_size` ranks (torchrun's
        WORLD_SIZE), before any process group exists: servers that leave no trainer, replica groups
        that do not divide the trainers, a torchrun job per replica group of another size. The
        elastic layout (`ps.num_trainers`) starts every process on its own: nothing to check."""
        if self.ps.num_trainers:
            return
        group = self.sharding_group_size
        if self.replica_jobs.store is not None:
            if world_size != group:
                raise ConfigError(f"replica_jobs: each torchrun job is one replica group of sharding_group_size "
                                  f"({group}) ranks, but this one has {world_size}: launch every group with {group} "
                                  "ranks in all")
            return
        trainers = world_size - self.ps.num_servers
        if trainers < 1:
            raise ConfigError(f"ps.num_servers: {self.ps.num_servers} servers leave no trainer among the job's "
                              f"{world_size} ranks")
        if group and trainers % group:
            raise ConfigError(f"sharding_group_size: {group} does not divide the job's {trainers} trainers into equal "
                              "replica groups")

    @property
    def section(self) -> str:
        """The name of the section holding the chosen algorithm's options."""
        return SECTION_OF.get(self.algo, self.algo)

    def algorithm_config(self) -> Any:
        """The chosen algorithm's options (its typed section)."""
        if self.section in self.registered:
            return self.registered[self.section]
        return getattr(self, self.section)


LIVE_FIELDS: dict[str, tuple[typing.Callable[[float], bool], str]] = {
    "interval_ms": (lambda value: value >= 0, ">= 0"),
    "interval_steps": (lambda value: value >= 0, ">= 0"),
    "max_round_share": (lambda value: 0 < value <= 1, "in (0, 1]"),
    "max_step_cost": (lambda value: 0 < value <= 1, "in (0, 1]"),
    "max_gap_steps": (lambda value: value >= 0, ">= 0 (0: no floor)"),
    "warn_gap_steps": (lambda value: value >= 0, ">= 0 (0: no warning)"),
    "foreground_every": (lambda value: value >= 1, ">= 1"),
}
"""The `SyncConfig` fields a live control file may change too (`shadowgba.shadow.control`): what each
one must be, checked alike at start-up and on every edit of the file."""


def check_live_fields(settings: Any, fields: Mapping[str, tuple[typing.Callable[[float], bool], str]]) -> None:
    """Raise a `ConfigError` naming the first of `fields` (name: (allowed, wording)) that `settings`
    holds out of range; a field it holds as None (a control file leaves it as it is) passes."""
    for name, (allowed, wording) in fields.items():
        value = getattr(settings, name)
        if value is not None and not allowed(value):
            raise ConfigError(f"{name} must be {wording}, got {value}")


SECTION_OF = {"easgd_ps": "easgd"}
"""Built-in algorithms whose options live in another algorithm's section."""
PS_ALGOS = frozenset({"gba", "easgd_ps"})
"""The algorithms that run beside parameter-server ranks (their trainers never meet all ranks)."""


def from_dict(schema: type[T], data: Mapping[str, Any] | None) -> T:
    """Build dataclass `schema` from a mapping, strictly; errors name the dotted key."""
    return _build(schema, data or {}, prefix="")


def load_config(
    schema: type[T], path: str | Path | None = None, overrides: Sequence[str] = (), section: str | None = None
) -> T:
    """Load `schema` from an optional YAML file, then apply `--dotted.key value` overrides.

    With `section`, `schema` is built from that top-level key of the file alone (the rest of the
    file belongs to the application), and overrides name keys inside it (`--algo bmuf`) or with the
    section's prefix (`--sync.algo bmuf`); other overrides are left to the application."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ConfigError(f"config file {path} is not valid YAML: {error}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping, not {type(loaded).__name__}")
        data = loaded or {}
    if section is not None:
        data = data.get(section) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{section}: expected a mapping, got {data!r}")
    for key, value in parse_overrides(overrides).items():
        if section is not None and key.startswith(f"{section}."):
            key = key[len(section) + 1 :]
        elif section is not None and key.split(".")[0] not in {field.name for field in dataclasses.fields(schema)}:
            continue
        _set_dotted(data, key, value)
    prefix = f"{section}." if section is not None else ""
    try:
        return from_dict(schema, data)
    except ConfigError as error:
        raise ConfigError(f"{prefix}{error}") from None


def parse_overrides(args: Sequence[str]) -> dict[str, Any]:
    """`["--a.b", "1", "--c=x"]` -> `{"a.b": 1, "c": "x"}`; values parsed as YAML scalars."""
    parsed: dict[str, Any] = {}
    index = 0
    while index < len(args):
        arg = args[index]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"expected an override like --sync.algo=bmuf, got '{arg}'")
        key, has_value, value = arg[2:].partition("=")
        if not has_value:
            if index + 1 >= len(args):
                raise ConfigError(f"override --{key} has no value")
            index += 1
            value = args[index]
        parsed[key] = yaml.safe_load(value) if value != "" else ""
        index += 1
    return parsed


def to_dict(config: Any) -> dict[str, Any]:
    """A plain mapping of a config tree, for logs and result files, shaped as a config file is (the
    registered algorithms' sections beside the built-in ones): `from_dict` reads it back."""
    data: dict[str, Any] = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name == getattr(config, "OPEN_SECTIONS", None):
            data.update({name: to_dict(section) for name, section in value.items()})
        else:
            data[field.name] = _plain(value)
    return data


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_dict(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(item) for item in value)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    *parents, leaf = dotted.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot override {dotted}: {part} is not a section")
        node = child
    node[leaf] = value


def _build(schema: type[T], data: Any, prefix: str) -> T:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    open_field = getattr(schema, "OPEN_SECTIONS", None)  # SyncConfig: registered algorithms' sections
    sections: dict[str, type] = schema.open_sections() if open_field else {}  # type: ignore[attr-defined]
    fields = {field.name: field for field in dataclasses.fields(schema) if field.name != open_field}
    unknown = sorted(set(data) - set(fields) - set(sections))
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key; allowed keys: {sorted([*fields, *sections])}")
    hints = typing.get_type_hints(schema)
    values: dict[str, Any] = {name: _coerce(hints[name], data[name], f"{prefix}{name}") for name in data
                              if name in fields}
    if sections:
        values[open_field] = {name: _build(sections[name], data[name], f"{prefix}{name}.") for name in data
                              if name in sections}
    try:
        return schema(**values)
    except (ConfigError, ValueError) as error:
        raise ConfigError(f"{prefix}{error}") from None


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [arg for arg in args if arg is not type(None)]
        errors = []
        for option in options:
            try:
                return _coerce(option, value, key)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} fits none of {options}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not allowed; allowed values: {list(args)}")
        return value
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if origin in (list, tuple, Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        item = args[0] if args else Any
        return [_coerce(item, element, f"{key}[{i}]") for i, element in enumerate(value)]
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:  # every float field of every section: NaN / Inf would slip past range checks
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported field type {hint!r}")

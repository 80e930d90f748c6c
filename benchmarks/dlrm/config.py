"""The DLRM example's configuration: one dataclass tree, loaded strictly from YAML plus overrides.

Sections: `baseline` (none / ddp / pma instead of shadowgba), `sync` (shadowgba, with its
parameter-server ranks in `sync.ps`), `model`, `data`, `train`, `straggler`. Every combination that cannot run is refused here, naming the keys, before any process
group exists:
- parameter servers and PS-hosted embeddings exist only for `sync.algo: gba` and `easgd_ps` (the
  servers host GBA's dense shards or the S-EASGD centre; for any other algorithm they would idle);
- GBA mode, easgd_ps and PS embeddings need at least one server (`SyncConfig` checks the first two);
- the PS tables support sgd and rowwise_adagrad, not TorchRec's (element-wise) adagrad;
- `train.global_samples` counts samples by the GBA global step, so it needs `sync.algo: gba`.

Model presets (`examples/configs/presets/NAME.yaml`, `preset_overrides`) hold only `model` and
`data` sections, so one preset applies to every algorithm's config and changes no sync setting.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

import yaml

from shadowgba.config import PS_ALGOS, SyncConfig
from shadowgba.errors import ConfigError
from ctrkit.straggler import StragglerConfig
from ctrkit.datasets import DataConfig

@dataclasses.dataclass
class ModelConfig:
    """DLRM shape (TorchRec's conventions: layer sizes include the output layer) and where its tables live."""

    embedding_dim: int = 16
    """Width of every embedding table."""
    dense_arch_layer_sizes: list[int] = dataclasses.field(default_factory=lambda: [64, 16])
    """Bottom MLP on the dense features; the last size must equal embedding_dim."""
    over_arch_layer_sizes: list[int] = dataclasses.field(default_factory=lambda: [64, 1])
    """Top MLP on the interactions; the last size must be 1 (the click logit)."""
    embeddings: Literal["torchrec", "ps"] = "torchrec"
    """torchrec: tables sharded table-wise over the trainers by DistributedModelParallel (its
    all-to-all makes every step a barrier between trainers). ps: tables row-sharded on the parameter
    servers (`shadowgba.ps.embedding`), no collective in a trainer step."""

    def __post_init__(self) -> None:
        if self.dense_arch_layer_sizes[-1:] != [self.embedding_dim]:
            raise ConfigError(f"dense_arch_layer_sizes must end with embedding_dim ({self.embedding_dim})")
        if self.over_arch_layer_sizes[-1:] != [1]:
            raise ConfigError("over_arch_layer_sizes must end with 1")


@dataclasses.dataclass
class TrainConfig:
    """Optimizers and how long to train."""

    steps: int = 4000
    """Training steps per trainer, warm-up included; used when duration_s, global_samples and
    job_samples are 0."""
    duration_s: float = 0.0
    """When > 0: train for this many seconds after warm-up instead of a step count."""
    global_samples: int = 0
    """When > 0 (sync.algo gba only): train until the dense parameters have been updated with this
    many samples, read from the global step (k x global batch; k x local batch for GBA without
    aggregation), so that runs of different algorithms stop at equal samples applied."""
    job_samples: int = 0
    """When > 0: train until every trainer together has computed this many samples (a counter in the
    job's store), as from a reader that all trainers share: a fast trainer, or a fast 2D replica
    group, takes more of them, so that runs stop at equal samples seen whatever paces whom."""
    warmup_steps: int = 50
    """Steps before the timed window that throughput is measured over."""
    eval_every_samples: int = 0
    """When > 0: evaluate held-out AUC and log loss each time the samples seen (all trainers) cross a
    multiple of this, for a `curve` in the results (benchmarks/dlrm/curve.py); its time is left out of
    the training clock. 0: only the final evaluation."""
    stop_check_every: int = 20
    """With duration_s, global_samples or job_samples: steps between two stop decisions; when trainers
    must stop at the same step (TorchRec embeddings), between two broadcasts of the decision."""
    embedding_optimizer: Literal["sgd", "adagrad", "rowwise_adagrad"] = "adagrad"
    """Optimizer of the tables: fused in backward for TorchRec tables (Adam/LAMB are CUDA-only in
    FBGEMM), on the servers for PS tables (sgd or rowwise_adagrad there)."""
    embedding_lr: float = 0.1
    """Learning rate of the embedding optimizer."""
    dense_optimizer: Literal["sgd", "adagrad", "adam"] = "adam"
    """Optimizer of the dense parameters (each rank's replica; GBA: the one optimizer)."""
    dense_lr: float = 0.002
    """Learning rate of the dense optimizer."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay (torch's default 0.9); 0 takes the momentum out, a diagnostic of how
    much of stale gradients' cost is momentum's (docs/gba.md). Only with dense_optimizer adam."""
    seed: int = 0
    """Seeds model initialization (identical on every rank)."""
    progress: bool = True
    """Show progress on trainer 0: a bar on a terminal, a plain line every few seconds in a log
    (`dlrm.progress`)."""
    record_step_times: bool = False
    """Put the writing trainer's step end times (wall clock) in the result, as `step_end_at`: for
    benchmarks that place the steps beside events outside the job (`benchmarks/bench_rejoin.py`)."""

    def __post_init__(self) -> None:
        if min(self.duration_s, self.global_samples, self.job_samples) < 0:
            raise ConfigError("duration_s, global_samples and job_samples must be >= 0")
        if sum(map(bool, self.stop_limits)) > 1:
            raise ConfigError("set at most one of duration_s, global_samples and job_samples")
        if not any(self.stop_limits) and self.steps <= self.warmup_steps:
            raise ConfigError(f"steps ({self.steps}) must exceed warmup_steps ({self.warmup_steps})")
        if self.warmup_steps < 0 or self.stop_check_every < 1:
            raise ConfigError("warmup_steps must be >= 0 and stop_check_every >= 1")
        if self.eval_every_samples < 0:
            raise ConfigError(f"eval_every_samples must be >= 0, got {self.eval_every_samples}")

    @property
    def stop_limits(self) -> tuple[float, int, int]:
        """The limits other than a step count; at most one is set (> 0)."""
        return self.duration_s, self.global_samples, self.job_samples


@dataclasses.dataclass
class ExperimentConfig:
    """Everything one run reads."""

    baseline: Literal["none", "ddp", "pma", "torchrec_2d"] | None = None
    """Run a baseline instead of shadowgba (then `sync` is not used, but for pma's and torchrec_2d's
    `sync.foreground_every` and the 2D layout's `sync.sharding_group_size`): none trains locally only
    (in a 2D job: no sync across replica groups), ddp is TorchRec's default dense DDP, pma is torch's
    periodic model averaging every `sync.foreground_every` steps (`dlrm.pma`), torchrec_2d is
    TorchRec's 2D recipe: dense DDP over every trainer, tables averaged across replica groups every
    `sync.foreground_every` steps in the step (`dlrm.torchrec_2d`)."""
    sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
    """Dense synchronization (shadowgba), parameter-server ranks included (`sync.ps`)."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """DLRM shape and where the tables live."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Synthetic CTR task and per-trainer batch size."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """Optimizers and run length."""
    straggler: StragglerConfig = dataclasses.field(default_factory=StragglerConfig)
    """Injected slowness of chosen trainers (tests and benchmarks)."""

    def __post_init__(self) -> None:
        if self.baseline is not None and self.sync.ps.num_servers:
            raise ConfigError(f"sync.ps.num_servers: the {self.baseline} baseline runs without parameter servers")
        if (self.baseline == "torchrec_2d") != bool(self.sync.sharding_group_size) and self.baseline in (
                "torchrec_2d", "ddp", "pma"):
            raise ConfigError(f"sync.sharding_group_size: the {self.baseline} baseline "
                              + ("needs the 2D layout (> 0)" if self.baseline == "torchrec_2d" else "is flat (0)"))
        if self.train.global_samples and self.algo != "gba":
            raise ConfigError(
                f"train.global_samples: counted by the GBA global step; needs sync.algo gba, not '{self.algo}'"
            )
        if self.model.embeddings == "ps":
            if self.algo not in PS_ALGOS or not self.sync.ps.num_servers:
                raise ConfigError("model.embeddings: ps needs sync.algo gba or easgd_ps and sync.ps.num_servers >= 1")
            if self.train.embedding_optimizer == "adagrad":
                raise ConfigError("train.embedding_optimizer: PS tables support sgd and rowwise_adagrad, not adagrad")

    @property
    def algo(self) -> str:
        """What keeps the dense replicas together: the baseline's name, or `sync.algo`."""
        return self.baseline or self.sync.algo

    @property
    def lockstep(self) -> bool:
        """Whether every trainer must take the same number of steps (TorchRec's all-to-all pairs them)."""
        return self.model.embeddings == "torchrec"


PRESETS_DIR = Path(__file__).resolve().parents[2] / "examples" / "configs" / "presets"
"""The model presets: `small` (the benchmarks' throughput model) and `production` (MLPerf DLRM's dense size)."""
PRESET_SECTIONS = ("model", "data")
"""The only sections a preset may set: the model's shape and the data it is built for."""


def preset_names() -> list[str]:
    """Every preset shipped in `PRESETS_DIR`."""
    return sorted(path.stem for path in PRESETS_DIR.glob("*.yaml"))


def preset_overrides(name: str) -> list[str]:
    """Preset `name` as `--dotted.key value` overrides (lists are values, not sections), to go between
    the `--config` file and the command line's own overrides, which win."""
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"preset: unknown preset '{name}'; allowed: {preset_names()}")
    loaded = yaml.safe_load(path.read_text()) or {}
    if not isinstance(loaded, dict) or set(loaded) - set(PRESET_SECTIONS):
        raise ConfigError(f"preset {name}: may hold only the sections {list(PRESET_SECTIONS)}, not {sorted(loaded)}")
    return [argument for key, value in _leaves(loaded, "") for argument in (f"--{key}", json.dumps(value))]


def _leaves(mapping: dict[str, Any], prefix: str) -> list[tuple[str, Any]]:
    """Dotted key and value of every non-mapping value under `mapping`."""
    leaves = []
    for key, value in mapping.items():
        if isinstance(value, dict):
            leaves += _leaves(value, f"{prefix}{key}.")
        else:
            leaves.append((f"{prefix}{key}", value))
    return leaves

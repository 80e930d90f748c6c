"""Synthetic click-through data with a planted teacher, streamed batch by batch.

Quality comparisons between sync algorithms need a task whose ceiling is known and that a DLRM can
learn within minutes. Here a fixed random *teacher* scores every sample: pairwise dot
products of per-table teacher embeddings (the structure of DLRM's interaction layer) plus a small MLP
on the dense features, standardized to a chosen logit spread and shifted to a chosen click rate.
Labels are Bernoulli draws from the teacher's probability, so the teacher's own held-out AUC is the
ceiling every trained model is judged against.

Ids follow a Zipf law over a small id space per table. Every batch is generated on demand from a
generator keyed by (seed, stream, rank, batch index): the data set is never materialised, any batch
can be regenerated exactly, training ranks draw from disjoint streams, and the held-out set is the
same for every rank count.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch
from torchrec.datasets.utils import Batch

from ctrkit.ctr_data import keyed_generator, make_batch
from ctrkit.evaluation import roc_auc


@dataclasses.dataclass
class SyntheticConfig:
    """Shape of the synthetic CTR task and of its batches."""

    seed: int = 0
    """Seeds the teacher, the calibration and every data stream."""
    num_tables: int = 8
    """Sparse features, one embedding table each."""
    num_embeddings: int = 1000
    """Ids per table. Small id spaces keep the task learnable in minutes."""
    zipf_exponent: float = 1.05
    """Id frequency falls as rank^-exponent; which ids are frequent is a fixed random permutation."""
    ids_per_sample: int = 1
    """Ids per sample and table (multi-hot when > 1); the teacher mean-pools their embeddings."""
    num_dense: int = 13
    """Dense features per sample, standard normal."""
    teacher_dim: int = 8
    """Dimension of the teacher's embeddings."""
    teacher_hidden: int = 16
    """Hidden width of the teacher's MLP on the dense features."""
    dense_share: float = 0.25
    """Share of the teacher's logit variance that comes from the dense MLP; the rest comes from the
    pairwise embedding interactions."""
    logit_std: float = 2.0
    """Standard deviation of the teacher's logits: larger values make labels less noisy and raise
    the ceiling AUC."""
    click_rate: float = 0.3
    """Mean click probability the teacher is calibrated to."""
    calibration_samples: int = 65536
    """Samples drawn once (own stream) to standardize the logits and calibrate the click rate."""
    batch_size: int = 512
    """Samples per batch, per rank."""
    eval_batches: int = 32
    """Held-out set size in batches; must be a multiple of the number of ranks that share it."""

    def __post_init__(self) -> None:
        if self.num_tables < 2:
            raise ValueError(f"num_tables must be >= 2 (the teacher needs pairs), got {self.num_tables}")
        positive = ( "num_embeddings", "ids_per_sample", "num_dense", "teacher_dim",
                    "teacher_hidden", "calibration_samples", "batch_size", "eval_batches")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.zipf_exponent < 0:
            raise ValueError(f"zipf_exponent must be >= 0, got {self.zipf_exponent}")
        if not 0.0 <= self.dense_share <= 1.0:
            raise ValueError(f"dense_share must be in [0, 1], got {self.dense_share}")
        if self.logit_std <= 0:
            raise ValueError(f"logit_std must be > 0, got {self.logit_std}")
        if not 0.0 < self.click_rate < 1.0:
            raise ValueError(f"click_rate must be in (0, 1), got {self.click_rate}")


class _Teacher:
    """The fixed random model that generates the labels; returns its two raw logit components."""

    def __init__(self, config: SyntheticConfig, generator: torch.Generator) -> None:
        tables, dim, hidden = config.num_tables, config.teacher_dim, config.teacher_hidden
        self.embeddings = torch.randn(tables, config.num_embeddings, dim, generator=generator)
        self.pair_rows, self.pair_cols = torch.triu_indices(tables, tables, offset=1)
        self.pair_weights = torch.randn(self.pair_rows.numel(), generator=generator)
        self.hidden_weights = torch.randn(config.num_dense, hidden, generator=generator)
        self.hidden_bias = torch.randn(hidden, generator=generator)
        self.output_weights = torch.randn(hidden, generator=generator)

    def components(self, dense: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw (pairwise, dense) scores for `dense` [B, num_dense] and `ids` [B, tables, ids]."""
        table_index = torch.arange(ids.shape[1]).view(1, -1, 1)
        pooled = self.embeddings[table_index, ids].mean(dim=2)
        gram = pooled @ pooled.transpose(1, 2)
        pairwise = gram[:, self.pair_rows, self.pair_cols] @ self.pair_weights
        mlp = torch.relu(dense @ self.hidden_weights + self.hidden_bias) @ self.output_weights
        return pairwise, mlp


class SyntheticCTR:
    """Streams of `Batch`es (dense features, one KJT feature per table, 0/1 labels) from a teacher;
    a `ctrkit.ctr_data.CTRData`."""

    def __init__(self, config: SyntheticConfig) -> None:
        self.config = config
        self.feature_names = [f"cat_{table}" for table in range(config.num_tables)]
        self.num_embeddings_per_feature = [config.num_embeddings] * config.num_tables
        self.num_dense = config.num_dense
        self.batch_size = config.batch_size
        teacher_rng = keyed_generator(config.seed, "teacher")
        self._teacher = _Teacher(config, teacher_rng)
        self._popularity = torch.stack(
            [torch.randperm(config.num_embeddings, generator=teacher_rng) for _ in self.feature_names]
        )
        ranks = torch.arange(1, config.num_embeddings + 1, dtype=torch.float64)
        weights = ranks.pow(-config.zipf_exponent)
        self._zipf_cdf = (weights.cumsum(0) / weights.sum()).float()
        self._pair_scale, self._dense_scale, self._bias = self._calibrate()

    def train_batch(self, rank: int, index: int) -> Batch:
        """Training batch `index` of rank `rank`'s stream; streams of different ranks are disjoint."""
        return self._draw(self.config.batch_size, "train", rank, index)[0]

    def train_batches(self, rank: int, world_size: int = 1, start: int = 0) -> Iterator[Batch]:
        """Rank `rank`'s endless training stream from batch `start` on. `world_size` is there for
        the common `CTRData` interface: streams are keyed by rank, disjoint for any world size."""
        index = start
        while True:
            yield self.train_batch(rank, index)
            index += 1

    def heldout_batches(self, rank: int, world_size: int) -> Iterator[Batch]:
        """Rank `rank`'s share (every world_size-th batch) of the fixed held-out set."""
        if self.config.eval_batches % world_size:
            raise ValueError(
                f"eval_batches ({self.config.eval_batches}) must be a multiple of the world size ({world_size})"
            )
        for index in range(rank, self.config.eval_batches, world_size):
            yield self._draw(self.config.batch_size, "heldout", index)[0]

    def teacher_heldout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's logits and the labels over the whole held-out set."""
        draws = [self._draw(self.config.batch_size, "heldout", i) for i in range(self.config.eval_batches)]
        return torch.cat([logits for _, logits in draws]), torch.cat([batch.labels for batch, _ in draws])

    def teacher_auc(self) -> float:
        """The teacher's own held-out AUC: the ceiling for any trained model."""
        return roc_auc(*self.teacher_heldout())

    def _draw(self, batch_size: int, *stream: object) -> tuple[Batch, torch.Tensor]:
        generator = keyed_generator(self.config.seed, *stream)
        dense, ids = self._features(batch_size, generator)
        logits = self._logits(dense, ids)
        labels = torch.bernoulli(torch.sigmoid(logits), generator=generator)
        return make_batch(self.feature_names, dense, labels, ids), logits

    def _features(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        config = self.config
        dense = torch.randn(batch_size, config.num_dense, generator=generator)
        uniform = torch.rand(batch_size, config.num_tables, config.ids_per_sample, generator=generator)
        zipf_rank = torch.searchsorted(self._zipf_cdf, uniform).clamp_(max=config.num_embeddings - 1)
        table_index = torch.arange(config.num_tables).view(1, -1, 1)
        return dense, self._popularity[table_index, zipf_rank]

    def _logits(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        pairwise, mlp = self._teacher.components(dense, ids)
        return pairwise * self._pair_scale + mlp * self._dense_scale + self._bias

    def _calibrate(self) -> tuple[float, float, float]:
        """Scales giving each component its variance share of logit_std², and the click-rate bias."""
        config = self.config
        dense, ids = self._features(config.calibration_samples, keyed_generator(config.seed, "calibration"))
        pairwise, mlp = self._teacher.components(dense, ids)
        pair_scale = config.logit_std * (1.0 - config.dense_share) ** 0.5 / pairwise.std().item()
        dense_scale = config.logit_std * config.dense_share**0.5 / mlp.std().item()
        centred = pairwise * pair_scale + mlp * dense_scale
        low, high = -50.0, 50.0
        for _ in range(60):
            bias = (low + high) / 2
            if torch.sigmoid(centred + bias).mean().item() < config.click_rate:
                low = bias
            else:
                high = bias
        return pair_scale, dense_scale, (low + high) / 2

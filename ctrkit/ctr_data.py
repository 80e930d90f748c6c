"""What every CTR data source hands the trainers, and the batch building they share.

Three sources feed the same training loop (synthetic, MovieLens-100K, Criteo TSV files), so they
share one interface (`CTRData`) and one way of laying out a torchrec `Batch`: dense features
[B, num_dense] float32, one KeyedJaggedTensor key per sparse feature (values key-major, as TorchRec
expects) and 0/1 float labels [B]. `CTRTable` holds a finite data set as tensors and serves it the
way the loop needs: an endless, seeded, per-rank training stream of equal-sized batches (every rank
takes the same number of steps, which TorchRec's all-to-all requires) and a held-out set split into
the same number of batches on every rank, each row scored exactly once.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Iterator, Protocol, Sequence

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class DataFileError(RuntimeError):
    """A data file that is missing, damaged or malformed; the message names the file (and line)."""


class CTRData(Protocol):
    """A CTR data set as the training loop consumes it."""

    feature_names: list[str]
    """Sparse feature names, one KJT key (and one embedding table) each, in KJT order."""
    num_embeddings_per_feature: list[int]
    """Ids of each sparse feature lie in [0, this)."""
    num_dense: int
    """Dense features per sample."""
    batch_size: int
    """Samples per training batch and rank."""

    def train_batches(self, rank: int, world_size: int, start: int = 0) -> Iterator[Batch]:
        """Rank `rank`'s endless training stream from its batch `start` on."""
        ...

    def heldout_batches(self, rank: int, world_size: int) -> Iterator[Batch]:
        """Rank `rank`'s share of the fixed held-out set; every rank gets the same number of batches."""
        ...


def keyed_generator(*key: object) -> torch.Generator:
    """A generator seeded from every part of `key`, stable across runs, processes and hosts."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def make_batch(
    feature_names: Sequence[str],
    dense: torch.Tensor,
    labels: torch.Tensor,
    ids: torch.Tensor,
    jagged: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
) -> Batch:
    """A torchrec `Batch` from fixed-length and jagged sparse features.

    `ids` [B, F, K]: the first F features, K ids per sample each. `jagged`: one (values, lengths [B])
    pair per further feature. `feature_names` names the F fixed features, then the jagged ones.
    """
    batch_size, num_fixed, per_sample = ids.shape
    if len(feature_names) != num_fixed + len(jagged):
        raise ValueError(f"{len(feature_names)} feature names for {num_fixed} fixed and {len(jagged)} jagged features")
    fixed_lengths = torch.full((num_fixed * batch_size,), per_sample, dtype=torch.int32)
    return Batch(
        dense_features=dense,
        sparse_features=KeyedJaggedTensor.from_lengths_sync(
            keys=list(feature_names),
            values=torch.cat([ids.transpose(0, 1).reshape(-1), *(values for values, _ in jagged)]),
            lengths=torch.cat([fixed_lengths, *(lengths.int() for _, lengths in jagged)]),
        ),
        labels=labels,
    )


@dataclasses.dataclass
class CTRTable:
    """A finite CTR data set held as tensors, one row per sample."""

    feature_names: list[str]
    """Names of the single-valued features (columns of `ids`), then of the jagged ones."""
    dense: torch.Tensor
    """[N, num_dense] float32 dense features."""
    ids: torch.Tensor
    """[N, F] int64: one id per row and single-valued sparse feature."""
    labels: torch.Tensor
    """[N] float32, 0 or 1."""
    jagged_values: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Per multi-valued feature: the ids of all rows, concatenated in row order (int64)."""
    jagged_offsets: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Per multi-valued feature: [N + 1] int64, row i's ids are values[offsets[i]:offsets[i + 1]]."""

    def __len__(self) -> int:
        return self.labels.shape[0]

    def select(self, index: torch.Tensor) -> CTRTable:
        """A new table of the rows `index` (a 1-D int64 tensor), in that order."""
        pairs = [gather_jagged(*jagged, index) for jagged in zip(self.jagged_values, self.jagged_offsets)]
        return CTRTable(self.feature_names, self.dense[index], self.ids[index], self.labels[index],
                        [values for values, _ in pairs], [offsets_of(lengths) for _, lengths in pairs])

    def as_batch(self) -> Batch:
        """All rows as one `Batch`."""
        jagged = [(values, offsets.diff()) for values, offsets in zip(self.jagged_values, self.jagged_offsets)]
        return make_batch(self.feature_names, self.dense, self.labels, self.ids.unsqueeze(2), jagged)

    def train_batches(
        self, batch_size: int, seed: int, rank: int, world_size: int, start: int = 0
    ) -> Iterator[Batch]:
        """Endless epochs, each a fresh seeded shuffle cut into full batches dealt round-robin to the
        ranks; the remainder of an epoch that would not give every rank one more batch is skipped."""
        check_rank(rank, world_size)
        per_rank = len(self) // (batch_size * world_size)
        if per_rank == 0:
            raise ValueError(f"{len(self)} rows give no full batch of {batch_size} to each of {world_size} ranks")
        epoch, position = divmod(start, per_rank)
        while True:
            order = torch.randperm(len(self), generator=keyed_generator(seed, "epoch", epoch))
            for step in range(position, per_rank):
                first = (step * world_size + rank) * batch_size
                yield self.select(order[first : first + batch_size]).as_batch()
            epoch, position = epoch + 1, 0

    def heldout_batches(self, batch_size: int, rank: int, world_size: int) -> Iterator[Batch]:
        """Rank `rank`'s contiguous share of the rows, in order, in as many batches (at most
        `batch_size` rows each) as every other rank's share."""
        check_rank(rank, world_size)
        per_rank = max(1, -(-len(self) // (batch_size * world_size)))
        share = torch.tensor_split(torch.arange(len(self)), world_size)[rank]
        for index in torch.tensor_split(share, per_rank):
            yield self.select(index).as_batch()


def check_rank(rank: int, world_size: int) -> None:
    """Refuse a rank outside [0, world_size)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")


def gather_jagged(
    values: torch.Tensor, offsets: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, lengths) of the rows `index` of a jagged feature stored as (values, offsets)."""
    starts, lengths = offsets[index], offsets[index + 1] - offsets[index]
    row_start_in_output = offsets_of(lengths)[:-1]
    within_row = torch.arange(int(lengths.sum())) - row_start_in_output.repeat_interleave(lengths)
    return values[starts.repeat_interleave(lengths) + within_row], lengths


def offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    """[0, l0, l0 + l1, ...] as int64."""
    return torch.cat([torch.zeros(1, dtype=torch.int64), lengths.long().cumsum(0)])

"""The shared CTR batch layout, finite-table streams and the choice of data source."""

from __future__ import annotations

import pytest
import torch

from shadowgba.config import ConfigError, from_dict
from ctrkit.ctr_data import CTRTable, gather_jagged, make_batch
from ctrkit.datasets import DataConfig, open_dataset
from ctrkit.synthetic import SyntheticCTR

pytestmark = pytest.mark.timeout(60)


def table(rows: int) -> CTRTable:
    """Row i: dense [i], ids [i, 2i], labels i % 2, a jagged feature holding i % 3 copies of i."""
    index = torch.arange(rows)
    lengths = index % 3
    return CTRTable(
        feature_names=["a", "b", "multi"],
        dense=index.float()[:, None],
        ids=torch.stack([index, 2 * index], dim=1),
        labels=(index % 2).float(),
        jagged_values=[index.repeat_interleave(lengths)],
        jagged_offsets=[torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])],
    )


def test_make_batch_lays_out_fixed_then_jagged_features_key_major() -> None:
    ids = torch.tensor([[[1, 2], [3, 4]], [[5, 6], [7, 8]]])  # [B=2, F=2, K=2]
    jagged = [(torch.tensor([9]), torch.tensor([0, 1]))]
    batch = make_batch(["x", "y", "z"], torch.zeros(2, 1), torch.ones(2), ids, jagged)
    features = batch.sparse_features.to_dict()
    assert features["x"].values().tolist() == [1, 2, 5, 6] and features["y"].values().tolist() == [3, 4, 7, 8]
    assert features["x"].lengths().tolist() == [2, 2]
    assert torch.equal(features["z"].lengths(), torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="feature names"):
        make_batch(["x"], torch.zeros(2, 1), torch.ones(2), ids)


def test_gather_jagged_picks_whole_rows_in_the_given_order() -> None:
    values, offsets = torch.tensor([10, 11, 20, 30, 31, 32]), torch.tensor([0, 2, 3, 3, 6])
    gathered, lengths = gather_jagged(values, offsets, torch.tensor([3, 0, 2, 1]))
    assert torch.equal(gathered, torch.tensor([30, 31, 32, 10, 11, 20]))
    assert torch.equal(lengths, torch.tensor([3, 2, 0, 1]))


def test_select_keeps_every_feature_of_a_row_together() -> None:
    data = table(10)
    picked = data.select(torch.tensor([7, 2]))
    batch = picked.select(torch.tensor([1, 0])).as_batch()
    assert batch.dense_features.flatten().tolist() == [2.0, 7.0]
    assert batch.sparse_features["b"].values().tolist() == [4, 14]
    assert batch.sparse_features["multi"].values().tolist() == [2, 2, 7]


def test_train_stream_deals_each_epoch_disjointly_to_ranks_with_equal_batches() -> None:
    data, batch_size, world_size = table(50), 4, 3
    per_rank = 50 // (batch_size * world_size)
    streams = [data.train_batches(batch_size, seed=0, rank=rank, world_size=world_size) for rank in range(world_size)]
    epoch = [[next(stream) for _ in range(per_rank)] for stream in streams]
    rows = [int(row) for batches in epoch for batch in batches for row in batch.dense_features.flatten()]
    assert all(batch.labels.numel() == batch_size for batches in epoch for batch in batches)
    assert len(rows) == len(set(rows)) == per_rank * batch_size * world_size
    resumed = data.train_batches(batch_size, seed=0, rank=1, world_size=world_size, start=per_rank + 1)
    again = data.train_batches(batch_size, seed=0, rank=1, world_size=world_size)
    expected = [next(again) for _ in range(per_rank + 2)][-1]
    assert torch.equal(next(resumed).dense_features, expected.dense_features)
    with pytest.raises(ValueError, match="no full batch"):
        next(data.train_batches(64, seed=0, rank=0, world_size=1))
    with pytest.raises(ValueError, match="rank must be in"):
        next(data.train_batches(4, seed=0, rank=3, world_size=3))


def test_heldout_gives_every_rank_as_many_batches_and_every_row_once() -> None:
    data = table(23)
    shares = [list(data.heldout_batches(4, rank, 3)) for rank in range(3)]
    assert len({len(share) for share in shares}) == 1
    rows = [int(row) for share in shares for batch in share for row in batch.dense_features.flatten()]
    assert rows == list(range(23))
    assert max(batch.labels.numel() for share in shares for batch in share) <= 4


def test_data_config_selects_a_source_and_refuses_criteo_without_files() -> None:
    config = from_dict(DataConfig, {"synthetic": {"num_tables": 3, "batch_size": 8, "calibration_samples": 256}})
    data = open_dataset(config)
    assert isinstance(data, SyntheticCTR) and config.batch_size == 8
    assert data.num_embeddings_per_feature == [1000] * 3
    assert from_dict(DataConfig, {"source": "movielens", "movielens": {"batch_size": 64}}).batch_size == 64
    with pytest.raises(ConfigError, match="criteo: source criteo needs"):
        from_dict(DataConfig, {"source": "criteo"})
    with pytest.raises(ConfigError, match="criteo.heldout_paths must name at least one"):
        from_dict(DataConfig, {"source": "criteo", "criteo": {"train_paths": ["a.tsv"]}})
    with pytest.raises(ConfigError, match="source: 'parquet' is not allowed"):
        from_dict(DataConfig, {"source": "parquet"})

"""The synthetic CTR streams: reproducible, disjoint per rank, learnable, shaped as TorchRec expects."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torchrec.datasets.utils import Batch

from ctrkit.synthetic import SyntheticConfig, SyntheticCTR

pytestmark = pytest.mark.timeout(60)

CONFIG = SyntheticConfig(num_tables=4, num_embeddings=200, batch_size=64, eval_batches=8, calibration_samples=8192)


@pytest.fixture(scope="module")
def data() -> SyntheticCTR:
    return SyntheticCTR(CONFIG)


def assert_same(first: Batch, second: Batch) -> None:
    assert torch.equal(first.dense_features, second.dense_features)
    assert torch.equal(first.sparse_features.values(), second.sparse_features.values())
    assert torch.equal(first.labels, second.labels)


def test_batches_are_deterministic_per_seed_rank_and_index(data: SyntheticCTR) -> None:
    assert_same(data.train_batch(1, 5), SyntheticCTR(CONFIG).train_batch(1, 5))
    stream = data.train_batches(rank=1, start=4)
    next(stream)
    assert_same(next(stream), data.train_batch(1, 5))
    other_seed = SyntheticCTR(dataclasses.replace(CONFIG, seed=1))
    assert not torch.equal(other_seed.train_batch(1, 5).dense_features, data.train_batch(1, 5).dense_features)


def test_heldout_set_and_teacher_are_deterministic_per_seed(data: SyntheticCTR) -> None:
    again = SyntheticCTR(CONFIG)
    for first, second in zip(data.heldout_batches(0, 1), again.heldout_batches(0, 1), strict=True):
        assert_same(first, second)
    assert again.teacher_auc() == data.teacher_auc()
    other_seed = SyntheticCTR(dataclasses.replace(CONFIG, seed=1))
    assert not torch.equal(other_seed.teacher_heldout()[0], data.teacher_heldout()[0])


def test_rank_streams_and_heldout_set_are_disjoint(data: SyntheticCTR) -> None:
    rows = {
        tuple(row.tolist())
        for batch in [data.train_batch(0, 0), data.train_batch(0, 1), *data.heldout_batches(0, 1)]
        for row in batch.dense_features
    }
    other_rank = data.train_batch(1, 0).dense_features
    assert not any(tuple(row.tolist()) in rows for row in other_rank)


def test_heldout_shares_partition_the_fixed_set(data: SyntheticCTR) -> None:
    whole = [batch.labels for batch in data.heldout_batches(0, 1)]
    shares = [list(data.heldout_batches(rank, 2)) for rank in range(2)]
    assert [len(share) for share in shares] == [4, 4]
    assert torch.equal(shares[1][0].labels, whole[1])
    with pytest.raises(ValueError, match="multiple of the world size"):
        next(data.heldout_batches(0, 3))


def test_teacher_beats_chance_and_click_rate_is_calibrated(data: SyntheticCTR) -> None:
    assert 0.75 < data.teacher_auc() < 0.95
    _, labels = data.teacher_heldout()
    assert labels.mean().item() == pytest.approx(CONFIG.click_rate, abs=0.03)


def test_batch_shapes_match_torchrec(data: SyntheticCTR) -> None:
    multi_hot = SyntheticCTR(dataclasses.replace(CONFIG, ids_per_sample=3))
    for source, ids_per_sample in [(data, 1), (multi_hot, 3)]:
        batch = source.train_batch(0, 0)
        kjt = batch.sparse_features
        assert batch.dense_features.shape == (CONFIG.batch_size, CONFIG.num_dense)
        assert batch.labels.shape == (CONFIG.batch_size,)
        assert set(batch.labels.unique().tolist()) <= {0.0, 1.0}
        assert kjt.keys() == source.feature_names
        assert kjt.stride() == CONFIG.batch_size
        assert torch.all(kjt.lengths() == ids_per_sample)
        assert kjt.values().numel() == CONFIG.num_tables * CONFIG.batch_size * ids_per_sample
        for feature in source.feature_names:
            ids = kjt[feature].values()
            assert ids.min() >= 0 and ids.max() < CONFIG.num_embeddings


def test_ids_are_zipf_skewed(data: SyntheticCTR) -> None:
    ids = torch.cat([data.train_batch(0, index).sparse_features["cat_0"].values() for index in range(20)])
    counts = torch.bincount(ids, minlength=CONFIG.num_embeddings).sort(descending=True).values
    assert counts[:10].sum() > counts[-100:].sum()

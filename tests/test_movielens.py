"""MovieLens-100K from the real recbole wheel: counts, labels, feature ranges, time split, cache, errors.

The wheel is downloaded once per test session (about 2 MB from PyPI). Without network access these
tests fail, with the reason, rather than skip: the data path must be exercised.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from ctrkit import movielens
from ctrkit.ctr_data import CTRTable, DataFileError
from ctrkit.movielens import (DENSE_NAMES, FEATURE_NAMES, MovieLensConfig, MovieLensCTR, convert,
                                 extract_raw_files, fetch_wheel, read_atomic)

pytestmark = pytest.mark.timeout(120)

CARDINALITIES = [943, 1682, 2, 21, 795, 19]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("movielens")
    try:
        extract_raw_files(directory)
    except DataFileError as error:
        pytest.fail(f"the MovieLens tests need the recbole==1.2.1 wheel from PyPI: {error}")
    return directory


@pytest.fixture(scope="module")
def data(cache: Path) -> MovieLensCTR:
    return MovieLensCTR(MovieLensConfig(cache_dir=str(cache), batch_size=1000))


def test_rows_labels_and_cardinalities(data: MovieLensCTR) -> None:
    assert len(data.train) + len(data.test) == 100_000
    assert len(data.test) == pytest.approx(20_000, abs=50)
    assert int(data.train.labels.sum() + data.test.labels.sum()) == 55_375  # ratings >= 4
    for split in (data.train, data.test):
        assert 0.53 < split.labels.mean().item() < 0.58
    assert data.num_embeddings_per_feature == CARDINALITIES
    assert data.feature_names == FEATURE_NAMES and data.num_dense == len(DENSE_NAMES)


def test_feature_ranges(data: MovieLensCTR) -> None:
    for split in (data.train, data.test):
        assert split.ids.min() >= 0 and torch.all(split.ids.max(dim=0).values < torch.tensor(CARDINALITIES[:5]))
        genre_lengths = split.jagged_offsets[0].diff()
        assert genre_lengths.min() >= 1 and genre_lengths.max() <= 6
        assert 0 <= split.jagged_values[0].min() and split.jagged_values[0].max() < CARDINALITIES[5]
        assert torch.isfinite(split.dense).all()
    assert torch.allclose(data.train.dense.mean(dim=0), torch.zeros(len(DENSE_NAMES)), atol=1e-3)
    assert torch.allclose(data.train.dense.std(dim=0), torch.ones(len(DENSE_NAMES)), atol=1e-3)
    distinct = [data.train.dense[:, DENSE_NAMES.index(name)].unique().numel() for name in ("hour", "weekday")]
    assert distinct == [24, 7]


def test_time_split_has_no_leakage(data: MovieLensCTR, cache: Path, tmp_path: Path) -> None:
    raw = cache / movielens.RAW_DIR
    timestamps = torch.tensor([int(value) for value in read_atomic(raw / "ml-100k.inter")["timestamp"]])
    assert int((timestamps < data.split_timestamp).sum()) == len(data.train)
    # Rewrite every held-out rating (flip its label, move it a day later): the training rows must not change.
    for name in ("ml-100k.user", "ml-100k.item"):
        shutil.copy(raw / name, tmp_path / name)
    header, *lines = (raw / "ml-100k.inter").read_text().splitlines()
    rewritten = [header]
    for text in lines:
        user, item, rating, timestamp = text.split("\t")
        if int(timestamp) >= data.split_timestamp:
            rating, timestamp = str(6 - int(float(rating))), str(int(timestamp) + 86_400)
        rewritten.append("\t".join([user, item, rating, timestamp]))
    (tmp_path / "ml-100k.inter").write_text("\n".join(rewritten) + "\n")
    perturbed = convert(tmp_path, data.config.test_fraction)
    train = CTRTable(**perturbed["train"])
    for field in ("dense", "ids", "labels"):
        assert torch.equal(getattr(train, field), getattr(data.train, field)), field
    assert torch.equal(train.jagged_values[0], data.train.jagged_values[0])
    assert not torch.equal(CTRTable(**perturbed["test"]).labels, data.test.labels)


def test_batches_follow_the_common_interface(data: MovieLensCTR) -> None:
    batch = next(data.train_batches(rank=1, world_size=2))
    assert batch.dense_features.shape == (1000, len(DENSE_NAMES)) and batch.labels.shape == (1000,)
    assert batch.sparse_features.keys() == FEATURE_NAMES and batch.sparse_features.stride() == 1000
    assert torch.equal(next(data.train_batches(1, 2)).labels, batch.labels)
    shares = [list(data.heldout_batches(rank, 2)) for rank in range(2)]
    assert len(shares[0]) == len(shares[1])
    assert sum(batch.labels.numel() for share in shares for batch in share) == len(data.test)


def test_cache_is_reused_without_the_raw_files(data: MovieLensCTR, monkeypatch: pytest.MonkeyPatch) -> None:
    assert data.config.processed_path.exists()

    def refuse(cache: Path) -> Path:
        raise AssertionError("the processed cache should have been used")

    monkeypatch.setattr(movielens, "extract_raw_files", refuse)
    again = MovieLensCTR(data.config)
    assert torch.equal(again.test.dense, data.test.dense)


def test_damaged_files_fail_naming_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / movielens.WHEEL_NAME).write_bytes(b"not a wheel")
    with pytest.raises(DataFileError, match=rf"sha256 mismatch: expected {movielens.WHEEL_SHA256}, got [0-9a-f]{{64}}"):
        fetch_wheel(tmp_path)
    config = MovieLensConfig(cache_dir=str(tmp_path))
    config.processed_path.write_bytes(b"garbage")
    with pytest.raises(DataFileError, match="cannot read the processed MovieLens cache .*delete it"):
        MovieLensCTR(config)
    (tmp_path / "bad.user").write_text("user_id:token\tage:token\n1\t24\n2\n")
    with pytest.raises(DataFileError, match=r"bad.user, line 3: expected 2 tab-separated fields, got 1"):
        read_atomic(tmp_path / "bad.user")
    monkeypatch.setattr(sys, "executable", "/bin/false")  # pip cannot run: as without network access
    with pytest.raises(DataFileError, match=r"could not download recbole==1.2.1"):
        fetch_wheel(tmp_path / "offline")

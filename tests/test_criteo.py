"""The Criteo-format TSV reader on a tiny generated sample: values, sharding, held-out set, errors."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from torchrec.datasets.utils import Batch

from ctrkit.criteo import CriteoConfig, CriteoCTR
from ctrkit.ctr_data import DataFileError

pytestmark = pytest.mark.timeout(60)

BUCKETS = 1000


def line(index: int) -> str:
    """Sample line `index`: label index % 2; int_0 missing, int_1 = index, int_2 = -3, int_j = index * j;
    cat_j = (index + 1) * 7919 * (j + 1) in hex, cat_25 missing."""
    integers = ["", str(index), "-3", *(str(index * j) for j in range(3, 13))]
    categories = [f"{(index + 1) * 7919 * (j + 1):08x}" for j in range(25)] + [""]
    return "\t".join([str(index % 2), *integers, *categories])


def with_field(index: int, position: int, value: str) -> str:
    """Sample line `index` with field `position` (0 is the label) replaced by `value`."""
    fields = line(index).split("\t")
    fields[position] = value
    return "\t".join(fields)


def row_indices(batch: Batch) -> list[int]:
    """Which sample lines a batch holds, read back from int_1 = index."""
    return batch.dense_features[:, 1].expm1().round().int().tolist()


def write(path: Path, lines: list[str]) -> str:
    """Write `lines` as a TSV file; its path as a string."""
    path.write_text("".join(text + "\n" for text in lines))
    return str(path)


@pytest.fixture
def sample(tmp_path: Path) -> CriteoConfig:
    train = write(tmp_path / "train.tsv", [line(index) for index in range(10)])
    heldout = write(tmp_path / "heldout.tsv", [line(index) for index in range(100, 107)])
    return CriteoConfig(train_paths=[train], heldout_paths=[heldout], num_embeddings=BUCKETS, batch_size=2)


def test_values_are_log_transformed_and_hashed(sample: CriteoConfig) -> None:
    data = CriteoCTR(sample)
    batch = next(data.train_batches(rank=0, world_size=1))
    assert data.feature_names == [f"cat_{j}" for j in range(26)] and data.num_dense == 13
    assert batch.labels.tolist() == [0.0, 1.0]
    second = batch.dense_features[1]
    assert second[0] == 0.0  # missing
    assert second[1].item() == pytest.approx(math.log1p(1))
    assert second[2] == 0.0  # -3 clamps to 0
    assert second[5].item() == pytest.approx(math.log1p(5))
    features = batch.sparse_features
    assert features["cat_3"].values().tolist() == [(row + 1) * 7919 * 4 % BUCKETS for row in range(2)]
    assert features["cat_25"].values().tolist() == [0, 0]  # missing
    assert all(features[name].lengths().tolist() == [1, 1] for name in data.feature_names)


def test_ranks_take_alternate_batches_of_an_endless_stream(sample: CriteoConfig) -> None:
    data = CriteoCTR(sample)
    # 10 lines in batches of 2: the stream wraps to line 0 after 5 batches; rank r takes batches r, r + 2, ...
    streams = [data.train_batches(rank, 2) for rank in range(2)]
    first_rows = [[row_indices(next(stream))[0] for _ in range(4)] for stream in streams]
    assert first_rows == [[0, 4, 8, 2], [2, 6, 0, 4]]
    assert row_indices(next(data.train_batches(1, 2, start=2))) == [0, 1]


def test_heldout_rows_are_shared_evenly_and_capped(sample: CriteoConfig) -> None:
    data = CriteoCTR(sample)
    shares = [list(data.heldout_batches(rank, 2)) for rank in range(2)]
    assert [len(share) for share in shares] == [2, 2]
    assert sum(batch.labels.numel() for share in shares for batch in share) == 7
    capped = CriteoCTR(dataclasses.replace(sample, max_heldout_rows=3))
    assert sum(batch.labels.numel() for batch in capped.heldout_batches(0, 1)) == 3


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ("1\t2", "expected 40 tab-separated fields"),
        (with_field(3, 0, "x"), "label must be 0 or 1, got 'x'"),
        (with_field(3, 4, "five"), "int_3 must be an integer, got 'five'"),
        (with_field(3, 20, "zz"), "cat_6 must be a hexadecimal hash, got 'zz'"),
    ],
)
def test_a_malformed_line_names_file_and_line(tmp_path: Path, broken: str, message: str) -> None:
    path = write(tmp_path / "bad.tsv", [line(0), line(1), broken])
    config = CriteoConfig(train_paths=[path], heldout_paths=[path], batch_size=4)
    with pytest.raises(DataFileError, match=rf"bad.tsv, line 3: {message}"):
        next(CriteoCTR(config).train_batches(0, 1))


def test_missing_and_empty_files_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(DataFileError, match="criteo.train_paths: no such file: .*nope.tsv"):
        CriteoCTR(CriteoConfig(train_paths=[str(tmp_path / "nope.tsv")], heldout_paths=[str(tmp_path / "nope.tsv")]))
    empty = write(tmp_path / "empty.tsv", [])
    data = CriteoCTR(CriteoConfig(train_paths=[empty], heldout_paths=[empty]))
    with pytest.raises(DataFileError, match="train_paths hold no rows"):
        next(data.train_batches(0, 1))
    with pytest.raises(DataFileError, match="heldout_paths hold no rows"):
        next(data.heldout_batches(0, 1))

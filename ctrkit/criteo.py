"""Users' own click logs in Criteo's TSV layout, streamed as CTR batches.

Each line is: label (0/1), 13 integer features, 26 categorical features written as hexadecimal
hashes, tab-separated; an empty field is a missing value. This is the layout of the Criteo Kaggle and
1TB data sets that TorchRec's readers target (`torchrec.datasets.criteo`), and the layout constants
and feature names (`cat_0` ... `cat_25`) come from there. Integers become log(1 + max(x, 0)) (the
DLRM convention; missing is 0); categorical values become int(hex) modulo `num_embeddings` (as
TorchRec's `hashes`; missing is 0).

TorchRec's TSV reader itself is not used: its row mapper turns malformed values into 0 silently, its
csv parsing lets a stray quote merge lines (so line numbers drift) and it leaves files open. Here
every line is split on tabs and checked, and a bad line fails naming its file and line number.

Training files are streamed, never loaded whole: they are read in order, endlessly (epoch after
epoch, no shuffling, so shuffle them upstream), cut into batches dealt round-robin to the ranks;
each rank parses only its own batches. The held-out files (their first `max_heldout_rows` rows) are
loaded into memory once, so every rank gets the same number of evaluation batches.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from pathlib import Path
from typing import Iterator

import torch
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES, INT_FEATURE_COUNT
from torchrec.datasets.utils import Batch

from ctrkit.ctr_data import CTRTable, DataFileError, check_rank

FIELDS = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT

Row = tuple[str, int, str]
"""(file, line number, text) of one TSV line."""


@dataclasses.dataclass
class CriteoConfig:
    """Criteo-format TSV files and how their categorical features are hashed and batched."""

    train_paths: list[str] = dataclasses.field(default_factory=list)
    """TSV files streamed for training, in this order, again and again."""
    heldout_paths: list[str] = dataclasses.field(default_factory=list)
    """TSV files of the held-out set (their first `max_heldout_rows` rows are evaluated)."""
    num_embeddings: int = 100_000
    """Hash buckets (embedding rows) per categorical feature."""
    batch_size: int = 512
    """Samples per training and evaluation batch, per rank."""
    max_heldout_rows: int = 1_000_000
    """Held-out rows loaded into memory at most."""

    def __post_init__(self) -> None:
        for name in ("train_paths", "heldout_paths"):
            if not getattr(self, name):
                raise ValueError(f"{name} must name at least one TSV file")
        for name in ("num_embeddings", "batch_size", "max_heldout_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class CriteoCTR:
    """Criteo-format TSV files as CTR batches; a `ctrkit.ctr_data.CTRData`."""

    def __init__(self, config: CriteoConfig) -> None:
        for key in ("train_paths", "heldout_paths"):
            missing = [path for path in getattr(config, key) if not Path(path).is_file()]
            if missing:
                raise DataFileError(f"criteo.{key}: no such file: {', '.join(missing)}")
        self.config = config
        self.feature_names = list(DEFAULT_CAT_NAMES)
        self.num_embeddings_per_feature = [config.num_embeddings] * CAT_FEATURE_COUNT
        self.num_dense = INT_FEATURE_COUNT
        self.batch_size = config.batch_size

    def train_batches(self, rank: int, world_size: int, start: int = 0) -> Iterator[Batch]:
        """Rank `rank`'s endless stream: batches rank, rank + world_size, ... of the training lines,
        from its batch `start` on."""
        check_rank(rank, world_size)
        chunks = _chunks(_endless_rows(self.config.train_paths), self.batch_size)
        for chunk in itertools.islice(chunks, start * world_size + rank, None, world_size):
            yield self._parse(chunk).as_batch()

    def heldout_batches(self, rank: int, world_size: int) -> Iterator[Batch]:
        """Rank `rank`'s share of the held-out rows, in file order."""
        return self._heldout.heldout_batches(self.batch_size, rank, world_size)

    @functools.cached_property
    def _heldout(self) -> CTRTable:
        """The held-out rows, read and parsed once."""
        rows = list(itertools.islice(_rows(self.config.heldout_paths), self.config.max_heldout_rows))
        if not rows:
            raise DataFileError(f"criteo.heldout_paths hold no rows: {', '.join(self.config.heldout_paths)}")
        return self._parse(rows)

    def _parse(self, rows: list[Row]) -> CTRTable:
        """The rows as a table: log-transformed integers, hashed categorical ids, labels."""
        labels, integers, categories = [], [], []
        for path, number, line in rows:
            try:
                label, row_integers, row_categories = _parse_line(line, self.config.num_embeddings)
            except ValueError as error:
                raise DataFileError(f"{path}, line {number}: {error}") from None
            labels.append(label)
            integers.append(row_integers)
            categories.append(row_categories)
        dense = torch.log1p(torch.tensor(integers, dtype=torch.float64).clamp_min(0)).float()
        return CTRTable(self.feature_names, dense, torch.tensor(categories, dtype=torch.int64), torch.tensor(labels))


def _parse_line(line: str, num_embeddings: int) -> tuple[float, list[int], list[int]]:
    """(label, integer features, hashed categorical ids) of one TSV line."""
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) != FIELDS:
        raise ValueError(f"expected {FIELDS} tab-separated fields (label, {INT_FEATURE_COUNT} integer, "
                         f"{CAT_FEATURE_COUNT} categorical), got {len(fields)}")
    if fields[0] not in ("0", "1"):
        raise ValueError(f"label must be 0 or 1, got '{fields[0]}'")
    integers, categories = fields[1 : 1 + INT_FEATURE_COUNT], fields[1 + INT_FEATURE_COUNT :]
    return (
        float(fields[0]),
        [_field(value, 10, name) for value, name in zip(integers, DEFAULT_INT_NAMES)],
        [_field(value, 16, name) % num_embeddings for value, name in zip(categories, DEFAULT_CAT_NAMES)],
    )


def _field(value: str, base: int, name: str) -> int:
    """An integer field (0 when missing); a malformed one fails naming the feature."""
    try:
        return int(value, base) if value else 0
    except ValueError:
        kind = "a hexadecimal hash" if base == 16 else "an integer"
        raise ValueError(f"{name} must be {kind}, got '{value}'") from None


def _rows(paths: list[str]) -> Iterator[Row]:
    """Every line of `paths`, in order (split into fields only by the rank that parses it)."""
    for path in paths:
        with open(path, encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                yield path, number, line


def _endless_rows(paths: list[str]) -> Iterator[Row]:
    """`_rows(paths)` repeated forever; files without any row fail instead of spinning."""
    while True:
        empty = True
        for row in _rows(paths):
            empty = False
            yield row
        if empty:
            raise DataFileError(f"criteo.train_paths hold no rows: {', '.join(paths)}")


def _chunks(rows: Iterator[Row], size: int) -> Iterator[list[Row]]:
    """Consecutive lists of `size` rows (the last one shorter if `rows` ends)."""
    while chunk := list(itertools.islice(rows, size)):
        yield chunk

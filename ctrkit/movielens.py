"""MovieLens-100K as a click-through task for DLRM: a real data set small enough for every machine.

The data ships inside the `recbole==1.2.1` wheel (RecBole's atomic files for ml-100k), which is
fetched with `pip download --no-deps`, checked against a pinned sha256 and read as a zip: installing
recbole would pull heavy dependencies. Only the three ml-100k files are extracted.

The task: one sample per rating, label rating >= 4. Dense features are the user's age,
the movie's release year, the hour and weekday of the rating (UTC), and log(1 + earlier ratings) of
the user and of the movie, counted over strictly earlier timestamps, so no feature looks ahead.
They are standardized with training-split statistics only. Sparse features are user, item, gender,
occupation and zip code (one id each) and the movie's genres (multi-valued, a jagged feature).

The split is by time: the latest `test_fraction` of ratings are held out, and ratings sharing the
boundary timestamp all go to the held-out side, so every training rating precedes every held-out
one. The processed tensors are cached next to the wheel; later runs read only the cache.

MovieLens is provided by GroupLens for research use; publications must cite F. Maxwell Harper and
Joseph A. Konstan. 2015. The MovieLens Datasets: History and Context. ACM TiiS 5, 4, Article 19.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any, Iterator

import torch
from torchrec.datasets.utils import Batch

from ctrkit.ctr_data import CTRTable, DataFileError, gather_jagged, offsets_of

WHEEL_REQUIREMENT = "recbole==1.2.1"
WHEEL_NAME = "recbole-1.2.1-py3-none-any.whl"
WHEEL_SHA256 = "9c9948202011f37eb0a7c6768129313f00d6403ad221ec940d5e2d5d5f33a407"
WHEEL_MEMBER_DIR = "recbole/dataset_example/ml-100k/"
RAW_FILES = ("ml-100k.inter", "ml-100k.user", "ml-100k.item")
RAW_DIR = "ml-100k"
CACHE_VERSION = 1
"""Part of the processed cache's file name; bump it whenever the conversion changes."""
DENSE_NAMES = ["age", "release_year", "hour", "weekday", "log_user_earlier_ratings", "log_item_earlier_ratings"]
FEATURE_NAMES = ["user", "item", "gender", "occupation", "zip", "genres"]
POSITIVE_RATING = 4.0
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class MovieLensConfig:
    """Where MovieLens-100K is cached, how it is split and batched."""

    cache_dir: str | None = None
    """Folder for the wheel, the extracted ml-100k files and the processed tensors; None: data_cache/
    in the repository root."""
    test_fraction: float = 0.2
    """Share of ratings, the latest by timestamp, held out for evaluation."""
    batch_size: int = 512
    """Samples per training and evaluation batch, per rank."""
    seed: int = 0
    """Seeds the shuffle of every training epoch."""

    def __post_init__(self) -> None:
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {self.test_fraction}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    @property
    def cache_path(self) -> Path:
        """The cache folder as a path."""
        return Path(self.cache_dir) if self.cache_dir is not None else REPO_ROOT / "data_cache"

    @property
    def processed_path(self) -> Path:
        """The cached processed task for this split."""
        return self.cache_path / f"ml-100k-ctr-v{CACHE_VERSION}-test{self.test_fraction}.pt"


class MovieLensCTR:
    """MovieLens-100K rating samples as CTR batches; a `ctrkit.ctr_data.CTRData`. `train` and
    `test` hold the two splits; `split_timestamp` is the Unix time of the earliest held-out rating."""

    def __init__(self, config: MovieLensConfig) -> None:
        self.config = config
        payload = load_or_convert(config)
        self.train = CTRTable(**payload["train"])
        self.test = CTRTable(**payload["test"])
        self.split_timestamp: int = payload["split_timestamp"]
        self.feature_names = list(FEATURE_NAMES)
        self.num_embeddings_per_feature: list[int] = payload["num_embeddings_per_feature"]
        self.num_dense = len(DENSE_NAMES)
        self.batch_size = config.batch_size

    def train_batches(self, rank: int, world_size: int, start: int = 0) -> Iterator[Batch]:
        """Rank `rank`'s endless stream: its share of every shuffled epoch of the training ratings."""
        return self.train.train_batches(self.batch_size, self.config.seed, rank, world_size, start)

    def heldout_batches(self, rank: int, world_size: int) -> Iterator[Batch]:
        """Rank `rank`'s share of the held-out (latest) ratings, in time order."""
        return self.test.heldout_batches(self.batch_size, rank, world_size)


def load_or_convert(config: MovieLensConfig) -> dict[str, Any]:
    """The processed task from the cache, or built (downloading the wheel if needed) and cached.
    A lock on the cache folder lets several ranks call this at once."""
    cache = config.cache_path
    cache.mkdir(parents=True, exist_ok=True)
    processed = config.processed_path
    with open(cache / ".ml-100k.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not processed.exists():
            payload = convert(extract_raw_files(cache), config.test_fraction)
            partial = processed.with_name(f"{processed.name}.partial")
            torch.save(payload, partial)
            partial.replace(processed)
    try:
        return torch.load(processed, weights_only=True)
    except Exception as error:
        raise DataFileError(
            f"cannot read the processed MovieLens cache {processed} ({type(error).__name__}); delete it to rebuild it"
        ) from error


def extract_raw_files(cache: Path) -> Path:
    """The folder holding the ml-100k atomic files, extracted from the verified wheel if absent."""
    raw = cache / RAW_DIR
    if all((raw / name).exists() for name in RAW_FILES):
        return raw
    wheel = fetch_wheel(cache)
    raw.mkdir(exist_ok=True)
    with zipfile.ZipFile(wheel) as archive:
        for name in RAW_FILES:
            partial = raw / f"{name}.partial"
            partial.write_bytes(archive.read(WHEEL_MEMBER_DIR + name))
            partial.replace(raw / name)
    return raw


def fetch_wheel(cache: Path) -> Path:
    """The recbole wheel in `cache`, downloaded from the package index if absent, sha256-checked."""
    wheel = cache / WHEEL_NAME
    if not wheel.exists():
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "--quiet", WHEEL_REQUIREMENT, "-d", str(cache)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0 or not wheel.exists():
            raise DataFileError(
                f"could not download {WHEEL_REQUIREMENT} (MovieLens-100K ships inside it) into {cache}: "
                f"`{' '.join(command)}` exited with {result.returncode}: {result.stderr.strip()[-2000:]}"
            )
    got = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if got != WHEEL_SHA256:
        raise DataFileError(f"{wheel}: sha256 mismatch: expected {WHEEL_SHA256}, got {got}; delete it to fetch again")
    return wheel


def convert(raw: Path, test_fraction: float) -> dict[str, Any]:
    """The CTR task from the atomic files in `raw`: train and test tables, cardinalities, split time."""
    ratings_path, user_path, item_path = (raw / name for name in RAW_FILES)
    ratings, users, items = read_atomic(ratings_path), read_atomic(user_path), read_atomic(item_path)
    genre_lists = [text.split() for text in items["class"]]
    user_columns = {"gender": "gender", "occupation": "occupation", "zip": "zip_code"}
    vocabularies = {
        "user": _vocabulary(users["user_id"]), "item": _vocabulary(items["item_id"]),
        **{feature: _vocabulary(users[column]) for feature, column in user_columns.items()},
        "genres": _vocabulary([genre for genres in genre_lists for genre in genres]),
    }

    timestamps = _numbers(ratings["timestamp"], ratings_path, "timestamp").long()
    order = torch.argsort(timestamps, stable=True)
    timestamps = timestamps[order]
    user = _lookup(vocabularies["user"], ratings["user_id"], ratings_path, "user_id")[order]
    item = _lookup(vocabularies["item"], ratings["item_id"], ratings_path, "item_id")[order]
    labels = (_numbers(ratings["rating"], ratings_path, "rating")[order] >= POSITIVE_RATING).float()
    cut = _split_index(timestamps, test_fraction)

    per_user = torch.stack([
        _lookup(vocabularies[feature], users[column], user_path, column) for feature, column in user_columns.items()
    ], dim=1)
    ids = torch.cat([user[:, None], item[:, None], per_user[user]], dim=1)
    genre_ids = torch.tensor([vocabularies["genres"][genre] for genres in genre_lists for genre in genres])
    genre_offsets = offsets_of(torch.tensor([len(genres) for genres in genre_lists]))
    genre_values, genre_lengths = gather_jagged(genre_ids, genre_offsets, item)

    age = _numbers(users["age"], user_path, "age")
    release_year = torch.tensor([float(year) if year.isdigit() else float("nan") for year in items["release_year"]])
    dense = torch.stack([
        age[user], release_year[item], (timestamps // 3600 % 24).float(),
        ((timestamps // 86400 + 3) % 7).float(),  # 1970-01-01 was a Thursday; Monday is 0
        torch.log1p(_earlier_count(user, timestamps)), torch.log1p(_earlier_count(item, timestamps)),
    ], dim=1)
    dense = _standardize(dense, dense[:cut])

    table = CTRTable(FEATURE_NAMES, dense, ids, labels, [genre_values], [offsets_of(genre_lengths)])
    return {
        "train": dataclasses.asdict(table.select(torch.arange(cut))),
        "test": dataclasses.asdict(table.select(torch.arange(cut, len(table)))),
        "num_embeddings_per_feature": [len(vocabularies[name]) for name in FEATURE_NAMES],
        "split_timestamp": int(timestamps[cut]),
    }


def read_atomic(path: Path) -> dict[str, list[str]]:
    """Columns of a RecBole atomic file (tab-separated, header `name:type`), keyed by name."""
    try:
        header, *lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, ValueError) as error:
        raise DataFileError(f"cannot read {path}: {error}") from None
    names = [field.partition(":")[0] for field in header.split("\t")]
    columns: list[list[str]] = [[] for _ in names]
    for number, line in enumerate(lines, start=2):
        fields = line.split("\t")
        if len(fields) != len(names):
            raise DataFileError(f"{path}, line {number}: expected {len(names)} tab-separated fields, got {len(fields)}")
        for column, field in zip(columns, fields):
            column.append(field)
    return dict(zip(names, columns))


def _vocabulary(tokens: list[str]) -> dict[str, int]:
    """Distinct tokens, sorted, to ids 0..n-1."""
    return {token: index for index, token in enumerate(sorted(set(tokens)))}


def _lookup(vocab: dict[str, int], tokens: list[str], path: Path, column: str) -> torch.Tensor:
    """Ids of `tokens` (a column of `path`); an unknown token fails naming its line."""
    ids = []
    for number, token in enumerate(tokens, start=2):
        if token not in vocab:
            raise DataFileError(f"{path}, line {number}: unknown {column} '{token}'")
        ids.append(vocab[token])
    return torch.tensor(ids, dtype=torch.int64)


def _numbers(tokens: list[str], path: Path, column: str) -> torch.Tensor:
    """`tokens` (a column of `path`) as float64; a non-number fails naming its line."""
    values = []
    for number, token in enumerate(tokens, start=2):
        try:
            values.append(float(token))
        except ValueError:
            raise DataFileError(f"{path}, line {number}: {column} '{token}' is not a number") from None
    return torch.tensor(values, dtype=torch.float64)


def _split_index(timestamps: torch.Tensor, test_fraction: float) -> int:
    """First held-out row of the time-sorted ratings; rows sharing its timestamp are held out too."""
    nominal = min(int(round(len(timestamps) * (1.0 - test_fraction))), len(timestamps) - 1)
    cut = int(torch.searchsorted(timestamps, timestamps[nominal]))
    if cut == 0:
        raise ValueError(f"test_fraction {test_fraction} leaves no training rating before the split time")
    return cut


def _earlier_count(group: torch.Tensor, timestamps: torch.Tensor) -> torch.Tensor:
    """Per row: rows of the same group (user or item) with a strictly smaller timestamp."""
    span = int(timestamps.max()) + 1
    keys = group * span + timestamps
    sorted_keys = keys.sort().values
    return (torch.searchsorted(sorted_keys, keys) - torch.searchsorted(sorted_keys, group * span)).float()


def _standardize(dense: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Zero mean, unit variance per column using `reference` rows' statistics; NaN (unknown) -> 0."""
    mean = reference.nanmean(dim=0)
    filled = torch.where(reference.isnan(), mean, reference)
    std = filled.std(dim=0).clamp_min(1e-6)
    return torch.nan_to_num((dense - mean) / std, nan=0.0).float()

"""Choosing the CTR data source from the config: `data.source: synthetic | movielens | criteo`.

Each source keeps its own config section, so switching sources is one key and the other sections
keep their values. `open_dataset` returns the chosen source as a `ctrkit.ctr_data.CTRData`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from ctrkit.criteo import CriteoConfig, CriteoCTR
from ctrkit.ctr_data import CTRData
from ctrkit.movielens import MovieLensConfig, MovieLensCTR
from ctrkit.synthetic import SyntheticConfig, SyntheticCTR


@dataclasses.dataclass
class DataConfig:
    """Which CTR data set to train on, and each source's settings."""

    source: Literal["synthetic", "movielens", "criteo"] = "synthetic"
    """synthetic: planted-teacher data of any size (its AUC ceiling is known); movielens:
    MovieLens-100K ratings, label rating >= 4, split by time; criteo: your own TSV files in
    Criteo's layout."""
    synthetic: SyntheticConfig = dataclasses.field(default_factory=SyntheticConfig)
    """Settings of the synthetic source."""
    movielens: MovieLensConfig = dataclasses.field(default_factory=MovieLensConfig)
    """Settings of the MovieLens-100K source."""
    criteo: CriteoConfig | None = None
    """Settings of the Criteo-format source (its files have no default, so the section is optional)."""

    def __post_init__(self) -> None:
        if self.source == "criteo" and self.criteo is None:
            raise ValueError("criteo: source criteo needs a criteo section with train_paths and heldout_paths")

    @property
    def batch_size(self) -> int:
        """Samples per batch and rank of the chosen source."""
        return getattr(self, self.source).batch_size


def open_dataset(config: DataConfig) -> CTRData:
    """The chosen source, ready to stream (MovieLens is downloaded and converted on first use)."""
    if config.source == "movielens":
        return MovieLensCTR(config.movielens)
    if config.source == "criteo":
        assert config.criteo is not None  # DataConfig refuses source criteo without the section
        return CriteoCTR(config.criteo)
    return SyntheticCTR(config.synthetic)

"""Exact AUC against a brute-force pairwise count, log loss against its formula, cross-rank gather."""

from __future__ import annotations

import math

import pytest
import torch

from ctrkit.evaluation import all_gather_rows, log_loss, roc_auc
from tests.multiprocess import run_ranks


def pairwise_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of (positive, negative) pairs ordered correctly; ties count one half."""
    positives, negatives = scores[labels == 1], scores[labels == 0]
    difference = positives[:, None] - negatives[None, :]
    wins = (difference > 0).double().sum() + 0.5 * (difference == 0).double().sum()
    return (wins / difference.numel()).item()


@pytest.mark.parametrize("distinct_values", [3, 20, 10_000])
def test_auc_matches_pairwise_count_with_ties(distinct_values: int) -> None:
    generator = torch.Generator().manual_seed(distinct_values)
    labels = torch.randint(0, 2, (700,), generator=generator)
    scores = torch.randint(0, distinct_values, (700,), generator=generator).float() + 0.3 * labels
    assert roc_auc(scores, labels) == pytest.approx(pairwise_auc(scores, labels), abs=1e-12)


def test_auc_extremes_and_single_class() -> None:
    labels = torch.tensor([0, 0, 1, 1])
    assert roc_auc(torch.tensor([0.1, 0.2, 0.3, 0.4]), labels) == 1.0
    assert roc_auc(torch.tensor([0.4, 0.3, 0.2, 0.1]), labels) == 0.0
    assert roc_auc(torch.ones(4), labels) == 0.5
    with pytest.raises(ValueError, match="both classes"):
        roc_auc(torch.rand(3), torch.ones(3))


def test_log_loss_matches_formula() -> None:
    logits = torch.tensor([-2.0, 0.0, 0.5, 3.0])
    labels = torch.tensor([0.0, 1.0, 1.0, 0.0])
    probabilities = [1 / (1 + math.exp(-x)) for x in logits.tolist()]
    expected = -sum(
        y * math.log(p) + (1 - y) * math.log(1 - p) for p, y in zip(probabilities, labels.tolist())
    ) / len(probabilities)
    assert log_loss(logits, labels) == pytest.approx(expected, rel=1e-12)


def gather_uneven(rank: int, world_size: int) -> torch.Tensor:
    local = torch.full((rank + 1, 2), float(rank))
    return all_gather_rows(local)


def test_all_gather_rows_concatenates_uneven_shares_in_rank_order() -> None:
    expected = torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    for gathered in run_ranks(gather_uneven, 2, timeout_s=60):
        assert torch.equal(gathered, expected)

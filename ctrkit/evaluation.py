"""Held-out metrics for binary click models: exact ROC AUC, log loss, and a cross-rank gather.

AUC is computed exactly from ranks (Mann-Whitney U, ties count one half) rather than from a
thresholded curve, so differences of a few thousandths between sync algorithms are not binning
artefacts. Each rank scores its share of the held-out set; `all_gather_rows` collects the shares so
the metric is computed over the whole set, not averaged over ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Probability that a random positive scores above a random negative (ties count 1/2).

    `scores` are any monotone scores (logits or probabilities), `labels` are 0/1; both are flattened.
    """
    scores = scores.detach().flatten().double().cpu()
    positive = labels.detach().flatten().cpu() > 0.5
    num_positive = int(positive.sum())
    num_negative = positive.numel() - num_positive
    if num_positive == 0 or num_negative == 0:
        raise ValueError(f"AUC needs both classes; got {num_positive} positives and {num_negative} negatives")
    sorted_scores, order = torch.sort(scores)
    _, group, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    last_rank = counts.cumsum(0).double()
    mean_rank = last_rank - (counts.double() - 1.0) / 2.0
    positive_rank_sum = mean_rank[group][positive[order]].sum().item()
    return (positive_rank_sum - num_positive * (num_positive + 1) / 2) / (num_positive * num_negative)


def log_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy of sigmoid(`logits`) against 0/1 `labels`, in nats."""
    return F.binary_cross_entropy_with_logits(
        logits.detach().flatten().double(), labels.detach().flatten().double()
    ).item()


def all_gather_rows(local: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's `local` along dim 0, in group-rank order, over `group` (default: the
    default group; a job with parameter servers gathers over its trainers' group).

    Ranks may hold different numbers of rows. Without an initialized process group the input is
    returned as is. With NCCL, `local` must live on the rank's CUDA device.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return local
    world_size = dist.get_world_size(group)
    count = torch.tensor([local.shape[0]], dtype=torch.int64, device=local.device)
    counts = [torch.empty_like(count) for _ in range(world_size)]
    dist.all_gather(counts, count, group=group)
    sizes = [int(size) for size in counts]
    padded = local.new_zeros((max(sizes), *local.shape[1:]))
    padded[: local.shape[0]] = local
    chunks = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(chunks, padded, group=group)
    return torch.cat([chunk[:size] for chunk, size in zip(chunks, sizes)])

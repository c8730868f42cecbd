"""Losses of semi-supervised LDL (torch): KL and the pairwise relevance-ranking (PRR) losses.

* :func:`kl_loss` — ``KL(target ‖ softmax(logits))``, batch mean (``F.kl_div``; ``0 · ln 0 = 0``).
* :func:`prr_loss` — the pairwise relevance-ranking loss, one function for both forms.  For every
  ordered label pair ``(i, j)`` with ``t_i > t_j`` in the target ``t``, and the predicted
  distribution ``p = softmax(logits)``::

      PRR = Σ_{i,j: t_i > t_j} max(0, s · (t_i − t_j) − (p_i − p_j))

  ``s = margin_scale``.  With ``s > 0`` (RankMatch on *labelled* data, and the margin-on-unlabelled
  ablation) the predicted gap must be at least ``s`` times the target gap; with ``s = 0`` (RankMatch
  on *pseudo-labels*) only the order counts.  The loss is zero exactly when every target-ordered
  pair is ordered in ``p`` (``p_i ≥ p_j``) with its margin; pairs tied in the target add nothing.
  Summed over pairs (the notes' form), averaged over the instances.

RECONSTRUCTED (no code or equations are public; research notes ``continual.md`` §3): the hinge form,
the probability space (not logits), the margin ``s · (t_i − t_j)`` and the sum over pairs are this
reconstruction's choices, consistent with the READ fragments ("PRR loss with a margin", "strong/weak
constraint for labelled/unlabelled", "focusing solely on the ranking … while disregarding their
margins").  A hinge at zero margin is used for the order-only form (instead of the notes' softplus)
so that the loss is exactly zero on a correctly ordered prediction, as the abstract's "disregarding
their margins" suggests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kl_loss(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``KL(target ‖ softmax(logits))`` per instance, averaged (``weight``: per-instance weights, mean over all)."""
    per = F.kl_div(F.log_softmax(logits, dim=1), target, reduction="none").sum(dim=1)
    return _mean(per, weight)


def prr_terms(p: torch.Tensor, target: torch.Tensor, margin_scale: float) -> torch.Tensor:
    """The (B, C, C) hinge terms ``[t_i > t_j] · max(0, s (t_i − t_j) − (p_i − p_j))``."""
    dt = target.unsqueeze(2) - target.unsqueeze(1)  # [b, i, j] = t_i − t_j
    dp = p.unsqueeze(2) - p.unsqueeze(1)
    return torch.where(dt > 0, F.relu(margin_scale * dt - dp), torch.zeros_like(dp))


def prr_loss(logits: torch.Tensor, target: torch.Tensor, margin_scale: float = 1.0,
             weight: torch.Tensor | None = None) -> torch.Tensor:
    """The PRR loss of ``softmax(logits)`` against ``target`` (``margin_scale=0``: order only)."""
    if margin_scale < 0:
        raise ValueError(f"margin_scale must be >= 0, got {margin_scale}")
    per = prr_terms(F.softmax(logits, dim=1), target, margin_scale).sum(dim=(1, 2))
    return _mean(per, weight)


def _mean(per: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    if per.numel() == 0:
        return per.sum()
    return per.mean() if weight is None else (per * weight).mean()


def kl_per_instance(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``KL(target_i ‖ softmax(logits_i))`` of every instance (B,): no term couples instances."""
    return F.kl_div(F.log_softmax(logits, dim=1), target, reduction="none").sum(dim=1)


def prr_per_instance(logits: torch.Tensor, target: torch.Tensor, margin_scale: float) -> torch.Tensor:
    """The PRR loss of every instance (B,): its label pairs only (the ranking is over labels, not instances)."""
    return prr_terms(F.softmax(logits, dim=1), target, margin_scale).sum(dim=(1, 2))

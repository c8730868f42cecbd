"""The entropy maths of Tent and ETA/EATA: per-sample entropy, ETA's two sample filters and its
re-weighted loss (benchmark ``utils/losses.py``, ``eata.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def softmax_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-sample Shannon entropy of softmax(logits) (benchmark ``utils/losses.py::Entropy``)."""
    return -(logits.softmax(1) * logits.log_softmax(1)).sum(1)


def update_ema_probs(ema: torch.Tensor | None, probs: torch.Tensor, momentum: float) -> torch.Tensor | None:
    """EATA's moving average of the mean prediction of the kept samples (``update_model_probs``)."""
    with torch.no_grad():
        if probs.shape[0] == 0:
            return ema
        if ema is None:
            return probs.mean(0)
        return momentum * ema + (1 - momentum) * probs.mean(0)


def eta_select(
    logits: torch.Tensor,
    entropy: torch.Tensor,
    e_margin: float,
    d_margin: float,
    ema: torch.Tensor | None,
    momentum: float,
) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """ETA's two filters: (indices kept, number passing the reliability filter, updated EMA).

    The redundancy filter applies only once an EMA exists (not on the first batch with kept
    samples), exactly as the code.
    """
    ids1 = torch.where(entropy < e_margin)[0]
    probs1 = logits[ids1].softmax(1)
    if ema is not None:
        cos = F.cosine_similarity(ema.unsqueeze(0), probs1, dim=1)
        ids2 = torch.where(torch.abs(cos) < d_margin)[0]
        keep = ids1[ids2]
        new_ema = update_ema_probs(ema, probs1[ids2], momentum)
    else:
        keep = ids1
        new_ema = update_ema_probs(ema, probs1, momentum)
    return keep, int(ids1.numel()), new_ema


def eta_loss(entropy: torch.Tensor, keep: torch.Tensor, e_margin: float) -> torch.Tensor:
    """Mean of Hᵢ·exp(E0 − Hᵢ) over kept samples, weights detached (NaN when none is kept)."""
    h = entropy[keep]
    coeff = 1 / torch.exp(h.clone().detach() - e_margin)
    return h.mul(coeff).mean(0)

"""The three training losses, on L2-normalised embeddings and a logit scale (the authors' ``losses.py``).

* :func:`clip_loss`: the symmetric CLIP loss (the authors' ``_compute_standard_clip_loss``).
* :func:`negclip_loss`: NegCLIP, the authors' "unified" branch with one positive set: image→text
  cross-entropy over the batch's positives *and* all its hard negatives, text→image over positives.
* :func:`clic_loss`: CLIC (Eq. 4–7, the ``hard_negatives_separate`` branch): per positive set i a CLIP
  loss (image→text over set i's captions, text→image over the images), a two-way cross-entropy
  [logit(image, p_i), logit(image, negative)] with target p_i, and the uni-modal ‖e(p1) − e(p2)‖²
  (summed over dimensions, mean over the batch); each term averaged over the sets, total
  ``cont·contrastive + sneg·hard-negative + uni·uni-modal``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def clip_loss(img: torch.Tensor, txt: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(CE(image→text) + CE(text→image)) / 2 over the batch, the diagonal being the pairs."""
    logits = scale * img @ txt.T
    labels = torch.arange(len(img))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def negclip_loss(img: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Image→text over [positives | negatives] (B × 2B), text→image over positives; their mean."""
    labels = torch.arange(len(img))
    i2t = F.cross_entropy(scale * img @ torch.cat([pos, neg]).T, labels)
    t2i = F.cross_entropy(scale * pos @ img.T, labels)
    return (i2t + t2i) / 2


def clic_loss(img: torch.Tensor, positives: list[torch.Tensor], neg: torch.Tensor, scale: torch.Tensor,
              cont: float = 0.5, sneg: float = 0.5, uni: float = 1.0) -> dict[str, torch.Tensor]:
    """CLIC's loss terms and their weighted total (``positives``: the sets p1, p2, ..., each B × d)."""
    labels = torch.arange(len(img))
    targets = torch.zeros(len(img), dtype=torch.long)
    neg_logit = scale * (img * neg).sum(-1)
    i2t, t2i, hard = [], [], []
    for pos in positives:
        i2t.append(F.cross_entropy(scale * img @ pos.T, labels))
        t2i.append(F.cross_entropy(scale * pos @ img.T, labels))
        hard.append(F.cross_entropy(torch.stack([scale * (img * pos).sum(-1), neg_logit], 1), targets))
    k = len(positives)
    terms = {"contrastive": (sum(i2t) / k + sum(t2i) / k) / 2, "hard_negative": sum(hard) / k}
    terms["uni_modal"] = ((positives[0] - positives[1]) ** 2).sum(-1).mean() if k > 1 else img.new_zeros(())
    terms["total"] = cont * terms["contrastive"] + sneg * terms["hard_negative"] + uni * terms["uni_modal"]
    return terms

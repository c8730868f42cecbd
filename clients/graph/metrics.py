"""Node-classification scores for class-imbalanced domain adaptation: micro/macro-F1, per-class F1 and
the head/tail split (scikit-learn's ``f1_score``)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from sklearn.metrics import f1_score

__all__ = ["f1_report", "head_tail"]


def head_tail(sizes: Sequence[float], order: Sequence[int], tail_classes: int) -> tuple[list[int], list[int]]:
    """Head and tail classes: classes ranked by training size (largest first, ties by ``order``);
    the last ``tail_classes`` are the tail, the rest the head."""
    rank = {k: i for i, k in enumerate(order)}
    ranked = sorted(range(len(sizes)), key=lambda k: (-sizes[k], rank.get(k, k)))
    cut = len(ranked) - tail_classes
    return sorted(ranked[:cut]), sorted(ranked[cut:])


def f1_report(pred: torch.Tensor | np.ndarray, y: torch.Tensor | np.ndarray, num_classes: int,
              head: Sequence[int] = (), tail: Sequence[int] = ()) -> dict[str, float]:
    """``macro_f1``, ``micro_f1``, ``f1_c{k}`` per class, and the mean F1 of the ``head`` / ``tail`` classes
    (all NaN without any node)."""
    pred, y = np.asarray(pred), np.asarray(y)
    labels = list(range(num_classes))
    if len(y) == 0:  # e.g. a tiny graph without validation nodes
        nan = float("nan")
        return {"macro_f1": nan, "micro_f1": nan, **{f"f1_c{k}": nan for k in labels},
                **({"head_f1": nan} if head else {}), **({"tail_f1": nan} if tail else {})}
    per_class = f1_score(y, pred, labels=labels, average=None, zero_division=0)
    out = {"macro_f1": float(per_class.mean()), "micro_f1": float(f1_score(y, pred, labels=labels, average="micro",
                                                                              zero_division=0))}
    out.update({f"f1_c{k}": float(v) for k, v in enumerate(per_class)})
    if head:
        out["head_f1"] = float(per_class[list(head)].mean())
    if tail:
        out["tail_f1"] = float(per_class[list(tail)].mean())
    return out

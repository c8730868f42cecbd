"""ImGDA's losses, as the authors code them (``utils.py`` of github.com/maxin88scu/ImGDA), vectorised.

* :func:`anchor_nodes` -- the "distilled anchor set": per class, the ``k`` source nodes of highest
  degree in the branch's operator (adjacency for the local branch, PPMI for the global branch;
  ``sampling_anchor_nodes``).  Ties are broken by node index (stable sort).
* :func:`class_prototypes` -- ``c_y^b`` = the mean branch-``b`` embedding of *all* source nodes of
  class ``y``.  Quirk kept: the authors' ``calculate_prototypes`` receives the anchors but ignores them.
* :func:`dynamic_temperature` -- ``tau_y = tau0 + (1 - tau0) * n_y / n_max`` (tail classes get a
  lower temperature).  Quirk (selectable in the learner): the authors count ``n_y`` on the whole
  original source graph (a module-level ``label``), not on the long-tailed training graph; on a
  balanced original graph that makes every ``tau_y = 1``.
* :func:`cross_branch_loss` -- ``L_cb``: for prototype branch ``b`` and embedding branch ``j`` (all
  four pairs), each class ``y``: ``-mean_{i in anchors_j(y)} log softmax_u(z_u^j . c_y^b / tau_y)``,
  the softmax over *all* source nodes ``u``; embeddings and prototypes L2-normalised; the sum is
  divided by ``4 C`` (``(len(prototypes) + len(nodes_embeddings)) * C`` in the code).
* :func:`cross_domain_loss` -- ``L_cd``: for each branch ``b``, a target node's pseudo-label is the
  argmax of ``sum_a softmax_a(z_t . z_a^b / T) onehot(y_a)`` over the branch's source anchors
  (``T = 1``; ``z_t = z_t^L + z_t^G``); then for each pseudo-class ``c``, each target node with
  ``y_t = c`` gets ``-mean_{a in anchors_b(c)} log softmax_a(z_t . z_a^b / T)``.  Quirks kept: the
  softmax runs over the anchors *of class c only* (``denominator="class"``), so the loss is
  minimised when a target node is equally similar to all of its pseudo-class's anchors (it is
  ``log |anchors_b(c)|`` then), not when it is closer to them than to other classes' anchors; and
  the per-class mean is divided once more by the class's target count (``target_loss.mean() /
  target_loss.size(0)``).  ``denominator="all"`` (softmax over every anchor: an InfoNCE over
  classes) is the option; the federated target node needs it, because it sees one global
  prototype per class, for which the class-only softmax is identically 0.
* :func:`balanced_weights` -- class weights ``N / (C n_c)`` for the class-balanced CE baseline.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch_geometric.utils import degree, scatter

__all__ = [
    "anchor_nodes",
    "balanced_weights",
    "class_prototypes",
    "cross_branch_loss",
    "cross_domain_loss",
    "dynamic_temperature",
    "prototype_sums",
    "pseudo_labels",
]


def anchor_nodes(edge_index: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    """Per class, the ``k`` nodes of highest out-degree in ``edge_index`` (ids, grouped by class)."""
    deg = degree(edge_index[0], num_nodes=y.shape[0])
    out = []
    for c in torch.unique(y).tolist():
        nodes = torch.nonzero(y == c).view(-1)
        order = torch.sort(deg[nodes], descending=True, stable=True).indices
        out.append(nodes[order[:k]])
    return torch.cat(out)


def prototype_sums(z: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class embedding sums ``[C, d]`` and counts ``[C]``."""
    sums = scatter(z, y, dim=0, dim_size=num_classes, reduce="sum")
    counts = torch.bincount(y, minlength=num_classes)[:num_classes].to(z.dtype)
    return sums, counts


def class_prototypes(z: torch.Tensor, y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Mean embedding of each class (all its nodes) ``[C, d]``; zero for a class without nodes."""
    sums, counts = prototype_sums(z, y, num_classes)
    return sums / counts.clamp_min(1).unsqueeze(1)


def dynamic_temperature(counts: torch.Tensor, tau0: float) -> torch.Tensor:
    """``tau_y = tau0 + (1 - tau0) * n_y / max_y n_y``."""
    counts = counts.float()
    return tau0 + (1.0 - tau0) * counts / counts.max()


def cross_branch_loss(z_local: torch.Tensor, z_global: torch.Tensor, y: torch.Tensor, anchors_local: torch.Tensor,
                      anchors_global: torch.Tensor, tau: torch.Tensor, num_classes: int,
                      prototypes: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """``L_cb``: cross-branch prototype contrast with class-dependent temperature ``tau`` ``[C]``.

    ``prototypes`` (local, global; ``[C, d]`` each) replace the class means of ``z_local`` /
    ``z_global`` when given (the federated variant's shared prototypes).
    """
    if prototypes is None:
        prototypes = (class_prototypes(z_local, y, num_classes), class_prototypes(z_global, y, num_classes))
    protos = [F.normalize(p, dim=1) for p in prototypes]
    embeds = [F.normalize(z_local, dim=1), F.normalize(z_global, dim=1)]
    anchors = [anchors_local, anchors_global]
    present = torch.unique(y)
    loss = z_local.new_zeros(())
    for proto in protos:
        for z, a in zip(embeds, anchors):
            logits = (z @ proto.t()) / tau.unsqueeze(0)  # [N, C]
            logp = logits - torch.logsumexp(logits, dim=0, keepdim=True)  # softmax over the source nodes
            per_anchor = -logp[a, y[a]]
            per_class = scatter(per_anchor, y[a], dim=0, dim_size=num_classes, reduce="mean")
            loss = loss + per_class[present].sum()
    return loss / ((len(protos) + len(embeds)) * num_classes)


def pseudo_labels(z_target: torch.Tensor, z_anchor: torch.Tensor, y_anchor: torch.Tensor, num_classes: int,
                  temperature: float = 1.0) -> torch.Tensor:
    """The authors' soft-vote pseudo-labels: argmax of the similarity-softmax-weighted anchor labels."""
    sim = F.normalize(z_target, dim=1) @ F.normalize(z_anchor, dim=1).t() / temperature
    votes = torch.softmax(sim, dim=1) @ F.one_hot(y_anchor, num_classes).to(sim.dtype)
    return votes.argmax(dim=1)


def cross_domain_loss(z_target: torch.Tensor, branch_anchors: Sequence[tuple[torch.Tensor, torch.Tensor]],
                      num_classes: int, temperature: float = 1.0, denominator: str = "class") -> torch.Tensor:
    """``L_cd``: pseudo-label each target node from a branch's anchors, then contrast it with them.

    ``branch_anchors`` holds, per branch, ``(anchor embeddings [A, d], anchor labels [A])``;
    ``z_target`` is the (summed-branch) target embedding.  The result is averaged over branches.
    """
    if denominator not in ("class", "all"):
        raise ValueError(f"denominator must be 'class' or 'all', got {denominator!r}")
    zt = F.normalize(z_target, dim=1)
    loss = z_target.new_zeros(())
    for z_anchor, y_anchor in branch_anchors:
        za = F.normalize(z_anchor, dim=1)
        logits = zt @ za.t() / temperature  # [Nt, A]
        yt = torch.softmax(logits, dim=1).matmul(F.one_hot(y_anchor, num_classes).to(logits.dtype)).argmax(1)
        same = yt.unsqueeze(1) == y_anchor.unsqueeze(0)  # [Nt, A]: anchors of the node's pseudo-class
        if denominator == "class":
            logits = logits.masked_fill(~same, float("-inf"))
        logp = torch.log_softmax(logits, dim=1)
        has = same.any(dim=1)  # a pseudo-class without anchors contributes nothing
        per_node = -(logp.masked_fill(~same, 0.0)).sum(1) / same.sum(1).clamp_min(1)
        per_node, cls = per_node[has], yt[has]
        n_c = torch.bincount(cls, minlength=num_classes).to(per_node.dtype)
        per_class = scatter(per_node, cls, dim=0, dim_size=num_classes, reduce="sum")
        loss = loss + (per_class / n_c.clamp_min(1) ** 2).sum()
    return loss / len(branch_anchors)


def balanced_weights(y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Class weights ``N / (C n_c)`` (scikit-learn's "balanced"); 0 for an absent class."""
    counts = torch.bincount(y, minlength=num_classes)[:num_classes].float()
    w = y.shape[0] / (num_classes * counts.clamp_min(1))
    return torch.where(counts > 0, w, torch.zeros_like(w))

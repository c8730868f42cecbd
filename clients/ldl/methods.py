"""Semi-supervised LDL methods as switchable recipes over one loss (RankMatch and its baselines).

Every method minimises, per step, on a labelled batch ``(x_l, d_l)`` and an unlabelled batch ``x_u``::

    L = KL(d_l ‖ f(weak(x_l)))                       + λ_s · PRR_s(f(weak(x_l)), d_l)        [labelled]
      + w_u · ( KL(q ‖ f(view(x_u)))                 + λ_u · PRR_u(f(view(x_u)), q) )        [unlabelled]

with ``q`` a pseudo-distribution (no gradient) and ``f`` the softmax of the network.  A
:class:`Recipe` says where ``q`` comes from, which view the student sees and which ranking terms
are on; the six methods of the issue are six recipes (:data:`RECIPES`):

=================  ============================  ===========  ===========  ==============
method             pseudo-distribution q          student view  PRR_s        PRR_u
=================  ============================  ===========  ===========  ==============
supervised         (none: labelled KL only)       —            off          off
pseudo_label       the round's global model on    weak         off          off
                   the clean x_u (fixed all round)
fixmatch           f(weak(x_u)), same step        strong       off          off
avg_pseudo         mean of f over ``views`` weak  strong       off          off
                   views (the earlier version)
rankmatch          as avg_pseudo                  strong       margin       order only
rankmatch_margin   as avg_pseudo                  strong       margin       margin (ablation)
=================  ============================  ===========  ===========  ==============

RankMatch (Kou et al., NeurIPS 2025, https://openreview.net/forum?id=Q8QMhJFSk4; earlier version
arXiv 2312.06343): the supervised KL plus a pairwise relevance-ranking loss with a margin on the
labelled data, and on the unlabelled data the averaged weak-view pseudo-distribution matched by the
strong view with KL plus a ranking loss that keeps only the order (:func:`clients.ldl.losses.prr_loss`).

RECONSTRUCTED (no code is public; research notes ``continual.md`` §3): the whole loss above.  In
particular the averaging over weak views comes from the earlier version (READ: "averaging strategy
that creates a pseudo-label distribution from multiple weakly augmented images"); no sharpening of
``q`` (a label distribution is not a class to be sharpened to); an optional FixMatch-style
confidence mask ``max_j q_j ≥ threshold`` (default 0 = off: the peak mass of a distribution is not
a confidence); the pseudo_label baseline's targets are refreshed once per round (when a node
receives the global model — classic self-training in rounds, since soft self-targets recomputed at
every step have zero KL gradient); ``avg_pseudo`` is the earlier version's averaging *without* its
ranking term (the ranking is what RankMatch adds, ablated separately).  No EMA teacher.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from clients.ldl.augment import Augment
from clients.ldl.losses import kl_loss, kl_per_instance, prr_loss, prr_per_instance
from fedsim.errors import ConfigError

PSEUDO_SOURCES = ("none", "snapshot", "weak", "average")
VIEWS = ("weak", "strong")
RANKINGS = ("none", "order", "margin")


@dataclass(frozen=True)
class Recipe:
    """Which pieces of the loss a method uses (see the module table)."""

    pseudo: str  # none | snapshot | weak | average
    student_view: str  # weak | strong
    sup_rank: bool  # PRR with margin on labelled data
    unsup_rank: str  # none | order | margin

    def __post_init__(self) -> None:
        if self.pseudo not in PSEUDO_SOURCES or self.student_view not in VIEWS or self.unsup_rank not in RANKINGS:
            raise ValueError(f"bad recipe {self}")

    @property
    def uses_unlabelled(self) -> bool:
        return self.pseudo != "none"


RECIPES: dict[str, Recipe] = {
    "supervised": Recipe("none", "weak", False, "none"),
    "pseudo_label": Recipe("snapshot", "weak", False, "none"),
    "fixmatch": Recipe("weak", "strong", False, "none"),
    "avg_pseudo": Recipe("average", "strong", False, "none"),
    "rankmatch": Recipe("average", "strong", True, "order"),
    "rankmatch_margin": Recipe("average", "strong", True, "margin"),
}


def recipe_of(method: str) -> Recipe:
    if method not in RECIPES:
        raise ConfigError(f"unknown ldl method {method!r}; known: {', '.join(RECIPES)}")
    return RECIPES[method]


@dataclass
class Weights:
    """Loss weights and knobs shared by the recipes (a weight of 0 switches its term off)."""

    unsup_weight: float = 1.0  # w_u
    sup_rank_weight: float = 0.1  # λ_s (only where the recipe has PRR_s)
    unsup_rank_weight: float = 0.1  # λ_u (only where the recipe has PRR_u)
    margin_scale: float = 1.0  # s of the margin PRR (labelled, and unlabelled in rankmatch_margin)
    views: int = 4  # weak views averaged into q (recipes with pseudo=average)
    threshold: float = 0.0  # keep an unlabelled instance only if max_j q_j >= threshold (0 = all)


@torch.no_grad()
def predict(model: nn.Module, x: torch.Tensor, batch_size: int = 1024) -> torch.Tensor:
    """softmax(model(x)) in eval mode, batched."""
    was = model.training
    model.eval()
    out = torch.cat([torch.softmax(model(x[i:i + batch_size]), dim=1) for i in range(0, len(x), batch_size)]) \
        if len(x) else torch.empty(0)
    model.train(was)
    return out


@torch.no_grad()
def pseudo_distributions(model: nn.Module, x: torch.Tensor, recipe: Recipe, weights: Weights, augment: Augment,
                         gen: torch.Generator, snapshot: torch.Tensor | None = None) -> torch.Tensor:
    """The recipe's pseudo-distributions ``q`` of ``x`` (rows on the simplex; no gradient).

    ``snapshot``: the round's fixed targets of ``x`` (pseudo=snapshot); pseudo=none gives the plain
    prediction on the clean ``x`` (what the model would pseudo-label; used only to measure it).
    """
    if recipe.pseudo == "snapshot" and snapshot is not None:
        return snapshot
    if recipe.pseudo in ("none", "snapshot"):
        return predict(model, x)
    if recipe.pseudo == "weak":
        return predict(model, augment.weak(x, gen))
    views = torch.stack([predict(model, augment.weak(x, gen)) for _ in range(weights.views)])
    return views.mean(dim=0)


def step_loss(model: nn.Module, x_l: torch.Tensor, d_l: torch.Tensor, x_u: torch.Tensor | None,
              recipe: Recipe, weights: Weights, augment: Augment, gen: torch.Generator,
              q_fixed: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """One step's loss and its parts (``x_u`` None or empty: labelled terms only; no labelled rows: unlabelled only).

    ``q_fixed``: the snapshot targets of ``x_u`` (pseudo_label).  Pseudo-distributions are built in
    eval mode before the student's forward pass (models with dropout or batch norm see the same
    teacher for every view).
    """
    zero = torch.zeros(())
    parts = {"sup_kl": zero, "sup_rank": zero, "unsup_kl": zero, "unsup_rank": zero}
    kept = float("nan")
    use_u = recipe.uses_unlabelled and x_u is not None and len(x_u) > 0 and weights.unsup_weight > 0
    if use_u:
        q = q_fixed if recipe.pseudo == "snapshot" else pseudo_distributions(model, x_u, recipe, weights, augment, gen)
    if len(x_l):
        logits_l = model(augment.weak(x_l, gen))
        parts["sup_kl"] = kl_loss(logits_l, d_l)
        if recipe.sup_rank and weights.sup_rank_weight > 0:
            parts["sup_rank"] = prr_loss(logits_l, d_l, weights.margin_scale)
    if use_u:
        view = augment.strong if recipe.student_view == "strong" else augment.weak
        logits_u = model(view(x_u, gen))
        mask = (q.max(dim=1).values >= weights.threshold).float()
        kept = float(mask.mean())
        parts["unsup_kl"] = kl_loss(logits_u, q, mask)
        if recipe.unsup_rank != "none" and weights.unsup_rank_weight > 0:
            scale = weights.margin_scale if recipe.unsup_rank == "margin" else 0.0
            parts["unsup_rank"] = prr_loss(logits_u, q, scale, mask)
    loss = (parts["sup_kl"] + weights.sup_rank_weight * parts["sup_rank"]
            + weights.unsup_weight * (parts["unsup_kl"] + weights.unsup_rank_weight * parts["unsup_rank"]))
    return loss, {**{k: float(v.detach()) for k, v in parts.items()}, "kept": kept}


def per_example_loss(model: nn.Module, x: torch.Tensor, target: torch.Tensor, labelled: torch.Tensor,
                     recipe: Recipe, weights: Weights, augment: Augment,
                     gen: torch.Generator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DP-SGD form of :func:`step_loss`: per-row terms ``ℓ_i`` of one batch mixing labelled and
    unlabelled rows (``labelled``: a bool per row), returned with their parts (each (B,)).

    Labelled row: ``KL(d_i ‖ f(weak(x_i))) + λ_s PRR_s``; unlabelled row: ``w_u · m_i · (KL(q_i ‖ f(view(x_i)))
    + λ_u PRR_u)`` with ``q_i`` built from ``x_i`` alone (its weak views under the model, eval mode, no
    gradient; or ``target`` = the round's snapshot for pseudo=snapshot) and ``m_i`` its own confidence
    mask.  Every term reads its own row only and the PRR ranks labels within the row, so the mean
    ``Σ ℓ_i / B`` is a per-example loss.  One forward pass over all rows (each row's view chosen by its
    flag), as Opacus' per-sample gradients need one batch dimension per pass.
    """
    n = len(x)
    zero = torch.zeros(n)
    lab = labelled.bool()
    use_u = recipe.uses_unlabelled and weights.unsup_weight > 0 and bool((~lab).any())
    q = target
    if use_u and recipe.pseudo != "snapshot":
        q = torch.where(lab[:, None], target, pseudo_distributions(model, x, recipe, weights, augment, gen))
    weak = augment.weak(x, gen)
    if use_u and recipe.student_view == "strong":
        shape = (n,) + (1,) * (x.dim() - 1)
        view = torch.where(lab.view(shape), weak, augment.strong(x, gen))
    else:
        view = weak
    logits = model(view)
    kl = kl_per_instance(logits, q)
    parts = {"sup_kl": torch.where(lab, kl, zero), "sup_rank": zero, "unsup_kl": zero, "unsup_rank": zero}
    if recipe.sup_rank and weights.sup_rank_weight > 0:
        parts["sup_rank"] = torch.where(lab, prr_per_instance(logits, q, weights.margin_scale), zero)
    if use_u:
        mask = (~lab) & (q.max(dim=1).values >= weights.threshold)
        parts["unsup_kl"] = torch.where(mask, kl, zero)
        if recipe.unsup_rank != "none" and weights.unsup_rank_weight > 0:
            scale = weights.margin_scale if recipe.unsup_rank == "margin" else 0.0
            parts["unsup_rank"] = torch.where(mask, prr_per_instance(logits, q, scale), zero)
    per = (parts["sup_kl"] + weights.sup_rank_weight * parts["sup_rank"]
           + weights.unsup_weight * (parts["unsup_kl"] + weights.unsup_rank_weight * parts["unsup_rank"]))
    return per + 0.0 * logits.sum(dim=1), parts  # always in the graph (zero gradient where every term is off)

"""The recipes: valid pseudo-distributions, the right loss terms per method, augmentations that keep shapes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from clients.ldl.augment import AugmentParams, ImageAugment, TabularAugment, augment_for
from clients.ldl.methods import RECIPES, Weights, pseudo_distributions, recipe_of, step_loss
from fedsim.errors import ConfigError

C = 5


def tiny_model(d_in: int = 6) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d_in, 16), nn.ReLU(), nn.Linear(16, C))


def tabular_augment(x: torch.Tensor) -> TabularAugment:
    return augment_for(x.numpy())  # type: ignore[return-value]


@pytest.mark.parametrize("method", list(RECIPES))
def test_pseudo_distributions_are_valid_distributions(method) -> None:
    x = torch.randn(37, 6, generator=torch.Generator().manual_seed(1))
    q = pseudo_distributions(tiny_model(), x, RECIPES[method], Weights(views=3), tabular_augment(x),
                             torch.Generator().manual_seed(2))
    assert q.shape == (37, C) and not q.requires_grad
    assert (q >= 0).all() and torch.allclose(q.sum(1), torch.ones(37), atol=1e-6)


def test_average_is_the_mean_of_weak_views_and_snapshot_is_kept() -> None:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    model, aug = tiny_model(), tabular_augment(x)
    q = pseudo_distributions(model, x, RECIPES["rankmatch"], Weights(views=3), aug, torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        views = [torch.softmax(model(aug.weak(x, gen)), 1) for _ in range(3)]
    assert torch.allclose(q, torch.stack(views).mean(0), atol=1e-6)
    one = pseudo_distributions(model, x, RECIPES["fixmatch"], Weights(views=3), aug, torch.Generator().manual_seed(5))
    assert torch.allclose(one, views[0], atol=1e-6)  # fixmatch: a single weak view
    snap = torch.full((8, C), 1 / C)
    assert pseudo_distributions(model, x, RECIPES["pseudo_label"], Weights(), aug, torch.Generator(), snap) is snap


def _parts(method: str, **weights) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    x_l, x_u = torch.randn(4, 6, generator=g), torch.randn(12, 6, generator=g)
    d_l = torch.softmax(torch.randn(4, C, generator=g), 1)
    aug = tabular_augment(torch.cat([x_l, x_u]))
    q_fixed = torch.softmax(torch.randn(12, C, generator=g), 1)
    loss, parts = step_loss(tiny_model(), x_l, d_l, x_u, recipe_of(method), Weights(**weights), aug,
                            torch.Generator().manual_seed(3), q_fixed)
    assert loss.requires_grad
    return parts


def test_each_method_uses_exactly_its_terms() -> None:
    on = {m: {k for k, v in _parts(m).items() if k != "kept" and v != 0} for m in RECIPES}
    assert on["supervised"] == {"sup_kl"}
    assert on["pseudo_label"] == on["fixmatch"] == on["avg_pseudo"] == {"sup_kl", "unsup_kl"}
    # a random network mis-orders: both ranking terms are active
    assert on["rankmatch"] == on["rankmatch_margin"] == {"sup_kl", "sup_rank", "unsup_kl", "unsup_rank"}
    # the margin on pseudo-labels is strictly stronger than order only (same q, same views: same seeds);
    # ">=" would also pass if rankmatch used the margin too
    assert _parts("rankmatch_margin")["unsup_rank"] > _parts("rankmatch")["unsup_rank"] > 0
    # a zero weight switches a term off; the threshold masks every instance below it
    assert _parts("rankmatch", sup_rank_weight=0.0)["sup_rank"] == 0
    assert _parts("fixmatch", threshold=1.0)["kept"] == 0 and _parts("fixmatch")["kept"] == 1
    with pytest.raises(ConfigError, match="unknown ldl method"):
        recipe_of("mixmatch")


def test_augmentations_keep_shape_and_strong_moves_more() -> None:
    x = torch.zeros(64, 1, 8, 8)
    x[:, :, 2:6, 3:5] = 1.0
    aug = augment_for(x.numpy(), AugmentParams(shift=-1, rotation=20, cutout=0.375))
    assert isinstance(aug, ImageAugment) and aug.shift == 1 and aug.background == 0.0
    gen = torch.Generator().manual_seed(0)
    weak, strong = aug.weak(x, gen), aug.strong(x, gen)
    assert weak.shape == strong.shape == x.shape
    assert 0 < (weak - x).abs().mean() < (strong - x).abs().mean()
    # the weak view is a whole-pixel shift (plus small noise): the stroke mass is preserved
    assert torch.allclose(weak.sum((1, 2, 3)), x.sum((1, 2, 3)), atol=1.0)  # noise only: sum std ~0.2
    assert (weak - x).abs().max() > 0.5  # ... and some strokes did move
    a = aug.strong(x, torch.Generator().manual_seed(7))
    assert torch.equal(a, aug.strong(x, torch.Generator().manual_seed(7)))  # seeded
    # the defaults keep the geometry: weak = noise only, strong = noise + one 2x2 Cutout square
    plain = augment_for(x.numpy())
    w = plain.weak(x, gen)
    assert (w - x).abs().max() < 0.5
    st = plain.strong(x, gen)
    assert ((st - x).abs() > 0.5).flatten(1).sum(1).max() <= 4
    tab = torch.randn(50, 4)
    t = augment_for(tab.numpy(), AugmentParams(drop=0.5))
    assert isinstance(t, TabularAugment) and t.strong(tab, gen).shape == tab.shape
    dropped = t.strong(tab, gen) == t.mean
    assert 0.3 < dropped.float().mean() < 0.7


def test_order_only_ranking_ignores_margins_that_the_margin_form_enforces() -> None:
    """RankMatch's pseudo-label term keeps the order only: a prediction ordered like q, however
    flat, costs nothing; the margin form (labelled data, the rankmatch_margin ablation) charges it."""
    from clients.ldl.losses import prr_loss

    q = torch.tensor([[0.6, 0.3, 0.1]])
    flat_but_ordered = torch.log(torch.tensor([[0.34, 0.333, 0.327]]))
    assert prr_loss(flat_but_ordered, q, margin_scale=0.0) == 0
    assert prr_loss(flat_but_ordered, q, margin_scale=1.0) > 0.5  # (0.3-0.007)+(0.5-0.013)+(0.2-0.006)
    misordered = torch.log(torch.tensor([[0.3, 0.6, 0.1]]))
    assert prr_loss(misordered, q, margin_scale=0.0) > 0
    from clients.ldl.methods import RECIPES

    assert RECIPES["rankmatch"].unsup_rank == "order" and RECIPES["rankmatch_margin"].unsup_rank == "margin"

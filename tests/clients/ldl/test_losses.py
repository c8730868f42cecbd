"""The ranking losses are zero exactly when the order (and margin) is right; KL is the textbook one."""

from __future__ import annotations

import math

import pytest
import torch

from clients.ldl.losses import kl_loss, prr_loss, prr_terms


def logits_of(p: list[float]) -> torch.Tensor:
    return torch.log(torch.tensor([p], dtype=torch.float64))


T = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)


def test_kl_is_the_textbook_value_and_zero_at_the_target() -> None:
    assert float(kl_loss(logits_of([0.5, 0.3, 0.2]), T)) == pytest.approx(0.0, abs=1e-12)
    expected = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4) + 0.2 * math.log(0.2 / 0.2)
    assert float(kl_loss(logits_of([0.4, 0.4, 0.2]), T)) == pytest.approx(expected)


@pytest.mark.parametrize("p,order_ok,margin_ok", [
    ([0.5, 0.3, 0.2], True, True),     # the target itself: every gap exactly the target's
    ([0.7, 0.25, 0.05], True, True),   # order right, every gap wider than the target's
    ([0.4, 0.35, 0.25], True, False),  # order right, gaps narrower than the target's
    ([0.45, 0.2, 0.35], False, False), # labels 1 and 2 swapped
    ([0.3, 0.5, 0.2], False, False),   # labels 0 and 1 swapped
    ([0.2, 0.3, 0.5], False, False),   # reversed
])
def test_zero_exactly_when_order_and_margin_hold(p, order_ok, margin_ok) -> None:
    logits = logits_of(p)
    order, margin = float(prr_loss(logits, T, 0.0)), float(prr_loss(logits, T, 1.0))
    assert (order <= 1e-12) is order_ok
    assert (margin <= 1e-12) is margin_ok
    assert margin >= order - 1e-12  # the margin form is never weaker
    # brute force: the margin loss is the sum of the pairwise shortfalls
    shortfall = sum(max(0.0, (T[0, i] - T[0, j]).item() - (p[i] - p[j])) for i in range(3) for j in range(3)
                    if T[0, i] > T[0, j])
    assert margin == pytest.approx(shortfall, abs=1e-9)


def test_values_and_gradients_by_hand() -> None:
    # t = (.5, .3, .2), p = (.3, .5, .2): pairs (0>1): gap_t .2, gap_p -.2; (0>2): .3, .1; (1>2): .1, .3
    logits = logits_of([0.3, 0.5, 0.2]).requires_grad_(True)
    order = prr_loss(logits, T, 0.0)
    margin = prr_loss(logits, T, 1.0)
    assert order.item() == pytest.approx(0.2)                 # only the swapped pair, by how much it is swapped
    assert margin.item() == pytest.approx(0.4 + 0.2 + 0.0)   # (.2+.2) + (.3-.1) + max(0, .1-.3)
    order.backward()  # noqa
    assert logits.grad[0, 0] < 0 < logits.grad[0, 1]          # pushes label 0 up and label 1 down


def test_ties_in_the_target_add_nothing_and_batches_average() -> None:
    tied = torch.tensor([[0.4, 0.4, 0.2]], dtype=torch.float64)
    terms = prr_terms(torch.tensor([[0.1, 0.7, 0.2]], dtype=torch.float64), tied, 0.0)
    assert float(terms[0, 0, 1]) == 0 and float(terms[0, 1, 0]) == 0  # the tied pair
    assert float(terms[0, 0, 2]) == pytest.approx(0.1)  # 0 > 2 in the target, 0.1 < 0.2 predicted
    two = torch.cat([logits_of([0.3, 0.5, 0.2]), logits_of([0.5, 0.3, 0.2])])
    assert float(prr_loss(two, T.repeat(2, 1), 0.0)) == pytest.approx(0.1)
    w = torch.tensor([1.0, 0.0], dtype=torch.float64)
    assert float(prr_loss(two, T.repeat(2, 1), 0.0, w)) == pytest.approx(0.1)  # weighted mean over the batch
    with pytest.raises(ValueError):
        prr_loss(two, T.repeat(2, 1), -1.0)

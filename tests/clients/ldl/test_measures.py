"""The six LDL measures against values computed by hand, and the rank correlations against scipy.stats."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import kendalltau, spearmanr

from clients.ldl.measures import EPS, kendall_rows, ldl_measures, per_instance, spearman_rows

D = np.array([0.5, 0.3, 0.2, 0.0])
P = np.array([0.4, 0.4, 0.1, 0.1])


def test_six_measures_match_hand_computed_values() -> None:
    # |d - p| = (.1, .1, .1, .1); d + p = (.9, .7, .3, .1)
    m = {k: float(v[0]) for k, v in per_instance(D, P).items()}
    assert m["chebyshev"] == pytest.approx(0.1)
    assert m["clark"] == pytest.approx(math.sqrt((0.1 / 0.9) ** 2 + (0.1 / 0.7) ** 2 + (0.1 / 0.3) ** 2 + 1.0))
    assert m["canberra"] == pytest.approx(0.1 / 0.9 + 0.1 / 0.7 + 0.1 / 0.3 + 1.0)
    assert m["kl"] == pytest.approx(0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4) + 0.2 * math.log(2.0))
    assert m["cosine"] == pytest.approx((0.2 + 0.12 + 0.02) / (math.sqrt(0.38) * math.sqrt(0.34)))
    assert m["intersection"] == pytest.approx(0.4 + 0.3 + 0.1 + 0.0)


def test_zero_handling_and_identity() -> None:
    d = np.array([[0.6, 0.4, 0.0]])
    same = per_instance(d, d)
    for k in ("chebyshev", "clark", "canberra", "kl"):
        assert same[k][0] == pytest.approx(0.0, abs=1e-12)  # 0/0 terms of the empty label count 0
    assert same["cosine"][0] == pytest.approx(1.0) and same["intersection"][0] == pytest.approx(1.0)
    # a predicted zero where the truth has mass is read as EPS: finite, huge
    kl = per_instance(d, np.array([[1.0, 0.0, 0.0]]))["kl"][0]
    assert kl == pytest.approx(0.6 * math.log(0.6) + 0.4 * math.log(0.4 / EPS))


def test_means_over_instances() -> None:
    d = np.stack([D, D[::-1]])
    p = np.stack([P, D[::-1]])
    out = ldl_measures(d, p)
    assert out["chebyshev"] == pytest.approx(0.05) and out["intersection"] == pytest.approx(0.9)
    assert out["spearman"] == pytest.approx((spearmanr(D, P)[0] + 1.0) / 2)


def test_rank_correlations_equal_scipy_row_by_row() -> None:
    rng = np.random.default_rng(0)
    d = rng.dirichlet(np.ones(7), size=40)
    p = rng.dirichlet(np.ones(7), size=40)
    p[:5] = np.round(p[:5], 1)  # ties
    d[5:8] = np.round(d[5:8], 1)
    rho, tau = spearman_rows(d, p), kendall_rows(d, p)
    for i in range(40):
        assert rho[i] == pytest.approx(spearmanr(d[i], p[i])[0], abs=1e-12)
        assert tau[i] == pytest.approx(kendalltau(d[i], p[i])[0], abs=1e-12)  # tau-b
    assert spearman_rows(D, D)[0] == pytest.approx(1.0) and kendall_rows(D, D[::-1])[0] == pytest.approx(-1.0)
    # a constant row has no correlation and is left out of the mean
    flat = np.stack([np.full(4, 0.25), D])
    assert math.isnan(spearman_rows(flat, np.stack([P, P]))[0])
    assert ldl_measures(flat, np.stack([P, P]))["kendall"] == pytest.approx(kendalltau(D, P)[0])

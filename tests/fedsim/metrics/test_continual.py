"""Accuracy-matrix and curve metrics against hand-computed values, edge cases and validation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedsim.errors import ConfigError
from fedsim.metrics import continual as cm

# R[i, j] = performance on task j after training task i. Task 0 improves after task 1 (0.8 -> 0.9),
# so max-forgetting and final forgetting differ on it.
R = np.array([
    [0.8, 0.1, 0.2],
    [0.9, 0.7, 0.3],
    [0.5, 0.6, 0.9],
])
B = np.array([0.1, 0.1, 0.25])  # random-init performance per task


def test_average_performance_is_final_row_mean():
    assert cm.average_performance(R) == pytest.approx((0.5 + 0.6 + 0.9) / 3)


def test_average_own_performance_is_diagonal_mean():
    assert cm.average_own_performance(R) == pytest.approx((0.8 + 0.7 + 0.9) / 3)


def test_running_average_over_seen_tasks():
    np.testing.assert_allclose(cm.running_average_performance(R), [0.8, (0.9 + 0.7) / 2, 2.0 / 3])


def test_forgetting_final_and_max():
    np.testing.assert_allclose(cm.forgetting_per_task(R, "final"), [0.8 - 0.5, 0.7 - 0.6])
    np.testing.assert_allclose(cm.forgetting_per_task(R, "max"), [0.9 - 0.5, 0.7 - 0.6])
    assert cm.forgetting(R) == pytest.approx(0.2)
    assert cm.forgetting(R, kind="max") == pytest.approx(0.25)
    # Continual World's code: the same sum over all T tasks (last one contributes 0)
    assert cm.forgetting(R, include_last=True) == pytest.approx(0.4 / 3)


def test_bwt_is_minus_forgetting():
    assert cm.backward_transfer(R) == pytest.approx(((0.5 - 0.8) + (0.6 - 0.7)) / 2)
    assert cm.backward_transfer(R) == pytest.approx(-cm.forgetting(R))


def test_lopez_paz_forward_transfer():
    np.testing.assert_allclose(cm.forward_transfer_per_task(R, B), [0.1 - 0.1, 0.3 - 0.25])
    assert cm.forward_transfer(R, B) == pytest.approx(0.025)


def test_max_forgetting_dominates_final_forgetting():
    rng = np.random.default_rng(0)
    for _ in range(20):
        M = rng.uniform(size=(5, 5))
        assert np.all(cm.forgetting_per_task(M, "max") >= cm.forgetting_per_task(M, "final") - 1e-12)


def test_single_task():
    one = np.array([[0.7]])
    assert cm.average_performance(one) == pytest.approx(0.7)
    np.testing.assert_allclose(cm.running_average_performance(one), [0.7])
    assert cm.forgetting_per_task(one).shape == (0,)
    assert math.isnan(cm.forgetting(one)) and math.isnan(cm.forgetting(one, "max"))
    assert math.isnan(cm.backward_transfer(one))
    assert math.isnan(cm.forward_transfer(one, [0.1]))
    rep = cm.continual_report(one, baseline=[0.1])
    assert rep.as_metrics() == {"cl/num_tasks": 1.0, "cl/avg_perf": 0.7, "cl/avg_own_perf": 0.7}


def test_nan_upper_triangle_is_allowed_where_not_needed():
    M = R.copy()
    M[0, 2] = np.nan  # task 2 never evaluated after task 0: not needed by any metric below
    M[0, 1] = M[1, 2] = np.nan  # superdiagonal missing: FWT impossible, the rest fine
    assert cm.average_performance(M) == pytest.approx(cm.average_performance(R))
    assert cm.forgetting(M) == pytest.approx(cm.forgetting(R))
    with pytest.raises(ConfigError, match=r"R\[0, 1\] is NaN"):
        cm.forward_transfer(M, B)
    rep = cm.continual_report(M)
    assert "cl/fwt" not in rep.as_metrics() and rep.as_metrics()["cl/bwt"] == pytest.approx(-0.2)


def test_report_needs_only_diagonal_and_final_row():
    M = np.full((3, 3), np.nan)
    M[np.arange(3), np.arange(3)] = np.diag(R)
    M[2] = R[2]  # CompoNet-style data: own-training performance + a final evaluation on all tasks
    rep = cm.continual_report(M)
    assert rep.forgetting == pytest.approx(0.2) and rep.avg_perf == pytest.approx(2 / 3)
    assert rep.max_forgetting == pytest.approx(0.2)  # R[1, 0] unknown: the max is over known entries
    assert np.isnan(rep.running_avg_perf[1]) and rep.running_avg_perf[2] == pytest.approx(2 / 3)
    m = rep.as_metrics(per_task=True)
    assert "cl/after/1/avg_perf" not in m and m["cl/after/0/avg_perf"] == pytest.approx(0.8)
    with pytest.raises(ConfigError, match="lower triangle"):
        cm.running_average_performance(M)


def test_nan_in_needed_entry_is_a_one_line_error():
    M = R.copy()
    M[2, 1] = np.nan
    with pytest.raises(ConfigError, match=r"R\[2, 1\] is NaN") as e:
        cm.average_performance(M)
    assert "\n" not in str(e.value)
    M = R.copy()
    M[1, 1] = np.nan
    with pytest.raises(ConfigError, match=r"R\[1, 1\]"):
        cm.forgetting(M)
    M = R.copy()
    M[1, 0] = np.nan  # max-forgetting skips NaN between own training and the end
    assert cm.forgetting(M, "max") == pytest.approx(((0.8 - 0.5) + 0.1) / 2)


@pytest.mark.parametrize("bad", [np.zeros((2, 3)), np.zeros(3), np.zeros((0, 0)), [["a"]],
                                 np.array([[1.0, np.inf], [0.0, 1.0]])])
def test_bad_matrix_shapes(bad):
    with pytest.raises(ConfigError):
        cm.average_performance(bad)


def test_bad_baseline_and_kind():
    with pytest.raises(ConfigError, match="baseline"):
        cm.forward_transfer(R, [0.1, 0.2])
    with pytest.raises(ConfigError, match="forgetting kind"):
        cm.forgetting(R, kind="worst")


# --------------------------------------------------------------------------- curves


def test_curve_auc_trapezoid_and_mean():
    assert cm.curve_auc([0, 1, 1]) == pytest.approx(0.75)  # 0.5*(0+1)/2 + 0.5*(1+1)/2
    assert cm.curve_auc([0, 0, 1]) == pytest.approx(0.25)
    assert cm.curve_auc([0, 1, 1], method="mean") == pytest.approx(2 / 3)
    assert cm.curve_auc([0.4]) == pytest.approx(0.4)


def test_curve_auc_holds_end_values_over_unit_interval():
    assert cm.curve_auc([1.0, 1.0], steps=[0.5, 1.0]) == pytest.approx(1.0)
    assert cm.curve_auc([0.0, 1.0], steps=[0.0, 0.5]) == pytest.approx(0.25 + 0.5)
    assert cm.curve_auc([0.2, 0.2], steps=[0.3, 0.6]) == pytest.approx(0.2)


def test_normalized_forward_transfer_hand_curves():
    up, ref = [0, 1, 1], [0, 0, 1]
    ft = cm.normalized_forward_transfer_per_task([up, [0, 0, 0], ref], [ref, [0, 1, 1], [1, 1, 1]])
    np.testing.assert_allclose(ft[:2], [(0.75 - 0.25) / 0.75, (0.0 - 0.75) / 0.25])
    assert math.isnan(ft[2])  # perfect reference: undefined
    assert cm.normalized_forward_transfer([up, [0, 0, 0], ref], [ref, [0, 1, 1], [1, 1, 1]]) == \
        pytest.approx((2 / 3 - 3) / 2)
    # CompoNet drops task 0 from the mean
    assert cm.normalized_forward_transfer([up, up], [up, ref], skip_first=True) == pytest.approx(2 / 3)
    # Continual World's AUC: mean of points
    assert cm.normalized_forward_transfer([up], [ref], method="mean") == pytest.approx((2 / 3 - 1 / 3) / (2 / 3))


def test_same_curve_has_zero_transfer():
    c = [0.1, 0.5, 0.9, 0.95]
    assert cm.normalized_forward_transfer([c], [c]) == pytest.approx(0.0)


def _componet_ft(x, y_method, y_base):
    """CompoNet's formula (areas where the method is above / below the baseline), common x from 0."""
    def trap(y, xx):
        return float(np.sum(np.diff(xx) * (y[1:] + y[:-1]) / 2)) if len(xx) > 1 else 0.0
    up, down = y_method > y_base, y_method < y_base
    area_up = trap(y_method[up], x[up]) - trap(y_base[up], x[up])
    area_down = trap(y_base[down], x[down]) - trap(y_method[down], x[down])
    return (area_up - area_down) / (x.max() - trap(y_base, x))


def test_agrees_with_componet_formula_when_curves_do_not_cross():
    x = np.linspace(0, 1, 11)
    base = 0.2 + 0.5 * x**2
    for method in (base + 0.1 + 0.2 * np.sin(np.pi * x), 0.5 * base):  # strictly above / strictly below
        ref = _componet_ft(x, method, base)
        assert cm.normalized_forward_transfer([method], [base], steps=[x], ref_steps=[x]) == pytest.approx(ref)
    # the default equally spaced steps on [0, 1] are the same grid
    assert cm.normalized_forward_transfer([base + 0.1], [base]) == pytest.approx(_componet_ft(x, base + 0.1, base))


def test_touching_curves_use_the_exact_difference_not_componets_masked_areas():
    x = np.linspace(0, 1, 11)
    base = 0.5 * x**2
    method = 0.5 * base  # equal at x = 0: CompoNet's mask drops the first segment
    exact = float(np.sum(np.diff(x) * ((method - base)[1:] + (method - base)[:-1]) / 2)) / (1 - cm.curve_auc(base))
    ours = cm.normalized_forward_transfer([method], [base])
    assert ours == pytest.approx(exact)
    assert abs(ours - _componet_ft(x, method, base)) > 1e-5


def test_curve_validation():
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        cm.curve_auc([0.0, 21.3])
    with pytest.raises(ConfigError, match="increase strictly"):
        cm.curve_auc([0.1, 0.2], steps=[0.5, 0.5])
    with pytest.raises(ConfigError, match="takes no steps"):
        cm.curve_auc([0.1, 0.2], steps=[0.0, 1.0], method="mean")
    with pytest.raises(ConfigError, match="reference curves"):
        cm.normalized_forward_transfer([[0.1]], [[0.1], [0.2]])
    with pytest.raises(ConfigError, match="both curves and ref_curves"):
        cm.continual_report(R, curves=[[0.1]] * 3)


# --------------------------------------------------------------------------- report


def test_report_as_metrics_names_and_values():
    up, ref = [0, 1, 1], [0, 0, 1]
    rep = cm.continual_report(R, baseline=B, curves=[up, up, ref], ref_curves=[ref, ref, ref])
    m = rep.as_metrics()
    assert set(m) == {"cl/num_tasks", "cl/avg_perf", "cl/avg_own_perf", "cl/forgetting", "cl/max_forgetting",
                      "cl/bwt", "cl/fwt", "cl/normalized_ft"}
    assert m["cl/avg_perf"] == pytest.approx(2 / 3)
    assert m["cl/forgetting"] == pytest.approx(0.2)
    assert m["cl/max_forgetting"] == pytest.approx(0.25)
    assert m["cl/bwt"] == pytest.approx(-0.2)
    assert m["cl/fwt"] == pytest.approx(0.025)
    assert m["cl/normalized_ft"] == pytest.approx((2 / 3 + 2 / 3 + 0) / 3)
    assert all(isinstance(v, float) for v in m.values())
    rep_skip = cm.continual_report(R, curves=[up, up, ref], ref_curves=[ref, ref, ref], skip_first_ft=True)
    assert rep_skip.normalized_ft == pytest.approx(1 / 3)


def test_report_per_task_keys_and_prefix():
    m = cm.continual_report(R, baseline=B).as_metrics("run/cl", per_task=True)
    assert m["run/cl/after/1/avg_perf"] == pytest.approx(0.8)
    assert m["run/cl/task/0/max_forgetting"] == pytest.approx(0.4)
    assert m["run/cl/task/2/fwt"] == pytest.approx(0.05)
    assert "run/cl/task/0/fwt" not in m and "run/cl/task/2/forgetting" not in m

"""spam_select: χ² statistic calibration, BH / adaptive FDR control, the group-lasso closed form,
exact-recovery limits, rates, seeded runs and params."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize, stats

from central.spam_select import baselines as B
from central.spam_select import selectors as S
from central.spam_select.run import SpamSelectParams, check, crossing, plan, select
from central.spam_select.sequence import (Scenario, chi2_pvalue, chi2_stat, dyadic_grid, flat_width, make_theta,
                                          separation_rate, simulate, sobolev_energy, stat_threshold)
from fedsim.errors import ConfigError


def null_energies(d: int, reps: int, K: int, levels: list[int], seed: int, eps: float = 0.1) -> S.Energies:
    return simulate(np.zeros((d, K)), eps, reps, levels, np.random.default_rng(seed))


def sparse_energies(scn: Scenario, c: float, reps: int, levels: list[int], seed: int) -> tuple[S.Energies, np.ndarray]:
    rng = np.random.default_rng(seed)
    theta = make_theta(c * separation_rate(scn, math.log(scn.d)), scn, rng)
    return simulate(theta, scn.eps, reps, levels, rng), theta


# -- the statistic ---------------------------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 3, 16])
def test_chi2_statistic_is_centred_and_scaled_under_the_null(m) -> None:
    en = null_energies(d=2000, reps=25, K=16, levels=[1, 3, 16], seed=m)  # 50k null variables
    T = chi2_stat(S.at_level(en, m), m, 0.1).ravel()
    se = 1 / math.sqrt(T.size)
    assert abs(T.mean()) < 4 * se  # centring at m - 1 would shift the mean by 1/√(2m) ≥ 0.18
    assert abs(T.var() - 1) < 0.05  # scaling by √m instead of √(2m) would double the variance
    p = chi2_pvalue(S.at_level(en, m), m, 0.1).ravel()
    assert stats.kstest(p, "uniform").pvalue > 1e-3
    # the exact moments of the formula, independently of any simulation
    mean, var = stats.chi2.stats(m, moments="mv")
    assert abs((mean - m) / math.sqrt(2 * m)) < 1e-12 and abs(var / (2 * m) - 1) < 1e-12


def test_threshold_is_the_exact_quantile_below_laurent_massart_and_tends_to_the_gaussian_scale() -> None:
    alpha = 400.0 ** -1.5
    x = math.log(1 / alpha)
    for m in [1, 4, 16, 64]:
        tau = float(stat_threshold(m, alpha))
        assert math.isclose(stats.chi2.sf(m + tau * math.sqrt(2 * m), m), alpha, rel_tol=1e-8)
        assert tau <= math.sqrt(2 * x) + math.sqrt(2) * x / math.sqrt(m)
    assert abs(float(stat_threshold(10**7, alpha)) - stats.norm.isf(alpha)) < 0.02
    assert float(stat_threshold(1, alpha)) > 2 * math.sqrt(2 * x)  # small m: far above √(2 log d)


# -- FDR control -----------------------------------------------------------------------------------

def test_bh_fdr_equals_q_under_the_global_null_and_wrong_pvalues_fail() -> None:
    q, m, d, reps = 0.1, 2, 100, 4000
    en = null_energies(d, reps, K=4, levels=[1, 2, 4], seed=1)
    se = math.sqrt(q * (1 - q) / reps)
    fdr = S.selection_metrics(S.bh_fixed(en, m, 0.1, q), 0).fdr  # = P(any rejection) under the global null
    assert abs(fdr - q) < 4 * se  # Simes: exactly q for independent uniform p-values
    fdr_adaptive = S.selection_metrics(S.bh_adaptive(en, [1, 2, 4], 0.1, q), 0).fdr
    assert q / 3 - 4 * se < fdr_adaptive < q + 4 * se
    # a normal approximation of the χ²_m tail is anti-conservative: such a selector must fail here
    wrong = stats.norm.sf(chi2_stat(S.at_level(en, m), m, 0.1))
    assert S.selection_metrics(S.benjamini_hochberg(wrong, q), 0).fdr > q + 10 * se
    # the support-recovery threshold keeps the family-wise error below d^{-δ}
    fwer = S.selection_metrics(S.sr_adaptive(en, [1, 2, 4], 0.1, d, 0.5), 0).fdr
    assert fwer < d**-0.5 + 4 * math.sqrt(d**-0.5 / reps)


def test_bh_fdr_equals_pi0_q_under_a_sparse_alternative_and_bonferroni_does_not() -> None:
    # the step-up: p(1) = 0.03 > q/4 stops a step-down procedure, but p(3) = 0.06 <= 3q/4
    np.testing.assert_array_equal(S.benjamini_hochberg(np.array([0.5, 0.04, 0.03, 0.06]), 0.1),
                                  [False, True, True, True])
    scn, q, reps = Scenario(n=1000, d=100, s=30, beta=1.0, K=16), 0.1, 6000
    grid = dyadic_grid(16)
    en, _ = sparse_energies(scn, 0.7, reps, grid, seed=2)
    masks = {"bh": S.bh_fixed(en, 8, scn.eps, q), "bh_adaptive": S.bh_adaptive(en, grid, scn.eps, q),
             "bonferroni": chi2_pvalue(S.at_level(en, 8), 8, scn.eps) <= q / scn.d}
    met = {k: S.selection_metrics(v, scn.s) for k, v in masks.items()}
    target = q * (scn.d - scn.s) / scn.d  # BH with independent continuous p-values: FDR = π0 q exactly
    assert 0.5 < met["bh"].fnr < 0.99  # a regime where the step-up matters (a step-down BH lands ~5 se low)
    assert abs(met["bh"].fdr - target) < 4 * met["bh"].fdr_se
    assert met["bh_adaptive"].fdr < target + 4 * met["bh_adaptive"].fdr_se
    # without the step-up (Bonferroni) the FDR is far below π0 q: the equality check above can fail
    assert met["bonferroni"].fdr < target - 4 * met["bh"].fdr_se


def test_adaptive_pvalue_is_calibrated_under_the_null_and_the_raw_min_p_is_not() -> None:
    grid = dyadic_grid(16)
    en = null_energies(d=2000, reps=50, K=16, levels=grid, seed=3)  # 100k null variables
    pg = S.grid_pvalues(en, grid, 0.1)
    p_adaptive = S.adaptive_pvalue(pg).ravel()
    raw = pg.min(axis=-1).ravel()
    for alpha in [0.005, 0.02, 0.1]:
        se = math.sqrt(alpha / p_adaptive.size)
        rate = float(np.mean(p_adaptive <= alpha))
        assert alpha / len(grid) < rate < alpha + 4 * se  # valid, and not uselessly conservative
        assert float(np.mean(raw <= alpha)) > alpha + 10 * se  # min-p without the correction over-rejects


# -- group lasso -----------------------------------------------------------------------------------

def test_group_soft_threshold_is_the_group_lasso_solution() -> None:
    rng = np.random.default_rng(4)
    y, lam = rng.normal(size=(3, 2)) * np.array([[3.0], [0.4], [1.5]]), 1.0
    closed = B.group_soft_threshold(y, lam)
    assert np.all(closed[1] == 0) and np.all(closed[[0, 2]] != 0)
    # KKT: y_j − θ_j = λ θ_j/‖θ_j‖ on the selected groups, ‖y_j‖ ≤ λ on the others
    for j in range(3):
        if np.any(closed[j]):
            np.testing.assert_allclose(y[j] - closed[j], lam * closed[j] / np.linalg.norm(closed[j]), atol=1e-12)
        else:
            assert np.linalg.norm(y[j]) <= lam
    # a generic solver on the epigraph form: min ½‖y − θ‖² + λ Σ t_j  s.t.  t_j ≥ ‖θ_j‖
    def obj(z):
        return 0.5 * ((y.ravel() - z[:6]) ** 2).sum() + lam * z[6:].sum()

    cons = [{"type": "ineq", "fun": (lambda z, j=j: z[6 + j] ** 2 - z[2 * j] ** 2 - z[2 * j + 1] ** 2)}
            for j in range(3)]
    z0 = np.concatenate([y.ravel(), np.linalg.norm(y, axis=1) + 0.1])
    res = optimize.minimize(obj, z0, method="SLSQP", constraints=cons, bounds=[(None, None)] * 6 + [(0, None)] * 3,
                            options={"ftol": 1e-12, "maxiter": 500})
    assert res.success
    np.testing.assert_allclose(res.x[:6].reshape(3, 2), closed, atol=1e-4)
    assert B.group_lasso_objective(closed, y, lam) <= res.fun + 1e-6  # SLSQP may violate constraints by ~1e-8


def test_glasso_selection_is_the_support_of_the_solution_and_the_fast_risk_is_exact() -> None:
    scn = Scenario(n=500, d=40, s=4, beta=1.0, K=8)
    rng = np.random.default_rng(5)
    theta = make_theta(0.2, scn, rng)
    noise = rng.standard_normal((30, scn.d, scn.K))
    y = theta + scn.eps * noise
    en = simulate(theta, scn.eps, 30, [4, 8], np.random.default_rng(0))
    # energies from the same data, computed by hand
    en.energy = np.cumsum(y**2, axis=-1)[..., [3, 7]]
    en.cross = np.cumsum(y * theta, axis=-1)[..., [3, 7]]
    lam = B.universal_lambda(4, scn.eps, scn.d)
    fit = B.group_soft_threshold(y[..., :4], lam)
    np.testing.assert_array_equal(B.glasso_select(en, 4, lam), np.any(fit != 0, axis=-1))
    lams = scn.eps * np.array([0.3, 2.0, 4.0, 9.0])
    direct = [float(((B.group_soft_threshold(y[..., :4], lm) - theta[:, :4]) ** 2).sum(axis=(1, 2)).mean()
                    + (theta[:, 4:] ** 2).sum()) for lm in lams]
    np.testing.assert_allclose(B.estimation_risk(en, 4, lams, (theta**2).sum(1)), direct, rtol=1e-10)
    tune = B.tune_for_risk(en, [4, 8], scn.eps, scn.d, theta, 4)
    assert tune.risk <= tune.universal_risk + 1e-12


# -- signals, rates, recovery ----------------------------------------------------------------------

def test_flat_signal_has_the_norm_and_stays_in_the_sobolev_ball() -> None:
    scn = Scenario(n=1000, d=10, s=3, beta=1.0, K=64)
    for rho in [0.05, 0.2, 0.6]:
        theta = make_theta(rho, scn, np.random.default_rng(0))
        np.testing.assert_allclose(np.linalg.norm(theta[:3], axis=1), rho)
        assert np.all(sobolev_energy(theta, 1.0) <= 1.0 + 1e-9) and np.all(theta[3:] == 0)
        width = flat_width(rho, 1.0, 1.0, 64)
        k = np.arange(1, width + 2)
        assert width == 64 or rho**2 / (width + 1) * (k**2.0).sum() > 1.0  # one wider would leave the ball
    rho = separation_rate(scn, math.log(400))
    lhs, rhs = rho**2 / scn.eps**2, 2 * math.sqrt(flat_width(rho, 1.0, 1.0, 64) * math.log(400)) + 2 * math.log(400)
    assert lhs == pytest.approx(rhs, rel=0.05)  # M(ρ) is a step function: equality up to one step
    assert separation_rate(Scenario(4000, 10, 3, 1.0), math.log(400)) < rho  # more data, smaller rate


def test_exact_recovery_tends_to_one_at_strong_signal_and_zero_at_weak() -> None:
    scn = Scenario(n=1000, d=200, s=5, beta=1.0, K=32)
    pl, p = plan(scn), SpamSelectParams(delta=0.5)
    for c, lo, hi in [(0.3, 0.0, 0.05), (4.0, 0.9, 1.0)]:
        en, theta = sparse_energies(scn, c, 150, pl.levels, seed=int(10 * c))
        for name in ["sr_oracle", "sr_adaptive", "glasso"]:
            exact = S.selection_metrics(select(name, en, pl, p, theta)[0], scn.s).exact
            assert lo <= exact <= hi, (name, c, exact)


def test_crossing_interpolates_and_reports_never_as_nan() -> None:
    x = np.array([1.0, 2.0, 4.0])
    assert crossing(x, np.array([0.0, 0.25, 0.75]), 0.5, True) == pytest.approx(2 * math.sqrt(2))
    assert math.isnan(crossing(x, np.array([0.0, 0.1, 0.2]), 0.5, True))
    assert crossing(x, np.array([0.9, 0.4, 0.1]), 0.5, False) == pytest.approx(2 ** 0.8)


# -- the registered method -------------------------------------------------------------------------

def same(a: dict[str, float], b: dict[str, float]) -> bool:
    """Equal metrics, nan (a transition never reached) equal to nan."""
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


TINY = ("method: spam_select\ndescription: tiny\nseed: 0\nparams:\n  scenarios: [[500, 50, 3, 1.0]]\n"
        "  signals: [0.5, 3.0]\n  reps: 20\n  K: 16\n  ref_signal: 3.0\n")


def test_same_seed_same_metrics_through_run_central(tmp_path) -> None:
    from fedsim.central_runner import run_central
    from fedsim import config as C

    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)

    def run(seed: int):
        cfg = C.load_central_config(str(path), seed=seed)
        cfg.tracking.enabled = False
        return run_central(cfg)

    a, b, c = run(0), run(0), run(1)
    assert same(a.metrics, b.metrics) and not same(a.metrics, c.metrics)
    assert len(a.tables["curves"]) == 7 * 2 and len(a.tables["transitions"]) == 7
    assert a.metrics["headline/exact_at_ref"] == a.metrics["exact_at_ref/sr_oracle"] >= 0.8
    names = sorted(a.metrics)  # no metric name is a path prefix of another (MLflow's file store needs that)
    assert not any(b.startswith(x + "/") for x in names for b in names)
    assert a.metrics["risk_at_ref/glasso_risk"] > a.metrics["risk_at_ref/sr_oracle"]


@pytest.mark.parametrize("changes, message", [
    ({"scenarios": []}, "scenarios"),
    ({"scenarios": [[1000, 400, 10]]}, r"\[n, d, s, beta\]"),
    ({"scenarios": [[1000, 400, 400, 1.0]]}, "s < d"),
    ({"scenarios": [[1000.5, 400, 10, 1.0]]}, "integers"),
    ({"scenarios": [[1000, 400, 10, 0.0]]}, "beta"),
    ({"selectors": ["lasso"]}, "selectors"),
    ({"selectors": ["bh_oracle", "bh_oracle"]}, "selectors"),
    ({"signals": [0.0, 1.0]}, "signals"),
    ({"reps": 1}, "reps"),
    ({"K": 1}, "params.K"),
    ({"q": 1.0}, "params.q"),
    ({"delta": -0.1}, "delta"),
    ({"shape": "bump"}, "shape"),
    ({"chunk": 10**6}, "chunk"),
])
def test_bad_params_raise_one_line_config_errors(changes, message) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        check(SpamSelectParams(**changes))
    assert "\n" not in str(err.value)


def test_bad_params_stop_run_central_before_anything_runs(tmp_path) -> None:
    from fedsim.central_runner import run_central
    from fedsim import config as C

    path = tmp_path / "bad.yaml"
    path.write_text(TINY.replace("reps: 20", "reps: 20\n  selectors: [oracle]"))
    cfg = C.load_central_config(str(path))
    cfg.tracking.enabled = False
    with pytest.raises(ConfigError, match="params.selectors"):
        run_central(cfg)

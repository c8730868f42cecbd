"""spam_select: χ² statistic calibration, BH / adaptive FDR control, the group-lasso closed form,
exact-recovery limits, rates, seeded runs and params."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize, stats

from central.spam_select import baselines as B
from central.spam_select import selectors as S
from central.spam_select import sequence as Q
from central.spam_select.run import SpamSelectParams, check, crossing, plan, select
from central.spam_select.sequence import (Scenario, chi2_bound_rate, chi2_pvalue, chi2_stat, dyadic_grid, flat_width,
                                          make_theta, minimax_rate, multiple_testing_rate, simulate, sobolev_energy,
                                          stat_threshold, support_recovery_rate)
from fedsim.errors import ConfigError


def null_energies(d: int, reps: int, K: int, levels: list[int], seed: int, eps: float = 0.1) -> S.Energies:
    return simulate(np.zeros((d, K)), eps, reps, levels, np.random.default_rng(seed))


def sparse_energies(scn: Scenario, c: float, reps: int, levels: list[int], seed: int) -> tuple[S.Energies, np.ndarray]:
    rng = np.random.default_rng(seed)
    theta = make_theta(c * support_recovery_rate(scn), scn, rng)
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
    c = 0.7 * chi2_bound_rate(scn, math.log(scn.d)) / support_recovery_rate(scn)  # raw ‖θ_j‖ = 0.7 × the χ² bound
    en, _ = sparse_energies(scn, c, reps, grid, seed=2)
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
    rho = chi2_bound_rate(scn, math.log(400))  # the χ² bound (sets the oracle's truncation only)
    lhs, rhs = rho**2 / scn.eps**2, 2 * math.sqrt(flat_width(rho, 1.0, 1.0, 64) * math.log(400)) + 2 * math.log(400)
    assert lhs == pytest.approx(rhs, rel=0.05)  # M(ρ) is a step function: equality up to one step
    assert chi2_bound_rate(Scenario(4000, 10, 3, 1.0), math.log(400)) < rho  # more data, smaller rate


# -- the signal unit: the closed-form minimax rate -------------------------------------------------

def closed_form(n: float, d: float, beta: float, sigma: float = 1.0, L: float = 1.0, x: float | None = None) -> float:
    """ρ*² = L^{2/(4β+1)} (ε²√x)^{4β/(4β+1)} + ε² x, ε² = σ²/n, x = log d: written out here, apart from the code."""
    x = math.log(d) if x is None else x
    e2 = sigma**2 / n
    return math.sqrt(L ** (2 / (4 * beta + 1)) * (e2 * math.sqrt(x)) ** (4 * beta / (4 * beta + 1)) + e2 * x)


@pytest.mark.parametrize("n, d, s, beta, sigma, L", [(1000, 400, 10, 1.0, 1.0, 1.0), (16000, 3200, 40, 2.0, 1.0, 1.0),
                                                     (250, 50, 3, 0.5, 2.0, 3.0)])
def test_the_unit_is_the_closed_form_minimax_rate(n, d, s, beta, sigma, L) -> None:
    scn = Scenario(n, d, s, beta, sigma, L, K=64)
    assert support_recovery_rate(scn) == pytest.approx(closed_form(n, d, beta, sigma, L), rel=1e-12)
    assert multiple_testing_rate(scn) == pytest.approx(closed_form(n, d, beta, sigma, L, math.log(d / s)), rel=1e-12)
    pl = plan(scn)
    assert pl.rho_sr == support_recovery_rate(scn) and pl.rho_mt == multiple_testing_rate(scn)
    log_g = math.log(len(dyadic_grid(64)))
    assert pl.rho_sr_adaptive == pytest.approx(closed_form(n, d, beta, sigma, L, math.log(d) + log_g), rel=1e-12)


@pytest.mark.parametrize("beta", [0.5, 1.0, 2.0])
def test_the_unit_scales_in_n_d_s_beta_like_the_formula(beta) -> None:
    def rate(n, d=400, s=10, b=beta):
        return support_recovery_rate(Scenario(n, d, s, b))

    def nonparametric(n, d=400):  # ρ*² minus the parametric ε² log d term
        return rate(n, d) ** 2 - math.log(d) / n

    exponent = 4 * beta / (4 * beta + 1)
    assert nonparametric(32_000) / nonparametric(1000) == pytest.approx(32.0 ** -exponent, rel=1e-9)
    assert nonparametric(1000, d=3200) / nonparametric(1000) == pytest.approx(
        (math.log(3200) / math.log(400)) ** (exponent / 2), rel=1e-9)
    # for n -> ∞ the nonparametric term dominates: ρ* ∝ n^{-2β/(4β+1)}
    slope = math.log(rate(1e41) / rate(1e40)) / math.log(10)
    assert slope == pytest.approx(-2 * beta / (4 * beta + 1), abs=2e-3)
    # s: support recovery reads log d only; multiple testing reads log(d/s), so larger s, smaller unit
    assert rate(1000, s=40) == rate(1000, s=10)
    assert multiple_testing_rate(Scenario(1000, 400, 40, beta)) < multiple_testing_rate(Scenario(1000, 400, 10, beta))
    # smoother components: a smaller unit (at ε² √log d < 1)
    assert support_recovery_rate(Scenario(1000, 400, 10, 2 * beta)) < rate(1000)


def test_the_unit_does_not_read_the_selectors_threshold_or_the_signal_width(monkeypatch) -> None:
    scn = Scenario(1000, 400, 10, 1.0)
    unit, bound = support_recovery_rate(scn), chi2_bound_rate(scn, math.log(400))
    assert 1.2 < bound / unit < 1.6  # the χ² bound is the same order (1.37 here), but not the unit
    # break the thresholds the selectors use and the width of the simulated signal: the unit stays put
    monkeypatch.setattr(Q, "stat_threshold", lambda m, alpha: 10 * np.ones_like(np.asarray(m, float)))
    monkeypatch.setattr(S, "stat_threshold", lambda m, alpha: 10 * np.ones_like(np.asarray(m, float)))
    monkeypatch.setattr(S, "recovery_alpha", lambda d, delta: 1e-30)
    monkeypatch.setattr(Q, "flat_width", lambda rho, beta, radius, K: K)
    assert support_recovery_rate(scn) == unit and plan(scn).rho_sr == unit
    assert chi2_bound_rate(scn, math.log(400)) != bound  # while the old, solved unit moves: the check can fail


def test_the_threshold_constant_moves_the_transition_not_the_unit(tmp_path) -> None:
    """δ sets the selectors' level d^{-(1+δ)}: a larger δ must raise FNR at the same raw signals."""
    from fedsim.central_runner import run_central
    from fedsim import config as C

    def run(delta: float):
        path = tmp_path / f"delta{delta}.yaml"
        path.write_text(TINY.replace("reps: 20", f"reps: 20\n  delta: {delta}\n  selectors: [sr_oracle]")
                        .replace("signals: [0.5, 3.0]", "signals: [1.4, 1.8, 2.2]"))
        cfg = C.load_central_config(str(path))
        cfg.tracking.enabled = False
        return run_central(cfg)

    low, high = run(0.5), run(3.0)
    assert [r["rho"] for r in low.tables["curves"]] == [r["rho"] for r in high.tables["curves"]]
    assert [r["rho_sr"] for r in low.tables["scenarios"]] == [r["rho_sr"] for r in high.tables["scenarios"]]
    fnr_low, fnr_high = ([r["fnr"] for r in res.tables["curves"]] for res in (low, high))
    assert all(h >= lo for h, lo in zip(fnr_high, fnr_low)) and any(h > lo for h, lo in zip(fnr_high, fnr_low))


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
    assert a.metrics["headline/exact_max"] == a.metrics["exact_max/sr_oracle"]
    assert a.metrics["headline/log_transition_exact"] == pytest.approx(math.log(a.metrics["headline/transition_exact"]))
    assert a.metrics["headline/log_rho_transition_exact"] == pytest.approx(
        math.log(a.metrics["transition_raw/exact/sr_oracle"]))
    unit = a.tables["scenarios"][0]["rho_sr"]
    assert a.metrics["transition_raw/exact/sr_oracle"] == pytest.approx(a.metrics["headline/transition_exact"] * unit)
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


def test_claim_spec_builds_valid_params_and_never_reads_a_transition_that_can_be_nan() -> None:
    from fedsim import reproduce
    from fedsim.central_runner import method_params

    spec = reproduce.load_claim("spam_select")
    for setting in reproduce.settings(spec):
        params = method_params(reproduce.build_config(spec, setting, 0))
        check(params)
        assert len(params.scenarios) == 1 and len(params.selectors) == 1 and max(params.signals) == 5.0
    assert spec.has_protocol and len(spec.seeds) >= 3 and len(spec.claim) >= 5 and spec.controls.positive
    # glasso_risk never reaches P(exact) = 1/2: its transition is nan, unlogged, and would leave a claim unpaired
    for comp in [*spec.claim, *spec.controls.positive]:
        side = {**comp.at, **comp.better}
        if side.get("params.selectors") == ["glasso_risk"]:
            assert all("transition" not in m for m in comp.metrics(spec.metric)), comp.name

"""LoRA-ML, linear setting: objective and gradients vs direct computations, symmetry-invariant recovery
error, identifiability for T = 2 vs T = 3, adaptation, and the registered method end to end."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedsim.central_runner import method_params, run_central
from central.peft_meta import linear as L
from central.peft_meta import run as R
from fedsim import config as C
from fedsim.errors import ConfigError

D, T, K, N = 5, 3, 2, 40


def _problem(seed: int = 0, noise: float = 0.1) -> tuple[L.Truth, list[torch.Tensor], list[torch.Tensor], L.Stats]:
    rng = np.random.default_rng(seed)
    truth = L.make_truth(rng, D, T, K)
    data = [L.sample(rng, truth.targets[t], N, noise) for t in range(T)]
    xs, ys = [x for x, _ in data], [y for _, y in data]
    return truth, xs, ys, L.Stats.of(xs, ys)


def _random(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.tensor(np.random.default_rng(seed).normal(0.0, 0.5, shape), dtype=L.DTYPE)


def _population(targets: torch.Tensor) -> L.Stats:
    """Noise-free population statistics (E xxᵀ = I): L_t(M) = ½‖M − target_t‖²."""
    t, d, _ = targets.shape
    return L.Stats(torch.eye(d, dtype=L.DTYPE).expand(t, d, d).clone(), targets.clone(), (targets ** 2).sum((1, 2)), 1)


# -- objective and gradients ---------------------------------------------------------------------------

def test_objectives_equal_the_direct_sums_over_samples() -> None:
    truth, xs, ys, s = _problem()
    a, u, v = _random((D, D), 1), _random((T, D, K), 2), _random((D, K), 3)
    direct = np.mean([0.5 * float(((ys[t] - (a + u[t] @ u[t].T) @ xs[t]) ** 2).sum()) / N for t in range(T)])
    assert float(L.lora_ml_objective(a, u, s)) == pytest.approx(direct, rel=1e-10)
    one = L.Stats.of([xs[0]], [ys[0]])
    assert float(L.lora_loss(a, u[0], v, one)) == pytest.approx(
        0.5 * float(((ys[0] - (a + u[0] @ v.T) @ xs[0]) ** 2).sum()) / N, rel=1e-10)
    # pooled statistics = the statistics of the concatenated samples
    pooled = L.Stats.of([torch.cat(xs, 1)], [torch.cat(ys, 1)])
    assert torch.allclose(s.pooled().sxx, pooled.sxx) and torch.allclose(s.pooled().syx, pooled.syx)
    assert float(L.task_losses(a, s.pooled())) == pytest.approx(float(L.task_losses(a, pooled)), rel=1e-10)
    # the population excess risk is E_x‖(target − M)x‖² for x ~ N(0, I)
    x = torch.tensor(np.random.default_rng(9).normal(size=(D, 200_000)), dtype=L.DTYPE)
    mc = float(((truth.targets[0] - a) @ x).pow(2).sum(0).mean())
    assert L.excess(a, truth.targets[0]) == pytest.approx(mc, rel=0.02)


def test_autograd_gradients_equal_the_closed_form_ones() -> None:
    _, xs, ys, s = _problem(seed=1)
    a, u, v = _random((D, D), 4), _random((T, D, K), 5), _random((D, K), 6)
    ga, gu = L._grad(lambda p, q: L.lora_ml_objective(p, q, s), a, u)
    res = [(a + u[t] @ u[t].T) @ xs[t] - ys[t] for t in range(T)]
    # authors' outer_gradient / (N T) and inner_gradient_symmetric / N (the latter per task, so / T here)
    assert torch.allclose(ga, sum(r @ x.T for r, x in zip(res, xs)) / (N * T), atol=1e-12)
    for t in range(T):
        closed = (xs[t] @ res[t].T + res[t] @ xs[t].T) @ u[t] / N
        assert torch.allclose(gu[t], closed / T, atol=1e-12)
    # the asymmetric adaptation LoRA (authors' inner_gradient_asymmetric / n)
    one = L.Stats.of([xs[0]], [ys[0]])
    gu1, gv1 = L._grad(lambda p, q: L.lora_loss(a, p, q, one), u[0], v)
    r = (a + u[0] @ v.T) @ xs[0] - ys[0]
    assert torch.allclose(gu1, r @ xs[0].T @ v / N, atol=1e-12)
    assert torch.allclose(gv1, xs[0] @ r.T @ u[0] / N, atol=1e-12)


def test_one_lora_ml_iteration_is_the_authors_update() -> None:
    _, xs, ys, s = _problem(seed=2)
    u0 = _random((T, D, K), 7) * 0.2
    inner, outer = 0.003, 0.03
    got = L.train_lora_ml(s, u0, inner, outer, inner_steps=2, outer_steps=1)
    a, u = torch.zeros(D, D, dtype=L.DTYPE), u0.clone()
    for _ in range(2):  # every U_t with its own task's gradient, all at once
        res = [(a + u[t] @ u[t].T) @ xs[t] - ys[t] for t in range(T)]
        u = torch.stack([u[t] - inner * (xs[t] @ res[t].T + res[t] @ xs[t].T) @ u[t] / N for t in range(T)])
    res = [(a + u[t] @ u[t].T) @ xs[t] - ys[t] for t in range(T)]
    a = a - outer * sum(r @ x.T for r, x in zip(res, xs)) / (N * T)
    assert torch.allclose(got.u, u, atol=1e-12) and torch.allclose(got.a, a, atol=1e-12)


def test_retrain_reaches_pooled_least_squares_and_linear_reptile_its_fixed_point() -> None:
    _, xs, ys, s = _problem(seed=3, noise=0.0)
    x, y = torch.cat(xs, 1), torch.cat(ys, 1)
    ls = torch.linalg.solve(x @ x.T, x @ y.T).T  # argmin ‖Y − A X‖²
    sr = L.train_retrain(s, lr=0.3, steps=400)
    assert torch.allclose(sr.a, ls, atol=1e-8)
    # Reptile's fixed point in the linear case: mean_t (A_t − A) = 0; with equal E xxᵀ it is the same A
    rep = L.train_reptile(_population(L.make_truth(np.random.default_rng(3), D, T, K).targets), 0.1, 5, 1.0, 100)
    mean_target = L.make_truth(np.random.default_rng(3), D, T, K).targets.mean(0)
    assert torch.allclose(rep.a, mean_target, atol=1e-8)


# -- recovery up to symmetry ----------------------------------------------------------------------------

def test_recovery_error_is_zero_exactly_up_to_the_orthogonal_symmetry() -> None:
    truth = L.make_truth(np.random.default_rng(4), D, T, K)
    q = torch.stack([torch.linalg.qr(_random((K, K), 10 + t))[0] for t in range(T)])  # orthogonal Q_t
    assert L.recovery_error(truth.a_star, truth.u_star @ q, truth.a_star, truth.u_star) < 1e-28
    assert L.recovery_error(truth.a_star, -truth.u_star, truth.a_star, truth.u_star) < 1e-28
    # anything else is > 0: a moved base, a moved adapter, a non-orthogonal mixing
    assert L.recovery_error(truth.a_star + 1e-3 * _random((D, D), 20), truth.u_star, truth.a_star, truth.u_star) > 1e-9
    bumped = truth.u_star.clone()
    bumped[1] += 1e-3 * _random((D, K), 21)
    assert L.recovery_error(truth.a_star, bumped, truth.a_star, truth.u_star) > 1e-9
    skew = torch.tensor([[1.0, 0.5], [0.0, 1.0]], dtype=L.DTYPE)
    assert L.recovery_error(truth.a_star, truth.u_star @ skew, truth.a_star, truth.u_star) > 1e-3


def _hyperbolic_solution(truth: L.Truth, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """For T = 2, k = 1: a different exact minimiser, U_1 U_1ᵀ − U_2 U_2ᵀ kept by a hyperbolic rotation."""
    u1, u2 = truth.u_star[0], truth.u_star[1]
    a1 = math.cosh(theta) * u1 + math.sinh(theta) * u2
    a2 = math.sinh(theta) * u1 + math.cosh(theta) * u2
    shift = u1 @ u1.T - a1 @ a1.T
    return truth.a_star + shift, torch.stack([a1, a2])


def test_two_tasks_have_a_continuum_of_exact_minimisers_three_do_not() -> None:
    truth = L.make_truth(np.random.default_rng(5), 4, 3, 1)
    two = _population(truth.targets[:2])
    a, u = _hyperbolic_solution(L.Truth(truth.a_star, truth.u_star[:2]), 0.3)
    assert float(L.lora_ml_objective(a, u, two)) < 1e-20  # exact fit of both tasks ...
    assert L.recovery_error(a, u, truth.a_star, truth.u_star[:2]) > 1e-3  # ... far from the truth
    # the same base cannot fit a third task with a rank-1 PSD adapter: residual of the best rank-1 PSD fit
    resid = truth.targets[2] - a
    w = torch.linalg.eigvalsh(resid)
    assert float((w[:-1] ** 2).sum() + torch.clamp(w[-1], max=0) ** 2) > 1e-3


@pytest.mark.parametrize("tasks, flat", [(2, True), (3, False)])
def test_hessian_at_the_truth_is_flat_only_for_two_tasks(tasks: int, flat: bool) -> None:
    """Local identifiability: with k = 1 (no orthogonal symmetry left but the sign) the noise-free
    objective's Hessian at (A*, {U_t*}) is singular for T = 2 and positive definite for T = 3."""
    d = 4
    truth = L.make_truth(np.random.default_rng(6), d, tasks, 1)
    s = _population(truth.targets)
    theta = torch.cat([truth.a_star.reshape(-1), truth.u_star.reshape(-1)])

    def f(z: torch.Tensor) -> torch.Tensor:
        return L.lora_ml_objective(z[:d * d].view(d, d), z[d * d:].view(tasks, d, 1), s)

    eig = torch.linalg.eigvalsh(torch.autograd.functional.hessian(f, theta))
    assert float(eig.min()) > -1e-10  # a minimum
    assert (float(eig.min()) < 1e-10) is flat


# -- adaptation ----------------------------------------------------------------------------------------------

def test_rank_k_adaptation_reaches_the_floor_from_the_true_base_not_from_the_pooled_one() -> None:
    rng = np.random.default_rng(7)
    truth = L.make_truth(rng, D, T, 1)
    u_new = torch.tensor(rng.normal(size=(D, 1)), dtype=L.DTYPE)
    target = truth.a_star + u_new @ u_new.T
    x, y = L.sample(rng, target, 200, 0.01)
    s = L.Stats.of([x], [y])
    u0, v0 = _random((D, 1), 30) * 0.2, _random((D, 1), 31) * 0.2
    good = L.adapt_lora(truth.a_star, s, u0, v0, lr=0.02, steps=600, target=target)
    pooled = L.adapt_lora(truth.targets.mean(0), s, u0, v0, lr=0.02, steps=600, target=target)
    assert good.curve[0][0] == 0 and good.curve[-1] == (600, good.final_excess)
    assert good.final_excess < 1e-3 < 0.1 < pooled.final_excess  # rank 1 cannot fix a rank-(T+1) residual
    # the adapted base is unchanged (only U Vᵀ was fitted): the difference has rank k
    assert torch.linalg.matrix_rank(good.m - truth.a_star, tol=1e-8) == 1


# -- the registered method -------------------------------------------------------------------------------------

TINY = ["params.d=4", "params.samples=200", "params.outer_steps=100", "params.inner_steps=3",
        "params.retrain_steps=100", "params.reptile_outer_steps=30", "params.ft_steps=120", "params.draws=1",
        "params.inner_lr=0.03", "params.outer_lr=0.3", "params.ft_lr=0.02", "params.n_prime=40",
        "params.n_prime_sweep=[20,80]", "params.recovery_T=[2,3]", "tracking.enabled=false"]


def test_method_end_to_end_is_seeded_and_reports_every_claim() -> None:
    cfg = C.load_central_config("peft_meta_linear", TINY)
    a, b = run_central(cfg), run_central(cfg)
    assert a.metrics == b.metrics
    m = a.metrics
    for key in ("adapt/excess/lora_ml", "adapt/test_over_floor/retrain", "scaling/slope_kd_over_n",
                "recovery/sym_err_T2", "recovery/sym_err_T3", "claims/held_frac", "noise_floor"):
        assert key in m, key
    assert m["noise_floor"] == pytest.approx(4 * 0.01 ** 2)
    assert m["adapt/excess/lora_ml"] < m["adapt/excess/retrain"]
    # the control: fine-tuning from the true base A* ends nearest the floor, and is in the table
    assert 1.0 <= m["adapt/test_over_floor/truth"] < m["adapt/test_over_floor/retrain"]
    truth = next(r for r in a.tables["adaptation"] if r["method"] == "truth (A*)")
    assert truth["test_over_floor"] == pytest.approx(m["adapt/test_over_floor/truth"]) and truth["base_rel_err"] == 0
    assert set(a.tables) == {"adaptation", "scaling", "recovery"}
    assert [r["T"] for r in a.tables["recovery"]] == [2, 3] and a.tables["recovery"][0]["adapter_rank"] == 3
    assert 0.0 <= m["claims/held_frac"] <= 1.0
    curve = a.history.series("curve/test_loss/lora_ml")
    assert curve[0][0] == 0 and curve[-1][0] == 120


@pytest.mark.parametrize("override", ["params.rank=11", "params.methods=[retrain]", "params.methods=[lora_ml,maml]",
                                      "params.recovery_T=[0]", "params.ft_lr=0", "params.n_prime_sweep=[1]"])
def test_bad_params_are_one_line_config_errors(override: str) -> None:
    cfg = C.load_central_config("peft_meta_linear", [override, "tracking.enabled=false"])
    with pytest.raises(ConfigError) as err:
        R.check(method_params(cfg))
    assert "\n" not in str(err.value)


def test_default_experiment_params_pass_the_check() -> None:
    R.check(method_params(C.load_central_config("peft_meta_linear")))

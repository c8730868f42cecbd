"""PNN identifiability: the map, exact/float/symbolic Jacobian ranks, symmetries, known cases, recovery, runner."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from fedsim.central_runner import method_params, run_central
from central.pnn_ident import run as R
from central.pnn_ident.dimension import blocks, expected_dim, kruskal, kruskal_block, upper_bound, verdict
from central.pnn_ident.jacobian import (DEFAULT_PRIME, coefficient_jacobian_rank, exact_rank, float_rank, forward_mode,
                                        jacobian_float, jacobian_mod_p, random_point_float, random_point_mod_p,
                                        rank_mod_p)
from central.pnn_ident.pnn import Arch, ambient_dim, coefficients, expand, forward, forward_mod, monomials, transform
from central.pnn_ident.recover import canonical, canonical_distance, recover
from fedsim import config as C
from fedsim.errors import ConfigError

P = DEFAULT_PRIME


def _random_symmetry(arch: Arch, rng: np.random.Generator, p: int | None = None) -> tuple[list, list]:
    if p is None:
        scales = [rng.uniform(0.5, 2.0, d) * rng.choice([-1.0, 1.0], d) for d in arch.hidden]
    else:
        scales = [rng.integers(2, p, d, dtype=np.int64) for d in arch.hidden]
    return scales, [rng.permutation(d) for d in arch.hidden]


def _scaling_tangents(arch: Arch, theta: np.ndarray) -> np.ndarray:
    """d/dt at t = 1 of scaling each hidden neuron: incoming row (and bias) × t, outgoing column × t^{−r}."""
    vs = []
    for l, d in enumerate(arch.hidden):
        for j in range(d):
            scales = [np.ones(h) for h in arch.hidden]
            eps = 1e-6
            scales[l][j] = 1 + eps
            plus = transform(arch, theta, scales, [np.arange(h) for h in arch.hidden])
            scales[l][j] = 1 - eps
            minus = transform(arch, theta, scales, [np.arange(h) for h in arch.hidden])
            vs.append((plus - minus) / (2 * eps))
    return np.array(vs).T


# -- the map --------------------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [False, True])
def test_network_map_equals_a_direct_expansion(bias) -> None:
    import sympy as sp

    arch = Arch((2, 2, 1), 3, bias)
    rng = np.random.default_rng(0)
    theta = [int(v) for v in rng.integers(-4, 5, arch.n_params)]
    # by hand: f = v1 (w11 x + w12 y + b1)^3 + v2 (w21 x + w22 y + b2)^3 + c
    x, y = sp.symbols("x y")
    if bias:
        w11, w12, w21, w22, b1, b2, v1, v2, c = theta
    else:
        (w11, w12, w21, w22, v1, v2), b1, b2, c = theta, 0, 0, 0
    direct = sp.Poly(sp.expand(v1 * (w11 * x + w12 * y + b1) ** 3 + v2 * (w21 * x + w22 * y + b2) ** 3 + c), x, y)
    ours = expand(arch, theta)[0]
    assert ours == {e: Fraction(int(c_)) for e, c_ in zip(direct.monoms(), direct.coeffs())}
    basis = monomials(2, 3, homogeneous=not bias)
    assert len(basis) == (4 if not bias else 10) == ambient_dim(arch)
    assert coefficients(arch, theta) == [ours.get(e, 0) for e in basis]


@pytest.mark.parametrize("bias", [False, True])
def test_float_modular_and_exact_evaluations_agree_on_a_deep_network(bias) -> None:
    arch = Arch((3, 2, 2, 1), 2, bias)
    rng = np.random.default_rng(1)
    theta = rng.integers(-3, 4, arch.n_params)
    X = rng.integers(-3, 4, (5, 3))
    poly = expand(arch, [int(t) for t in theta])[0]
    exact = [sum(c * np.prod([Fraction(int(xi)) ** e for xi, e in zip(x, ex)]) for ex, c in poly.items()) for x in X]
    assert max(e.denominator for e in exact) == 1
    np.testing.assert_array_equal(forward(arch, theta.astype(float), X.astype(float))[:, 0], np.array(exact, float))
    mod = forward_mod(arch, theta % P, X % P, P)[:, 0]
    assert [int(m) for m in mod] == [int(e) % P for e in exact]


# -- Jacobians and ranks -----------------------------------------------------------------------------

def test_rank_mod_p_is_gaussian_elimination_over_f_p() -> None:
    rng = np.random.default_rng(2)
    M = rng.integers(-50, 50, (7, 3)) @ rng.integers(-50, 50, (3, 6))
    assert rank_mod_p(M % P, P) == np.linalg.matrix_rank(M.astype(float)) == 3
    assert rank_mod_p(np.array([[1, 0], [0, 13]]), 13) == 1  # singular mod 13, not over Q
    assert rank_mod_p(np.eye(4, dtype=np.int64), P) == 4 and rank_mod_p(np.zeros((3, 2), np.int64), P) == 0


@pytest.mark.parametrize("bias", [False, True])
def test_forward_mode_jacobian_matches_autograd_and_finite_differences_mod_p(bias) -> None:
    arch = Arch((3, 3, 2, 2), 3, bias)
    rng = np.random.default_rng(3)
    theta, X = random_point_float(arch, rng, 7)
    J, J_auto = forward_mode(arch, theta, X), jacobian_float(arch, theta, X)
    assert np.abs(J - J_auto).max() <= 1e-10 * np.abs(J_auto).max()
    # mod p: for a parameter that enters linearly (the last one, in the output layer) the exact
    # difference f(θ + e_j) − f(θ) is the Jacobian column
    th, Xp = random_point_mod_p(arch, rng, P, 4)
    Jp = jacobian_mod_p(arch, th, Xp, P)
    j = arch.n_params - 1
    step = th.copy()
    step[j] = (step[j] + 1) % P
    diff = (forward_mod(arch, step, Xp, P) - forward_mod(arch, th, Xp, P)) % P
    np.testing.assert_array_equal(diff.reshape(-1), Jp[:, j])


@pytest.mark.parametrize("bias", [False, True])
def test_jacobian_rank_is_invariant_under_the_symmetry_group(bias) -> None:
    arch = Arch((4, 3, 2, 1), 2, bias)
    rng = np.random.default_rng(4)
    # exact: the same function, the same rank, at every point (not just generically)
    theta, X = random_point_mod_p(arch, rng, P, arch.n_params + 4)
    moved = transform(arch, theta, *_random_symmetry(arch, rng, P), p=P)
    assert not np.array_equal(moved, theta)
    np.testing.assert_array_equal(forward_mod(arch, moved, X, P), forward_mod(arch, theta, X, P))
    r0, r1 = rank_mod_p(jacobian_mod_p(arch, theta, X, P), P), rank_mod_p(jacobian_mod_p(arch, moved, X, P), P)
    assert r0 == r1 == upper_bound(arch) - 1  # (4,3,2,1) with r = 2 is defective by one
    # float: same function, same numerical rank, and the scaling tangents lie in the kernel
    th, Xf = random_point_float(arch, rng, 2 * arch.n_params)
    moved_f = transform(arch, th, *_random_symmetry(arch, rng))
    np.testing.assert_allclose(forward(arch, moved_f, Xf), forward(arch, th, Xf), rtol=1e-10, atol=1e-12)
    from central.pnn_ident.jacobian import numerical_rank

    assert numerical_rank(forward_mode(arch, th, Xf)).rank == numerical_rank(forward_mode(arch, moved_f, Xf)).rank == r0
    T = _scaling_tangents(arch, th)
    assert np.linalg.matrix_rank(T) == sum(arch.hidden)
    assert np.abs(forward_mode(arch, th, Xf) @ T).max() < 1e-6 * np.abs(forward_mode(arch, th, Xf)).max()


@pytest.mark.parametrize("widths,r,bias,rank,kind,defect,block_kinds", [
    ((3, 2, 1), 3, False, 6, "identifiable", 0, ["identifiable"]),
    ((3, 2, 1), 2, False, 5, "defective", 1, ["defective"]),  # a rank-2 ternary quadric: det = 0 is a hypersurface
    ((4, 3, 2, 1), 2, False, 14, "defective", 1, ["identifiable", "defective"]),
    ((4, 3, 2, 1), 3, False, 15, "identifiable", 0, ["identifiable", "identifiable"]),
    ((3, 2, 1), 2, True, 8, "defective", 1, ["defective"]),  # with biases: still one short of 11 − 2
    ((3, 2, 1), 3, True, 9, "identifiable", 0, ["identifiable"]),
    ((2, 4, 2), 2, False, 6, "filling", 0, ["filling"]),     # 12 − 4 = 8 > 6 = 2·C(3, 2)
])
def test_exact_rank_matches_the_expected_dimension_on_known_cases(widths, r, bias, rank, kind, defect,
                                                                  block_kinds) -> None:
    arch = Arch(widths, r, bias)
    ranks = exact_rank(arch, np.random.default_rng(5), P, trials=2)
    v = verdict(arch, max(ranks))
    assert ranks == [rank, rank]
    assert (v.kind, v.defect) == (kind, defect)
    kinds = [verdict(b, max(exact_rank(b, np.random.default_rng(6), P))).kind for b in blocks(arch)]
    assert kinds == block_kinds
    assert v.identifiable == all(k == "identifiable" for k in kinds)  # localisation


def test_dimension_counts() -> None:
    a = Arch((3, 2, 1), 2)
    assert (a.n_params, upper_bound(a), ambient_dim(a), expected_dim(a)) == (8, 6, 6, 6)
    b = Arch((4, 3, 2, 1), 3, bias=True)  # D = 9, inhomogeneous: C(4 + 9, 9) monomials
    assert (b.n_params, upper_bound(b), ambient_dim(b), b.degree) == (15 + 8 + 3, 26 - 5, 715, 9)
    assert [x.widths for x in blocks(b)] == [(4, 3, 2), (3, 2, 1)] and all(x.bias for x in blocks(b))


def test_kruskal_condition_on_known_blocks() -> None:
    assert not kruskal_block(Arch((3, 2, 1), 2)) and kruskal_block(Arch((3, 2, 1), 3))
    for w in range(2, 7):  # binary forms: Sylvester — identifiable iff r >= 2w − 1
        first = next(r for r in range(2, 20) if kruskal_block(Arch((2, w, 1), r), best=False))
        assert first == 2 * w - 1
    assert kruskal(Arch((5, 4, 3, 2), 2)) and not kruskal(Arch((4, 2, 4, 4), 3))


@pytest.mark.parametrize("widths,r,bias", [((3, 2, 1), 2, False), ((3, 2, 1), 3, False), ((2, 2, 2), 2, True),
                                           ((2, 3, 1), 3, False), ((3, 2, 2, 1), 2, False)])
def test_float64_exact_and_symbolic_ranks_agree(widths, r, bias) -> None:
    arch = Arch(widths, r, bias)
    rng = np.random.default_rng(7)
    exact = max(exact_rank(arch, rng, P))
    fr = float_rank(arch, rng)
    assert fr.reliable(3.0) and fr.rank == exact
    theta = [int(v) for v in rng.integers(1, 1000, arch.n_params) * rng.choice([-1, 1], arch.n_params)]
    if arch.L == 2:
        assert coefficient_jacobian_rank(arch, theta) == exact


# -- canonical form and recovery ---------------------------------------------------------------------

@pytest.mark.parametrize("bias", [False, True])
def test_canonicalisation_maps_symmetric_copies_to_one_form(bias) -> None:
    arch = Arch((4, 3, 2, 2), 3, bias)
    rng = np.random.default_rng(8)
    theta = rng.standard_normal(arch.n_params)
    ref = canonical(arch, theta)
    for _ in range(3):
        copy = transform(arch, theta, *_random_symmetry(arch, rng))
        assert np.abs(copy - theta).max() > 0.1
        np.testing.assert_allclose(canonical(arch, copy), ref, rtol=1e-10, atol=1e-12)
    other = theta + 1e-3 * rng.standard_normal(arch.n_params)
    assert canonical_distance(arch, other, theta) > 1e-5


def test_recovery_unique_when_identifiable_and_not_when_defective() -> None:
    good = recover(Arch((3, 2, 1), 3), np.random.default_rng(9), restarts=3, local_restarts=1)
    assert good.n_exact(1e-8) >= 2 and good.n_match(1e-8, 1e-6) == good.n_exact(1e-8)
    bad = recover(Arch((3, 2, 1), 2), np.random.default_rng(9), restarts=2, local_restarts=1)
    assert bad.n_exact(1e-8, "local") == 1  # fits the polynomial exactly ...
    assert min(bad.exact_errors(1e-8)) > 1e-3  # ... with weights that are not a symmetric copy of the truth


# -- the registered method --------------------------------------------------------------------------

TINY = ("method: pnn_ident\ndescription: tiny\nseed: 0\ntracking: {enabled: false}\nparams:\n"
        "  families: []\n  architectures: [3-2-1, 4-3-2-1]\n  degrees: [2, 3]\n  bias: [false]\n"
        "  threshold_families: [2-w-1]\n  threshold_widths: [2, 3]\n  max_degree: 8\n"
        "  recovery: ['3-2-1:3', '3-2-1:2']\n  restarts: 1\n  local_restarts: 1\n")


def test_same_seed_gives_identical_metrics_through_the_runner(tmp_path) -> None:
    path = tmp_path / "pnn.yaml"
    path.write_text(TINY)
    a = run_central(C.load_central_config(str(path)))
    b = run_central(C.load_central_config(str(path)))
    assert a.metrics == b.metrics
    assert a.tables["verdicts"] == b.tables["verdicts"]
    assert a.metrics["claims/held_frac"] == 1.0 and a.metrics["localization/agreement"] == 1.0
    grid = {row["widths"]: row for row in a.tables["verdict_grid"]}
    assert grid["3-2-1"]["r=2"] == "D1" and grid["3-2-1"]["r=3"].startswith("I")
    assert grid["4-3-2-1"]["r=2"].startswith("D1 [I,D1]")
    assert [(t["w"], t["r_jacobian"]) for t in a.tables["thresholds"]] == [(2, 3), (3, 5)]
    assert [r["claim_holds"] for r in a.tables["recovery"]] == [True, True]


@pytest.mark.parametrize("override,message", [
    ("params.degrees=[1,2]", "integers >= 2"),
    ("params.families=[pyramids]", "unknown"),
    ("params.architectures=[3-x-1]", "bad architecture"),
    ("params.architectures=[3-1]", "bad architecture"),
    ("params.recovery=[3-2-1]", "bad recovery case"),
    ("params.prime=1000000", "prime"),
    ("params.threshold_families=[2-2-2]", "free width"),
    ("params.max_params=10", "max_params"),
    ("params.bias=[]", "params.bias"),
    ("params.local_scale=0", "local_scale"),
])
def test_bad_params_are_one_line_config_errors(override, message) -> None:
    cfg = C.load_central_config("pnn_ident", [override, "tracking.enabled=false"])
    with pytest.raises(ConfigError, match=message) as info:
        run_central(cfg)
    assert "\n" not in str(info.value)


def test_defaults_and_claim_spec_are_valid() -> None:
    from fedsim import reproduce

    R.check(method_params(C.load_central_config("pnn_ident")))
    spec = reproduce.load_claim("pnn_ident")
    seen = set()
    for setting in reproduce.settings(spec):
        params = method_params(reproduce.build_config(spec, setting, 0))
        R.check(params)
        seen.add((tuple(params.families), tuple(params.bias)))
    assert len(seen) == 6 and spec.metric == "claims/held_frac"

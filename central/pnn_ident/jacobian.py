"""The parameter-to-polynomial Jacobian and its generic rank: exact (mod p), float64 and symbolic.

**Why values at points.**  The polynomial f_θ is linear in its coefficient vector c(θ), and its
values at points x_1, …, x_N are ``E · c(θ)`` with E the evaluation (Vandermonde-type) matrix, so
``rank J_vals = rank(E · J_coef) ≤ rank J_coef``.  The columns of J_coef span a space of polynomial
maps of dimension k = rank J_coef ≤ #params; each new generic point cuts the kernel of the evaluation
on that space by at least one, so N ≥ k generic points give equality.  We use N = #params + 4 points,
never the (much larger) ambient dimension.

**Exact verdicts — rank over F_p.**  Parameters and points are drawn uniformly in F_p
(p = 2^31 − 1 by default; every product of two residues fits in int64) and the Jacobian of the values
is propagated in forward mode modulo p.  Any nonzero minor mod p is a nonzero integer minor, so the
F_p rank at any point is a *lower bound* on the generic rank over ℚ (hence over ℝ and ℂ).  Since the
per-neuron scalings always give ``rank ≤ #params − #hidden neurons``, a modular rank reaching that
bound *certifies* generic finite identifiability.  A smaller rank means "defective" with an error
probability bounded by Schwartz–Zippel (total degree of a minor / p, ≲ 1e-5 per draw for the sizes run
here); we take the maximum over ``trials`` independent draws.

**Float64 cross-check.**  ``torch.func.jacrev`` of the same map in float64 at Gaussian parameters and
Gaussian points x ~ N(0, I/d_0) (not points on the unit sphere: with biases the polynomial is not
determined by its values there — this cross-check caught that); columns normalised (rank-invariant), singular values by SVD, numerical rank
= #{σ_i > σ_1·rtol}.  The log10 gap σ_k/σ_{k+1} at the cut is reported; a float rank is called
*reliable* only if that gap is ≥ ``min_gap`` decades (degree-r^{L−1} polynomials become badly
conditioned quickly, which is why verdicts come from the modular rank).

**Symbolic check (tiny cases).**  sympy expands f_θ with symbolic parameters and takes the exact
rank over ℚ of the coefficient Jacobian at an integer point: the reference the other two must match.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from central.pnn_ident.pnn import MAX_PRIME, Arch, forward, layers, powmod

DEFAULT_PRIME = 2**31 - 1


# -- modular ---------------------------------------------------------------------------------------

def forward_mode(arch: Arch, theta: np.ndarray, X: np.ndarray, p: int | None = None) -> np.ndarray:
    """∂ f_θ(x_n)_i / ∂θ_j, shape (N·d_L, #params), by forward-mode propagation.

    With ``p`` everything is int64 modulo p (one product of two residues per update, exact); without
    it, float64 (used by the fits: much faster than autograd on these tiny maps).
    """
    if p is not None:
        assert p < MAX_PRIME
        theta, X = theta % p, X % p

    def red(a: np.ndarray) -> np.ndarray:
        return a % p if p is not None else a

    N, P = X.shape[0], arch.n_params
    dtype = np.int64 if p is not None else np.float64
    h = X
    dh = np.zeros((N, arch.widths[0], P), dtype=dtype)
    for l, ((W, b), (offset, d_in, d_out)) in enumerate(zip(layers(arch, theta), arch.layer_slices()), start=1):
        z = np.zeros((N, d_out), dtype=dtype) if b is None else np.tile(b, (N, 1))
        dz = np.zeros((N, d_out, P), dtype=dtype)
        for k in range(d_in):  # chain rule through the inputs (earlier parameters)
            z = red(z + h[:, k, None] * W[None, :, k])
            dz = red(dz + W[None, :, k, None] * dh[:, None, k, :])
        for i in range(d_out):  # this layer's own parameters (their columns are still zero)
            dz[:, i, offset + i * d_in : offset + (i + 1) * d_in] = h
            if b is not None:
                dz[:, i, offset + d_out * d_in + i] = 1
        if l < arch.L:
            if p is not None:
                slope = arch.r * powmod(z, arch.r - 1, p) % p
                h = powmod(z, arch.r, p)
            else:
                slope, h = arch.r * z ** (arch.r - 1), z**arch.r
            dh = red(slope[:, :, None] * dz)
        else:
            h, dh = z, dz
    return dh.reshape(N * arch.widths[-1], P)


def jacobian_mod_p(arch: Arch, theta: np.ndarray, X: np.ndarray, p: int = DEFAULT_PRIME) -> np.ndarray:
    """The Jacobian of the values modulo p (entries in [0, p))."""
    return forward_mode(arch, theta, X, p)


def rank_mod_p(M: np.ndarray, p: int = DEFAULT_PRIME) -> int:
    """Rank over F_p by Gaussian elimination (int64, one product per entry update)."""
    A = np.array(M, dtype=np.int64) % p
    m, n = A.shape
    rank = 0
    for col in range(n):
        if rank == m:
            break
        nz = np.flatnonzero(A[rank:, col])
        if nz.size == 0:
            continue
        piv = rank + int(nz[0])
        if piv != rank:
            A[[rank, piv]] = A[[piv, rank]]
        A[rank, col:] = A[rank, col:] * pow(int(A[rank, col]), p - 2, p) % p
        factors = A[rank + 1 :, col].copy()
        if factors.any():
            A[rank + 1 :, col:] = (A[rank + 1 :, col:] - factors[:, None] * A[rank, None, col:] % p) % p
        rank += 1
    return rank


def random_point_mod_p(arch: Arch, rng: np.random.Generator, p: int, n_points: int) -> tuple[np.ndarray, np.ndarray]:
    """(θ, X) uniform over F_p^{#params} × F_p^{N×d_0} (θ nonzero entries)."""
    theta = rng.integers(1, p, size=arch.n_params, dtype=np.int64)
    X = rng.integers(0, p, size=(n_points, arch.widths[0]), dtype=np.int64)
    return theta, X


def n_points_for(arch: Arch) -> int:
    return arch.n_params + 4


def exact_rank(arch: Arch, rng: np.random.Generator, p: int = DEFAULT_PRIME, trials: int = 2) -> list[int]:
    """The F_p Jacobian rank at ``trials`` independent random points (max = the lower bound used)."""
    ranks = []
    for _ in range(trials):
        theta, X = random_point_mod_p(arch, rng, p, n_points_for(arch))
        ranks.append(rank_mod_p(jacobian_mod_p(arch, theta, X, p), p))
    return ranks


# -- float64 ----------------------------------------------------------------------------------------

@dataclass
class FloatRank:
    rank: int
    gap_decades: float  # log10(σ_rank / σ_{rank+1}); inf when the rank is full
    singular_values: np.ndarray

    def reliable(self, min_gap: float) -> bool:
        return self.gap_decades >= min_gap


def jacobian_float(arch: Arch, theta: np.ndarray, X: np.ndarray) -> np.ndarray:
    """∂ f_θ(X) / ∂θ in float64 by ``torch.func.jacrev`` (an implementation independent of the modular one)."""
    import torch

    th = torch.as_tensor(theta, dtype=torch.float64)
    Xt = torch.as_tensor(X, dtype=torch.float64)
    J = torch.func.jacrev(lambda t: forward(arch, t, Xt).reshape(-1))(th)
    return J.numpy()


def numerical_rank(J: np.ndarray, rtol: float = 1e-8) -> FloatRank:
    """Numerical rank of J after normalising its columns; the gap at the cut in decades."""
    norms = np.linalg.norm(J, axis=0)
    Jn = J[:, norms > 0] / norms[norms > 0]
    s = np.linalg.svd(Jn, compute_uv=False) if Jn.size else np.zeros(0)
    if s.size == 0 or s[0] == 0:
        return FloatRank(0, float("inf"), s)
    k = int(np.sum(s > s[0] * rtol))
    gap = float("inf") if k >= s.size else float(np.log10(s[k - 1] / max(s[k], 1e-300)))
    return FloatRank(k, gap, s)


def random_point_float(arch: Arch, rng: np.random.Generator, n_points: int) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian parameters and points (x ~ N(0, I/d_0), so ‖x‖ ≈ 1).

    Not points *on* the unit sphere: a non-homogeneous polynomial (biases) is not determined by its
    values there (multiples of ‖x‖² − 1 vanish), which the float/exact cross-check caught.
    """
    theta = rng.standard_normal(arch.n_params)
    return theta, rng.standard_normal((n_points, arch.widths[0])) / np.sqrt(arch.widths[0])


def float_rank(arch: Arch, rng: np.random.Generator, rtol: float = 1e-8) -> FloatRank:
    theta, X = random_point_float(arch, rng, 2 * arch.n_params + 4)
    return numerical_rank(jacobian_float(arch, theta, X), rtol)


# -- symbolic (tiny cases) ---------------------------------------------------------------------------

def coefficient_jacobian_rank(arch: Arch, theta: list[int]) -> int:
    """Exact rank over ℚ of ∂ coefficients / ∂θ at an integer θ, by sympy expansion (tiny cases only)."""
    import sympy as sp

    xs = sp.symbols(f"x0:{arch.widths[0]}")
    ts = sp.symbols(f"t0:{arch.n_params}")
    outputs = forward(arch, np.array(ts, dtype=object), np.array([xs], dtype=object))[0]
    rows = []
    for out in outputs:
        poly = sp.Poly(sp.expand(out), *xs)
        rows += [sp.Matrix([c]).jacobian(ts) for c in poly.coeffs()]
    J = sp.Matrix.vstack(*rows).subs(dict(zip(ts, theta)))
    return int(J.rank())


__all__ = ["DEFAULT_PRIME", "forward_mode", "jacobian_mod_p", "rank_mod_p", "exact_rank", "random_point_mod_p",
           "n_points_for",
           "FloatRank", "jacobian_float", "numerical_rank", "float_rank", "random_point_float",
           "coefficient_jacobian_rank"]

"""LRQK's low-rank algebra, as the authors' ``lrqk_attention.py`` codes it (penalised formulation).

Prefill: per head, factor the query and key matrices ``Q, K ∈ ℝ^{l×d}`` as ``A_Q B_Q`` and ``A_K B_K``
(``A ∈ ℝ^{l×r}``, ``B ∈ ℝ^{r×d}``) by alternating exact block minimisation of the *penalised*
objective (the code's relaxation of the poster's constrained one)::

    L = ½‖Q Kᵀ − A_Q A_Kᵀ‖² + ½λ_Q‖Q − A_Q B_Q‖² + ½λ_K‖K − A_K B_K‖²

    B_Q = (A_QᵀA_Q)⁻¹ A_QᵀQ,   B_K = (A_KᵀA_K)⁻¹ A_KᵀK
    A_Q = Q (KᵀA_K + λ_Q B_Qᵀ)(A_KᵀA_K + λ_Q B_Q B_Qᵀ)⁻¹
    A_K = K (QᵀA_Q + λ_K B_Kᵀ)(A_QᵀA_Q + λ_K B_K B_Kᵀ)⁻¹      (with the *new* A_Q)

and a final ``B`` refit.  Every update is the exact minimiser of ``L`` in its block, so ``L`` never
increases.  Decode: for the new ``q, k ∈ ℝ^{1×d}`` find ``q̂, k̂ ∈ ℝ^{1×r}`` by alternating least
squares on ``½‖q̂B_Q − q‖² + ½‖k̂B_K − k‖² + ½λ₁(q̂k̂ᵀ − qkᵀ)² + ½λ₂‖q̂A_{K,Ω}ᵀ − qK_Ωᵀ‖²`` (Ω = the
tokens attended at the previous step), then one gradient step on ``B_Q`` and ``B_K`` with the exact
line-search step ``‖dB‖²/‖ĥ dB‖²``.  All tensors carry leading head dimensions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INITS = ("randn", "top", "topcol")


@dataclass
class Factors:
    """Per-head factors: ``A_Q, A_K`` (..., l, r); ``B_Q, B_K`` (..., r, d)."""

    A_Q: torch.Tensor
    B_Q: torch.Tensor
    A_K: torch.Tensor
    B_K: torch.Tensor


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


def _solve_right(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``X`` with ``X A = B`` (the code's ``solve_ex(..., left=False)``)."""
    return torch.linalg.solve_ex(A, B, left=False)[0]


def _solve_left(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``X`` with ``A X = B``."""
    return torch.linalg.solve_ex(A, B)[0]


def init_factors(Q: torch.Tensor, K: torch.Tensor, r: int, method: str = "randn",
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Initial ``A_Q, A_K``: Gaussian (the code's default), or the top-r columns by |column| sum."""
    if method == "randn":
        shape = (*Q.shape[:-1], r)
        return (torch.randn(shape, generator=generator, dtype=Q.dtype).to(Q.device),
                torch.randn(shape, generator=generator, dtype=K.dtype).to(K.device))
    q_sum, k_sum = Q.abs().sum(-2, keepdim=True), K.abs().sum(-2, keepdim=True)
    if method == "top":
        iq, ik = q_sum.topk(r, dim=-1).indices, k_sum.topk(r, dim=-1).indices
    elif method == "topcol":
        iq = ik = (q_sum + k_sum).topk(r, dim=-1).indices
    else:
        raise ValueError(f"unknown init {method!r}; known: {', '.join(INITS)}")
    return (Q.gather(-1, iq.expand(*Q.shape[:-1], r)), K.gather(-1, ik.expand(*K.shape[:-1], r)))


def refit_B(A: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """Least-squares ``B = (AᵀA)⁻¹AᵀX``."""
    return _solve_left(_t(A) @ A, _t(A) @ X)


def penalised_objective(Q: torch.Tensor, K: torch.Tensor, f: Factors, lam_q: float = 1.0,
                        lam_k: float = 1.0) -> torch.Tensor:
    """The code's prefill objective ``L`` per head (shape: the leading dims)."""
    fit = (Q @ _t(K) - f.A_Q @ _t(f.A_K)).square().sum((-1, -2))
    pen_q = (Q - f.A_Q @ f.B_Q).square().sum((-1, -2))
    pen_k = (K - f.A_K @ f.B_K).square().sum((-1, -2))
    return 0.5 * (fit + lam_q * pen_q + lam_k * pen_k)


def als_step(Q: torch.Tensor, K: torch.Tensor, A_Q: torch.Tensor, A_K: torch.Tensor, lam_q: float,
             lam_k: float) -> tuple[Factors, Factors]:
    """One ALS sweep; returns the factors after the B refit and after the A updates."""
    B_Q, B_K = refit_B(A_Q, Q), refit_B(A_K, K)
    after_b = Factors(A_Q, B_Q, A_K, B_K)
    new_A_Q = Q @ _solve_right(_t(A_K) @ A_K + lam_q * B_Q @ _t(B_Q), _t(K) @ A_K + lam_q * _t(B_Q))
    new_A_K = K @ _solve_right(_t(new_A_Q) @ new_A_Q + lam_k * B_K @ _t(B_K), _t(Q) @ new_A_Q + lam_k * _t(B_K))
    return after_b, Factors(new_A_Q, B_Q, new_A_K, B_K)


def als_prefill(Q: torch.Tensor, K: torch.Tensor, r: int, lam_q: float = 1.0, lam_k: float = 1.0,
                iters: int = 2, tol: float = 1e-8, init: str = "randn",
                generator: torch.Generator | None = None,
                trace: list[torch.Tensor] | None = None) -> Factors:
    """The prefill factorisation (``iters`` sweeps, early stop when the A's move less than ``tol`` in MSE).

    ``trace``, if given, receives the objective after every block update (for the monotonicity test).
    """
    A_Q, A_K = init_factors(Q, K, r, init, generator)
    for _ in range(iters):
        after_b, new = als_step(Q, K, A_Q, A_K, lam_q, lam_k)
        if trace is not None:
            trace += [penalised_objective(Q, K, after_b, lam_q, lam_k),
                      penalised_objective(Q, K, new, lam_q, lam_k)]
        delta = max(float((new.A_Q - A_Q).square().mean()), float((new.A_K - A_K).square().mean()))
        A_Q, A_K = new.A_Q, new.A_K
        if delta < tol:
            break
    out = Factors(A_Q, refit_B(A_Q, Q), A_K, refit_B(A_K, K))
    if trace is not None:
        trace.append(penalised_objective(Q, K, out, lam_q, lam_k))
    return out


def decode_objective(B_Q: torch.Tensor, B_K: torch.Tensor, A_K_sel: torch.Tensor, K_sel: torch.Tensor,
                     q: torch.Tensor, k: torch.Tensor, q_hat: torch.Tensor, k_hat: torch.Tensor,
                     lam1: float = 1.0, lam2: float = 1.0) -> torch.Tensor:
    """The decode objective per head (for tests)."""
    a = (q_hat @ B_Q - q).square().sum((-1, -2)) + (k_hat @ B_K - k).square().sum((-1, -2))
    b = (q_hat @ _t(k_hat) - q @ _t(k)).square().sum((-1, -2))
    c = (q_hat @ _t(A_K_sel) - q @ _t(K_sel)).square().sum((-1, -2))
    return 0.5 * (a + lam1 * b + lam2 * c)


def _b_step(B: torch.Tensor, hat: torch.Tensor, x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """One gradient step on ``½‖ĥB − x‖²`` with the code's step ``‖dB‖²/(‖ĥ dB‖² + ε)``."""
    dB = _t(hat) @ (hat @ B - x)
    lr = dB.square().sum((-1, -2), keepdim=True) / ((hat @ dB).square().sum((-1, -2), keepdim=True) + eps)
    return B - lr * dB


def decode_update(B_Q: torch.Tensor, B_K: torch.Tensor, A_K_sel: torch.Tensor, K_sel: torch.Tensor,
                  q: torch.Tensor, k: torch.Tensor, lam1: float = 1.0, lam2: float = 1.0, iters: int = 2,
                  tol: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step: ``(B_Q, B_K, q̂, k̂)``; ``q, k`` are (..., 1, d), ``A_K_sel`` (..., n, r), ``K_sel`` (..., n, d)."""
    kBKt, BKBKt = k @ _t(B_K), B_K @ _t(B_K)
    rhs_q = q @ _t(B_Q) + lam2 * (q @ _t(K_sel)) @ A_K_sel
    lhs_q = B_Q @ _t(B_Q) + lam2 * _t(A_K_sel) @ A_K_sel
    qk = lam1 * (q @ _t(k))
    k_hat = _solve_right(BKBKt, kBKt)  # the code's initial guess: k̂ = argmin ‖k̂B_K − k‖
    q_hat = k_hat
    for _ in range(max(iters, 1)):
        q_hat = _solve_right(lhs_q + lam1 * _t(k_hat) @ k_hat, rhs_q + qk @ k_hat)
        new_k_hat = _solve_right(BKBKt + lam1 * _t(q_hat) @ q_hat, kBKt + qk @ q_hat)
        delta = float((new_k_hat - k_hat).square().mean())
        k_hat = new_k_hat
        if delta < tol:
            break
    return _b_step(B_Q, q_hat, q), _b_step(B_K, k_hat, k), q_hat, k_hat

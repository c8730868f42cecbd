"""Tucker-2 and CP decompositions of a conv kernel in the data-informed norm ‖Σ^{1/2}(W − Ŵ)‖_F.

Layout (the authors' ``Tucker_Sigma.py``): the kernel W (C_out × C_in × k × k) is read as the matrix
``W_mat = weight.reshape(C_out, C_in·k²)ᵀ`` (rows = patch coordinates (i, j), i the input channel, j the
spatial offset; columns = output channels), and the error is ``‖S (W_mat − Ŵ_mat)‖_F`` with S = Σ^{1/2},
i.e. ``sqrt(tr(Dᵀ Σ D))``.  Every update below uses Σ (= SᵀS) directly.

**Tucker-2** ``Ŵ[(i,j),o] = Σ_{a,b} U_in[i,a] G[a,j,b] U_out[o,b]``, i.e. ``Ŵ_mat = (U_in ⊗ I_{k²}) G U_outᵀ``.
One ALS sweep updates, in the code's order (modes 0, 3, 4):

1. ``U_in`` — the Kronecker-structured normal equations ``M vec(U_in) = b`` with
   ``M[(i,a),(u,c)] = Σ_{j,v} Σ[(i,j),(u,v)] FFᵀ[(a,j),(c,v)]``, F = G ×₃ U_out (r_in × k² × C_out),
   ``b[i,a] = Σ_{j,o} (ΣW)[(i,j),o] F[a,j,o]`` — the code solves it with MINRES on GPU; we solve the
   same system densely (Cholesky) when it has at most ``dense_max`` unknowns, else matrix-free by
   Jacobi-preconditioned conjugate gradients warm-started at the current factor (:class:`ModeProblem`);
2. ``U_outᵀ = (KᵀΣK)⁻¹ KᵀΣW`` with K = (U_in ⊗ I) G;
3. the core ``G = (BᵀΣB)⁻¹ BᵀΣW U_out (U_outᵀU_out)⁻¹`` with B = U_in ⊗ I (the code's two solves).

Initialisation: HOSVD factors (leading left singular vectors of the input-channel and output-channel
unfoldings of W) and the core by the Σ-weighted least squares of step 3.  After each sweep the relative
error ``‖S(W−Ŵ)‖/‖SW‖`` is computed; if it increased the previous iterate is restored and the loop stops
(revert rule); it stops when the decrease is below ``tol`` (``abs_rec_error``), else after ``n_iter_max``.

**CP** (the notes: code not seen [I]) ``Ŵ[(i,j),o] = Σ_r B[i,r] C[j,r] A[o,r]`` over the 3-way tensor
(C_out, C_in, k²) — the factorised conv is 1×1 (C_in→R), depthwise k×k, 1×1 (R→C_out).  ALS over
A (output), B (input channel), C (spatial), the order of tensorly's ``parafac``; A by the Σ-weighted
least squares with the Khatri–Rao matrix K = B ⊙ C, B and C by the normal equations of their mode
(both see Σ through the patch index).  Initialised like ``parafac(init="svd")`` (tensorly's
``initialize_cp``); same stopping and revert rules.

Deviation from the code: the revert check also runs after the *first* sweep (the code compares only
from the second sweep on, ``if iteration >= 1``), so the returned trace never increases.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

DT = torch.float64


@dataclass
class Tucker2:
    """Tucker-2 factors of a kernel: U_in (C_in × r_in), core (r_in × k² × r_out), U_out (C_out × r_out)."""

    u_in: torch.Tensor
    core: torch.Tensor
    u_out: torch.Tensor

    def matrix(self) -> torch.Tensor:
        """Ŵ_mat (C_in·k² × C_out)."""
        f = torch.einsum("ajb,ob->ajo", self.core, self.u_out)
        return torch.einsum("ia,ajo->ijo", self.u_in, f).reshape(-1, self.u_out.shape[0])

    def kernel(self, k: tuple[int, int]) -> torch.Tensor:
        return from_matrix(self.matrix(), self.u_in.shape[0], k)


@dataclass
class CP:
    """CP factors of a kernel: A (C_out × R), B (C_in × R), C (k² × R)."""

    a: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor

    def matrix(self) -> torch.Tensor:
        return torch.einsum("ir,jr,or->ijo", self.b, self.c, self.a).reshape(-1, self.a.shape[0])

    def kernel(self, k: tuple[int, int]) -> torch.Tensor:
        return from_matrix(self.matrix(), self.b.shape[0], k)


@dataclass
class Trace:
    """Relative Σ-errors of the accepted iterates (initialisation first) and how the loop ended."""

    errors: list[float] = field(default_factory=list)
    reverted: bool = False
    converged: bool = False

    @property
    def sweeps(self) -> int:
        return len(self.errors) - 1


# -- layout ----------------------------------------------------------------------------------------

def to_matrix(weight: torch.Tensor) -> torch.Tensor:
    """(C_out, C_in, kh, kw) → W_mat (C_in·kh·kw, C_out) in float64."""
    return weight.detach().to(DT).reshape(weight.shape[0], -1).T.contiguous()


def from_matrix(mat: torch.Tensor, c_in: int, k: tuple[int, int]) -> torch.Tensor:
    """W_mat (C_in·kh·kw, C_out) → (C_out, C_in, kh, kw)."""
    return mat.T.reshape(mat.shape[1], c_in, *k)


def sigma_error(w: torch.Tensor, w_hat: torch.Tensor, sigma: torch.Tensor) -> float:
    """Relative error ``sqrt(tr(DᵀΣD) / tr(WᵀΣW))`` with D = W − Ŵ (matrices n × C_out)."""
    d = w - w_hat
    num = float((d * (sigma @ d)).sum().clamp_min(0.0))
    den = float((w * (sigma @ w)).sum())
    return float(np.sqrt(num / den)) if den > 0 else float(np.sqrt(num))


# -- linear algebra --------------------------------------------------------------------------------

def solve_normal(m: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """Solve the symmetric PSD system M X = rhs (Cholesky, or least squares when M is singular)."""
    m = 0.5 * (m + m.T)
    chol, info = torch.linalg.cholesky_ex(m)
    if int(info) == 0:
        x = torch.cholesky_solve(rhs, chol)
        if torch.isfinite(x).all():
            return x
    return torch.linalg.lstsq(m, rhs, driver="gelsd").solution


@dataclass
class ModeProblem:
    """min_X tr(DᵀΣD), D = W − Ŵ(X), Ŵ[(p,q),o] = Σ_c X[p,c] F[c,q,o], Σ and W indexed by (p, q).

    Every Kronecker-structured update has this form: Tucker's U_in (p = input channel, q = spatial,
    F = G ×₃ U_out), CP's B (F[r,j,o] = C[j,r]·A[o,r]) and CP's C (p = spatial, q = input channel,
    F[r,i,o] = B[i,r]·A[o,r]).  Its normal equations are ``M vec(X) = b`` with
    ``M[(p,c),(p',c')] = Σ_{q,q'} Σ[(p,q),(p',q')] (FFᵀ)[(c,q),(c',q')]`` (the code's ``matvec_M``).
    """

    sigma: torch.Tensor  # (P·Q, P·Q)
    sw: torch.Tensor  # Σ W, (P·Q, C_out)
    f: torch.Tensor  # (r, Q, C_out)

    @property
    def shape(self) -> tuple[int, int]:
        return self.sigma.shape[0] // self.f.shape[1], self.f.shape[0]

    def rhs(self) -> torch.Tensor:
        p, _ = self.shape
        return torch.einsum("pqo,cqo->pc", self.sw.reshape(p, self.f.shape[1], -1), self.f)

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        p, _ = self.shape
        w_hat = torch.einsum("pc,cqo->pqo", x, self.f).reshape(self.sigma.shape[0], -1)
        return torch.einsum("pqo,cqo->pc", (self.sigma @ w_hat).reshape(p, self.f.shape[1], -1), self.f)

    def diagonal(self) -> torch.Tensor:
        p, q = self.sigma.shape[0] // self.f.shape[1], self.f.shape[1]
        sig_pp = torch.diagonal(self.sigma.reshape(p, q, p, q), dim1=0, dim2=2)  # (q, q', p)
        ff = torch.einsum("cqo,cvo->qvc", self.f, self.f)
        return torch.einsum("qvp,qvc->pc", sig_pp, ff)

    def dense(self) -> torch.Tensor:
        """M as an explicit (P·r) × (P·r) matrix."""
        p, q = self.sigma.shape[0] // self.f.shape[1], self.f.shape[1]
        gram = torch.einsum("cqo,dvo->cqdv", self.f, self.f)
        m = torch.einsum("pqxv,cqdv->pcxd", self.sigma.reshape(p, q, p, q), gram)
        n = p * self.f.shape[0]
        return m.reshape(n, n)

    def solve(self, x0: torch.Tensor, rtol: float = 1e-10, max_iter: int = 1000, dense_max: int = 2500) -> torch.Tensor:
        """The exact solution by a dense solve when there are at most ``dense_max`` unknowns, else CG."""
        if x0.numel() <= dense_max:
            return solve_normal(self.dense(), self.rhs().reshape(-1, 1)).reshape(x0.shape)
        return self.cg(x0, rtol, max_iter)

    def cg(self, x0: torch.Tensor, rtol: float = 1e-10, max_iter: int = 1000) -> torch.Tensor:
        """Jacobi-preconditioned conjugate gradients warm-started at ``x0``.

        CG's iterates minimise the (convex) block objective over growing Krylov spaces around ``x0``,
        so even a truncated solve never increases it.
        """
        b = self.rhs()
        d = self.diagonal()
        inv_d = torch.where(d > 0, 1.0 / d.clamp_min(torch.finfo(DT).tiny), torch.ones_like(d))
        x = x0.clone()
        r = b - self.matvec(x)
        z = inv_d * r
        p = z.clone()
        rz = float((r * z).sum())
        stop = rtol * float(b.norm())
        for _ in range(max_iter):
            if float(r.norm()) <= stop or rz <= 0:
                break
            mp = self.matvec(p)
            pmp = float((p * mp).sum())
            if pmp <= 0:
                break
            alpha = rz / pmp
            x, r = x + alpha * p, r - alpha * mp
            z = inv_d * r
            rz_new = float((r * z).sum())
            p, rz = z + (rz_new / rz) * p, rz_new
        return x


# -- Tucker-2 --------------------------------------------------------------------------------------

@dataclass
class Problem:
    """One kernel's data: W_mat, Σ, ΣW, their sizes, and the solver settings of the Kronecker updates."""

    w: torch.Tensor
    sigma: torch.Tensor
    c_in: int
    k2: int
    cg_rtol: float = 1e-10
    cg_max_iter: int = 1000
    dense_max: int = 2500

    def __post_init__(self) -> None:
        self.sw = self.sigma @ self.w

    @classmethod
    def of(cls, weight: torch.Tensor, sigma: torch.Tensor | None, cg_rtol: float, cg_max_iter: int,
           dense_max: int) -> "Problem":
        w = to_matrix(weight)
        sigma = torch.eye(w.shape[0], dtype=DT) if sigma is None else sigma.to(DT)
        if sigma.shape != (w.shape[0], w.shape[0]):
            raise ValueError(f"Σ must be {w.shape[0]}×{w.shape[0]} for this kernel, got {tuple(sigma.shape)}")
        return cls(w, sigma, weight.shape[1], weight.shape[2] * weight.shape[3], cg_rtol, cg_max_iter, dense_max)

    def error(self, w_hat: torch.Tensor) -> float:
        return sigma_error(self.w, w_hat, self.sigma)

    def spatial_first(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Σ and ΣW re-indexed with the spatial offset first: (j, i) instead of (i, j)."""
        n, c, k = self.w.shape[0], self.c_in, self.k2
        perm = torch.arange(n).reshape(c, k).T.reshape(-1)
        return self.sigma[perm][:, perm], self.sw[perm]


def _tucker_core(pb: Problem, u_in: torch.Tensor, u_out: torch.Tensor) -> torch.Tensor:
    """Σ-weighted least-squares core for fixed factors (the code's two solves)."""
    c_in, r_in = u_in.shape
    b = torch.einsum("ia,jv->ijav", u_in, torch.eye(pb.k2, dtype=DT)).reshape(c_in * pb.k2, r_in * pb.k2)
    dx = solve_normal(b.T @ pb.sigma @ b, b.T @ pb.sw)  # (r_in·k², C_out)
    g = solve_normal(u_out.T @ u_out, u_out.T @ dx.T).T  # (r_in·k², r_out)
    return g.reshape(r_in, pb.k2, u_out.shape[1])


def _update_u_in(pb: Problem, t: Tucker2) -> torch.Tensor:
    f = torch.einsum("ajb,ob->ajo", t.core, t.u_out)  # F = G ×₃ U_out, (r_in, k², C_out)
    return ModeProblem(pb.sigma, pb.sw, f).solve(t.u_in, pb.cg_rtol, pb.cg_max_iter, pb.dense_max)


def _update_u_out(pb: Problem, t: Tucker2) -> torch.Tensor:
    kmat = torch.einsum("ia,ajb->ijb", t.u_in, t.core).reshape(pb.c_in * pb.k2, -1)
    return solve_normal(kmat.T @ pb.sigma @ kmat, kmat.T @ pb.sw).T


def hosvd_factors(w4: torch.Tensor, r_in: int, r_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Leading left singular vectors of the input- and output-channel unfoldings of W (C_out, C_in, k²)."""
    c_out, c_in = w4.shape[:2]
    u_in = torch.linalg.svd(w4.transpose(0, 1).reshape(c_in, -1), full_matrices=False)[0][:, :r_in]
    u_out = torch.linalg.svd(w4.reshape(c_out, -1), full_matrices=False)[0][:, :r_out]
    return u_in, u_out


def _loop(pb: Problem, state: object, sweep, n_iter_max: int, tol: float, revert: bool) -> tuple[object, Trace]:
    """The authors' outer loop: sweep, relative error, revert on increase, stop on a small decrease."""
    trace = Trace([pb.error(state.matrix())])
    for _ in range(n_iter_max):
        new = sweep(state)
        err = pb.error(new.matrix())
        if revert and not err <= trace.errors[-1]:  # increase (or NaN): keep the previous iterate
            trace.reverted = True
            break
        state, decrease = new, trace.errors[-1] - err
        trace.errors.append(err)
        if abs(decrease) < tol:
            trace.converged = True
            break
    return state, trace


def tucker2_als_sigma(weight: torch.Tensor, r_in: int, r_out: int, sigma: torch.Tensor | None = None,
                      n_iter_max: int = 100, tol: float = 1e-6, revert: bool = True, cg_rtol: float = 1e-10,
                      cg_max_iter: int = 1000, dense_max: int = 2500) -> tuple[Tucker2, Trace]:
    """Tucker2-ALS-Σ of a conv kernel (C_out, C_in, kh, kw); ``sigma=None`` is Σ = I (Frobenius).

    ``revert=False`` disables the revert rule (the raw trace, for tests).
    """
    c_out, c_in = weight.shape[:2]
    if not (1 <= r_in <= c_in and 1 <= r_out <= c_out):
        raise ValueError(f"Tucker-2 ranks must satisfy 1 <= r_in <= {c_in}, 1 <= r_out <= {c_out}")
    pb = Problem.of(weight, sigma, cg_rtol, cg_max_iter, dense_max)
    u_in, u_out = hosvd_factors(weight.detach().to(DT).reshape(c_out, c_in, -1), r_in, r_out)

    def sweep(t: Tucker2) -> Tucker2:
        new = Tucker2(_update_u_in(pb, t), t.core, t.u_out)
        new.u_out = _update_u_out(pb, new)
        new.core = _tucker_core(pb, new.u_in, new.u_out)
        return new

    return _loop(pb, Tucker2(u_in, _tucker_core(pb, u_in, u_out), u_out), sweep, n_iter_max, tol, revert)


# -- CP --------------------------------------------------------------------------------------------

def cp_init(weight: torch.Tensor, rank: int, seed: int) -> CP:
    """tensorly's ``initialize_cp(init="svd")`` on the (C_out, C_in, k²) tensor (weights folded into A)."""
    import warnings

    from tensorly.decomposition._cp import initialize_cp

    c_out, c_in = weight.shape[:2]
    w3 = weight.detach().to(DT).reshape(c_out, c_in, -1).numpy()
    with warnings.catch_warnings():  # ranks above a mode's size: tensorly pads the SVD init randomly
        warnings.simplefilter("ignore", UserWarning)
        cp = initialize_cp(w3, rank, init="svd", random_state=seed % 2**32)
    a, b, c = (torch.from_numpy(np.asarray(f, dtype=np.float64)) for f in cp.factors)
    return CP(a * torch.from_numpy(np.asarray(cp.weights, dtype=np.float64)), b, c)


def _update_a(pb: Problem, t: CP) -> torch.Tensor:
    kr = torch.einsum("ir,jr->ijr", t.b, t.c).reshape(-1, t.b.shape[1])  # Khatri–Rao B ⊙ C
    return solve_normal(kr.T @ pb.sigma @ kr, kr.T @ pb.sw).T


def cp_als_sigma(weight: torch.Tensor, rank: int, sigma: torch.Tensor | None = None, n_iter_max: int = 100,
                 tol: float = 1e-6, seed: int = 0, revert: bool = True, cg_rtol: float = 1e-10,
                 cg_max_iter: int = 1000, dense_max: int = 2500) -> tuple[CP, Trace]:
    """CP-ALS-Σ of a conv kernel (C_out, C_in, kh, kw) over (C_out, C_in, kh·kw); ``sigma=None`` is Σ = I."""
    if rank < 1:
        raise ValueError(f"CP rank must be >= 1, got {rank}")
    pb = Problem.of(weight, sigma, cg_rtol, cg_max_iter, dense_max)
    sig_t, sw_t = pb.spatial_first()

    def sweep(t: CP) -> CP:
        new = CP(_update_a(pb, t), t.b, t.c)
        f_b = torch.einsum("jr,or->rjo", new.c, new.a)
        new.b = ModeProblem(pb.sigma, pb.sw, f_b).solve(new.b, pb.cg_rtol, pb.cg_max_iter, pb.dense_max)
        f_c = torch.einsum("ir,or->rio", new.b, new.a)
        new.c = ModeProblem(sig_t, sw_t, f_c).solve(new.c, pb.cg_rtol, pb.cg_max_iter, pb.dense_max)
        return new

    return _loop(pb, cp_init(weight, rank, seed), sweep, n_iter_max, tol, revert)

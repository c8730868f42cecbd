"""Frobenius-norm baselines with tensorly: plain Tucker-2 (HOOI, ``partial_tucker``) and CP (``parafac``).

Both run on the numpy backend in float64 and are converted to the factor layout of
:mod:`central.tensor_compress.als`, so the same factorised convs and error measures apply.  The
"Σ = identity" baseline is :func:`~central.tensor_compress.als.tucker2_als_sigma` /
:func:`~central.tensor_compress.als.cp_als_sigma` with ``sigma=None`` (our ALS, Frobenius norm).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from central.tensor_compress.als import CP, DT, Trace, Tucker2, sigma_error, to_matrix


def tucker2_frobenius(weight: torch.Tensor, r_in: int, r_out: int, n_iter_max: int = 100,
                      tol: float = 1e-6) -> tuple[Tucker2, Trace]:
    """tensorly ``partial_tucker`` on modes (C_out, C_in) of the kernel, HOSVD init."""
    from tensorly.decomposition import partial_tucker

    c_out, c_in, kh, kw = weight.shape
    w = weight.detach().to(DT).numpy()
    (core, (u_out, u_in)), errors = partial_tucker(w, rank=[r_out, r_in], modes=[0, 1], n_iter_max=n_iter_max,
                                                   init="svd", tol=tol)
    core_t = torch.from_numpy(np.ascontiguousarray(core)).permute(1, 2, 3, 0).reshape(r_in, kh * kw, r_out)
    t = Tucker2(torch.from_numpy(np.ascontiguousarray(u_in)), core_t.contiguous(),
                torch.from_numpy(np.ascontiguousarray(u_out)))
    err = sigma_error(to_matrix(weight), t.matrix(), torch.eye(c_in * kh * kw, dtype=DT))
    return t, Trace([float("nan")] + [float(e) for e in errors[:-1]] + [err], converged=len(errors) < n_iter_max)


def cp_frobenius(weight: torch.Tensor, rank: int, n_iter_max: int = 100, tol: float = 1e-6,
                 seed: int = 0) -> tuple[CP, Trace]:
    """tensorly ``parafac`` (SVD init) on the (C_out, C_in, k²) tensor; the weights are folded into A."""
    from tensorly.decomposition import parafac

    c_out, c_in = weight.shape[:2]
    w3 = weight.detach().to(DT).reshape(c_out, c_in, -1).numpy()
    with warnings.catch_warnings():  # ranks above a mode's size: tensorly pads the SVD init randomly
        warnings.simplefilter("ignore", UserWarning)
        cp, errors = parafac(w3, rank, n_iter_max=n_iter_max, init="svd", tol=tol, random_state=seed % 2**32,
                             return_errors=True)
    a, b, c = (torch.from_numpy(np.asarray(f, dtype=np.float64)) for f in cp.factors)
    t = CP(a * torch.from_numpy(np.asarray(cp.weights, dtype=np.float64)), b, c)
    err = sigma_error(to_matrix(weight), t.matrix(), torch.eye(w3.shape[1] * w3.shape[2], dtype=DT))
    return t, Trace([float("nan")] + [float(e) for e in errors[:-1]] + [err], converged=len(errors) < n_iter_max)

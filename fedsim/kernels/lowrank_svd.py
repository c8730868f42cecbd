"""Exact batched SVD refactorisation of LoRA products (the FedSVD server step).

FedSVD (Lee et al., "FedSVD: Adaptive Orthogonalization for Private Federated
Learning with LoRA", arXiv 2505.12805) refactorises every LoRA layer after each
aggregation: with ``B`` (m×r), ``A`` (r×n) and the SVD ``BA = U Σ Vᵀ`` it sets
``B_new = U_r Σ_r`` and ``A_new = V_rᵀ``. The product ``BA`` is unchanged and
``A_new`` has orthonormal rows. The authors' code forms the m×n product and
runs a full SVD per layer: O(mn·min(m, n)) work and one host sync per layer.

Because rank(BA) ≤ r the same factors are obtained exactly in
O((m + n)r² + r³) without forming the product::

    B = Q_b R_b,   Aᵀ = Q_a R_a,   M = R_b R_aᵀ = U_c Σ V_cᵀ   (r×r core)
    B_new = Q_b U_c Σ,   A_new = V_cᵀ Q_aᵀ

If ``A`` already has orthonormal rows (every round after the first, since the
previous refactorisation produced it) ``Q_a = Aᵀ`` and ``R_a = I``, so the core
is the thin SVD of ``B`` alone and ``A_new = V_cᵀ A`` (the "shortcut").
The shortcut keeps ``BA`` exact for any A; a small deviation of A from
orthonormality (auto-detection accepts max|AAᵀ - I| ≤ 16·eps·√n) is carried
over unchanged, not amplified, and the general path re-orthonormalises A as soon
as the deviation exceeds the tolerance.

All layers of one shape are processed in one call on ``(L, m, r)``/``(L, r, n)``
tensors with batched ``torch.linalg.qr``/``svd``. The r×r core is always
decomposed in float64; the large QRs and products run in float32 (float64 for
float64 inputs, float32 for float16/bfloat16 inputs); outputs keep the input
dtype and device.

Conventions and deviations from the authors' code:

* Sign convention: each row of ``A_new`` (a right singular vector) is flipped so
  that its largest-magnitude entry is positive (evaluated in the compute dtype;
  on an exact tie between +a and -a the row is left with max = +a); the matching
  column of ``B_new`` is flipped with it.
  :func:`svd_refactor_reference` applies the same convention. With repeated
  non-zero singular values the basis of that singular subspace is still only
  defined up to a rotation (``BA`` is unaffected).
* Rank deficiency (e.g. ``B = 0`` at round 0): the rows of ``A_new`` belonging
  to zero singular values are an orthonormal completion *inside the row space
  of A* (taken from the QR of ``Aᵀ``) and the matching columns of ``B_new`` are
  zero. The authors' code instead takes arbitrary null-space vectors of ``BA``
  (for ``B = 0`` typically the first unit vectors), discarding the subspace of
  ``A``. Only those zero-singular-value rows differ; ``BA`` is identical.
* ``r > m`` is supported (the extra columns of ``B_new`` are zero); ``r > n``
  raises ``ValueError`` because ``A_new`` cannot have r orthonormal rows.

Device paths. CPU and CUDA run the same :func:`_refactor_core`. On CUDA (and
any non-CPU device) nothing branches on tensor values: the orthonormal-A
auto-detection is skipped (the general path, exact for every A, is used unless
``assume_orthonormal_A=True``), the r×r core uses cuSOLVER's batched Jacobi SVD
(``driver="gesvdj"``; one ``gesvdjBatched`` launch for r ≤ 32, after which
torch performs one convergence check per call, not per layer), and the final
products, scaling and sign fix are fused with ``torch.compile`` (CUDA only; set
``FEDSIM_SVD_COMPILE=0`` to disable, and it falls back to eager if compilation
fails).
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "orthonormal_rows_mask",
    "refactor_lora_state_dict",
    "svd_refactor",
    "svd_refactor_reference",
]

_CORE_DTYPE = torch.float64
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_GESVDJ_BATCHED_MAX = 32

FinalizeFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


# --------------------------------------------------------------------------- helpers


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the large QRs and products: float64 stays, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _validate_pair(B: Tensor, A: Tensor) -> None:
    """Check shapes, dtypes and devices of a (batched) LoRA pair."""
    if B.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {B.dtype}; expected one of {_SUPPORTED_DTYPES}")
    if A.dtype != B.dtype or A.device != B.device:
        raise ValueError(
            f"B and A must share dtype and device, got {B.dtype}/{B.device} and {A.dtype}/{A.device}"
        )
    if B.ndim < 2 or B.ndim != A.ndim:
        raise ValueError(f"B and A must both be 2-D or batched alike, got {tuple(B.shape)} and {tuple(A.shape)}")
    if B.shape[:-2] != A.shape[:-2] or B.shape[-1] != A.shape[-2]:
        raise ValueError(f"shapes do not chain as B (…, m, r) @ A (…, r, n): {tuple(B.shape)} and {tuple(A.shape)}")
    r, n = A.shape[-2], A.shape[-1]
    if r > n:
        raise ValueError(f"rank r={r} exceeds n={n}: A_new cannot have r orthonormal rows")


def _sign_of_largest(rows: Tensor) -> Tensor:
    """±1 per row so that each row's largest-|.| entry becomes positive (+ wins a ±a tie).

    The largest-|.| entry is positive iff max ≥ -min (two cheap reductions, no |.| copy).
    """
    return 1 - 2 * (rows.amax(dim=-1) < -rows.amin(dim=-1)).to(rows.dtype)


def _apply_sign_convention(B_new: Tensor, A_new: Tensor) -> tuple[Tensor, Tensor]:
    """Flip rows of A_new and the matching columns of B_new (BA unchanged)."""
    sign = _sign_of_largest(A_new)
    return B_new * sign.unsqueeze(-2), A_new * sign.unsqueeze(-1)


def _pad_columns(X: Tensor, width: int) -> Tensor:
    """Zero-pad the last dimension of X to ``width`` (no-op when already that wide)."""
    missing = width - X.shape[-1]
    return F.pad(X, (0, missing)) if missing > 0 else X


def _default_ortho_tol(dtype: torch.dtype, n: int) -> float:
    """Tolerance on max|A Aᵀ - I| below which A counts as having orthonormal rows."""
    eps = torch.finfo(_compute_dtype(dtype)).eps
    return 16.0 * eps * max(n, 1) ** 0.5


def orthonormal_rows_mask(A: Tensor, tol: float | None = None) -> Tensor:
    """Per-layer bool tensor: does A (…, r, n) have orthonormal rows to within ``tol``?

    Costs one batched (r×n)(n×r) product; it does not synchronise with the device.
    """
    cd = _compute_dtype(A.dtype)
    tol = _default_ortho_tol(A.dtype, A.shape[-1]) if tol is None else tol
    A = A.to(cd)
    gram = A @ A.mT
    eye = torch.eye(A.shape[-2], dtype=cd, device=A.device)
    return (gram - eye).abs().amax(dim=(-2, -1)) <= tol


def _resolve_shortcut(A: Tensor, assume_orthonormal_A: bool | None) -> bool:
    """Decide the path; only on CPU is the decision read back from tensor values."""
    if assume_orthonormal_A is not None:
        return bool(assume_orthonormal_A)
    if A.device.type != "cpu":
        return False
    return bool(orthonormal_rows_mask(A).all())


def _svd_driver(device: torch.device, r: int) -> str | None:
    """cuSOLVER batched Jacobi for small cores on CUDA; torch's default elsewhere."""
    if device.type == "cuda" and torch.version.cuda is not None and r <= _GESVDJ_BATCHED_MAX:
        return "gesvdj"
    return None


# --------------------------------------------------------------------------- core


def _finalize(Qb: Tensor, Uc: Tensor, S: Tensor, Vhc: Tensor, A_basis: Tensor) -> tuple[Tensor, Tensor]:
    """A_new = D V_cᵀ A_basis, B_new = Q_b U_c Σ D (zero-padded to r columns), D = signs.

    Σ and the signs are folded into the small U_c, so only two large products and one
    reduction over A_new touch m- or n-sized data.
    """
    r, k = Vhc.shape[-1], S.shape[-1]
    A_new = Vhc @ A_basis
    sign = _sign_of_largest(A_new)
    A_new.mul_(sign.unsqueeze(-1))
    B_new = Qb @ (Uc * (S * sign[..., :k]).unsqueeze(-2))
    return _pad_columns(B_new, r), A_new


def _refactor_core(
    B: Tensor, A: Tensor, *, shortcut: bool, finalize: FinalizeFn = _finalize
) -> tuple[Tensor, Tensor]:
    """Exact refactorisation in the dtype of B/A (float32 or float64); shared by all devices.

    B: (…, m, r), A: (…, r, n). With ``shortcut`` A must have orthonormal rows.
    """
    cd = B.dtype
    Qb, Rb = torch.linalg.qr(B)  # (…, m, k), (…, k, r) with k = min(m, r)
    if shortcut:
        A_basis, core = A, Rb.to(_CORE_DTYPE)
    else:
        Qa, Ra = torch.linalg.qr(A.mT)  # (…, n, r), (…, r, r)
        A_basis, core = Qa.mT, Rb.to(_CORE_DTYPE) @ Ra.to(_CORE_DTYPE).mT
    driver = _svd_driver(B.device, core.shape[-1])
    Uc, S, Vhc = torch.linalg.svd(core, full_matrices=True, driver=driver)  # (k,k), (k,), (r,r)
    return finalize(Qb, Uc.to(cd), S.to(cd), Vhc.to(cd), A_basis)


# --------------------------------------------------------------------------- CUDA fusion


class _CompiledFinalize:
    """Lazily ``torch.compile``-d :func:`_finalize`, used on CUDA only; eager on failure."""

    def __init__(self) -> None:
        self._fn: FinalizeFn | None = None
        self._failed = os.environ.get("FEDSIM_SVD_COMPILE", "1") == "0"

    def select(self, device: torch.device) -> FinalizeFn:
        """The finalize function to use for tensors on ``device``."""
        if device.type != "cuda" or self._failed:
            return _finalize
        return self._call

    def _call(self, *args: Tensor) -> tuple[Tensor, Tensor]:
        if self._fn is None:
            self._fn = torch.compile(_finalize, dynamic=None)
        try:
            return self._fn(*args)
        except Exception as exc:  # compilation problems (e.g. no Triton): stay eager from now on
            self._failed = True
            warnings.warn(f"torch.compile of the SVD finalize step failed ({exc!r}); using eager", stacklevel=3)
            return _finalize(*args)


_COMPILED_FINALIZE = _CompiledFinalize()


# --------------------------------------------------------------------------- public API


@torch.no_grad()
def svd_refactor(B: Tensor, A: Tensor, *, assume_orthonormal_A: bool | None = None) -> tuple[Tensor, Tensor]:
    """Refactor ``B @ A`` into ``(U_r Σ_r, V_rᵀ)`` for every layer at once.

    Args:
        B: ``(L, m, r)`` (or ``(m, r)``; any equal leading batch dims work).
        A: ``(L, r, n)`` (or ``(r, n)``).
        assume_orthonormal_A: ``True`` uses the thin-SVD-of-B shortcut (A must have
            orthonormal rows), ``False`` the general QR path; ``None`` detects it on
            CPU (all layers must pass) and uses the general path on other devices.

    Returns:
        ``(B_new, A_new)`` with the input shapes, dtype and device, ``B_new @ A_new
        == B @ A``, orthonormal rows of ``A_new``, descending singular values
        (column norms of ``B_new``) and the documented sign convention.
    """
    _validate_pair(B, A)
    shortcut = _resolve_shortcut(A, assume_orthonormal_A)
    cd = _compute_dtype(B.dtype)
    finalize = _COMPILED_FINALIZE.select(B.device)
    B_new, A_new = _refactor_core(B.to(cd), A.to(cd), shortcut=shortcut, finalize=finalize)
    return B_new.to(B.dtype), A_new.to(A.dtype)


def _reference_layer(b: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
    """The authors' per-layer step: SVD of the formed m×n product, keep the top r."""
    m, r = b.shape
    n = a.shape[1]
    U, S, Vh = torch.linalg.svd(b @ a, full_matrices=r > min(m, n))
    k = min(m, n, r)
    B_new = _pad_columns(U[:, :k] * S[:k], r)
    return _apply_sign_convention(B_new, Vh[:r])


@torch.no_grad()
def svd_refactor_reference(B: Tensor, A: Tensor) -> tuple[Tensor, Tensor]:
    """Baseline: per-layer full SVD of ``B @ A`` (arXiv 2505.12805 code), same sign convention."""
    _validate_pair(B, A)
    cd = _compute_dtype(B.dtype)
    Bs = B.to(cd).reshape(-1, *B.shape[-2:])
    As = A.to(cd).reshape(-1, *A.shape[-2:])
    if Bs.shape[0] == 0:
        return B.clone(), A.clone()
    outs = [_reference_layer(b, a) for b, a in zip(Bs, As, strict=True)]
    B_new = torch.stack([o[0] for o in outs]).reshape(B.shape)
    A_new = torch.stack([o[1] for o in outs]).reshape(A.shape)
    return B_new.to(B.dtype), A_new.to(A.dtype)


# --------------------------------------------------------------------------- state dicts


def _lora_pairs(state_dict: Mapping[str, Any], a_suffix: str, b_suffix: str) -> list[tuple[str, str]]:
    """(A key, B key) for every LoRA pair; ValueError for any unmatched A or B."""
    if not a_suffix or not b_suffix or a_suffix == b_suffix:
        raise ValueError(f"a_suffix and b_suffix must be distinct and non-empty, got {a_suffix!r}, {b_suffix!r}")
    pairs = []
    for a_key in (k for k in state_dict if k.endswith(a_suffix)):
        b_key = a_key[: len(a_key) - len(a_suffix)] + b_suffix
        if b_key not in state_dict:
            raise ValueError(f"LoRA A {a_key!r} has no matching B {b_key!r}")
        pairs.append((a_key, b_key))
    matched = {b for _, b in pairs}
    orphans = sorted(k for k in state_dict if k.endswith(b_suffix) and k not in matched)
    if orphans:
        raise ValueError(f"LoRA B {orphans[0]!r} has no matching A (suffix {a_suffix!r})")
    return pairs


def _group_key(a_key: str, A: Any, b_key: str, B: Any) -> tuple[int, int, int, torch.dtype, torch.device]:
    """(m, r, n, dtype, device) of a pair, after checking that the pair is consistent."""
    if not isinstance(A, Tensor) or not isinstance(B, Tensor):
        raise ValueError(f"LoRA entries {a_key!r} and {b_key!r} must be tensors")
    if A.ndim != 2 or B.ndim != 2 or A.shape[0] != B.shape[1]:
        raise ValueError(
            f"LoRA shapes disagree: {b_key!r} {tuple(B.shape)} must be (m, r) and {a_key!r} {tuple(A.shape)} (r, n)"
        )
    if A.dtype != B.dtype or A.device != B.device:
        raise ValueError(f"LoRA pair {a_key!r}/{b_key!r} mixes dtypes or devices")
    return B.shape[0], B.shape[1], A.shape[1], B.dtype, B.device


def refactor_lora_state_dict(
    state_dict: Mapping[str, Any],
    *,
    a_suffix: str = "lora_A.weight",
    b_suffix: str = "lora_B.weight",
    assume_orthonormal_A: bool | None = None,
) -> dict[str, Any]:
    """Apply :func:`svd_refactor` to every LoRA pair, one batched call per shape group.

    Pairs are keys ``<prefix><a_suffix>`` (r, n) and ``<prefix><b_suffix>`` (m, r).
    Returns a shallow copy of ``state_dict`` (same mapping type for dicts) in which
    only the LoRA entries are replaced; all other values are the same objects.
    """
    pairs = _lora_pairs(state_dict, a_suffix, b_suffix)
    groups: dict[tuple[Any, ...], list[tuple[str, str]]] = {}
    for a_key, b_key in pairs:
        key = _group_key(a_key, state_dict[a_key], b_key, state_dict[b_key])
        groups.setdefault(key, []).append((a_key, b_key))
    out = copy.copy(state_dict) if isinstance(state_dict, dict) else dict(state_dict)
    for members in groups.values():
        B = torch.stack([state_dict[b] for _, b in members])
        A = torch.stack([state_dict[a] for a, _ in members])
        B_new, A_new = svd_refactor(B, A, assume_orthonormal_A=assume_orthonormal_A)
        for i, (a_key, b_key) in enumerate(members):
            out[a_key], out[b_key] = A_new[i].clone(), B_new[i].clone()
    return out

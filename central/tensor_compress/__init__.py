"""Distribution-aware tensor decomposition for compressing CNNs (Kalle, Rudkiewicz, Ouerfelli, Tamaazousti;
NeurIPS 2025, arXiv:2511.04494).

Paper: https://arxiv.org/abs/2511.04494 — the official code read for this package: ``Tucker_Sigma.py``
(``partial_tucker_sigma``) and ``Compute_Covariance.py`` of the authors' Tucker2-ALS-Σ repository.

**The algorithm as the authors coded it.**  A conv kernel W (C_out × C_in × k × k) is compressed by a
low-rank Tucker-2 (or CP) form Ŵ that minimises the change of the layer's *output* on the data,
``‖(W − Ŵ) Σ^{1/2}‖_F``, with Σ = E[x xᵀ] the second moment of the layer's input patches
x ∈ ℝ^{C_in·k²} (zero padding and stride of the conv, averaged over images and positions, through the
original network).  Tucker-2 ``Ŵ_mat = (U_in ⊗ I_{k²}) G U_outᵀ`` is fitted by alternating least squares:
HOSVD factors and a Σ-weighted least-squares core to start; each sweep solves U_in from its
Kronecker-structured normal equations (MINRES in the code), then U_out, then the core, each an exact
Σ-weighted least-squares step; the relative Σ-error is tracked, the previous iterate is restored and
the loop stops if it increases, and the loop stops when it decreases by less than ``tol``.  The
factorised conv is 1×1 → k×k → 1×1.  Claims: often competitive accuracy *without fine-tuning*, and a Σ
estimated on another dataset transfers with a minor drop (ResNet-18/50, GoogLeNet on ImageNet,
FGVC-Aircraft, CIFAR-10/100).

**This package.**  :mod:`sigma` — Σ from ``F.unfold`` patches via forward pre-hooks, eigenvalue floor
and symmetric square root; :mod:`als` — Tucker2-ALS-Σ and CP-ALS-Σ; :mod:`baselines` — tensorly's
``partial_tucker`` / ``parafac`` in the Frobenius norm; :mod:`ratio` — parameter counts and ranks for a
compression ratio; :mod:`model` — the small MNIST ResNet, its cache, the factorised convs and the Σ
image sources; :mod:`run` — the registered ``tensor_compress`` method.

**Deliberate deviations / choices**

* Setting: a ResNet with one BasicBlock per stage (widths 8/16/32 by default, ~97.5% accuracy) trained
  6 epochs on 4,000 of the 5,000 offline MNIST images, scored on the other 1,000 (not ImageNet-scale
  models).  Its 8-32-channel convs have little redundancy, so every method loses much more accuracy
  at a given ratio than the paper's ResNets; the comparison between norms is what is tested.
  All six 3×3 block convs are compressed at once; the stem (one input channel), the 1×1 shortcuts
  and the head are kept.  Ranks: the same per-layer parameter budget for Tucker-2 (r_in/C_in =
  r_out/C_out) and CP, rounded down (the paper chooses ranks per layer differently; not reproduced).
* Σ is floored (eigenvalues ≥ ``sigma_floor``·λ_max) and its square root taken by eigendecomposition;
  the code takes a Cholesky factor after adding 10⁻⁹…10⁻³ to the diagonal when needed.  Any square
  root gives the same objective.  Σ uses ``sigma_images`` images (the code: the whole dataset).
  ``*_sigma`` and ``*_sigma_transfer`` use the same Σ for every ratio; the Σ-error columns of the
  layer table always use the MNIST Σ.
* The Kronecker-structured updates (Tucker's U_in, CP's B and C) are solved matrix-free by
  Jacobi-preconditioned conjugate gradients warm-started at the current factor (the code: MINRES,
  tol 1e-10, 2,000 iterations, cold start).  CG never increases the block objective even when cut
  short; the other updates are dense solves, as in the code.
* The revert check also runs after the first sweep (the code checks from the second sweep on).
* CP-ALS-Σ (code not seen) is our derivation: a 3-way CP of (C_out, C_in, k²) with tensorly's SVD
  initialisation and parafac's mode order, every mode's least squares in the Σ-norm; its factorised
  conv is 1×1 → depthwise k×k → 1×1.  (The paper's CP may split the two spatial modes.)
* Transfer: Σ from scikit-learn's 8×8 digits upsampled to 20×20 and padded to 28×28 (MNIST's framing),
  through the MNIST model; ``noise`` (white-noise images) is a harsher alternative.
* BatchNorm keeps the original statistics after compression (no re-calibration, no fine-tuning).
"""

from central.tensor_compress import run  # noqa: F401  (registers the "tensor_compress" method)
from central.tensor_compress.run import TensorCompressParams, check, run_tensor_compress

__all__ = ["TensorCompressParams", "check", "run_tensor_compress"]

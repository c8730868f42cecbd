"""Identifiability of deep polynomial neural networks (Usevich, Borsoi, Dérand, Clausel; arXiv:2506.17093).

Paper: https://arxiv.org/abs/2506.17093 — no code was released; only the paper's abstract and
published summaries could be read offline, so the statements below marked [I] are our reading.

**Setting, as in the paper.**  ``f_θ(x) = W_L σ(W_{L−1} … σ(W_1 x + b_1) … + b_{L−1}) + b_L`` with
σ(t) = t^r, widths d = (d_0, …, d_L), with biases or without (homogeneous PNN, "hPNN").  The output
is a vector of d_L polynomials of degree D = r^{L−1}; the closure of the set of such functions is the
*neurovariety*.  Each hidden neuron carries a scaling symmetry (incoming row × t, outgoing column ×
t^{−r}) and each hidden layer the permutations of its neurons, so the *expected dimension* is
``min(#params − Σ_hidden d_l, d_L · #monomials)``; the network is (finitely) *identifiable* when a
generic θ is determined by f_θ up to these symmetries (finitely many choices).  The paper proves a
localisation theorem — the deep network is identifiable iff every two-consecutive-layer block
(d_{l−1}, d_l, d_{l+1}) is — via a link between each block and a partially symmetric CP
decomposition with Kruskal-type uniqueness; pyramidal (non-increasing) widths are identifiable under
mild conditions, encoder–decoders when the decoder does not widen too fast for r, the required
degree is linear in the widths (earlier bound: quadratic), biases are handled by homogenisation.

**What this package computes** (a numerical check of those statements, not the paper's proofs):

* :mod:`pnn` — the map (numpy/torch float, exact mod p, exact Fraction expansion into coefficients)
  and the symmetry action;
* :mod:`jacobian` — the Jacobian of θ ↦ (values at N = #params + 4 generic points), whose rank equals
  that of θ ↦ coefficients; its rank over F_p (p = 2^31 − 1) at random points is a certified lower
  bound on the generic rank, so reaching #params − Σ_hidden d_l *certifies* finite identifiability;
  float64 ranks (torch.func.jacrev + SVD with a gap criterion) and sympy coefficient-Jacobian ranks
  cross-check it on small cases;
* :mod:`dimension` — the counts, the verdict (identifiable / filling / defective with its defect),
  the two-layer blocks, and Kruskal-type sufficient conditions per block [I: derived by us];
* :mod:`recover` — Levenberg–Marquardt fits from random restarts to the network's values, compared
  with the truth after canonicalising the scaling/permutation symmetries;
* :mod:`run` — the registered method ``pnn_ident``: the architectures × degrees → verdict table,
  block verdicts beside whole-network ones, degree thresholds vs width, recovery.

**Deliberate deviations / choices**

* Verdicts are *finite* (local) identifiability from the generic Jacobian rank; the paper's global
  uniqueness (up to symmetries) is only checked through the Kruskal-type condition and, empirically,
  through recovery.
* The defective verdict is probabilistic: a rank below the bound at ``trials`` random F_p points
  (false-alarm probability ≲ degree/p by Schwartz–Zippel); an identifiable verdict is certain.
* N = #params + 4 evaluation points, not N ≥ the ambient dimension: the rank cannot exceed #params,
  and N ≥ rank generic points already preserve it (argument in :mod:`jacobian`).
* One activation degree r for all hidden layers (the paper allows r_l per layer).
* With biases, each block is tested as a stand-alone biased two-layer PNN and the Kruskal-type check
  is applied to the homogenised block [I]; the paper's exact statement for biased blocks was not read.
* "Mild conditions" of the pyramidal regime are read as r ≥ 2, and r ≥ 3 when a block ends in width 1
  (what the (r+1)-way Kruskal bound gives) [I].
* Recovery fits the values at random points (least squares), not the paper's constructive
  tensor-decomposition algorithm.
"""

from central.pnn_ident import run  # noqa: F401  (registers the "pnn_ident" method)
from central.pnn_ident.run import PNNIdentParams, check, run_pnn_ident

__all__ = ["PNNIdentParams", "check", "run_pnn_ident"]

"""LRQK — Low-Rank Query-Key attention for long-context decoding (Li et al., NeurIPS 2025, arXiv:2510.23649).

Paper: https://arxiv.org/abs/2510.23649 · code read: github.com/tenghuilee/LRQK, ``lrqk_attention.py``
(``_lrqk_prefill_inv[_w1]``, ``_lrqk_decode_inv[_w1]``, ``LightAttentionIndicesFactory``).

**Algorithm, as the authors code it** (this package implements the code's *penalised* formulation,
not the poster's constrained one; see :mod:`central.lrqk.factor` for the equations):

* Prefill — exact attention.  Per layer and *query* head (K is repeated to the query heads first),
  ``Q ≈ A_Q B_Q`` and ``K ≈ A_K B_K`` with rank r by alternating least squares on
  ``½‖QKᵀ − A_QA_Kᵀ‖² + ½λ_Q‖Q − A_QB_Q‖² + ½λ_K‖K − A_KB_K‖²`` (randn init, 2 sweeps, λ = 1).
  The initial top-k set is scored with the last row of ``A_Q``.
* Decode step t — ``q̂, k̂ ∈ ℝ^r`` by 2 ALS sweeps on ``½‖q̂B_Q − q‖² + ½‖k̂B_K − k‖² + ½λ₁(q̂k̂ᵀ − qkᵀ)²
  + ½λ₂‖q̂A_{K,Ω}ᵀ − qK_Ωᵀ‖²`` (Ω = the tokens attended at t−1, their true full-precision keys), one
  exact-line-search gradient step on ``B_Q`` and ``B_K``, ``k̂`` appended to ``A_K``; proxy scores
  ``q̂A_Kᵀ`` over the tokens before the recent window (O(l·r)) → top-k (sorted) ∪ the ``window``
  most recent ("lite") tokens; a per-head buffer of k K/V slots keeps hits and copies only the
  misses from the full-precision store; exact softmax attention over those k + window rows.

**Here**: a custom attention function registered with transformers' ``AttentionInterface``
(:mod:`central.lrqk.attend`) runs this in every decoder layer of a real Llama (the kit's tiny LM or
SmolLM2-135M, 3 KV heads for 9 query heads) while a long held-out stdlib file is decoded with
teacher forcing; the ``DynamicCache`` plays the CPU-side store.  Baselines at the same budget
(k + window tokens): full attention, the recent window alone, Quest-style pages (per-channel min/max
key summaries, page upper bounds ``Σ max(q·min, q·max)``, top ``k / page_size`` pages + the same
window) and the exact top-k (an oracle: what a perfect proxy would select).

**Deliberate deviations**

* λ ≠ 1 in prefill: the code's general-λ path updates A_K with the *old* A_Q (Jacobi), its λ = 1
  path (the one it always runs: ``DynamicLRQKCache`` never forwards λ) with the new A_Q
  (Gauss–Seidel).  We always use Gauss–Seidel, so the objective decreases monotonically.
* The decode update uses Ω_{t−1} = previous top-k ∪ previous window with their own ``A_K`` rows;
  the code's buffer at that moment already holds the new k_t in a lite slot whose ``A_K`` row is still
  zero (a no-op term) and has evicted the oldest lite token.
* Candidates for top-k are all tokens before the window ``[0, t−w+1)``; the code's ring buffer of
  lite tokens leaves one token (position t−w) out of both sets.
* Copies are counted, not timed: rows copied per step with the hit/miss buffer vs without (all k
  rows every step), summed over layers and query heads (GQA groups fetch per query head, as in the
  code).  No CPU/GPU, no asynchronous offload, float32 throughout (the code runs bf16 with f32 solves).
* "Fast memory" bytes are computed analytically (``run.fast_bytes``), not measured.
* Teacher forcing: every method decodes the same tokens; Δloss is the mean next-token loss
  difference against the full-attention replay over the decoded tokens.
* The kit's tiny LM was trained on 128-token windows, so 1K+ contexts are out of its range (full-attention
  loss ≈ 4.9 there vs 3.7 held out at 128 tokens, and the recent window alone *lowers* its loss): its
  recall / output error are informative, its Δloss is not; the loss claim is checked on SmolLM2.
"""

from central.lrqk import run  # noqa: F401  (registers the "lrqk" method)
from central.lrqk.run import LRQKParams, check, run_lrqk

__all__ = ["LRQKParams", "check", "run_lrqk"]

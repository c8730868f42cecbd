"""HeavyWater and SimplexWater: LLM watermarks as optimal transport (arXiv 2506.06409, Tsur et al.).

Paper: "HeavyWater and SimplexWater: Watermarking Low-Entropy Text Distributions",
https://arxiv.org/abs/2506.06409; code: github.com/DorTsur/HeavyWater_SimplexWater
(``watermark/linear_code.py``, ``watermark/heavy_tail_randscore.py``, ``watermark/exponential.py``).

The algorithm as the authors coded it (and as :mod:`central.watermark.schemes` does it)
----------------------------------------------------------------------------------------
At every generation step, with next-token distribution P_X:

1. side information s from a PRNG seeded by the key and the previous token (``markov_1``);
2. P_X is top-p filtered (p = 0.999: the smallest most-likely set with mass >= p) and renormalised;
3. the entropic OT coupling π of P_X and Unif(S) is computed with ``ot.sinkhorn`` (reg 0.05, at most
   2000 iterations, stop threshold 1e-5) for the cost below;
4. the token is drawn from x ~ π[:, s] / Σ_x π[x, s].  Averaging over s gives back P_X, so the
   scheme is distortion-free up to the Sinkhorn tolerance.  An optional tilt δ multiplies
   π(x, s) by (1+δ) where f(x, s) = 1 and (1−δ) where f = 0 (trading distortion for detection).

* **SimplexWater**: n = ⌈log₂ V⌉, s uniform on {1, …, 2ⁿ−1}, score f(x, s) = ⟨bin(x), bin(s)⟩ mod 2
  (the binary simplex code), cost 1 − f; detection z = (Σ_t f − T/2)/√(T/4), p = 1 − Φ(z).
* **HeavyWater**: f(x, s) i.i.d. lognormal(0, 1) per (token, s), s ∈ {1..1024}, each token row
  standardised (mean 0, variance 1), the table seeded by the key; cost −f shifted and /10;
  detection z = Σ_t f/√T, p = 1 − Φ(z).
* Baselines with the same keyed side information: **Red-Green** (Kirchenbauer et al.: a γ=0.5 green
  list per context, +δ=2 on its logits, z = (#green − γT)/√(Tγ(1−γ))) and **Gumbel** (Aaronson:
  x = argmax r_x^(1/p_x) over the top-p set for keyed uniforms r, score Σ −log(1 − r_x) ~ Gamma(T, 1)).

The experiment (:mod:`central.watermark.experiment`, :mod:`central.watermark.method`) measures TPR at
1% FPR against the number of scored tokens T, with the threshold taken from unwatermarked sequences
scored with the same key (half of them; the other half checks the FPR, and the nominal p-values'
FPR is reported too), on (i) synthetic streams of Dirichlet next-token distributions binned by
entropy and (ii) a kit LM continuing held-out stdlib code; and the distortion KL(P ‖ P̂) of the
average sampling distribution P̂ over the side information, plus the LM perplexity of the text.

Deliberate deviations
---------------------
* Context hash: the PRNG is ``numpy.random.default_rng([key, previous token])`` (a SeedSequence
  hash) instead of ``torch.Generator.manual_seed(key × previous token)``, which makes token 0
  unkeyed; HeavyWater's table is drawn from ``default_rng([key, 0x4EA7])`` instead of
  ``np.random.seed(key)``.  Same roles, different PRNG streams.
* Sinkhorn is POT's ``sinkhorn_knopp`` re-implemented for a batch of problems that share one kernel
  (matrix products in torch; same initialisation, updates, error and stopping rule, each problem
  stopping on its own; a test checks plans and iteration counts against ``ot.sinkhorn``).  The
  experiments run it in float32 by default (``sinkhorn_dtype``; about 2× faster, the same
  iteration counts in our checks); the authors' POT call runs in float64.
* HeavyWater's shift is the table's global maximum (the authors shift by the minimum over the
  current top-p rows); a constant shift does not change the Sinkhorn plan.
* Tilt for HeavyWater: the authors' code compares the continuous score with 1 and 0, which never
  matches, so their tilt is a no-op there; ours tilts up where f > 0 and down elsewhere.
* HeavyWater's p-value: the normal approximation 1 − Φ(z) ignores the lognormal skew and is
  anti-conservative for short texts (its FPR is reported as ``fpr_normal_approx``); the FPR check
  uses an exact Monte-Carlo p-value given the tokens (s_t i.i.d. uniform under H0).  TPRs use the
  empirical null threshold, which needs neither.
* Synthetic streams draw each step's distribution from a finite pool (``pool`` per entropy bin),
  so each coupling is computed once.  The entropy is that of the unfiltered distribution.
* Gumbel's P̂ is a Rao-Blackwellised Monte-Carlo estimate (Red-Green's a plain Monte-Carlo one),
  so their KL includes Monte-Carlo error of order (support size)/(2 × ``distortion_draws``).
* torch runs single-threaded inside the Sinkhorn loop and the LM generation (two threads on a loaded
  2-core machine were up to 100× slower).
* Reporting additions: LM text is also scored once per (previous token, token) pair (regime
  ``<lm>-dedup``; watermarked LM text repeats pairs far more often than unwatermarked text, which
  inflates the authors' per-token statistics), and the unwatermarked perplexity is measured on the
  same prompts as the watermarked one.
* Repetition next to perplexity (:func:`central.watermark.experiment.repetition`): repetitive text is
  cheap for the model, so a watermark that makes text loop can look as fluent as plain text.  For the
  unwatermarked (``none``) and each watermarked generation the run logs ``repeated_pairs/<scheme>/<lm>``
  (share of positions whose (previous token, token) pair occurred earlier in the same sequence),
  ``distinct_2/<scheme>/<lm>`` (distinct pairs / all pairs over the ``lm_sequences`` sequences; the
  unwatermarked set has the same prompts and size), ``ppl_first_pairs/<scheme>/<lm>`` (perplexity over
  first occurrences only) and ``entropy/<scheme>/<lm>`` (mean entropy of the sampling distribution);
  the ``lm`` table adds ``repeated_pairs_ratio`` (to the unwatermarked text) and the ``summary`` table
  shows them beside ``ppl``.

Low-entropy LM setting
----------------------
The default LM test bed (the drafter continuing stdlib code at ``temperature: 1``) was reported to
sample at about 2.8 nats, where every scheme detects within 25 tokens: it does not test the
low-entropy claim.
``params.temperature`` < 1 (e.g. ``params.temperature=0.3``) samples every scheme from
softmax(logits / temperature), a low-entropy distribution, while perplexity stays the model's own
(temperature 1) NLL; distortion-freeness is then relative to the tempered distribution.  Check
``entropy/none/<lm>`` lands in the synthetic low bins before reading the TPRs.  ``lms: [smollm2]``
at low temperature is the real-LM version (slow on CPU: see the cost below).  Neither is run by the
claim check, which is synthetic only.

Cost: HeavyWater's Sinkhorn (|S| = 1024, about 150-450 iterations at the LM's entropy) dominates;
SimplexWater on SmolLM2 (V = 49152, so |S| = 65535) takes tens of seconds per generated token on
CPU, so ``lms: [smollm2]`` is for a handful of short sequences only.
"""

from central.watermark import method  # noqa: F401  (registers "watermark")

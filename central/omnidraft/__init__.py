"""OmniDraft: a cross-vocabulary, online adaptive drafter for speculative decoding.

Paper: Qualcomm AI Research, "OmniDraft: A Cross-vocabulary, Online Adaptive
Drafter for On-device Speculative Decoding", arXiv 2507.02659, NeurIPS 2025.  No official code: this
follows the research notes (``/work/shared/research/central.md`` §1), where **[R]** marks what the
paper states and **[I]** what was inferred.  Every [I] choice is a parameter (see below).

The algorithm, per generated block
----------------------------------
1. The drafter (its own BPE vocabulary) samples up to ``k`` draft tokens d₁…d_k, KV-cached.
2. **Translation [R]**: a draft run that matches an entry of the online **n-gram cache**
   C = {(t, [d_j])} (a target token and the draft tokens that spell the same bytes) is merged into
   that target token, longest match first (e.g. 'Ġf' + 'la' + 'ke' → 'Ġflake'); any other draft token
   maps to the target token with the same text (the vocabulary intersection, all UAG has).  A draft
   token with neither stops the translation.  Proposals: m ≤ k target tokens.
3. **q′ [R]**: q′(t) = q(d) for a direct token, q′(t) = ∏_j q(d_j) for a merged one (the paper's;
   greedy verification does not need it, and sampling uses the exact Q of ``exact.py`` instead).
4. **Verification in the target vocabulary**: one target forward over [last token, t₁…t_m] (KV
   cached).  Sampling: accept tᵢ with probability min(1, p(tᵢ)/q′(tᵢ)); at the first rejection draw
   from the normalised residual (p − q̃)₊; a bonus token from p when all m are accepted [I: the
   standard lossless rule].  Greedy: accept while tᵢ = argmax p, then emit the argmax.
5. **Cache fill [I]**: every committed target token whose bytes the draft tokenizer spells with 2..
   ``ngram_max`` tokens is added (key: the draft tokenizer's own BPE spelling of those bytes).
6. **Online hybrid distillation [R: a hybrid loss; LoRA]** (variant c): after every block, one Adam
   step on LoRA adapters of the drafter, on the last ``train_window`` drafter tokens, with
   L = mean over the block's committed target tokens of
   ``kd_weight``·KL(p̂ ‖ q) at direct-mapped positions (p̂: the target's p carried into the draft
   vocabulary) and ``ngram_weight``·(−log ∏_j q(d_j)) at n-gram positions [I: the form of both terms].
7. **Adaptive draft length [R: a head that changes the proposal length]** (variant d): a logistic head
   on the drafter's last hidden state predicts whether the draft token just sampled will be accepted;
   drafting stops after a token whose prediction is below ``head_threshold`` [I: SpecDec++-style];
   it is trained online (BCE on a replay buffer) with labels min(1, p/q′) (sampling) or 1[tᵢ = argmax]
   (greedy) for every proposed draft token, 0 for an untranslatable one.

Variants: (a) intersection only, (b) + n-gram cache, (c) + online distillation, (d) + adaptive length.
The stream: the first ``prompt_tokens`` target tokens of held-out stdlib files, one after the other
(in a seeded order; ``shuffle_stream=false``: sorted), each continued by ``new_tokens`` tokens; the cache, the LoRA weights and the head persist across prompts.

[I] choices and the parameters that switch them
-----------------------------------------------
* acceptance min(1, p/Q) with residual resampling (``mode=sample``), Q the exact proposal
  probability of the path-local walk (``exact.py``; deviates from greedy longest-match translation);
* cache filled from committed target tokens (``cache_prompt``: also from the prompt's tokens);
* KD target: ``kd_target`` = ``intersection`` (p on same-text tokens, renormalised) or ``first_token``
  (each target token's mass on the first draft token of its spelling); n-gram term: ``ngram_loss`` =
  ``nll`` or ``weighted_nll`` (× p(t)); weights ``kd_weight``, ``ngram_weight``;
* LoRA placement: all projections of the last ``lora_layers`` layers (0 = all), rank ``lora_rank``;
* head: ``head_rule`` = ``token`` (stop when P(accept) < threshold) or ``cumulative`` (∏P < threshold);
  ``head_features`` = ``hidden`` or ``hidden+conf`` (+ log q(d) and the entropy of q).

Deviations and caveats (deliberate)
-----------------------------------
* Scale: the kit's 4.2M-parameter target (BPE 4096) and 0.27M drafter (BPE 512) trained on stdlib
  code (``target=smollm2`` swaps in SmolLM2-135M with its 49k vocabulary), not Llama-68M → 7-8B
  targets.  The 512 vocabulary is a subset of the 4096 one (same corpus, same BPE trainer), so the
  intersection is the whole draft vocabulary and every gain of (b) comes from merges.
  At this scale a drafter forward costs nearly as much as a target forward on CPU (Python overhead
  dominates), so the wall-clock speed-up is reported but accepted tokens per target call is the
  scale-free measure.
* Exactness: greedy verification is exactly lossless for every variant (tested token for token).
  Speculative sampling is exact for every variant (issue #26).  It used to translate the draft by
  greedy longest match and verify with the single-path q′ = ∏q and an estimated residual, which is
  not the probability that the procedure proposes the target token (a direct proposal d→t is made
  only when no cache entry starting with d completed, and the breaking token was reused by the next
  proposal): χ² p ≈ 1e-57 with 20,000 draws.  Sampling now drafts and translates with the path-local
  walk of :mod:`central.omnidraft.exact` (a look-ahead token is discarded, never reused), whose
  proposal probability Q(t) — summed over the direct twin and the cache key of t — needs only the
  drafter rows along those paths; the residual (p − Q)₊ is drawn by rejection from point values of Q.
  The draft budget k and the head are checked only between proposals (a proposal started before the
  budget runs out is finished: a block may consume up to k − 1 + ``ngram_max`` draft tokens).  The
  translation therefore differs from greedy mode's, and so do sampling-mode acceptance numbers.
  A second bias was found and fixed on the way: a block cut by the requested length kept an
  untranslatable draft token at the last allowed position and drew it from the residual.  The
  check (``dist_samples``) runs the decoder's own code on a toy world with a closed-form target —
  positions 1-3 and the pair (1, 2), chi-square and TV, plus the pre-fix sampler as a negative control.
* After each distillation step the drafter's KV cache is rebuilt (its weights changed); the
  target's cache is always reused (cropped to the accepted prefix on rejection).
* The drafter's context is the draft-token spelling of the committed text built incrementally
  (accepted draft runs + the draft tokenizer's spelling of each corrected/bonus token), not a
  re-tokenisation of the whole text, so its KV cache survives across blocks.
* The drafter's context is cut to its last ``drafter_window // 2`` tokens whenever it would pass
  ``drafter_window`` (default 128, its training length: its loss rises from 2.7 to 4.3 nats between
  positions 128 and 384), which costs one recomputation of its cache.
* Metrics: ``accepted_per_call`` = accepted draft proposals (target tokens) per target forward;
  ``tokens_per_call`` adds the corrected/bonus token (target-only decoding = 1);
  ``calls_per_char``; ``wasted_per_token`` = drafted tokens not in an accepted proposal per generated
  token; ``speedup`` = target-only seconds / speculative seconds on the same prompts, interleaved
  (``speedup_end_to_end`` also counts the online LoRA and head updates, which a deployment could
  run in the background); ``acceptance_rise`` = last third minus first third of the stream (per-prompt
  accepted per call), ``rise_vs_b`` the same for the per-prompt gain over (b); ``head_auc`` = ROC AUC
  of the head's predictions, made while drafting, against the acceptances learned afterwards.
* Speed (issue #26).  Every run profiles its decoding: ``CachedLM`` times each model's forwards, so
  each variant's decode time splits into target forwards, drafter forwards, drafter re-encodings after
  a distillation step (its KV cache is dropped) and Python (translation, n-gram look-ups,
  verification, bookkeeping): the ``time_split`` table, the ``where_the_time_goes`` plot and the
  ``timing/*`` metrics, with the drafter-to-target forward cost ratio and the ratio at which the
  speed-up would be 1.  The profile showed transformers' per-forward Python overhead making the
  0.27M drafter's forward cost as much as the 4.2M target's, so both models (and the target-only
  baseline) decode through :mod:`central.lm.lean` by default (``lean_forward``): the same function
  (tested to 1e-10 in float64), several times less overhead per forward.  ``lean_forward=false`` is
  transformers' forward; ``benchmarks/bench_omnidraft.py`` compares the two.
* Wall-clock timings run with ``threads`` torch threads (default 1: on a shared 2-core machine
  OpenMP spinning makes 2 threads up to ~30× slower for these tiny models).
"""

from central.omnidraft import method  # noqa: F401  (registers "omnidraft")
from central.omnidraft.method import OmniDraftParams, run_omnidraft

__all__ = ["OmniDraftParams", "run_omnidraft"]

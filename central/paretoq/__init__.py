"""ParetoQ — unified 1/1.58/2/3/4-bit quantisation-aware training (Liu et al., Meta; arXiv 2502.02631).

Paper: https://arxiv.org/abs/2502.02631 — code: facebookresearch/ParetoQ (``models/utils_quant.py``,
``models/modeling_llama_quant.py``, ``train.py``), which this module follows.

The algorithm as the authors code it (``quant.py``):

* **Weight-only** fake quantisation of every linear layer inside the transformer blocks (q/k/v/o,
  gate/up/down); token embeddings and the LM head stay in full precision.  Activations are not
  quantised.
* A learnable **per-output-row scale** α (``weight_clip_val``, out × 1) per layer, initialised from
  the full-precision weights: mean|w| (1 bit), max|w| (ternary, 2 bits), max|w|/(2^(b−1)−1) (3, 4 bits).
* **LSQ** for 1, 3 and 4 bits: q = clamp(round(w/α), −2^(b−1), 2^(b−1)−1)·α; 1 bit is sign(w)·α.
* **SEQ** (stretched elastic quant) for ternary and 2 bits:
  q = (round(clamp(w/α, −0.99, 0.99)·n − s) + s)/n·α with (n, s) = (1.5, 0) → {0, ±⅔α} and
  (2, ½) → {±¼α, ±¾α}.
* **Straight-through** gradients: the latent weight gets the upstream gradient where w/α lies in the
  clip range ([Qn, Qp] for LSQ, ±1 for 1 bit, ±0.99 for SEQ) and zero outside; α gets the LSQ
  gradient Σ_row [Qn | Qp | q(w/α) − w/α]·g (1 bit: Σ_row sign(w)·g) times 1/√(numel·Qp), numel of
  the whole matrix.  Kept as coded: SEQ's clipped-weight term is ±(n − s)/n, which is 1 for ternary
  although a clipped ternary weight sits at ±⅔α; SEQ's gradient scale uses Qp = 1 for both widths.
* **Budget split** (the paper's training-strategy study): a fixed budget of B steps, the first (1−f)·B
  in full precision, then f·B steps of QAT of all parameters.  f = 0 is post-training quantisation
  of the full-precision model (the scale initialisation, no training); f = 1 is QAT from scratch.
  The authors' QAT recipe: AdamW, cosine schedule, no warm-up, no weight decay, lr 2e-5.

What the sweep measures (``run.py``): held-out loss (the kit's ``mean_loss``), model bytes, and the
relative change ‖W_after − W_fp‖/‖W_fp‖ of the block linears' latent weights over the QAT phase (and
of their quantised values), for bits × QAT fraction (× model width); plots loss vs bytes with the
Pareto front, loss vs QAT fraction, and weight change vs bits.

Deliberate deviations:

* **Scale.** A tiny Llama from the kit (``central/lm/tiny.py``) trained from scratch on stdlib
  source for a few hundred steps, not LLaMA/MobileLLM on billions of tokens.  The claim check
  (``experiments/reproduce/paretoq.yaml``) uses the kit's ``drafter`` preset at two widths, not
  ``target``: the full grid costs 13.4 budgets of training per width and seed, and ``target`` takes
  about 1 CPU-second a step at one thread here (its variant is a CLI override, see the spec).
* **QAT learning rate.** ``qat_lr`` (default 1e-3) instead of the authors' 2e-5: their rate is for
  fine-tuning pretrained LLMs; at our budget of tens of QAT steps 2e-5 barely moves the weights.
  One rate for every bit width, as the authors.  Picked by a small pilot on held-out loss (drafter,
  d=96, B=600, f=0.1, lr ∈ {1e-4, 3e-4, 1e-3}): 1e-3 was best at 1/1.58/2 bits and on average, but
  3e-4 was better at 3 bits and 1e-4 at 4 bits (by 0.01–0.03 nats), so a single rate slightly
  favours the low bit widths and post-training quantisation at 3/4 bits.  Schedule shape as the
  authors' (cosine to 0, no warm-up, wd 0).  QAT from scratch (f = 1) is pre-training, so it takes
  the kit's pre-training recipe (lr, warm-up, wd 0.1 on weights, cosine to 10%) instead.  The scales
  never get weight decay.
* **Full-precision phase.** The kit's trainer (AdamW, warm-up, cosine) over (1−f)·B steps, its
  warm-up kept at the preset's share of the steps: one FP run per fraction, as in the paper's
  fixed-budget study.
* **1-bit sign.** sign(0) = +1 (the authors' ``torch.sign`` maps an exact zero to 0, a third value a
  1-bit store cannot hold); irrelevant for trained float weights.
* **Model bytes** (the paper's "model size" is not spelt out): quantised weights packed at b bits
  per weight, ternary five weights per byte (1.6 bits/weight), per layer rounded up to whole bytes;
  scales and every other parameter (embeddings with the tied head counted once, norms) at 16 bits
  (``fp_bits``), as the authors' bf16 checkpoints store them.
* **Pareto front** over the best-over-fractions quantised point of each (width, bits), on two size
  axes: the whole model, and the block linears alone (packed weights + scales; the part ParetoQ
  quantises — at this scale the 16-bit embeddings dominate the whole-model bytes).  The 16-bit
  models are drawn for reference but are not part of the front.
* **Threads.** The sweep runs with one torch thread by default (``threads``): these matmuls are
  too small to gain from more, and on a shared 2-core machine OpenMP spinning made two threads
  several times slower.
* ``seq_bits`` (default [1.58, 2], the authors') lets a run use LSQ at 2 bits or ternary, the
  SEQ-vs-LSQ comparison the notes suggest.
"""

from central.paretoq import run  # noqa: F401  (registers the "paretoq" method)
from central.paretoq.quant import (LSQ, SEQ, QuantLinear, init_scale, levels, model_bytes, packed_bytes,  # noqa: F401
                                   quantize, quantize_model)

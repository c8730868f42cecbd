"""The tiny CLIP's word-level tokenizer (``tokenizers`` WordLevel over the world's words)."""

from __future__ import annotations

import functools

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from central.clic.world import World

PAD, CLS, UNK = "<pad>", "<cls>", "<unk>"


@functools.lru_cache(maxsize=8)
def word_tokenizer(world: World, max_len: int) -> Tokenizer:
    """``<cls>`` + whitespace-split words, right-padded with id 0 (and truncated) to ``max_len``."""
    vocab = {w: i for i, w in enumerate([PAD, CLS, UNK, *world.words()])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single=f"{CLS} $A", special_tokens=[(CLS, vocab[CLS])])
    tok.enable_padding(pad_id=vocab[PAD], pad_token=PAD, length=max_len)
    tok.enable_truncation(max_len)
    return tok


def encode(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """Token ids of the texts, (N, L) with L the longest text's length (at most ``max_len``)."""
    ids = torch.tensor([e.ids for e in tok.encode_batch(texts)], dtype=torch.long)
    return ids[:, : int((ids != 0).sum(1).max())]


def pad_cat(batches: list[torch.Tensor]) -> torch.Tensor:
    """Row-wise concatenation of id batches of different lengths (right-padded with 0)."""
    width = max(b.shape[1] for b in batches)
    return torch.cat([torch.nn.functional.pad(b, (0, width - b.shape[1])) for b in batches])

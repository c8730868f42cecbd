"""The ComBo head: per-(backbone, layer) linear compression, token-wise concatenation, a small transformer.

For token t of the common grid, backbone k and layer l give a feature f_{k,l,t} ∈ ℝ^{D_{k,l}};
the head computes

    z_t = [W_{k,l} f_{k,l,t} + b_{k,l}]_{(k,l)} ∈ ℝ^{K·L·d}           (compression + concatenation)
    h   = TransformerEncoder([cls; z_1; …; z_T] + pos)                  (pre-LN, ``depth`` blocks)
    ŷ   = Linear(LayerNorm(h_cls))                                       (task head)

and the task relevance of backbone k is ``Σ_l ‖W_{k,l}‖_F`` (:meth:`ComboHead.relevance`).

Initialisation [ours; the paper does not state it, and no code was found].  The projections start at
``proj_init`` (default 0.01) × PyTorch's default Linear init, weights and biases, so their final norms
are what training put there.  PyTorch's init gives every W_{k,l} the same expected norm (‖W‖_F² ≈ d/3
whatever D_{k,l}); after our short training the norms stay within a few percent of that start
(``proj_init=1``: relevance spread ≈ 4%), and the init noise, not the task, decides the ranking.
Every scale ≤ 0.1 gave the same ranking on the mini-VTAB (see :mod:`central.combo`); the claim check
runs both 0.01 and 1.

Order invariance.  The head sorts the backbones by name before concatenating, and every projection
W_{k,l} is initialised from a seed derived from (seed, backbone name, layer); the transformer, the
cls/pos embeddings and the batch order depend on the seed and the number of backbones only.  So
listing the backbones in another order trains the very same network: the relevance scores come
back permuted the same way, bit for bit, and a kept backbone starts its top-k retrain from the same
projection it started with in the full run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from central.combo.features import LayerMaps
from fedsim.seeding import derive_seed


@dataclass(frozen=True)
class HeadRecipe:
    """The one fixed recipe of every ComBo head (no per-task tuning)."""

    proj_dim: int = 8  # d: the compressed width of each (backbone, layer)
    depth: int = 1
    heads: int = 4
    mlp_ratio: int = 2
    dropout: float = 0.1
    epochs: int = 30
    batch: int = 64
    lr: float = 2e-3
    weight_decay: float = 1.0  # AdamW (decoupled): the per-step shrink is lr × weight_decay
    proj_init: float = 0.01  # > 0: projections start at this × PyTorch's default init (ours; module docstring)


def _seeded_linear(d_in: int, d_out: int, seed: int, scale: float) -> nn.Linear:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layer = nn.Linear(d_in, d_out)
    with torch.no_grad():
        layer.weight.mul_(scale)
        layer.bias.mul_(scale)
    return layer


class ComboHead(nn.Module):
    """ComBo over the backbones ``names`` whose layers have widths ``dims[k] = [D_{k,1}, …]``."""

    def __init__(self, names: list[str], dims: list[list[int]], n_tokens: int, n_classes: int, recipe: HeadRecipe,
                 seed: int) -> None:
        super().__init__()
        if len(set(names)) != len(names):
            raise ValueError(f"backbone names must be distinct, got {names}")
        self.names = list(names)
        self.order = sorted(range(len(names)), key=lambda k: names[k])  # canonical: by name
        self.slots = [(k, layer) for k in self.order for layer in range(len(dims[k]))]
        self.proj = nn.ModuleList(_seeded_linear(dims[k][layer], recipe.proj_dim,
                                                 derive_seed(seed, "proj", names[k], layer), recipe.proj_init)
                                  for k, layer in self.slots)
        width = recipe.proj_dim * len(self.slots)
        if width % recipe.heads:
            raise ValueError(f"transformer width {width} is not divisible by {recipe.heads} heads")
        with torch.random.fork_rng():
            torch.manual_seed(derive_seed(seed, "body", len(self.slots)))
            self.cls = nn.Parameter(torch.zeros(1, 1, width))
            self.pos = nn.Parameter(0.02 * torch.randn(1, n_tokens + 1, width))
            block = nn.TransformerEncoderLayer(width, recipe.heads, recipe.mlp_ratio * width, recipe.dropout,
                                               activation="gelu", batch_first=True, norm_first=True)
            self.body = nn.TransformerEncoder(block, recipe.depth, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(width)
            self.out = nn.Linear(width, n_classes)

    def tokens(self, feats: list[LayerMaps]) -> torch.Tensor:
        """(N, T, K·L·d): every (backbone, layer) compressed token-wise, concatenated in canonical order."""
        return torch.cat([proj(feats[k][layer]) for proj, (k, layer) in zip(self.proj, self.slots)], dim=-1)

    def forward(self, feats: list[LayerMaps]) -> torch.Tensor:
        z = self.tokens(feats)
        x = torch.cat([self.cls.expand(len(z), -1, -1), z], dim=1) + self.pos
        return self.out(self.norm(self.body(x)[:, 0]))

    def relevance(self) -> torch.Tensor:
        """Per backbone, in the order of ``names``: Σ over its layers of ‖W_{k,l}‖_F."""
        scores = torch.zeros(len(self.names))
        for proj, (k, _) in zip(self.proj, self.slots):
            scores[k] += float(proj.weight.detach().norm())
        return scores


def _rows(feats: list[LayerMaps], idx: torch.Tensor) -> list[LayerMaps]:
    return [[m[idx] for m in maps] for maps in feats]


def train_head(names: list[str], feats: list[LayerMaps], y: torch.Tensor, n_classes: int, recipe: HeadRecipe,
               seed: int) -> ComboHead:
    """Train a ComBo head on cached features: AdamW, cosine schedule, mini-batches, cross-entropy."""
    head = ComboHead(names, [[m.shape[-1] for m in maps] for maps in feats], feats[0][0].shape[1], n_classes,
                     recipe, seed)
    decay = [p for n, p in head.named_parameters() if p.ndim >= 2 and n not in ("cls", "pos")]
    rest = [p for n, p in head.named_parameters() if not (p.ndim >= 2 and n not in ("cls", "pos"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=recipe.lr)
    n = len(y)
    steps = recipe.epochs * -(-n // recipe.batch)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(derive_seed(seed, "batches"))
    head.train()
    with torch.random.fork_rng():
        torch.manual_seed(derive_seed(seed, "dropout"))
        for _ in range(recipe.epochs):
            order = torch.randperm(n, generator=gen)
            for i in range(0, n, recipe.batch):
                idx = order[i:i + recipe.batch]
                loss = F.cross_entropy(head(_rows(feats, idx)), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
    return head.eval()


@torch.no_grad()
def predict(head: ComboHead, feats: list[LayerMaps], batch: int = 500) -> torch.Tensor:
    """Predicted classes of every row of ``feats``."""
    head.eval()
    n = len(feats[0][0])
    return torch.cat([head(_rows(feats, torch.arange(i, min(i + batch, n)))).argmax(1) for i in range(0, n, batch)])


def top_k(names: list[str], scores: torch.Tensor, k: int) -> list[str]:
    """The ``k`` backbones with the highest scores, best first (ties: the earlier in ``names``)."""
    order = sorted(range(len(names)), key=lambda i: (-float(scores[i]), i))
    return [names[i] for i in order[:k]]

"""The tiny CLIP: a small CNN image tower, a small transformer text tower, a learnable logit scale.

Both towers end in a linear projection to a shared ``embed`` dimension; the embeddings are
L2-normalised by :meth:`TinyCLIP.encode_image` / :meth:`TinyCLIP.encode_text`.  Everything of the
image tower lives under ``visual`` (the authors freeze the parameters whose name contains "visual").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

LOGIT_SCALE_MAX = math.log(100.0)  # the authors clamp the log scale to [0, ln 100] after every step


@dataclass(frozen=True)
class ModelSpec:
    vocab: int
    max_len: int = 24
    embed: int = 64  # shared embedding dimension
    width: int = 64  # text transformer width
    layers: int = 2
    heads: int = 4
    channels: tuple[int, int, int] = (16, 32, 64)


class ImageTower(nn.Module):
    """Three 3×3 conv blocks (ReLU, 2×2 max-pool), global average pooling, a two-layer head.

    The last conv layer's receptive field (22 px) spans both objects of a 32-px scene, so the pooled
    features can say which object is where; pooling makes the tower accept any image size, and a
    stacked pair of scenes is seen as the mean of the two scenes' features (up to the seam).
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        c1, c2, c3 = spec.channels
        self.convs = nn.Sequential(
            nn.Conv2d(3, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c2, c3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Linear(c3, 2 * spec.embed), nn.ReLU(), nn.Linear(2 * spec.embed, spec.embed))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.convs((images - 0.5) / 0.25).mean(dim=(2, 3)))


class TextTower(nn.Module):
    """Token + position embeddings, a pre-norm transformer encoder, the ``<cls>`` state, a projection."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.tokens = nn.Embedding(spec.vocab, spec.width)
        nn.init.normal_(self.tokens.weight, std=0.02)  # CLIP's initialisation of both embeddings
        self.positions = nn.Parameter(torch.randn(spec.max_len, spec.width) * 0.01)
        layer = nn.TransformerEncoderLayer(spec.width, spec.heads, 2 * spec.width, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, spec.layers, enable_nested_tensor=False)
        self.ln_final = nn.LayerNorm(spec.width)
        self.proj = nn.Linear(spec.width, spec.embed, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions[: ids.shape[1]]
        x = self.encoder(x, src_key_padding_mask=ids == 0)
        return self.proj(self.ln_final(x[:, 0]))


class TinyCLIP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.visual = ImageTower(spec)
        self.text = TextTower(spec)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.visual(images), dim=-1)

    def encode_text(self, ids: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.text(ids), dim=-1)

    def scale(self) -> torch.Tensor:
        return self.logit_scale.exp()

    def clamp_scale(self) -> None:
        with torch.no_grad():
            self.logit_scale.clamp_(0.0, LOGIT_SCALE_MAX)


def build(spec: ModelSpec, seed: int) -> TinyCLIP:
    """A freshly initialised tiny CLIP (initialisation seeded, global RNG untouched)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return TinyCLIP(spec)


def freeze_visual(model: TinyCLIP) -> list[nn.Parameter]:
    """The authors' ``freeze_visual_layers``: every parameter named "visual" frozen, the rest trainable;
    returns the trainable ones (text tower, its projection and the logit scale)."""
    trainable = []
    for name, p in model.named_parameters():
        p.requires_grad_("visual" not in name)
        if p.requires_grad:
            trainable.append(p)
    return trainable

"""The frozen backbones: one small CNN trained offline with different objectives, cached on disk.

Every backbone is the same :class:`ConvNet` (three 3×3 conv → ReLU → 2×2 max-pool blocks, widths
16/32/64 by default; on 32×32 inputs its three tapped layers give 16×16, 8×8 and 4×4 maps).  The
objectives (:data:`OBJECTIVES`) play the part of differently trained foundation models:

* ``supervised``: cross-entropy on MNIST digits 0–4 (head: global average pool → linear);
* ``rotation``: rotation prediction (0/90/180/270°, RotNet-style self-supervision) on the unlabeled
  pool (head: flattened last map → linear);
* ``autoencoder``: pixel MSE reconstruction of the unlabeled pool (three transposed convs decode the
  last map);
* ``random``: the seeded initialisation, never trained (the control that should rank last).

The unlabeled pool is half MNIST 0–4 images and half 64×64 patches (halved to 32×32) of the natural
images in :data:`central.combo.tasks.PRETRAIN_IMAGES`; no task uses either.  Digits are scaled and
placed afresh in every batch (:func:`central.combo.tasks.place`, the tasks' nuisance range), a data
augmentation that lets the trained backbones learn the invariances the digit tasks need.  Trained weights are cached
under ``$FEDSIM_CACHE/combo/`` keyed by the recipe (:func:`central.lm.cache.key_of`).

:func:`token_features` turns a backbone's layer maps into token grids: adaptive average pooling of
every map to ``grid × grid`` and a row-major flattening, so every (backbone, layer) gives a
(N, grid², D_l) tensor whose token t sees the same image region — the common token grid ComBo needs.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from central.combo.tasks import PRETRAIN_IMAGES, halve, mnist_unit, normalise, place
from central.image.data import crops, load_image
from fedsim.cache import cache_dir, cached_state, key_of

OBJECTIVES = ("supervised", "rotation", "autoencoder", "random")
SUPERVISED_CLASSES = 5  # MNIST digits 0–4


class ConvNet(nn.Module):
    """Three conv blocks; :meth:`layers` returns the three pooled maps (the tapped layers)."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64)) -> None:
        super().__init__()
        chans = (3, *widths)
        self.convs = nn.ModuleList(nn.Conv2d(a, b, 3, padding=1) for a, b in zip(chans[:-1], chans[1:]))
        self.widths = tuple(widths)

    def layers(self, x: torch.Tensor) -> list[torch.Tensor]:
        maps = []
        for conv in self.convs:
            x = F.max_pool2d(F.relu(conv(x)), 2)
            maps.append(x)
        return maps


@dataclass(frozen=True)
class BackboneRecipe:
    """Everything that determines a trained backbone (and keys its cache entry)."""

    objective: str
    widths: tuple[int, ...] = (16, 32, 64)
    images: int = 2500  # pretraining images (supervised: MNIST 0–4, at most 2,500; others: the unlabeled pool)
    epochs: int = 10
    batch: int = 64
    lr: float = 2e-3
    seed: int = 0


# -- pretraining data ------------------------------------------------------------------------------

@dataclass
class PretrainData:
    """Raw MNIST 0–4 digits (N, 28, 28) in [0, 1] with labels, and normalised natural patches (M, 3, 32, 32)."""

    digits: torch.Tensor
    labels: torch.Tensor
    natural: torch.Tensor

    def __len__(self) -> int:
        return len(self.digits) + len(self.natural)

    def batch(self, idx: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Images of rows ``idx`` (digits first, then patches); digits freshly scaled and placed."""
        is_digit = idx < len(self.digits)
        parts = [normalise(place(self.digits[idx[is_digit]], gen))] if bool(is_digit.any()) else []
        if not bool(is_digit.all()):
            parts.append(self.natural[idx[~is_digit] - len(self.digits)])
        labels = self.labels[idx[is_digit]]
        return torch.cat(parts), labels


def pretrain_data(objective: str, n: int, seed: int) -> PretrainData:
    """``supervised``: ``n`` MNIST 0–4 digits; otherwise the unlabeled pool, half digits, half natural patches."""
    x, y = mnist_unit()
    rows = np.flatnonzero(y < SUPERVISED_CLASSES)
    rng = np.random.default_rng(seed)
    n_digits = n if objective == "supervised" else n // 2
    rows = rows[rng.permutation(len(rows))[:n_digits]]
    n_nat = n - n_digits
    per = np.bincount(np.arange(n_nat) % len(PRETRAIN_IMAGES), minlength=len(PRETRAIN_IMAGES))
    natural = [halve(crops(load_image(name), 64, int(m), rng)) for name, m in zip(PRETRAIN_IMAGES, per) if m]
    patches = normalise(np.concatenate(natural)) if natural else torch.zeros(0, 3, 32, 32)
    return PretrainData(torch.from_numpy(x[rows]), torch.as_tensor(y[rows]), patches)


def rotate_batch(x: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image rotated by a random multiple of 90° (its label)."""
    k = torch.randint(0, 4, (len(x),), generator=gen)
    return torch.stack([torch.rot90(img, int(q), dims=(1, 2)) for img, q in zip(x, k)]), k


# -- the objectives --------------------------------------------------------------------------------

def _objective_head(recipe: BackboneRecipe) -> nn.Module:
    w = recipe.widths[-1]
    if recipe.objective == "supervised":
        return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(w, SUPERVISED_CLASSES))
    if recipe.objective == "rotation":
        return nn.Sequential(nn.Flatten(), nn.Linear(w * 16, 4))  # the 4×4 last map of a 32×32 input
    chans = (*reversed(recipe.widths), 3)  # autoencoder: upsample ×2 per block back to 3×32×32
    layers: list[nn.Module] = []
    for a, b in zip(chans[:-1], chans[1:]):
        layers += [nn.ConvTranspose2d(a, b, 2, stride=2), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _loss(recipe: BackboneRecipe, net: ConvNet, head: nn.Module, x: torch.Tensor, y: torch.Tensor,
          gen: torch.Generator) -> tuple[torch.Tensor, float]:
    """The objective's loss on a batch and its monitored score (accuracy, or reconstruction MSE)."""
    if recipe.objective == "rotation":
        x, y = rotate_batch(x, gen)
    out = head(net.layers(x)[-1])
    if recipe.objective == "autoencoder":
        loss = F.mse_loss(out, x)
        return loss, loss.item()
    return F.cross_entropy(out, y), float((out.argmax(1) == y).float().mean())


def train_backbone(recipe: BackboneRecipe) -> tuple[ConvNet, dict[str, float]]:
    """Train a backbone with its objective (Adam); ``random`` returns the seeded initialisation."""
    with torch.random.fork_rng():
        torch.manual_seed(recipe.seed)
        net, head = ConvNet(recipe.widths), _objective_head(recipe)
    info = {"score": float("nan"), "seconds": 0.0}
    if recipe.objective == "random":
        return net.eval(), info
    start = time.perf_counter()
    data = pretrain_data(recipe.objective, recipe.images, recipe.seed)
    gen = torch.Generator().manual_seed(recipe.seed)
    opt = torch.optim.Adam([*net.parameters(), *head.parameters()], lr=recipe.lr)
    scores: list[float] = []
    for epoch in range(recipe.epochs):
        order = torch.randperm(len(data), generator=gen)
        for i in range(0, len(data), recipe.batch):
            x, y = data.batch(order[i:i + recipe.batch], gen)
            loss, score = _loss(recipe, net, head, x, y, gen)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if epoch == recipe.epochs - 1:
                scores.append(score)
    info.update(score=float(np.mean(scores)), seconds=time.perf_counter() - start)
    return net.eval(), info


def load_or_train(recipe: BackboneRecipe) -> tuple[ConvNet, dict[str, float]]:
    """The backbone of ``recipe`` from ``$FEDSIM_CACHE/combo`` (or trained now and cached); info has ``cached``."""
    if recipe.objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {recipe.objective!r}; known: {', '.join(OBJECTIVES)}")
    if recipe.objective == "random":
        net, info = train_backbone(recipe)
        return net, {**info, "cached": 0.0}
    path = cache_dir() / "combo" / f"{recipe.objective}-{key_of(asdict(recipe), 'combo-backbone-v2')}.pt"

    def build() -> dict:
        trained, info = train_backbone(recipe)
        return {"net": trained.state_dict(), "info": info}

    state, cached = cached_state(path, build)
    net = ConvNet(recipe.widths)
    net.load_state_dict(state["net"])
    return net.eval(), {**state["info"], "cached": float(cached)}


# -- token-grid features ---------------------------------------------------------------------------

def token_grid(fmap: torch.Tensor, grid: int) -> torch.Tensor:
    """(N, D, H, W) → (N, grid², D): average-pool to ``grid × grid`` and flatten the tokens row-major."""
    return F.adaptive_avg_pool2d(fmap, grid).flatten(2).transpose(1, 2)


@torch.no_grad()
def token_features(net: ConvNet, x: torch.Tensor, grid: int, batch: int = 500) -> list[torch.Tensor]:
    """Every tapped layer of ``net`` on ``x`` as token grids: a list of (N, grid², D_l) tensors."""
    net.eval()
    chunks = [[token_grid(m, grid) for m in net.layers(x[i:i + batch])] for i in range(0, len(x), batch)]
    return [torch.cat([c[layer] for c in chunks]).contiguous() for layer in range(len(net.convs))]

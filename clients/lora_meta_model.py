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

A third, :class:`LoraMiniLM` (``arch: minilm``), is the text variant: the offline pretrained MiniLM-L6
encoder (:func:`fedsim.models.minilm.pretrained_encoder`) whose attention ``query`` and ``value``
projections (every layer) become :class:`MultiLoraLinear` banks (pretrained weight and bias copied in),
mean pooling over the non-pad tokens, and a ``MultiLoraLinear`` head (384 → classes) seeded by the
run.  Its *base* — what retraining trains and a round exchanges — is only the wrapped projections'
weights and biases plus the head; every other encoder weight stays at the checkpoint, frozen, and is
neither trained nor exchanged (:meth:`LoraMiniLM.base_state`).  **Deliberate deviation**: the authors'
language experiment retrains the whole RoBERTa-base; a 22.7M-parameter backward pass through every
weight does not fit the 2-core CPU budget, so retraining moves ~1.2M parameters (12 projections + head).
The encoder's dropout (0.1) is switched off (the model always runs the encoder in eval mode), so a
run depends only on its seeds and batches (the authors keep dropout 0.1); LoRA has no alpha/r scale
(scale 1, as the vision ``AdapterLinear``).
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
        self._dp_slot = slot  # what the per-sample gradient of this forward pass needs (register_opacus)
        if slot is None or self.slots == 0:
            return out
        if len(slot) != len(x):
            raise ValueError(f"{len(slot)} slot indices for {len(x)} samples")
        n, s_all = len(x), self.slots
        if n and n % s_all == 0 and torch.equal(slot, torch.arange(s_all).repeat_interleave(n // s_all)):
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
        patches = patches.permute(0, 2, 3, 4, 5, 1)
        patches = patches.reshape(b, patches.shape[1] * patches.shape[2], p * p * c)  # b, n, (p1 p2 c); b may be 0
        z = self.embed(patches, slot)
        for blk in self.blocks:
            z = z + blk.tokens(blk.norm1(z).transpose(1, 2), slot).transpose(1, 2)
            z = z + blk.channels(blk.norm2(z), slot)
        return self.head(self.norm(z).mean(1), slot)


class LoraMiniLM(LoraNet):
    """Pretrained MiniLM-L6 with LoRA banks on attention query/value and on the head (mean pooling).

    ``forward(input_ids, slot)`` takes int64 token ids (n, L) (pad id masked out of attention and
    pooling) and returns logits (n, classes).  Only the wrapped projections and the head are base
    parameters; the rest of the encoder is frozen and outside ``state_dict`` exchanges.
    """

    TARGETS = ("query", "value")

    def __init__(self, num_classes: int, rank: int, slots: int) -> None:
        super().__init__()
        import copy

        from fedsim.models.minilm import pretrained_encoder

        self.bert = copy.deepcopy(pretrained_encoder())
        self.pad_id = int(self.bert.config.pad_token_id or 0)
        for p in self.bert.parameters():
            p.requires_grad_(False)
        self._slot: Tensor | None = None
        names = [n for n, m in self.bert.named_modules()
                 if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in self.TARGETS]
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = self.bert.get_submodule(parent_name)
            old: nn.Linear = getattr(parent, child)
            new = _SlotLoraLinear(self, old.in_features, old.out_features, rank, slots)
            with torch.no_grad():
                new.weight.copy_(old.weight)
                new.bias.copy_(old.bias)
            setattr(parent, child, new)
        self.head = MultiLoraLinear(self.bert.config.hidden_size, num_classes, rank, slots)
        self.reset_adapters()

    def train(self, mode: bool = True) -> "LoraMiniLM":
        super().train(mode)
        self.bert.eval()  # no dropout (see the module doc)
        return self

    def _base_keys(self) -> set[str]:
        wrapped = [n for n, m in self.named_modules() if isinstance(m, MultiLoraLinear)]
        return {f"{n}.{w}" for n in wrapped for w in ("weight", "bias")}

    def base_state(self) -> dict[str, Tensor]:
        """The trainable base only: wrapped query/value weights and biases, head (detached copies)."""
        keys = self._base_keys()
        return {k: v.detach().clone() for k, v in self.state_dict().items() if k in keys}

    def base_parameters(self) -> list[nn.Parameter]:
        keys = self._base_keys()
        return [p for k, p in self.named_parameters() if k in keys]

    def forward(self, x: Tensor, slot: Tensor | None = None) -> Tensor:
        mask = x != self.pad_id
        self._slot = slot
        try:
            hidden = self.bert(input_ids=x, attention_mask=mask.long()).last_hidden_state
        finally:
            self._slot = None
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        return self.head(pooled, slot)


class _SlotLoraLinear(MultiLoraLinear):
    """A ``MultiLoraLinear`` inside the encoder: BERT calls it with the hidden states only, so the
    per-sample slots come from the owning :class:`LoraMiniLM`'s current forward call."""

    def __init__(self, owner: LoraMiniLM, in_features: int, out_features: int, rank: int, slots: int) -> None:
        super().__init__(in_features, out_features, rank, slots)
        object.__setattr__(self, "_owner", owner)  # not a submodule (no cycle in modules())

    def forward(self, x: Tensor, slot: Tensor | None = None) -> Tensor:
        return super().forward(x, self._owner._slot if slot is None else slot)


def _grad_sample(layer: MultiLoraLinear, activations: list[Tensor], backprops: Tensor) -> dict[nn.Parameter, Tensor]:
    """Opacus' per-sample gradients of a :class:`MultiLoraLinear` (DP-SGD, ``clients.lora_meta``).

    Sample ``i`` (input ``x_i``, output gradient ``g_i``, slot ``s_i``): ``W``: ``g_iᵀ x_i``, ``b``: ``Σ g_i``;
    its adapter slot ``s_i`` only: ``B``: ``g_iᵀ (x_i A_sᵀ)``, ``A``: ``(g_i B_s)ᵀ x_i`` (every other slot 0).
    Sums run over any middle dimensions (patches, tokens), as Opacus' ``nn.Linear`` sampler does.
    """
    x = activations[0].to(backprops.dtype)
    g = backprops
    out: dict[nn.Parameter, Tensor] = {}
    if layer.weight.requires_grad:
        out[layer.weight] = torch.einsum("n...o,n...i->noi", g, x)
    if layer.bias.requires_grad:
        out[layer.bias] = torch.einsum("n...o->no", g)
    n = len(x)
    slot = getattr(layer, "_dp_slot", None)
    if layer.lora_a.requires_grad or layer.lora_b.requires_grad:
        ga = torch.zeros((n, *layer.lora_a.shape), dtype=g.dtype)
        gb = torch.zeros((n, *layer.lora_b.shape), dtype=g.dtype)
        if slot is not None and layer.slots > 0 and n:
            a, b = layer.lora_a[slot].detach(), layer.lora_b[slot].detach()  # (n, k, in), (n, out, k)
            h = torch.einsum("n...i,nki->n...k", x, a)
            rows = torch.arange(n)
            gb[rows, slot] = torch.einsum("n...o,n...k->nok", g, h)
            ga[rows, slot] = torch.einsum("n...k,n...i->nki", torch.einsum("n...o,nok->n...k", g, b), x)
        if layer.lora_a.requires_grad:
            out[layer.lora_a] = ga
        if layer.lora_b.requires_grad:
            out[layer.lora_b] = gb
    return out


def register_opacus() -> None:
    """Teach Opacus (hooks mode) the per-sample gradients of the adapter banks (idempotent)."""
    from opacus.grad_sample import register_grad_sampler

    register_grad_sampler([MultiLoraLinear, _SlotLoraLinear])(_grad_sample)


def build(arch: str, image_shape: tuple[int, ...], num_classes: int, rank: int, slots: int, seed: int,
          hidden: list[int], patch: int, dim: int, depth: int) -> LoraNet:
    """A network whose base is drawn from ``seed`` (adapters: reset them with their own seeds).

    ``arch: minilm`` ignores ``image_shape`` (token ids of any length ≤ 512), ``hidden``, ``patch``,
    ``dim`` and ``depth``; its base is the pretrained checkpoint plus a head drawn from ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if arch == "minilm":
            return LoraMiniLM(num_classes, rank, slots)
        if arch == "mixer":
            return LoraMixer(image_shape, patch, dim, depth, 4.0, 0.5, num_classes, rank, slots)
        return LoraMLP(int(math.prod(image_shape)), hidden, num_classes, rank, slots)

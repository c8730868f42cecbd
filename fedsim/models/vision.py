"""MLP, small CNN and VGG-style classifiers for the offline image and tabular sets."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from fedsim.errors import ConfigError
from fedsim.registry import MODELS


@dataclass
class MLPParams:
    hidden: list[int] = field(default_factory=lambda: [128])
    dropout: float = 0.0


NORMS = ("none", "batch", "layer")


@dataclass
class CNNParams:
    channels: list[int] = field(default_factory=lambda: [16, 32])
    hidden: int = 64
    dropout: float = 0.0
    # after each conv: "none", "batch" (BatchNorm; made GroupNorm under DP-SGD) or "layer" (LayerNorm over
    # (C, H, W) as GroupNorm(1, C): per-example, the "ViT-like" source model of the test-time regimes)
    norm: str = "none"


@MODELS.register("mlp", params=MLPParams, summary="multi-layer perceptron on flattened inputs")
def build_mlp(params: MLPParams, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if any(h < 1 for h in params.hidden):
        raise ConfigError(f"model.params.hidden: layer widths must be >= 1, got {params.hidden}")
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in params.hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        if params.dropout > 0:
            layers.append(nn.Dropout(params.dropout))
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


class SmallCNN(nn.Module):
    """Conv(3x3)-ReLU-MaxPool blocks, then a hidden linear layer and the classifier."""

    def __init__(self, params: CNNParams, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ConfigError(f"model 'cnn' needs image inputs (C, H, W), got shape {input_shape}; use model.name=mlp")
        if params.norm not in NORMS:
            raise ConfigError(f"model.params.norm must be one of {list(NORMS)}, got {params.norm!r}")
        c, h, w = input_shape
        blocks: list[nn.Module] = []
        for out in params.channels:
            blocks.append(nn.Conv2d(c, out, 3, padding=1))
            if params.norm == "batch":
                blocks.append(nn.BatchNorm2d(out))
            elif params.norm == "layer":
                blocks.append(nn.GroupNorm(1, out))
            blocks.append(nn.ReLU())
            if min(h, w) >= 2:
                blocks.append(nn.MaxPool2d(2))
                h, w = h // 2, w // 2
            c = out
        self.features = nn.Sequential(*blocks)
        head: list[nn.Module] = [nn.Flatten(), nn.Linear(c * h * w, params.hidden), nn.ReLU()]
        if params.dropout > 0:
            head.append(nn.Dropout(params.dropout))
        head.append(nn.Linear(params.hidden, num_classes))
        self.classifier = nn.Sequential(*head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@MODELS.register("cnn", params=CNNParams, summary="small convolutional network for image inputs")
def build_cnn(params: CNNParams, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return SmallCNN(params, input_shape, num_classes)


#: VGG-11's conv widths ("M" = 2x2 max-pool), scaled by ``VGGParams.width``.
VGG11 = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")
VGG_NORMS = ("none", "group")


@dataclass
class VGGParams:
    width: float = 1.0  # multiplies every conv width (0.125 -> 8-16-32-64-64 filters)
    norm: str = "none"  # after each conv: "none" or "group" (GroupNorm, per-example: Opacus-compatible)
    groups: int = 8  # GroupNorm groups (capped at, and made a divisor of, each layer's width)
    hidden: int = 512  # the two hidden linear layers of the classifier (0: one linear layer)
    dropout: float = 0.0


def _group_count(groups: int, channels: int) -> int:
    """The largest divisor of ``channels`` that is <= ``groups``."""
    g = max(1, min(groups, channels))
    while channels % g:
        g -= 1
    return g


class VGG(nn.Module):
    """VGG-11 layout for 32x32 inputs: 8 conv 3x3 layers in 5 pooled stages, then the classifier."""

    def __init__(self, params: VGGParams, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        _check_vgg(params, input_shape)
        c, h, _ = input_shape
        blocks: list[nn.Module] = []
        for item in VGG11:
            if item == "M":
                blocks.append(nn.MaxPool2d(2))
                h //= 2
                continue
            out = max(1, int(round(int(item) * params.width)))
            blocks.append(nn.Conv2d(c, out, 3, padding=1))
            if params.norm == "group":
                blocks.append(nn.GroupNorm(_group_count(params.groups, out), out))
            blocks.append(nn.ReLU())
            c = out
        self.features = nn.Sequential(*blocks)
        head: list[nn.Module] = [nn.Flatten()]
        width = c * h * h
        for _ in range(2 if params.hidden else 0):
            head += [nn.Linear(width, params.hidden), nn.ReLU()]
            if params.dropout > 0:
                head.append(nn.Dropout(params.dropout))
            width = params.hidden
        head.append(nn.Linear(width, num_classes))
        self.classifier = nn.Sequential(*head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _check_vgg(params: VGGParams, input_shape: tuple[int, ...]) -> None:
    """ConfigError naming the offending key for a bad width/norm or a non-32x32-style input."""
    if len(input_shape) != 3 or input_shape[1] != input_shape[2] or input_shape[1] < 32:
        raise ConfigError(f"model 'vgg' needs square image inputs (C, H, W) of at least 32x32, got shape {input_shape}")
    if params.width <= 0:
        raise ConfigError(f"model.params.width must be > 0, got {params.width}")
    if params.norm not in VGG_NORMS:
        raise ConfigError(f"model.params.norm must be one of {list(VGG_NORMS)}, got {params.norm!r}")
    if params.groups < 1 or params.hidden < 0:
        raise ConfigError(f"model.params.groups must be >= 1 and hidden >= 0, got {params.groups} and {params.hidden}")


@MODELS.register("vgg", params=VGGParams, summary="VGG-11-style CNN for 32x32 images (width multiplier, GroupNorm or none)")
def build_vgg(params: VGGParams, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return VGG(params, input_shape, num_classes)


def build_model(name: str, params: dict | None, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build a registered model from its name and raw params mapping (validated here)."""
    typed = MODELS.params(name, params, "model.params")
    return MODELS.get(name)(typed, tuple(input_shape), num_classes)

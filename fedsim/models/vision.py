"""MLP and small CNN classifiers for the offline image and tabular sets."""

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


def build_model(name: str, params: dict | None, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build a registered model from its name and raw params mapping (validated here)."""
    typed = MODELS.params(name, params, "model.params")
    return MODELS.get(name)(typed, tuple(input_shape), num_classes)

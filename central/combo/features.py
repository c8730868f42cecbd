"""Cached, standardised token-grid features of every (task, backbone): extracted once, used by every method.

No method backpropagates through a backbone: each backbone runs once over a task's images
(:func:`central.combo.backbones.token_features`), and ComBo, its top-k retrain and the linear probes all
read the same cached tensors.  Each (backbone, layer) map is standardised channel-wise with the mean
and standard deviation of the task's *training* features (over examples and tokens), so the random
backbone and the trained ones enter the heads on the same scale — otherwise the norm of a backbone's
projection would measure its feature scale, not its relevance.  The bank runs the image CNNs itself;
the text setting hands it an ``extract(name, inputs)`` callable (:class:`central.combo.text.TextExtractor`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from central.combo.backbones import ConvNet, token_features
from central.combo.tasks import TaskData

#: Layer maps = a list over layers of (N, T, D_l) tensors; a feature set = a list of those over backbones.
LayerMaps = list[torch.Tensor]


@dataclass
class TaskFeatures:
    """One task's features: ``train[k][l]`` / ``test[k][l]`` for backbone k, layer l, (N, T, D_l)."""

    names: list[str]
    train: list[LayerMaps]
    test: list[LayerMaps]

    def select(self, names: list[str]) -> "TaskFeatures":
        """The features of the backbones ``names`` (in that order)."""
        idx = [self.names.index(n) for n in names]
        return TaskFeatures(list(names), [self.train[i] for i in idx], [self.test[i] for i in idx])


def standardise(train: torch.Tensor, test: torch.Tensor, rel_eps: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel-wise (last axis) standardisation of both sets with the training mean and std.

    A channel's std is floored at ``rel_eps`` × the layer's largest channel std, so near-constant
    channels are not blown up; constant (dead ReLU) channels become exactly 0.
    """
    flat = train.reshape(-1, train.shape[-1])
    mean, std = flat.mean(0), flat.std(0)
    std = std.clamp_min(rel_eps * float(std.max()) if float(std.max()) > 0 else 1.0)
    return (train - mean) / std, (test - mean) / std


class FeatureBank:
    """Extracts each (task, backbone) once and hands out the cached, standardised token grids."""

    def __init__(self, backbones: dict[str, Any], grid: int, batch: int = 500,
                 extract: Callable[[str, torch.Tensor], LayerMaps] | None = None) -> None:
        """``backbones``: name -> :class:`ConvNet`, or anything when ``extract(name, inputs)`` gives the maps."""
        self.backbones = backbones
        self.grid = grid
        self.batch = batch
        self.extract = extract or self._conv_maps
        self.extractions = 0  # backbone forward passes over a task (each (task, backbone) at most once)
        self._cache: dict[tuple[str, str], tuple[LayerMaps, LayerMaps]] = {}

    def _maps(self, task: TaskData, name: str) -> tuple[LayerMaps, LayerMaps]:
        key = (task.name, name)
        if key not in self._cache:
            both = self.extract(name, torch.cat([task.x_train, task.x_test]))
            n = len(task.x_train)
            pairs = [standardise(m[:n], m[n:]) for m in both]
            self._cache[key] = ([p[0] for p in pairs], [p[1] for p in pairs])
            self.extractions += 1
        return self._cache[key]

    def _conv_maps(self, name: str, x: torch.Tensor) -> LayerMaps:
        net: ConvNet = self.backbones[name]
        return token_features(net, x, self.grid, self.batch)

    def features(self, task: TaskData, names: list[str] | None = None) -> TaskFeatures:
        names = list(self.backbones) if names is None else list(names)
        maps = [self._maps(task, n) for n in names]
        return TaskFeatures(names, [m[0] for m in maps], [m[1] for m in maps])

    def drop(self, task_name: str) -> None:
        """Free a finished task's features."""
        for key in [k for k in self._cache if k[0] == task_name]:
            del self._cache[key]

"""FedPhoenix's stochastic filter reset (Tian et al., NeurIPS 2025): the maths its strategy and learner share.

``strategies.fedphoenix`` sends the reset schedule in each round's config (the keys of
:mod:`fedsim.contracts.wire`); the learner applies :func:`phoenix_reset` to its copy of the received
global model through the model-transform contract (:mod:`fedsim.contracts.transforms`), under the
transform name :data:`~fedsim.contracts.wire.PHOENIX`.  Both sides import this module, never each
other.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

from fedsim.contracts.transforms import register_transform
from fedsim.contracts.wire import (PHOENIX, PHOENIX_DISTRIBUTION, PHOENIX_RESET_ROUNDS, PHOENIX_SCALE, PHOENIX_SEED,
                                   PHOENIX_THETA, SERVER_ROUND)

DISTRIBUTIONS = ("normal", "uniform", "kaiming_uniform", "kaiming_normal")


def conv_layers(model: nn.Module) -> list[tuple[str, nn.Conv2d]]:
    """The model's ``Conv2d`` layers in registration order (shallow to deep, as the authors')."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Conv2d)]


def layer_is_reset(depth: int, num_layers: int, server_round: int, reset_rounds: float) -> bool:
    """The stair schedule: conv layer ``depth`` (0-based) is reset in this (1-based) Flower round.

    The authors' loop counts rounds from 0 (``for iter in range(epochs)``) and resets layer d while
    ``iter < (d+1) * r_s / L``.  Flower counts rounds from 1, so ``iter = server_round - 1``.  The
    comparison is written ``iter * L < (d+1) * r_s`` (the same inequality without the division, so
    that an integral r_s is compared exactly).  With r_s = 5 and L = 2: layer 0 is reset in rounds
    1-3 (iter 0, 1, 2 < 2.5), layer 1 in rounds 1-5, nothing from round 6 on.
    """
    return (server_round - 1) * num_layers < (depth + 1) * reset_rounds


def any_layer_reset(server_round: int, reset_rounds: float) -> bool:
    """Whether any layer is reset in this round (the deepest layer stops last, after r_s rounds)."""
    return server_round - 1 < reset_rounds


def _draw(shape: torch.Size, dtype: torch.dtype, distribution: str, mean: float, std: float,
          fan_in: int, scale: float, generator: torch.Generator) -> torch.Tensor:
    if distribution == "normal":  # the authors' default 'ori_normal': N(mu, sigma^2) of the layer
        return torch.randn(shape, generator=generator, dtype=dtype) * (std * scale) + mean
    if distribution == "uniform":  # U(mu - sigma, mu + sigma)
        low, high = mean - std * scale, mean + std * scale
        return torch.rand(shape, generator=generator, dtype=dtype) * (high - low) + low
    if distribution == "kaiming_uniform":
        bound = math.sqrt(6.0 / fan_in) * scale
        return torch.rand(shape, generator=generator, dtype=dtype) * (2 * bound) - bound
    if distribution == "kaiming_normal":
        return torch.randn(shape, generator=generator, dtype=dtype) * (math.sqrt(2.0 / fan_in) * scale)
    raise ValueError(f"unknown reset distribution {distribution!r}; choose one of {', '.join(DISTRIBUTIONS)}")


@torch.no_grad()
def phoenix_reset(
    model: nn.Module,
    *,
    server_round: int,
    theta: float,
    reset_rounds: float,
    generator: torch.Generator,
    distribution: str = "normal",
    scale: float = 1.0,
) -> dict[str, list[int]]:
    """FedPhoenix's reset of one client's copy of the global model, in place.

    For each ``Conv2d`` (registration order, depth d = 0..L-1) that the stair schedule still resets
    in ``server_round`` (:func:`layer_is_reset`), ``floor(theta * out_channels)`` output filters
    (rows ``weight[i]``) drawn uniformly without replacement are redrawn from ``distribution``,
    whose mean and std are those of the layer's whole current weight tensor, computed before any
    filter is replaced (``torch.std``: unbiased, as the authors').  Conv biases, normalisation
    layers and linear layers are untouched.

    Returns the plan that was carried out: ``{layer name: sorted reset filter indices}`` for every
    scheduled layer (an empty list where ``floor(theta * out_channels) == 0``).
    """
    if not 0.0 <= theta <= 1.0:
        raise ValueError(f"reset ratio theta must be in [0, 1], got {theta}")
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"unknown reset distribution {distribution!r}; choose one of {', '.join(DISTRIBUTIONS)}")
    layers = conv_layers(model)
    plan: dict[str, list[int]] = {}
    for depth, (name, conv) in enumerate(layers):
        if not layer_is_reset(depth, len(layers), server_round, reset_rounds):
            continue
        weight = conv.weight
        out_channels = weight.shape[0]
        k = int(out_channels * theta)
        idx = torch.randperm(out_channels, generator=generator)[:k].sort().values
        plan[name] = idx.tolist()
        if k == 0:
            continue
        mean, std = float(weight.mean()), float(weight.std())
        fan_in = weight[0].numel()  # in_channels/groups * kernel area, as nn.init computes it
        new = _draw(torch.Size((k, *weight.shape[1:])), weight.dtype, distribution, mean, std, fan_in, scale,
                    generator)
        weight[idx] = new.to(weight.device)
    return plan


@register_transform(PHOENIX)
def _phoenix_transform(model: nn.Module, config: Mapping[str, Any]) -> dict[str, float]:
    plan = phoenix_reset(
        model,
        server_round=int(config[SERVER_ROUND]),
        theta=float(config[PHOENIX_THETA]),
        reset_rounds=float(config[PHOENIX_RESET_ROUNDS]),
        generator=torch.Generator().manual_seed(int(config[PHOENIX_SEED])),
        distribution=str(config.get(PHOENIX_DISTRIBUTION, "normal")),
        scale=float(config.get(PHOENIX_SCALE, 1.0)),
    )
    return {"reset_layers": float(len(plan)), "reset_filters": float(sum(len(v) for v in plan.values()))}

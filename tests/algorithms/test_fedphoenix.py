"""FedPhoenix's filter reset (algorithms/fedphoenix.py, applied through fedsim.contracts.transforms): exactly the planned filters of exactly the
scheduled layers change, drawn as the authors draw them, reproducibly from a seed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from algorithms.fedphoenix import conv_layers, layer_is_reset, phoenix_reset
from fedsim.contracts.transforms import apply_transforms
from fedsim.contracts.wire import PHOENIX, PHOENIX_RESET_ROUNDS, PHOENIX_SEED, PHOENIX_THETA, TRANSFORM_KEY


def net() -> nn.Module:
    """Three convs (16, 32, 64 filters) with BatchNorm, plus linear layers: L = 3."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.Sequential(nn.Conv2d(32, 64, 3, padding=1), nn.ReLU()),  # nested: registration order still counts
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 20), nn.Linear(20, 10),
    )


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reset(model: nn.Module, server_round: int, seed: int = 1, **kw) -> dict[str, list[int]]:
    kw.setdefault("theta", 0.25)
    kw.setdefault("reset_rounds", 3)
    return phoenix_reset(model, server_round=server_round, generator=torch.Generator().manual_seed(seed), **kw)


def changed_rows(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """Per state-dict key, the indices along dim 0 whose values changed."""
    out = {}
    for k, v in before.items():
        diff = (after[k] != v).reshape(v.shape[0], -1).any(1) if v.dim() else (after[k] != v).reshape(1)
        if diff.any():
            out[k] = diff.nonzero().flatten().tolist()
    return out


def test_stair_schedule_maps_flower_rounds_to_the_authors_0_based_rounds() -> None:
    # L = 3, r_s = 3: layer d is reset while (round - 1) < (d+1) * r_s / L = d + 1
    sched = {r: [d for d in range(3) if layer_is_reset(d, 3, r, 3)] for r in range(1, 6)}
    assert sched == {1: [0, 1, 2], 2: [1, 2], 3: [2], 4: [], 5: []}
    # the authors' defaults: r_s = 1000 of 1200, L = 2 -> layer 0 until round 500, layer 1 until 1000
    assert layer_is_reset(0, 2, 500, 1000) and not layer_is_reset(0, 2, 501, 1000)
    assert layer_is_reset(1, 2, 1000, 1000) and not layer_is_reset(1, 2, 1001, 1000)
    # a fractional r_s (5/6 of 10 rounds = 8.33): the deepest layer is reset while round - 1 < 8.33
    assert [r for r in range(1, 11) if layer_is_reset(1, 2, r, 10 * 5 / 6)] == list(range(1, 10))


@pytest.mark.parametrize("server_round, scheduled", [(1, ["0", "3", "5.0"]), (2, ["3", "5.0"]), (3, ["5.0"]), (4, [])])
def test_reset_touches_exactly_the_planned_filters_of_the_scheduled_layers(server_round, scheduled) -> None:
    model = net()
    before = snapshot(model)
    plan = reset(model, server_round)
    assert sorted(plan) == scheduled
    widths = {name: conv.out_channels for name, conv in conv_layers(model)}
    for name, idx in plan.items():
        assert len(idx) == int(widths[name] * 0.25) and len(set(idx)) == len(idx)  # floor(θ·out), distinct
    # what changed is exactly the planned rows of the planned conv weights: no bias, BN, Linear, other rows
    assert changed_rows(before, snapshot(model)) == {f"{name}.weight": idx for name, idx in plan.items()}


def test_reset_values_follow_the_layer_statistics() -> None:
    conv = nn.Conv2d(64, 512, 3)
    with torch.no_grad():
        conv.weight.normal_(0.3, 0.05, generator=torch.Generator().manual_seed(0))
    mean, std = float(conv.weight.detach().mean()), float(conv.weight.detach().std())
    model = nn.Sequential(conv)
    plan = reset(model, 1, theta=0.5, reset_rounds=1)
    new = conv.weight.detach()[plan["0"]]
    assert new.numel() == 256 * 64 * 9
    assert abs(float(new.mean()) - mean) < 0.002 and abs(float(new.std()) - std) < 0.002
    # uniform(μ±σ) option: bounded by μ±σ of the layer
    with torch.no_grad():
        conv.weight.normal_(0.3, 0.05, generator=torch.Generator().manual_seed(0))
    mean, std = float(conv.weight.detach().mean()), float(conv.weight.detach().std())
    plan = reset(model, 1, theta=0.5, reset_rounds=1, distribution="uniform")
    new = conv.weight.detach()[plan["0"]]
    assert float(new.min()) >= mean - std - 1e-6 and float(new.max()) <= mean + std + 1e-6
    assert abs(float(new.std()) - 2 * std / 12 ** 0.5) < 0.002


def test_same_seed_same_reset_different_seed_different_reset() -> None:
    a, b, c = net(), net(), net()
    plan_a, plan_b, plan_c = reset(a, 1, seed=11), reset(b, 1, seed=11), reset(c, 1, seed=12)
    assert plan_a == plan_b
    assert all(torch.equal(v, snapshot(b)[k]) for k, v in snapshot(a).items())
    assert plan_a != plan_c
    assert not torch.equal(a[0].weight, c[0].weight)


def test_theta_too_small_resets_nothing() -> None:
    model = net()
    before = snapshot(model)
    plan = reset(model, 1, theta=1 / 64)  # floor(16/64) = floor(32/64) = 0, floor(64/64) = 1
    assert [len(v) for v in plan.values()] == [0, 0, 1]
    assert changed_rows(before, snapshot(model)) == {"5.0.weight": plan["5.0"]}


def test_apply_transforms_reads_the_round_config() -> None:
    model = net()
    before = snapshot(model)
    assert apply_transforms(model, {"server-round": 1}) == {}  # no "transform" key: nothing happens
    assert changed_rows(before, snapshot(model)) == {}
    config = {TRANSFORM_KEY: PHOENIX, "server-round": 2, PHOENIX_SEED: 5, PHOENIX_THETA: 0.25,
              PHOENIX_RESET_ROUNDS: 3.0}
    metrics = apply_transforms(model, config)
    assert metrics == {"reset_layers": 2.0, "reset_filters": 8.0 + 16.0}
    again = net()
    reset(again, 2, seed=5)  # the config path is phoenix_reset with a generator seeded by the config
    assert all(torch.equal(v, snapshot(again)[k]) for k, v in snapshot(model).items())
    with pytest.raises(ValueError, match="unknown model transform"):
        apply_transforms(model, {TRANSFORM_KEY: "nope"})

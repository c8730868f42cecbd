"""FedMut (strategies/fedmut.py): per-client mutated copies w_t + alpha*c*(w_t - w_{t-1}), balanced
around w_t, the plain global model in round 1, FedAvg aggregation."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedsim.engine.local import InProcessGrid, server_identity
from fedsim.engine.runtime import RunSpec, build_client_app, get_learner
from fedsim.engine.server import build_strategy
from fedsim.runner import run_experiment
from strategies.fedmut import mutation_coefficients
from tests.strategies.util import one_round, tiny_cfg


def test_coefficients_are_balanced_per_tensor() -> None:
    rng = np.random.default_rng(0)
    c = mutation_coefficients(50, 6, 0.3, rng)
    for row in c:
        assert sorted(row.tolist()) == [-0.7] * 3 + [1.0] * 3
    assert len({tuple(row) for row in c}) > 1  # arrangements differ between tensors
    odd = mutation_coefficients(20, 5, 0.0, rng)
    assert (odd[:, 4] == 0).all() and (odd[:, :4].sum(1) == 0).all()  # m odd: last client unmutated


def test_acceleration_decays_to_zero() -> None:
    s = build_strategy(RunSpec.from_config(tiny_cfg("fedmut", "strategy.params.acc_bound=10")))
    assert [round(s.acceleration(r), 6) for r in (2, 7, 12, 30)] == [0.3, 0.15, 0.0, 0.0]


def sent_states(strategy, server_round, arrays, grid):
    msgs = list(strategy.configure_train(server_round, arrays, ConfigRecord({}), grid))
    return [m.content["arrays"].to_torch_state_dict() for m in msgs]


@pytest.mark.parametrize("clients", [4, 3])
def test_round_one_is_plain_then_copies_spread_around_the_global_model(clients: int) -> None:
    alpha = 2.0
    cfg = tiny_cfg("fedmut", "strategy.fraction_train=1.0", f"strategy.params.alpha={alpha}",
                   "strategy.params.acc_rate=0.0", rounds=2, clients=clients)
    spec = RunSpec.from_config(cfg)
    strategy = build_strategy(spec)
    grid = InProcessGrid(build_client_app(spec), clients)
    with server_identity(1):
        w0 = get_learner(spec).init_arrays()
        random.seed(0)
        first = sent_states(strategy, 1, ArrayRecord(w0), grid)
        assert all(torch.equal(sd[k], w0[k]) for sd in first for k in w0)  # no previous global yet
        w1 = one_round(strategy, 1, ArrayRecord(w0), grid, cfg.seed)
        second = sent_states(strategy, 2, w1, grid)
    g = w1.to_torch_state_dict()
    assert len(second) == clients
    for k in g:
        delta = alpha * (g[k] - w0[k])
        if not delta.abs().sum():
            continue
        diffs = [sd[k] - g[k] for sd in second]
        signs = []
        for d in diffs:  # every copy is w_t + s * alpha * (w_t - w_{t-1}) with s in {+1, -1, 0}
            s = [s for s in (1, -1, 0) if torch.allclose(d, s * delta, atol=1e-6)]
            assert len(s) == 1, k
            signs.append(s[0])
        assert sorted(signs) == sorted([1, -1] * (clients // 2) + [0] * (clients % 2))
        mean = torch.stack([sd[k] for sd in second]).mean(0)
        assert torch.allclose(mean, g[k], atol=1e-6)  # balanced: the mean of the copies is w_t
    # the copies differ from one another
    assert any(not torch.equal(second[0][k], second[1][k]) for k in g)


def test_acceleration_shifts_the_mean_forward() -> None:
    cfg = tiny_cfg("fedmut", "strategy.fraction_train=1.0", "strategy.params.alpha=1.0",
                   "strategy.params.acc_rate=0.5", rounds=2, clients=4)
    spec = RunSpec.from_config(cfg)
    strategy = build_strategy(spec)
    grid = InProcessGrid(build_client_app(spec), 4)
    with server_identity(1):
        w0 = get_learner(spec).init_arrays()
        w1 = one_round(strategy, 1, ArrayRecord(w0), grid, cfg.seed)
        second = sent_states(strategy, 2, w1, grid)
    g = w1.to_torch_state_dict()
    for k in g:  # mean of {+1, +1, -0.5, -0.5} * delta = 0.25 * delta
        mean = torch.stack([sd[k] for sd in second]).mean(0)
        assert torch.allclose(mean, g[k] + 0.25 * (g[k] - w0[k]), atol=1e-6)


def test_fedmut_runs_and_is_reproducible() -> None:
    a = run_experiment(tiny_cfg("fedmut", rounds=3)).history.as_rows()
    b = run_experiment(tiny_cfg("fedmut", rounds=3)).history.as_rows()
    fedavg = run_experiment(tiny_cfg("fedavg", rounds=3)).history.as_rows()
    assert a == b
    assert a[1] == fedavg[1] and a[2] != fedavg[2]  # round 1 is FedAvg, mutations start in round 2

"""The supervised learner's two round-config hooks: FedProx's proximal term and model transforms."""

from __future__ import annotations

import torch
from torch import nn

from fedsim.contracts.learner import NodeContext
from fedsim.contracts.wire import PROXIMAL_MU
from clients.supervised import SupervisedLearner, SupervisedParams, proximal_term
from fedsim.contracts.wire import PHOENIX, PHOENIX_RESET_ROUNDS, PHOENIX_SEED, PHOENIX_THETA, TRANSFORM_KEY
from fedsim import config as C


def test_proximal_term_value_and_gradient() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    anchor = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        model.weight.add_(torch.tensor([[1.0, 0.0, -2.0], [0.5, 0.0, 0.0]]))
        model.bias.add_(torch.tensor([0.0, 3.0]))
    mu = 0.2
    term = proximal_term(model, anchor, mu)
    assert torch.isclose(term, torch.tensor(mu / 2 * (1 + 4 + 0.25 + 9)))
    term.backward()
    for p, a in zip(model.parameters(), anchor):
        assert torch.allclose(p.grad, mu * (p.detach() - a))  # d/dw (mu/2)||w - w_g||^2 = mu (w - w_g)


def learner(*overrides: str) -> SupervisedLearner:
    cfg = C.load_config("fedavg_digits", ["model.name=cnn", "model.params={channels: [8, 16], hidden: 16}",
                                          "client.local_steps=3", "data.partition.name=iid", *overrides], {"clients": 4})
    return SupervisedLearner(cfg, SupervisedParams())


def ctx(config: dict) -> NodeContext:
    return NodeContext(partition_id=1, num_partitions=4, server_round=1, root_seed=0,
                       config={"server-round": 1, **config})


def test_learner_adds_the_proximal_term_only_when_asked() -> None:
    lrn = learner()
    init = lrn.init_arrays()
    plain = lrn.train(init, ctx({})).arrays
    zero = lrn.train(init, ctx({PROXIMAL_MU: 0.0})).arrays
    strong = lrn.train(init, ctx({PROXIMAL_MU: 10.0})).arrays
    assert all(torch.equal(plain[k], zero[k]) for k in plain)  # mu = 0: exactly the plain update
    assert any(not torch.equal(plain[k], strong[k]) for k in plain)
    # a strong proximal term keeps the model closer to where it started
    dist = lambda sd: sum(float(((sd[k] - init[k]) ** 2).sum()) for k in init)  # noqa: E731
    assert dist(strong) < dist(plain)


def test_learner_applies_the_transform_before_training() -> None:
    lrn = learner()
    init = lrn.init_arrays()
    cfg = {TRANSFORM_KEY: PHOENIX, PHOENIX_SEED: 3, PHOENIX_THETA: 0.25, PHOENIX_RESET_ROUNDS: 2.0}
    res = lrn.train(init, ctx(cfg))
    assert res.metrics["reset_layers"] == 2.0 and res.metrics["reset_filters"] == 2.0 + 4.0
    assert any(not torch.equal(res.arrays[k], lrn.train(init, ctx({})).arrays[k]) for k in init)
    again = lrn.train(init, ctx(cfg)).arrays
    assert all(torch.equal(res.arrays[k], again[k]) for k in init)  # the seed in the config reproduces it

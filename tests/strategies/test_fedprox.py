"""FedProx (strategies/fedprox.py): Flower's strategy sends "proximal-mu", the learner adds the term."""

from __future__ import annotations

import random

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedsim.engine.local import server_identity
from fedsim.engine.runtime import RunSpec
from fedsim.engine.server import build_strategy
from fedsim.errors import ConfigError
from fedsim.runner import run_experiment
from tests.strategies.util import StubGrid, tiny_cfg


def test_messages_carry_proximal_mu() -> None:
    strategy = build_strategy(RunSpec.from_config(tiny_cfg("fedprox", "strategy.params.mu=0.25")))
    random.seed(0)
    with server_identity(1):
        msgs = list(strategy.configure_train(1, ArrayRecord({"w": torch.zeros(1)}), ConfigRecord({}),
                                             StubGrid([1, 2, 3, 4])))
    assert [float(m.content["config"]["proximal-mu"]) for m in msgs] == [0.25] * len(msgs)


def test_mu_zero_is_fedavg_exactly_and_mu_positive_differs() -> None:
    fedavg = run_experiment(tiny_cfg("fedavg", rounds=2)).history.as_rows()
    zero = run_experiment(tiny_cfg("fedprox", "strategy.params.mu=0.0", rounds=2)).history.as_rows()
    prox = run_experiment(tiny_cfg("fedprox", "strategy.params.mu=1.0", rounds=2)).history.as_rows()
    assert zero == fedavg
    assert prox != fedavg
    assert prox[1]["train/loss"] > fedavg[1]["train/loss"]  # the reported objective includes the term


def test_negative_mu_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="mu"):
        build_strategy(RunSpec.from_config(tiny_cfg("fedprox", "strategy.params.mu=-1")))

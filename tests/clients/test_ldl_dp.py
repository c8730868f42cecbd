"""The semi-supervised LDL learner under sample-level DP-SGD (--eps): per-example loss, ledger metrics
equal to the accountant's, seeded, different from the non-DP run, end to end; refusing learners say why."""

from __future__ import annotations

import pytest
import torch
from flwr.app import RecordDict

from clients.ldl.augment import augment_for
from clients.ldl.methods import RECIPES, Weights, per_example_loss
from fedsim.contracts.learner import NodeContext
from fedsim.engine.runtime import RunSpec, check_learner, get_learner
from fedsim.errors import ConfigError
from fedsim import config as C
from fedsim.runner import run_experiment
from privacy.accounting import epsilon_for
from privacy.ledger import CLIENT_EPSILON, NOISE, SAMPLE_RATE, STEPS
from tests.clients.test_ldl_learner import cfg_of

DP = ["privacy.enabled=true", "privacy.epsilon=3"]


def _learner(*overrides: str, clients: int = 1):
    learner = get_learner(RunSpec.from_config(cfg_of(*DP, *overrides, clients=clients)))
    learner.preflight()
    return learner


def _train(*overrides: str, clients: int = 1, pid: int = 0):
    learner = _learner(*overrides, clients=clients)
    return learner, learner.train(learner.init_arrays(), NodeContext(pid, clients, 1, 0, state=RecordDict()))


def test_per_example_loss_does_not_couple_rows() -> None:
    """A row's term is the same in any batch (given the same augmentation draws): rankmatch's ranking is over labels."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    x, d = torch.randn(6, 4), torch.softmax(torch.randn(6, 3), 1)
    lab = torch.tensor([True, True, False, False, False, True])
    aug = augment_for(x.numpy())
    aug.params.weak_noise = aug.params.strong_noise = 0.0  # deterministic views
    w = Weights(views=2)
    per, _ = per_example_loss(model, x, d, lab, RECIPES["rankmatch"], w, aug, torch.Generator().manual_seed(0))
    for i in range(6):
        one, _ = per_example_loss(model, x[i:i + 1], d[i:i + 1], lab[i:i + 1], RECIPES["rankmatch"], w, aug,
                                  torch.Generator().manual_seed(0))
        assert torch.allclose(one[0], per[i], atol=1e-6)


@pytest.mark.parametrize("method", ["rankmatch", "pseudo_label", "supervised"])
def test_dp_round_reports_the_accountants_epsilon(method: str) -> None:
    learner, result = _train(f"client.params.method={method}")
    plan, m, p = learner.privacy_plan(0), result.metrics, learner.cfg.privacy
    assert m[STEPS] == plan.steps_per_round == 3 and m[SAMPLE_RATE] == plan.accounting_rate
    assert m[NOISE] == plan.noise_multiplier
    assert m[CLIENT_EPSILON] == epsilon_for(plan.noise_multiplier, plan.accounting_rate, 3, p.delta, p.accountant)
    assert 0 < m[CLIENT_EPSILON] <= 3.0


def test_dp_is_seeded_and_differs_from_plain_training() -> None:
    _, a = _train()
    _, b = _train()
    assert a.metrics == b.metrics and all(torch.equal(v, b.arrays[k]) for k, v in a.arrays.items())
    plain = get_learner(RunSpec.from_config(cfg_of()))
    plain.preflight()
    c = plain.train(plain.init_arrays(), NodeContext(0, 1, 1, 0, state=RecordDict()))
    assert STEPS not in c.metrics
    assert any(not torch.equal(v, c.arrays[k]) for k, v in a.arrays.items())


def test_supervised_unlabelled_only_node_has_an_empty_plan() -> None:
    learner = _learner("client.params.method=supervised", "client.params.labelled_clients=1", clients=2)
    assert learner.privacy_plan(1).steps_per_round == 0
    result = learner.train(learner.init_arrays(), NodeContext(1, 2, 1, 0, state=RecordDict()))
    assert result.num_examples == 0 and STEPS not in result.metrics


def test_end_to_end_run_stays_within_epsilon() -> None:
    final = run_experiment(cfg_of(*DP, rounds=2, clients=2)).history.final()
    assert 0 < final["privacy/epsilon_max"] <= 3.0
    assert "eval/kl" in final and "eval/pseudo_kl" not in final  # the server does not read the nodes' rows


@pytest.mark.parametrize("experiment", ["imgda", "lcotta"])
def test_learners_without_dp_refuse_eps_with_their_reason(experiment: str) -> None:
    cfg = C.load_config(experiment, ["privacy.enabled=true", "privacy.epsilon=3"])
    with pytest.raises(ConfigError, match="has no differential privacy \\(.+\\)"):
        check_learner(cfg)

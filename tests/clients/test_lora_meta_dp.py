"""The LoRA-ML learner under sample-level DP-SGD (--eps): the adapters' per-sample gradients, ledger
metrics equal to the accountant's, seeded, different from the non-DP run, reptile's per-task runs, end to end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from flwr.app import RecordDict

from clients.lora_meta_model import build, register_opacus
from fedsim.contracts.learner import NodeContext
from fedsim.runner import run_experiment
from privacy.accounting import epsilon_for
from privacy.facade import DP_STATE
from privacy.ledger import CLIENT_EPSILON, NOISE, SAMPLE_RATE, STEPS
from tests.clients.test_lora_meta import cfg_of, learner_of

DP = ["privacy.enabled=true", "privacy.epsilon=3", "client.params.arch=mlp"]


def _train(*overrides: str, clients: int = 1, pid: int = 0):
    learner = learner_of(*DP, *overrides, clients=clients)
    ctx = NodeContext(pid, clients, 1, 0, state=RecordDict())
    return learner, ctx, learner.train(learner.init_arrays(), ctx)


def test_adapter_grad_sampler_matches_per_example_autograd() -> None:
    """Opacus' per-sample gradients of the LoRA banks (base and only the example's own slot) are exact."""
    from opacus import GradSampleModule

    register_opacus()
    model = build("mixer", (1, 8, 8), 2, 1, 3, seed=0, hidden=[8], patch=4, dim=8, depth=1)
    model.reset_adapters([1, 2, 3])
    with torch.no_grad():
        for q in model.adapter_parameters():
            q.add_(0.1 * torch.randn(q.shape, generator=torch.Generator().manual_seed(4)))
    x, y, slot = torch.randn(5, 1, 8, 8), torch.tensor([0, 1, 1, 0, 1]), torch.tensor([2, 0, 2, 1, 0])
    gsm = GradSampleModule(model, loss_reduction="sum")
    F.cross_entropy(gsm(x, slot), y, reduction="sum").backward()
    named = dict(model.named_parameters())
    per_sample = {name: q.grad_sample.clone() for name, q in named.items()}
    gsm._close()  # plain autograd below
    for i in range(len(y)):
        grads = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1], slot[i:i + 1]), y[i:i + 1], reduction="sum"),
                                    list(named.values()))
        for (name, q), g in zip(named.items(), grads):
            assert torch.allclose(per_sample[name][i], g, atol=1e-5), name


@pytest.mark.parametrize("method", ["lora_ml", "retrain", "reptile"])
def test_dp_round_reports_the_accountants_epsilon(method: str) -> None:
    learner, ctx, result = _train(f"client.params.method={method}")
    plan = learner.privacy_plan(0)
    m, p = result.metrics, learner.cfg.privacy
    assert m[STEPS] == plan.steps_per_round == learner.params.local_steps
    assert m[SAMPLE_RATE] == plan.accounting_rate and m[NOISE] == plan.noise_multiplier
    assert m[CLIENT_EPSILON] == epsilon_for(plan.noise_multiplier, plan.accounting_rate, int(m[STEPS]), p.delta,
                                            p.accountant)
    assert 0 < m[CLIENT_EPSILON] <= 3.0
    assert int(ctx.state[DP_STATE]["steps"]) == plan.steps_per_round  # reptile: one run's steps (disjoint tasks)


def test_dp_is_seeded_and_differs_from_plain_training() -> None:
    _, _, a = _train()
    _, _, b = _train()
    assert a.metrics == b.metrics and all(torch.equal(v, b.arrays[k]) for k, v in a.arrays.items())
    plain = learner_of("client.params.arch=mlp")
    c = plain.train(plain.init_arrays(), NodeContext(0, 1, 1, 0, state=RecordDict()))
    assert STEPS not in c.metrics
    assert any(not torch.equal(v, c.arrays[k]) for k, v in a.arrays.items())


def test_two_nodes_plan_with_their_own_pools() -> None:
    learner = learner_of(*DP, clients=2)
    sizes = [len(learner.tasks[t].y_train) for t in learner.node_tasks(1)]
    assert learner.privacy_plan(1).num_examples == sum(sizes)


def test_end_to_end_run_stays_within_epsilon() -> None:
    cfg = cfg_of(*DP, "client.params.method=lora_ml", rounds=2, clients=2)
    final = run_experiment(cfg).history.final()
    assert 0 < final["privacy/epsilon_max"] <= 3.0
    assert "eval/new_task_acc" in final
